"""TQL aggregates (GROUP BY, HAVING, count/sum/avg/min/max), PER <expression> k, and AS OF STEP k,
each result asserted by hand on a real store."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest

import trellisdb
from trellisdb.tql import ast as A
from trellisdb.tql.parser import MAX_GROUP_KEYS, parse

# The graph `g` (conftest.py), one task 't':
#   r ─┬─ a ─┬─ c (crossover of a and b)     session s1: r a b d c (steps 1..5, commit 2), e (step 6, commit 3)
#      │     └─ d                             session s2: x (step 1, commit 2)
#      └─ b ─┬─ c                             scores: r .1  a .5  b .7  c .9  d .35 (.3 before)  e .95  x .8
#            └─ e


def rows(db: trellisdb.Database, text: str, **params: object) -> list[dict[str, object]]:
    return db.query(text, **params).to_pylist()


def ids(db: trellisdb.Database, text: str) -> list[str]:
    return [str(r["id"]) for r in rows(db, text)]


def error(db: trellisdb.Database, text: str, kind: type[trellisdb.QueryError] = trellisdb.QueryError) -> str:
    with pytest.raises(kind) as ei:
        db.query(text)
    return str(ei.value)


# ------------------------------------------------------------------ aggregates
def test_an_aggregate_without_group_by_returns_one_row(g: trellisdb.Database) -> None:
    got = rows(g, "NODES RETURN count(*) AS n, count(summary) AS with_summary, sum(step) AS steps, avg(step) AS mean, "
                  "min(id) AS first, max(reward('score')) AS best, count(DISTINCT session_id) AS sessions")
    assert got == [{"n": 7, "with_summary": 7, "steps": 22, "mean": 22 / 7, "first": "a", "best": 0.95,
                    "sessions": 2}]
    # no row matches: still one row (count 0, the others null)
    assert rows(g, "NODES WHERE step > 100 RETURN count(*) AS n, max(step) AS m, sum(usd) AS s") == [
        {"n": 0, "m": None, "s": None}]
    assert rows(g, "NODES RETURN count(*)") == [{"count": 7}]  # the default name is the function's


def test_group_by_having_order_by_an_alias_and_limit(g: trellisdb.Database) -> None:
    text = ("NODES FROM TASK 't' GROUP BY session_id ORDER BY best DESC LIMIT 5 "
            "RETURN session_id, count(id) AS n, max(reward('score')) AS best")
    assert rows(g, text) == [{"session_id": "s1", "n": 6, "best": 0.95}, {"session_id": "s2", "n": 1, "best": 0.8}]
    assert rows(g, "NODES GROUP BY session_id HAVING count(*) > 1 RETURN session_id, count(*) AS n") == [
        {"session_id": "s1", "n": 6}]
    # HAVING by a RETURN name, ORDER BY an aggregate that RETURN does not show
    assert rows(g, "NODES GROUP BY session_id HAVING best < 0.9 ORDER BY min(step) "
                   "RETURN session_id, max(reward('score')) AS best") == [{"session_id": "s2", "best": 0.8}]
    # as of the tag, e was not yet written and d scored .3
    assert rows(g, "NODES WHERE session_id = 's1' RETURN count(*) AS n, sum(reward('score')) AS total "
                   "AS OF TAG 'early'") == [{"n": 5, "total": pytest.approx(2.5)}]


def test_order_by_may_use_return_names_in_any_selection(g: trellisdb.Database) -> None:
    assert ids(g, "NODES ORDER BY s DESC LIMIT 2 RETURN id, reward('score') AS s") == ["e", "c"]
    # a name RETURN gives with AS wins over the column (as in SQL) ...
    assert ids(g, "NODES WHERE session_id = 's1' ORDER BY step RETURN id, -step AS step") == [
        "e", "c", "d", "b", "a", "r"]
    # ... but a column a RETURN expression merely uses is still the column
    got = rows(g, "REWARDS FROM SESSION 's1' WHERE value > 0.6 ORDER BY value DESC RETURN node_id, -value AS v")
    assert [r["node_id"] for r in got] == ["e", "c", "b"]


def test_group_keys_break_ties_and_nulls_form_one_group(g: trellisdb.Database) -> None:
    # parent: r -> a, b; a -> c, d; b -> e (c's primary parent is a); roots r and x have none
    got = rows(g, "NODES GROUP BY parent ORDER BY n DESC RETURN parent, count(*) AS n, min(id) AS first")
    assert got == [{"parent": "a", "n": 2, "first": "c"}, {"parent": "r", "n": 2, "first": "a"},
                   {"parent": None, "n": 2, "first": "r"}, {"parent": "b", "n": 1, "first": "e"}]
    # without ORDER BY the groups come in key order (nulls last), the same every time
    text = "NODES GROUP BY session_id, step % 2 RETURN session_id, step % 2 AS odd, count(*) AS n"
    want = [{"session_id": "s1", "odd": 0, "n": 3}, {"session_id": "s1", "odd": 1, "n": 3},
            {"session_id": "s2", "odd": 1, "n": 1}]
    assert rows(g, text) == want and rows(g, text) == want


def test_group_by_expressions_and_return_names(g: trellisdb.Database) -> None:
    # a RETURN name in GROUP BY means that column's expression (a column of the rows wins)
    assert rows(g, "NODES GROUP BY good RETURN reward('score') >= 0.5 AS good, count(*) AS n") == [
        {"good": False, "n": 2}, {"good": True, "n": 5}]
    assert rows(g, "NODES GROUP BY coalesce(summary, 'none') = 'other session' "
                   "RETURN coalesce(summary, 'none') = 'other session' AS other, count(*) AS n") == [
        {"other": False, "n": 6}, {"other": True, "n": 1}]
    # expressions over keys and aggregates
    assert rows(g, "NODES GROUP BY session_id RETURN upper(session_id) AS s, "
                   "max(reward('score')) - min(reward('score')) AS spread, count(*) * 10 AS tens") == [
        {"s": "S1", "spread": pytest.approx(0.85), "tens": 60}, {"s": "S2", "spread": 0.0, "tens": 10}]
    # without RETURN a grouped query returns its keys
    assert rows(g, "NODES GROUP BY session_id") == [{"session_id": "s1"}, {"session_id": "s2"}]


def test_sum_and_avg_types(g: trellisdb.Database) -> None:
    got = g.query("NODES RETURN sum(step) AS s, avg(step) AS a, sum(reward('score') > 0.5) AS hits, "
                  "avg(reward('score') > 0.5) AS share, sum(reward('score')) AS total, min(created_at) AS t")
    row = got.to_pylist()[0]
    # whole numbers sum exactly to an integer (not DuckDB's 128-bit decimal); a condition counts where it holds
    assert row["s"] == 22 and isinstance(row["s"], int)
    assert row["hits"] == 4 and isinstance(row["hits"], int)
    assert row["share"] == pytest.approx(4 / 7) and row["a"] == pytest.approx(22 / 7)
    assert row["total"] == pytest.approx(0.1 + 0.5 + 0.7 + 0.9 + 0.35 + 0.95 + 0.8)
    assert isinstance(row["t"], dt.datetime)


def test_other_entities_aggregate_too(g: trellisdb.Database) -> None:
    assert rows(g, "REWARDS GROUP BY channel RETURN channel, count(*) AS n, max(value) AS best") == [
        {"channel": "score", "n": 7, "best": 0.95}]
    assert rows(g, "SESSIONS GROUP BY task_id RETURN task_id, count(*) AS n, min(agent) AS a") == [
        {"task_id": "t", "n": 2, "a": "a"}]
    assert rows(g, "TASKS RETURN count(*) AS n") == [{"n": 1}]
    assert rows(g, "REWARDS FROM SESSION 's2' RETURN count(*) AS n") == [{"n": 1}]


def test_explain_shows_the_aggregate(g: trellisdb.Database) -> None:
    res = g.query("NODES FROM TASK 't' GROUP BY session_id HAVING count(*) > 1 ORDER BY best DESC LIMIT 5 "
                  "RETURN session_id, count(*) AS n, max(reward('score')) AS best")
    assert res.plan.pretty().splitlines()[:-1] == [
        "Project __g1 AS session_id, __a1 AS n, __a2 AS best",
        "  Limit 5",
        "    Sort __a2 DESC, then __g1",
        "      Filter (__a1 > 1)  -- HAVING",
        "        Aggregate count(*) AS __a1, max(reward('score')) AS __a2 by session_id AS __g1",
        "          Derive reward('score')",
    ]
    assert res.sql is not None and "GROUP BY 1" in res.sql and "COUNT(*)" in res.sql
    out = g.query("EXPLAIN NODES RETURN count(*) AS n").to_pylist()[0]["explain"]
    assert "Aggregate count(*) AS __a1 over all rows (one row)" in out and "-- DuckDB plan" in out


@pytest.mark.parametrize(
    ("text", "kind", "needles"),
    [
        ("NODES RETURN count(id), step", trellisdb.QueryTypeError,
         ["RETURN uses step (line 1, column 25) outside an aggregate", "no GROUP BY", "max(step)", "GROUP BY step"]),
        ("NODES GROUP BY session_id RETURN session_id, step, count(*) AS n", trellisdb.QueryTypeError,
         ["RETURN uses step (line 1, column 46)", "neither a GROUP BY key nor inside an aggregate",
          "GROUP BY session_id, step", "max(step)"]),
        ("NODES GROUP BY session_id ORDER BY step RETURN session_id", trellisdb.QueryTypeError,
         ["ORDER BY uses step", "GROUP BY session_id, step"]),
        ("NODES GROUP BY session_id HAVING step > 1 RETURN session_id", trellisdb.QueryTypeError,
         ["HAVING uses step"]),
        ("NODES WHERE count(*) > 3 RETURN id", trellisdb.QueryError,
         ["count(*) (line 1, column 13) is an aggregate", "cannot be in WHERE", "HAVING count(*) > 3"]),
        ("NODES GROUP BY max(step) RETURN count(*) AS n", trellisdb.QueryError,
         ["max(step) (line 1, column 16) is an aggregate", "GROUP BY takes values of each row"]),
        ("NODES GROUP BY n RETURN count(*) AS n", trellisdb.QueryError,
         ["GROUP BY n (line 1, column 16) names the RETURN column n, which is an aggregate (count(*))"]),
        ("NODES RETURN max(count(*))", trellisdb.QueryError, ["aggregates cannot nest", "count(*)"]),
        ("NODES RETURN sum(summary)", trellisdb.QueryTypeError, ["sum() takes numbers", "summary is text"]),
        ("NODES RETURN avg(created_at) AS a", trellisdb.QueryTypeError, ["avg() takes numbers", "created_at is time"]),
        ("NODES ORDER BY count(*)", trellisdb.QueryError, ["without GROUP BY needs a RETURN", "RETURN count(*) AS n"]),
        ("NODES GROUP BY session_id PER step 1 RETURN session_id", trellisdb.QueryError,
         ["PER keeps at most k rows per value", "grouped query"]),
        ("NODES GROUP BY session_id HAVING count(*) RETURN session_id", trellisdb.QueryTypeError,
         ["HAVING needs a condition"]),
        ("FRONTIER RANK BY reward('score') DESC RETURN count(*) AS n", trellisdb.QueryError,
         ["FRONTIER returns rows, and does not aggregate them", "NODES, SESSIONS, TASKS and REWARDS selections"]),
        ("LINEAGE OF 'c' ANCESTORS RETURN max(hop) AS h", trellisdb.QueryError, ["LINEAGE returns rows"]),
        ("SUBTREE OF 'a' WHERE count(*) > 1", trellisdb.QueryError, ["SUBTREE returns rows"]),
        ("FRONTIER PER max(step) 1", trellisdb.QueryError, ["PER takes a value of each row"]),
        ("NODES RETURN sum(*)", trellisdb.QuerySyntaxError, ["only count(*) takes '*'"]),
        ("NODES RETURN max(step, 2)", trellisdb.QuerySyntaxError,
         ["max() is an aggregate and takes one argument, got 2", "greatest(a, b)"]),
        ("NODES RETURN lower(DISTINCT id)", trellisdb.QuerySyntaxError, ["DISTINCT goes inside an aggregate"]),
    ],
)
def test_aggregate_mistakes_are_clear_errors(g: trellisdb.Database, text: str, kind: type[trellisdb.QueryError],
                                             needles: list[str]) -> None:
    msg = error(g, text, kind)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_a_grouping_error_points_at_the_column(g: trellisdb.Database) -> None:
    text = "NODES GROUP BY session_id\nRETURN session_id, step"
    with pytest.raises(trellisdb.QueryTypeError) as ei:
        g.query(text)
    e = ei.value
    assert e.span is not None and e.query == text and text[e.span.start:e.span.end] == "step"
    assert (e.span.line, e.span.column) == (2, 20)


def test_group_by_parses_where_sql_has_it_and_return_stays_last() -> None:
    q = parse("NODES WHERE step > 1 GROUP BY session_id, step % 2 HAVING count(*) > 1 ORDER BY n DESC LIMIT 3 "
              "RETURN session_id, count(*) AS n")
    s = q.statement
    assert isinstance(s, A.Select) and s.grouped and len(s.group_by) == 2 and s.having is not None
    assert isinstance(s.returning[1].expr, A.AggCall) and s.returning[1].expr.arg is None
    c = parse("NODES RETURN count(DISTINCT session_id)").statement
    assert isinstance(c, A.Select) and c.returning[0].expr == A.AggCall("count", A.Column(
        "session_id", c.returning[0].expr.arg.span), True, c.returning[0].expr.span)  # type: ignore[union-attr]
    assert not parse("NODES RETURN id").statement.grouped  # type: ignore[union-attr]
    # the SQL habit (RETURN before ORDER BY) is a syntax error whose hint shows the TQL order
    with pytest.raises(trellisdb.QuerySyntaxError) as ei:
        parse("NODES GROUP BY session_id RETURN session_id, count(*) AS n ORDER BY n DESC LIMIT 5 AS OF TAG 'x'")
    assert ("RETURN comes after the other clauses: put ORDER ... before RETURN, as in: NODES GROUP BY session_id "
            "ORDER BY n DESC LIMIT 5 RETURN session_id, count(*) AS n AS OF TAG 'x'") in str(ei.value)
    with pytest.raises(trellisdb.QuerySyntaxError, match="GROUP BY has 33 keys, over the limit of 32"):
        parse("NODES GROUP BY " + ", ".join(["step"] * (MAX_GROUP_KEYS + 1)))


# ------------------------------------------------------------------ PER <expression> k
def test_per_any_expression_on_the_frontier(g: trellisdb.Database) -> None:
    # frontier: c (step 5, .9), d (4, .35), e (6, .95), x (1, .8)
    assert ids(g, "FRONTIER RANK BY reward('score') DESC PER step % 2 1") == ["e", "c"]
    assert ids(g, "FRONTIER RANK BY reward('score') DESC PER step % 2 2 LIMIT 3") == ["e", "c", "x"]
    assert ids(g, "FRONTIER RANK BY reward('score') DESC PER reward('score') > 0.85 1") == ["e", "x"]
    assert [r["id"] for r in rows(g, "FRONTIER RANK BY reward('score') DESC PER step % $m $k", m=2, k=1)] == [
        "e", "c"]
    # PER PARENT and PER SESSION are PER parent and PER session_id
    assert ids(g, "FRONTIER RANK BY reward('score') DESC PER PARENT 1") == ids(
        g, "FRONTIER RANK BY reward('score') DESC PER coalesce(parent, parent) 1") == ["e", "c", "x"]
    assert ids(g, "FRONTIER RANK BY reward('score') DESC PER SESSION 1") == ids(
        g, "FRONTIER RANK BY reward('score') DESC PER session_id 1") == ["e", "x"]
    plan = g.query("FRONTIER RANK BY reward('score') DESC PER step % 2 1").plan.pretty()
    assert "TopPerGroup 1 per (step % 2) by reward('score') DESC, then seq, id" in plan


def test_per_on_a_selection_and_nulls_form_one_group(g: trellisdb.Database) -> None:
    # roots r (.1) and x (.8) have no parent: one group, x wins it
    assert rows(g, "NODES ORDER BY reward('score') DESC PER parent 1 RETURN id, parent") == [
        {"id": "e", "parent": "b"}, {"id": "c", "parent": "a"}, {"id": "x", "parent": None},
        {"id": "b", "parent": "r"}]
    assert ids(g, "NODES ORDER BY reward('score') DESC PER session_id 1") == ["e", "x"]
    assert ids(g, "NODES WHERE step <= 3 ORDER BY step DESC PER session_id 2 LIMIT 3") == ["b", "a", "x"]
    # the row order stays the selection's, ties broken by insertion order (r was written first)
    assert ids(g, "NODES PER session_id 1") == ["r", "x"]
    assert "TopPerGroup 1 per session_id" in g.query("EXPLAIN NODES PER session_id 1").to_pylist()[0]["explain"]


def test_per_mistakes(g: trellisdb.Database) -> None:
    assert "PER ... k (line 1, column 16) must be a whole number >= 1, got 0" in error(g, "NODES PER step 0")
    assert "unknown column 'nope'" in error(g, "FRONTIER PER nope 2", trellisdb.QueryNameError)
    assert "unknown column 'parent'" in error(g, "SESSIONS PER PARENT 1", trellisdb.QueryNameError)
    assert "ucb() ranks the frontier" in error(g, "FRONTIER PER ucb(step, visits, 1) 1")


# ------------------------------------------------------------------ AS OF STEP k
@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[trellisdb.Database]:
    """Session s1 writes step 2 in two flushes (another session commits between them), rewards
    step 2 before step 3 starts, writes step 3's second half together with step 4's first node,
    then re-scores a step-2 node."""
    db = trellisdb.connect(tmp_path_factory.mktemp("steps") / "db", embedding_dim=4)
    s = db.session(task="t", agent="a", id="s1")
    o = db.session(task="t", agent="b", id="o")
    with db.transaction():
        s.add_node(id="p", step=1)
    with db.transaction():
        s.add_node(id="q1", parents=["p"], step=2)  # step 2, first flush
    with db.transaction():
        o.add_node(id="other", step=1)
    with db.transaction():
        s.add_node(id="q2", parents=["p"], step=2)  # step 2, second flush
        s.add_reward("q1", "score", 0.4)
    with db.transaction():
        s.add_reward("q2", "score", 0.6)  # the step's evaluation, before step 3 starts
    with db.transaction():
        s.add_node(id="r1", parents=["q1"], step=3)
    with db.transaction():
        s.add_node(id="r2", parents=["q2"], step=3)  # step 3 ends in the flush that starts step 4
        s.add_node(id="t1", parents=["r1"], step=4)
    with db.transaction():
        s.add_reward("q1", "score", 0.45)  # a late re-score of step 2
        s.add_node(id="gap", step=9)
    yield db
    db.close()


def test_as_of_step_sees_every_flush_of_the_step_and_nothing_later(steps: trellisdb.Database) -> None:
    def at(k: int) -> list[tuple[object, object]]:
        res = steps.query(f"NODES WHERE session_id = 's1' ORDER BY id RETURN id, reward('score') AS s "
                          f"AS OF STEP {k} OF SESSION 's1'")
        return [(r["id"], r["s"]) for r in res.to_pylist()]

    assert at(1) == [("p", None)]
    # both flushes of step 2 and its rewards; nothing of step 3, whose nodes came in later flushes
    assert at(2) == [("p", None), ("q1", 0.4), ("q2", 0.6)]
    # step 3 was finished only in the commit that started step 4: that commit, t1 included
    assert at(3) == [("p", None), ("q1", 0.4), ("q2", 0.6), ("r1", None), ("r2", None), ("t1", None)]
    assert at(4) == at(3)
    assert dict(at(9))["q1"] == 0.45  # the last step: everything written about the session's steps
    # the snapshot is a commit like any other: the other session's commit between the flushes is in it
    assert [r["id"] for r in steps.query("NODES WHERE session_id = 'o' AS OF STEP 2 OF SESSION 's1'").to_pylist()] == [
        "other"]


def test_as_of_step_the_session_lacks_says_which_steps_it_has(steps: trellisdb.Database) -> None:
    msg = error(steps, "NODES AS OF STEP 57 OF SESSION 's1'")
    assert "session 's1' has no step 57; its steps run 1..9 with gaps; the nearest are 9" in msg
    assert "the nearest are 4 and 9" in error(steps, "NODES AS OF STEP 6 OF SESSION 's1'")
    assert "session 'o' has no step 2; its only step is 1" in error(steps, "NODES AS OF STEP 2 OF SESSION 'o'")


def test_as_of_step_of_a_contiguous_session(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    s = db.session(task="t", agent="a", id="run")
    for i in range(3):
        with db.transaction():
            s.add_node(id=f"n{i}")  # steps 1, 2, 3 (the session's counter)
    assert "session 'run' has no step 7; its steps are 1..3" in error(db, "NODES AS OF STEP 7 OF SESSION 'run'")
    assert [r["id"] for r in db.query("NODES AS OF STEP 2 OF SESSION 'run'").to_pylist()] == ["n0", "n1"]
    db.close()
