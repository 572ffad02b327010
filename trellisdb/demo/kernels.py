"""The simulation behind `trellis demo`: tuning a matrix-multiply kernel for simulated accelerators.

A **task** is one (accelerator, problem) pair: a GEMM of shape ``M x N x K`` with elements of
``bytes`` bytes, on an accelerator with ``cores`` cores, ``smem_kb`` KiB of shared memory per
core, ``regs`` registers per thread, a vector width of ``16 / bytes`` lanes and
``flop_per_byte`` (how many flops of compute one byte of memory traffic costs in time). A
**kernel** is six knobs: the output tile (``tile_m x tile_n``), the reduction tile
``tile_k``, the inner loop's ``unroll``, the vector width ``vec`` it issues, and the
software-pipeline depth ``stages``.

The cost model (:func:`runtime`, arbitrary time units) is a roofline per tile:

- a kernel whose tiles do not fit shared memory (``(tile_m + tile_n) * tile_k * bytes *
  stages``) or the register file (``tile_m * tile_n / 128 + 2 * unroll * vec + 16``) does not
  compile: speedup 0;
- compute per tile ``2 * tile_m * tile_n * K / (vector efficiency * unroll efficiency)``, with
  vector efficiency ``min(vec, lanes) / lanes`` and unroll efficiency ``1 / (1 + 0.5 / unroll)``;
- memory per tile ``(tile_m + tile_n) * K * bytes * flop_per_byte``, slower when a ``tile_k``
  row is shorter than a 64-byte transaction;
- the slower of the two, plus the faster one divided by ``stages`` (pipelining hides it),
  plus a barrier per ``tile_k`` step and a fixed cost per tile;
- times the number of *waves*: ``ceil(tiles / cores)``, so tiles too large for a small
  problem leave cores idle.

The **speedup** of a kernel is the runtime of a naive kernel (32 x 32 x 8 tiles, no unroll,
scalar, no pipelining) divided by its own. Because the best knobs depend on shared memory,
registers, element size, the compute/memory balance and the shape, the optimum shifts from
task to task; tasks of similar accelerators have similar optima. The space is small enough
(6,400 kernels) for :func:`optimum` to enumerate, so the demo knows how far each attempt is
from the best possible, which the agent never sees.

>>> t = family(4)[0]
>>> naive = {"tile_m": 32, "tile_n": 32, "tile_k": 8, "unroll": 1, "vec": 1, "stages": 1}
>>> speedup(t, naive)
1.0
>>> best, knobs = optimum(t)
>>> best > 3 and speedup(t, knobs) == best
True
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

KNOBS: dict[str, tuple[int, ...]] = {
    "tile_m": (16, 32, 64, 128, 256),
    "tile_n": (16, 32, 64, 128, 256),
    "tile_k": (8, 16, 32, 64),
    "unroll": (1, 2, 4, 8),
    "vec": (1, 2, 4, 8),
    "stages": (1, 2, 3, 4),
}
NAIVE: dict[str, int] = {"tile_m": 32, "tile_n": 32, "tile_k": 8, "unroll": 1, "vec": 1, "stages": 1}
SHAPES = ((4096, 4096, 4096), (4096, 11008, 4096), (1024, 4096, 4096), (512, 4096, 1024),
          (8192, 1024, 8192), (2048, 2048, 512), (256, 8192, 4096), (16384, 4096, 1024))


@dataclass(frozen=True)
class Task:
    """One tuning task: a GEMM shape on one simulated accelerator."""

    id: str
    M: int
    N: int
    K: int
    bytes: int
    cores: int
    smem_kb: int
    regs: int
    flop_per_byte: int

    @property
    def lanes(self) -> int:
        return 16 // self.bytes

    def describe(self) -> str:
        dtype = "fp16" if self.bytes == 2 else "fp32"
        return (f"{dtype} GEMM {self.M}x{self.N}x{self.K} on an accelerator with {self.cores} cores, "
                f"{self.smem_kb} KiB shared memory, {self.regs} registers/thread, "
                f"{self.flop_per_byte} flop/byte")

    def situation(self) -> list[float]:
        """The task as a vector (each feature scaled to about [0, 1]): what retrieval compares."""
        return [self.smem_kb / 228, self.regs / 255, self.flop_per_byte / 100, self.bytes / 4,
                math.log2(self.M) / 14, math.log2(self.N) / 14, math.log2(self.K) / 14, self.cores / 132]


def family(n: int, seed: int = 2026) -> list[Task]:
    """``n`` related tasks, drawn from a fixed generator (``seed``): the same list every run."""
    g = random.Random(seed)
    out = []
    for i in range(n):
        m, nn, k = SHAPES[g.randrange(len(SHAPES))]
        out.append(Task(id=f"gemm-{i:02d}", M=m, N=nn, K=k, bytes=g.choice((2, 4)), cores=g.choice((80, 108, 132)),
                        smem_kb=g.choice((64, 96, 128, 164, 228)), regs=g.choice((128, 168, 255)),
                        flop_per_byte=g.choice((30, 40, 60, 80, 100))))
    return out


def runtime(t: Task, k: dict[str, int]) -> float | None:
    """The kernel's simulated runtime on the task, or None when it does not compile."""
    tm, tn, tk, u, v, s = (k[name] for name in KNOBS)
    if (tm + tn) * tk * t.bytes * s > t.smem_kb * 1024:
        return None
    if tm * tn // 128 + 2 * u * v + 16 > t.regs:
        return None
    waves = math.ceil(math.ceil(t.M / tm) * math.ceil(t.N / tn) / t.cores)
    compute = 2 * tm * tn * t.K / ((min(v, t.lanes) / t.lanes) * (1 / (1 + 0.5 / u)))
    memory = (tm + tn) * t.K * t.bytes * t.flop_per_byte * max(1.0, 64 / (tk * t.bytes)) ** 0.5
    per_tile = max(compute, memory) + min(compute, memory) / s + (t.K / tk) * tm * 8 + 2e4
    return float(waves * per_tile)


def speedup(t: Task, k: dict[str, int]) -> float:
    """The naive kernel's runtime over this one's (0 when it does not compile), rounded to 4 places."""
    r = runtime(t, k)
    base = runtime(t, NAIVE)
    assert base is not None
    return 0.0 if r is None else round(base / r, 4)


def optimum(t: Task) -> tuple[float, dict[str, int]]:
    """The best speedup possible on the task, and its knobs (every kernel tried)."""
    best: tuple[float, dict[str, int]] = (0.0, dict(NAIVE))
    for values in itertools.product(*KNOBS.values()):
        k = dict(zip(KNOBS, values, strict=True))
        s = speedup(t, k)
        if s > best[0]:
            best = (s, k)
    return best


def mutate(rng: random.Random, k: dict[str, int]) -> tuple[dict[str, int], str]:
    """What the simulated model proposes from a kernel: one knob (sometimes two) a notch up or
    down; the new knobs and a line saying what changed."""
    out = dict(k)
    changes = []
    for name in rng.sample(sorted(KNOBS), 1 if rng.random() < 0.7 else 2):
        values = KNOBS[name]
        i = values.index(out[name])
        step = rng.choice((-1, 1))
        j = i + step if 0 <= i + step < len(values) else i - step  # at an end of its range: the other way
        out[name] = values[j]
        changes.append(f"{name} {values[i]}->{values[j]}")
    return out, ", ".join(changes)


def describe(k: dict[str, int]) -> str:
    return (f"tile {k['tile_m']}x{k['tile_n']}x{k['tile_k']}, unroll {k['unroll']}, vec {k['vec']}, "
            f"stages {k['stages']}")
