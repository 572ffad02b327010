"""The write side: staged rows, group commit, transactions, the commit protocol, and the
lookups a write makes before it stages anything.

``Committer`` is what every writer uses (``SessionWriter``, bulk ingest, ``db.embed``,
``add_vectors``): ``sink`` gives the batch a write goes to (the thread's transaction, or the
group batch committed by a timer or ``flush``), ``commit`` runs the commit protocol of
``ARCHITECTURE.md`` under the writer lock, and the write-path lookups (does a node exist,
its original row, is an artifact stored) look at pending batches first, then committed
data through a ``Snapshot``. Tags and compaction are commits to the log and the tables too.

>>> import tempfile
>>> from trellisdb.store import Store
>>> from trellisdb.snapshot import Reads
>>> store = Store(tempfile.mkdtemp() + "/db", embedding_dim=4)
>>> c = Committer(store, Reads(store))
>>> with c.sink() as b:
...     b.rows["tasks"].append({"id": "t", "name": "t"})
>>> c.flush(), c.flush()
(1, None)
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from trellisdb.batch import Batch
from trellisdb.errors import (
    CommitError,
    CorruptionError,
    TransactionError,
    TrellisError,
    UnknownCommitError,
    UnknownTagError,
    ValidationError,
)
from trellisdb.membership import Fingerprints, id_hash
from trellisdb.names import check_name, check_text, did_you_mean
from trellisdb.rules import commit_meta
from trellisdb.schema import DATA_TABLES
from trellisdb.snapshot import Reads
from trellisdb.storage.tables import PRUNE_GRACE
from trellisdb.storage.wal import Frame, Payload, WalView, rows_table
from trellisdb.store import Store

log = logging.getLogger("trellisdb")

#: Seconds between background cleanups of old physical versions (per process).
CLEANUP_INTERVAL = 60.0
#: The longest pause between retries of a failed group commit (the pause doubles from ``commit_delay``).
RETRY_MAX_DELAY = 5.0
#: Commits of at most this many rows and bytes are written to the WAL (one fsynced append);
#: bigger ones (bulk ingest) are appended to Lance directly.
WAL_MAX_ROWS = 4096
WAL_MAX_BYTES = 8 << 20
#: A background checkpoint moves the WAL into Lance once it holds this many bytes or commits...
CHECKPOINT_BYTES = 32 << 20
CHECKPOINT_COMMITS = 2000
#: ... or once no commit came for this many seconds.
CHECKPOINT_DELAY = 1.0
#: The columns of a node's latest row that a rewrite (a status change) copies: ``born`` resolved
#: to the commit that first wrote the node, so the rewrite keeps the node's insertion order; the
#: others as they are (``provenance`` among them: a rewrite keeps who wrote the node).
_REWRITE = "* EXCLUDE (commit_id, born, seq), coalesce(born, commit_id) AS born"
#: The ``provenance`` of the nodes a handle writes unless a session names another
#: (``connect(provenance=...)``, ``db.session(provenance=...)``).
DEFAULT_PROVENANCE = "api"
#: An artifact hash as trellisdb writes it (sha256, lower-case hex).
_SHA256 = re.compile(r"[0-9a-f]{64}")
#: Artifact hashes confirmed stored, kept to answer repeated duplicates without a query.
KNOWN_HASHES = 4096


class Transaction:
    """Handle of a :meth:`Database.transaction` block."""

    commit_id: int | None = None


@dataclass
class _Failure:
    """A group commit that failed: its error, and the writers (session ids; None for writes made
    outside a session) not yet told."""

    error: BaseException
    writers: set[str | None]


def _no_tables() -> set[str]:
    return set()


def _nothing(data: Mapping[str, pa.Table]) -> None:
    return None


def _frames_since(wal: WalView, upto: int) -> dict[int, Frame]:
    """The WAL's frames of commits above ``upto``, by id (read from the newest back)."""
    out: dict[int, Frame] = {}
    frames = wal.frames
    for k in range(len(frames) - 1, -1, -1):
        if frames[k].id <= upto:
            break
        out[frames[k].id] = frames[k]
    return out


def _has_vectors(extra: Mapping[str, pa.Table] | None) -> bool:
    """Whether an ingest brings vectors (an ``embedding`` column with values): those go to Lance
    at once, where index upkeep (started after the commit) reads them."""
    return any("embedding" in t.column_names and t.column("embedding").null_count < t.num_rows
               for t in (extra or {}).values())


class Committer:
    """Pending writes of one open store and the commits that make them durable.

    ``indexing()`` names the tables an index build is running on (not compacted meanwhile);
    ``after_commit(data)`` is called with the rows of each commit once it is acknowledged
    (the vectors service starts index upkeep from it)."""

    def __init__(
        self,
        store: Store,
        reads: Reads,
        *,
        commit_delay: float = 0.05,
        max_batch_rows: int = 10_000,
        auto_compact: bool = True,
        compact_fragments: int = 8,
        indexing: Callable[[], set[str]] = _no_tables,
        after_commit: Callable[[Mapping[str, pa.Table]], None] = _nothing,
    ) -> None:
        self.store = store
        self.reads = reads
        self.commit_delay = commit_delay
        self.max_batch_rows = max_batch_rows
        self.auto_compact = auto_compact
        self.compact_fragments = compact_fragments
        self.indexing = indexing
        self.after_commit = after_commit
        #: the provenance of the nodes written without one of their own (a session's)
        self.provenance: str | None = DEFAULT_PROVENANCE
        self._writer_name = f"{socket.gethostname()}:{os.getpid()}"
        self._state_lock = threading.RLock()
        self._pending = Batch()
        self._tx = threading.local()
        self._timer: threading.Timer | None = None
        self._failure: _Failure | None = None
        self._retry_delay = 0.0
        self._known_nodes: set[str] = set()
        #: session and task ids known committed (this writer's commits): few, kept whole
        self._known_ids: dict[str, set[str]] = {"sessions": set(), "tasks": set()}
        #: artifact hashes confirmed stored (a bounded cache: duplicates recur)
        self._known_hashes: set[str] = set()
        #: the last purge (``LogState.purged``) the caches above have been emptied after
        self._purge_seen = 0
        #: fingerprints of the stored artifacts, as of commit ``_fp_upto`` (-1: not loaded) and
        #: this writer's commits above it
        self._fingerprints = Fingerprints()
        self._fp_upto = -1
        self._fp_own: set[int] = set()
        self._fp_lock = threading.Lock()
        #: fingerprints of every committed node id (``membership.id_hash``), as of commit
        #: ``_nfp_upto`` (-1: not loaded): an explicit id not among them is new, with no query
        self._node_fps = Fingerprints()
        self._nfp_upto = -1
        self._nfp_lock = threading.Lock()
        self._last_cleanup = time.monotonic()
        self._cleanup_thread: threading.Thread | None = None
        self.closed = False
        #: commits up to this many rows and bytes go to the WAL; bigger ones straight to Lance
        self.wal_max_rows = WAL_MAX_ROWS
        self.wal_max_bytes = WAL_MAX_BYTES
        #: a background checkpoint starts when the WAL holds this much, or commits paused this long
        self.checkpoint_bytes = CHECKPOINT_BYTES
        self.checkpoint_commits = CHECKPOINT_COMMITS
        self.checkpoint_delay = CHECKPOINT_DELAY
        #: whether this handle has checkpointed (its first checkpoint checks Lance for stray rows)
        self._checkpointed = False
        self._wal_bytes = 0
        self._ckpt_lock = threading.Lock()
        self._ckpt_wake = threading.Event()
        self._ckpt_due: float | None = None
        self._ckpt_thread: threading.Thread | None = None

    @property
    def embedding_dim(self) -> int:
        return self.store.embedding_dim

    # ------------------------------------------------------------ batches
    def batches(self) -> list[Batch]:
        """The batches holding this thread's uncommitted writes: its transaction's (if one), then the group's."""
        tx = getattr(self._tx, "batch", None)
        return [self._pending] if tx is None else [tx, self._pending]

    def in_transaction(self) -> bool:
        return getattr(self._tx, "batch", None) is not None

    @contextmanager
    def sink(self, writer: str | None = None) -> Iterator[Batch]:
        """The batch a write goes to: the thread's transaction, or the group batch. ``writer``
        (the session writing, if one) is told here of a failed group commit that held its writes."""
        self.store.writable("writing")
        if self.closed:
            raise TransactionError(f"database {self.store.path} is closed")
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
        except BaseException as e:  # recorded by flush for the writers it concerns; retried below
            log.warning("a group commit failed (retried): %s", e)
            with self._state_lock:
                if len(self._pending) and not self.closed:
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

    def flush(self, meta: Mapping[str, Any] | None = None) -> int | None:
        """Commit pending group-committed writes now; return the commit id (None if nothing and
        no ``meta``: with ``meta``, a commit is written even without rows, to carry it).

        If the commit fails, the writes stay pending (the next flush, or the timer, retries
        them), the error is raised here, and each session whose writes it held is told on its
        next write: a failed commit never drops writes silently."""
        checked = commit_meta(meta)
        with self._state_lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            batch, self._pending = self._pending, Batch()
            if not len(batch) and checked is None:
                return None
            try:
                cid = self.commit(batch, None, meta=checked)
            except BaseException as e:
                # Nothing was staged meanwhile (we hold the state lock): the batch is the pending one again.
                self._pending = batch
                self._failure = _Failure(e, set(batch.writers))
                raise
            self._failure = None
            self._retry_delay = 0.0
            return cid

    @contextmanager
    def transaction(self, message: str | None = None, meta: Mapping[str, Any] | None = None) -> Iterator[Transaction]:
        """Commit every write made in the block (in this thread) as one commit (see
        :meth:`Database.transaction`)."""
        self.store.writable("transaction")
        check_text(message, "commit message")
        checked = commit_meta(meta)
        if self.in_transaction():
            raise TransactionError("transactions do not nest; commit the outer one first")
        tx = Transaction()
        self._tx.batch = Batch()
        try:
            yield tx
            batch = self._tx.batch
        finally:
            self._tx.batch = None
        if len(batch) or checked is not None:
            # Earlier group-committed writes (e.g. the parent of a node in this
            # transaction) commit first, so the transaction never overtakes them.
            self.flush()
            tx.commit_id = self.commit(batch, message, meta=checked)

    # ------------------------------------------------------------ commits
    def commit(
        self, batch: Batch, message: str | None, extra: Mapping[str, pa.Table] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> int:
        """Commit ``batch`` (and the whole Arrow tables ``extra``) for a caller that waits for it: a
        failure before the commit point is raised (as ``CommitError`` if it is not a TrellisError)
        and nothing of the batch is visible; one after it does not undo the acknowledged commit."""
        try:
            return self._commit(batch, message=message, extra=extra, meta=meta)
        except Exception as e:
            if batch.commit_id is not None:
                log.warning("commit %d is durable, but what follows it failed: %s", batch.commit_id, e)
                return batch.commit_id
            if isinstance(e, TrellisError):
                raise
            raise CommitError(f"the commit failed: {e}; nothing of it was written") from e

    def _commit(
        self, batch: Batch, message: str | None, extra: Mapping[str, pa.Table] | None = None,
        meta: dict[str, Any] | None = None,
    ) -> int:
        s = self.store
        batch.settle_born()
        latest = batch.latest_rows()
        vectors = batch.vector_tables(0)  # commit_id: set below, or taken from the frame's id
        whole = {**vectors, **(extra or {})}  # tables an ingest brought whole (their commit_id set the same way)
        rows = sum(len(r) for r in latest.values()) + sum(t.num_rows for t in whole.values())
        small = rows <= self.wal_max_rows and batch.approx_bytes() + sum(
            t.nbytes for t in (extra or {}).values()) <= self.wal_max_bytes and not _has_vectors(extra)
        # encoded before the lock is taken: writers in other threads and processes wait only for the append.
        # A small ingest goes to the WAL too (its tables as Arrow IPC): one fsync, no Lance append per table
        payload = Payload.of(latest, whole) if small else None
        with s.lock.held():
            mark = s.log.repair_tail()  # refuses when the log lost acknowledged records; reads the log
            st = s.log.state
            if st.problems:
                raise CorruptionError(
                    f"the commit log is damaged ({st.problems[0][1]}); writes are refused until "
                    "db.repair() (`trellis repair`) mends it and `trellis verify` is clean. Reads still work"
                )
            s.guard.check_rows(st, mark)  # rows of commits the log does not record: refused
            self._collect_aborted()
            cid = s.guard.next_id(st, mark)
            record = {"op": "commit", "id": cid, "time": time.time(), "writer": self._writer_name,
                      "session": batch.session_id, "message": message}
            if meta is not None:  # checked by rules.commit_meta
                record["meta"] = meta
            if payload is not None:
                # the commit point: one fsynced frame in the WAL; Lance gets the rows at a checkpoint
                s.log.append_frame({**record, "rows": rows}, payload)
                batch.commit_id = cid
                self._wal_bytes += payload.nbytes
            else:
                # a big commit goes to Lance itself; the WAL's commits (lower ids) go first
                self._checkpoint_locked()
                data = batch.to_arrow(s.embedding_dim, cid)
                for name, t in [*(extra or {}).items(), *vectors.items()]:  # stamped with this commit's id
                    t = t.set_column(
                        t.schema.get_field_index("commit_id"), "commit_id", pa.array([cid] * t.num_rows, pa.int64())
                    )
                    data[name] = pa.concat_tables([data[name], t]) if name in data else t
                written = [name for name in (*DATA_TABLES, *batch.vectors) if name in data and data[name].num_rows]
                s.log.append([{"op": "begin", "id": cid}])
                for name in written:
                    s.tables.append(name, data[name])
                s.log.append([{**record, "rows": sum(data[n].num_rows for n in written)}])
                batch.commit_id = cid  # the commit point: from here on, a failure must not make a retry write it again
                s.log.refresh()
                self._compact(written)
                self.after_commit(data)
            self._known_nodes.update(batch.nodes)
            self._known_ids["sessions"].update(batch.sessions)
            self._known_ids["tasks"].update(batch.tasks)
            for name, t in (extra or {}).items():
                if name in ("sessions", "tasks"):
                    self._known_ids[name].update(t.column("id").to_pylist())
                elif payload is not None and name in ("nodes", "artifacts"):  # a small ingest's, as add_node's
                    self._remember_stored(name, t.column("id" if name == "nodes" else "hash").to_pylist())
            self._remember_stored("artifacts", batch.hashes)
            if self._fp_upto >= 0:
                with self._fp_lock:
                    self._fingerprints.add_hashes(batch.hashes)
                    if extra and "artifacts" in extra:  # an ingest's artifacts: not in the batch
                        self._fingerprints.add_hashes(extra["artifacts"].column("hash").to_pylist())
                    self._fp_own.add(cid)
        if payload is not None:
            self._after_wal_commit()
        return cid

    def _compact(self, written: Sequence[str]) -> None:
        """Size-tiered compaction of the tables a Lance append touched (writer lock held)."""
        if not self.auto_compact:
            return
        busy = self.indexing()  # compacting these would preempt their index build
        for name in written:
            if name in busy:
                continue
            # best effort: an index build committing at the same moment can make Lance refuse
            # the rewrite; the next commit compacts instead
            with contextlib.suppress(OSError, RuntimeError, ValueError):
                self.store.tables.compact_tiered(name, self.compact_fragments)
        self._maybe_cleanup()

    # ------------------------------------------------------- checkpoints
    def _after_wal_commit(self) -> None:
        """Checkpoint in the background when the WAL is big, or once commits pause."""
        if self._wal_bytes >= self.checkpoint_bytes or self.store.log.state.wal.n_frames >= self.checkpoint_commits:
            self._start_checkpoint(0.0)
        else:
            self._start_checkpoint(self.checkpoint_delay)

    def _start_checkpoint(self, delay: float) -> None:
        with self._ckpt_lock:
            due = time.monotonic() + delay
            earlier = self._ckpt_due is None or due < self._ckpt_due
            self._ckpt_due = due
            if self._ckpt_thread is None or not self._ckpt_thread.is_alive():
                self._ckpt_thread = threading.Thread(target=self._checkpoint_loop, name="trellisdb-checkpoint",
                                                     daemon=True)
                self._ckpt_thread.start()
            elif earlier:  # a later time is noticed when the thread wakes: no wake-up per commit
                self._ckpt_wake.set()

    def _checkpoint_loop(self) -> None:
        while not self.closed:
            with self._ckpt_lock:
                due = self._ckpt_due
                self._ckpt_wake.clear()
                if due is None:
                    self._ckpt_thread = None
                    return
            wait = due - time.monotonic()
            if wait > 0:
                self._ckpt_wake.wait(wait)
                continue
            with self._ckpt_lock:
                if self._ckpt_due != due:
                    continue  # moved meanwhile
                self._ckpt_due = None
            try:
                self.checkpoint()
            except Exception as e:  # the WAL keeps the commits; the next checkpoint tries again
                log.warning("a checkpoint failed (the commits stay in the WAL, retried later): %s", e)
                with self._ckpt_lock:
                    self._ckpt_due = time.monotonic() + RETRY_MAX_DELAY

    def checkpoint(self, upto: int | None = None) -> int:
        """Move the WAL's commits (those up to ``upto``; default all) into Lance; return how many
        commits moved. Readers see the same rows before and after."""
        s = self.store
        if s.read_only:
            return 0
        st = s.log.state
        if not st.wal.n_frames or (upto is not None and st.wal.upto >= upto):
            return 0
        with s.lock.held():
            s.log.repair_tail()
            return self._checkpoint_locked()

    def _checkpoint_locked(self) -> int:
        """Checkpoint (writer lock held, log refreshed): append every WAL commit's rows to Lance,
        one append per table, then their commit records and a ``checkpoint`` record naming the
        next WAL segment to the commit log (one fsync), then delete the old segment.

        A crash before the ``checkpoint`` record leaves rows of WAL commits in Lance that no
        commit-log record covers: readers ignore Lance rows above ``lance_upto``, and the next
        checkpoint deletes them first (its ``checkpoint-begin`` record says they may exist)."""
        s = self.store
        st = s.log.refresh()
        view = st.wal
        if not view.frames:
            self._remove_old_segments()
            return 0
        upto = view.frames[-1].id
        if st.checkpoint_begun > view.upto:  # an earlier checkpoint died half-way: its rows go first
            for name in s.all_tables():
                s.tables.delete(name, f"commit_id > {int(view.upto)}")
        elif not self._checkpointed:
            # this handle's first checkpoint: one that died half-way before it opened may have left rows
            # no checkpoint-begin record names (the line damaged, and no mark to tell): counted, not trusted
            for name in s.all_tables():
                s.tables.delete_if_any(name, f"commit_id > {int(view.upto)}")
        self._checkpointed = True
        s.log.append([{"op": "checkpoint-begin", "upto": upto}])
        frames = view.frames
        names = {n for f in frames for n in f.names()}
        written = [n for n in (*DATA_TABLES, *sorted(names - set(DATA_TABLES))) if n in names]
        merged = {n: rows_table(frames, n, s.tables.dataset(n).schema) for n in written}
        for name in written:
            s.tables.append(name, merged[name])
        gen = st.wal_gen + 1
        s.log.append([*({k: v for k, v in f.record.items() if k not in ("tables", "bytes", "pcrc")}
                        for f in view.frames),
                      {"op": "checkpoint", "upto": upto, "wal": gen}])
        s.log.refresh()
        self._wal_bytes = 0
        self._remove_old_segments()
        self._compact(written)
        self.after_commit(merged)
        return len(view.frames)

    def _remove_old_segments(self) -> None:
        for path in self.store.log.wal_segments():
            with contextlib.suppress(OSError):
                os.remove(path)

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
            for name in self.store.all_tables():
                if self.closed:
                    return
                # Best effort: a failure (another process cleaning the same
                # files) leaves files behind, never removes live ones.
                try:
                    self.store.tables.cleanup(name)
                except Exception as e:
                    log.info("cleanup of old versions of %s skipped: %s", name, e)

        self._cleanup_thread = threading.Thread(target=run, name="trellisdb-cleanup", daemon=True)
        self._cleanup_thread.start()

    def _collect_aborted(self) -> None:
        """Delete rows of commits that began but never committed (holding the lock)."""
        s = self.store
        dead = sorted(s.log.state.open_ids)  # we hold the lock: nothing is in flight
        if not dead:
            return
        pred = f"commit_id IN ({', '.join(str(i) for i in dead)})"
        for name in s.all_tables():
            s.tables.delete(name, pred)
        s.log.append([{"op": "collected", "ids": dead}])
        s.log.refresh()

    def compact(self, prune_older_than: dt.timedelta = PRUNE_GRACE) -> dict[str, Any]:
        """Compact every table's fragments now and drop physical versions older than ``prune_older_than``."""
        self.store.writable("compact")
        self.flush()
        s = self.store
        with s.lock.held():
            s.log.repair_tail()
            self._checkpoint_locked()
            out = {name: s.tables.compact(name) for name in s.all_tables()}
        for name in s.all_tables():
            s.tables.cleanup(name, prune_older_than)
        return out

    # ---------------------------------------------------------------- tags
    def tag(self, name: str, commit: int | None = None, *, move: bool = False) -> int:
        """Name a commit (default: the latest); see :meth:`Database.tag`."""
        self.store.writable("tag")
        check_name(name, "tag name")
        if name.isdigit():
            raise ValidationError(f"tag name {name!r} must not be a number (AS OF COMMIT takes numbers)")
        if commit is not None and (isinstance(commit, bool) or not isinstance(commit, int)):
            raise ValidationError(f"commit must be a commit id (an integer) or None, not {commit!r}")
        self.flush()
        s = self.store
        with s.lock.held():
            s.log.repair_tail()
            st = s.log.refresh()
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
            s.log.append([{"op": "tag", "name": name, "id": cid}])
            s.log.refresh()
        return cid

    def untag(self, name: str) -> int:
        """Remove tag ``name``; return the commit it named."""
        self.store.writable("untag")
        if not isinstance(name, str):
            raise ValidationError(f"tag name must be a string, got {type(name).__name__}")
        s = self.store
        with s.lock.held():
            s.log.repair_tail()
            st = s.log.refresh()
            cid = st.tags.get(name, st.invalid_tags.get(name))
            if cid is None:
                raise UnknownTagError(f"tag {name!r} does not exist{did_you_mean(name, list(st.tags))}")
            s.log.append([{"op": "untag", "name": name}])
            s.log.refresh()
        return cid

    # ------------------------------------------------- lookups for writes
    def lookup(self, text: str, params: list[Any]) -> list[dict[str, Any]]:
        """Rows of an internal query as of the latest commit."""
        return self.reads.at_commit(self.reads.state().last_committed).rows(text, params)

    def exists(self, table: str, col: str, value: str) -> bool:
        """Whether any committed row of ``table`` has ``col = value``."""
        return bool(self.lookup(f"SELECT 1 FROM {table}_history WHERE {col} = $1 LIMIT 1", [value]))

    def missing_nodes(self, ids: list[str]) -> list[str]:
        """The ids among ``ids`` that are neither pending nor committed."""
        # Under the state lock: a group commit moving rows from pending to the
        # store must not make them invisible to this check half-way.
        with self._state_lock:
            self._after_purge()
            batches = self.batches()
            todo = [i for i in ids if i not in self._known_nodes and not any(i in b.nodes for b in batches)]
            if not todo:
                return []
            found = {r["id"] for r in self.lookup(
                "SELECT DISTINCT id FROM nodes_history WHERE id IN (SELECT unnest($1::VARCHAR[]))", [todo])}
            self._known_nodes.update(found)
            return [i for i in todo if i not in found]

    def node_rows(self, ids: Sequence[str], owners: dict[str, Batch] | None = None) -> dict[str, dict[str, Any]]:
        """The latest row of each node (pending or committed) by id; unknown ids are absent.
        ``owners`` gets the pending batch of each row found pending (read under the lock: a
        group commit may take the batch away right after)."""
        out: dict[str, dict[str, Any]] = {}
        with self._state_lock:
            for b in self.batches():
                for i in ids:
                    if i in b.nodes and i not in out:
                        out[i] = b.nodes[i]
                        if owners is not None:
                            owners[i] = b
            todo = [i for i in ids if i not in out]
            if len(todo) == 1:
                rows = self.lookup(
                    f"SELECT {_REWRITE} FROM nodes_full_history WHERE id = $1 ORDER BY commit_id DESC LIMIT 1",
                    todo,
                )
            elif todo:
                rows = self.lookup(
                    f"SELECT {_REWRITE} FROM nodes_full_history WHERE id IN (SELECT unnest($1::VARCHAR[])) "
                    "QUALIFY row_number() OVER (PARTITION BY id ORDER BY commit_id DESC) = 1",
                    [todo],
                )
            else:
                rows = []
            out.update((r["id"], r) for r in rows)
        return out

    def node_sessions(self, ids: Sequence[str]) -> dict[str, str]:
        """The session of each node among ``ids`` that exists (pending or committed; the
        session that first wrote it); unknown ids are absent."""
        out: dict[str, str] = {}
        with self._state_lock:  # as missing_nodes: a group commit must not hide a node half-way
            for b in self.batches():
                for i in ids:
                    if i in b.nodes and i not in out:
                        out[i] = b.nodes[i]["session_id"]
            todo = [i for i in ids if i not in out]
            if todo:
                out.update((r["id"], r["session_id"]) for r in self.lookup(
                    "SELECT id, arg_min(session_id, commit_id) AS session_id FROM nodes_history "
                    "WHERE id IN (SELECT unnest($1::VARCHAR[])) GROUP BY id", [todo]))
        return out

    def _remember_stored(self, table: str, values: Iterable[str]) -> None:
        """Remember node ids (all) or artifact hashes (a bounded cache: duplicates recur) this
        writer committed."""
        if table == "nodes":
            self._known_nodes.update(values)
            return
        if len(self._known_hashes) >= KNOWN_HASHES:
            self._known_hashes.clear()
        self._known_hashes.update(values)

    def known(self, table: str, col: str, values: Sequence[str]) -> tuple[set[str], set[str]]:
        """What memory says of committed ``table.col`` for ``values``: (present, absent); the
        rest is unknown (a query decides). Node ids and artifact hashes absent by their
        fingerprints (no false negatives; caught up with the log first), node ids present
        when known; session and task ids present when this writer committed them."""
        self._after_purge()
        if (table, col) == ("nodes", "id"):
            present = {v for v in values if v in self._known_nodes}
            rest = [v for v in values if v not in present]
            with self._nfp_lock:
                self._catch_up_node_fingerprints()
                maybe = self._node_fps.may_contain_many(id_hash(v) for v in rest)
            return present, {v for v, m in zip(rest, maybe.tolist(), strict=True) if not m}
        if (table, col) == ("artifacts", "hash"):
            hexes = [v for v in values if _SHA256.fullmatch(v)]  # anything else: the query answers
            with self._fp_lock:
                self._catch_up_fingerprints()
                maybe = self._fingerprints.may_contain_many(hexes)
            absent = {v for v, m in zip(hexes, maybe.tolist(), strict=True) if not m}
            return {v for v in values if v in self._known_hashes} - absent, absent
        if col == "id" and table in self._known_ids:
            return set(values) & self._known_ids[table], set()
        return set(), set()

    def node_original(self, node_id: str, edge_kind: str) -> tuple[dict[str, Any], set[str]] | None:
        """The first row written for a node and its ``edge_kind`` parents from
        that same write: what an idempotent retry of ``add_node`` must match."""
        with self._state_lock:
            for b in self.batches():
                if node_id in b.added:
                    parents = {e["src"] for e in b.rows["edges"] if e["dst"] == node_id and e["kind"] == edge_kind}
                    return b.nodes[node_id], parents
            with self._nfp_lock:
                self._catch_up_node_fingerprints()
                if not self._node_fps.may_contain(id_hash(node_id)):
                    return None  # a new id (the common case): answered from memory
            rows = self.lookup("SELECT * FROM nodes_full_history WHERE id = $1 ORDER BY commit_id LIMIT 1", [node_id])
            if not rows:
                return None
            first = rows[0]
            srcs = self.lookup(
                "SELECT src FROM edges_history WHERE dst = $1 AND kind = $2 AND commit_id = $3",
                [node_id, edge_kind, first.pop("commit_id")],
            )
            return first, {r["src"] for r in srcs}

    def has_artifact(self, h: str) -> bool:
        """Whether artifact ``h`` is stored or pending in the group batch: from memory (the
        fingerprints of every stored artifact, ``membership.py``) unless a fingerprint matches,
        which a query confirms (and a bounded cache of confirmed ones remembers)."""
        self._after_purge()
        if h in self._known_hashes or h in self._pending.hashes:
            return True
        with self._fp_lock:
            self._catch_up_fingerprints()
            if not self._fingerprints.may_contain(h):
                return False
        if self.exists("artifacts", "hash", h):
            if len(self._known_hashes) >= KNOWN_HASHES:
                self._known_hashes.clear()
            self._known_hashes.add(h)
            return True
        return False

    def _catch_up_fingerprints(self) -> None:
        """Extend the fingerprints by the artifacts of commits other writers made since the last
        look (this one's own are added as it commits); the first call loads them all. The log as
        last read will do: one another writer stored since is at worst stored again (the same
        content under the same hash), and every commit reads the log."""
        st = self.store.log.state
        last = st.last_committed
        if self._fp_upto >= last:
            return
        since: int | None = -1
        if self._fp_upto >= 0:
            others = [i for i in range(self._fp_upto + 1, last + 1) if i in st.commits and i not in self._fp_own]
            wal = st.wal
            # other writers' small commits still in the WAL: their hashes are in memory already
            in_wal = _frames_since(wal, self._fp_upto) if others and others[0] > wal.upto else {}
            if all(i in in_wal for i in others):
                self._fingerprints.add_hashes(h for i in others for h in in_wal[i].values("artifacts", "hash"))
                since = None
            else:
                since = self._fp_upto
        if since is not None:
            t = self.reads.at_commit(last, st).execute(
                "SELECT TRY_CAST('0x' || hash[1:16] AS UBIGINT) AS f FROM artifacts_history WHERE commit_id > $1",
                [since], tables=("artifacts",))
            self._fingerprints.add_array(t.column("f").drop_null())
        self._fp_upto = last
        self._fp_own = {i for i in self._fp_own if i > last}

    def _catch_up_node_fingerprints(self) -> None:
        """Extend the node-id fingerprints by the commits made since the last look, this
        writer's included (caller holds ``_nfp_lock``); the first call loads them all. The log
        is re-read first, as a query would: an id another writer committed must be found.
        Commits still in the WAL are read from its frames in memory (rows and a small ingest's
        tables; this writer's own as written); otherwise (a big commit went to Lance, or a
        checkpoint came since the last look) one query reads the ids committed since."""
        st = self.reads.state()
        last = st.last_committed
        if self._nfp_upto >= last:
            return
        since: int | None = -1
        if self._nfp_upto >= 0:
            new = [i for i in range(self._nfp_upto + 1, last + 1) if i in st.commits]
            wal = st.wal
            in_wal = _frames_since(wal, self._nfp_upto) if new and new[0] > wal.upto else {}
            if all(i in in_wal for i in new):
                self._node_fps.add_hashes(id_hash(v) for i in new for v in in_wal[i].values("nodes", "id"))
                since = None
            else:
                since = self._nfp_upto
        if since is not None:
            t = self.reads.at_commit(last, st).execute(
                "SELECT TRY_CAST('0x' || md5(id)[1:16] AS UBIGINT) AS f FROM nodes_history "
                "WHERE commit_id > $1", [since], tables=("nodes",))
            self._node_fps.add_array(t.column("f").drop_null())
        self._nfp_upto = last

    def session_row(self, session_id: str) -> dict[str, Any] | None:
        """The latest row of a session (pending or committed), or None."""
        with self._state_lock:
            for b in self.batches():
                if session_id in b.sessions:
                    return dict(b.sessions[session_id])
        rows = self.lookup("SELECT * EXCLUDE (commit_id) FROM sessions WHERE id = $1", [session_id])
        return rows[0] if rows else None

    def task_row(self, task_id: str, b: Batch) -> dict[str, Any] | None:
        """The row of a task, pending in ``b`` or committed, or None."""
        if task_id in b.tasks:
            return next((r for r in reversed(b.rows["tasks"]) if r["id"] == task_id), None)
        rows = self.lookup("SELECT * EXCLUDE (commit_id) FROM tasks_full WHERE id = $1", [task_id])
        return rows[0] if rows else None

    def pending_task(self, task_id: str) -> bool:
        return any(task_id in b.tasks for b in self.batches())

    def comparison_row(self, comparison_id: str) -> dict[str, Any] | None:
        """The latest row of a comparison (pending or committed), or None."""
        with self._state_lock:
            for b in self.batches():
                row = next((r for r in reversed(b.rows["comparisons"]) if r["id"] == comparison_id), None)
                if row is not None:
                    return dict(row)
        rows = self.lookup("SELECT * EXCLUDE (commit_id) FROM comparisons WHERE id = $1", [comparison_id])
        return rows[0] if rows else None

    def max_step(self, session_id: str) -> int:
        """The highest step a session has written (pending or committed), 0 if none."""
        rows = self.lookup("SELECT coalesce(max(step), 0) AS s FROM nodes WHERE session_id = $1", [session_id])
        pending = [r["step"] or 0 for b in self.batches() for r in b.nodes.values() if r["session_id"] == session_id]
        return max([int(rows[0]["s"]), *pending])

    # --------------------------------------------------------------- purge
    def begin_purge(self, sessions: Sequence[str]) -> None:
        """Log that a purge of ``sessions`` begins (writer lock held, log refreshed): until its
        audit commit (:meth:`end_purge`) the log's ``purging`` names them, so that ``verify``
        reports a purge a crash interrupted, and a purge run again finishes it."""
        self.store.log.append([{"op": "purge-begin", "sessions": list(sessions)}])
        self.store.log.refresh()

    def end_purge(self, meta: dict[str, Any]) -> int:
        """Append a purge's audit commit (no rows, message "purge", ``meta``) to the commit log
        itself (writer lock held, the WAL checkpointed), and forget what this writer remembered
        of committed rows; returns its id. Its ``"purge": true`` tells every reader, in any
        process, that rows were deleted: they drop what they mirrored (``reader.py``)."""
        s = self.store
        mark = s.log.repair_tail()
        if s.log.state.wal.frames:  # a record in the log says Lance holds every commit below it
            self._checkpoint_locked()
        # as every commit does: a commit a writer died in is collected before a later id is taken
        # (repair takes a begun commit below a later one for a whole one)
        self._collect_aborted()
        cid = s.guard.next_id(s.log.state, mark)
        s.log.append([{"op": "commit", "id": cid, "time": time.time(), "writer": self._writer_name,
                       "session": None, "message": "purge", "meta": meta, "rows": 0, "purge": True}])
        s.log.refresh()
        self.forget()
        return cid

    def forget(self) -> None:
        """Drop what this writer remembers of committed rows (a purge deleted some): the node,
        session and task ids known committed and the artifact hashes confirmed stored. The
        fingerprints stay: they only say "maybe stored", and a query decides."""
        with self._state_lock:
            self._purge_seen = max(self._purge_seen, self.store.log.state.purged)
            self._known_nodes.clear()
            for ids in self._known_ids.values():
                ids.clear()
            self._known_hashes.clear()

    def _after_purge(self) -> None:
        """Forget (:meth:`forget`) once the log shows a purge not seen yet (another process's)."""
        if self.store.log.state.purged > self._purge_seen:
            self.forget()

    # --------------------------------------------------------------- close
    def close(self) -> None:
        """Flush pending writes and checkpoint the WAL; wait for background work to stop."""
        if self.closed:
            return
        self.flush()
        try:
            self.checkpoint()
        except Exception as e:  # the commits are durable in the WAL; the next writer checkpoints them
            log.warning("the checkpoint at close failed (the commits stay in the WAL): %s", e)
        self.closed = True
        with self._ckpt_lock:
            self._ckpt_due = None
            self._ckpt_wake.set()
            t = self._ckpt_thread
        if t is not None:
            t.join()
        if self._cleanup_thread is not None:
            self._cleanup_thread.join()
