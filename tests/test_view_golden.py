"""Golden SQL of each view kind: tests/fixtures/views/<kind>.sql holds what ``compute`` runs.

A view's SQL is its kind's contract, as a TQL query's plan and SQL are the compiler's
(``test_tql_golden.py``): a change to either shows up here as a diff. Each file holds, per
case of that kind, the statement of a full build and, for kinds a refresh recomputes by parts,
of the refresh's restricted forms (over the relations ``__members``, ``__dirty_nodes``,
``__dirty_groups``, ``__dirty_leaves``, and for parent groups ``__group_edges``: the dirty
groups' edges as the refresh found them, or, without it, when the old rows named more groups),
each followed by its parameters. The CTEs are shown one per line (display only). After an
intended change, regenerate with ``TRELLIS_REGEN_GOLDEN=1 pytest tests/test_view_golden.py``
and review the diff. A new kind needs its cases here and its file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from trellisdb.tql.resolve import Catalog
from trellisdb.training import sql
from trellisdb.training.compute import statement
from trellisdb.training.kinds import KINDS
from trellisdb.training.spec import ViewSpec

HERE = Path(__file__).with_name("fixtures") / "views"
REGEN = os.environ.get("TRELLIS_REGEN_GOLDEN") == "1"

CATALOG = Catalog(
    channels=lambda: {"score", "entropy"},
    sessions=lambda: {"s1"},
    tasks=lambda: {"t"},
    tags={},
    commits={i: {"id": i, "time": 1_700_000_000.0 + i} for i in range(1, 8)},
    last_commit=7,
    step_commit=lambda s, k: 1,
)

R = "reward('score')"
#: Per kind: its cases (options besides the name and kind).
CASES: dict[str, list[dict[str, Any]]] = {
    "sft": [{}, {"reward": R, "threshold": 0.5}, {"reward": R, "threshold": 0.5, "path": True},
            {"reward": R, "where": "status IS NULL OR status <> 'expanded'", "threshold": 0.5}],
    "preference": [{"reward": R}, {"reward": R, "margin": 0.1, "pairs_from": ["siblings"], "group_by": "prompt"}],
    "grpo": [{"reward": R}, {"reward": R, "group_by": "prompt", "min_size": 3, "drop_zero_variance": True}],
    "kto": [{"reward": R, "threshold": 0.5}],
    "stepwise": [{"reward": R, "threshold": 0.5}, {"reward": R, "threshold": 0.5, "via": ["derived_from"]}],
    "replay": [{"reward": R, "size": 5},
               {"reward": R, "size": 5, "strategy": "bucket", "threshold": 0.5, "entropy": "entropy"}],
}
_EMPTY = pa.table({"id": pa.array([], pa.string())})
#: A CTE's start (display only: the CTEs one per line).
_CTE = re.compile(r", (?=[A-Za-z_][A-Za-z_0-9]* AS (?:MATERIALIZED )?\()")


def forms(spec: ViewSpec) -> list[tuple[str, dict[str, pa.Table] | None]]:
    """The statements a view of ``spec`` runs: its full build and its refresh's restricted forms."""
    out: list[tuple[str, dict[str, pa.Table] | None]] = [("build", None)]
    if KINDS[spec.kind].rebuilds is not None:
        return out
    dirty = dict.fromkeys(("__members", "__dirty_nodes", "__dirty_groups"), _EMPTY)
    if spec.paths:
        dirty["__dirty_leaves"] = _EMPTY
    if spec.group_by == "parent":
        out.append(("refresh (with the dirty groups' edges)", {**dirty, "__group_edges": _EMPTY}))
        out.append(("refresh (groups the old rows add: no edges given)", dirty))
    else:
        out.append(("refresh", dirty))
    return out


def render(kind: str) -> str:
    parts = [f"-- view kind {kind}: the SQL compute runs, per case (see tests/test_view_golden.py)\n"]
    for options in CASES[kind]:
        spec = ViewSpec.from_dict({**options, "name": "v", "kind": kind})
        base = sql.base(spec, CATALOG, CATALOG.last_commit)
        for form, dirty in forms(spec):
            text = statement(spec, base, dirty)
            used = sql.used(text, {**base.params, **sql.option_params(spec)})
            parts.append(f"\n-- {spec.definition()}: {form}\n" + _CTE.sub(",\n", text) + "\n"
                         + "".join(f"-- ${k} = {v!r}\n" for k, v in used.items()))
    return "".join(parts)


def test_every_kind_has_cases() -> None:
    assert set(CASES) == set(KINDS)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_golden_view_sql(kind: str) -> None:
    got = render(kind)
    path = HERE / f"{kind}.sql"
    if REGEN or not path.exists():
        HERE.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
        if not REGEN:
            pytest.fail(f"{path.name} did not exist; wrote it: review and commit it")
    assert got == path.read_text(), f"{path.name} changed; see the module docstring"


def test_a_refresh_reads_only_the_members() -> None:
    """The restricted form of a kind that is not a path reads the nodes and rewards of
    ``__members`` only (the scan the TQL base starts from, narrowed)."""
    spec = ViewSpec.from_dict({"name": "v", "kind": "preference", "reward": R})
    base = sql.base(spec, CATALOG, CATALOG.last_commit)
    trusted = ("nodes ANTI JOIN (SELECT node_id FROM labels WHERE label = 'trellis:quarantined') AS __q "
               "ON __q.node_id = nodes.id")  # a view leaves out the quarantined nodes
    scan, narrowed = f"s0 AS (SELECT * FROM {trusted})", \
        f"s0 AS MATERIALIZED (SELECT * FROM {trusted} WHERE id IN (SELECT id FROM __members))"
    assert scan in base.full and narrowed in base.members
    text = statement(spec, base, {"__members": _EMPTY, "__group_edges": _EMPTY})
    assert narrowed in text and scan not in text
    assert "FROM rewards WHERE channel" not in text
    assert "rewards WHERE node_id IN (SELECT id FROM __members) AND channel = " in text
