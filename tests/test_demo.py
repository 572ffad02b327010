"""`trellis demo`: the simulated flywheel, on a real store (small sizes; the default size is run
by .ci/run through the CLI)."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from pathlib import Path

import pytest

import trellisdb
from trellisdb.demo.agent import RETRIEVE, Agent
from trellisdb.demo.kernels import KNOBS, NAIVE, family, mutate, optimum, runtime, speedup
from trellisdb.demo.run import report_folder, run_demo
from trellisdb.errors import TrellisError

SMALL = {"tasks": 3, "max_steps": 25}


def _run(folder: Path, seed: int = 0, **kw: object) -> tuple[dict[str, object], list[str]]:
    lines: list[str] = []
    s = run_demo(str(folder / "demo.db"), seed=seed, report=str(folder / "report"), out=lines.append,
                 **{**SMALL, **kw})  # type: ignore[arg-type]
    return {k: v for k, v in asdict(s).items() if k != "report"}, lines


def test_the_cost_model_is_what_its_docstring_says() -> None:
    t = family(5)[1]
    assert speedup(t, NAIVE) == 1.0
    too_big = {**NAIVE, "tile_m": 256, "tile_n": 256, "tile_k": 64, "stages": 4}  # shared memory
    assert runtime(t, too_big) is None and speedup(t, too_big) == 0.0
    best, knobs = optimum(t)
    assert all(knobs[k] in KNOBS[k] for k in KNOBS) and speedup(t, knobs) == best > 1
    # the optimum shifts from task to task
    assert len({tuple(optimum(u)[1].values()) for u in family(8)}) > 2
    rng = random.Random(0)
    for _ in range(50):  # a proposal always changes the kernel, within the knobs' ranges
        new, change = mutate(rng, knobs)
        assert new != knobs and change and all(new[k] in KNOBS[k] for k in KNOBS)


def test_the_demo_runs_reports_and_is_deterministic(tmp_path: Path) -> None:
    a, lines = _run(tmp_path / "a")
    b, _ = _run(tmp_path / "b", plots=False)
    assert a == b  # the same seed: the same sessions, steps, tokens and commits
    c, _ = _run(tmp_path / "c", seed=1, plots=False)
    assert c["runs"] != a["runs"]
    text = "\n".join(lines)
    assert "SIMULATION" in text and "fewer per task" in text
    runs = a["runs"]
    assert isinstance(runs, list) and [r["mode"] for r in runs] == ["cold"] * 3 + ["warm"] * 3
    for r in runs:  # the summary's numbers are the store's
        assert 1 <= r["steps"] <= SMALL["max_steps"]
        assert r["steps_to_target"] is None or r["best"] >= 0.95 * r["optimum"]
    db = trellisdb.connect(str(tmp_path / "a" / "demo.db"), read_only=True)
    for r in runs:
        got = db.sql("SELECT count(*) AS n, sum(tokens_in + tokens_out) AS tokens, max(value) AS best FROM nodes n "
                     "JOIN rewards r ON r.node_id = n.id WHERE n.session_id = $1", params=[r["session"]]).to_pylist()[0]
        assert (got["n"], got["tokens"], got["best"]) == (r["steps"], r["tokens"], r["best"])
    # a warm session starts from retrieved champions of other tasks, linked by 'retrieved' edges
    crossed = db.sql("SELECT e.src, n.task_id AS from_task, m.task_id AS to_task FROM edges e "
                     "JOIN nodes n ON n.id = e.src JOIN nodes m ON m.id = e.dst WHERE e.kind = 'retrieved'").to_pylist()
    assert crossed and all(x["from_task"] != x["to_task"] for x in crossed)
    champions = {x["id"] for x in db.query("NODES WHERE has_label('champion') RETURN id").to_pylist()}
    assert {x["src"] for x in crossed} <= champions and len(champions) == 6
    assert "EXPAND ANCESTORS 2" in RETRIEVE
    # the demo's commits only; the time-travel and lineage commands it prints name the store
    assert a["commits"] == len(db.log())
    assert f"trellis --db {tmp_path / 'a' / 'demo.db'} query" in text and "AS OF STEP" in text
    db.close()
    report = tmp_path / "a" / "report"
    summary = json.loads((report / "summary.json").read_text())
    assert summary["runs"] == runs
    for png in ("best_vs_step.png", "lineage.png"):
        assert (report / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pairs = [json.loads(x) for x in (report / "preferences" / "train.jsonl").read_text().splitlines()]
    assert pairs and all(p["chosen"] != p["rejected"] for p in pairs)


def test_the_demo_writes_a_new_store_and_resets_only_its_own(tmp_path: Path) -> None:
    path = tmp_path / "demo.db"
    _run(tmp_path, plots=False)
    with pytest.raises(TrellisError, match=r"already holds a demo run.*--reset"):
        _run(tmp_path, plots=False)
    again, _ = _run(tmp_path, plots=False, reset=True)
    assert again["commits"] == len(trellisdb.connect(str(path), read_only=True).log())
    other = tmp_path / "mine.db"
    db = trellisdb.connect(str(other))
    with db.session(task="t") as s:
        s.add_node(summary="not a demo")
    db.close()
    with pytest.raises(TrellisError, match="not the demo's"):
        run_demo(str(other), reset=True, out=lambda _: None, **SMALL)  # type: ignore[arg-type]
    assert trellisdb.connect(str(other), read_only=True).sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 1}]
    with pytest.raises(TrellisError, match="at least 2"):
        run_demo(str(tmp_path / "x.db"), tasks=1)


def test_a_warm_agent_without_precedents_starts_cold(tmp_path: Path) -> None:
    """The retrieval is a real query: when the only champion is of the same task (which the
    query leaves out), it finds nothing, and the warm session starts from the naive kernel."""
    db = trellisdb.connect(str(tmp_path / "db"))
    t = family(2)[0]
    db.add_task(t.id)
    db.create_space("situation", dim=len(t.situation()))
    agent = Agent(db, seed=0, max_steps=3, target=0.95)
    agent.run(t, "cold", optimum(t)[0])
    warm = agent.run(t, "warm", optimum(t)[0])
    assert warm.retrieved == [] and warm.steps == 3
    first = db.query("NODES WHERE session_id = $s ORDER BY step LIMIT 1 RETURN id, action", s=warm.session).to_pylist()
    assert json.loads(first[0]["action"]) == NAIVE
    assert db.sql("SELECT count(*) AS n FROM edges WHERE kind = 'retrieved'").to_pylist() == [{"n": 0}]
    db.close()


def test_report_folder_sits_beside_the_store() -> None:
    assert report_folder("./trellis-demo.db") == Path("./trellis-demo-report")
    assert report_folder("/x/runs") == Path("/x/runs-report")
