"""TQL's closed dispatch and its errors: spans as data, the operator union, the vector step in the plan.

Whether every ``match`` over an AST or plan union has a case for each member is
checked by ``mypy --strict`` (each ends in ``case _: assert_never(x)``); these
tests check what mypy cannot: that the unions hold every class, that a class
outside them fails loudly, and that errors point at the right text.
"""

from __future__ import annotations

import dataclasses
import inspect
import pickle
import typing

import pytest

import trellisdb
from trellisdb import errors
from trellisdb.tql import ast as A
from trellisdb.tql import plan as P
from trellisdb.tql.compile import compile_plan
from trellisdb.tql.parser import parse
from trellisdb.tql.resolve import Bound, Catalog, resolve

CATALOG = Catalog(
    channels=lambda: {"score"},
    sessions=lambda: {"s1"},
    tasks=lambda: {"t"},
    tags={},
    commits={i: {"id": i, "time": 1_700_000_000.0 + i} for i in range(1, 4)},
    last_commit=3,
    step_commit=lambda s, k: 1,
    spaces=lambda target: {"embedding": 4, "summaries": 4},
)


def pointed(e: trellisdb.QueryError) -> str:
    """The text an error's span covers."""
    assert e.span is not None and e.query is not None, e
    return e.query[e.span.start:e.span.end]


# ------------------------------------------------------------------ errors carry their place
def test_a_syntax_error_carries_its_span() -> None:
    text = "NODES WHERE step == 3"
    with pytest.raises(trellisdb.QuerySyntaxError) as ei:
        parse(text)
    e = ei.value
    assert e.query == text and pointed(e) == "="  # the second '=' (a single '=' compares)
    assert (e.span.start, e.span.line, e.span.column) == (18, 1, 19)  # type: ignore[union-attr]
    assert (e.line, e.column) == (1, 19) and "line 1, column 19" in str(e)


def test_a_syntax_error_at_the_end_has_an_empty_span_there() -> None:
    text = "NODES\nWHERE step >\n"
    with pytest.raises(trellisdb.QuerySyntaxError) as ei:
        parse(text)
    span = ei.value.span
    assert span is not None and span.start == span.end == len(text.rstrip())
    assert (span.line, span.column) == (2, 13)


def test_an_unknown_name_error_carries_its_span() -> None:
    text = "NODES WHERE step > 1 AND stpe < 9"
    with pytest.raises(trellisdb.QueryNameError, match="did you mean 'step'") as ei:
        resolve(parse(text), CATALOG)
    e = ei.value
    assert e.query == text and pointed(e) == "stpe"
    assert (e.span.line, e.span.column) == (1, 26)  # type: ignore[union-attr]
    with pytest.raises(trellisdb.QueryNameError) as ei:
        resolve(parse("NODES WHERE step > $lo"), CATALOG)
    assert pointed(ei.value) == "$lo"
    with pytest.raises(trellisdb.QueryNameError) as ei:
        resolve(parse("NODES RETURN lenght(summary) AS n"), CATALOG)
    assert pointed(ei.value) == "lenght(summary)"


def test_a_type_error_carries_its_span() -> None:
    text = "NODES\nWHERE step > 1 AND status > 3"
    with pytest.raises(trellisdb.QueryTypeError) as ei:
        resolve(parse(text), CATALOG)
    e = ei.value
    assert e.query == text and pointed(e) == "status > 3"
    assert (e.span.line, e.span.column) == (2, 20)  # type: ignore[union-attr]
    assert "(line 2, column 20)" in str(e)  # the message is as before
    with pytest.raises(trellisdb.QueryTypeError) as ei:
        resolve(parse("NODES WHERE step > 1 AND summary"), CATALOG)
    assert pointed(ei.value) == "summary"


def test_an_error_without_a_place_has_no_span() -> None:
    with pytest.raises(trellisdb.QueryNameError) as ei:
        resolve(parse("NODES"), CATALOG, {"unused": 1})
    assert ei.value.span is None and ei.value.query == "NODES"
    assert trellisdb.QueryError("plain").span is None


def test_the_span_survives_pickling() -> None:
    with pytest.raises(trellisdb.QuerySyntaxError) as ei:
        parse("NODES WHERE step == 3")
    back = pickle.loads(pickle.dumps(ei.value))
    assert (str(back), back.span, back.query, back.line, back.column) == (
        str(ei.value), ei.value.span, ei.value.query, 1, 19)


def test_tql_errors_live_in_errors_py_and_are_exported() -> None:
    assert P.PlanError is errors.PlanError is trellisdb.PlanError
    assert issubclass(trellisdb.PlanError, trellisdb.QueryError)
    for name in ("QuerySyntaxError", "QueryNameError", "QueryTypeError", "PlanError", "EmptySpaceError"):
        assert getattr(trellisdb, name) is getattr(errors, name)
        assert name in trellisdb.__all__


# ------------------------------------------------------------------ closed unions
def _classes(module: object, base: type | None = None) -> set[type]:
    return {c for _, c in inspect.getmembers(module, inspect.isclass)
            if c.__module__ == getattr(module, "__name__", "") and (base is None or issubclass(c, base))}


def test_the_operator_union_holds_every_operator() -> None:
    assert set(typing.get_args(P.Operator)) == _classes(P, P.Plan) - {P.Plan}
    assert typing.get_args(P.Operator) == P.OPERATORS


def test_the_expression_and_statement_unions_hold_every_node() -> None:
    nodes = {c for c in _classes(A) if dataclasses.is_dataclass(c) and "span" in {f.name for f in dataclasses.fields(c)}}
    clauses = {A.Scope, A.AsOf, A.ViewCommand}
    assert set(typing.get_args(A.Expr)) | set(typing.get_args(A.Statement)) == nodes - clauses
    assert set(typing.get_args(A.Command)) == set(typing.get_args(A.Statement)) | {A.ViewCommand}


def test_a_plan_class_outside_the_union_fails_loudly() -> None:
    @dataclasses.dataclass(frozen=True)
    class Mystery(P.Plan):
        pass

    with pytest.raises(trellisdb.PlanError, match="Mystery is not a plan operator"):
        compile_plan(Mystery())
    with pytest.raises(trellisdb.PlanError, match="Derive reads a Scan, a graph walk or an Expand, not a Limit"):
        compile_plan(P.Derive(P.Limit(P.Scan("nodes", 1), 3), ("score",)))


# ------------------------------------------------------------------ the vector step in the plan
def _plan(text: str, **params: object) -> P.Plan:
    return P.build(resolve(parse(text), CATALOG, params))


def test_vector_search_carries_what_the_vector_step_needs() -> None:
    plan = _plan("RETRIEVE 4 SIMILAR TO $q IN summaries MATCHING 'greedy' WHERE reward('score') > 0.5 "
                 "EXPAND ANCESTORS 1 RETURN id", q=[1.0, 0.0, 0.0, 0.0])
    vs = P.vector_search(plan)
    assert vs is not None
    assert (vs.entity, vs.space, vs.k, vs.similar_text, vs.vector_param, vs.matching, vs.snapshot) == (
        "nodes", "summaries", 4, None, "q", "greedy", 3)
    assert isinstance(vs.prefilter, P.Project) and [p.alias for p in vs.prefilter.columns] == ["id"]
    assert "reward_score" not in compile_plan(vs.prefilter).sql  # node columns only: the channel keeps its name
    ex = plan
    while not isinstance(ex, P.Expand):
        ex = ex.input  # type: ignore[attr-defined]
    assert ex.input is vs  # the leaf the Expand (the relation __found) rests on

    text = P.vector_search(_plan("RETRIEVE 2 SIMILAR TO 'hex grid' FROM tasks"))
    assert text is not None
    assert (text.entity, text.space, text.similar_text, text.vector_param, text.matching, text.prefilter) == (
        "tasks", "embedding", "hex grid", None, None, None)
    assert P.vector_search(_plan("NODES WHERE step > 1")) is None


def test_vector_search_checks_its_fields() -> None:
    with pytest.raises(trellisdb.PlanError, match="not both"):
        P.VectorSearch("nodes", "embedding", 3, "a text", "q", None, None, 1)
    with pytest.raises(trellisdb.PlanError, match="needs SIMILAR TO"):
        P.VectorSearch("nodes", "embedding", 3, None, None, None, None, 1)
    with pytest.raises(trellisdb.PlanError, match="k must be >= 1"):
        P.VectorSearch("nodes", "embedding", 0, None, None, "kw", None, 1)


def test_graph_statements_plan_as_before() -> None:
    q = parse("SIBLINGS OF 'a' WHERE step > 1")
    plan = P.build(Bound(q, q.statement, 2))  # type: ignore[arg-type]
    assert plan.pretty().splitlines() == [
        "Sort shared_parent, then seq, id",
        "  Filter (step > 1)",
        "    Derive ",
        "      Siblings of 'a' via  as of commit 2",
    ]
