"""Vector and keyword search over a space, as of a snapshot, and rank fusion.

Search is cosine distance. Below ``index.INDEX_MIN_ROWS`` vectors a space is
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

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.storage.spaces import Space

#: A WHERE leaving at most this many candidates is answered exactly among them.
EXACT_CANDIDATES = 10_000
#: Index candidates re-ranked on the full vectors per result (Lance ``refine_factor``). At least
#: 1: without a refine step an IVF_SQ cosine index reports 2 x the cosine distance (the squared
#: L2 of normalized vectors), so RETRIEVE's distance and score would be wrong (measured on
#: pylance 14; tests/test_retrieve.py checks the distances are exact).
REFINE_FACTOR: int = 1
#: Reciprocal rank fusion constant (Cormack et al. 2009).
RRF_K = 60



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


def merge_exact(hits: pa.Table, rows: pa.Table, column: str, q: np.ndarray, k: int,
                candidates: pa.Array | None) -> pa.Table:
    """``hits`` (id, distance) merged with an exact cosine search of ``rows`` (a few thousand at
    most: the commits still in the write-ahead log), the ``k`` best, one row per id."""
    if rows.num_rows == 0:
        return hits
    rows = rows.filter(pc.is_valid(rows[column]))
    if candidates is not None:
        rows = rows.filter(pc.is_in(rows["id"], value_set=candidates))
    if rows.num_rows == 0:
        return hits
    dim = len(q)
    mat = rows[column].combine_chunks().flatten().to_numpy(zero_copy_only=False).reshape(-1, dim).astype(np.float32)
    qn = np.asarray(q, np.float32)
    norms = np.linalg.norm(mat, axis=1) * max(float(np.linalg.norm(qn)), 1e-30)
    dist = 1.0 - (mat @ qn) / np.maximum(norms, 1e-30)
    found = pa.table({"id": rows["id"].combine_chunks().cast(pa.string()),
                      "distance": pa.array(dist.astype(np.float32), pa.float32())})
    return _best_per_id(pa.concat_tables([hits.cast(found.schema), found]), "distance", descending=False).slice(0, k)


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
