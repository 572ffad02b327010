"""Storage benchmark: each figure is a ratio against a baseline measured in the same run.

    .venv/bin/python benchmarks/storage_ratios.py --smoke        # CI size, < 1 minute
    .venv/bin/python benchmarks/storage_ratios.py --nodes 100000 # by hand

1. batched ingest via ``db.ingest`` vs bare lancedb ``add()`` of the same Arrow
   tables (target >= 0.8x), and vs one JSON file per node (OpenEvolve's status quo);
2. per-step commits (transaction per step) from 1 and 4 processes: commits/s,
   p50/p99, vs one bare lancedb add() per step;
3. full scan after many small commits with auto-compaction vs after a manual
   compaction (target <= 1.5x), and with auto-compaction off;
4. bytes on disk per node vs the same tables as Parquet files.

Synthetic data is calibrated on ../shared/data/openevolve-circle-packing
(mean 1.58 children per expanded parent, 5 metric channels, ~5.7 KB code).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import trellisdb
import trellisdb.bulk

CHANNELS = ("validity", "sum_radii", "target_ratio", "combined_score", "eval_time")


def generate(n_nodes: int, sessions: int, dim: int, code_bytes: int, seed: int = 0) -> dict[str, pa.Table]:
    """Sessions of evolving programs: each node's parent is an earlier node of its session,
    chosen so that expanded parents have ~1.6 children (as in the circle-packing run)."""
    rng = np.random.default_rng(seed)
    per = n_nodes // sessions
    ids = np.array([f"n{i:09d}" for i in range(per * sessions)])
    sess = np.repeat(np.array([f"s{i:05d}" for i in range(sessions)]), per)
    local = np.tile(np.arange(per), sessions)
    # parent: a recent node of the same session (geometric look-back => branching ~1.6)
    back = np.minimum(rng.geometric(0.62, size=len(ids)), np.maximum(local, 1))
    parent_idx = np.arange(len(ids)) - back
    has_parent = local > 0
    emb = rng.standard_normal((len(ids), dim)).astype(np.float32)
    base = rng.bytes(code_bytes)
    contents = [base[: code_bytes - 16] + i.to_bytes(16, "little") for i in range(len(ids))]
    hashes = [hashlib.sha256(c).hexdigest() for c in contents]
    nodes = pa.table({
        "id": ids, "session_id": sess, "task_id": np.full(len(ids), "circle-packing"),
        "kind": np.full(len(ids), "attempt"), "step": local, "status": np.full(len(ids), "evaluated"),
        "summary": np.char.add("mutation ", local.astype(str)),
        "tokens_in": rng.integers(500, 4000, len(ids)), "tokens_out": rng.integers(200, 2000, len(ids)),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(emb.ravel()), dim),
    })
    edges = pa.table({"src": ids[parent_idx[has_parent]], "dst": ids[has_parent],
                      "kind": np.full(int(has_parent.sum()), "derived_from")})
    rewards = pa.table({
        "node_id": np.repeat(ids, len(CHANNELS)), "channel": np.tile(np.array(CHANNELS), len(ids)),
        "value": rng.random(len(ids) * len(CHANNELS)), "verifier": np.full(len(ids) * len(CHANNELS), "evaluator.py"),
    })
    artifacts = pa.table({"hash": hashes, "media_type": np.full(len(ids), "text/x-python"),
                          "size": np.full(len(ids), code_bytes),
                          "content": pa.array(contents, pa.large_binary())})
    links = pa.table({"node_id": ids, "name": np.full(len(ids), "code"), "hash": hashes})
    sessions_t = pa.table({"id": np.unique(sess), "task_id": np.full(sessions, "circle-packing"),
                           "agent": np.full(sessions, "openevolve")})
    return {"sessions": sessions_t, "nodes": nodes, "edges": edges, "rewards": rewards,
            "artifacts": artifacts, "node_artifacts": links}


def _chunks(data: dict[str, pa.Table], n_chunks: int) -> list[dict[str, pa.Table]]:
    """Split by node so every chunk's edges/rewards refer to nodes already written."""
    nodes = data["nodes"]
    size = -(-nodes.num_rows // n_chunks)
    out = []
    import pyarrow.compute as pc

    for k in range(n_chunks):
        chunk_ids = nodes.column("id").slice(k * size, size)
        part: dict[str, pa.Table] = {"sessions": data["sessions"]} if k == 0 else {}
        part["nodes"] = nodes.slice(k * size, size)
        for name, col in (("edges", "dst"), ("rewards", "node_id"), ("node_artifacts", "node_id")):
            part[name] = data[name].filter(pc.is_in(data[name].column(col), chunk_ids))
        hashes = part["node_artifacts"].column("hash")
        part["artifacts"] = data["artifacts"].filter(pc.is_in(data["artifacts"].column("hash"), hashes))
        out.append(part)
    return out


def bench_ingest(work: Path, data: dict[str, pa.Table], dim: int, n_chunks: int) -> dict[str, float]:
    import lancedb

    chunks = _chunks(data, n_chunks)
    t0 = time.perf_counter()
    db = trellisdb.connect(work / "ingest.db", embedding_dim=dim)
    for ch in chunks:
        db.ingest(ch)
    t_trellis = time.perf_counter() - t0
    conformed = [{n: trellisdb.bulk.conform(n, t, dim) for n, t in ch.items()} for ch in chunks]
    t0 = time.perf_counter()
    ldb = lancedb.connect(str(work / "bare.lancedb"))
    tables: dict[str, object] = {}
    for ch in conformed:
        for name, t in ch.items():
            if name not in tables:
                tables[name] = ldb.create_table(name, t)
            else:
                tables[name].add(t)  # type: ignore[attr-defined]
    t_lance = time.perf_counter() - t0
    # status quo: one JSON file per node, as OpenEvolve writes its programs
    nodes = data["nodes"].to_pylist()
    codes = data["artifacts"].column("content").to_pylist()
    t0 = time.perf_counter()
    jdir = work / "json"
    jdir.mkdir()
    for node, code in zip(nodes, codes, strict=True):
        rec = {"id": node["id"], "code": code.decode("latin-1"), "parent_id": None,
               "metrics": dict.fromkeys(CHANNELS, 0.5), "generation": node["step"]}
        with open(jdir / f"{node['id']}.json", "w") as fh:
            json.dump(rec, fh)
    t_json = time.perf_counter() - t0
    n = data["nodes"].num_rows
    return {"nodes": n, "trellis_nodes_per_s": n / t_trellis, "lancedb_nodes_per_s": n / t_lance,
            "json_nodes_per_s": n / t_json, "ratio_vs_lancedb": t_lance / t_trellis,
            "ratio_vs_json": t_json / t_trellis}


def _commit_worker(path: str, tag: str, steps: int, q: mp.Queue) -> None:  # type: ignore[type-arg]
    db = trellisdb.connect(path)
    with db.transaction():
        s = db.session(task="bench", agent=tag)
    lat = []
    prev = None
    for i in range(steps):
        t0 = time.perf_counter()
        with db.transaction():
            prev = s.add_node(parents=[prev] if prev else [], summary=f"{tag} {i}")
            s.add_reward(prev, "score", float(i))
        lat.append(time.perf_counter() - t0)
    q.put(lat)


def bench_commits(work: Path, steps: int, dim: int) -> dict[str, float]:
    import lancedb

    out: dict[str, float] = {}
    ctx = mp.get_context("spawn")
    for procs in (1, 4):
        path = str(work / f"commits{procs}.db")
        trellisdb.connect(path, embedding_dim=dim).close()
        q = ctx.Queue()
        t0 = time.perf_counter()
        ps = [ctx.Process(target=_commit_worker, args=(path, f"w{i}", steps, q)) for i in range(procs)]
        for p in ps:
            p.start()
        lats = [x for _ in ps for x in q.get()]
        for p in ps:
            p.join()
        wall = time.perf_counter() - t0
        lat = np.array(lats) * 1000
        out[f"p{procs}_commits_per_s"] = len(lats) / wall
        out[f"p{procs}_p50_ms"] = float(np.percentile(lat, 50))
        out[f"p{procs}_p99_ms"] = float(np.percentile(lat, 99))
        out[f"p{procs}_per_process_commits_per_s"] = 1000 / float(lat.mean())
    ldb = lancedb.connect(str(work / "bare_commits.lancedb"))
    row = pa.table({"id": ["x"], "value": [1.0]})
    tbl = ldb.create_table("t", row)
    lat = []
    for _ in range(steps):
        t0 = time.perf_counter()
        tbl.add(row)
        lat.append(time.perf_counter() - t0)
    out["lancedb_add_per_s"] = 1 / float(np.mean(lat))
    out["ratio_1proc_vs_lancedb_add"] = out["p1_per_process_commits_per_s"] / out["lancedb_add_per_s"]
    return out


def bench_scan(work: Path, commits: int) -> dict[str, float]:
    def fill(path: Path, auto: bool) -> trellisdb.Database:
        db = trellisdb.connect(path, embedding_dim=4, auto_compact=auto)
        s = db.session(task="scan", agent="a")
        prev = None
        for i in range(commits):
            with db.transaction():
                prev = s.add_node(parents=[prev] if prev else [], summary=str(i))
                s.add_reward(prev, "score", float(i))
        return db

    def scan(db: trellisdb.Database) -> float:
        q = "SELECT count(*), sum(value) FROM rewards_history"
        db.sql(q)
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            db.sql(q)
            best = min(best, time.perf_counter() - t0)
        return best

    auto = fill(work / "scan_auto.db", True)
    t_auto = scan(auto)
    off = fill(work / "scan_off.db", False)
    t_off = scan(off)
    auto.compact(prune_older_than=dt.timedelta(0))
    t_compacted = scan(auto)
    return {"commits": commits, "scan_auto_ms": t_auto * 1000, "scan_no_compaction_ms": t_off * 1000,
            "scan_compacted_ms": t_compacted * 1000, "ratio_auto_vs_compacted": t_auto / t_compacted,
            "ratio_off_vs_compacted": t_off / t_compacted}


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def bench_bytes(work: Path, data: dict[str, pa.Table]) -> dict[str, float]:
    db = trellisdb.connect(work / "ingest.db")
    db.compact(prune_older_than=dt.timedelta(0))
    pdir = work / "parquet"
    pdir.mkdir()
    for name, t in data.items():
        pq.write_table(t, pdir / f"{name}.parquet")
    n = data["nodes"].num_rows
    b_trellis, b_parquet = _du(work / "ingest.db"), _du(pdir)
    return {"trellis_bytes_per_node": b_trellis / n, "parquet_bytes_per_node": b_parquet / n,
            "ratio_vs_parquet": b_trellis / b_parquet}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--code-bytes", type=int, default=5700)
    ap.add_argument("--commits", type=int, default=10_000, help="small commits for the scan figure")
    ap.add_argument("--steps", type=int, default=200, help="per-step commits per writer process")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes for CI")
    ap.add_argument("--out", default="benchmarks/out/storage.json")
    a = ap.parse_args()
    if a.smoke:
        a.nodes, a.sessions, a.dim, a.commits, a.steps = 2000, 10, 32, 300, 30
    work = Path(tempfile.mkdtemp(prefix="trellis-bench-"))
    try:
        data = generate(a.nodes, a.sessions, a.dim, a.code_bytes)
        res = {
            "ingest": bench_ingest(work, data, a.dim, n_chunks=max(1, a.nodes // 10_000)),
            "commits": bench_commits(work, a.steps, a.dim),
            "scan": bench_scan(work, a.commits),
            "bytes": bench_bytes(work, data),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for section, figs in res.items():
        print(f"[{section}]")
        for k, v in figs.items():
            print(f"  {k:34s} {v:12.3f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"args": vars(a), "results": res}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
