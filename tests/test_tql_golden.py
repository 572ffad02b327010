"""Golden fixtures: tests/fixtures/queries/*.tql -> the expected plan (.plan) and SQL (.sql).

The plan and SQL text are the compiler's contract: a change to either shows up
here as a diff. After an intended change, regenerate with
``TRELLIS_REGEN_GOLDEN=1 pytest tests/test_tql_golden.py`` and review the diff.
Each fixture also runs on the hand-built graph of ``test_tql_exec``, except the
``retrieve_*`` ones (that graph has no vectors and the tests no embedder;
``test_retrieve.py`` runs RETRIEVE).

A fixture's ``-- $name = <JSON>`` comment lines are its parameters. The SQL of
a RETRIEVE with a WHERE ends with the prefilter's: the SQL of its VectorSearch's
``prefilter`` sub-plan, which picks the candidate ids before the vector step.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import trellisdb
from trellisdb.tql.compile import Compiled, compile_plan
from trellisdb.tql.parser import parse
from trellisdb.tql.plan import build, vector_search
from trellisdb.tql.resolve import Catalog, resolve

HERE = Path(__file__).with_name("fixtures") / "queries"
CASES = sorted(HERE.glob("*.tql"))
#: the fixtures that run on the hand-built graph (see the module docs)
RUNNABLE = [c for c in CASES if not c.stem.startswith("retrieve_")]
REGEN = os.environ.get("TRELLIS_REGEN_GOLDEN") == "1"

CATALOG = Catalog(
    channels=lambda: {"score"},
    sessions=lambda: {"s1", "s2"},
    tasks=lambda: {"t"},
    tags={"early": 1},
    commits={i: {"id": i, "time": 1_700_000_000.0 + i} for i in range(1, 8)},
    last_commit=7,
    step_commit=lambda s, k: 1,
    spaces=lambda target: {"embedding": 4, "summaries": 4} if target == "nodes" else {"embedding": 4},
)

PARAM = re.compile(r"^--\s*\$(\w+)\s*=\s*(.+)$", re.MULTILINE)


def params_of(text: str) -> dict[str, Any]:
    """A fixture's parameters: its ``-- $name = <JSON>`` lines."""
    return {m[1]: json.loads(m[2]) for m in PARAM.finditer(text)}


def sql_text(c: Compiled) -> str:
    return c.sql + "\n" + "".join(f"-- ${k} = {v!r}\n" for k, v in c.params.items())


def render(text: str) -> tuple[str, str]:
    plan = build(resolve(parse(text), CATALOG, params_of(text)))
    sql = sql_text(compile_plan(plan))
    search = vector_search(plan)
    if search is not None and search.prefilter is not None:
        sql += "-- prefilter: the ids the VectorSearch may return, before the SQL\n"
        sql += sql_text(compile_plan(search.prefilter))
    return plan.pretty() + "\n", sql


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


@pytest.mark.parametrize("case", RUNNABLE, ids=[c.stem for c in RUNNABLE])
def test_golden_queries_run(case: Path, g: trellisdb.Database) -> None:
    """Every fixture finds something on the hand-built graph (its rows are asserted in test_tql_exec)."""
    assert len(g.query(case.read_text())) > 0


def test_the_flat_chain_fixture_keeps_and_before_or(g: trellisdb.Database) -> None:
    """Its SQL is one flat AND with a flat OR inside; the rows prove the grouping held."""
    rows = g.query((HERE / "select_flat_chain.tql").read_text()).to_pylist()
    assert [r["id"] for r in rows] == ["a", "b", "c", "e"]
