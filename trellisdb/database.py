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
import inspect
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb import writer
from trellisdb.asof import AsOf
from trellisdb.batch import Batch
from trellisdb.committer import DEFAULT_PROVENANCE, Committer, Transaction
from trellisdb.errors import ValidationError
from trellisdb.names import check_name, check_text, name_problem
from trellisdb.paths import check_root, confined, default_root
from trellisdb.progress import Steps
from trellisdb.reader import QUERY_TIMEOUT, QueryScope, commits_table
from trellisdb.result import Result
from trellisdb.rules import commit_meta
from trellisdb.snapshot import Reads, Snapshot
from trellisdb.storage.tables import PRUNE_GRACE
from trellisdb.store import Store
from trellisdb.training import ViewStore
from trellisdb.vectors.service import Vectors
from trellisdb.writer import SessionWriter

if TYPE_CHECKING:
    from trellisdb.client import RemoteDatabase
    from trellisdb.embed import Embedder
    from trellisdb.tql.run import QueryResult

__all__ = ["AsOf", "Database", "Transaction", "connect", "open_local"]

_open_dbs: weakref.WeakSet[Database] = weakref.WeakSet()


@atexit.register
def _flush_all() -> None:  # a clean interpreter exit loses nothing pending
    for db in list(_open_dbs):
        with contextlib.suppress(Exception):  # exiting: nothing to report to
            db.close()


def connect(
    target: str | os.PathLike[str],
    *,
    token: str | None = None,
    timeout: float = 120.0,
    embedding_dim: int | None = None,
    commit_delay: float = 0.05,
    max_batch_rows: int = 10_000,
    auto_compact: bool = True,
    compact_fragments: int = 8,
    create: bool = True,
    mirror: bool = True,
    auto_index: bool = True,
    keep_memory: int | None = None,
    memory_limit: int | None = None,
    query_timeout: float | None = QUERY_TIMEOUT,
    read_only: bool = False,
    export_root: str | os.PathLike[str] | None = None,
    provenance: str | None = DEFAULT_PROVENANCE,
    tenant: str | None = None,
) -> Database | RemoteDatabase:
    """Open a database: a folder path (embedded; :func:`open_local` explains the options) or
    the URL of a server (``http://host:port``, ``https://...``: ``trellis serve``) with its
    ``token`` and a per-request ``timeout`` in seconds (default 120: more than a server's
    default query limit and read wait together).

    A served store's handle (``trellisdb.client.RemoteDatabase``) has the embedded handle's API
    for writing (sessions, tasks, transactions, ``flush``, ``ingest``), reading (``query``,
    ``sql``, ``log``, tags) and views, so a script moves between the two by changing this
    string; the store's options are set where it is served.

    >>> import tempfile, trellisdb
    >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
    >>> type(db).__name__
    'Database'
    """
    local = {"embedding_dim": embedding_dim, "commit_delay": commit_delay, "max_batch_rows": max_batch_rows,
             "auto_compact": auto_compact, "compact_fragments": compact_fragments, "create": create,
             "mirror": mirror, "auto_index": auto_index, "keep_memory": keep_memory, "read_only": read_only,
             "export_root": export_root, "provenance": provenance, "tenant": tenant, "memory_limit": memory_limit,
             "query_timeout": query_timeout}
    if isinstance(target, str) and target.lower().startswith(("http://", "https://")):
        if tenant is not None:
            raise ValidationError("tenant: a served store's tenant is its token's (`trellis token create --tenant`)")
        given = sorted(k for k, v in local.items() if v != _LOCAL_DEFAULTS[k])
        if given:
            raise ValidationError(f"{', '.join(given)}: options of an embedded store; a served store is "
                                  "configured where it is served (`trellis serve`)")
        from trellisdb.client import RemoteDatabase

        return RemoteDatabase(target, token=token, timeout=timeout)
    if token is not None:
        raise ValidationError("token is for a server's URL (http://...); an embedded store has none")
    return open_local(target, embedding_dim=embedding_dim, commit_delay=commit_delay, max_batch_rows=max_batch_rows,
                      auto_compact=auto_compact, compact_fragments=compact_fragments, create=create, mirror=mirror,
                      auto_index=auto_index, keep_memory=keep_memory, read_only=read_only, export_root=export_root,
                      provenance=provenance, tenant=tenant, memory_limit=memory_limit, query_timeout=query_timeout)


def open_local(
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
    memory_limit: int | None = None,
    query_timeout: float | None = QUERY_TIMEOUT,
    read_only: bool = False,
    export_root: str | os.PathLike[str] | None = None,
    provenance: str | None = DEFAULT_PROVENANCE,
    tenant: str | None = None,
) -> Database:
    """Open the database in folder ``path``, creating it if needed.

    The folder is one implicit tenant; ``tenant`` names another, the store ``trellis serve``
    keeps for that tenant in the same folder (``<path>/tenants/<tenant>/``; see
    ``trellisdb/tenants.py``): the same store a server answers that tenant's tokens from.

    ``provenance`` is who the handle writes as: the ``provenance`` of the nodes it writes
    (default ``'api'``; a session may name another, ``db.session(provenance=...)``).

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

    ``query_timeout`` (seconds, default 60; None: no limit) is how long a caller's query
    (:meth:`Database.query`, :meth:`Database.sql`) may run: past it, it is stopped and raises
    ``QueryTimeoutError`` (view statements, materialize, export and the store's own upkeep have
    no limit). ``memory_limit`` (bytes; default half the memory DuckDB finds, RAM or the
    cgroup's) is the most the store's query engine may use, its in-memory mirror and every
    running query together: a query needing more is stopped with ``QueryMemoryError``
    (nothing spills to disk). ``keep_memory`` is a share of it.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise ValidationError(f"connect takes a folder path, not {type(path).__name__}") from None
    if not isinstance(path, str) or not path or "\x00" in path:
        raise ValidationError(f"database path {path!r} must be a non-empty text path without NUL characters")
    check_text(path, "database path")
    if tenant is not None:
        from trellisdb.tenants import tenant_path

        path = tenant_path(path, tenant)
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
        memory_limit=memory_limit,
        query_timeout=query_timeout,
        read_only=read_only,
        export_root=export_root,
        provenance=provenance,
    )


_LOCAL_DEFAULTS = {k: p.default for k, p in inspect.signature(open_local).parameters.items() if k != "path"}


class Database:
    """An open trellisdb database: the facade over the store's parts. Create it with
    :func:`trellisdb.connect`.

    Reads go through snapshots (``trellisdb/snapshot.py``), writes through the committer
    (``trellisdb/committer.py``) and the session writer (``trellisdb/writer.py``), embedding
    spaces through ``trellisdb/vectors/``, training views through ``trellisdb/training/``;
    this class wires them and keeps the public API in one place."""

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
        memory_limit: int | None = None,
        query_timeout: float | None = QUERY_TIMEOUT,
        read_only: bool = False,
        export_root: str | os.PathLike[str] | None = None,
        provenance: str | None = DEFAULT_PROVENANCE,
    ) -> None:
        check_name(provenance, "provenance", optional=True)
        self._store = Store(path, embedding_dim=embedding_dim, create=create, read_only=read_only, mirror=mirror,
                            keep_memory=keep_memory, memory_limit=memory_limit, query_timeout=query_timeout)
        self.path = path
        self.read_only = self._store.read_only
        self.embedding_dim = self._store.embedding_dim
        #: the folder exports named in TQL and on the command line are written under
        self.export_root = check_root(os.fspath(export_root), path) if export_root is not None else default_root(path)
        self._reads = Reads(self._store)
        self._committer = Committer(self._store, self._reads, commit_delay=commit_delay,
                                    max_batch_rows=max_batch_rows, auto_compact=auto_compact,
                                    compact_fragments=compact_fragments)
        self._committer.provenance = provenance
        self._reads.checkpoint = self._committer.checkpoint
        self._vectors = Vectors(self._store, self._reads, self._committer, auto_index=auto_index)
        self._committer.indexing = self._vectors.indexing
        self._committer.after_commit = self._vectors.after_commit
        self._views = ViewStore(self._store, self._reads, self._committer)
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
        at: object = None,
        attrs: Mapping[str, Any] | None = None,
        provenance: str | None = None,
    ) -> SessionWriter:
        """Start a session of ``agent`` on ``task`` (created if new); returns its writer.

        Use it as a context manager: on exit the session is marked completed
        (or failed, on an exception) and its writes are flushed. An ``id`` that
        names an existing session reopens it (status running again, the step
        counter where it stopped) if ``task``, and ``agent``, ``model`` and
        ``config`` where given, are its own; otherwise it is an error (use
        :meth:`resume`, or a new id): a session is never silently rewritten.
        ``at`` is its event time (when it started in the agent's world), ``attrs``
        its attributes (see :meth:`set_attrs`). ``provenance`` is who writes through it (the
        ``provenance`` of its nodes, e.g. ``'token:alice'``; default: the handle's, ``'api'``).
        """
        return writer.open_session(self._committer, task=task, agent=agent, model=model, config=config, id=id,
                                   task_spec=task_spec, at=at, attrs=attrs, provenance=provenance)

    def resume(self, session_id: str, *, provenance: str | None = None) -> SessionWriter:
        """A writer for an existing session (e.g. after the agent restarted); ``provenance`` as
        in :meth:`session`."""
        return writer.resume_session(self._committer, session_id, provenance)

    def add_task(self, id: str, *, name: str | None = None, spec: str | None = None,
                 tags: Sequence[str] | None = None, embedding: Sequence[float] | None = None) -> str:
        """Declare a task (what is being solved). Declaring an existing task again is a no-op
        when it says the same, and an error when it says something else (a task is never
        silently rewritten)."""
        return writer.add_task(self._committer, id, name=name, spec=spec, tags=tags, embedding=embedding)

    def set_attrs(self, entity: str, attrs: Mapping[str, Any], *, scope: str = "node", at: object = None) -> None:
        """Set attributes (JSON values by key; ``None`` retracts a key) of a node, or of a
        session or task with ``scope``; commit-stamped like every fact. See
        ``docs/data-model.md``; a session's writer has the same method.

        >>> import tempfile, trellisdb
        >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
        >>> with db.session(task="t") as s:
        ...     n = s.add_node(attrs={"island": 1})
        >>> db.set_attrs(n, {"island": 2, "migrant": True}); _ = db.flush()
        >>> db.query("NODES WHERE attr('island') = 2 RETURN attr('migrant') AS m").to_pylist()
        [{'m': True}]
        """
        writer.write_attrs(self._committer, scope, entity, attrs, at, None)

    def label(self, node_ids: str | Sequence[str], *labels: str, at: object = None) -> None:
        """Give nodes memberships (see ``SessionWriter.label``)."""
        writer.write_labels(self._committer, node_ids, labels, True, at, None)

    def unlabel(self, node_ids: str | Sequence[str], *labels: str, at: object = None) -> None:
        """Remove memberships (see ``SessionWriter.unlabel``)."""
        writer.write_labels(self._committer, node_ids, labels, False, at, None)

    def quarantine(self, node_ids: str | Sequence[str], reason: str | None = None, *, at: object = None) -> None:
        """Quarantine nodes (a poisoned or unverified write): RETRIEVE (seeds and EXPAND),
        FRONTIER and the training views leave them out from this commit on, unless a query
        says ``INCLUDE QUARANTINED`` (a view ``include_quarantined=True``). Commit-stamped like
        every fact: the reserved label ``trellis:quarantined`` (``has_label`` / ``quarantined()``
        in TQL) and, with a ``reason``, the attribute ``trellis:quarantine_reason``. See
        ``docs/data-model.md``, Provenance and trust; a write can be held from its first commit with
        ``add_node(quarantine=...)``."""
        writer.write_quarantine(self._committer, node_ids, True, reason, at, None)

    def release(self, node_ids: str | Sequence[str], *, at: object = None) -> None:
        """Release quarantined nodes (retrieved, ranked and trained on again from this commit
        on; ``AS OF`` an earlier moment still leaves them out). The reason is retracted."""
        writer.write_quarantine(self._committer, node_ids, False, None, at, None)

    def in_transaction(self) -> bool:
        return self._committer.in_transaction()

    def flush(self, meta: Mapping[str, Any] | None = None) -> int | None:
        """Commit pending group-committed writes now; return the commit id (None if nothing).

        ``meta``: run-level state to record with the commit (a mapping of JSON values, at most
        64 KiB as JSON; the ``meta`` column of ``commits``, shown by ``trellis log``). With
        ``meta`` a commit is written even when nothing is pending, to carry it.

        If the commit fails, the writes stay pending (the next flush, or the timer, retries
        them), the error is raised here, and each session whose writes it held is told on its
        next write: a failed commit never drops writes silently."""
        return self._committer.flush(meta)

    @contextmanager
    def transaction(self, message: str | None = None, meta: Mapping[str, Any] | None = None) -> Iterator[Transaction]:
        """Commit every write made in the block (in this thread) as one commit.

        Nothing is visible to readers until the block ends; an exception
        discards the writes. After the block, ``tx.commit_id`` is the id of
        the acknowledged commit (None if the block wrote nothing and had no ``meta``).
        ``meta`` is run-level state recorded with the commit, as in :meth:`flush`:

        >>> import tempfile, trellisdb
        >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db")
        >>> with db.transaction(message="checkpoint 10", meta={"best_program_id": "p7", "last_iteration": 10}):
        ...     db.add_task("t")
        't'
        >>> db.sql("SELECT json_extract_string(meta, '$.best_program_id') AS best FROM commits").to_pylist()
        [{'best': 'p7'}]
        """
        with self._committer.transaction(message, meta) as tx:
            yield tx

    def ingest(
        self, tables: Mapping[str, pa.Table], message: str | None = None, meta: Mapping[str, Any] | None = None,
        *, provenance: str | None = None,
    ) -> int:
        """Bulk-write whole Arrow tables (any subset of the data tables) as one commit.

        Columns are matched by name; missing nullable columns are filled with
        nulls (a ``nodes`` table without ``provenance`` gets the handle's; ``provenance`` given
        replaces the table's: a server writes who sent the rows). Parents of edges
        must exist in the batch or the database. Writes
        still pending in the group commit are committed first (as a transaction
        does), so the ingest can refer to them and never reuses their ids.
        """
        self._store.writable("ingest")
        check_text(message, "commit message")
        from trellisdb.bulk import prepare_bulk

        checked = commit_meta(meta)
        check_name(provenance, "provenance", optional=True)
        if provenance is not None and isinstance(tables, Mapping) and isinstance(tables.get("nodes"), pa.Table):
            nodes = tables["nodes"]
            if "provenance" in nodes.column_names:
                nodes = nodes.drop_columns(["provenance"])
            tables = {**tables, "nodes": nodes}
        self._committer.flush()
        prepared = prepare_bulk(self._reads.at(), self.embedding_dim, tables, known=self._committer.known,
                                provenance=provenance or self._committer.provenance)
        return self._committer.commit(Batch(), message, extra=prepared, meta=checked)

    def compact(self, prune_older_than: dt.timedelta = PRUNE_GRACE, *, progress: bool | None = None) -> dict[str, Any]:
        """Compact every table's fragments now and drop physical versions older
        than ``prune_older_than`` (default 5 minutes: readers in other processes
        may still scan them; pass ``timedelta(0)`` when nothing else reads).
        ``progress``: a bar over the tables' compaction and cleanup steps on stderr (None: when
        stderr is a terminal)."""
        with Steps("compact", [""] * (2 * len(self._store.all_tables())), progress) as bar, \
                self._store.tables.watched(lambda what, name: bar(f"{what} {name}")):
            return self._committer.compact(prune_older_than)

    def purge(self, session: str | Sequence[str] | None = None, *, task: str | None = None) -> dict[str, Any]:
        """Delete a session's data (or several sessions', or every session of ``task``) from
        every stored version: its nodes, their edges, rewards, comparisons, attributes, labels,
        vectors and the artifacts no other node links, the session's row, the views' rows
        derived from them (views are computed again) and the exports naming them, with an
        audit commit in the log (message ``purge``; the meta names the sessions and counts the
        rows). ``AS OF`` any earlier commit no longer shows them. Irreversible.

        An admin operation (``trellisdb/purge.py``): it holds the writer lock throughout, and
        removes every old physical version at once, so readers in other processes may get an
        error while it runs (they must reopen); after it, their next query starts over. Stop the
        purged sessions' writers first. A purge a crash interrupted is named by ``verify`` and
        finished by the next purge. Returns what went (``rows`` per table, ``commit``, ...)."""
        from trellisdb.purge import purge

        return purge(self._store, self._reads, self._committer, self._vectors, self._views, session, task=task,
                     export_roots=[self.export_root])

    def tag(self, name: str, commit: int | None = None, *, move: bool = False) -> int:
        """Name a commit (default: the latest); return its id.

        A tag names one commit: tagging the commit it names again changes nothing, and
        pointing it at another commit needs ``move=True`` (or :meth:`untag` first)."""
        return self._committer.tag(name, commit, move=move)

    def untag(self, name: str) -> int:
        """Remove tag ``name``; return the commit it named. A tag whose name a store written
        before names were checked holds (see ``verify``) is removed the same way."""
        return self._committer.untag(name)

    # ------------------------------------------------------- embedding spaces
    def create_space(self, name: str, *, target: str = "nodes", dim: int | None = None,
                     embedder: Embedder | None = None, model: str | None = None,
                     text: str | None = None) -> dict[str, Any]:
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
        return self._vectors.create_space(name, target=target, dim=dim, embedder=embedder, model=model, text=text)

    def spaces(self) -> list[dict[str, Any]]:
        """Every embedding space: name, target, dim, model, text column, table."""
        return self._vectors.spaces()

    def set_embedder(self, space: str, embedder: Embedder, *, target: str = "nodes") -> None:
        """Use ``embedder`` (in this process) for query texts and :meth:`embed` of ``space``."""
        self._vectors.set_embedder(space, embedder, target=target)

    def add_vectors(self, space: str, ids: Sequence[str], vectors: Any, *, target: str = "nodes") -> None:
        """Add vectors (an (n, dim) array or n sequences) for existing node/task ``ids`` to ``space``.

        Group-committed like every write (or part of the open transaction).
        A vector added again for an id is added next to the old one; searches
        list each id once, at its best distance (a new model belongs in a new
        space). The built-in space takes vectors through ``add_node(embedding=...)``.
        """
        self._vectors.add_vectors(space, ids, vectors, target=target)

    def embed(self, space: str, *, target: str = "nodes", batch_size: int = 256,
              progress: bool | Callable[[int, int], None] | None = None) -> int:
        """Compute the missing vectors of ``space`` with its embedder; return how many were added.

        Embeds the space's text column of every row that has text and no
        vector yet, ``batch_size`` texts per commit (so a long run keeps what
        it did, and a second call resumes). A progress bar (texts done, rate,
        time left) goes to stderr when it is a terminal; ``progress=False``
        silences it, ``progress=True`` shows it anyway, and a callable
        ``progress(done, total)`` is called after each batch instead of a bar.

        >>> db.embed("minilm", progress=False)            # doctest: +SKIP
        5000
        """
        return self._vectors.embed(space, target=target, batch_size=batch_size, progress=progress)

    def index_status(self) -> list[dict[str, Any]]:
        """Per space: state (exact | building | indexed | failed), rows, indexed_rows,
        partitions, building_for_seconds, last_build_seconds, builds, error."""
        return self._vectors.index_status()

    def build_index(self, space: str = "embedding", *, target: str = "nodes", wait: bool = True) -> dict[str, Any]:
        """Build (or rebuild) the ANN index of ``space`` now, whatever its size; with
        ``wait`` block until done. Returns the space's index status."""
        return self._vectors.build_index(space, target=target, wait=wait)

    # ------------------------------------------------------- training-data views
    def create_view(self, name: str, kind: str, *, replace: bool = False, **options: Any) -> dict[str, Any]:
        """Declare a training-data view (``trellisdb/training/`` lists the kinds and options);
        nothing is computed until :meth:`materialize`. Returns its catalog entry.

        >>> db.create_view("good", "sft", reward="reward('score')", threshold=0.9)  # doctest: +SKIP
        """
        return self._views.create(name, kind, replace=replace, **options)

    def views(self) -> list[dict[str, Any]]:
        """Every view: name, kind, definition, the commit it is materialized at and its row count."""
        return self._views.list()

    def materialize(self, name: str, as_of: AsOf = None, *, progress: bool | None = None) -> dict[str, Any]:
        """Compute view ``name`` as of a commit (default: the latest) and store its rows pinned to it.
        ``progress``: a progress bar on stderr (None: when stderr is a terminal)."""
        return self._views.materialize(name, as_of, progress=progress)

    def refresh(self, name: str, *, progress: bool | None = None) -> dict[str, Any]:
        """Bring a materialized view to the latest commit, recomputing only what the commits
        since its own touched (equal to a rebuild). ``progress``: as :meth:`materialize`'s."""
        return self._views.refresh(name, progress=progress)

    def view(self, name: str) -> Result:
        """The stored rows of a materialized view (artifact hashes, provenance ``node_ids``)."""
        return Result(self._views.rows(name))

    def drop_view(self, name: str) -> None:
        """Forget a view and delete its stored rows (exports already written stay)."""
        self._views.drop(name)

    def export(self, name: str, path: str | os.PathLike[str], format: str = "trl", *, validation: float = 0.0,
               overwrite: bool = False, skip_missing: bool = False,
               progress: bool | Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Write materialized view ``name`` to folder ``path`` as ``trl`` / ``openai`` JSONL or
        ``parquet``, with ``manifest.json``, ``provenance.parquet`` and a ``README.md`` card
        (``trellisdb/training/export.py`` has the layouts). ``validation``: the share of tasks
        split off. ``progress``: a progress bar over the rows on stderr (None: when stderr is a
        terminal), or a callable ``progress(done, total)`` called after each chunk instead.
        Returns the manifest."""
        return self._views.export(name, path, format, validation=validation, overwrite=overwrite,
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

    # ------------------------------------------------------------------ reading
    def snapshot(self, as_of: AsOf = None) -> Snapshot:
        """The database as of a commit id, tag, timestamp or None (latest): SQL, scans and the
        catalog of that moment (``trellisdb/snapshot.py``). Pending writes are flushed first."""
        self._committer.flush()
        return self._reads.at(as_of)

    def log(self) -> list[dict[str, Any]]:
        """The commits, oldest first: id, time, writer, session_id, message, rows, tags, meta (JSON text)."""
        st = self._reads.state()
        rows: list[dict[str, Any]] = commits_table(st, st.last_committed).to_pylist()
        return rows

    def tags(self) -> dict[str, int]:
        return dict(self._reads.state().tags)

    def resolve_as_of(self, as_of: AsOf) -> int:
        """The commit id a point in time names: a commit id, tag, timestamp or None (latest)."""
        return self._reads.resolve(as_of)

    def sql(self, text: str, as_of: AsOf = None,
            params: Sequence[Any] | Mapping[str, Any] | None = None) -> Result:
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
        relations) raises ``QueryError`` (``trellisdb/usersql.py``). It runs under the handle's
        ``query_timeout`` (``QueryTimeoutError`` past it; see :meth:`query_scope`).
        """
        with self._store.engine.bounded():
            return self._reads.at(as_of).sql(text, params)

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
        with self._store.engine.bounded():  # the handle's query_timeout, or the thread's scope (a server's)
            return run(self._reads, self._vectors, self, text, params)

    def query_scope(self) -> QueryScope:
        """A scope for the queries a thread runs for one caller: ``with scope:`` around them (on
        that thread), ``scope.cancel(reason)`` from any other stops the one running (a server
        does when its client goes away); the time limit is the handle's ``query_timeout``,
        counted from ``with``. Without one, each :meth:`query` and :meth:`sql` has its own."""
        return self._store.engine.scope()

    @property
    def latest_commit(self) -> int:
        """The last commit this handle has read from the log: no I/O, no flush (a health check's
        answer; :meth:`snapshot` reads the log and flushes first)."""
        return self._store.log.state.last_committed

    # ------------------------------------------------------------- maintenance
    def verify(self) -> list[str]:
        """Check every file; return problems, each naming the file (empty: healthy)."""
        s = self._store
        problems = s.guard.problems()  # damaged lines, lost records, stranded rows
        problems += [f"{s.log.path}: tag {name!r} (commit {cid}) has a name no tag may have "
                     f"({name_problem(name)}); remove it with db.untag({name!r})"
                     for name, cid in list(s.log.refresh().invalid_tags.items())]
        for name in s.all_tables():
            problems.extend(s.tables.verify(name))
        return problems

    def repair(self) -> dict[str, Any]:
        """Mend a commit log that lost records; return a report of what was done.

        Every commit whose rows are proven whole (its WAL frame; or rows in the tables that a
        commit or checkpoint record, the high-water mark ``commits.hwm`` or a later WAL segment
        says are complete) gets back its commit record; rows of commits never acknowledged, and
        the damaged lines of the log, are copied to ``<db>/lost+found/<UTC time>/`` and removed,
        and no id is used again. An acknowledged commit beyond proof (two faults at once) is
        named in the report's ``lost``, with the reason.
        Tags lost with the log's lines cannot be recovered. On a healthy store it does nothing.
        A process that had read the lines a repair dropped must open the database again.
        See ``trellisdb/storage/recovery.py`` for the report's keys.

        >>> import tempfile, trellisdb
        >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
        >>> report = db.repair()
        >>> report["damage"], report["recovered"], report["lost_found"]
        ([], [], None)
        """
        self._store.writable("repair")
        with self._store.lock.held():
            return self._store.guard.repair()

    def close(self) -> None:
        """Flush pending writes and release resources."""
        if self._committer.closed:
            return
        self._committer.close()
        self._vectors.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<trellisdb.Database {self.path!r} commit={self._store.log.state.last_committed}>"
