"""Index upkeep: when a space's ANN index is built, updated or retrained, on one background thread.

After a commit that wrote vectors, the counts of indexed and unindexed rows are read from
Lance metadata (no scan); at :data:`INDEX_MIN_ROWS` vectors an ``IVF_SQ`` (cosine, sqrt(n)
partitions) build is queued, later the index is updated once :data:`UPDATE_FRACTION`
(at least :data:`UPDATE_MIN_ROWS`) rows are unindexed, and retrained when sqrt(n) has
doubled. Builds run without the writer lock: Lance commits the index next to concurrent
appends. A build that loses a race (a commit conflict, or a compaction that removed the files
of the version it read) starts again on a fresh version, a few times (:data:`BUILD_ATTEMPTS`),
logged at debug level; one that fails for good is kept in the space's ``IndexState`` and logged
as a warning.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trellisdb.storage.spaces import Space
from trellisdb.vectors.search import partitions_for, text_index, vector_index

log = logging.getLogger("trellisdb")

#: Spaces with fewer vectors than this are searched exactly, without an index.
INDEX_MIN_ROWS = 20_000
#: Unindexed rows (appended after the last build) that trigger an index update:
#: this many, or :data:`UPDATE_FRACTION` of the table, whichever is more.
UPDATE_MIN_ROWS = 10_000
UPDATE_FRACTION = 0.05
#: The index is retrained (new partitions) when the partition count the table
#: now calls for is this many times the trained one (rows grew ~4x).
RETRAIN_GROWTH = 2.0
#: Tries of one build that lost a race (a commit conflict, or a compaction that removed the
#: files of the version it read), each on a fresh version after a short pause (0.2 s, 0.4 s, ...).
BUILD_ATTEMPTS = 5


@dataclass
class IndexState:
    """What the index of one space is doing (``db.index_status()``)."""

    space: str
    target: str
    state: str = "exact"  # exact | building | indexed | failed
    rows: int = 0
    indexed_rows: int = 0
    partitions: int = 0
    building_since: float | None = None
    last_build_seconds: float | None = None
    builds: int = 0
    error: str | None = None
    has_index: bool = False

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k != "has_index"}
        if self.building_since is not None:
            d["building_for_seconds"] = round(time.monotonic() - self.building_since, 2)
        d.pop("building_since")
        return d


def index_counts(ds: Any, column: str) -> tuple[int, int, dict[str, Any] | None]:
    """(rows, rows in fragments the vector index covers, the index) from metadata only."""
    idx = vector_index(ds, column)
    covered = idx["fragment_ids"] if idx is not None else ()
    rows = indexed = 0
    for f in ds.get_fragments():
        n = int(f.metadata.physical_rows or 0)
        rows += n
        if idx is not None and f.fragment_id in covered:
            indexed += n
    return rows, indexed, idx


def needed_job(rows: int, indexed: int, partitions: int, has_index: bool) -> str | None:
    """What the index of a space with these counts needs: "create", "retrain", "update" or None.

    >>> needed_job(5_000, 0, 0, False) is None
    True
    >>> needed_job(50_000, 0, 0, False)
    'create'
    >>> needed_job(60_000, 50_000, 224, True)
    'update'
    >>> needed_job(400_000, 100_000, 316, True)
    'retrain'
    """
    if not has_index:
        return "create" if rows >= INDEX_MIN_ROWS else None
    if partitions and partitions_for(rows) >= RETRAIN_GROWTH * partitions:
        return "retrain"
    if rows - indexed >= max(UPDATE_MIN_ROWS, UPDATE_FRACTION * rows):
        return "update"
    return None


class IndexMaintainer:
    """Builds and refreshes vector (and full-text) indexes on one background thread.

    ``poke(space)`` after a commit that wrote vectors checks the counts (a
    metadata read) and queues a job if one is needed; the thread opens its own
    dataset handle and trains a new index aside (``create_index_uncommitted``,
    no lock), then commits it holding the writer lock for the manifest write
    alone, so a stream of appends cannot starve the commit; incremental
    updates commit next to concurrent writes, retrying on a conflict.
    """

    def __init__(
        self, open_ds: Callable[[str], Any], text_columns: dict[str, str],
        commit_lock: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> None:
        self._open = open_ds
        self._text = text_columns
        #: held around the commit of a (re)trained index only: writers wait for the manifest
        #: write, not for the build, and the commit never races an append
        self._commit_lock = commit_lock
        self._lock = threading.Lock()
        self._states: dict[tuple[str, str], IndexState] = {}
        self._queue: dict[tuple[str, str], tuple[Space, str]] = {}
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self.closed = False

    def building(self) -> set[str]:
        """Tables with an index build in progress: their compaction waits (a rewrite would preempt the build)."""
        with self._lock:
            busy = {sp.table for sp, _ in self._queue.values()}
            busy |= {t for (tg, name), st in self._states.items() if st.state == "building"
                     for t in [Space(name, tg, 0).table]}
        return busy

    def state(self, space: Space) -> IndexState:
        with self._lock:
            return self._states.setdefault((space.target, space.name), IndexState(space.name, space.target))

    def observe(self, space: Space) -> IndexState:
        """Refresh the counts of ``space`` from its table's metadata."""
        st = self.state(space)
        ds = self._open(space.table)
        rows, indexed, idx = index_counts(ds, space.column)
        st.rows, st.indexed_rows, st.has_index = rows, indexed, idx is not None
        if idx is not None and not st.partitions:
            st.partitions = _partitions(ds, idx)
        if st.state != "building":
            st.state = "indexed" if idx is not None else ("failed" if st.error else "exact")
        return st

    def poke(self, space: Space, force: str | None = None) -> str | None:
        st = self.observe(space)
        job = force or needed_job(st.rows, st.indexed_rows, st.partitions, st.has_index)
        if job is None or self.closed:
            return None
        if (job == "create" and not force and space.builtin  # the table's rows are not all vectors
                and self._open(space.table).count_rows(filter=f"{space.column} IS NOT NULL") < INDEX_MIN_ROWS):
            return None
        with self._lock:
            if st.state == "building" and not force:
                return None
            self._queue[(space.target, space.name)] = (space, job)
            self._idle.clear()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="trellisdb-index", daemon=True)
                self._thread.start()
        return job

    def wait(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)

    def idle(self) -> bool:
        """Whether no build is queued or running."""
        with self._lock:
            return self._idle.is_set() and not self._queue

    def rebuilt(self, space: Space) -> IndexState:
        """The state of ``space`` read afresh after its index was rebuilt or dropped outside the
        maintainer (``rebuild_indexes``, by a purge)."""
        st = self.state(space)
        st.partitions, st.error = 0, None
        return self.observe(space)

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue or self.closed:
                    self._idle.set()
                    self._thread = None
                    return
                key = next(iter(self._queue))
                space, job = self._queue.pop(key)
            self._build(space, job)

    def _build(self, space: Space, job: str) -> None:
        st = self.state(space)
        st.state, st.building_since, st.error = "building", time.monotonic(), None
        t0 = time.perf_counter()
        try:
            for attempt in range(BUILD_ATTEMPTS):
                try:
                    ds = self._open_fresh(space.table)
                    rows, _, idx = index_counts(ds, space.column)
                    if space.builtin:
                        rows = ds.count_rows(filter=f"{space.column} IS NOT NULL")
                    if job == "update" and idx is not None:
                        ds.optimize.optimize_indices(index_names=[idx["name"]])
                    else:  # built aside over the fragments there now, then committed under the writer lock
                        parts = partitions_for(rows)
                        name = idx["name"] if idx is not None else f"{space.column}_idx"
                        frags = [f.fragment_id for f in ds.get_fragments()]
                        seg = ds.create_index_uncommitted(space.column, "IVF_SQ", metric="cosine", num_partitions=parts,
                                                          fragment_ids=frags, replace=True, name=name)
                        with self._commit_lock():
                            self._open_fresh(space.table).commit_existing_index_segments(name, space.column, [seg])
                        st.partitions = parts
                    text = self._text.get(space.table)
                    if text is not None:  # the table's full-text index rides along
                        ds = self._open_fresh(space.table)
                        tix = text_index(ds, text)
                        if tix is None:
                            ds.create_scalar_index(text, index_type="INVERTED")
                        else:
                            ds.optimize.optimize_indices(index_names=[tix["name"]])
                    break
                except (OSError, RuntimeError, ValueError) as e:  # a race lost: try again on a fresh version
                    if attempt == BUILD_ATTEMPTS - 1 or not (is_conflict(e) or is_gone(e)):
                        raise
                    log.debug("building the index of space %s of %s again on a fresh version (attempt %d of %d): %s",
                              space.name, space.target, attempt + 2, BUILD_ATTEMPTS, e)
                    time.sleep(0.2 * (attempt + 1))
            st.builds += 1
            st.last_build_seconds = round(time.perf_counter() - t0, 3)
            st.state = "indexed"
        except Exception as e:  # reported by index_status(); searches stay exact meanwhile
            st.error = f"{type(e).__name__}: {e}"
            log.warning("building the index of space %s of %s failed: %s", space.name, space.target, st.error)
            st.state = "failed"
        finally:
            st.building_since = None
        with contextlib.suppress(Exception):
            self.observe(space)

    def _open_fresh(self, table: str) -> Any:
        import lance

        return lance.dataset(self._open(table).uri)


def rebuild_indexes(ds: Any) -> dict[str, str]:
    """Build every index of dataset ``ds`` again over the rows it holds now, each under its
    own name, replacing the old one (a purge took rows out: the old index files still hold
    them, until the old versions are pruned). A vector index is built as the maintainer
    builds it (``IVF_SQ``, cosine, sqrt(n) partitions); one that cannot be trained on what is
    left (too few vectors) is dropped: searches go exact until the maintainer builds it again.
    Returns, per index name, "rebuilt" or "dropped". Caller holds the writer lock."""
    import lance

    out: dict[str, str] = {}
    uri = ds.uri
    for idx in ds.describe_indices():
        name, column, kind = str(idx.name), str(next(iter(idx.field_names))), str(idx.index_type).upper()
        if name in out:
            continue
        ds = lance.dataset(uri)
        if kind.startswith("IVF"):
            n = ds.count_rows(filter=f"{column} IS NOT NULL")
            try:
                if not n:
                    raise ValueError("no vectors left")
                ds.create_index(column, "IVF_SQ", name=name, metric="cosine", num_partitions=partitions_for(n),
                                replace=True)
                out[name] = "rebuilt"
            except (OSError, RuntimeError, ValueError) as e:
                log.info("the index %s of %s cannot be trained now (%s): dropped", name, uri, e)
                lance.dataset(uri).drop_index(name)
                out[name] = "dropped"
        else:
            ds.create_scalar_index(column, index_type=kind, name=name, replace=True)
            out[name] = "rebuilt"
    return out


def is_conflict(e: BaseException) -> bool:
    """Whether Lance refused a commit because another one won the race (worth a retry on a
    fresh version). pylance raises ``CommitConflictError`` for the conflicts it classifies; the
    Rust core's *retryable* conflicts ("Retryable commit conflict for version ...", "... retry")
    still arrive as a plain ``OSError`` / ``RuntimeError`` whose text is all that says so."""
    from lance.commit import CommitConflictError

    if isinstance(e, CommitConflictError):
        return True
    text = str(e).lower()
    return "commit conflict" in text or "retry" in text


def is_gone(e: BaseException) -> bool:
    """Whether a read failed because a file of the version it read is gone: a compaction (in this
    process or another) rewrote the fragments and pruned the old ones meanwhile. Lance says
    ``Not found: <table>.lance/data/<file>.lance`` (as an ``OSError`` or a ``ValueError``); the
    version there now has the rows in new files, so a fresh read succeeds.

    >>> is_gone(ValueError("Not found: db/tables/nodes.lance/data/0101.lance, local.rs:273:40"))
    True
    >>> is_gone(ValueError("Not found: column 'x'"))
    False
    """
    text = str(e)
    return "not found" in text.lower() and ".lance" in text


def _partitions(ds: Any, idx: dict[str, Any]) -> int:
    try:
        stats = ds.stats.index_stats(idx["name"])
        segs = stats.get("indices") or stats.get("segments") or []
        return int(segs[0]["num_partitions"]) if segs else 0
    except Exception:  # statistics are informative only
        return 0
