"""The in-memory adjacency (trellisdb/graph.py) against networkx, built at once and commit by commit."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pyarrow as pa
import pytest

from trellisdb import graph
from trellisdb.graph import Adjacency
from trellisdb.schema import EDGE_KINDS


def random_edges(seed: int, nodes: int = 120, edges: int = 400, commits: int = 12) -> pa.Table:
    rng = np.random.default_rng(seed)
    src = rng.integers(0, nodes, edges)
    dst = rng.integers(0, nodes, edges)
    keep = src != dst
    kinds = np.array(EDGE_KINDS)[rng.integers(0, 3, edges)]  # derived_from, repair_of, crossover_of
    commit = np.sort(rng.integers(1, commits + 1, edges))
    return pa.table({
        "src": [f"n{v}" for v in src[keep]], "dst": [f"n{v}" for v in dst[keep]],
        "kind": kinds[keep].tolist(), "commit_id": commit[keep],
    })


def expected(e: pa.Table, seeds: list[str], forward: bool, hops: int, kinds: set[str], snapshot: int) -> set[tuple]:
    g = nx.DiGraph()
    for r in e.to_pylist():
        if r["kind"] in kinds and r["commit_id"] <= snapshot:
            g.add_edge(r["src"], r["dst"]) if forward else g.add_edge(r["dst"], r["src"])
    out = set()
    for s in seeds:
        if s in g:
            out |= {(n, s, h) for n, h in nx.single_source_shortest_path_length(g, s, cutoff=hops).items() if h}
    return out


def siblings(e: pa.Table, seeds: list[str], kinds: set[str], snapshot: int) -> set[tuple]:
    rows = [r for r in e.to_pylist() if r["kind"] in kinds and r["commit_id"] <= snapshot]
    out = set()
    for s in seeds:
        parents = {r["src"] for r in rows if r["dst"] == s}
        out |= {(r["dst"], s, 1) for r in rows if r["src"] in parents and r["dst"] != s and r["dst"] not in parents}
    return out


def got(adj: Adjacency, seeds: list[str], spec: list, kinds: tuple[str, ...], snapshot: int) -> set[tuple]:
    w = adj.walk(pa.array(seeds), spec, kinds, snapshot)
    rows = list(zip(w["id"].to_pylist(), w["seed"].to_pylist(), w["hop"].to_pylist(), strict=True))
    assert len(rows) == len(set(rows)), "one row per (id, seed)"
    return set(rows)


@pytest.mark.parametrize("incremental", [False, True])
def test_walks_match_networkx(incremental: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(graph, "MERGE_MIN", 40)  # several merges of the delta into the base
    e = random_edges(7)
    if incremental:  # commit by commit, as a live store extends it
        adj = Adjacency.build(e.filter(pa.compute.equal(e["commit_id"], 1)), upto=1)
        for c in range(2, 13):
            adj = adj.extended(e.filter(pa.compute.equal(e["commit_id"], c)), upto=c)
    else:
        adj = Adjacency.build(e, upto=12)
    assert adj.edges == e.num_rows
    seeds = ["n3", "n50", "n77", "n999"]  # n999 has no edges
    for kinds in [("derived_from",), ("derived_from", "repair_of", "crossover_of")]:
        for snap in (3, 8, 12):
            for fwd in (True, False):
                name = "descendant" if fwd else "ancestor"
                want = expected(e, seeds, fwd, 3, set(kinds), snap)
                assert got(adj, seeds, [(name, [fwd] * 3, [True] * 3)], kinds, snap) == want
            sib = got(adj, seeds, [("sibling", [False, True], [False, True])], kinds, snap)
            assert sib == siblings(e, seeds, set(kinds), snap)


def test_relations_and_empty_cases() -> None:
    e = pa.table({"src": ["a", "a", "b"], "dst": ["b", "c", "d"], "kind": ["derived_from"] * 3, "commit_id": [1, 1, 2]})
    adj = Adjacency.build(e, upto=2)
    spec = [("ancestor", [False], [True]), ("descendant", [True], [True]), ("sibling", [False, True], [False, True])]
    w = adj.walk(pa.array(["b"]), spec, ("derived_from",), 2)
    assert sorted(zip(w["id"].to_pylist(), w["relation"].to_pylist(), w["hop"].to_pylist(), strict=True)) == [
        ("a", "ancestor", 1), ("c", "sibling", 1), ("d", "descendant", 1)]
    assert adj.walk(pa.array(["b"]), spec, ("repair_of",), 2).num_rows == 0
    assert adj.walk(pa.array(["zz"]), spec, ("derived_from",), 2).num_rows == 0
    empty = Adjacency.build(e.slice(0, 0), upto=0)
    assert empty.walk(pa.array(["a"]), spec, ("derived_from",), 5).num_rows == 0
    more = empty.extended(e, upto=2)
    assert more.walk(pa.array(["a"]), spec[1:2], ("derived_from",), 2)["id"].to_pylist() == ["b", "c"]


def test_lineage_walked_in_memory_answers_as_the_recursive_sql(tmp_path: object) -> None:
    """A process's first LINEAGE runs as a recursive CTE, later ones over the in-memory
    adjacency: the same rows in the same order, for every direction, hop bound, edge kind
    and AS OF, on a graph with diamonds, a cycle and a node without edges."""
    import trellisdb

    db = trellisdb.connect(f"{tmp_path}/db", embedding_dim=4)
    rng = np.random.default_rng(7)
    s = db.session(task="t", agent="a", id="s")
    ids = [s.add_node(id="root")]
    commits = []
    for i in range(120):
        k = rng.integers(1, 3)
        parents = sorted({ids[int(j)] for j in rng.integers(max(0, len(ids) - 15), len(ids), k)})
        ids.append(s.add_node(id=f"n{i}", parents=parents))
        if i % 20 == 19:
            commits.append(db.flush())
    s.add_edge("n119", "n100", kind="repair_of")  # a cycle through another edge kind
    s.add_node(id="alone")
    commits.append(db.flush())
    queries = [f"LINEAGE OF '{n}' {d} {h} {via} RETURN id, hop{asof}"
               for n in ("n119", "n60", "root", "alone")
               for d in ("ANCESTORS", "DESCENDANTS")
               for h in ("", "2")
               for via in ("", "VIA derived_from")
               for asof in ("", f" AS OF COMMIT {commits[2]}")]
    reads = db._reads
    answers = {}
    for q in queries:
        reads.graph_walks = 0  # the first walk of a process: SQL
        try:
            answers[q] = db.query(q).to_pylist()
        except trellisdb.UnknownNodeError:
            answers[q] = None
    assert not db._store.engine.adjacency_built
    for q in queries:
        try:
            walked = db.query(q).to_pylist()
        except trellisdb.UnknownNodeError:
            walked = None
        assert walked == answers[q], q
    assert db._store.engine.adjacency_built
    assert len(answers["LINEAGE OF 'n119' ANCESTORS   RETURN id, hop"]) > 20
    db.close()
