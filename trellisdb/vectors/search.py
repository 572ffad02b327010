"""Embedding spaces, vector and keyword search, and the ANN index behind them.

A *space* is a named set of vectors of one dimension (and, usually, one
model) attached to nodes or tasks. Every database has the built-in space
``embedding``: the ``embedding`` column of ``nodes`` and of ``tasks``
(``add_node(embedding=...)``). More spaces are made with
``db.create_space(name, ...)``; each is a Lance table ``vec_<target>_<name>``
of ``(id, vector, commit_id)`` rows, listed in ``spaces.json``.

Search is cosine distance. Below :data:`INDEX_MIN_ROWS` vectors a space is
searched exactly (a flat scan); above it an ``IVF_SQ`` index is built on a
background thread, without the writer lock (Lance commits the index
optimistically next to concurrent appends), and refreshed as rows arrive.
Rows appended after a build are searched exactly next to the index, so they
are found at once. Time travel and aborted commits are filters on
``commit_id``; ``WHERE`` prefilters pick candidate ids first (see
:func:`search`).

>>> import numpy as np
>>> rrf([pa.table({"id": ["a", "b"]}), pa.table({"id": ["b", "c"]})], k=2)["id"].to_pylist()
['b', 'a']
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import EmbeddingDimensionError, ValidationError

#: The space every database has: the ``embedding`` column of nodes and tasks.
BUILTIN = "embedding"

#: Spaces with fewer vectors than this are searched exactly, without an index.
INDEX_MIN_ROWS = 20_000
#: Unindexed rows (appended after the last build) that trigger an index update:
#: this many, or :data:`UPDATE_FRACTION` of the table, whichever is more.
UPDATE_MIN_ROWS = 10_000
UPDATE_FRACTION = 0.05
#: The index is retrained (new partitions) when the partition count the table
#: now calls for is this many times the trained one (rows grew ~4x).
RETRAIN_GROWTH = 2.0
#: A WHERE leaving at most this many candidates is answered exactly among them.
EXACT_CANDIDATES = 10_000
#: Index candidates re-ranked on the full vectors per result (Lance ``refine_factor``). At least
#: 1: without a refine step an IVF_SQ cosine index reports 2 x the cosine distance (the squared
#: L2 of normalized vectors), so RETRIEVE's distance and score would be wrong (measured on
#: pylance 14; tests/test_retrieve.py checks the distances are exact).
REFINE_FACTOR: int = 1
#: Reciprocal rank fusion constant (Cormack et al. 2009).
RRF_K = 60

#: The text column keyword search (and ``db.embed``) reads, per target.
TEXT_COLUMN = {"nodes": "summary", "tasks": "spec"}
TARGETS = ("nodes", "tasks")
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True)
class Space:
    """A named embedding space of ``target`` rows (nodes or tasks)."""

    name: str
    target: str
    dim: int
    model: str | None = None
    #: the target column ``db.embed`` embeds (default: summary / spec)
    text: str | None = None

    @property
    def builtin(self) -> bool:
        return self.name == BUILTIN

    @property
    def table(self) -> str:
        return self.target if self.builtin else f"vec_{self.target}_{self.name}"

    @property
    def column(self) -> str:
        return "embedding" if self.builtin else "vector"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "dim": self.dim, "model": self.model,
                "text": self.text or TEXT_COLUMN[self.target], "table": self.table}


def space_schema(dim: int) -> pa.Schema:
    return pa.schema([
        pa.field("id", pa.string(), nullable=False, metadata={"doc": "node or task id"}),
        pa.field("vector", pa.list_(pa.float32(), dim), metadata={"doc": "the embedding"}),
        pa.field("commit_id", pa.int64(), nullable=False, metadata={"doc": "id of the commit that wrote this row"}),
    ])


def check_space_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValidationError(
            f"space name {name!r} must be lower-case letters, digits and _ (starting with a letter), at most 63"
        )
    return name


def as_matrix(vectors: Any, dim: int, what: str) -> np.ndarray:
    """``vectors`` as a finite float32 (n, dim) array, or a clear error."""
    try:
        arr = np.asarray(vectors, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValidationError(f"{what} must be numbers, got {type(vectors).__name__}") from e
    if arr.ndim == 1:
        arr = arr.reshape(1, -1)
    if arr.ndim != 2 or arr.shape[1] != dim:
        got = arr.shape[-1] if arr.ndim else 0
        raise EmbeddingDimensionError(f"{what} has dimension {got}, but the space has dimension {dim}")
    if not np.isfinite(arr).all():
        raise ValidationError(f"{what} contains NaN or infinite values")
    return arr


def vector_column(arr: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(arr, np.float32).ravel()), arr.shape[1])


# ------------------------------------------------------------------ registry
class SpaceRegistry:
    """The spaces of a database: the built-in ones plus ``spaces.json``."""

    def __init__(self, path: str, builtin_dim: int) -> None:
        self.path = path
        self.builtin_dim = builtin_dim
        self._mtime: float | None = None
        self._spaces: dict[tuple[str, str], Space] = {}

    def all(self) -> list[Space]:
        self._load()
        return [Space(BUILTIN, t, self.builtin_dim) for t in TARGETS] + list(self._spaces.values())

    def get(self, target: str, name: str) -> Space | None:
        if name == BUILTIN:
            return Space(BUILTIN, target, self.builtin_dim)
        self._load()
        return self._spaces.get((target, name))

    def names(self, target: str) -> list[str]:
        return [s.name for s in self.all() if s.target == target]

    def _load(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self._spaces = {}
            return
        if mtime == self._mtime:
            return
        from trellisdb.errors import CorruptionError

        try:
            with open(self.path) as fh:
                raw = json.load(fh)
            spaces = {(d["target"], d["name"]): Space(d["name"], d["target"], int(d["dim"]), d.get("model"),
                                                      d.get("text")) for d in raw["spaces"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptionError(f"{self.path} is unreadable ({e}); restore it or remove the spaces it named") from e
        self._spaces, self._mtime = spaces, mtime

    def add(self, space: Space) -> None:
        """Record ``space`` (the caller holds the writer lock); atomic: written aside, then renamed."""
        self._load()
        spaces = {**self._spaces, (space.target, space.name): space}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"spaces": [{"name": s.name, "target": s.target, "dim": s.dim, "model": s.model,
                                   "text": s.text} for s in spaces.values()]}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._mtime = None


# ------------------------------------------------------------------ search
def visibility(snapshot: int, aborted: list[int], top: int) -> str | None:
    """The Lance filter that hides rows not visible at ``snapshot`` (None: all rows are)."""
    parts = []
    if top > snapshot:
        parts.append(f"commit_id <= {int(snapshot)}")
    if aborted:
        parts.append(f"commit_id NOT IN ({', '.join(str(int(a)) for a in aborted)})")
    return " AND ".join(parts) or None


def _and(*parts: str | None) -> str | None:
    ps = [f"({p})" for p in parts if p]
    return " AND ".join(ps) or None


def sql_strings(ids: pa.Array) -> str:
    """``ids`` as a comma-separated list of quoted SQL string constants."""
    return ", ".join("'" + str(i).replace("'", "''") + "'" for i in ids.to_pylist())


def _in_list(ids: pa.Array) -> str:
    return f"id IN ({sql_strings(ids)})"


def _indexes(ds: Any, column: str) -> list[dict[str, Any]]:
    out = []
    for d in ds.describe_indices():
        if list(d.field_names) == [column]:
            frags: set[int] = set()
            for seg in d.segments:
                frags.update(seg.fragment_ids)
            out.append({"name": d.name, "type": str(d.index_type), "fragment_ids": frags,
                        "rows": int(d.num_rows_indexed or 0), "segments": len(d.segments)})
    return out


def vector_index(ds: Any, column: str) -> dict[str, Any] | None:
    """The ANN index on ``column``: name, type, fragment_ids, rows, segments (None: there is none)."""
    return next((i for i in _indexes(ds, column) if i["type"].upper().startswith("IVF")), None)


def text_index(ds: Any, column: str) -> dict[str, Any] | None:
    """The full-text (inverted) index on ``column``, or None."""
    return next((i for i in _indexes(ds, column) if i["type"].lower() == "inverted"), None)


def partitions_for(rows: int) -> int:
    """IVF partitions for ``rows`` vectors: about sqrt(rows), at least 1."""
    return max(1, min(4096, round(math.sqrt(rows))))


def nprobes_for(partitions: int) -> int:
    """Partitions probed per query: 20 (Lance's default), or 1 in 16 of a big index."""
    return max(20, partitions // 16)


@dataclass
class SearchStats:
    """What a search did (shown by EXPLAIN and kept on the result)."""

    strategy: str = ""
    rounds: int = 0
    fetched: int = 0
    candidates: int | None = None
    visible_filter: str | None = None

    def text(self) -> str:
        cand = f", {self.candidates} candidates after WHERE" if self.candidates is not None else ""
        return f"{self.strategy}; {self.rounds} round(s), {self.fetched} rows fetched{cand}"


def _best_per_id(t: pa.Table, col: str, descending: bool) -> pa.Table:
    """One row per id (its best ``col``), best first: node rows re-written by a status change repeat a vector."""
    if t.num_rows == 0:
        return t
    agg = t.group_by("id").aggregate([(col, "max" if descending else "min")])
    agg = agg.rename_columns(["id", col]) if agg.column_names[0] == "id" else agg.rename_columns([col, "id"])
    return agg.sort_by([(col, "descending" if descending else "ascending"), ("id", "ascending")])


def _fetch(space: Space, k: int) -> int:
    """Rows to ask Lance for to find ``k`` distinct ids: node rows re-written by a status change
    repeat their vector in the built-in space; a named space rarely holds two vectors of one id."""
    return 2 * k + 5 if space.builtin else k + 5


def search(
    ds: Any,
    space: Space,
    q: np.ndarray,
    k: int,
    visible: str | None,
    candidates: pa.Array | None,
    stats: SearchStats,
) -> pa.Table:
    """The ``k`` nearest (cosine) vectors of ``space`` visible at the snapshot, as (id, distance).

    ``candidates`` (ids a WHERE allows, or None for all): at most
    :data:`EXACT_CANDIDATES` are searched exactly among themselves (a flat
    scan with an ``id IN`` prefilter); more are searched through the index,
    fetching ``k`` scaled by the inverse of their share of the table and
    growing it 4x until ``k`` candidates are found or everything was seen.
    """
    col = space.column
    stats.visible_filter = visible
    base = visible  # no "IS NOT NULL" filter: a prefilter scans the column; null vectors have no distance
    total = max(1, ds.count_rows())
    if candidates is not None:
        stats.candidates = len(candidates)
        if len(candidates) == 0:
            stats.strategy = "no candidates"
            return pa.table({"id": pa.array([], pa.string()), "distance": pa.array([], pa.float32())})
    nn: dict[str, Any] = {"column": col, "q": q, "metric": "cosine"}
    idx = vector_index(ds, col)
    exact_among = candidates is not None and len(candidates) <= EXACT_CANDIDATES
    if exact_among or idx is None:
        nn["use_index"] = False
    else:
        parts = int(idx.get("num_partitions") or 0) or partitions_for(total)
        nn["nprobes"] = nprobes_for(parts)
        nn["refine_factor"] = REFINE_FACTOR
    if exact_among:
        assert candidates is not None
        stats.strategy = f"exact among {len(candidates)} candidates (flat scan, id IN prefilter)"
        flt = _and(base, _in_list(candidates))
        fetch = _fetch(space, k)
    else:
        refine = f", exact re-rank of {REFINE_FACTOR}x k"
        stats.strategy = (f"index {idx.get('type')} (nprobes {nn['nprobes']}{refine}) + exact over rows added "
                          "since its build") if idx is not None else "exact (flat scan; below the index threshold)"
        flt = base
        share = 1.0 if candidates is None else len(candidates) / total
        fetch = min(total, math.ceil(_fetch(space, k) / max(share, 1e-6)))
    while True:
        stats.rounds += 1
        got = ds.to_table(nearest={**nn, "k": int(fetch)}, columns=["id", "_distance"], filter=flt,
                          prefilter=flt is not None)  # prefilter without a filter costs ~4 ms here
        stats.fetched += got.num_rows
        hits = got.rename_columns(["id", "distance"])
        if hits["distance"].null_count:
            hits = hits.filter(pc.is_valid(hits["distance"]))
        if candidates is not None and not exact_among:
            hits = hits.filter(pc.is_in(hits["id"], value_set=candidates))
        hits = _best_per_id(hits, "distance", descending=False)
        if hits.num_rows >= k or got.num_rows < fetch or fetch >= total:
            return hits.slice(0, k)
        fetch = min(total, fetch * 4)


def keyword_search(
    ds: Any, column: str, text: str, k: int, visible: str | None, candidates: pa.Array | None, stats: SearchStats
) -> pa.Table:
    """The ``k`` best BM25 matches of ``text`` in ``column`` (Lance full-text index), as (id, score)."""
    flt = visible
    if candidates is not None:
        stats.candidates = len(candidates)
        if len(candidates) == 0:
            return pa.table({"id": pa.array([], pa.string()), "score": pa.array([], pa.float32())})
        if len(candidates) <= EXACT_CANDIDATES:
            flt = _and(flt, _in_list(candidates))
    fetch = 3 * k + 10
    stats.strategy = f"full-text (BM25) on {column}"
    while True:
        stats.rounds += 1
        got = ds.to_table(full_text_query=text, columns=["id", "_score"], filter=flt, prefilter=flt is not None,
                          limit=int(fetch))
        stats.fetched += got.num_rows
        hits = got.rename_columns(["id", "score"])
        if candidates is not None and len(candidates) > EXACT_CANDIDATES:
            hits = hits.filter(pc.is_in(hits["id"], value_set=candidates))
        hits = _best_per_id(hits, "score", descending=True)
        if hits.num_rows >= k or got.num_rows < fetch:
            return hits.slice(0, k)
        fetch *= 4


def rrf(ranked: list[pa.Table], k: int) -> pa.Table:
    """Reciprocal rank fusion of ranked id lists: score = sum of 1 / (RRF_K + rank); best ``k``, as (id, score)."""
    parts = [pa.table({"id": t["id"], "score": pa.array(1.0 / (RRF_K + np.arange(1, t.num_rows + 1)))})
             for t in ranked if t.num_rows]
    if not parts:
        return pa.table({"id": pa.array([], pa.string()), "score": pa.array([], pa.float64())})
    fused = pa.concat_tables(parts).group_by("id").aggregate([("score", "sum")]).rename_columns(["id", "score"])
    return fused.sort_by([("score", "descending"), ("id", "ascending")]).slice(0, k)


# ------------------------------------------------------------------ index upkeep
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
            for attempt in range(5):
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
                except (OSError, RuntimeError, ValueError) as e:  # a commit conflict: try again on a fresh version
                    if attempt == 4 or ("onflict" not in str(e) and "etry" not in str(e)):
                        raise
                    time.sleep(0.2 * (attempt + 1))
            st.builds += 1
            st.last_build_seconds = round(time.perf_counter() - t0, 3)
            st.state = "indexed"
        except Exception as e:  # reported by index_status(); searches stay exact meanwhile
            st.error = f"{type(e).__name__}: {e}"
            st.state = "failed"
        finally:
            st.building_since = None
        with contextlib.suppress(Exception):
            self.observe(space)

    def _open_fresh(self, table: str) -> Any:
        import lance

        return lance.dataset(self._open(table).uri)


def _partitions(ds: Any, idx: dict[str, Any]) -> int:
    try:
        stats = ds.stats.index_stats(idx["name"])
        segs = stats.get("indices") or stats.get("segments") or []
        return int(segs[0]["num_partitions"]) if segs else 0
    except Exception:  # statistics are informative only
        return 0
