"""TQL inputs whose error (or lack of one) is known to be poor.

Each case is a strict xfail stating what a good message would do; when one is
fixed its test starts passing, fails as XPASS, and the entry moves to a real
test. Keep this list honest: add what you notice.
"""

from __future__ import annotations

import pytest

import trellisdb


def message(db: trellisdb.Database, text: str) -> str:
    try:
        db.query(text)
    except trellisdb.TrellisError as e:
        return str(e)
    return ""


@pytest.mark.xfail(strict=True, reason="type errors come from DuckDB's binder: no TQL line/column, no column name")
def test_type_mismatch_points_at_the_tql_expression(g: trellisdb.Database) -> None:
    msg = message(g, "NODES WHERE status > 3")
    assert "line 1, column 13" in msg and "status" in msg


@pytest.mark.xfail(strict=True, reason="the resolver does not type-check: a non-boolean WHERE is accepted")
def test_where_must_be_a_condition(g: trellisdb.Database) -> None:
    assert "condition" in message(g, "NODES WHERE reward('score')")


@pytest.mark.xfail(strict=True, reason="lark's contextual lexer reports every terminal of the state, ')' and ',' included")
def test_expected_list_names_only_what_fits(g: trellisdb.Database) -> None:
    msg = message(g, "NODES WHERE a && b")
    assert "')'" not in msg and "','" not in msg


@pytest.mark.xfail(strict=True, reason="AS OF must come last; a clause after it gets a hint, but not the fix")
def test_as_of_in_the_middle_shows_the_rewritten_query(g: trellisdb.Database) -> None:
    assert "NODES RETURN id AS OF TAG 'early'" in message(g, "NODES AS OF TAG 'early' RETURN id")
