"""Synthetic experience graphs shaped like an OpenEvolve run, as trellisdb Arrow tables.

The generator produces the tables of ``trellisdb.schema`` (tasks, sessions,
nodes, edges, artifacts, node_artifacts, rewards), ready for
``db.ingest(...)``, in chunks of consecutive nodes. Everything is vectorized
with numpy/pyarrow; the only per-row Python loop is the sha256 of each
artifact (``hashlib`` has no vectorized form, and it is cheap next to
the bytes it hashes).

Defaults are calibrated on the OpenEvolve circle-packing checkpoint in
``/work/shared/data/openevolve-circle-packing/checkpoints/checkpoint_100``
(see :func:`calibrate`, which re-measures them; the constants in
``MEASURED`` are what it measured, so the generator works without the data):

- lineage: each expanded parent has 1.58 children on average, at most 6
  (a geometric child count clipped at 6 fits the measured histogram
  24/9/4/0/0/1 for 1/2/3/4/5/6 children);
- rewards: 5 channels ``validity, sum_radii, target_ratio, combined_score,
  eval_time`` with the measured means and spreads (``target_ratio =
  sum_radii / 2.635``, ``combined_score = target_ratio`` when valid);
- artifacts per node: ``code`` (~5.7 KB), ``prompt`` (the user prompt, ~9.0 KB),
  ``response`` (~5.9 KB), and ``system_prompt`` (945 B, identical for every
  node of a task, so content addressing stores it once).

Artifact bodies are slices of the real programs/prompts (or of a synthetic
Python-like corpus when the data is absent), each prefixed by a header naming
the node, so contents are unique, text-like and about as compressible as
real code. Deterministic for a given ``seed`` and chunk size.

    >>> g = ExperienceGraph(GeneratorConfig(sessions=2, nodes_per_session=10, embedding_dim=4))
    >>> t = g.chunk(0, g.n_nodes)
    >>> t["nodes"].num_rows, t["edges"].num_rows, t["rewards"].num_rows
    (20, 18, 100)
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.schema import table_schema

DEFAULT_PROGRAMS_DIR = "/work/shared/data/openevolve-circle-packing/checkpoints/checkpoint_100/programs"

CIRCLE_TARGET = 2.635  # sum of radii the AlphaEvolve paper reached for n=26 (target_ratio = sum_radii / this)

#: What ``calibrate()`` measured on checkpoint_100 (60 programs).
MEASURED: dict[str, Any] = {
    "programs": 60,
    "mean_children": 1.5789,
    "max_children": 6,
    "children_histogram": {1: 24, 2: 9, 3: 4, 6: 1},
    "max_generation": 9,
    "channels": ("validity", "sum_radii", "target_ratio", "combined_score", "eval_time"),
    # channel: (mean, std, min, max)
    "metric_stats": {
        "validity": (1.0, 0.0, 1.0, 1.0),
        "sum_radii": (1.6273, 0.2775, 0.7372, 2.1289),
        "target_ratio": (0.6176, 0.1053, 0.2798, 0.8079),
        "combined_score": (0.6176, 0.1053, 0.2798, 0.8079),
        "eval_time": (1.3869, 3.5670, 0.1285, 27.0945),
    },
    # artifact: (mean, std, min, max) bytes
    "artifact_bytes": {
        "code": (5675.4, 1008.1, 3701, 9392),
        "prompt": (9021.8, 1096.4, 4781, 12754),
        "response": (5874.3, 1344.1, 3715, 10740),
    },
    "system_prompt_bytes": 945,
    "json_bytes_per_program": 23121,
    "seconds_per_iteration": 18.73,
}

MEDIA_TYPES = {
    "code": "text/x-python",
    "prompt": "text/plain",
    "response": "text/markdown",
    "system_prompt": "text/plain",
}


# --------------------------------------------------------------------------- calibration
@dataclass(frozen=True)
class Calibration:
    """Statistics of a set of OpenEvolve program files, plus text corpora for artifact bodies."""

    source: str
    programs: int
    mean_children: float
    max_children: int
    children_histogram: dict[int, int]
    max_generation: int
    channels: tuple[str, ...]
    metric_stats: dict[str, tuple[float, float, float, float]]
    artifact_bytes: dict[str, tuple[float, float, float, float]]
    system_prompt: str
    json_bytes_per_program: float
    seconds_per_iteration: float
    corpora: dict[str, bytes] = field(repr=False, default_factory=dict)

    def summary(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("corpora", "system_prompt")}
        d["system_prompt_bytes"] = len(self.system_prompt.encode())
        d["children_histogram"] = {str(k): v for k, v in sorted(self.children_histogram.items())}
        return d


def _stats(values: Sequence[float]) -> tuple[float, float, float, float]:
    a = np.asarray(values, dtype=np.float64)
    return (float(a.mean()), float(a.std()), float(a.min()), float(a.max()))


def calibrate(programs_dir: str = DEFAULT_PROGRAMS_DIR) -> Calibration:
    """Measure lineage, reward and artifact statistics of OpenEvolve program JSON files.

    Falls back to ``MEASURED`` and a synthetic corpus when ``programs_dir`` has no files.
    """
    files = sorted(glob.glob(os.path.join(programs_dir, "*.json")))
    if not files:
        return _builtin_calibration()
    progs = []
    for f in files:
        with open(f) as fh:
            progs.append(json.load(fh))
    children = Counter(p["parent_id"] for p in progs if p.get("parent_id"))
    hist = Counter(children.values())
    channels: list[str] = []
    for p in progs:
        for k in p.get("metrics") or {}:
            if k not in channels:
                channels.append(k)
    metric_stats = {c: _stats([p["metrics"][c] for p in progs if c in p.get("metrics", {})]) for c in channels}
    codes, users, responses, systems = [], [], [], []
    for p in progs:
        codes.append(p.get("code") or "")
        for pr in (p.get("prompts") or {}).values():
            systems.append(pr.get("system") or "")
            users.append(pr.get("user") or "")
            responses.append("".join(pr.get("responses") or []))
    art = {"code": _stats([len(c.encode()) for c in codes])}
    if users:
        art["prompt"] = _stats([len(u.encode()) for u in users])
        art["response"] = _stats([len(r.encode()) for r in responses])
    system = Counter(systems).most_common(1)[0][0] if systems else ""
    ts = [p["timestamp"] for p in progs if "timestamp" in p]
    its = [p["iteration_found"] for p in progs if "iteration_found" in p]
    spi = (max(ts) - min(ts)) / (max(its) - min(its)) if len(its) > 1 and max(its) > min(its) else 20.0
    corpora = {
        "code": "\n".join(codes).encode(),
        "prompt": "\n".join(users).encode() or "\n".join(codes).encode(),
        "response": "\n".join(responses).encode() or "\n".join(codes).encode(),
    }
    return Calibration(
        source=programs_dir,
        programs=len(progs),
        mean_children=float(np.mean(list(children.values()))) if children else 1.0,
        max_children=max(children.values()) if children else 1,
        children_histogram=dict(sorted(hist.items())),
        max_generation=max((int(p.get("generation", 0)) for p in progs), default=0),
        channels=tuple(channels),
        metric_stats=metric_stats,
        artifact_bytes=art,
        system_prompt=system,
        json_bytes_per_program=float(np.mean([os.path.getsize(f) for f in files])),
        seconds_per_iteration=float(spi),
        corpora=corpora,
    )


def _synthetic_corpus(seed: int, n_lines: int = 40_000) -> bytes:
    """Python-looking text (used when the calibration data is absent)."""
    rng = np.random.default_rng(seed)
    words = np.array(
        ["x", "y", "r", "i", "j", "n", "k", "centers", "radii", "np.array", "np.sqrt", "np.zeros", "np.clip", "min", "max", "sum", "for", "in", "range", "if", "else", "return", "def", "construct_packing", "compute_max_radii", "dist", "best", "score", "+", "-", "*", "/", "=", "==", "<", ">", "(", ")", "[", "]", ",", ":", "0.5", "1.0", "2", "26"]
    )
    lens = rng.integers(3, 12, n_lines)
    toks = words[rng.integers(0, len(words), int(lens.sum()))]
    indent = rng.integers(0, 3, n_lines)
    out, pos = [], 0
    for ln, ind in zip(lens.tolist(), indent.tolist(), strict=True):  # once, ~40k lines: cheap
        out.append("    " * ind + " ".join(toks[pos : pos + ln].tolist()))
        pos += ln
    return "\n".join(out).encode()


def _builtin_calibration() -> Calibration:
    corpus = _synthetic_corpus(0)
    m = MEASURED
    return Calibration(
        source="builtin (MEASURED constants; data not found)",
        programs=m["programs"],
        mean_children=m["mean_children"],
        max_children=m["max_children"],
        children_histogram=dict(m["children_histogram"]),
        max_generation=m["max_generation"],
        channels=tuple(m["channels"]),
        metric_stats=dict(m["metric_stats"]),
        artifact_bytes=dict(m["artifact_bytes"]),
        system_prompt=(corpus[: m["system_prompt_bytes"]].decode()),
        json_bytes_per_program=m["json_bytes_per_program"],
        seconds_per_iteration=m["seconds_per_iteration"],
        corpora={"code": corpus, "prompt": corpus, "response": corpus},
    )


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class GeneratorConfig:
    """Shape of the synthetic graph. Defaults: the measured OpenEvolve run, 100 sessions x 100 iterations."""

    sessions: int = 100
    nodes_per_session: int = 100
    #: mean children per expanded parent (>= 1)
    branching: float = MEASURED["mean_children"]
    max_children: int = MEASURED["max_children"]
    #: an int (the first k calibrated channels, then ``metric_<i>``) or channel names
    reward_channels: int | tuple[str, ...] = len(MEASURED["channels"])
    #: mean size of the ``code`` artifact in bytes; prompt/response scale with it
    artifact_bytes: float = MEASURED["artifact_bytes"]["code"][0]
    #: artifact roles per node, besides the shared ``system_prompt``
    artifact_names: tuple[str, ...] = ("code", "prompt", "response")
    shared_system_prompt: bool = True
    embedding_dim: int = 384
    #: 0: embeddings uniform on the sphere; k > 0: around k random centroids (noise 0.35 per dimension-normalized)
    embedding_clusters: int = 0
    tasks: int = 1
    seed: int = 0
    agent: str = "openevolve"
    model: str = "o4-mini"

    @property
    def n_nodes(self) -> int:
        return self.sessions * self.nodes_per_session

    @classmethod
    def for_nodes(cls, n_nodes: int, **kw: Any) -> GeneratorConfig:
        """A config with about ``n_nodes`` nodes (sessions of ``nodes_per_session``)."""
        base = cls(**kw)
        nps = min(base.nodes_per_session, max(1, n_nodes))
        return replace(base, nodes_per_session=nps, sessions=max(1, math.ceil(n_nodes / nps)))


def _clipped_geometric_q(mean: float, cap: int) -> float:
    """q such that E[min(G, cap)] = mean for G ~ Geometric(1 - q) on {1, 2, ...}."""
    if mean <= 1.0 or cap <= 1:
        return 0.0
    mean = min(mean, cap - 1e-9)
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(80):
        q = (lo + hi) / 2
        m = (1 - q**cap) / (1 - q)  # sum_{k=0}^{cap-1} q^k
        lo, hi = (q, hi) if m < mean else (lo, q)
    return (lo + hi) / 2


_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def _uuid_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 36) uint8: random version-4 UUID strings (vectorized)."""
    b = rng.integers(0, 256, size=(n, 16), dtype=np.uint8)
    b[:, 6] = (b[:, 6] & 0x0F) | 0x40
    b[:, 8] = (b[:, 8] & 0x3F) | 0x80
    h = np.empty((n, 32), np.uint8)
    h[:, 0::2] = _HEX[b >> 4]
    h[:, 1::2] = _HEX[b & 0x0F]
    out = np.full((n, 36), ord("-"), np.uint8)
    for dst, src in ((slice(0, 8), slice(0, 8)), (slice(9, 13), slice(8, 12)), (slice(14, 18), slice(12, 16)),
                     (slice(19, 23), slice(16, 20)), (slice(24, 36), slice(20, 32))):
        out[:, dst] = h[:, src]
    return out


def _fixed_strings(mat: np.ndarray) -> pa.Array:
    """A string array from an (n, w) uint8 matrix of ASCII rows."""
    n, w = mat.shape
    offsets = np.arange(0, w * (n + 1), w, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(mat))])


def _slices(src: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """``src[starts[i] : starts[i] + lengths[i]]`` for all i as a large_binary array, without a row loop:
    an Arrow binary_view array pointing into ``src`` (lengths > 12), materialized by a cast."""
    n = len(starts)
    starts = starts.astype(np.int32)
    if n and (int(lengths.min()) <= 12 or int(starts.max()) + int(lengths.max()) > len(src)):
        raise ValueError("slices must be longer than 12 bytes and lie inside src")
    views = np.zeros(n, dtype=[("len", "<i4"), ("prefix", "u1", (4,)), ("buf", "<i4"), ("off", "<i4")])
    views["len"] = lengths
    views["prefix"] = src[starts[:, None] + np.arange(4)]
    views["off"] = starts
    arr = pa.Array.from_buffers(pa.binary_view(), n, [None, pa.py_buffer(views), pa.py_buffer(src)])
    return arr.cast(pa.large_binary())


def _ts(micros: np.ndarray) -> pa.Array:
    return pa.array(micros.astype(np.int64), pa.int64()).cast(pa.timestamp("us", tz="UTC"))


#: Columns trellisdb sets itself (the insertion order): an ingest may not give them.
SYSTEM_COLUMNS = {"born", "ordinal"}


def as_stored(name: str, tab: pa.Table, commit_id: int) -> pa.Table:
    """An ingested table as the store holds it, for a baseline that reads the same rows: the
    (unqueried) embedding left out, ``commit_id`` stamped, and for nodes the insertion order TQL
    breaks ties by (``schema.SEQ_SQL``) as a plain ``seq`` column."""
    tab = tab.drop_columns([c for c in ("embedding", "commit_id") if c in tab.column_names])
    tab = tab.append_column("commit_id", pa.array([commit_id] * tab.num_rows, pa.int64()))
    if name == "nodes":
        tab = tab.append_column("seq", pa.array([(commit_id << 32) + i for i in range(tab.num_rows)], pa.int64()))
    return tab


def _table(name: str, dim: int, cols: dict[str, Any], n: int) -> pa.Table:
    full = table_schema(name, dim)
    sch = pa.schema([f for f in full if f.name not in SYSTEM_COLUMNS])
    arrays = []
    for f in sch:
        if f.name == "commit_id":
            arrays.append(pa.array(np.zeros(n, np.int64)))
        elif f.name in cols:
            a = cols[f.name]
            if isinstance(a, pa.Array | pa.ChunkedArray):
                arrays.append(a if a.type == f.type else a.cast(f.type))
            else:
                arrays.append(pa.array(a, f.type))
        else:
            arrays.append(pa.nulls(n, f.type))
    return pa.Table.from_arrays(arrays, schema=sch)


# --------------------------------------------------------------------------- the generator
class ExperienceGraph:
    """A synthetic experience graph; tables are produced per chunk of consecutive nodes.

    Nodes are ordered session by session; within a session node 0 is the root
    (the initial program) and parents always precede their children, so any
    prefix of nodes is a valid ingest (edges point at nodes already ingested).
    """

    def __init__(self, config: GeneratorConfig | None = None, calibration: Calibration | None = None) -> None:
        self.config = cfg = config or GeneratorConfig()
        self.cal = cal = calibration or calibrate()
        if cfg.branching < 1:
            raise ValueError("branching (mean children per expanded parent) must be >= 1")
        rng = np.random.default_rng([cfg.seed, 0])
        S, n = cfg.sessions, cfg.nodes_per_session
        N = self.n_nodes = S * n
        self.dim = cfg.embedding_dim
        # ---- channels
        if isinstance(cfg.reward_channels, int):
            base = list(cal.channels)
            self.channels = tuple(base[: cfg.reward_channels]) + tuple(
                f"metric_{i}" for i in range(len(base), cfg.reward_channels)
            )
        else:
            self.channels = tuple(cfg.reward_channels)
        # ---- lineage: BFS assignment of clipped-geometric child counts, per session
        self.session_of = np.repeat(np.arange(S, dtype=np.int64), n)
        self.step = np.tile(np.arange(1, n + 1, dtype=np.int64), S)
        parent = np.full(N, -1, np.int64)
        if n > 1:
            q = _clipped_geometric_q(cfg.branching, cfg.max_children)
            counts = (
                np.minimum(rng.geometric(1 - q, size=(S, n - 1)), cfg.max_children)
                if q > 0
                else np.ones((S, n - 1), np.int64)
            )
            cum = np.cumsum(counts, axis=1)
            big = cfg.max_children * n + 1
            rows = np.arange(S, dtype=np.int64)[:, None]
            flat = (cum + rows * big).ravel()
            pos = np.arange(1, n, dtype=np.int64)[None, :] + rows * big
            rel = np.searchsorted(flat, pos.ravel(), side="left").reshape(S, n - 1) - rows * (n - 1)
            par = np.full((S, n), -1, np.int64)
            par[:, 1:] = rel + rows * n
            parent = par.ravel()
        self.parent = parent
        has = parent >= 0
        self.has_children = np.zeros(N, bool)
        self.has_children[parent[has]] = True
        depth = np.zeros(N, np.int64)
        for _ in range(N + 1):  # converges in max-depth rounds (~log_b n)
            nd = np.where(has, depth[np.maximum(parent, 0)] + 1, 0)
            if np.array_equal(nd, depth):
                break
            depth = nd
        self.generation = depth
        # ---- ids
        self.node_id_bytes = _uuid_bytes(rng, N)
        self.node_ids = _fixed_strings(self.node_id_bytes)
        self.session_ids = _fixed_strings(_uuid_bytes(rng, S))
        self.task_of_session = np.arange(S, dtype=np.int64) % max(1, cfg.tasks)
        self.task_ids = pa.array(
            ["circle-packing-26" if t == 0 else f"circle-packing-26-{t}" for t in range(max(1, cfg.tasks))]
        )
        self.island = rng.integers(0, 4, N)
        # ---- times: session s starts s hours after T0; one iteration per seconds_per_iteration
        t0 = 1_750_000_000_000_000
        start = t0 + np.arange(S, dtype=np.int64) * 3_600_000_000
        spi = cal.seconds_per_iteration
        self.created_us = start[self.session_of] + (self.step * spi * 1e6).astype(np.int64)
        # ---- metrics (N, channels)
        self.metrics = self._metrics(rng, N)
        # ---- artifact sizes (N,) per role, scaled so that code's mean is cfg.artifact_bytes
        scale = cfg.artifact_bytes / cal.artifact_bytes["code"][0]
        self.sizes: dict[str, np.ndarray] = {}
        for name in cfg.artifact_names:
            mean, std, lo, hi = cal.artifact_bytes.get(name, cal.artifact_bytes["code"])
            s = rng.normal(mean, std, N).clip(lo, hi) * scale
            self.sizes[name] = np.maximum(s.astype(np.int64), 64)
        # ---- corpora as uint8, doubled so any slice up to its length fits
        self._corpus: dict[str, np.ndarray] = {}
        for name in cfg.artifact_names:
            raw = cal.corpora.get(name) or cal.corpora.get("code") or _synthetic_corpus(cfg.seed)
            need = int(self.sizes[name].max()) + 1 if N else 1
            reps = max(2, math.ceil(need / len(raw)) + 1)
            self._corpus[name] = np.frombuffer(raw * reps, np.uint8)
        self._corpus_len = {k: len(cal.corpora.get(k) or cal.corpora.get("code") or b"x") for k in self._corpus}
        # ---- the shared system prompt: one artifact per task
        self.system_prompts = [
            (cal.system_prompt if t == 0 else f"{cal.system_prompt}\n(task variant {t})").encode()
            for t in range(max(1, cfg.tasks))
        ]
        self.system_hashes = [hashlib.sha256(c).hexdigest() for c in self.system_prompts]

    # ------------------------------------------------------------------ pieces
    def _metrics(self, rng: np.random.Generator, N: int) -> np.ndarray:
        st = self.cal.metric_stats
        out = np.zeros((N, len(self.channels)))
        cols: dict[str, np.ndarray] = {}
        mean, std, lo, hi = st.get("sum_radii", (1.6, 0.28, 0.7, 2.2))
        cols["sum_radii"] = rng.normal(mean, std, N).clip(lo, hi)
        cols["validity"] = (rng.random(N) < st.get("validity", (1.0,))[0]).astype(np.float64)
        cols["target_ratio"] = cols["sum_radii"] / CIRCLE_TARGET
        cols["combined_score"] = cols["target_ratio"] * cols["validity"]
        m, s, lo, hi = st.get("eval_time", (1.39, 3.57, 0.13, 27.1))
        sig2 = math.log(1 + (s / m) ** 2)
        cols["eval_time"] = rng.lognormal(math.log(m) - sig2 / 2, math.sqrt(sig2), N).clip(lo, hi * 2)
        for i, c in enumerate(self.channels):
            if c in cols:
                out[:, i] = cols[c]
            else:
                m, s, lo, hi = st.get(c, (0.5, 0.2, 0.0, 1.0))
                out[:, i] = rng.normal(m, s, N).clip(lo, hi)
        return out

    def _contents(self, name: str, a: int, b: int, rng: np.random.Generator) -> tuple[pa.Array, pa.Array, pa.Array]:
        """(hash, size, content) of role ``name`` for nodes [a, b): a header naming the node + a corpus slice."""
        m = b - a
        tag = f"# {name[:8]:<8} ".encode()
        header = np.empty((m, len(tag) + 37), np.uint8)
        header[:, : len(tag)] = np.frombuffer(tag, np.uint8)
        header[:, len(tag) : len(tag) + 36] = self.node_id_bytes[a:b]
        header[:, -1] = ord("\n")
        H = header.shape[1]
        hdr = pa.Array.from_buffers(
            pa.large_binary(), m, [None, pa.py_buffer(np.arange(0, H * (m + 1), H, dtype=np.int64)), pa.py_buffer(header)]
        )
        body_len = np.maximum(self.sizes[name][a:b] - H, 16).astype(np.int32)
        body = _slices(self._corpus[name], rng.integers(0, self._corpus_len[name], m), body_len)
        content = pc.binary_join_element_wise(hdr, body, pa.scalar(b"", pa.large_binary()))
        offsets = np.frombuffer(content.buffers()[1], np.int64, m + 1, content.offset * 8)
        data = content.buffers()[2]
        mv = memoryview(data)
        off = offsets.tolist()
        # the one per-row loop: sha256 has no vectorized form (hashlib releases the GIL; ~1 GB/s)
        hashes = pa.array([hashlib.sha256(mv[off[i] : off[i + 1]]).hexdigest() for i in range(m)], pa.string())
        return hashes, pa.array(np.diff(offsets), pa.int64()), content

    def _embeddings(self, m: int, rng: np.random.Generator) -> pa.Array:
        v = rng.standard_normal((m, self.dim), dtype=np.float32)
        k = self.config.embedding_clusters
        if k:
            cent = np.random.default_rng(self.config.seed + 7919).standard_normal((k, self.dim), dtype=np.float32)
            v = cent[rng.integers(0, k, m)] + 0.35 * v
        v /= np.linalg.norm(v, axis=1, keepdims=True) + 1e-12
        return pa.FixedSizeListArray.from_arrays(pa.array(v.ravel(), pa.float32()), self.dim)

    # ------------------------------------------------------------------ public
    def chunk_bounds(self, chunk_nodes: int) -> list[tuple[int, int]]:
        return [(a, min(a + chunk_nodes, self.n_nodes)) for a in range(0, self.n_nodes, chunk_nodes)]

    def chunks(self, chunk_nodes: int = 10_000) -> Iterator[dict[str, pa.Table]]:
        """The tables for consecutive chunks of ``chunk_nodes`` nodes, in ingest order."""
        for a, b in self.chunk_bounds(chunk_nodes):
            yield self.chunk(a, b)

    def chunk(self, a: int, b: int) -> dict[str, pa.Table]:
        """Tables for nodes [a, b): the sessions/tasks that start there, nodes, edges,
        rewards, artifacts (new hashes only) and node_artifacts."""
        cfg, dim = self.config, self.dim
        rng = np.random.default_rng([cfg.seed, 1, a, b])
        m = b - a
        idx = np.arange(a, b)
        sess = self.session_of[a:b]
        ids = self.node_ids.slice(a, m)
        sess_ids = pc.take(self.session_ids, pa.array(sess))
        task_ids = pc.take(self.task_ids, pa.array(self.task_of_session[sess]))
        out: dict[str, pa.Table] = {}
        # tasks and sessions whose first node is in this chunk
        new_sess = sess[self.step[a:b] == 1]
        if len(new_sess):
            ns = len(new_sess)
            tsk = self.task_of_session[new_sess]
            cfg_json = json.dumps(
                {"max_iterations": cfg.nodes_per_session, "num_islands": 4, "population_size": 1000,
                 "diff_based_evolution": False, "llm": {"primary_model": cfg.model}},
                sort_keys=True,
            )
            out["sessions"] = _table(
                "sessions", dim,
                {
                    "id": pc.take(self.session_ids, pa.array(new_sess)),
                    "task_id": pc.take(self.task_ids, pa.array(tsk)),
                    "agent": pa.array([cfg.agent] * ns),
                    "model": pa.array([cfg.model] * ns),
                    "config": pa.array([cfg_json] * ns),
                    "status": pa.array(["completed"] * ns),
                    "created_at": _ts(self.created_us[new_sess * cfg.nodes_per_session]),
                },
                ns,
            )
            first_tasks = np.unique(tsk[new_sess < max(1, cfg.tasks)])
            if len(first_tasks):
                nt = len(first_tasks)
                out["tasks"] = _table(
                    "tasks", dim,
                    {
                        "id": pc.take(self.task_ids, pa.array(first_tasks)),
                        "name": pc.take(self.task_ids, pa.array(first_tasks)),
                        "spec": pa.array([self.system_prompts[t].decode() for t in first_tasks.tolist()]),
                        "tags": pa.array([["circle-packing", "openevolve"]] * nt, pa.list_(pa.string())),
                        "embedding": self._embeddings(nt, rng),
                        "created_at": _ts(self.created_us[first_tasks * cfg.nodes_per_session]),
                    },
                    nt,
                )
        # nodes
        sizes = {k: v[a:b] for k, v in self.sizes.items()}
        tok_in = (sizes.get("prompt", np.zeros(m, np.int64)) + len(self.system_prompts[0])) // 4
        tok_out = sizes.get("response", sizes.get("code", np.zeros(m, np.int64))) // 4
        llm_s = rng.lognormal(math.log(12.0), 0.5, m)
        ch = list(self.channels)
        eval_t = self.metrics[a:b, ch.index("eval_time")] if "eval_time" in ch else np.zeros(m)
        summaries = pa.array(["Full rewrite", "Change 1: replace ring layout", "Change 1: tune radii"])
        out["nodes"] = _table(
            "nodes", dim,
            {
                "id": ids,
                "session_id": sess_ids,
                "task_id": task_ids,
                "kind": pa.array(["attempt"] * m),
                "step": pa.array(self.step[a:b]),
                "status": pc.if_else(pa.array(self.has_children[a:b]), "expanded", "evaluated"),
                "summary": pc.take(summaries, pa.array(rng.choice(3, m, p=[0.8, 0.1, 0.1]))),
                "tokens_in": pa.array(tok_in, pa.int64()),
                "tokens_out": pa.array(tok_out, pa.int64()),
                "seconds": pa.array(llm_s + eval_t),
                "usd": pa.array(tok_in * 1.1e-6 + tok_out * 4.4e-6),
                "source": pa.array(["synthetic:openevolve-circle-packing"] * m),
                "embedding": self._embeddings(m, rng),
                "created_at": _ts(self.created_us[a:b]),
            },
            m,
        )
        # edges
        par = self.parent[a:b]
        has = par >= 0
        ne = int(has.sum())
        out["edges"] = _table(
            "edges", dim,
            {
                "src": pc.take(self.node_ids, pa.array(par[has])),
                "dst": pc.take(self.node_ids, pa.array(idx[has])),
                "kind": pa.array(["derived_from"] * ne),
                "session_id": pc.filter(sess_ids, pa.array(has)),
            },
            ne,
        )
        # rewards: one row per node x channel
        k = len(ch)
        rep = pa.array(np.repeat(np.arange(m), k))
        eval_us = (eval_t * 1e6).astype(np.int64)
        out["rewards"] = _table(
            "rewards", dim,
            {
                "node_id": pc.take(ids, rep),
                "channel": pc.take(pa.array(ch), pa.array(np.tile(np.arange(k), m))),
                "value": pa.array(self.metrics[a:b].ravel()),
                "verifier": pa.array(["evaluator.py"] * (m * k)),
                "verifier_version": pa.array(["1"] * (m * k)),
                "created_at": _ts(np.repeat(self.created_us[a:b] + eval_us, k)),
            },
            m * k,
        )
        # artifacts (content-addressed) and their links
        hashes, sizes_a, contents, media, links_node, links_name, links_hash = [], [], [], [], [], [], []
        for name in cfg.artifact_names:
            h, sz, c = self._contents(name, a, b, rng)
            hashes.append(h)
            sizes_a.append(sz)
            contents.append(c)
            media.append(pa.array([MEDIA_TYPES.get(name, "application/octet-stream")] * m))
            links_node.append(ids)
            links_name.append(pa.array([name] * m))
            links_hash.append(h)
        if cfg.shared_system_prompt:
            tsk = self.task_of_session[sess]
            # a task's system prompt is new in this chunk iff the chunk holds that task's first node
            first_node_of_task = np.arange(max(1, cfg.tasks)) * cfg.nodes_per_session
            new = [t for t in np.unique(tsk).tolist() if a <= first_node_of_task[t] < b]
            if new:
                hashes.append(pa.array([self.system_hashes[t] for t in new]))
                sizes_a.append(pa.array([len(self.system_prompts[t]) for t in new], pa.int64()))
                contents.append(pa.array([self.system_prompts[t] for t in new], pa.large_binary()))
                media.append(pa.array([MEDIA_TYPES["system_prompt"]] * len(new)))
            links_node.append(ids)
            links_name.append(pa.array(["system_prompt"] * m))
            links_hash.append(pc.take(pa.array(self.system_hashes), pa.array(tsk)))
        na = sum(len(h) for h in hashes)
        out["artifacts"] = _table(
            "artifacts", dim,
            {
                "hash": pa.chunked_array(hashes, pa.string()),
                "media_type": pa.chunked_array(media, pa.string()),
                "size": pa.chunked_array(sizes_a, pa.int64()),
                "content": pa.chunked_array(contents, pa.large_binary()),
            },
            na,
        )
        nl = sum(len(x) for x in links_node)
        out["node_artifacts"] = _table(
            "node_artifacts", dim,
            {
                "node_id": pa.chunked_array(links_node, pa.string()),
                "name": pa.chunked_array(links_name, pa.string()),
                "hash": pa.chunked_array(links_hash, pa.string()),
            },
            nl,
        )
        return {name: out[name] for name in ("tasks", "sessions", "nodes", "edges", "artifacts", "node_artifacts",
                                                "rewards") if name in out}

    def openevolve_programs(self, a: int, b: int, tables: dict[str, pa.Table]) -> list[dict[str, Any]]:
        """The same nodes as OpenEvolve program dicts (what it json.dumps, one file per program).

        Built from the chunk's tables (so the JSON holds the same bytes: code,
        prompts, response, metrics, embedding), plus OpenEvolve's own fields.
        """
        m = b - a
        ids = self.node_ids.slice(a, m).to_pylist()
        par = self.parent[a:b]
        all_ids = self.node_ids
        parent_ids = [None if p < 0 else all_ids[int(p)].as_py() for p in par.tolist()]
        content_of: dict[str, list[str]] = {}
        na = tables["node_artifacts"]
        art = tables["artifacts"]
        # in chunk() the per-role artifacts come first, m rows each, in node order
        for r, name in enumerate(self.config.artifact_names):
            content_of[name] = [c.decode() for c in art.column("content").slice(r * m, m).to_pylist()]
        assert na.num_rows >= m * len(self.config.artifact_names)
        ch = list(self.channels)
        metrics = self.metrics[a:b].tolist()
        pmetrics = [None if p < 0 else self.metrics[p].tolist() for p in par.tolist()]
        emb = tables["nodes"].column("embedding").combine_chunks().flatten().to_numpy().reshape(m, self.dim).tolist()
        summaries = tables["nodes"].column("summary").to_pylist()
        ts = (self.created_us[a:b] / 1e6).tolist()
        gen = self.generation[a:b].tolist()
        steps = self.step[a:b].tolist()
        island = self.island[a:b].tolist()
        sys_text = [self.system_prompts[t].decode() for t in range(len(self.system_prompts))]
        tsk = self.task_of_session[self.session_of[a:b]].tolist()
        empty = [""] * m
        progs = []
        for i in range(m):
            progs.append(
                {
                    "id": ids[i],
                    "code": content_of.get("code", empty)[i],
                    "language": "python",
                    "parent_id": parent_ids[i],
                    "generation": gen[i],
                    "timestamp": ts[i],
                    "iteration_found": steps[i],
                    "metrics": dict(zip(ch, metrics[i], strict=True)),
                    "complexity": 0.0,
                    "diversity": 0.0,
                    "metadata": {
                        "changes": summaries[i],
                        "parent_metrics": None if pmetrics[i] is None else dict(zip(ch, pmetrics[i], strict=True)),
                        "island": island[i],
                    },
                    "artifacts_json": None,
                    "artifact_dir": None,
                    "embedding": emb[i],
                    "prompts": {
                        "full_rewrite_user": {
                            "system": sys_text[tsk[i]],
                            "user": content_of.get("prompt", empty)[i],
                            "responses": [content_of.get("response", empty)[i]],
                        }
                    },
                }
            )
        return progs


def graph_stats(g: ExperienceGraph) -> dict[str, Any]:
    """Lineage statistics of a generated graph, comparable with :func:`calibrate`."""
    p = g.parent[g.parent >= 0]
    counts = np.bincount(p, minlength=g.n_nodes)
    counts = counts[counts > 0]
    return {
        "nodes": g.n_nodes,
        "mean_children_per_expanded_parent": float(counts.mean()) if len(counts) else 0.0,
        "max_children": int(counts.max()) if len(counts) else 0,
        "max_generation": int(g.generation.max()) if g.n_nodes else 0,
        "mean_code_bytes": float(g.sizes["code"].mean()) if "code" in g.sizes else None,
    }


if __name__ == "__main__":
    cal = calibrate()
    print(json.dumps(cal.summary(), indent=1, default=str))
    g = ExperienceGraph(GeneratorConfig(sessions=10), cal)
    print(json.dumps(graph_stats(g), indent=1))
