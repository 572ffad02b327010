"""TQL type errors name the TQL text (line, column, the expression), before any SQL runs."""

from __future__ import annotations

import pytest

import trellisdb


def message(db: trellisdb.Database, text: str, **params: object) -> str:
    with pytest.raises(trellisdb.TrellisError) as e:
        db.query(text, **params)
    return str(e.value)


@pytest.mark.parametrize(
    ("text", "params", "expected"),
    [
        ("NODES WHERE status > 3", {}, ["line 1, column 13", "status (text)", "3 (number)"]),
        ("NODES WHERE step > $x", {"x": "a"}, ["line 1, column 13", "step (number)", "'a' (text)"]),
        ("NODES WHERE reward('score')", {}, ["WHERE needs a condition", "reward('score') is number", "> 0.5"]),
        ("NODES WHERE step > 1 AND summary", {}, ["line 1, column 26", "summary is text, not a condition"]),
        ("NODES WHERE status IN ('a', 2)", {}, ["line 1, column 29", "2 (number)"]),
        ("NODES WHERE step BETWEEN 1 AND 'x'", {}, ["line 1, column 32", "BETWEEN"]),
        ("NODES WHERE -status > 1", {}, ["line 1, column 14", "not a number"]),
        ("NODES WHERE lower(step) = 'a'", {}, ["line 1, column 19", "lower() takes text"]),
        ("NODES WHERE created_at > 'yesterday'", {}, ["line 1, column 26", "'yesterday' is not a time", "ISO"]),
        ("NODES RETURN summary * 2 AS x", {}, ["summary is text, not a number"]),
        ("NODES ORDER BY status + 1", {}, ["status is text, not a number"]),
        ("FRONTIER EXPANDED WHEN children RANK BY depth", {}, ["EXPANDED WHEN needs a condition"]),
        ("LINEAGE OF 'root' ANCESTORS WHERE hop", {}, ["WHERE needs a condition", "hop is number"]),
    ],
)
def test_type_errors(g: trellisdb.Database, text: str, params: dict[str, object], expected: list[str]) -> None:
    with pytest.raises(trellisdb.QueryTypeError) as e:
        g.query(text, **params)
    for part in expected:
        assert part in str(e.value), (part, str(e.value))


@pytest.mark.parametrize(
    "text",
    [
        "NODES WHERE created_at > '2026-01-01' AND created_at < '2100-01-01T00:00:00+00:00'",
        "NODES WHERE step IS NULL OR step BETWEEN 1 AND 3 AND NOT (status = 'x')",
        "NODES WHERE coalesce(reward('score'), 0) >= 0 RETURN id, greatest(step, 1) AS g, upper(status) AS u",
        "NODES WHERE contains(summary, 'a') OR starts_with(id, 'r')",
        "NODES WHERE step = NULL OR status = $s",
        "FRONTIER EXPANDED WHEN children > 1 RANK BY ucb(reward('score'), visits, 1.4) DESC",
    ],
)
def test_well_typed_queries_pass(g: trellisdb.Database, text: str) -> None:
    params = {"s": None} if "$s" in text else {}
    g.query(text, **params)  # runs: no type error, no DuckDB error


def test_expected_list_names_only_what_fits(g: trellisdb.Database) -> None:
    msg = message(g, "NODES WHERE a && b")
    assert "')'" not in msg and "','" not in msg
    assert "AND" in msg and "OR" in msg
    assert "')'" in message(g, "NODES WHERE (step > 1")  # inside a parenthesis it does fit
    assert "the end of the query" in message(g, "NODES LIMT 3")


def test_as_of_in_the_middle_shows_the_rewritten_query(g: trellisdb.Database) -> None:
    assert "NODES RETURN id AS OF TAG 'early'" in message(g, "NODES AS OF TAG 'early' RETURN id")
    msg = message(g, "NODES AS OF COMMIT 1 WHERE step > 1 LIMIT 2")
    assert "NODES WHERE step > 1 LIMIT 2 AS OF COMMIT 1" in msg
