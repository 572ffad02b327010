"""TQL inputs whose error (or lack of one) is known to be poor.

Each case is a strict xfail stating what a good message would do; when one is
fixed its test starts passing, fails as XPASS, and the entry moves to a real
test (``test_tql_types.py`` holds the ones fixed so far). Keep this list
honest: add what you notice.
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


@pytest.mark.xfail(strict=True, reason="ln/sqrt of a negative number is NaN, which DuckDB orders above every "
                                       "number: the condition holds instead of failing or being unknown")
def test_math_domain_errors_are_reported(g: trellisdb.Database) -> None:
    assert "negative" in message(g, "NODES WHERE ln(step - 100) > 0")


@pytest.mark.xfail(strict=True, reason="a failure inside DuckDB at run time (here a computed text cast to a "
                                       "timestamp in SQL) is reported without the TQL position")
def test_run_time_failures_point_at_the_tql_text(g: trellisdb.Database) -> None:
    msg = message(g, "NODES WHERE created_at > lower('not a time')")
    assert "line 1, column 26" in msg
