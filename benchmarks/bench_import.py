"""Importers (issue 24): ``trellis import openevolve`` throughput against ``db.ingest`` of the same rows.

Figures (the baseline measured in the same run, on a fresh store each):

1. the shared OpenEvolve run (``../shared/data/openevolve-circle-packing``, 10 checkpoints,
   89 programs, 455 program files): the whole import (reading every checkpoint's files,
   mapping, one commit and one tag per checkpoint) against ``db.ingest`` of the same prepared
   tables, one commit per checkpoint (no parsing, no tags);
2. a synthetic run in OpenEvolve's own layout, larger: ``--checkpoints`` checkpoints of
   ``--per-checkpoint`` new programs each (a population capped at ``--population``, four
   islands, an archive), each program file ~4 KB as OpenEvolve writes them.

Nodes/s counts distinct programs (nodes written). The target is >= 5,000 nodes/s.

    .venv/bin/python benchmarks/bench_import.py --smoke
    .venv/bin/python benchmarks/bench_import.py --checkpoints 10 --per-checkpoint 2000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import trellisdb  # noqa: E402
from trellisdb.importers import import_run  # noqa: E402
from trellisdb.importers import openevolve as oe  # noqa: E402
from trellisdb.importers.units import _tables  # noqa: E402

SHARED = HERE.parents[1] / "shared" / "data" / "openevolve-circle-packing"
SYSTEM = ("You are an expert mathematician specializing in circle packing problems and computational "
          "geometry. Your task is to improve a constructor function that directly produces a specific "
          "arrangement of 26 circles in a unit square, maximizing the sum of their radii.")


def synthetic_run(root: Path, checkpoints: int, per_checkpoint: int, population: int, seed: int = 7) -> Path:
    """An OpenEvolve output folder (``checkpoints/checkpoint_<k>/{metadata.json,programs/<id>.json}``)."""
    rng = random.Random(seed)
    programs: dict[str, dict[str, Any]] = {}
    alive: list[str] = []
    t0 = 1_750_000_000.0
    iteration = 0
    for c in range(1, checkpoints + 1):
        for _ in range(per_checkpoint):
            iteration += 1
            pid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
            parent = rng.choice(alive) if alive else None
            score = rng.random()
            metrics = {"validity": 1.0, "sum_radii": 2.6 * score, "target_ratio": score, "combined_score": score,
                       "eval_time": rng.random()}
            code = "# EVOLVE-BLOCK-START\nimport numpy as np\n\n\ndef construct_packing():\n" + "".join(
                f"    centers[{i}] = [{rng.random():.6f}, {rng.random():.6f}]\n" for i in range(40)) + "# EVOLVE-BLOCK-END\n"
            programs[pid] = {
                "id": pid, "code": code, "language": "python", "parent_id": parent,
                "generation": (programs[parent]["generation"] + 1) if parent else 0,
                "timestamp": t0 + iteration, "iteration_found": iteration, "metrics": metrics,
                "complexity": 0.0, "diversity": 0.0,
                "metadata": {"island": rng.randrange(4), "changes": "Full rewrite",
                             "parent_metrics": programs[parent]["metrics"] if parent else {}},
                "prompts": {"full_rewrite_user": {"system": SYSTEM, "user": f"Improve program {parent}",
                                                  "responses": [f"```python\n{code}```"]}},
                "artifacts_json": None, "artifact_dir": None,
            }
            alive.append(pid)
        alive = alive[-population:]  # the cap evicts the oldest
        folder = root / "checkpoints" / f"checkpoint_{c * per_checkpoint}"
        (folder / "programs").mkdir(parents=True)
        for pid in alive:
            (folder / "programs" / f"{pid}.json").write_text(json.dumps(programs[pid]))
        islands: list[list[str]] = [[], [], [], []]
        for pid in alive:
            islands[programs[pid]["metadata"]["island"]].append(pid)
        ranked = sorted(alive, key=lambda p: -programs[p]["metrics"]["combined_score"])
        meta = {"islands": islands, "archive": ranked[:50], "best_program_id": ranked[0],
                "last_iteration": iteration, "current_island": c % 4, "island_generations": [c] * 4,
                "last_migration_generation": 0, "feature_map": {}}
        (folder / "metadata.json").write_text(json.dumps(meta))
    return root


def measure(run: Path, work: Path) -> dict[str, Any]:
    """Import ``run`` into a fresh store, then ingest the same prepared units into another."""
    a = trellisdb.connect(work / "import.db")
    t = time.perf_counter()
    report = import_run(a, "openevolve", run, progress=False)
    import_s = time.perf_counter() - t
    a.close()
    units = list(oe.units(str(run)))
    b = trellisdb.connect(work / "ingest.db")
    prepared = [(_tables(b, u.rows, set()), u.meta) for u in units]
    t = time.perf_counter()
    for tables, meta in prepared:
        b.ingest(tables, meta=meta)
    ingest_s = time.perf_counter() - t
    b.close()
    files = sum(1 for _ in run.glob("checkpoints/checkpoint_*/programs/*.json"))
    return {"units": len(units), "nodes": report.nodes, "program_files": files, "rows": report.rows,
            "import_s": round(import_s, 4), "ingest_s": round(ingest_s, 4),
            "import_nodes_per_s": round(report.nodes / import_s), "ingest_nodes_per_s": round(report.nodes / ingest_s),
            "import_over_ingest": round(import_s / ingest_s, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    p.add_argument("--checkpoints", type=int, default=10)
    p.add_argument("--per-checkpoint", type=int, default=2000)
    p.add_argument("--population", type=int, default=5000)
    p.add_argument("--out", default=str(HERE / "out" / "import.json"))
    args = p.parse_args()
    if args.smoke:
        args.checkpoints, args.per_checkpoint, args.population = 3, 200, 400
    work = Path(tempfile.mkdtemp(prefix="bench-import-"))
    results: dict[str, Any] = {"args": vars(args)}
    try:
        if SHARED.is_dir():
            (work / "shared").mkdir()
            results["shared"] = measure(SHARED, work / "shared")
        run = synthetic_run(work / "run", args.checkpoints, args.per_checkpoint, args.population)
        (work / "synthetic").mkdir()
        results["synthetic"] = measure(run, work / "synthetic")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'run':<10} {'units':>5} {'nodes':>7} {'files':>7} {'import s':>9} {'nodes/s':>8} {'ingest s':>9} "
          f"{'nodes/s':>8} {'import/ingest':>14}")
    for name in ("shared", "synthetic"):
        r = results.get(name)
        if r:
            print(f"{name:<10} {r['units']:>5} {r['nodes']:>7} {r['program_files']:>7} {r['import_s']:>9.3f} "
                  f"{r['import_nodes_per_s']:>8} {r['ingest_s']:>9.3f} {r['ingest_nodes_per_s']:>8} "
                  f"{r['import_over_ingest']:>13.2f}x")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
