"""`trellis demo`: does experience reused across sessions make the next session better? Measured.

A **simulation** (nothing here is a real accelerator or a real model; see
:mod:`trellisdb.demo.kernels` for the cost model and :mod:`trellisdb.demo.agent` for the agent):
an agent tunes a matrix-multiply kernel for a family of simulated accelerators, one session per
task. First every task gets a **cold** session (from the naive kernel), then a **warm** one,
seeded by vector-seeded graph retrieval from the champions of earlier sessions on the most
similar other tasks. Both search the same way (every choice a TQL query) until they are within
``1 - target`` of the best possible kernel or out of steps. It prints steps and (simulated)
tokens to the target, cold vs warm, per task and their ratios; answers a time-travel question;
draws the lineage of the best program; exports a preference dataset of sibling kernels; and
writes a report folder (``summary.json``, the plots, the dataset). The same ``seed`` gives the
same numbers.
"""

from __future__ import annotations

import json
import shlex
import shutil
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trellisdb.database import Database, open_local
from trellisdb.demo.agent import BEST, FRONTIER, RETRIEVE, SPACE, Agent, SessionRun
from trellisdb.demo.kernels import family, optimum
from trellisdb.demo.report import curves, draw, have_matplotlib
from trellisdb.errors import TrellisError
from trellisdb.result import Result

if TYPE_CHECKING:
    import pyarrow as pa

Show = Callable[["pa.Table"], str]

MARK = "trellis_demo"  # the meta key of the demo's first commit: how --reset knows the store is a demo's


@dataclass
class Summary:
    """The demo's figures: per task (cold, warm), and the medians and totals."""

    seed: int
    tasks: int
    max_steps: int
    target: float
    runs: list[dict[str, Any]]
    median_steps_cold: float
    median_steps_warm: float
    median_step_ratio: float
    step_ratio_range: tuple[float, float]
    total_step_ratio: float
    median_token_saving: float
    reached_cold: int
    reached_warm: int
    commits: int
    report: str | None


def report_folder(path: str) -> Path:
    """Where the report goes by default: beside the store, ``<name>-report`` (``.db`` dropped)."""
    p = Path(path)
    stem = p.name[:-3] if p.name.endswith(".db") else p.name
    return p.with_name(f"{stem or 'trellis-demo'}-report")


def _open(path: str, reset: bool) -> Database:
    """A new store for the demo; ``reset`` removes an earlier demo's store first (never another one)."""
    if Path(path).exists() and any(Path(path).iterdir()):
        db = open_local(path, create=False)
        try:
            made = db.sql(f"SELECT count(*) AS n FROM commits WHERE json_extract(meta, '$.{MARK}') IS NOT NULL"
                          ).to_pylist()[0]["n"]
            commits = len(db.log())
        finally:
            db.close()
        if commits and not (reset and made):
            if made:
                raise TrellisError(f"{path} already holds a demo run; run `trellis demo --db {path} --reset` to "
                                   "run it again from scratch, or give another --db")
            raise TrellisError(f"{path} holds a database that is not the demo's ({commits} commits); the demo "
                               "writes into a new folder: give another --db")
        if commits:
            shutil.rmtree(path)
    return open_local(path)


def _steps(r: SessionRun, budget: int) -> int:
    """Steps to the target, counting a session that missed it as the whole budget (a bound)."""
    return r.steps_to_target if r.steps_to_target is not None else budget


def _tokens(r: SessionRun) -> int:
    return r.tokens_to_target if r.tokens_to_target is not None else r.tokens


def run_demo(path: str, *, seed: int = 0, tasks: int = 8, max_steps: int = 100, target: float = 0.95,
             report: str | None = None, reset: bool = False, plots: bool = True,
             out: Callable[[str], None] = print, show: Show | None = None) -> Summary:
    """Run the demo into a new store at ``path``; print as it goes (``out``, tables as ``show``
    renders them: the CLI's table format; by default a result's text form); its figures."""
    if tasks < 2:
        raise TrellisError(f"--tasks must be at least 2 (a warm session reuses another task's), got {tasks}")
    if max_steps < 1:
        raise TrellisError(f"--steps must be at least 1, got {max_steps}")
    if not 0 < target <= 1:
        raise TrellisError(f"--target is a fraction of the best possible speedup in (0, 1], got {target}")
    db = _open(path, reset)
    try:
        return _run(db, path, seed=seed, n_tasks=tasks, max_steps=max_steps, target=target,
                    folder=Path(report) if report else report_folder(path), plots=plots, out=out,
                    show=show or (lambda t: repr(Result(t))))
    finally:
        db.close()


def _run(db: Database, path: str, *, seed: int, n_tasks: int, max_steps: int, target: float, folder: Path,
         plots: bool, out: Callable[[str], None], show: Show) -> Summary:
    family_ = family(n_tasks)
    best = {t.id: optimum(t)[0] for t in family_}
    first = len(db.log())
    with db.transaction(message="trellis demo: the tasks", meta={MARK: {"seed": seed, "tasks": n_tasks}}):
        for t in family_:
            db.add_task(t.id, name=t.describe(), spec=t.describe())
    db.create_space(SPACE, dim=len(family_[0].situation()))
    out("trellis demo: a SIMULATION of cross-session reuse (trellisdb/demo/kernels.py documents the cost model).\n"
        f"An agent tunes a GEMM kernel for {n_tasks} simulated accelerators, one session per task, until it is "
        f"within {1 - target:.0%} of the\nbest possible speedup (known to the simulator, not to the agent) or "
        f"has evaluated {max_steps} kernels. Each step picks its parent with\n  {FRONTIER}\n")
    agent = Agent(db, seed=seed, max_steps=max_steps, target=target)
    cold = [agent.run(t, "cold", best[t.id]) for t in family_]
    out(f"cold: {n_tasks} sessions, each from the naive kernel. Then a warm session per task, seeded by\n"
        f"  {RETRIEVE}\n(the champions of earlier sessions on the 3 most similar other tasks, with the 2 steps "
        "before each)\n")
    warm = [agent.run(t, "warm", best[t.id]) for t in family_]
    summary = _summarize(seed, n_tasks, max_steps, target, cold, warm)
    out(_table(show, cold, warm, max_steps))
    reached = (f"warm reached the target in {summary.reached_warm} of {n_tasks} tasks, cold in "
               f"{summary.reached_cold}; a missed target counts as the whole budget of {max_steps} steps")
    lo, hi = summary.step_ratio_range
    out(f"\nsteps to the target, median over tasks: cold {summary.median_steps_cold:g}, warm "
        f"{summary.median_steps_warm:g}: {summary.median_step_ratio:.1f}x fewer per task (median; from "
        f"{lo:.1f}x to {hi:.1f}x), {summary.total_step_ratio:.1f}x fewer in total;\nsimulated tokens to the target: "
        f"{summary.median_token_saving:.0%} fewer per task (median). {reached}.\nWhat it shows: reuse helps most "
        "where an earlier task's optimum is near this one's, and a transferred kernel that does not\nfit this "
        "accelerator (shared memory, registers) costs steps; it is a toy cost model, not a claim about real "
        "hardware.")
    _time_travel(db, out, show, cold[0], path)
    lineage, branches, title = _lineage(db, out, show, warm, path)
    _preferences(db, out, folder)
    rows = db.sql("SELECT n.session_id, n.task_id, n.step, r.value AS speedup FROM nodes n JOIN rewards r "
                  "ON r.node_id = n.id AND r.channel = 'speedup'").to_pylist()
    lines = curves(rows, best)
    summary.commits = len(db.log()) - first
    summary.report = str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(asdict(summary), indent=2) + "\n")
    files = None
    if plots:
        files = draw(folder, {r.session: lines[r.session] for r in cold},
                     {r.session: lines[r.session] for r in warm}, target, lineage, branches, title)
    pictures = (", ".join(p.name for p in files) if files else
                "no plots: install the plots extra (pip install 'trellisdb[plots]')" if plots and
                not have_matplotlib() else "no plots")
    out(f"\nreport: {folder}/ (summary.json, {pictures}, preferences/)")
    out(f"wrote {summary.commits} commits into {path}")
    return summary


def _summarize(seed: int, n: int, budget: int, target: float, cold: list[SessionRun],
               warm: list[SessionRun]) -> Summary:
    ratios = [_steps(c, budget) / _steps(w, budget) for c, w in zip(cold, warm, strict=True)]
    savings = [1 - _tokens(w) / _tokens(c) for c, w in zip(cold, warm, strict=True)]
    runs = [{k: v for k, v in asdict(r).items() if k != "retrieved"} for r in [*cold, *warm]]
    return Summary(
        seed=seed, tasks=n, max_steps=budget, target=target, runs=runs,
        median_steps_cold=statistics.median(_steps(r, budget) for r in cold),
        median_steps_warm=statistics.median(_steps(r, budget) for r in warm),
        median_step_ratio=statistics.median(ratios), step_ratio_range=(min(ratios), max(ratios)),
        total_step_ratio=sum(_steps(r, budget) for r in cold) / sum(_steps(r, budget) for r in warm),
        median_token_saving=statistics.median(savings),
        reached_cold=sum(r.steps_to_target is not None for r in cold),
        reached_warm=sum(r.steps_to_target is not None for r in warm), commits=0, report=None)


def _table(show: Show, cold: list[SessionRun], warm: list[SessionRun], budget: int) -> str:
    import pyarrow as pa

    def steps(r: SessionRun) -> str:
        return str(r.steps_to_target) if r.steps_to_target is not None else f">{budget}"

    rows = [{"task": c.task, "best possible": round(c.optimum, 2), "cold steps": steps(c), "warm steps": steps(w),
             "cold tokens": _tokens(c), "warm tokens": _tokens(w),
             "reused from": ", ".join(sorted({r["task_id"] for r in w.retrieved if r["relation"] == "seed"}))}
            for c, w in zip(cold, warm, strict=True)]
    return show(pa.Table.from_pylist(rows))


def _time_travel(db: Database, out: Callable[[str], None], show: Show, run: SessionRun, path: str) -> None:
    k = max(1, run.steps // 4)
    q = (f"NODES WHERE session_id = $s ORDER BY reward('speedup') DESC LIMIT 3 "
         f"RETURN step, id, reward('speedup') AS speedup, summary AS OF STEP {k} OF SESSION $s")
    out(f"\nwhat did the agent know at step {k} of session {run.session!r}? Its best kernels then:\n"
        f"  trellis --db {shlex.quote(path)} query \"{q.replace('$s', repr(run.session))}\"")
    out(show(db.query(q, s=run.session).to_arrow()))
    out("and what it would have expanded next, as of that step:")
    fq = FRONTIER.replace("RETURN id, reward('speedup') AS speedup, action",
                          "RETURN id, reward('speedup') AS speedup, summary") + f" AS OF STEP {k} OF SESSION $s"
    out(show(db.query(fq, s=run.session).to_arrow()))
    now = db.query(BEST, s=run.session).to_pylist()[0]
    out(f"(by its last step, {run.steps}, its best was {now['id']} at {now['speedup']}x)")


def _lineage(db: Database, out: Callable[[str], None], show: Show, warm: list[SessionRun],
             path: str) -> tuple[Any, list[dict[str, Any]], str]:
    """The lineage of the best warm program whose ancestry crosses sessions (the flywheel)."""
    crossing = [r for r in warm if r.retrieved] or warm
    run = max(crossing, key=lambda r: (r.best / r.optimum, r.session))
    node = db.query(BEST, s=run.session).to_pylist()[0]["id"]
    q = ("LINEAGE OF $n ANCESTORS 200 VIA derived_from, retrieved "
         "RETURN id, hop, session_id, reward('speedup') AS speedup, summary")
    res = db.query(q, n=node)
    sessions = sorted({r["session_id"] for r in res.to_pylist()})
    out(f"\nwhere the best kernel of {run.session!r} came from ({len(res)} ancestors across sessions "
        f"{', '.join(sessions)}):\n  trellis --db {shlex.quote(path)} query \"{q.replace('$n', repr(node))}\"")
    shown = res.to_arrow()
    out(show(shown.slice(0, 12)) + (f"\n... {len(shown) - 12} more" if len(shown) > 12 else ""))
    ids = [r["id"] for r in res.to_pylist()]
    branches = db.sql("SELECT e.src AS parent, n.id, r.value AS speedup, n.status FROM edges e JOIN nodes n ON n.id = e.dst "
                      "LEFT JOIN rewards r ON r.node_id = n.id AND r.channel = 'speedup' "
                      "WHERE e.kind = 'derived_from' AND list_contains($1, e.src) ORDER BY n.seq", params=[ids])
    return res.to_networkx(), branches.to_pylist(), f"lineage of {node} ({run.task}, {run.best}x), across sessions"


def _preferences(db: Database, out: Callable[[str], None], folder: Path) -> None:
    db.create_view("kernel-prefs", "preference", reward="reward('speedup')", margin=0.05, replace=True)
    made = db.materialize("kernel-prefs")
    dest = folder / "preferences"
    db.export("kernel-prefs", dest, format="trl", overwrite=True)
    out(f"\npreference dataset: view 'kernel-prefs' (sibling kernels whose speedups differ by >= 0.05; the faster "
        f"one chosen): {made.get('rows')} pairs, exported as TRL to {dest}/")

