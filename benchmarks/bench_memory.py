"""Peak memory of a reader session on a large store, against the same work done on DuckDB tables in memory.

    .venv/bin/python benchmarks/bench_memory.py --smoke            # tiny, CI
    .venv/bin/python benchmarks/bench_memory.py --nodes 1000000    # issue 23's size

The store comes from the calibrated generator (benchmarks/generator.py) with
small ``prompt`` / ``response`` artifacts and 16-d embeddings (the vector
index is built; its size does not depend on what the session does). Each side
runs in a fresh child process, so its peak resident memory (``VmHWM``) is its
own:

- **trellisdb**, with the defaults a user gets from ``trellisdb.connect(path)``:
  a frontier (top 10), the whole lineage of a deep node twice (the second walk
  goes to the in-memory adjacency), ``RETRIEVE 10 SIMILAR TO $v EXPAND
  LINEAGE 2``, then 1% new nodes ingested and a preference view refreshed;
- **the baseline**, what an analyst would do without us: DuckDB with the same
  narrow rows (nodes, edges, rewards; as Parquet written next to the store)
  loaded into in-memory tables, the same frontier and lineage as hand SQL.

Target (issue 23): trellisdb's peak <= 2 GiB at 1M nodes. The ratio to the
baseline is reported. Writes ``benchmarks/out/memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from generator import ExperienceGraph, GeneratorConfig, as_stored  # noqa: E402

import trellisdb  # noqa: E402

CH = "combined_score"
DIM = 16
KINDS = "('derived_from', 'repair_of', 'crossover_of')"
FRONTIER_TQL = f"FRONTIER RANK BY reward('{CH}') DESC LIMIT 10 RETURN id"
FRONTIER_SQL = f"""
    SELECT n.id FROM nodes n LEFT JOIN rewards r ON r.node_id = n.id AND r.channel = '{CH}'
    WHERE n.id NOT IN (SELECT src FROM edges WHERE kind IN {KINDS})
      AND n.status NOT IN ('expanded', 'closed', 'failed', 'pruned')
    ORDER BY r.value DESC NULLS LAST, n.seq, n.id LIMIT 10"""
LINEAGE_SQL = f"""
    WITH RECURSIVE w(id, hop) AS (
      SELECT $n, 0 UNION
      SELECT e.src, w.hop + 1 FROM w JOIN edges e ON e.dst = w.id WHERE e.kind IN {KINDS} AND w.hop < 10000)
    SELECT id, min(hop) AS hop FROM w GROUP BY id"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child_trellis(work: str, deep: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    db = trellisdb.connect(os.path.join(work, "m.db"))
    steps: dict[str, float] = {}
    assert db.query(FRONTIER_TQL).to_pylist()
    steps["frontier"] = peak_rss_mb()
    for _ in range(2):
        assert db.query("LINEAGE OF $n ANCESTORS RETURN id, hop", n=deep).to_pylist()
    steps["lineage"] = peak_rss_mb()
    v = np.random.default_rng(1).standard_normal(DIM).astype(np.float32)
    assert len(db.query("RETRIEVE 10 SIMILAR TO $v EXPAND LINEAGE 2", v=v).to_pylist()) >= 10
    steps["retrieve"] = peak_rss_mb()
    later = {f[len("later-"):-len(".parquet")]: pq.read_table(os.path.join(work, f))
             for f in os.listdir(work) if f.startswith("later-")}
    db.ingest(later, message="1% later")
    steps["ingest"] = peak_rss_mb()
    db.refresh("pairs")
    steps["refresh"] = peak_rss_mb()
    db.close()
    return {"peak_rss_mb": peak_rss_mb(), "after": steps, "seconds": time.perf_counter() - t0}


def child_duckdb(work: str, deep: str) -> dict[str, Any]:
    import duckdb

    t0 = time.perf_counter()
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    for t in ("nodes", "edges", "rewards"):
        con.execute(f"CREATE TABLE {t} AS SELECT * FROM read_parquet('{os.path.join(work, t + '.parquet')}')")
    assert con.execute(FRONTIER_SQL).fetchall()
    for _ in range(2):
        assert con.execute(LINEAGE_SQL, {"n": deep}).fetchall()
    con.close()
    return {"peak_rss_mb": peak_rss_mb(), "seconds": time.perf_counter() - t0}


def run_child(side: str, work: str, deep: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", side, "--work", work, "--deep", deep],
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"the {side} child failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def build(work: str, nodes: int) -> str:
    """The store (with a materialized preference view), the Parquet copies and the later 1%; a deep node's id."""
    cfg = GeneratorConfig.for_nodes(nodes, embedding_dim=DIM, artifact_names=("prompt", "response"),
                                    artifact_bytes=64, tasks=10)
    g = ExperienceGraph(cfg)
    first = max(cfg.nodes_per_session, (g.n_nodes * 99 // 100) // cfg.nodes_per_session * cfg.nodes_per_session)
    db = trellisdb.connect(os.path.join(work, "m.db"), embedding_dim=DIM)
    writers: dict[str, pq.ParquetWriter] = {}
    for a, b in g.chunk_bounds(50_000):
        b = min(b, first)
        if a >= first:
            break
        t = g.chunk(a, b)
        cid = db.ingest(t, message=f"nodes {a}..")
        for name in ("nodes", "edges", "rewards"):
            tab = as_stored(name, t[name], cid)
            if name not in writers:
                writers[name] = pq.ParquetWriter(os.path.join(work, f"{name}.parquet"), tab.schema)
            writers[name].write_table(tab)
    for w in writers.values():
        w.close()
    # the later 1% (whole sessions), ingested by the child before its refresh
    for name, tab in g.chunk(first, g.n_nodes).items():
        pq.write_table(tab, os.path.join(work, f"later-{name}.parquet"))
    db.create_view("pairs", "preference", reward=f"reward('{CH}')", margin=0.05, pairs_from=["siblings"])
    db.materialize("pairs")
    db.build_index()
    db.compact()
    sess = db.sql("SELECT id FROM sessions ORDER BY id LIMIT 1").to_pylist()[0]["id"]
    deep: str = db.sql("SELECT id FROM nodes WHERE session_id = $1 ORDER BY step DESC LIMIT 1",
                       params=[sess]).to_pylist()[0]["id"]
    db.close()
    return deep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=1_000_000)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--work", default=os.path.join(HERE, "out", "work-memory"))
    ap.add_argument("--out", default=os.path.join(HERE, "out", "memory.json"))
    ap.add_argument("--keep", action="store_true", help="keep the work folder (the store) afterwards")
    ap.add_argument("--child", choices=("trellis", "duckdb"), help=argparse.SUPPRESS)
    ap.add_argument("--deep", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        fn = child_trellis if args.child == "trellis" else child_duckdb
        print(json.dumps(fn(args.work, args.deep)))
        return 0
    nodes = 5000 if args.smoke else args.nodes
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    log(f"building a store of ~{nodes} nodes with a materialized view and a vector index")
    t0 = time.perf_counter()
    deep = build(args.work, nodes)
    res: dict[str, Any] = {"nodes": nodes, "build_seconds": time.perf_counter() - t0}
    log("trellisdb: open, frontier, lineage x2, retrieve, ingest 1% + refresh, in a fresh process")
    res["trellisdb"] = run_child("trellis", args.work, deep)
    log("DuckDB in-memory tables: load, frontier, lineage x2, in a fresh process")
    res["duckdb_in_memory"] = run_child("duckdb", args.work, deep)
    mine, base = res["trellisdb"]["peak_rss_mb"], res["duckdb_in_memory"]["peak_rss_mb"]
    res["ratio"] = mine / base
    log(f"peak RSS: trellisdb {mine:,.0f} MB (after each step: "
        + ", ".join(f"{k} {v:,.0f}" for k, v in res["trellisdb"]["after"].items())
        + f"); DuckDB in-memory tables {base:,.0f} MB; ratio {res['ratio']:.2f}x; target <= 2,048 MB at 1M")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=2)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
