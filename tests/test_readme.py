"""Every python block of the README runs as written, alone, in a fresh interpreter (the venv's
python, in an empty folder), and answers what its comments say.

A block stands alone unless the sentence before it says it continues the shell command above it
(the import; the server): for those the test does that step first, as the README does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .shared import shared_data

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SHARED = shared_data("openevolve-circle-packing")


@dataclass(frozen=True)
class Block:
    index: int  # among the README's python blocks, from 0
    section: str  # the "## " heading it is under ("" before the first)
    line: int  # the README line of its first line of code
    code: str

    @property
    def first_line(self) -> str:
        return next((x for x in self.code.splitlines() if x.strip()), "")


def python_blocks() -> list[Block]:
    out: list[Block] = []
    section, start = "", 0
    code: list[str] | None = None
    for n, line in enumerate(README.read_text().splitlines(), 1):
        if code is None and line.startswith("## "):
            section = line[3:].strip()
        elif code is None and line.strip() == "```python":
            code, start = [], n + 1
        elif code is not None and line.strip() == "```":
            out.append(Block(len(out), section, start, "\n".join(code) + "\n"))
            code = None
        elif code is not None:
            code.append(line)
    return out


BLOCKS = python_blocks()

# Runs a block (padded so its line numbers are the README's: a traceback names README.md and
# the line), then writes what the probe expression evaluates to in the block's globals as JSON.
RUNNER = """
import json, sys
readme, first, probe, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
code = sys.stdin.read()
scope = {"__name__": "__main__"}
exec(compile("\\n" * (first - 1) + code, readme, "exec"), scope)
with open(out, "w") as f:
    json.dump(eval(probe, scope), f, default=str)
"""


def run_block(block: Block, cwd: Path, *, code: str | None = None, probe: str = "None",
              env: dict[str, str] | None = None) -> Any:
    """Run ``block`` (or ``code``, an edited copy of it) in a fresh interpreter in ``cwd``; what
    ``probe`` evaluates to afterwards, through JSON. Fails naming the block and its first line."""
    out = cwd / ".probe.json"
    full_env = {**os.environ, **(env or {})}
    # this checkout's trellisdb, whatever else is installed
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, str(README), str(block.line), probe, str(out)],
        input=code if code is not None else block.code, cwd=cwd, env=full_env,
        capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0:
        pytest.fail(f"README python block {block.index} (under '## {block.section}', line {block.line}), "
                    f"which starts `{block.first_line}`, failed alone in a fresh interpreter:\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    return json.loads(out.read_text())


# ------------------------------------------------------------------ the steps a block continues
Setup = Callable[[ExitStack, Path, Block], tuple[str, dict[str, str]]]


def after_the_import(stack: ExitStack, cwd: Path, block: Block) -> tuple[str, dict[str, str]]:
    """The README's import command, then the block (on the shared OpenEvolve run)."""
    if not SHARED.is_dir():
        pytest.skip(f"the shared OpenEvolve run is not at {SHARED}")
    from trellisdb.cli import main

    section = README.read_text().split("## Import a run", 1)[1]
    assert ".venv/bin/trellis --db ./evolve.db import openevolve ../shared/data/openevolve-circle-packing" in section
    here = Path.cwd()
    os.chdir(cwd)
    try:
        assert main(["--db", "./evolve.db", "import", "openevolve", str(SHARED), "--no-progress"]) == 0
    finally:
        os.chdir(here)
    return block.code, {}


def after_the_server(stack: ExitStack, cwd: Path, block: Block) -> tuple[str, dict[str, str]]:
    """The README's server command (a real `trellis serve` process, its token from the
    environment), then the block, against it."""
    from .serving import free_port, start, stop

    text = README.read_text().split("## Run a server", 1)[1].split("## Connect an agent", 1)[0]
    serve = next(line for line in text.splitlines() if " serve " in line)
    assert serve.startswith(".venv/bin/trellis --db ./runs.db serve --port 7437 --token \"$TRELLIS_TOKEN\"")
    token, port = "readme-token", free_port()
    proc = start(cwd / "served.db", port, token)
    stack.callback(stop, proc)
    return block.code.replace("127.0.0.1:7437", f"127.0.0.1:{port}"), {"TRELLIS_TOKEN": token}


CONTINUES: dict[str, Setup] = {"Import a run": after_the_import, "Run a server": after_the_server}


# ------------------------------------------------------------------ what each block answers
def check_tour(got: Any, cwd: Path) -> None:
    latest, then = got
    assert [r["value"] for r in latest] == [0.64] and [r["value"] for r in then] == [0.61]


def check_import(got: Any, cwd: Path) -> None:
    """The queries answer checkpoint 50 as its files say."""
    import ast

    ck = SHARED / "checkpoints" / "checkpoint_50"
    meta = json.loads((ck / "metadata.json").read_text())

    def listed(v: Any) -> list[Any]:
        return list(ast.literal_eval(v) if isinstance(v, str) else v)

    files = {p.stem for p in (ck / "programs").glob("*.json")}
    assert {r["id"] for r in got["population"]} == files
    assert [r["id"] for r in got["best"]] == [meta["best_program_id"]]
    assert {r["id"] for r in got["island_1"]} == set(listed(meta["islands"])[1])
    assert {r["id"] for r in got["archive"]} == set(listed(meta["archive"])) & files
    assert got["state"] == [{"best": meta["best_program_id"]}]
    chain, node = [], meta["best_program_id"]
    while node is not None and (ck / "programs" / f"{node}.json").exists():
        chain.append(node)
        node = json.loads((ck / "programs" / f"{node}.json").read_text()).get("parent_id")
    lineage = [r["id"] for r in got["lineage"]]
    assert lineage[: len(chain)] == chain[: len(lineage)] and lineage[0] == meta["best_program_id"]
    islands = {r["island"] for r in got["per_island"]}
    assert len(islands) == len(got["per_island"])  # one per island


def check_server(got: Any, cwd: Path) -> None:
    assert [r["summary"] for r in got["best"]] == ["hexagonal"]
    assert got["step"]["commit"] > 0


def check_reuse(got: Any, cwd: Path) -> None:
    """The seeds are the earlier sessions' attempts scoring >= 0.5, the closest in meaning first,
    with their ancestors; the new attempt starts from one of them."""
    rows = got["rows"]
    seeds = [r for r in rows if r["relation"] == "seed"]
    assert seeds and all(r["session_id"] != got["me"] for r in seeds)
    assert {r["summary"] for r in seeds} == {"random restarts, keep the best", "hexagonal grid, then grow the radii"}
    assert "hexagonal" in next(r for r in seeds if r["seed_rank"] == 1)["summary"]
    assert {r["relation"] for r in rows} >= {"seed", "ancestor"}
    assert got["retrieved"] == [{"n": 1}]


def check_training(got: Any, cwd: Path) -> None:
    lines = [json.loads(x) for x in (cwd / "out" / "pairs" / "train.jsonl").read_text().splitlines()]
    assert len(lines) == 5  # .9 > .52 (twice), .9 > .31, .52 > .31 (twice); the .52 tie never pairs
    assert all(set(r) == {"prompt", "chosen", "rejected"} for r in lines)
    manifest = json.loads((cwd / "out" / "pairs" / "manifest.json").read_text())
    assert manifest["rows"] == 5 and manifest["view"] == "pairs"
    assert [v["name"] for v in got] == ["pairs"]


#: section -> (an expression over the block's globals, evaluated after it; a check of its value)
CHECKS: dict[str, tuple[str, Callable[[Any, Path], None]]] = {
    "A short tour": ('[db.sql("SELECT value FROM rewards").to_pylist(), '
                     'db.sql("SELECT value FROM rewards", as_of="baseline").to_pylist()]', check_tour),
    "Import a run": ('{"population": population, "best": best, "island_1": island_1.to_pylist(), '
                     '"archive": archive.to_pylist(), "lineage": lineage.to_pylist(), '
                     '"per_island": per_island.to_pylist(), "state": state}', check_import),
    "Run a server": ('{"best": best, "step": step}', check_server),
    "Cross-session reuse: retrieve similar past attempts with their lineage": (
        '{"rows": found.to_pylist(), "me": new.id, '
        '"retrieved": db.sql("SELECT count(*) AS n FROM edges WHERE kind = \'retrieved\'").to_pylist()}', check_reuse),
    "Training data: views over the experience, materialized and exported": ("db.views()", check_training),
}


def test_the_install_commands_come_first() -> None:
    """The first two blocks are the install-and-demo and install-and-test commands."""
    fences = re.findall(r"```(\w*)\n(.*?)```", README.read_text(), re.S)
    assert [lang for lang, _ in fences[:2]] == ["bash", "bash"]
    assert " demo" in fences[0][1] and "pytest" in fences[1][1]
    assert README.read_text().index(fences[1][1]) < README.read_text().index("## ")


def test_checks_name_sections_with_python_blocks() -> None:
    """A check (or a step run first) whose section lost its block, or was renamed, fails here
    rather than silently checking nothing."""
    assert BLOCKS and set(CHECKS) | set(CONTINUES) <= {b.section for b in BLOCKS}


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as s:
        yield s


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.index}-{b.section[:20]}" for b in BLOCKS])
def test_python_block_runs_alone(block: Block, tmp_path: Path, stack: ExitStack) -> None:
    code, env = CONTINUES[block.section](stack, tmp_path, block) if block.section in CONTINUES else (block.code, {})
    probe, check = CHECKS.get(block.section, ("None", lambda got, cwd: None))
    check(run_block(block, tmp_path, code=code, probe=probe, env=env), tmp_path)
