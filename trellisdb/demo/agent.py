"""The search agent of `trellis demo`: every decision it makes is a TQL query.

A session tunes one task (:mod:`trellisdb.demo.kernels`). Each step is one transaction: the
agent asks the store which kernel to expand next (``FRONTIER FROM SESSION ... RANK BY ucb(...)``,
:data:`FRONTIER`), has the simulated model propose a change to it, evaluates the new kernel with
the cost model and writes it (node, knobs, the prompt and response as artifacts,
the simulated token cost, the ``speedup`` reward). The knobs are the node's ``action`` (JSON). The session ends when a kernel comes within
``target`` of the best possible speedup (the simulator knows it; the agent does not) or after
``max_steps`` kernels. Its best kernel is labelled ``champion`` and given the task's situation
vector in the space ``situation``.

A **cold** session starts from the naive kernel. A **warm** one first asks the store for the
champions of earlier sessions on the most similar other tasks, with the steps that led to them
(``RETRIEVE ... WHERE has_label('champion') ... EXPAND ANCESTORS 2``, :data:`RETRIEVE`), and
starts from their knobs, each linked to its precedent by a ``retrieved`` edge; the retrieved
lineage is part of those first prompts, so it is paid for in tokens.

Tokens are simulated: a prompt is :data:`PROMPT_TOKENS` plus :data:`NODE_TOKENS` per kernel it
shows (the parent and the session's best; for a transferred kernel, the precedent and its
retrieved ancestors), a response :data:`RESPONSE_TOKENS`.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any

from trellisdb.database import Database
from trellisdb.demo.kernels import KNOBS, NAIVE, Task, describe, mutate, speedup

PROMPT_TOKENS = 600
NODE_TOKENS = 150
RESPONSE_TOKENS = 220
SPACE = "situation"
FRONTIER = ("FRONTIER FROM SESSION $s EXPANDED WHEN children >= 3 OR status = 'failed' "
            "RANK BY ucb(reward('speedup'), visits, 1.0) DESC LIMIT 1 "
            "RETURN id, reward('speedup') AS speedup, action")
BEST = ("NODES WHERE session_id = $s ORDER BY reward('speedup') DESC LIMIT 1 "
        "RETURN id, step, reward('speedup') AS speedup, action")
RETRIEVE = ("RETRIEVE 3 SIMILAR TO $situation IN situation WHERE has_label('champion') AND task_id != $task "
            "EXPAND ANCESTORS 2 RETURN id, relation, seed, seed_rank, hop, task_id, round(score, 3) AS similarity, "
            "reward('speedup') AS speedup, action")


@dataclass
class SessionRun:
    """What one session did: its id, task, mode, steps taken, steps and tokens to the target
    (None: not reached within the budget), the best speedup and the optimum."""

    session: str
    task: str
    mode: str
    steps: int
    steps_to_target: int | None
    tokens_to_target: int | None
    tokens: int
    best: float
    optimum: float
    retrieved: list[dict[str, Any]] = field(default_factory=list)


def knobs_of(row: dict[str, Any]) -> dict[str, int]:
    """The knobs of a node: its ``action``, the kernel the agent wrote (JSON)."""
    knobs = json.loads(row["action"])
    return {k: int(knobs[k]) for k in KNOBS}


class Agent:
    """Runs sessions on one store; ``seed`` makes its choices reproducible."""

    def __init__(self, db: Database, *, seed: int, max_steps: int, target: float) -> None:
        self.db = db
        self.seed = seed
        self.max_steps = max_steps
        self.target = target

    def run(self, task: Task, mode: str, optimum: float) -> SessionRun:
        rng = random.Random(f"{self.seed}/{task.id}/{mode}")
        sid = f"{task.id}-{mode}"
        goal = self.target * optimum
        s = self.db.session(task=task.id, id=sid, agent=f"demo-{mode}", model="simulated",
                            config={"seed": self.seed, "mode": mode, "max_steps": self.max_steps})
        run = SessionRun(sid, task.id, mode, 0, None, None, 0, 0.0, optimum)

        def write(knobs: dict[str, int], parents: list[str], edge_kind: str, prompt: str, shown: int,
                  change: str) -> float:
            run.steps += 1
            sp = speedup(task, knobs)
            tokens_in = PROMPT_TOKENS + NODE_TOKENS * shown
            response = f"{change}\n{json.dumps(knobs, sort_keys=True)}"
            with self.db.transaction():
                node = s.add_node(
                    id=f"{sid}-{run.steps:03d}", parents=parents, edge_kind=edge_kind, step=run.steps,
                    status="evaluated" if sp > 0 else "failed",
                    summary=f"{describe(knobs)}: {change}" + ("" if sp > 0 else " (does not compile)"),
                    action=json.dumps(knobs, sort_keys=True), artifacts={"prompt": prompt, "response": response},
                    cost={"tokens_in": tokens_in, "tokens_out": RESPONSE_TOKENS})
                s.add_reward(node, "speedup", sp, verifier="cost-model")
            run.tokens += tokens_in + RESPONSE_TOKENS
            run.best = max(run.best, sp)
            if run.steps_to_target is None and run.best >= goal:
                run.steps_to_target, run.tokens_to_target = run.steps, run.tokens
            return sp

        if mode == "warm":
            found = self.db.query(RETRIEVE, situation=task.situation(), task=task.id).to_pylist()
            run.retrieved = found
            for seed in (r for r in found if r["relation"] == "seed"):
                shown = sum(1 for r in found if r["seed"] == seed["id"])
                prompt = (f"Task: {task.describe()}.\nA kernel that won on a similar task ({seed['task_id']}, "
                          f"{seed['speedup']}x there) and the {shown - 1} steps before it are below. "
                          "Adapt it to this task.")
                write(knobs_of(seed), [seed["id"]], "retrieved", prompt, shown, f"reuse {seed['id']}")
                if run.steps_to_target is not None:
                    break
        pick: list[dict[str, Any]] = []
        while run.steps_to_target is None and run.steps < self.max_steps:
            if run.steps:
                pick = self.db.query(FRONTIER, s=sid).to_pylist()
            if not pick:  # nothing to expand (a cold session's start, or every transfer failed): the naive kernel
                write(dict(NAIVE), [], "derived_from", f"Task: {task.describe()}.\nWrite a first kernel.", 0,
                      "naive kernel")
                continue
            parent = pick[0]
            knobs, change = mutate(rng, knobs_of(parent))
            prompt = (f"Task: {task.describe()}.\nKernel {parent['id']} ({describe(knobs_of(parent))}) runs "
                      f"{parent['speedup']}x faster than naive; the best so far is {run.best}x. Propose one change.")
            write(knobs, [parent["id"]], "derived_from", prompt, 2, change)
        best = self.db.query(BEST, s=sid).to_pylist()[0]
        self.db.label(best["id"], "champion")
        self.db.add_vectors(SPACE, [best["id"]], [task.situation()])
        s.close()
        self.db.flush()
        return run
