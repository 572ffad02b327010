"""TQL parsing: every grammar rule has an AST handler; syntax errors point at the mistake."""

from __future__ import annotations

import pytest

import trellisdb
from trellisdb.tql import ast as A
from trellisdb.tql.parser import grammar_text, parse, parser
from trellisdb.tql.show import show


def test_every_grammar_rule_has_an_ast_handler() -> None:
    needed = set()
    for r in parser().rules:
        name = r.alias or r.origin.name
        if str(name).startswith("_"):
            continue  # lark's helper rules for repetitions: always inlined
        kept = [s for s in r.expansion if not (s.is_term and s.filter_out)]
        if r.options.expand1 and r.alias is None and len(kept) == 1:
            continue  # a ?rule with one child is replaced by that child, never handled
        needed.add(str(name))
    missing = needed - A.handler_names()
    assert not missing, f"grammar rules without a handler in ToAst: {sorted(missing)}"
    assert len(needed) > 40  # the enumeration itself found the grammar


def test_grammar_is_packaged_and_loaded_from_there() -> None:
    text = grammar_text()
    assert "FRONTIER" in text and "LINEAGE" in text


def test_keywords_are_case_insensitive_and_names_may_look_like_keywords() -> None:
    q = parse("frontier where step > 1 and status != 'done' rank by reward('s') desc per parent 2 limit 3")
    assert isinstance(q.statement, A.Frontier)
    d = q.statement.diversity
    assert d is not None and isinstance(d.per, A.Column) and d.per.name == "parent"  # PER PARENT is PER parent
    assert d.k == A.Literal(2, d.k.span)
    d = parse("FRONTIER PER session 1").statement.diversity  # type: ignore[union-attr]
    assert d is not None and isinstance(d.per, A.Column) and d.per.name == "session_id"
    # any expression, then k
    d = parse("FRONTIER RANK BY step PER step % 3 $k").statement.diversity  # type: ignore[union-attr]
    assert d is not None and show(d.per) == "(step % 3)" and d.k == A.Param("k", d.k.span)
    # 'step' and 'parent' are keywords of AS OF STEP / PER PARENT, and also column names
    q = parse("NODES WHERE parent = 'x' ORDER BY step RETURN step, parent AS p AS OF STEP 3 OF SESSION 's'")
    assert isinstance(q.statement, A.Select)
    assert [p.alias for p in q.statement.returning] == [None, "p"]
    assert q.as_of is not None and q.as_of.kind == "step"


def test_literals_comments_and_spans() -> None:
    q = parse("NODES -- a comment\nWHERE summary = 'it''s' AND step >= -2 AND x < 1.5e3")
    assert isinstance(q.statement, A.Select)
    w = q.statement.where
    assert isinstance(w, A.BoolOp) and w.op == "AND" and len(w.operands) == 3  # one flat chain
    lits = []

    def walk(e: object) -> None:
        if isinstance(e, A.Literal):
            lits.append(e.value)
        for v in e if isinstance(e, tuple) else getattr(e, "__dict__", {}).values():
            walk(v)

    walk(w)
    assert lits == ["it's", -2, 1500.0]
    assert w.span.line == 2 and w.span.column == 7


@pytest.mark.parametrize(
    ("text", "where", "needle"),
    [
        ("NODES WHERE", "line 1, column 12", "ends too early; expected an expression"),
        ("NODES WHERE status = \"done\"", "line 1, column 22", "single quotes"),
        ("SELECT id FROM nodes", "line 1, column 1", "starts with the entity"),
        ("LINEAGE OF 'n1'", "line 1, column 16", "LINEAGE needs a direction"),
        ("NODES AS OF 3", "line 1, column 13", "AS OF takes COMMIT n"),
        ("NODES WHERE step == 3", "line 1, column 19", "single '='"),
        ("FRONTIER ORDER BY x", "line 1, column 10", "RANK BY"),
        ("NODES RETURN id AS OF TAG 'x' LIMIT 3", "line 1, column 31", "AS OF comes last"),
        ("NODES\nWHERE step >\n", "line 2, column 13", "ends too early"),
        ("NODES WHERE a @ b", "line 1, column 15", "unexpected character '@'"),
    ],
)
def test_syntax_errors_show_position_caret_and_hint(text: str, where: str, needle: str) -> None:
    with pytest.raises(trellisdb.QuerySyntaxError) as ei:
        parse(text)
    msg = str(ei.value)
    assert msg.startswith(where), msg
    assert needle in msg, msg
    caret_line = [ln for ln in msg.splitlines() if ln.strip() == "^"]
    assert caret_line, msg
    col = int(where.rsplit(" ", 1)[1])
    assert caret_line[0].index("^") == col + 1  # two spaces of indent, 1-based column


def test_empty_huge_and_non_string_queries() -> None:
    for bad in ("", "   \n ", "x" * 200_000):
        with pytest.raises(trellisdb.QuerySyntaxError):
            parse(bad)
    with pytest.raises(trellisdb.QuerySyntaxError):
        parse(42)  # type: ignore[arg-type]
    # parentheses vanish in the AST; deep NOT chains hit the nesting limit with a clear error
    assert parse("NODES WHERE " + "(" * 3000 + "1" + ")" * 3000).statement.where == A.Literal(1, A.Span(3012, 3013, 1, 3013))
    with pytest.raises(trellisdb.QuerySyntaxError, match="nests too deeply"):
        parse("NODES WHERE " + "NOT " * 5000 + "TRUE")


def test_and_or_chains_are_one_flat_node_each_and_keep_precedence() -> None:
    w = parse("NODES WHERE a = 1 OR b = 2 AND c = 3 AND NOT d = 4 OR (e = 5 OR f = 6)").statement.where
    assert isinstance(w, A.BoolOp) and w.op == "OR" and len(w.operands) == 3
    assert isinstance(w.operands[1], A.BoolOp) and w.operands[1].op == "AND" and len(w.operands[1].operands) == 3
    assert isinstance(w.operands[1].operands[2], A.Not)
    assert isinstance(w.operands[2], A.BoolOp) and w.operands[2].op == "OR"  # parentheses stay a group
    assert w.span.start == 12 and w.span.end == 70
    assert show(w) == "((a = 1) OR ((b = 2) AND (c = 3) AND NOT (d = 4)) OR ((e = 5) OR (f = 6)))"
    with pytest.raises(trellisdb.QueryError, match="at least two operands"):
        A.BoolOp("AND", (A.Column("a"),))
    with pytest.raises(trellisdb.QueryError, match="use Binary"):
        A.BoolOp("+", (A.Column("a"), A.Column("b")))


def test_mistakes_found_while_building_the_ast_keep_their_own_message() -> None:
    with pytest.raises(trellisdb.QuerySyntaxError, match=r"^RETRIEVE takes at most one SIMILAR TO"):
        parse("RETRIEVE 3 SIMILAR TO 'a' SIMILAR TO 'b'")
