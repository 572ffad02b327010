"""The README's cross-session reuse example runs as written, on a store with earlier sessions."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import trellisdb

from .shared import shared_data

README = Path(__file__).resolve().parents[1] / "README.md"


def example(title: str) -> str:
    text = README.read_text()
    section = text.split(f"## {title}", 1)[1]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, f"no python block under {title!r}"
    return m.group(1)


def test_cross_session_reuse_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    db = trellisdb.connect("runs.db")
    db.add_task("circle-packing", name="pack circles")
    ideas = ["hexagonal lattice packing with jitter", "greedy placement along the border",
             "random restarts keeping the best layout", "hexagonal grid then grow the radii"]
    earlier = {}
    for si in range(2):
        with db.session(task="circle-packing", agent="openevolve") as s:
            parent = None
            for i, idea in enumerate(ideas):
                node = s.add_node(parents=[parent] if parent else [], summary=f"{idea} (v{si})")
                s.add_reward(node, "combined_score", 0.3 + 0.2 * i)
                earlier[node] = idea
                parent = node
    db.close()
    scope: dict[str, object] = {}
    exec(compile(example("Cross-session reuse: retrieve similar past attempts with their lineage"),
                 "README.md", "exec"), scope)
    found = scope["found"]
    assert isinstance(found, trellisdb.QueryResult)
    rows = found.to_pylist()
    seeds = [r for r in rows if r["relation"] == "seed"]
    assert seeds and all(r["id"] in earlier for r in seeds)
    nearest = next(r for r in seeds if r["seed_rank"] == 1)
    assert "hexagonal" in earlier[nearest["id"]]  # the closest attempt in meaning
    assert {r["relation"] for r in rows} >= {"seed", "ancestor"}
    db2 = trellisdb.connect("runs.db")
    try:
        got = db2.sql("SELECT count(*) AS n FROM edges WHERE kind = 'retrieved'").to_pylist()
        assert got == [{"n": 1}]
    finally:
        db2.close()
    scope["db"].close()  # type: ignore[attr-defined]
    assert os.path.isdir("runs.db")


def test_training_data_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    monkeypatch.chdir(tmp_path)
    db = trellisdb.connect("runs.db")
    with db.session(task="circle-packing", agent="openevolve") as s:
        root = s.add_node(status="evaluated", artifacts={"prompt": "pack 26 circles", "response": "start"})
        for i, score in enumerate([0.31, 0.52, 0.90, 0.52]):
            kid = s.add_node(parents=[root], status="evaluated",
                             artifacts={"prompt": "pack 26 circles", "response": f"program {i}"})
            s.add_reward(kid, "combined_score", score)
    scope: dict[str, object] = {"db": db}
    exec(compile(example("Training data: views over the experience, materialized and exported"), "README.md", "exec"),
         scope)
    lines = [json.loads(x) for x in (tmp_path / "out" / "pairs" / "train.jsonl").read_text().splitlines()]
    assert len(lines) == 5  # .9 > .52 (twice), .9 > .31, .52 > .31 (twice); the .52 tie never pairs
    assert all(set(r) == {"prompt", "chosen", "rejected"} for r in lines)
    manifest = json.loads((tmp_path / "out" / "pairs" / "manifest.json").read_text())
    assert manifest["rows"] == 5 and manifest["view"] == "pairs"
    db.close()


SHARED = shared_data("openevolve-circle-packing")


@pytest.mark.skipif(not SHARED.is_dir(), reason=f"the shared OpenEvolve run is not at {SHARED}")
def test_import_a_run_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's import command, then its queries, answer checkpoint 50 as the files say."""
    import ast
    import json

    from trellisdb.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["--db", "./evolve.db", "import", "openevolve", str(SHARED), "--no-progress"]) == 0
    scope: dict[str, object] = {}
    exec(compile(example("Import a run"), "README.md", "exec"), scope)
    ck = SHARED / "checkpoints" / "checkpoint_50"
    meta = json.loads((ck / "metadata.json").read_text())

    def listed(v: object) -> list[str]:
        return list(ast.literal_eval(v) if isinstance(v, str) else v)  # type: ignore[arg-type]

    files = {p.stem for p in (ck / "programs").glob("*.json")}
    assert {r["id"] for r in scope["population"]} == files  # type: ignore[attr-defined]
    assert [r["id"] for r in scope["best"]] == [meta["best_program_id"]]  # type: ignore[attr-defined]
    assert {r["id"] for r in scope["island_1"].to_pylist()} == set(listed(meta["islands"])[1])  # type: ignore[attr-defined]
    assert {r["id"] for r in scope["archive"].to_pylist()} == set(listed(meta["archive"])) & files  # type: ignore[attr-defined]
    assert scope["state"] == [{"best": meta["best_program_id"]}]
    chain, node = [], meta["best_program_id"]
    while node is not None and (SHARED / "checkpoints" / "checkpoint_50" / "programs" / f"{node}.json").exists():
        chain.append(node)
        node = json.loads((ck / "programs" / f"{node}.json").read_text()).get("parent_id")
    got = [r["id"] for r in scope["lineage"].to_pylist()]  # type: ignore[attr-defined]
    assert got[: len(chain)] == chain[: len(got)] and got[0] == meta["best_program_id"]
    islands = {r["island"] for r in scope["per_island"].to_pylist()}  # type: ignore[attr-defined]
    assert len(islands) == len(scope["per_island"].to_pylist())  # one per island  # type: ignore[attr-defined]
    scope["db"].close()  # type: ignore[attr-defined]


def test_run_a_server_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's server command (a real `trellis serve` process, its token from the
    environment), then its Python block as written, against it."""
    from .serving import free_port, start, stop

    text = README.read_text().split("## Run a server", 1)[1].split("## Connect an agent", 1)[0]
    serve = next(line for line in text.splitlines() if " serve " in line)
    assert serve.startswith(".venv/bin/trellis --db ./runs.db serve --port 7437 --token \"$TRELLIS_TOKEN\"")
    token = "readme-token"
    port = free_port()
    proc = start(tmp_path / "runs.db", port, token)
    try:
        monkeypatch.setenv("TRELLIS_TOKEN", token)
        scope: dict[str, object] = {}
        code = example("Run a server").replace("127.0.0.1:7437", f"127.0.0.1:{port}")
        exec(compile(code, "README.md", "exec"), scope)
        assert [r["summary"] for r in scope["best"]] == ["hexagonal"]  # type: ignore[attr-defined]
        assert scope["step"]["commit"] > 0  # type: ignore[index]
    finally:
        stop(proc)
