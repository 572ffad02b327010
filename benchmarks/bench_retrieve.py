"""Vector-seeded retrieval benchmarks, each figure a ratio against a baseline measured in the same run.

    .venv/bin/python benchmarks/bench_retrieve.py --smoke            # tiny sizes, CI
    .venv/bin/python benchmarks/bench_retrieve.py --nodes 100000
    .venv/bin/python benchmarks/bench_retrieve.py --nodes 1000000

1. ``RETRIEVE 10 SIMILAR TO $q EXPAND LINEAGE 2`` (top-10 + 2-hop expansion, through
   ``db.query``) p50/p95 vs bare ``lancedb`` ANN search of the same vectors
   (same index kind, partitions, nprobes and refine factor) without expansion
   (target <= 3x); recall@10 of both vs exact numpy search (target >= 0.95);
2. the do-it-yourself path: numpy brute force + networkx 2-hop expansion
   (graph build time reported on its own);
3. index build time (IVF_SQ over the built-in space) and per-step commit
   throughput while it builds vs before (the write slowdown).

Embeddings: the generator's clustered vectors (``embedding_clusters``), 384-d;
queries are stored vectors plus noise. Writes ``benchmarks/out/retrieve.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import lancedb  # noqa: E402
import networkx as nx  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
from generator import ExperienceGraph, GeneratorConfig  # noqa: E402
from lancedb.index import IvfSq  # noqa: E402

import trellisdb  # noqa: E402  (first: it quiets Lance's logging before lance loads)
from trellisdb import vectors  # noqa: E402
from trellisdb.writer import set_status  # noqa: E402

K = 10


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def timed(fns: list[Callable[[], Any]]) -> dict[str, float]:
    fns[0]()  # warm-up
    ts = []
    for fn in fns:
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1000)
    ts.sort()
    return {"p50_ms": statistics.median(ts), "p95_ms": ts[min(len(ts) - 1, int(0.95 * len(ts)))]}


def interleaved(named: dict[str, list[Callable[[], Any]]], rounds: int = 2) -> dict[str, dict[str, float]]:
    """p50/p95 of each named list of calls, the lists run round-robin (query i of every
    list, then query i + 1, ...) and ``rounds`` times, so the machine's drift hits all alike."""
    for fns in named.values():
        fns[0]()  # warm-up
    ts: dict[str, list[float]] = {k: [] for k in named}
    n = len(next(iter(named.values())))
    for _ in range(rounds):
        for i in range(n):
            for k, fns in named.items():
                t0 = time.perf_counter()
                fns[i]()
                ts[k].append((time.perf_counter() - t0) * 1000)
    out = {}
    for k, v in ts.items():
        v.sort()
        out[k] = {"p50_ms": statistics.median(v), "p95_ms": v[min(len(v) - 1, int(0.95 * len(v)))]}
    return out


def commit_rate(db: trellisdb.Database, seconds: float, stop: Callable[[], bool] = lambda: False) -> float:
    """Per-step commits per second (one node + one reward per commit) for ``seconds`` or until ``stop()``."""
    s = db.session(task="bench-writes", agent="w")
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds and not (n and stop()):
        with db.transaction():
            node = s.add_node(summary=f"step {n}")
            s.add_reward(node, "score", 0.5)
        n += 1
    return n / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--work", default="/tmp/trellis-bench-retrieve")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (to profile against)")
    args = ap.parse_args(argv)
    nodes, queries = (3000, 10) if args.smoke else (args.nodes, args.queries)
    if args.smoke:
        vectors.INDEX_MIN_ROWS = 1000  # exercise the indexed path at smoke size
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    dim = args.dim
    g = ExperienceGraph(GeneratorConfig.for_nodes(nodes, embedding_dim=dim, embedding_clusters=max(10, nodes // 1000),
                                                  artifact_names=(), shared_system_prompt=False))
    db = trellisdb.connect(os.path.join(args.work, "r.db"), embedding_dim=dim, auto_index=False)
    log(f"building {g.n_nodes} nodes x {dim}-d")
    ids: list[pa.Array] = []
    mats: list[np.ndarray] = []
    edges: list[pa.Table] = []
    for a, b in g.chunk_bounds(50_000):
        t = {k: v for k, v in g.chunk(a, b).items() if k not in ("artifacts", "node_artifacts")}
        db.ingest(t, message=f"nodes {a}..")
        ids.append(t["nodes"]["id"].combine_chunks())
        mats.append(t["nodes"]["embedding"].combine_chunks().flatten().to_numpy().reshape(-1, dim))
        edges.append(t["edges"].select(["src", "dst", "kind"]))
    # status changes re-write 10% of the node rows (their vectors too): superseded versions, as in a live store
    sample = ids[0].to_pylist()[:: 10] if len(ids) == 1 else pa.concat_arrays(ids).to_pylist()[::10]
    with db.transaction(message="statuses"):
        set_status(db._committer, sample, "expanded")  # internal: one statement for 10% of the nodes
    db.compact()
    all_ids = pa.concat_arrays(ids)
    x = np.concatenate(mats)
    id_list = all_ids.to_pylist()
    n = len(id_list)

    # -- 3. index build and the writes meanwhile
    base_rate = commit_rate(db, 3.0 if not args.smoke else 0.5)
    sp = db._reads.space("embedding", "nodes")
    t0 = time.perf_counter()
    db._vectors.indexer.poke(sp, force="create")
    during = commit_rate(db, 3600, stop=lambda: db._vectors.indexer.wait(0))
    db._vectors.indexer.wait()
    build_s = time.perf_counter() - t0
    st = db.index_status()[0]
    log(f"index built in {build_s:.1f} s ({st}); commits/s {base_rate:.1f} before, {during:.1f} during")
    assert st["state"] == "indexed", st
    parts = vectors.partitions_for(n)
    nprobes = vectors.nprobes_for(parts)

    rng = np.random.default_rng(1)
    qs = [x[i] + 0.15 * rng.standard_normal(dim).astype(np.float32) for i in rng.integers(0, n, queries)]
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)

    def exact(q: np.ndarray) -> list[str]:
        sims = xn @ (q / np.linalg.norm(q))
        top = np.argpartition(-sims, K)[:K]
        return [id_list[i] for i in top[np.argsort(-sims[top])]]

    truth = [set(exact(q)) for q in qs]

    # -- 1. ours vs bare lancedb
    def ours(q: np.ndarray, expand: str = " EXPAND LINEAGE 2") -> trellisdb.QueryResult:
        return db.query(f"RETRIEVE {K} SIMILAR TO $q{expand}", q=q)

    got = [ours(q) for q in qs]
    recall_ours = statistics.mean(len({r["id"] for r in res.to_pylist() if r["relation"] == "seed"} & t) / K
                                  for res, t in zip(got, truth, strict=True))
    expanded_rows = statistics.mean(len(r) for r in got)

    ldb = lancedb.connect(os.path.join(args.work, "bare"))
    tbl = ldb.create_table("v", data=pa.table({"id": all_ids, "vector": pa.FixedSizeListArray.from_arrays(
        pa.array(x.ravel()), dim)}))
    t0 = time.perf_counter()
    tbl.create_index("vector", config=IvfSq(distance_type="cosine", num_partitions=parts))
    bare_build = time.perf_counter() - t0

    def bare(q: np.ndarray) -> pa.Table:
        s = tbl.search(q).distance_type("cosine").limit(K).nprobes(nprobes).refine_factor(vectors.REFINE_FACTOR)
        return s.select(["id", "_distance"]).to_arrow()

    recall_bare = statistics.mean(len(set(bare(q)["id"].to_pylist()) & t) / K for q, t in zip(qs, truth, strict=True))
    lat = interleaved({
        "ours": [lambda q=q: ours(q) for q in qs],
        "seeds": [lambda q=q: ours(q, "") for q in qs],
        "bare": [lambda q=q: bare(q) for q in qs],
    })
    ours_t, seeds_t, bare_t = lat["ours"], lat["seeds"], lat["bare"]

    # -- 2. numpy + networkx
    e = pa.concat_tables(edges)
    e = e.filter(pa.compute.is_in(e["kind"], pa.array(["derived_from", "repair_of", "crossover_of"])))
    t0 = time.perf_counter()
    G = nx.DiGraph()
    G.add_edges_from(zip(e["src"].to_pylist(), e["dst"].to_pylist(), strict=True))
    nx_build = time.perf_counter() - t0
    R = G.reverse(copy=False)

    def diy(q: np.ndarray) -> set[str]:
        out: set[str] = set()
        for s in exact(q):
            out.add(s)
            if s in G:
                out |= set(nx.single_source_shortest_path_length(R, s, cutoff=2))
                out |= set(nx.single_source_shortest_path_length(G, s, cutoff=2))
        return out

    diy_t = timed([lambda q=q: diy(q) for q in qs])
    same = statistics.mean(len(diy(q) & {r["id"] for r in res.to_pylist()}) / max(1, len(diy(q)))
                           for q, res in zip(qs[:5], got[:5], strict=True))
    np_t = timed([lambda q=q: exact(q) for q in qs])

    out = {
        "nodes": n, "dim": dim, "queries": queries, "partitions": parts, "nprobes": nprobes,
        "retrieve_expand": ours_t, "retrieve_seeds_only": seeds_t, "bare_lancedb": bare_t,
        "ratio_vs_bare_p50": ours_t["p50_ms"] / bare_t["p50_ms"], "ratio_vs_bare_p95": ours_t["p95_ms"] / bare_t["p95_ms"],
        "seeds_only_ratio_vs_bare_p50": seeds_t["p50_ms"] / bare_t["p50_ms"],
        "recall_at_10": recall_ours, "recall_at_10_bare": recall_bare, "rows_per_result": expanded_rows,
        "diy_numpy_networkx": diy_t, "numpy_exact_only": np_t, "networkx_build_s": nx_build,
        "ratio_vs_diy_p50": ours_t["p50_ms"] / diy_t["p50_ms"], "diy_overlap": same,
        "index_build_s": build_s, "bare_lancedb_index_build_s": bare_build,
        "commits_per_s_before": base_rate, "commits_per_s_during_build": during,
        "write_slowdown_during_build": during / base_rate if base_rate else None,
    }
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    name = "retrieve_smoke.json" if args.smoke else f"retrieve_{n}.json"
    with open(os.path.join(HERE, "out", name), "w") as fh:
        json.dump(out, fh, indent=1)
    for k, v in out.items():
        print(f"{k:34} {v}")
    db.close()
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    if recall_ours < 0.9:
        print("recall below 0.9", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
