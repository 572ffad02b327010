"""TQL statements executed on a small hand-built graph, each result asserted by hand."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import networkx as nx

import trellisdb

# The graph `g` (conftest.py):
#   r ─┬─ a ─┬─ c (crossover of a and b)     scores: r .1  a .5  b .7  c .9  d .3
#      │     └─ d                                      e .95 (written after tag "early")
#      └─ b ─┬─ c
#            └─ e   (e also inspired_by-> r)


def ids(res: trellisdb.Result) -> list[str]:
    return [r["id"] for r in res.to_pylist()]


def test_selection_where_order_limit_return(g: trellisdb.Database) -> None:
    res = g.query("NODES FROM SESSION 's1' WHERE reward('score') >= 0.5 ORDER BY reward('score') DESC LIMIT 3 "
                  "RETURN id, reward('score') AS s, children, visits, parent, depth")
    assert res.to_pylist() == [
        {"id": "e", "s": 0.95, "children": 0, "visits": 1, "parent": "b", "depth": 2},
        {"id": "c", "s": 0.9, "children": 0, "visits": 1, "parent": "a", "depth": 2},
        {"id": "b", "s": 0.7, "children": 2, "visits": 3, "parent": "r", "depth": 1},
    ]
    assert ids(g.query("NODES FROM TASK 't' WHERE summary IS NULL")) == []
    assert ids(g.query("NODES WHERE id IN ('x', 'r') AND NOT step BETWEEN 2 AND 9")) == ["r", "x"]
    assert g.query("SESSIONS FROM TASK 't' RETURN id, agent").to_pylist() == [
        {"id": "s1", "agent": "a"}, {"id": "s2", "agent": "b"}]
    got = g.query("REWARDS FROM SESSION 's1' WHERE value > 0.8 ORDER BY value DESC RETURN node_id, value")
    assert got.to_pylist() == [{"node_id": "e", "value": 0.95}, {"node_id": "c", "value": 0.9}]


def test_frontier_default_expanded_rank_and_ties(g: trellisdb.Database) -> None:
    # expanded: r, a, b have children; frontier = c, d, e, x
    assert ids(g.query("FRONTIER RANK BY reward('score') DESC")) == ["e", "c", "x", "d"]
    assert ids(g.query("FRONTIER FROM SESSION 's1' RANK BY reward('score') DESC LIMIT 2")) == ["e", "c"]
    # no rank: ties break by insertion order (d was written before c, in the same commit), then id
    assert ids(g.query("FRONTIER")) == ["d", "c", "x", "e"]
    # the definition of expanded can be overridden
    assert ids(g.query("FRONTIER EXPANDED WHEN reward('score') < 0.6 RANK BY reward('score') DESC")) == [
        "e", "c", "x", "b"]


def test_frontier_diversity(g: trellisdb.Database) -> None:
    res = g.query("FRONTIER RANK BY reward('score') DESC PER PARENT 1 RETURN id, parent")
    # c (parent a) and d (parent a) compete: c wins; e (parent b); x is a root (parent null)
    assert res.to_pylist() == [{"id": "e", "parent": "b"}, {"id": "c", "parent": "a"}, {"id": "x", "parent": None}]
    assert ids(g.query("FRONTIER RANK BY reward('score') DESC PER SESSION 1")) == ["e", "x"]


def test_frontier_ucb(g: trellisdb.Database) -> None:
    res = g.query("NODES ORDER BY ucb(reward('score'), visits, 2.0) DESC RETURN id, visits")
    rows = res.to_pylist()
    import math

    scores = {"r": 0.1, "a": 0.5, "b": 0.7, "c": 0.9, "d": 0.35, "e": 0.95, "x": 0.8}
    visits = {r["id"]: r["visits"] for r in rows}
    total = sum(visits.values())
    want = sorted(scores, key=lambda n: (-(scores[n] + 2.0 * math.sqrt(math.log(total) / visits[n])), n))
    assert [r["id"] for r in rows] == want


def test_lineage_siblings_subtree_path(g: trellisdb.Database) -> None:
    res = g.query("LINEAGE OF 'c' ANCESTORS RETURN id, hop")
    assert res.to_pylist() == [{"id": "c", "hop": 0}, {"id": "a", "hop": 1}, {"id": "b", "hop": 1},
                               {"id": "r", "hop": 2}]
    assert ids(g.query("LINEAGE OF 'c' ANCESTORS 1")) == ["c", "a", "b"]
    assert ids(g.query("LINEAGE OF 'c' ANCESTORS VIA derived_from")) == ["c"]
    assert ids(g.query("LINEAGE OF 'r' DESCENDANTS")) == ["r", "a", "b", "d", "c", "e"]  # by hop, then written
    assert ids(g.query("SUBTREE OF 'a' WHERE hop > 0")) == ["d", "c"]  # d was written first
    assert g.query("SIBLINGS OF 'a' RETURN id, shared_parent").to_pylist() == [{"id": "b", "shared_parent": "r"}]
    assert ids(g.query("SIBLINGS OF 'c'")) == ["d", "e"]
    path = g.query("PATH FROM 'r' TO 'e' RETURN id, hop")
    assert path.to_pylist() == [{"id": "r", "hop": 0}, {"id": "b", "hop": 1}, {"id": "e", "hop": 2}]
    assert ids(g.query("PATH FROM 'e' TO 'r'")) == []  # edges run parent -> child
    assert ids(g.query("PATH FROM 'e' TO 'r' VIA inspired_by")) == ["e", "r"]


def test_cycles_terminate(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    s = db.session(task="t", agent="a")
    s.add_node(id="p")
    s.add_node(id="q", parents=["p"])
    s.add_edge("q", "p", "repair_of")  # bad data: a cycle p -> q -> p
    res = db.query("LINEAGE OF 'p' ANCESTORS RETURN id, hop")
    assert res.to_pylist() == [{"id": "p", "hop": 0}, {"id": "q", "hop": 1}]
    assert ids(db.query("LINEAGE OF 'p' DESCENDANTS")) == ["p", "q"]
    assert ids(db.query("PATH FROM 'p' TO 'q'")) == ["p", "q"]
    db.close()


def test_as_of_sees_exactly_that_commit(g: trellisdb.Database) -> None:
    early = g.tags()["early"]
    assert ids(g.query("FRONTIER RANK BY reward('score') DESC AS OF TAG 'early'")) == ["c", "x", "d"]
    assert ids(g.query(f"FRONTIER RANK BY reward('score') DESC AS OF COMMIT {early}")) == ["c", "x", "d"]
    # the later re-score of d is invisible as of early
    d = g.query("NODES WHERE id = 'd' RETURN reward('score') AS s AS OF TAG 'early'").to_pylist()
    assert d == [{"s": 0.3}]
    assert g.query("NODES WHERE id = 'd' RETURN reward('score') AS s").to_pylist() == [{"s": 0.35}]
    t = next(c["time"] for c in g.log() if c["id"] == early)
    stamp = t.isoformat()
    assert ids(g.query(f"SIBLINGS OF 'a' AS OF TIMESTAMP '{stamp}'")) == ["b"]
    assert ids(g.query("NODES AS OF TIMESTAMP $t", t=t - dt.timedelta(days=1))) == []
    # STEP k OF SESSION: the commit at which that step was complete (test_tql_aggregates.py has the details)
    step_e = g.query("NODES WHERE id = 'e' RETURN step").to_pylist()[0]["step"]
    assert "e" not in ids(g.query(f"NODES AS OF STEP {step_e - 1} OF SESSION 's1'"))
    assert "e" in ids(g.query(f"NODES AS OF STEP {step_e} OF SESSION 's1'"))


def test_parameters_and_networkx(g: trellisdb.Database) -> None:
    res = g.query("LINEAGE OF $n ANCESTORS $k WHERE reward($ch) > $min", n="c", k=5, ch="score", min=0.2)
    assert ids(res) == ["c", "a", "b"]
    graph = g.query("LINEAGE OF 'c' ANCESTORS").to_networkx()
    assert isinstance(graph, nx.DiGraph)
    assert sorted(graph.edges(data="kind")) == [("a", "c", "crossover_of"), ("b", "c", "crossover_of"),
                                                ("r", "a", "derived_from"), ("r", "b", "derived_from")]
    assert graph.nodes["c"]["hop"] == 0
    assert nx.is_directed_acyclic_graph(graph)


def test_explain_shows_plan_sql_and_duckdb(g: trellisdb.Database) -> None:
    out = g.query("EXPLAIN FRONTIER RANK BY reward('score') DESC PER PARENT 1 LIMIT 2").to_pylist()[0]["explain"]
    assert "-- logical plan" in out and "TopPerGroup 1 per parent" in out
    assert "-- SQL (DuckDB)" in out and "QUALIFY" in out
    assert "-- DuckDB plan" in out and ("WINDOW" in out.upper() or "STREAMING_WINDOW" in out.upper())
    res = g.query("NODES LIMIT 1")
    assert "Limit 1" in res.explain()
    assert res.sql is not None and "LIMIT 1" in res.sql
