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

Quarantined nodes (``trellis:quarantined`` as of the snapshot) are no seeds unless the query
says ``INCLUDE QUARANTINED``: with a WHERE, the prefilter's scan leaves them out; without one,
each list is searched deeper by their number and they are dropped from it (so the ``k`` seeds
are the best of the other nodes, as if searched among them alone), or, when more than
``OVERFETCH_MAX`` nodes are quarantined, searched among the ids of the others. The SQL then
leaves out the quarantined nodes the ``EXPAND`` reached.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import PlanError
from trellisdb.graph import WalkSpec, found_rows
from trellisdb.names import QUARANTINED
from trellisdb.storage.spaces import TEXT_COLUMN
from trellisdb.tql import plan as P
from trellisdb.tql.compile import compile_plan
from trellisdb.tql.resolve import Bound
from trellisdb.vectors.search import RRF_K, SearchStats, rrf

if TYPE_CHECKING:
    from trellisdb.snapshot import Snapshot
    from trellisdb.vectors.service import Vectors

#: The most quarantined nodes a RETRIEVE without WHERE searches past (each list is searched that
#: much deeper); with more, it searches among the ids of the nodes not quarantined.
OVERFETCH_MAX = 10_000

SEEDS_SCHEMA = pa.schema([("id", pa.string()), ("rank", pa.int64()), ("distance", pa.float64()),
                          ("score", pa.float64())])


def _search(plan: P.Plan) -> P.VectorSearch:
    vs = P.vector_search(plan)
    if vs is None:
        raise PlanError("a RETRIEVE plan has a VectorSearch under its Expand")
    return vs


def prefilter_sql(plan: P.Plan) -> tuple[str, dict[str, Any]] | None:
    """SQL for the ids the WHERE of a RETRIEVE allows (None: no WHERE)."""
    pre = _search(plan).prefilter
    if pre is None:
        return None
    c = compile_plan(pre)
    return c.sql, c.params


def vector_step(snap: Snapshot, vectors: Vectors, plan: P.Plan, bound: Bound) -> tuple[pa.Table, str]:
    """The seeds of a RETRIEVE plan's ``VectorSearch`` as ``(id, rank, distance, score)``, and
    what the search did (``bound.vector`` is the value of its vector parameter)."""
    vs = _search(plan)
    k = vs.k
    candidates = None
    pre = prefilter_sql(plan)
    if pre is not None:
        candidates = snap.execute(pre[0], pre[1]).column("id").combine_chunks()
    notes = []
    held = pa.array([], pa.string())  # quarantined nodes the searches skip (the prefilter left out the others)
    if vs.exclude_quarantined and candidates is None:
        held = snap.execute("SELECT node_id FROM labels WHERE label = $1", [QUARANTINED],
                            tables=("labels",)).column("node_id").combine_chunks()
        if len(held) > OVERFETCH_MAX:
            candidates = snap.execute("SELECT id FROM nodes WHERE id NOT IN (SELECT node_id FROM labels WHERE "
                                      "label = $1)", [QUARANTINED]).column("id").combine_chunks()
            held = pa.array([], pa.string())
        if len(held) or candidates is not None:
            notes.append(f"quarantined: {len(held) or 'over ' + str(OVERFETCH_MAX)} node(s) left out")
    searches_vectors = vs.similar_text is not None or vs.vector_param is not None
    fused_k = 2 * k + 10 if searches_vectors and vs.matching is not None else k  # fuse from deeper lists
    hits = kw = None
    if searches_vectors:
        sp = snap.space(vs.space, vs.entity)
        if vs.vector_param is not None:
            assert bound.vector is not None
            q = bound.vector
        else:
            assert vs.similar_text is not None
            q = vectors.query_vector(sp, vs.similar_text)
        stats = SearchStats()
        hits = _without(vectors.search(snap, sp, q, fused_k + len(held), candidates, stats), held, fused_k)
        notes.append(f"vector: {stats.text()}")
    if vs.matching is not None:
        ks = SearchStats()
        kw = _without(vectors.keywords(snap, vs.entity, vs.matching, fused_k + len(held), candidates, ks), held,
                      fused_k)
        notes.append(f"keywords: {ks.text()}")
    if hits is not None and kw is not None:
        fused = rrf([hits, kw], k)
        dist = hits.select(["id", "distance"])
        seeds = fused.join(dist, "id", join_type="left outer").sort_by([("score", "descending"), ("id", "ascending")])
        notes.append(f"fusion: reciprocal rank (k={RRF_K}) of {hits.num_rows} vector and {kw.num_rows} keyword hits")
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


def _without(hits: pa.Table, held: pa.Array, k: int) -> pa.Table:
    """The best ``k`` of ``hits`` (best first, each id once) whose ids are not in ``held``."""
    if not len(held):
        return hits
    return hits.filter(pc.invert(pc.is_in(hits["id"].cast(pa.string()), value_set=held))).slice(0, k)


def describe_search(snap: Snapshot, vectors: Vectors, plan: P.Plan, done: str | None) -> str:
    """The vector step of EXPLAIN: the space, how it will be (or was) searched, the prefilter."""
    vs = _search(plan)
    lines = []
    if vs.similar_text is not None or vs.vector_param is not None:
        lines.append(vectors.describe(snap, snap.space(vs.space, vs.entity)))
    if vs.matching is not None:
        lines.append(f"keywords: Lance full-text index (BM25) on {vs.entity}.{TEXT_COLUMN[vs.entity]}")
    pre = prefilter_sql(plan)
    if pre is not None:
        lines.append(f"prefilter (DuckDB, before top-k): {pre[0]}")
    lines.append(f"visibility: commit_id <= {vs.snapshot}, aborted commits excluded")
    if vs.exclude_quarantined:
        lines.append(f"quarantine: no seed is a node labelled {QUARANTINED} as of commit {vs.snapshot} "
                     "(INCLUDE QUARANTINED to include them)")
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


def expand(snap: Snapshot, plan: P.Plan, seeds: pa.Table) -> pa.Table:
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
    return snap.adjacency().expand(seeds, walks, ex.kinds, snap.commit)
