"""The pictures of `trellis demo`: PNG plots drawn with matplotlib (the ``plots`` extra).

:func:`draw` writes ``best_vs_step.png`` (the best speedup found so far, as a fraction of the
optimum, against the step: every task's cold and warm session, and their medians) and
``lineage.png`` (the ancestry of one program across sessions: ``derived_from`` edges within a
session, ``retrieved`` edges to the earlier session a warm start reused). Without matplotlib it
returns None and writes nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def curves(rows: Sequence[Mapping[str, Any]], optimum: Mapping[str, float]) -> dict[str, list[float]]:
    """Per session, the best fraction of its task's optimum after each step, from rows of
    ``session_id``, ``task_id``, ``step``, ``speedup`` (any order).

    >>> curves([{"session_id": "s", "task_id": "t", "step": 2, "speedup": 4.0},
    ...         {"session_id": "s", "task_id": "t", "step": 1, "speedup": 2.0}], {"t": 8.0})
    {'s': [0.25, 0.5]}
    """
    by: dict[str, list[tuple[int, float]]] = {}
    task: dict[str, str] = {}
    for r in rows:
        by.setdefault(r["session_id"], []).append((int(r["step"]), float(r["speedup"] or 0.0)))
        task[r["session_id"]] = r["task_id"]
    out: dict[str, list[float]] = {}
    for sid, pts in by.items():
        best, line = 0.0, []
        for _, v in sorted(pts):
            best = max(best, v)
            line.append(best / optimum[task[sid]])
        out[sid] = line
    return out


def _median_curve(lines: Sequence[Sequence[float]], length: int) -> list[float]:
    """The median over sessions at each step; a session that stopped keeps its last value."""
    return [statistics.median(ln[min(i, len(ln) - 1)] for ln in lines) for i in range(length)]


def draw(folder: Path, cold: Mapping[str, list[float]], warm: Mapping[str, list[float]], target: float,
         lineage: Any, branches: Sequence[Mapping[str, Any]], lineage_title: str) -> list[Path] | None:
    """Write the plots into ``folder``; the files written (None without matplotlib).
    ``lineage`` is a ``networkx.DiGraph`` of nodes with ``hop``, ``session_id`` and ``speedup``
    attributes (a LINEAGE query's ``to_networkx()``); ``branches`` the other children of its
    nodes (``parent``, ``id``, ``speedup``, ``status``): the attempts that led nowhere."""
    if not have_matplotlib():
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    length = max(len(ln) for ln in [*cold.values(), *warm.values()])
    for name, lines, color in (("cold", cold, "tab:blue"), ("warm", warm, "tab:orange")):
        for ln in lines.values():
            ax.plot(range(1, len(ln) + 1), ln, color=color, alpha=0.25, linewidth=1)
        ax.plot(range(1, length + 1), _median_curve(list(lines.values()), length), color=color, linewidth=2.5,
                label=f"{name} sessions (median of {len(lines)})")
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target: {target:.0%} of the optimum")
    ax.set_xscale("log")
    ax.set_xlabel("step (kernels evaluated)")
    ax.set_ylabel("best speedup so far / best possible")
    ax.set_ylim(0, 1.02)
    ax.set_title("Simulated kernel tuning: cold start vs. seeded by retrieval")
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = folder / "best_vs_step.png"
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
    written.append(_draw_lineage(plt, folder / "lineage.png", lineage, branches, lineage_title))
    return written


def _draw_lineage(plt: Any, path: Path, g: Any, branches: Sequence[Mapping[str, Any]], title: str) -> Path:
    """The ancestry as layers by hop (the program on the right), coloured by session, and below
    each node the other kernels tried from it (grey; a cross: did not compile)."""
    layers: dict[int, list[str]] = {}
    for n, d in g.nodes(data=True):
        layers.setdefault(int(d["hop"]), []).append(n)
    pos = {}
    for hop, names in layers.items():
        for i, n in enumerate(sorted(names)):
            pos[n] = (-hop, i - (len(names) - 1) / 2)
    sessions = sorted({d["session_id"] for _, d in g.nodes(data=True)})
    colors = {s: plt.get_cmap("tab10")(i % 10) for i, s in enumerate(sessions)}
    fig, ax = plt.subplots(figsize=(min(14.0, max(6.0, 0.45 * len(layers) + 2)), 4.5), dpi=110)
    below: dict[str, int] = {}
    for b in branches:
        if b["parent"] not in pos or b["id"] in pos:
            continue
        below[b["parent"]] = below.get(b["parent"], 0) + 1
        x0, y0 = pos[b["parent"]]
        x, y = x0 + 0.5, y0 - 0.45 * below[b["parent"]]
        ax.plot([x0, x], [y0, y], color="lightgray", linewidth=0.8, zorder=1)
        failed = b["status"] == "failed"
        ax.scatter([x], [y], s=30 if failed else 22, color="indianred" if failed else "darkgray",
                   marker="x" if failed else "o", zorder=2)
    for u, v, d in g.edges(data=True):
        (x0, y0), (x1, y1) = pos[u], pos[v]
        retrieved = d.get("kind") == "retrieved"
        ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                    arrowprops={"arrowstyle": "->", "color": "crimson" if retrieved else "gray",
                                "linestyle": "--" if retrieved else "-", "linewidth": 1.5 if retrieved else 1})
    for s in sessions:
        pts = [n for n, d in g.nodes(data=True) if d["session_id"] == s]
        ax.scatter([pos[n][0] for n in pts], [pos[n][1] for n in pts], s=260, color=colors[s], label=s, zorder=3)
        for n in pts:
            sp = g.nodes[n]["speedup"]
            ax.annotate(f"{sp:.1f}" if sp is not None else "", pos[n], ha="center", va="center", fontsize=7,
                        color="white", zorder=4)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("hops back from the program (numbers: speedup on its own task; dashed red: a retrieved edge; "
                  "below: other kernels tried)", fontsize=8)
    ax.set_yticks([])
    ax.set_ylim(-0.45 * max(below.values(), default=0) - 0.4, 0.6)
    ax.legend(loc="lower left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
