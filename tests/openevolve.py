"""Test helper: load the shared OpenEvolve circle-packing run through the write API.

Programs are written in the order the checkpoints first show them (parents
before children), one transaction per checkpoint, each tagged
``checkpoint_<iteration>``; every metric becomes a reward channel and the
code an artifact; a non-numeric metric (an error text) is
not a reward. (A full importer is a later issue.)
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import trellisdb


def _find_data() -> str:
    """``$TRELLIS_SHARED_DATA``, else ``../shared/data`` beside the checkout (or above it)."""
    env = os.environ.get("TRELLIS_SHARED_DATA")
    roots = [env] if env else []
    here = os.path.abspath(os.path.dirname(__file__))
    while True:
        roots.append(os.path.join(here, "shared", "data"))
        up = os.path.dirname(here)
        if up == here:
            break
        here = up
    for r in roots:
        path = os.path.join(r, "openevolve-circle-packing", "checkpoints")
        if os.path.isdir(path):
            return path
    return os.path.join(roots[0], "openevolve-circle-packing", "checkpoints")


DATA = _find_data()
TASK = "circle-packing-26"


def available() -> bool:
    return os.path.isdir(DATA)


def programs() -> dict[str, tuple[int, dict[str, Any]]]:
    """id -> (first checkpoint iteration that holds it, program JSON)."""
    out: dict[str, tuple[int, dict[str, Any]]] = {}
    dirs = sorted(glob.glob(os.path.join(DATA, "checkpoint_*")), key=lambda d: int(d.rsplit("_", 1)[1]))
    for d in dirs:
        it = int(d.rsplit("_", 1)[1])
        for f in sorted(glob.glob(os.path.join(d, "programs", "*.json"))):
            with open(f) as fh:
                p = json.load(fh)
            out.setdefault(p["id"], (it, p))
    return out


def numeric_metrics(p: dict[str, Any]) -> dict[str, float]:
    """The metrics that are numbers (a failed run also carries an ``error`` text)."""
    return {k: float(v) for k, v in p["metrics"].items() if isinstance(v, int | float) and not isinstance(v, bool)}


def prompt_artifacts(p: dict[str, Any]) -> dict[str, str]:
    """The program's prompt (system, user) and response texts, as artifact roles."""
    pr = next(iter((p.get("prompts") or {}).values()), None)
    if not pr:
        return {}
    out = {"system_prompt": pr.get("system") or "", "prompt": pr.get("user") or "",
           "response": "".join(pr.get("responses") or [])}
    return {k: v for k, v in out.items() if v}


def load(db: trellisdb.Database, prompts: bool = False) -> dict[str, tuple[int, dict[str, Any]]]:
    progs = programs()
    s = db.session(task=TASK, agent="openevolve", id="openevolve-run")
    by_ckpt: dict[int, list[dict[str, Any]]] = {}
    for it, p in progs.values():
        by_ckpt.setdefault(it, []).append(p)
    for it in sorted(by_ckpt):
        batch = sorted(by_ckpt[it], key=lambda p: (p["iteration_found"], p["timestamp"], p["id"]))
        with db.transaction(message=f"checkpoint {it}"):
            for p in batch:
                nid = s.add_node(
                    id=p["id"],
                    parents=[p["parent_id"]] if p.get("parent_id") else [],
                    step=p["iteration_found"],
                    status="evaluated",
                    source="openevolve",
                    artifacts={"code": p["code"], **(prompt_artifacts(p) if prompts else {})},
                )
                for ch, v in numeric_metrics(p).items():
                    s.add_reward(nid, ch, v, verifier="openevolve")
        db.tag(f"checkpoint_{it}")
    return progs
