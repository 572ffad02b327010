"""The vector step of RETRIEVE: prefilter, similarity / keyword search, fusion.

It runs before the SQL: the WHERE prefilter (compiled like any TQL
condition) picks candidate ids in DuckDB, Lance finds the nearest vectors
(or BM25 matches) among them as of the snapshot, and the seeds -- ``(id,
rank, distance, score)`` -- are handed to the SQL plan as the relation
``(id, rank, distance, score)``. An ``EXPAND`` is walked next, breadth
first over the in-memory adjacency arrays of ``trellisdb/graph.py`` (a hop
is a few vectorized gathers, not a SQL statement joining the whole edge
table), and each node kept at its nearest seed; the seeds and those nodes
become the relation ``__found`` of the SQL plan, which attaches the node
rows, rewards and ranking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import EmptySpaceError
from trellisdb.graph import WalkSpec, found_rows
from trellisdb.tql import ast as A
from trellisdb.tql import plan as P
from trellisdb.tql.compile import compile_plan
from trellisdb.tql.resolve import Bound
from trellisdb.vectors import (
    TEXT_COLUMN,
    SearchStats,
    Space,
    keyword_search,
    nprobes_for,
    rrf,
    search,
    text_index,
    vector_index,
    visibility,
)

if TYPE_CHECKING:
    from trellisdb.database import Database

SEEDS_SCHEMA = pa.schema([("id", pa.string()), ("rank", pa.int64()), ("distance", pa.float64()),
                          ("score", pa.float64())])


def _space(db: Database, s: A.Retrieve) -> Space:
    return db._space(s.space or "embedding", s.entity)


def prefilter_sql(bound: Bound) -> tuple[str, dict[str, Any]] | None:
    """SQL for the ids the WHERE of a RETRIEVE allows (None: no WHERE)."""
    s = bound.statement
    assert isinstance(s, A.Retrieve)
    if s.where is None:
        return None
    node: P.Plan = P.Scan(s.entity, bound.snapshot)
    if bound.channels or bound.accessors:
        node = P.Derive(node, bound.channels, bound.accessors)
    node = P.Project(P.Filter(node, s.where), (A.Proj(A.Column("id"), "id"),))
    c = compile_plan(node)
    return c.sql, c.params


def vector_step(db: Database, bound: Bound) -> tuple[pa.Table, str]:
    """The seeds of a RETRIEVE as ``(id, rank, distance, score)``, and what the search did."""
    s = bound.statement
    assert isinstance(s, A.Retrieve)
    assert isinstance(s.k, A.Literal) and isinstance(s.k.value, int)
    k = s.k.value
    st = db._log.refresh()
    snap = bound.snapshot
    visible = visibility(snap, st.aborted(snap), st.max_id)
    candidates = None
    pre = prefilter_sql(bound)
    if pre is not None:
        candidates = db._engine.run(st, snap, pre[0], pre[1]).column("id").combine_chunks()
    notes = []
    fused_k = k if s.similar is None or s.matching is None else 2 * k + 10  # fuse from deeper lists
    hits = kw = None
    sp = _space(db, s)
    if s.similar is not None:
        if bound.vector is not None:
            q = bound.vector
        else:
            assert isinstance(s.similar, A.Literal) and isinstance(s.similar.value, str)
            emb = db._embedder(sp)
            q = np.asarray(emb.embed([s.similar.value]), np.float32)[0]
        vs = SearchStats()
        hits = search(db._tables.dataset(sp.table), sp, q, fused_k, visible, candidates, vs)
        notes.append(f"vector: {vs.text()}")
        if hits.num_rows == 0 and candidates is None:
            _check_not_empty(db, sp, visible, snap)
    if s.matching is not None:
        assert isinstance(s.matching, A.Literal) and isinstance(s.matching.value, str)
        ds = _text_dataset(db, s.entity)
        ks = SearchStats()
        kw = keyword_search(ds, TEXT_COLUMN[s.entity], s.matching.value, fused_k, visible, candidates, ks)
        notes.append(f"keywords: {ks.text()}")
    if hits is not None and kw is not None:
        fused = rrf([hits, kw], k)
        dist = hits.select(["id", "distance"])
        seeds = fused.join(dist, "id", join_type="left outer").sort_by([("score", "descending"), ("id", "ascending")])
        notes.append(f"fusion: reciprocal rank (k={60}) of {hits.num_rows} vector and {kw.num_rows} keyword hits")
    elif hits is not None:
        seeds = hits.append_column("score", pc.subtract(pa.scalar(1.0), hits["distance"].cast(pa.float64())))
    else:
        assert kw is not None
        seeds = kw.append_column("distance", pa.nulls(kw.num_rows, pa.float64()))
    seeds = seeds.slice(0, k)
    n = seeds.num_rows
    out = pa.table({
        "id": seeds["id"].cast(pa.string()),
        "rank": pa.array(np.arange(1, n + 1, dtype=np.int64)),
        "distance": seeds["distance"].cast(pa.float64()),
        "score": seeds["score"].cast(pa.float64()),
    }, schema=SEEDS_SCHEMA)
    return out, "\n".join(notes)


def _check_not_empty(db: Database, sp: Space, visible: str | None, snap: int) -> None:
    ds = db._tables.dataset(sp.table)
    flt = " AND ".join(f"({p})" for p in (visible, f"{sp.column} IS NOT NULL") if p)
    if ds.count_rows(filter=flt) == 0:
        how = ("add_node(embedding=...)" if sp.builtin else
               f"db.add_vectors({sp.name!r}, ...) or db.embed({sp.name!r})")
        raise EmptySpaceError(
            f"space {sp.name!r} of {sp.target} holds no vectors as of commit {snap}; add some first ({how})"
        )


def _text_dataset(db: Database, entity: str) -> Any:
    """The table keyword search reads, given a full-text index if it lacks one (databases made before)."""
    ds = db._tables.dataset(entity)
    if text_index(ds, TEXT_COLUMN[entity]) is None:
        with db._lock.held():
            ds = db._tables.dataset(entity)
            if text_index(ds, TEXT_COLUMN[entity]) is None:
                ds.create_scalar_index(TEXT_COLUMN[entity], index_type="INVERTED")
        ds = db._tables.dataset(entity)
    return ds


def describe_search(db: Database, bound: Bound, done: str | None) -> str:
    """The vector step of EXPLAIN: the space, how it will be (or was) searched, the prefilter."""
    s = bound.statement
    assert isinstance(s, A.Retrieve)
    lines = []
    if s.similar is not None:
        sp = _space(db, s)
        ds = db._tables.dataset(sp.table)
        idx = vector_index(ds, sp.column)
        how = "exact flat scan (no index yet)"
        if idx is not None:
            st = db._indexer.observe(sp)
            how = (f"index {idx.get('type')} over {st.indexed_rows} of {st.rows} rows (nprobes "
                   f"{nprobes_for(st.partitions or 1)}) + exact scan of the rest")
        lines.append(f"space {sp.name!r} of {sp.target}: {sp.dim}-d, model {sp.model or 'caller-supplied'}, "
                     f"table {sp.table}.{sp.column}, cosine distance; {how}")
    if s.matching is not None:
        lines.append(f"keywords: Lance full-text index (BM25) on {s.entity}.{TEXT_COLUMN[s.entity]}")
    pre = prefilter_sql(bound)
    if pre is not None:
        lines.append(f"prefilter (DuckDB, before top-k): {pre[0]}")
    lines.append(f"visibility: commit_id <= {bound.snapshot}, aborted commits excluded")
    if done:
        lines.append("executed: " + done.replace("\n", "; "))
    return "\n".join(lines)


def _walks(items: tuple[tuple[str, int], ...]) -> list[WalkSpec]:
    """Each direction as (relation, [forward (src -> dst) per level], [emit at level])."""
    out: list[WalkSpec] = []
    for direction, hops in items:
        for d in ("ancestors", "descendants") if direction == "lineage" else (direction,):
            if d == "siblings":  # up to the parents, down to their other children
                out.append(("sibling", [False, True], [False, True]))
            else:
                out.append((d[:-1], [d == "descendants"] * hops, [True] * hops))
    return out


def expand(db: Database, plan: P.Plan, snapshot: int, seeds: pa.Table) -> pa.Table:
    """The rows of a RETRIEVE before the node columns: its ``seeds`` and the nodes its
    ``EXPAND`` reaches from them (breadth first, over the in-memory adjacency of
    ``trellisdb/graph.py``), one row per node at its nearest seed, as
    ``(id, relation, seed, seed_rank, hop, distance, score)``."""
    ex = plan
    while not isinstance(ex, P.Expand):
        ex = ex.input  # type: ignore[attr-defined]
    walks = _walks(ex.items)
    if not walks or seeds.num_rows == 0:
        z = np.empty(0, np.int64)
        return found_rows(seeds, pa.array([], pa.string()), pa.array([], pa.string()), z, z)
    adj = db._engine.adjacency(db._log.refresh())
    return adj.expand(seeds, walks, ex.kinds, snapshot)
