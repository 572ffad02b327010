"""Golden fixtures: tests/fixtures/queries/*.tql -> the expected plan (.plan) and SQL (.sql).

The plan and SQL text are the compiler's contract: a change to either shows up
here as a diff. After an intended change, regenerate with
``TRELLIS_REGEN_GOLDEN=1 pytest tests/test_tql_golden.py`` and review the diff.
Each fixture also runs on the hand-built graph of ``test_tql_exec``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import trellisdb
from trellisdb.tql.compile import compile_plan
from trellisdb.tql.parser import parse
from trellisdb.tql.plan import build
from trellisdb.tql.resolve import Catalog, resolve

HERE = Path(__file__).with_name("fixtures") / "queries"
CASES = sorted(HERE.glob("*.tql"))
REGEN = os.environ.get("TRELLIS_REGEN_GOLDEN") == "1"

CATALOG = Catalog(
    channels=lambda: {"score"},
    sessions=lambda: {"s1", "s2"},
    tasks=lambda: {"t"},
    tags={"early": 1},
    commits={i: {"id": i, "time": 1_700_000_000.0 + i} for i in range(1, 8)},
    last_commit=7,
    step_commit=lambda s, k: 1,
)


def render(text: str) -> tuple[str, str]:
    plan = build(resolve(parse(text), CATALOG))
    c = compile_plan(plan)
    params = "".join(f"-- ${k} = {v!r}\n" for k, v in c.params.items())
    return plan.pretty() + "\n", c.sql + "\n" + params


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden_plan_and_sql(case: Path) -> None:
    plan, sql = render(case.read_text())
    for suffix, got in ((".plan", plan), (".sql", sql)):
        path = case.with_suffix(suffix)
        if REGEN or not path.exists():
            path.write_text(got)
            if not REGEN:
                pytest.fail(f"{path.name} did not exist; wrote it: review and commit it")
        assert got == path.read_text(), f"{path.name} changed; see the module docstring"


def test_there_are_fixtures() -> None:
    assert len(CASES) >= 8


@pytest.mark.parametrize("case", CASES, ids=[c.stem for c in CASES])
def test_golden_queries_run(case: Path, g: trellisdb.Database) -> None:
    """Every fixture finds something on the hand-built graph (its rows are asserted in test_tql_exec)."""
    assert len(g.query(case.read_text())) > 0


def test_the_flat_chain_fixture_keeps_and_before_or(g: trellisdb.Database) -> None:
    """Its SQL is one flat AND with a flat OR inside; the rows prove the grouping held."""
    rows = g.query((HERE / "select_flat_chain.tql").read_text()).to_pylist()
    assert [r["id"] for r in rows] == ["a", "b", "c", "e"]
