"""The database handle: open/create, commits, group commit, time travel, SQL.

>>> import tempfile, trellisdb
>>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
>>> with db.transaction(message="seed"):
...     s = db.session(task="t1", agent="a")
...     n = s.add_node(id="n1", summary="root")
>>> first = db.log()[-1]["id"]
>>> _ = db.tag("seeded")
>>> with db.session(task="t1", agent="a") as s2:
...     _ = s2.add_node(parents=["n1"], summary="child")
>>> db.sql("SELECT count(*) AS n FROM nodes").to_pylist()
[{'n': 2}]
>>> db.sql("SELECT count(*) AS n FROM nodes", as_of="seeded").to_pylist()
[{'n': 1}]
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import os
import re
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb import usersql
from trellisdb.errors import (
    CommitError,
    CorruptionError,
    DuplicateIdError,
    FormatVersionError,
    NotADatabaseError,
    ReadOnlyError,
    TransactionError,
    TrellisError,
    UnknownCommitError,
    UnknownNodeError,
    UnknownSessionError,
    UnknownTagError,
    ValidationError,
)
from trellisdb.ids import new_id
from trellisdb.names import check_name, check_text, name_problem
from trellisdb.paths import check_root, confined, default_root
from trellisdb.reader import PUBLIC_RELATIONS, SqlEngine
from trellisdb.result import Result
from trellisdb.schema import DATA_TABLES, FORMAT_VERSION
from trellisdb.storage import log as commit_log
from trellisdb.storage import recovery
from trellisdb.storage.lock import WriterLock
from trellisdb.storage.tables import PRUNE_GRACE, LanceTables
from trellisdb.vectors import TARGETS, TEXT_COLUMN, IndexMaintainer, Space, SpaceRegistry, as_matrix
from trellisdb.writer import Batch, SessionWriter, check_embedding, config_text

if TYPE_CHECKING:
    from trellisdb.embed import Embedder
    from trellisdb.tql.run import QueryResult

#: Seconds between background cleanups of old physical versions (per process).
CLEANUP_INTERVAL = 60.0
#: The longest pause between retries of a failed group commit (the pause doubles from ``commit_delay``).
RETRY_MAX_DELAY = 5.0

MARKER = "trellis.json"
SPACES_FILE = "spaces.json"
DEFAULT_EMBEDDING_DIM = 384
AsOf = int | str | dt.datetime | None

_open_dbs: weakref.WeakSet[Database] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:  # a clean interpreter exit loses nothing pending
    for db in list(_open_dbs):
        with contextlib.suppress(Exception):  # exiting: nothing to report to
            db.close()


def connect(
    path: str | os.PathLike[str],
    *,
    embedding_dim: int | None = None,
    commit_delay: float = 0.05,
    max_batch_rows: int = 10_000,
    auto_compact: bool = True,
    compact_fragments: int = 8,
    create: bool = True,
    mirror: bool = True,
    auto_index: bool = True,
    keep_memory: int | None = None,
    read_only: bool = False,
    export_root: str | os.PathLike[str] | None = None,
) -> Database:
    """Open the database in folder ``path``, creating it if needed.

    ``read_only=True`` opens an existing database for reading only: every write,
    tag, view change, export and maintenance call raises ``ReadOnlyError``, and
    nothing in the folder is created or changed (raw SQL is read-only on every
    handle). ``export_root`` is the folder that exports named in TQL (``EXPORT
    ... TO 'path'``) and the CLI are written under (default ``<path>/exports``):
    a query can name a folder inside it, never anything else.

    ``embedding_dim`` is fixed when the database is created (default 384) and
    checked on open. ``commit_delay`` bounds how long a single-call write waits
    to be group-committed; ``flush()`` commits at once. With ``auto_compact``
    each commit runs a size-tiered compaction step: once ``compact_fragments``
    fragments of one size tier pile up in a table they are merged (see
    ``ARCHITECTURE.md``), and old physical versions are cleaned up now and
    then on a background thread.

    With ``mirror`` (the default) queries read an in-memory DuckDB copy of
    every table's narrow columns (all but embeddings and artifact bytes),
    built on the first query (~0.6 s per 100k nodes) and extended per
    commit; it costs about 1 KB of memory per node and makes queries 2-4x
    faster. ``mirror=False`` scans Lance on every query instead: the better
    trade for a short-lived process that asks one question.

    With ``auto_index`` (the default) a commit that takes an embedding space
    past ``trellisdb.vectors.INDEX_MIN_ROWS`` vectors starts building its ANN
    index on a background thread (and later commits refresh it); see
    :meth:`Database.index_status`.

    ``keep_memory`` bounds the bytes of memory DuckDB keeps mapped once it
    has used them, rather than hand them back to the operating system after
    each query and fault them in again for the next (default None: half of
    DuckDB's memory limit, none under Linux's strict overcommit accounting;
    0: hand everything back). Up to that bound the process keeps its peak
    query memory until :meth:`Database.close`; a query right after a large
    one (a refresh after a materialization) runs up to 2x faster for it.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise ValidationError(f"connect takes a folder path, not {type(path).__name__}") from None
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValidationError(f"database path {path!r} must be a non-empty text path without NUL characters")
    check_text(path, "database path")
    return Database(
        path,
        embedding_dim=embedding_dim,
        commit_delay=commit_delay,
        max_batch_rows=max_batch_rows,
        auto_compact=auto_compact,
        compact_fragments=compact_fragments,
        create=create,
        mirror=mirror,
        auto_index=auto_index,
        keep_memory=keep_memory,
        read_only=read_only,
        export_root=export_root,
    )


def _init_folder(path: str, dim: int) -> None:
    """Create a database; the marker file is written last, atomically."""
    tables = LanceTables(os.path.join(path, "tables"))
    tables.create_all(dim)
    for table, col in TEXT_COLUMN.items():  # full-text indexes start empty; Lance searches new rows next to them
        tables.dataset(table).create_scalar_index(col, index_type="INVERTED")
    log_path = os.path.join(path, "commits.log")
    if not os.path.exists(log_path):
        commit_log.create(log_path)
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"format": "trellisdb", "format_version": FORMAT_VERSION, "embedding_dim": dim}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(path, MARKER))


_OUR_FILES = {"tables", "commits.log", "LOCK", MARKER + ".tmp", SPACES_FILE}


#: A table named in SQL text (``nodes``, ``nodes_full_history``, ...).
_TABLE_NAMES = re.compile(rf"\b({'|'.join(DATA_TABLES)})(?:_full)?(?:_history)?\b")


class Transaction:
    """Handle of a :meth:`Database.transaction` block."""

    commit_id: int | None = None


@dataclass
class _Failure:
    """A group commit that failed: its error, and the writers (session ids; None for writes made
    outside a session) not yet told."""

    error: BaseException
    writers: set[str | None]


class Database:
    """An open trellisdb database. Create it with :func:`trellisdb.connect`."""

    def __init__(
        self,
        path: str,
        *,
        embedding_dim: int | None,
        commit_delay: float,
        max_batch_rows: int,
        auto_compact: bool,
        compact_fragments: int,
        create: bool,
        mirror: bool = True,
        auto_index: bool = True,
        keep_memory: int | None = None,
        read_only: bool = False,
        export_root: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(read_only, bool):
            raise ValidationError(f"read_only must be True or False, not {read_only!r}")
        self.read_only = read_only
        if read_only:
            create = False  # a read-only handle changes nothing in the folder, creating it least of all
        if keep_memory is not None and (isinstance(keep_memory, bool) or not isinstance(keep_memory, int)
                                        or keep_memory < 0):
            raise ValidationError(f"keep_memory must be a number of bytes >= 0 (or None), not {keep_memory!r}")
        self.path = path
        #: the folder exports named in TQL and on the command line are written under
        self.export_root = check_root(os.fspath(export_root), path) if export_root is not None else default_root(path)
        self.commit_delay = commit_delay
        self.max_batch_rows = max_batch_rows
        self.auto_compact = auto_compact
        self.compact_fragments = compact_fragments
        marker = os.path.join(path, MARKER)
        if not os.path.exists(marker):
            if os.path.isfile(path):
                raise NotADatabaseError(f"{path} is a file, not a trellisdb database folder")
            entries = set(os.listdir(path)) if os.path.isdir(path) else set()
            if entries - _OUR_FILES:
                raise NotADatabaseError(
                    f"{path} is not a trellisdb database (no {MARKER}) and is not empty; choose an empty or new folder"
                )
            if not create:
                raise NotADatabaseError(f"{path} is not a trellisdb database; run `trellis init --db {path}`")
            os.makedirs(path, exist_ok=True)
            self._lock = WriterLock(os.path.join(path, "LOCK"))
            with self._lock.held():
                if not os.path.exists(marker):
                    if "tables" in entries:  # a half-finished init: start it again
                        import shutil

                        shutil.rmtree(os.path.join(path, "tables"))
                    _init_folder(path, embedding_dim or DEFAULT_EMBEDDING_DIM)
        self._lock = WriterLock(os.path.join(path, "LOCK"))
        try:
            with open(marker) as fh:
                meta = json.load(fh)
        except (OSError, ValueError) as e:
            raise CorruptionError(f"{marker} is unreadable ({e}); the database cannot be opened") from e
        if not isinstance(meta, dict) or meta.get("format") != "trellisdb":
            raise NotADatabaseError(f"{marker} does not describe a trellisdb database")
        if meta.get("format_version") != FORMAT_VERSION:
            raise FormatVersionError(
                f"{path} has format version {meta.get('format_version')!r}; this trellisdb reads version "
                f"{FORMAT_VERSION}. Use the trellisdb release that wrote it, or export and re-import"
            )
        self.embedding_dim = int(meta["embedding_dim"])
        if embedding_dim is not None and embedding_dim != self.embedding_dim:
            raise ValidationError(
                f"{path} was created with embedding_dim={self.embedding_dim}, not {embedding_dim}; "
                "omit embedding_dim or pass the database's own"
            )
        self._log = commit_log.CommitLog(os.path.join(path, "commits.log"))
        self._tables = LanceTables(os.path.join(path, "tables"))
        # reads the log; warns (TrellisWarning) when it lost acknowledged records
        self._guard = recovery.LogGuard(self._log, self._tables, self._all_tables)
        self._guard.open()
        # ids used beyond the log (a damaged one) count as begun: the mirror leaves their fragments unsettled
        self._engine = SqlEngine(self._tables, lambda: max(self._log.refresh().max_id, self._guard.ceiling),
                                 mirror=mirror, keep_memory=keep_memory)
        self._writer_name = f"{socket.gethostname()}:{os.getpid()}"
        self._state_lock = threading.RLock()
        self._pending = Batch()
        self._tx = threading.local()
        self._timer: threading.Timer | None = None
        self._failure: _Failure | None = None
        self._retry_delay = 0.0
        self._known_nodes: set[str] = set()
        self._known_hashes: set[str] = set()
        self._name_cache: dict[tuple[str, str], tuple[set[str], int]] = {}
        self._last_cleanup = time.monotonic()
        self._cleanup_thread: threading.Thread | None = None
        self._closed = False
        self.auto_index = auto_index
        self._spaces = SpaceRegistry(os.path.join(path, SPACES_FILE), self.embedding_dim)
        self._embedders: dict[tuple[str, str], Embedder] = {}
        self._indexer = IndexMaintainer(lambda t: self._tables.dataset(t), dict(TEXT_COLUMN), self._lock.held)
        _open_dbs.add(self)

    # ------------------------------------------------------------------ writing
    def session(
        self,
        *,
        task: str,
        agent: str | None = None,
        model: str | None = None,
        config: Mapping[str, Any] | str | None = None,
        id: str | None = None,
        task_spec: str | None = None,
    ) -> SessionWriter:
        """Start a session of ``agent`` on ``task`` (created if new); returns its writer.

        Use it as a context manager: on exit the session is marked completed
        (or failed, on an exception) and its writes are flushed. An ``id`` that
        names an existing session reopens it (status running again, the step
        counter where it stopped) if ``task``, and ``agent``, ``model`` and
        ``config`` where given, are its own; otherwise it is an error (use
        :meth:`resume`, or a new id): a session is never silently rewritten.
        """
        self._writable("session")
        check_name(task, "task id")
        sid = check_name(id, "session id", optional=True) or new_id()
        row = {
            "id": sid,
            "task_id": task,
            "agent": check_name(agent, "agent", optional=True),
            "model": check_name(model, "model", optional=True),
            "config": config_text(config),
            "status": "running",
            "created_at": dt.datetime.now(dt.UTC),
        }
        check_text(task_spec, "task spec")
        old = self._session_row(sid) if id is not None else None
        if old is not None:
            given = {k: v for k, v in row.items() if k in ("task_id", "agent", "model", "config") and
                     (v is not None or k == "task_id")}
            diff = [k for k, v in given.items() if old.get(k) != v]
            if diff:
                raise DuplicateIdError(
                    f"session {sid!r} exists with {', '.join(f'{k} {old.get(k)!r}' for k in diff)}, not "
                    f"{', '.join(repr(given[k]) for k in diff)}; continue it with db.resume({sid!r}) or choose "
                    "another id"
                )
            row = {**old, "status": "running", "created_at": row["created_at"]}
        with self._sink(sid) as b:
            if task not in b.tasks and not self._exists("tasks", "id", task):
                self._add_task_row(b, task, None, task_spec, None, None)
            b.rows["sessions"].append(row)
            b.sessions[sid] = row
            b.session_id = sid
        w = SessionWriter(self, sid, task)
        if old is not None:
            w._step = self._max_step(sid)
        return w

    def _session_row(self, session_id: str) -> dict[str, Any] | None:
        """The latest row of a session (pending or committed), or None."""
        with self._state_lock:
            for b in self._batches():
                if session_id in b.sessions:
                    return dict(b.sessions[session_id])
        rows = self._lookup("SELECT * EXCLUDE (commit_id) FROM sessions WHERE id = $1", [session_id])
        return rows[0] if rows else None

    def _max_step(self, session_id: str) -> int:
        rows = self._lookup("SELECT coalesce(max(step), 0) AS s FROM nodes WHERE session_id = $1", [session_id])
        pending = [r["step"] or 0 for b in self._batches()
                   for r in b.nodes.values() if r["session_id"] == session_id]
        return max([int(rows[0]["s"]), *pending])

    def resume(self, session_id: str) -> SessionWriter:
        """A writer for an existing session (e.g. after the agent restarted)."""
        self._writable("resume")
        row = self._session_row(check_name(session_id, "session id") or "")
        if row is None:
            raise UnknownSessionError(f"session {session_id!r} does not exist")
        w = SessionWriter(self, session_id, row["task_id"])
        w._step = self._max_step(session_id)
        return w

    def add_task(
        self,
        id: str,
        *,
        name: str | None = None,
        spec: str | None = None,
        tags: Sequence[str] | None = None,
        embedding: Sequence[float] | None = None,
    ) -> str:
        """Declare a task (what is being solved). Declaring an existing task again is a no-op
        when it says the same, and an error when it says something else (a task is never
        silently rewritten)."""
        self._writable("add_task")
        check_name(id, "task id")
        with self._sink() as b:
            self._add_task_row(b, id, name, spec, tags, embedding, old=self._task_row(id, b))
        return id

    def _task_row(self, task_id: str, b: Batch) -> dict[str, Any] | None:
        if task_id in b.tasks:
            return next((r for r in reversed(b.rows["tasks"]) if r["id"] == task_id), None)
        rows = self._lookup("SELECT * EXCLUDE (commit_id) FROM tasks_full WHERE id = $1", [task_id])
        return rows[0] if rows else None

    def _add_task_row(
        self,
        b: Batch,
        id: str,
        name: str | None,
        spec: str | None,
        tags: Sequence[str] | None,
        embedding: Sequence[float] | None,
        old: dict[str, Any] | None = None,
    ) -> None:
        if isinstance(tags, str) or (tags is not None and not isinstance(tags, Sequence | set | frozenset)):
            raise ValidationError(f"tags of task {id!r} must be a list of strings, got {tags!r}")
        for t in tags or ():
            check_name(t, f"tag of task {id!r}")
        row = {
            "id": id,
            "name": id if name is None else check_text(name, "task name", optional=False),
            "spec": check_text(spec, "task spec"),
            "tags": list(tags) if tags else None,
            "embedding": check_embedding(embedding, self.embedding_dim, f"embedding of task {id!r}"),
            "created_at": dt.datetime.now(dt.UTC),
        }
        if old is not None:
            given = {"name": name, "spec": spec, "tags": tags, "embedding": embedding}
            diff = [k for k, v in given.items() if v is not None and old.get(k) != row[k]]
            if diff:
                raise DuplicateIdError(
                    f"task {id!r} exists with another {', '.join(diff)}; a task is declared once (choose another id)"
                )
            return  # declared again, the same: nothing to write
        b.rows["tasks"].append(row)
        b.tasks.add(id)

    def _write_session_status(self, session_id: str, status: str) -> None:
        with self._sink(session_id) as b:
            row = b.sessions.get(session_id)
            if row is None:
                row = self._session_row(session_id)
                if row is None:
                    raise UnknownSessionError(f"session {session_id!r} does not exist")
                b.rows["sessions"].append(row)
                b.sessions[session_id] = row
            row["status"] = status

    def _set_status(self, node_ids: str | Sequence[str], status: str, session_id: str | None = None) -> None:
        """New rows for the nodes with ``status``; committed rows are looked up in one query."""
        ids = [node_ids] if isinstance(node_ids, str) else list(dict.fromkeys(node_ids))
        with self._sink() as b:
            b.session_id = session_id or b.session_id
            found = self._node_rows([i for i in ids if i not in b.nodes])
            missing = [i for i in ids if i not in b.nodes and i not in found]
            if missing:  # before any row changes: all or nothing
                raise UnknownNodeError(
                    f"set_status: node(s) {missing[:5]!r} do not exist" + (f" ({len(missing)} in all)" if len(missing) > 5 else "")
                )
            now = dt.datetime.now(dt.UTC)
            for node_id in ids:
                row = b.nodes.get(node_id)
                if row is None:
                    row = dict(found[node_id])
                    row["created_at"] = now
                    b.rows["nodes"].append(row)
                    b.nodes[node_id] = row
                row["status"] = status

    def _batches(self) -> list[Batch]:
        """The batches holding this thread's uncommitted writes: its transaction's (if one), then the group's."""
        tx = getattr(self._tx, "batch", None)
        return [self._pending] if tx is None else [tx, self._pending]

    def _writable(self, what: str) -> None:
        if self.read_only:
            raise ReadOnlyError(
                f"{what} changes the database, and this handle is read-only (opened with read_only=True, or "
                "trellis --read-only); open it without read_only to write"
            )

    def in_transaction(self) -> bool:
        return getattr(self._tx, "batch", None) is not None

    @contextmanager
    def _sink(self, writer: str | None = None) -> Iterator[Batch]:
        """The batch a write goes to: the thread's transaction, or the group batch. ``writer``
        (the session writing, if one) is told here of a failed group commit that held its writes."""
        self._writable("writing")
        if self._closed:
            raise TransactionError(f"database {self.path} is closed")
        with self._state_lock:
            self._report_failure(writer)
        tx = getattr(self._tx, "batch", None)
        if tx is not None:
            yield tx
            tx.writers.add(writer)
            tx.session_id = writer or tx.session_id
            return
        with self._state_lock:
            yield self._pending
            self._pending.writers.add(writer)
            self._pending.session_id = writer or self._pending.session_id
            n = len(self._pending)
        if n >= self.max_batch_rows:
            self.flush()
        else:
            self._arm_timer()

    def _arm_timer(self, delay: float | None = None) -> None:
        with self._state_lock:
            if self._timer is None:
                t = threading.Timer(self.commit_delay if delay is None else delay, self._timer_flush)
                t.daemon = True
                self._timer = t
                t.start()

    def _timer_flush(self) -> None:
        try:
            self.flush()
        except BaseException:  # recorded by flush for the writers it concerns; retried below
            with self._state_lock:
                if len(self._pending) and not self._closed:
                    # retry with a growing pause: a full disk or a damaged log does not mend in 50 ms
                    self._retry_delay = min(max(2 * self._retry_delay, self.commit_delay), RETRY_MAX_DELAY)
                    self._arm_timer(self._retry_delay)

    def _report_failure(self, writer: str | None) -> None:
        """Raise, once per writer, the failure of a group commit that held ``writer``'s writes
        (they are still pending, and retried)."""
        f = self._failure
        if f is not None and writer in f.writers:
            f.writers.discard(writer)
            who = f"session {writer!r}" if writer is not None else "this database"
            raise CommitError(
                f"the group commit holding earlier writes of {who} failed: {f.error}. Those writes are kept "
                "and retried (db.flush() retries now); this call wrote nothing"
            ) from f.error

    def flush(self) -> int | None:
        """Commit pending group-committed writes now; return the commit id (None if nothing).

        If the commit fails, the writes stay pending (the next flush, or the timer, retries
        them), the error is raised here, and each session whose writes it held is told on its
        next write: a failed commit never drops writes silently."""
        with self._state_lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            batch, self._pending = self._pending, Batch()
            if not len(batch):
                return None
            try:
                cid = self._commit_once(batch, None)
            except BaseException as e:
                # Nothing was staged meanwhile (we hold the state lock): the batch is the pending one again.
                self._pending = batch
                self._failure = _Failure(e, set(batch.writers))
                raise
            self._failure = None
            self._retry_delay = 0.0
            return cid

    @contextmanager
    def transaction(self, message: str | None = None) -> Iterator[Transaction]:
        """Commit every write made in the block (in this thread) as one commit.

        Nothing is visible to readers until the block ends; an exception
        discards the writes. After the block, ``tx.commit_id`` is the id of
        the acknowledged commit (None if the block wrote nothing).
        """
        self._writable("transaction")
        check_text(message, "commit message")
        if self.in_transaction():
            raise TransactionError("transactions do not nest; commit the outer one first")
        tx = Transaction()
        self._tx.batch = Batch()
        try:
            yield tx
            batch = self._tx.batch
        finally:
            self._tx.batch = None
        if len(batch):
            # Earlier group-committed writes (e.g. the parent of a node in this
            # transaction) commit first, so the transaction never overtakes them.
            self.flush()
            tx.commit_id = self._commit_once(batch, message)

    def ingest(self, tables: Mapping[str, pa.Table], message: str | None = None) -> int:
        """Bulk-write whole Arrow tables (any subset of the data tables) as one commit.

        Columns are matched by name; missing nullable columns are filled with
        nulls. Parents of edges must exist in the batch or the database.
        """
        self._writable("ingest")
        check_text(message, "commit message")
        from trellisdb.bulk import prepare_bulk

        prepared = prepare_bulk(self, tables)
        return self._commit_once(Batch(), message, extra=prepared)

    def _commit_once(self, batch: Batch, message: str | None, extra: Mapping[str, pa.Table] | None = None) -> int:
        """Commit ``batch`` for a caller that waits for it (a transaction, an ingest): a failure
        before the commit point is raised (as ``CommitError`` if it is not a TrellisError) and
        nothing of the batch is visible; one after it does not undo the acknowledged commit."""
        try:
            return self._commit(batch, message=message, extra=extra)
        except Exception as e:
            if batch.commit_id is not None:
                return batch.commit_id
            if isinstance(e, TrellisError):
                raise
            raise CommitError(f"the commit failed: {e}; nothing of it was written") from e

    def _commit(self, batch: Batch, message: str | None, extra: Mapping[str, pa.Table] | None = None) -> int:
        with self._lock.held():
            mark = self._log.repair_tail()  # refuses when the log lost acknowledged records
            st = self._log.refresh()
            if st.problems:
                raise CorruptionError(
                    f"the commit log is damaged ({st.problems[0][1]}); writes are refused until "
                    "db.repair() (`trellis repair`) mends it and `trellis verify` is clean. Reads still work"
                )
            self._guard.check_rows(st, mark)  # rows of commits the log does not record: refused
            self._collect_aborted()
            cid = self._guard.next_id(st, mark)
            self._log.append([{"op": "begin", "id": cid}])
            data = batch.to_arrow(self.embedding_dim, cid)
            for name, t in (extra or {}).items():
                t = t.set_column(
                    t.schema.get_field_index("commit_id"), "commit_id", pa.array([cid] * t.num_rows, pa.int64())
                )
                data[name] = pa.concat_tables([data[name], t]) if name in data else t
            data.update(batch.vector_tables(cid))
            rows = 0
            written = [name for name in (*DATA_TABLES, *batch.vectors) if name in data and data[name].num_rows]
            for name in written:
                self._tables.append(name, data[name])
                rows += data[name].num_rows
            self._log.append(
                [
                    {
                        "op": "commit",
                        "id": cid,
                        "time": time.time(),
                        "writer": self._writer_name,
                        "session": batch.session_id,
                        "message": message,
                        "rows": rows,
                    }
                ]
            )
            batch.commit_id = cid  # the commit point: from here on, a failure must not make a retry write it again
            self._log.refresh()
            self._known_nodes.update(batch.nodes)
            self._known_hashes.update(batch.hashes)
            if self.auto_compact:
                busy = self._indexer.building()  # compacting these would preempt their index build
                for name in written:
                    if name in busy:
                        continue
                    # best effort: an index build committing at the same moment can make Lance refuse
                    # the rewrite; the next commit compacts instead
                    with contextlib.suppress(OSError, RuntimeError, ValueError):
                        self._tables.compact_tiered(name, self.compact_fragments)
                self._maybe_cleanup()
        if self.auto_index:
            for sp in self._spaces_written(data):
                self._indexer.poke(sp)
        return cid

    def _maybe_cleanup(self) -> None:
        """Start a background cleanup of old physical versions, at most once per
        ``CLEANUP_INTERVAL``. Cleanup needs no lock: it deletes only files of
        versions older than the grace period, never those of a write in flight."""
        now = time.monotonic()
        if now - self._last_cleanup < CLEANUP_INTERVAL:
            return
        if self._cleanup_thread is not None and self._cleanup_thread.is_alive():
            return
        self._last_cleanup = now

        def run() -> None:
            for name in self._all_tables():
                if self._closed:
                    return
                # Best effort: a failure (another process cleaning the same
                # files) leaves files behind, never removes live ones.
                with contextlib.suppress(Exception):
                    self._tables.cleanup(name)

        self._cleanup_thread = threading.Thread(target=run, name="trellisdb-cleanup", daemon=True)
        self._cleanup_thread.start()

    def _collect_aborted(self) -> None:
        """Delete rows of commits that began but never committed (holding the lock)."""
        dead = sorted(self._log.state.open_ids)  # we hold the lock: nothing is in flight
        if not dead:
            return
        pred = f"commit_id IN ({', '.join(str(i) for i in dead)})"
        for name in self._all_tables():
            self._tables.delete(name, pred)
        self._log.append([{"op": "collected", "ids": dead}])
        self._log.refresh()

    def compact(self, prune_older_than: dt.timedelta = PRUNE_GRACE) -> dict[str, Any]:
        """Compact every table's fragments now and drop physical versions older
        than ``prune_older_than`` (default 10 minutes: readers in other processes
        may still scan them; pass ``timedelta(0)`` when nothing else reads)."""
        self._writable("compact")
        self.flush()
        with self._lock.held():
            out = {name: self._tables.compact(name) for name in self._all_tables()}
        for name in self._all_tables():
            self._tables.cleanup(name, prune_older_than)
        return out

    def tag(self, name: str, commit: int | None = None, *, move: bool = False) -> int:
        """Name a commit (default: the latest); return its id.

        A tag names one commit: tagging the commit it names again changes nothing, and
        pointing it at another commit needs ``move=True`` (or :meth:`untag` first)."""
        self._writable("tag")
        check_name(name, "tag name")
        if name.isdigit():
            raise ValidationError(f"tag name {name!r} must not be a number (AS OF COMMIT takes numbers)")
        if commit is not None and (isinstance(commit, bool) or not isinstance(commit, int)):
            raise ValidationError(f"commit must be a commit id (an integer) or None, not {commit!r}")
        self.flush()
        with self._lock.held():
            self._log.repair_tail()
            st = self._log.refresh()
            cid = st.last_committed if commit is None else commit
            if cid not in st.commits:
                raise UnknownCommitError(f"commit {cid} does not exist; see `trellis log`")
            old = st.tags.get(name)
            if old == cid:
                return cid
            if old is not None and not move:
                raise ValidationError(
                    f"tag {name!r} names commit {old}; pass move=True (trellis tag --move) to point it at {cid}, "
                    f"or untag it first"
                )
            self._log.append([{"op": "tag", "name": name, "id": cid}])
            self._log.refresh()
        return cid

    def untag(self, name: str) -> int:
        """Remove tag ``name``; return the commit it named. A tag whose name a store written
        before names were checked holds (see ``verify``) is removed the same way."""
        self._writable("untag")
        if not isinstance(name, str):
            raise ValidationError(f"tag name must be a string, got {type(name).__name__}")
        with self._lock.held():
            self._log.repair_tail()
            st = self._log.refresh()
            cid = st.tags.get(name, st.invalid_tags.get(name))
            if cid is None:
                from trellisdb.tql.resolve import did_you_mean

                raise UnknownTagError(f"tag {name!r} does not exist{did_you_mean(name, list(st.tags))}")
            self._log.append([{"op": "untag", "name": name}])
            self._log.refresh()
        return cid

    # ------------------------------------------------------- embedding spaces
    def create_space(
        self,
        name: str,
        *,
        target: str = "nodes",
        dim: int | None = None,
        embedder: Embedder | None = None,
        model: str | None = None,
        text: str | None = None,
    ) -> dict[str, Any]:
        """Create the embedding space ``name`` of ``target`` (nodes or tasks); return its description.

        Give ``dim`` (vectors you supply) or an ``embedder`` (its ``dim`` and
        ``name`` become the space's; it embeds query texts and
        :meth:`embed`). ``text`` is the target column :meth:`embed` reads
        (default ``summary`` for nodes, ``spec`` for tasks). Creating a space
        that exists with the same dimension and model returns it unchanged.

        >>> import tempfile, trellisdb
        >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
        >>> db.create_space("tiny", dim=2)["table"]
        'vec_nodes_tiny'
        """
        self._writable("create_space")
        from trellisdb.errors import UnknownSpaceError
        from trellisdb.vectors import BUILTIN, check_space_name, space_schema

        check_space_name(name)
        if target not in TARGETS:
            raise UnknownSpaceError(f"target {target!r} has no embedding spaces; use 'nodes' or 'tasks'")
        if name == BUILTIN:
            raise ValidationError(f"{BUILTIN!r} is the built-in space (the embedding column); choose another name")
        if embedder is not None:
            dim = dim or int(embedder.dim)
            model = model or str(embedder.name)
            if dim != embedder.dim:
                raise ValidationError(f"dim={dim} disagrees with embedder {embedder.name!r} (dim {embedder.dim})")
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 65_536:
            raise ValidationError(f"space {name!r} needs dim= (a whole number 1..65536) or an embedder=, got {dim!r}")
        if text is not None:
            from trellisdb.tql.resolve import ENTITY_COLUMNS

            if text not in ENTITY_COLUMNS[target]:
                raise ValidationError(f"text={text!r} is not a column of {target}; columns: {ENTITY_COLUMNS[target]}")
        sp = Space(name, target, dim, model, text)
        with self._lock.held():
            old = self._spaces.get(target, name)
            if old is not None:
                if (old.dim, old.model) != (sp.dim, sp.model or old.model):
                    raise ValidationError(
                        f"space {name!r} of {target} exists with dim {old.dim} and model {old.model!r}; "
                        "a new model or dimension needs a new space name"
                    )
                sp = old
            else:
                sch = space_schema(dim)
                import lance

                uri = self._tables.uri(sp.table)  # a table left by an interrupted create_space is replaced
                lance.write_dataset(sch.empty_table(), uri, schema=sch, mode="overwrite" if os.path.exists(uri) else "create")
                self._spaces.add(sp)
        if embedder is not None:
            self._embedders[(target, name)] = embedder
        return sp.describe()

    def spaces(self) -> list[dict[str, Any]]:
        """Every embedding space: name, target, dim, model, text column, table."""
        return [s.describe() for s in self._spaces.all()]

    def _space(self, name: str, target: str) -> Space:
        from trellisdb.errors import UnknownSpaceError
        from trellisdb.tql.resolve import did_you_mean

        sp = self._spaces.get(target, name) if target in TARGETS else None
        if sp is None:
            names = self._spaces.names(target) if target in TARGETS else []
            raise UnknownSpaceError(
                f"unknown embedding space {name!r} of {target}{did_you_mean(name, names)}; spaces: "
                f"{', '.join(names) or 'none'} (create one with db.create_space)"
            )
        return sp

    def _space_tables(self) -> list[str]:
        return [s.table for s in self._spaces.all() if not s.builtin]

    def _all_tables(self) -> list[str]:
        return [*DATA_TABLES, *self._space_tables()]

    def _spaces_written(self, data: Mapping[str, pa.Table]) -> list[Space]:
        """The spaces a commit added vectors to (built-in: a non-null embedding)."""
        out = []
        for sp in self._spaces.all():
            t = data.get(sp.table)
            if t is None or not t.num_rows:
                continue
            if sp.builtin and t.column(sp.column).null_count == t.num_rows:
                continue
            out.append(sp)
        return out

    def set_embedder(self, space: str, embedder: Embedder, *, target: str = "nodes") -> None:
        """Use ``embedder`` (in this process) for query texts and :meth:`embed` of ``space``."""
        sp = self._space(space, target)
        if embedder.dim != sp.dim:
            from trellisdb.errors import EmbeddingDimensionError

            raise EmbeddingDimensionError(f"embedder {embedder.name!r} has dim {embedder.dim}; space {space!r} has {sp.dim}")
        self._embedders[(target, space)] = embedder

    def _embedder(self, sp: Space) -> Embedder:
        emb = self._embedders.get((sp.target, sp.name))
        if emb is None:
            from trellisdb.embed import MiniLM

            if sp.model == MiniLM.name:
                emb = self._embedders[(sp.target, sp.name)] = MiniLM()
            else:
                from trellisdb.errors import EmbedderError

                raise EmbedderError(
                    f"space {sp.name!r} ({sp.model or 'vectors supplied by the caller'}) has no embedder in this "
                    f"process: pass a vector ($v) instead of a text, or call db.set_embedder({sp.name!r}, ...)"
                )
        return emb

    def add_vectors(self, space: str, ids: Sequence[str], vectors: Any, *, target: str = "nodes") -> None:
        """Add vectors (an (n, dim) array or n sequences) for existing node/task ``ids`` to ``space``.

        Group-committed like every write (or part of the open transaction).
        A vector added again for an id is added next to the old one; searches
        list each id once, at its best distance (a new model belongs in a new
        space). The built-in space takes vectors through ``add_node(embedding=...)``.
        """
        self._writable("add_vectors")
        sp = self._space(space, target)
        if sp.builtin:
            raise ValidationError("the built-in space 'embedding' is written with add_node(embedding=...)")
        if isinstance(ids, str):
            raise ValidationError(f"ids must be a list of ids, got the string {ids!r}")
        ids = [check_name(i, "id") or "" for i in ids]
        mat = as_matrix(vectors, sp.dim, f"vectors for space {space!r}")
        if mat.shape[0] != len(ids):
            raise ValidationError(f"{len(ids)} ids but {mat.shape[0]} vectors for space {space!r}")
        if len(set(ids)) != len(ids):
            raise ValidationError(f"ids repeat in one add_vectors call to space {space!r}")
        if target == "nodes":
            missing = self._missing_nodes(ids)
        else:
            missing = [i for i in ids if i not in self._names("tasks", "id") and not self._pending_task(i)]
        if missing:
            raise (UnknownNodeError if target == "nodes" else ValidationError)(
                f"{target[:-1]} {missing[0]!r} does not exist ({len(missing)} of {len(ids)} ids are unknown); "
                f"add the {target[:-1]} before its vector"
            )
        with self._sink() as b:
            b.vectors.setdefault(sp.table, []).append((ids, mat))

    def _pending_task(self, task_id: str) -> bool:
        return any(task_id in b.tasks for b in self._batches())

    def embed(
        self,
        space: str,
        *,
        target: str = "nodes",
        batch_size: int = 256,
        progress: Any = None,
    ) -> int:
        """Compute the missing vectors of ``space`` with its embedder; return how many were added.

        Embeds the space's text column of every row that has text and no
        vector yet, ``batch_size`` texts per commit (so a long run keeps what
        it did). ``progress(done, total)`` is called after each batch.
        """
        self._writable("embed")
        sp = self._space(space, target)
        if sp.builtin:
            raise ValidationError("the built-in space holds supplied vectors; create a space with an embedder to embed")
        emb = self._embedder(sp)
        self.flush()
        import lance

        from trellisdb.embed import check_vectors

        have = lance.dataset(self._tables.uri(sp.table)).to_table(columns=["id"])
        col = sp.text or TEXT_COLUMN[target]
        st = self._log.refresh()
        con = self._engine.prepare(st, st.last_committed, (target,))
        con.register("__have", have)
        try:
            todo = con.sql(
                f'SELECT id, "{col}" AS t FROM {target} WHERE "{col}" IS NOT NULL AND id NOT IN (SELECT id FROM __have) '
                "ORDER BY id"
            ).to_arrow_table()
        finally:
            con.unregister("__have")
        ids, texts = todo["id"].to_pylist(), todo["t"].to_pylist()
        for lo in range(0, len(ids), batch_size):
            chunk = texts[lo : lo + batch_size]
            vecs = check_vectors(emb, chunk, emb.embed(chunk))
            b = Batch()
            b.vectors[sp.table] = [(ids[lo : lo + batch_size], vecs)]
            self._commit(b, message=f"embed {target} into space {space}")
            if progress is not None:
                progress(min(lo + batch_size, len(ids)), len(ids))
        return len(ids)

    # ------------------------------------------------------- training-data views
    def create_view(self, name: str, kind: str, *, replace: bool = False, **options: Any) -> dict[str, Any]:
        """Declare a training-data view (``trellisdb/views.py`` lists the kinds and options);
        nothing is computed until :meth:`materialize`. Returns its catalog entry.

        >>> db.create_view("good", "sft", reward="reward('score')", threshold=0.9)  # doctest: +SKIP
        """
        self._writable("create_view")
        from trellisdb import views

        spec = views.ViewSpec.from_dict({**options, "name": name, "kind": kind})
        views.check(self, spec, self._log.refresh().last_committed)  # the conditions compile, names exist
        with self._lock.held():
            cat = views.ViewCatalog(self.path).load()
            if name in cat.entries and not replace:
                raise ValidationError(f"view {name!r} exists; pass replace=True to redefine it (its rows go)")
            cat.entries[name] = {"spec": spec.as_dict(), "definition": spec.definition(), "commit": None,
                                 "rows": None, "file": None, "version": None}
            cat.save()
            views.remove(self, name)
        return dict(cat.entries[name])

    def views(self) -> list[dict[str, Any]]:
        """Every view: name, kind, definition, the commit it is materialized at and its row count."""
        from trellisdb import views

        cat = views.ViewCatalog(self.path).load()
        return [{"name": n, "kind": e["spec"]["kind"], "definition": e["definition"], "commit": e["commit"],
                 "rows": e["rows"], "computed_at": e.get("computed_at")} for n, e in sorted(cat.entries.items())]

    def materialize(self, name: str, as_of: AsOf = None) -> dict[str, Any]:
        """Compute view ``name`` as of a commit (default: the latest) and store its rows pinned to it."""
        self._writable("materialize")
        from trellisdb import views

        self.flush()
        commit = self.resolve_as_of(as_of)
        spec = views.ViewCatalog(self.path).load().spec(name)
        rows, texts = views.build(self, spec, commit)
        with self._lock.held():
            cat = views.ViewCatalog(self.path).load()
            cat.spec(name)
            return views.store(self, cat, spec, rows, texts, commit, "built")

    def refresh(self, name: str) -> dict[str, Any]:
        """Bring a materialized view to the latest commit, recomputing only what the commits
        since its own touched (equal to a rebuild; see ``views.refresh_rows``)."""
        self._writable("refresh")
        from trellisdb import views

        self.flush()
        for _attempt in range(3):
            cat = views.ViewCatalog(self.path).load()
            spec = cat.spec(name)
            entry = cat.entries[name]
            upto = self._log.refresh().last_committed
            if entry["commit"] is None:
                return self.materialize(name)
            if entry["commit"] >= upto:
                return dict(entry)
            r = views.refresh_rows(self, spec, entry, int(entry["commit"]), upto)
            with self._lock.held():
                cat = views.ViewCatalog(self.path).load()
                now = cat.entries.get(name)
                if now is None or now.get("version") != entry["version"]:
                    continue  # another process changed the view meanwhile: start again from its state
                if r.rows is not None:
                    return views.store(self, cat, spec, r.rows, r.texts, upto, r.how)
                assert r.fresh is not None
                return views.store_delta(self, cat, spec, entry, r.drop, r.fresh, r.texts, upto, r.how)
        raise TransactionError(f"view {name!r} kept changing under this refresh; try again")

    def view(self, name: str) -> Result:
        """The stored rows of a materialized view (artifact hashes, provenance ``node_ids``)."""
        from trellisdb import views

        cat = views.ViewCatalog(self.path).load()
        cat.spec(name)
        entry = cat.entries[name]
        if entry.get("version") is None:
            raise ValidationError(f"view {name!r} is not materialized yet; run db.materialize({name!r})")
        return Result(views.read_rows(self, entry))

    def drop_view(self, name: str) -> None:
        """Forget a view and delete its stored rows (exports already written stay)."""
        self._writable("drop_view")
        from trellisdb import views

        with self._lock.held():
            cat = views.ViewCatalog(self.path).load()
            cat.spec(name)
            cat.entries.pop(name)
            cat.save()
            views.remove(self, name)

    def export(
        self,
        name: str,
        path: str | os.PathLike[str],
        format: str = "trl",
        *,
        validation: float = 0.0,
        overwrite: bool = False,
        skip_missing: bool = False,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Write materialized view ``name`` to folder ``path`` as ``trl`` / ``openai`` JSONL or
        ``parquet``, with ``manifest.json``, ``provenance.parquet`` and a ``README.md`` card
        (``trellisdb/export.py`` has the layouts). ``validation``: the share of tasks split off.
        Returns the manifest."""
        from trellisdb.export import export

        self._writable("export")
        return export(self, name, path, format, validation=validation, overwrite=overwrite,
                      skip_missing=skip_missing, progress=progress)

    def export_target(self, path: str) -> str:
        """The folder an export named ``path`` in TQL or on the command line writes: ``path``
        relative to the export root (``connect(export_root=...)``, default ``<db>/exports``);
        an absolute path, ``..``, NUL or a symbolic link out of the root raise ``ExportError``.

        >>> import tempfile, trellisdb
        >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
        >>> db.export_target("runs/pairs").endswith("/db/exports/runs/pairs")
        True
        """
        return confined(self.export_root, self.path, path)

    def index_status(self) -> list[dict[str, Any]]:
        """Per space: state (exact | building | indexed | failed), rows, indexed_rows,
        partitions, building_for_seconds, last_build_seconds, builds, error."""
        return [self._indexer.observe(sp).as_dict() for sp in self._spaces.all()]

    def build_index(self, space: str = "embedding", *, target: str = "nodes", wait: bool = True) -> dict[str, Any]:
        """Build (or rebuild) the ANN index of ``space`` now, whatever its size; with
        ``wait`` block until done. Returns the space's index status."""
        self._writable("build_index")
        sp = self._space(space, target)
        self.flush()
        self._indexer.poke(sp, force="create")
        if wait:
            self._indexer.wait()
        return self._indexer.observe(sp).as_dict()

    # ------------------------------------------------------------------ reading
    def log(self) -> list[dict[str, Any]]:
        """The commits, oldest first: id, time, writer, session_id, message, rows, tags."""
        st = self._log.refresh()
        from trellisdb.reader import commits_table

        rows: list[dict[str, Any]] = commits_table(st, st.last_committed).to_pylist()
        return rows

    def tags(self) -> dict[str, int]:
        return dict(self._log.refresh().tags)

    def resolve_as_of(self, as_of: AsOf) -> int:
        """The commit id a point in time names: a commit id, tag, timestamp or None (latest)."""
        st = self._log.refresh()
        if as_of is None:
            return st.last_committed
        if isinstance(as_of, bool):
            raise ValidationError(f"as_of must be a commit id, tag or timestamp, not {as_of!r}")
        if isinstance(as_of, int):
            if as_of == 0 or as_of in st.commits:
                return as_of
            raise UnknownCommitError(
                f"commit {as_of} does not exist (last commit is {st.last_committed}); see `trellis log`"
            )
        if isinstance(as_of, str):
            if as_of in st.tags:
                return st.tags[as_of]
            if as_of.isdigit():
                return self.resolve_as_of(int(as_of))
            try:
                ts = dt.datetime.fromisoformat(as_of)
            except ValueError:
                import difflib

                close = difflib.get_close_matches(as_of, list(st.tags), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise UnknownTagError(f"{as_of!r} is neither a tag nor an ISO timestamp{hint}") from None
            as_of = ts
        if isinstance(as_of, dt.datetime):
            return commit_log.last_commit_at(st.commits, as_of)
        raise ValidationError(f"as_of must be a commit id, tag or timestamp, not {type(as_of).__name__}")

    def sql(
        self,
        text: str,
        as_of: AsOf = None,
        params: Sequence[Any] | Mapping[str, Any] | None = None,
    ) -> Result:
        """Run DuckDB SQL over the tables as of a commit (default: latest).

        Tables: ``tasks``, ``sessions``, ``nodes``, ``edges``, ``artifacts``,
        ``node_artifacts``, ``rewards``, ``comparisons`` (current state: latest
        row per key), each also as ``<name>_history`` (all rows), and
        ``commits``. ``nodes``, ``tasks`` and ``artifacts`` leave out their
        bulky column (``embedding``, ``content``: the views are served from an
        in-memory mirror); ``nodes_full``, ``tasks_full``, ``artifacts_full``
        and their ``_history`` views have it. Values go in ``params`` (``$1`` or ``$name``), never
        into the text.

        The text is one read-only query (``SELECT``, ``WITH``, ``EXPLAIN``) over those
        relations; anything else (writes, DDL, settings, file or extension access, internal
        relations) raises ``QueryError`` (``trellisdb/usersql.py``).
        """
        usersql.check(text, PUBLIC_RELATIONS)
        snap = self.resolve_as_of(as_of)
        return Result(self._engine.run(self._log.state, snap, text, params), sql=text)

    def query(self, text: str, **params: Any) -> QueryResult:
        """Run a TQL query; ``$name`` in the text takes the value of ``name=...``.

        Statements: ``NODES|SESSIONS|TASKS|REWARDS ...``, ``FRONTIER ...``,
        ``LINEAGE OF ...``, ``SIBLINGS OF ...``, ``SUBTREE OF ...``,
        ``PATH FROM ... TO ...``, each optionally ``AS OF ...`` and prefixed by
        ``EXPLAIN``; see ``docs/tql.md``. Values are bound as parameters,
        never spliced into SQL.

        >>> import tempfile, trellisdb
        >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
        >>> s = db.session(task="t", agent="a")
        >>> root = s.add_node(id="root", summary="first")
        >>> s.add_reward(root, "score", 0.5)
        >>> kid = s.add_node(id="kid", parents=[root])
        >>> s.add_reward(kid, "score", 0.9)
        >>> db.query("FRONTIER RANK BY reward('score') DESC LIMIT 1 RETURN id, reward('score') AS score").to_pylist()
        [{'id': 'kid', 'score': 0.9}]
        >>> [r["id"] for r in db.query("LINEAGE OF $n ANCESTORS", n="kid").to_pylist()]
        ['kid', 'root']
        """
        from trellisdb.tql.run import run

        self.flush()  # a query sees this process's own acknowledged-to-be writes
        return run(self, text, params)

    def _names(self, table: str, col: str) -> set[str]:
        """Distinct values of a name column (channels, session ids, task ids), cached
        and extended incrementally by the commits since the last look."""
        last = self._log.refresh().last_committed
        known, upto = self._name_cache.setdefault((table, col), (set(), 0))
        if upto < last:
            rows = self._lookup(f"SELECT DISTINCT {col} AS v FROM {table}_history WHERE commit_id > $1", [upto], at=last)
            known |= {r["v"] for r in rows}
            self._name_cache[(table, col)] = (known, last)
        return known

    def _step_commit(self, session_id: str, step: int) -> int | None:
        """The commit that first recorded step ``step`` of a session."""
        rows = self._lookup(
            "SELECT min(commit_id) AS c FROM nodes_history WHERE session_id = $1 AND step = $2", [session_id, step]
        )
        c = rows[0]["c"]
        return int(c) if c is not None else None

    # ------------------------------------------------------- lookups for writes
    def _exists(self, table: str, col: str, value: str) -> bool:
        return bool(self._lookup(f"SELECT 1 FROM {table}_history WHERE {col} = $1 LIMIT 1", [value]))

    def _missing_nodes(self, ids: list[str]) -> list[str]:
        """The ids among ``ids`` that are neither pending nor committed."""
        # Under the state lock: a group commit moving rows from pending to the
        # store must not make them invisible to this check half-way.
        with self._state_lock:
            return self._missing_nodes_locked(ids)

    def _missing_nodes_locked(self, ids: list[str]) -> list[str]:
        batches = self._batches()
        todo = [i for i in ids if i not in self._known_nodes and not any(i in b.nodes for b in batches)]
        if not todo:
            return []
        found = {
            r["id"]
            for r in self._lookup("SELECT DISTINCT id FROM nodes_history WHERE id IN (SELECT unnest($1::VARCHAR[]))", [todo])
        }
        self._known_nodes.update(found)
        return [i for i in todo if i not in found]

    def _node_row(self, node_id: str) -> dict[str, Any] | None:
        """The latest row of a node (pending or committed), or None."""
        return self._node_rows([node_id]).get(node_id)

    def _node_rows(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The latest row of each node (pending or committed) by id; unknown ids are absent."""
        out: dict[str, dict[str, Any]] = {}
        with self._state_lock:
            for b in self._batches():
                out.update((i, b.nodes[i]) for i in ids if i in b.nodes and i not in out)
            todo = [i for i in ids if i not in out]
            if len(todo) == 1:
                rows = self._lookup(
                    "SELECT * EXCLUDE (commit_id) FROM nodes_full_history WHERE id = $1 "
                    "ORDER BY commit_id DESC LIMIT 1",
                    todo,
                )
            elif todo:
                rows = self._lookup(
                    "SELECT * EXCLUDE (commit_id) FROM nodes_full_history "
                    "WHERE id IN (SELECT unnest($1::VARCHAR[])) "
                    "QUALIFY row_number() OVER (PARTITION BY id ORDER BY commit_id DESC) = 1",
                    [todo],
                )
            else:
                rows = []
            out.update((r["id"], r) for r in rows)
        return out

    def _comparison_row(self, comparison_id: str) -> dict[str, Any] | None:
        """The latest row of a comparison (pending or committed), or None."""
        with self._state_lock:
            for b in self._batches():
                row = next((r for r in reversed(b.rows["comparisons"]) if r["id"] == comparison_id), None)
                if row is not None:
                    return dict(row)
        rows = self._lookup("SELECT * EXCLUDE (commit_id) FROM comparisons WHERE id = $1", [comparison_id])
        return rows[0] if rows else None

    def _node_original(self, node_id: str, edge_kind: str) -> tuple[dict[str, Any], set[str]] | None:
        """The first row written for a node and its ``edge_kind`` parents from
        that same write: what an idempotent retry of ``add_node`` must match."""
        with self._state_lock:
            for b in self._batches():
                if node_id in b.added:
                    parents = {e["src"] for e in b.rows["edges"] if e["dst"] == node_id and e["kind"] == edge_kind}
                    return b.nodes[node_id], parents
            rows = self._lookup(
                "SELECT * FROM nodes_full_history WHERE id = $1 ORDER BY commit_id LIMIT 1", [node_id]
            )
            if not rows:
                return None
            first = rows[0]
            srcs = self._lookup(
                "SELECT src FROM edges_history WHERE dst = $1 AND kind = $2 AND commit_id = $3",
                [node_id, edge_kind, first.pop("commit_id")],
            )
            return first, {r["src"] for r in srcs}

    def _lookup(self, text: str, params: list[Any], at: int | None = None) -> list[dict[str, Any]]:
        """Rows of an internal query as of commit ``at`` (default: the latest)."""
        st = self._log.refresh()
        # our own texts: the tables they name are the ones whose mirror must be current
        tables = tuple(dict.fromkeys(m.group(1) for m in _TABLE_NAMES.finditer(text)))
        snapshot = st.last_committed if at is None else at
        return self._engine.run(st, snapshot, text, params, tables).to_pylist()  # type: ignore[no-any-return]

    def _has_artifact(self, h: str) -> bool:
        if h in self._known_hashes or h in self._pending.hashes:
            return True
        if self._exists("artifacts", "hash", h):
            self._known_hashes.add(h)
            return True
        return False

    # ------------------------------------------------------------- maintenance
    def verify(self) -> list[str]:
        """Check every file; return problems, each naming the file (empty: healthy)."""
        problems = self._guard.problems()  # damaged lines, lost records, stranded rows
        problems += [f"{self._log.path}: tag {name!r} (commit {cid}) has a name no tag may have "
                     f"({name_problem(name)}); remove it with db.untag({name!r})"
                     for name, cid in list(self._log.refresh().invalid_tags.items())]
        for name in self._all_tables():
            problems.extend(self._tables.verify(name))
        return problems

    def repair(self) -> dict[str, Any]:
        """Mend a commit log that lost records; return a report of what was done.

        Every commit whose rows are proven complete (acknowledged, says the high-water mark
        ``commits.hwm``, or followed by a later commit) gets back its commit record, with every
        row the tables hold; rows of commits never acknowledged, and the damaged lines of the
        log, are copied to ``<db>/lost+found/<UTC time>/`` and removed, and no id is used again.
        Tags lost with the log's lines cannot be recovered. On a healthy store it does nothing.
        A process that had read the lines a repair dropped must open the database again.
        See ``trellisdb/storage/recovery.py`` for the report's keys.

        >>> import tempfile, trellisdb
        >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
        >>> report = db.repair()
        >>> report["damage"], report["recovered"], report["lost_found"]
        ([], [], None)
        """
        self._writable("repair")
        with self._lock.held():
            return self._guard.repair()

    def close(self) -> None:
        """Flush pending writes and release resources."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._indexer.closed = True  # a build in progress finishes (or is abandoned at exit: Lance commits atomically)
        if self._cleanup_thread is not None:
            self._cleanup_thread.join()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<trellisdb.Database {self.path!r} commit={self._log.state.last_committed}>"
