"""Storage benchmarks of trellisdb, each reported as a ratio against a baseline measured in the same run.

    .venv/bin/python benchmarks/bench_storage.py --smoke          # tiny sizes, < 60 s
    .venv/bin/python benchmarks/bench_storage.py --nodes 100000   # the full run

a. batched ingest: ``db.ingest`` in chunks vs bare ``lancedb`` (create_table + add per chunk) and vs
   OpenEvolve's status quo (one ``json.dump`` file per program);
b. per-step commits (``with db.transaction(): add_node + add_reward``) from 1 and 4 writer processes
   vs a bare lancedb ``add()`` of one row per step (and of the same rows, table by table);
c. full scans after many small commits, auto_compact on / off, vs the same data after ``db.compact()``;
d. bytes on disk per node after ``db.compact()`` vs the same tables as Parquet files.

Prints a table and writes ``benchmarks/out/storage.json``. See ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from generator import ExperienceGraph, GeneratorConfig, calibrate, graph_stats  # noqa: E402

TASK = "circle-packing-26"


# --------------------------------------------------------------------------- helpers
def du(path: str) -> dict[str, int]:
    """Disk usage of a folder: allocated bytes (like ``du``) and apparent bytes, and the file count."""
    disk = apparent = files = 0
    for root, _dirs, names in os.walk(path):
        for n in names:
            try:
                st = os.lstat(os.path.join(root, n))
            except FileNotFoundError:
                continue
            disk += st.st_blocks * 512
            apparent += st.st_size
            files += 1
    return {"disk_bytes": disk, "apparent_bytes": apparent, "files": files}


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def growth(lat: list[float]) -> dict[str, float]:
    """p50 latency (ms) of the first and the last tenth of a run: does a commit get slower as commits pile up?"""
    k = max(1, len(lat) // 10)
    return {
        "first_tenth_p50_ms": pct(lat[:k], 50) * 1e3,
        "last_tenth_p50_ms": pct(lat[-k:], 50) * 1e3,
        "first_tenth_mean_ms": float(np.mean(lat[:k])) * 1e3,
        "last_tenth_mean_ms": float(np.mean(lat[-k:])) * 1e3,
    }


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM; unlike ru_maxrss it is not inherited across exec)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sync() -> None:
    """Flush dirty pages between phases (untimed) so one phase's writeback does not slow the next."""
    if hasattr(os, "sync"):
        os.sync()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def fragments(db: Any, name: str) -> int | None:
    try:
        return int(db._store.tables.fragment_count(name))  # internal, for reporting only
    except Exception:
        return None


# --------------------------------------------------------------------------- a + d: batched ingest, bytes on disk
def run_sink(g: ExperienceGraph, chunk: int, open_fn: Any, write_fn: Any, close_fn: Any, prep_fn: Any = None) -> dict:
    """Generate each chunk (untimed), then time ``write_fn`` on it; open/close are timed too."""
    gen_s = prep_s = 0.0
    t0 = time.perf_counter()
    state = open_fn()
    write_s = time.perf_counter() - t0
    logical = 0
    for a, b in g.chunk_bounds(chunk):
        t0 = time.perf_counter()
        tables = g.chunk(a, b)
        gen_s += time.perf_counter() - t0
        logical += sum(t.nbytes for t in tables.values())
        payload = tables
        if prep_fn is not None:
            t0 = time.perf_counter()
            payload = prep_fn(a, b, tables)
            prep_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        write_fn(state, a, payload)
        write_s += time.perf_counter() - t0
        del tables, payload
    t0 = time.perf_counter()
    close_fn(state)
    write_s += time.perf_counter() - t0
    return {"seconds": write_s, "gen_seconds": gen_s, "prep_seconds": prep_s, "logical_bytes": logical}


def bench_ingest(g: ExperienceGraph, chunk: int, work: str) -> dict[str, Any]:
    import lancedb

    import trellisdb

    N = g.n_nodes
    res: dict[str, Any] = {"nodes": N, "chunk_nodes": chunk, "chunks": len(g.chunk_bounds(chunk))}

    def trellis_stats(tpath: str) -> dict[str, Any]:
        r: dict[str, Any] = {}
        db = trellisdb.connect(tpath)
        counts = db.sql(
            "SELECT (SELECT count(*) FROM nodes) AS nodes, (SELECT count(*) FROM edges) AS edges, "
            "(SELECT count(*) FROM rewards) AS rewards, (SELECT count(*) FROM artifacts) AS artifacts, "
            "(SELECT count(*) FROM node_artifacts) AS node_artifacts"
        ).to_pylist()[0]
        r["counts"] = counts
        if counts["nodes"] != N:
            raise SystemExit(f"trellisdb holds {counts['nodes']} nodes after ingest, expected {N}")
        r["fragments_before_compact"] = {n: fragments(db, n) for n in ("nodes", "artifacts", "rewards")}
        r["du_before_compact"] = du(tpath)
        t0 = time.perf_counter()
        db.compact(prune_older_than=dt.timedelta(0))
        r["compact_seconds"] = time.perf_counter() - t0
        r["fragments_after_compact"] = {n: fragments(db, n) for n in ("nodes", "artifacts", "rewards")}
        r["du"] = du(tpath)
        r["du_per_table"] = {
            n: du(os.path.join(tpath, "tables", f"{n}.lance"))["disk_bytes"]
            for n in ("sessions", "nodes", "edges", "artifacts", "node_artifacts", "rewards")
        }
        db.close()
        return r

    # -- bare lancedb: create_table on the first chunk, add() after
    def l_write(state: dict, a: int, tables: dict[str, pa.Table]) -> None:
        con, opened = state["con"], state["tables"]
        for name, t in tables.items():
            if not t.num_rows:
                continue
            if name in opened:
                opened[name].add(t)
            else:
                opened[name] = con.create_table(name, data=t)

    # Interleaved chunk by chunk, alternating which sink goes first: on these
    # machines page cache and disk writeback make whichever sink runs first or
    # second look faster, by up to 2x, when each runs as a whole; writing the
    # same chunk to both back to back is fair to both.
    tpath, lpath = os.path.join(work, "trellis.db"), os.path.join(work, "lancedb")
    sync()
    log(f"a. trellisdb ingest vs bare lancedb create_table/add, {N} nodes in chunks of {chunk}, interleaved")
    t0 = time.perf_counter()
    tdb = trellisdb.connect(tpath, embedding_dim=g.dim)
    lstate: dict[str, Any] = {"con": lancedb.connect(lpath), "tables": {}}
    secs = {"trellis": time.perf_counter() - t0, "lancedb": 0.0}
    logical = 0
    for i, (a, b) in enumerate(g.chunk_bounds(chunk)):
        tables = g.chunk(a, b)
        logical += sum(t.nbytes for t in tables.values())
        order = ("trellis", "lancedb") if i % 2 == 0 else ("lancedb", "trellis")
        for sink in order:
            t0 = time.perf_counter()
            if sink == "trellis":
                tdb.ingest(tables, message=f"ingest nodes {a}..")
            else:
                l_write(lstate, a, tables)
            secs[sink] += time.perf_counter() - t0
    t0 = time.perf_counter()
    tdb.close()
    secs["trellis"] += time.perf_counter() - t0
    res["trellis"] = {"seconds": secs["trellis"], "logical_bytes": logical, **trellis_stats(tpath)}
    res["lancedb"] = {"seconds": secs["lancedb"], "logical_bytes": logical, "du": du(lpath)}
    shutil.rmtree(tpath)
    shutil.rmtree(lpath)

    # -- OpenEvolve status quo: one JSON file per program
    jpath = os.path.join(work, "programs")
    sync()
    log("a. one JSON file per program (OpenEvolve's checkpoint format)")

    def j_write(state: None, a: int, progs: list[dict[str, Any]]) -> None:
        for p in progs:
            with open(os.path.join(jpath, f"{p['id']}.json"), "w") as fh:
                json.dump(p, fh)

    res["json"] = run_sink(
        g, chunk, lambda: os.makedirs(jpath, exist_ok=True), j_write, lambda s: None, prep_fn=g.openevolve_programs
    )
    res["json"]["du"] = du(jpath)
    shutil.rmtree(jpath)

    # -- the same tables as Parquet files (one file per table, streamed row group per chunk)
    ppath = os.path.join(work, "parquet")
    sync()
    log("d. the same tables as Parquet files")

    def p_write(writers: dict, a: int, tables: dict[str, pa.Table]) -> None:
        for name, t in tables.items():
            if name not in writers:
                writers[name] = pq.ParquetWriter(os.path.join(ppath, f"{name}.parquet"), t.schema)
            writers[name].write_table(t)

    def p_open() -> dict:
        os.makedirs(ppath, exist_ok=True)
        return {}

    res["parquet"] = run_sink(g, chunk, p_open, p_write, lambda w: [x.close() for x in w.values()])
    res["parquet"]["du"] = du(ppath)
    res["parquet"]["du_per_table"] = {
        f[: -len(".parquet")]: os.lstat(os.path.join(ppath, f)).st_blocks * 512 for f in sorted(os.listdir(ppath))
    }
    shutil.rmtree(ppath)

    for k in ("trellis", "lancedb", "json", "parquet"):
        res[k]["nodes_per_s"] = N / res[k]["seconds"]
        res[k]["mb_per_s"] = res[k]["logical_bytes"] / 1e6 / res[k]["seconds"]
        res[k]["disk_bytes_per_node"] = res[k]["du"]["disk_bytes"] / N
        res[k]["apparent_bytes_per_node"] = res[k]["du"]["apparent_bytes"] / N
    res["logical_bytes_per_node"] = res["trellis"]["logical_bytes"] / N
    return res


# --------------------------------------------------------------------------- b: per-step commits
def step_payload(g: ExperienceGraph, steps: int, offset: int) -> dict[str, Any]:
    """Per-step inputs for one writer: code text, embedding and metrics of ``steps`` generated nodes."""
    a = offset % max(1, g.n_nodes - steps)
    b = a + steps
    t = g.chunk(a, b)
    code = [c.decode() for c in t["artifacts"].column("content").slice(0, steps).to_pylist()]
    emb = t["nodes"].column("embedding").combine_chunks().flatten().to_numpy().reshape(steps, g.dim)
    return {"code": code, "emb": emb, "metrics": g.metrics[a:b].copy(), "channels": list(g.channels)}


def _step_worker(kind: str, path: str, tag: str, payload: dict, ready_q: Any, go: Any, result_q: Any) -> None:
    try:
        result_q.put(_step_worker_inner(kind, path, tag, payload, ready_q, go))
    except BaseException as e:
        ready_q.put(f"error {tag}")
        result_q.put({"tag": tag, "error": f"{type(e).__name__}: {e}"})


def _step_worker_inner(kind: str, path: str, tag: str, payload: dict, ready_q: Any, go: Any) -> dict:
    import hashlib

    code, emb, metrics, channels = payload["code"], payload["emb"], payload["metrics"], payload["channels"]
    steps = len(code)
    lat: list[float] = []
    if kind == "trellis":
        import trellisdb

        db = trellisdb.connect(path)
        with db.transaction():
            s = db.session(task=TASK, agent=f"openevolve-{tag}", model="o4-mini")
        ready_q.put(tag)
        go.wait()
        prev: str | None = None
        t_start = time.time()
        for i in range(steps):
            t0 = time.perf_counter()
            with db.transaction():
                nid = s.add_node(
                    parents=[prev] if prev else [],
                    summary="Full rewrite",
                    cost={"tokens_in": 2500, "tokens_out": 1500, "seconds": 12.0},
                    embedding=emb[i],
                    artifacts={"code": code[i]},
                )
                for c, v in zip(channels, metrics[i].tolist(), strict=True):
                    s.add_reward(nid, c, v, verifier="evaluator.py")
            lat.append(time.perf_counter() - t0)
            prev = nid
        t_end = time.time()
        db.close()
    else:
        import lancedb

        from trellisdb.schema import table_schema

        dim = emb.shape[1]
        con = lancedb.connect(path)
        schemas = {n: table_schema(n, dim) for n in ("nodes", "edges", "artifacts", "node_artifacts", "rewards")}
        now = dt.datetime.now(dt.UTC)

        def node_row(i: int) -> dict[str, Any]:
            return {
                "id": f"{tag}-{i}", "session_id": tag, "task_id": TASK, "kind": "attempt", "step": i + 1,
                "status": "pending", "summary": "Full rewrite", "tokens_in": 2500, "tokens_out": 1500,
                "seconds": 12.0, "embedding": emb[i].tolist(), "created_at": dt.datetime.now(dt.UTC), "commit_id": 0,
            }

        seed_row = node_row(-1)
        tables = {"nodes": con.create_table("nodes", data=pa.Table.from_pylist([seed_row], schema=schemas["nodes"]))}
        if kind == "lancedb-tables":
            h0 = hashlib.sha256(b"seed").hexdigest()
            seeds = {
                "edges": {"src": "a", "dst": "b", "kind": "derived_from", "session_id": tag, "commit_id": 0},
                "artifacts": {"hash": h0, "media_type": "text/plain", "size": 4, "content": b"seed", "commit_id": 0},
                "node_artifacts": {"node_id": "a", "name": "code", "hash": h0, "commit_id": 0},
                "rewards": {"node_id": "a", "channel": "c", "value": 0.0, "created_at": now, "commit_id": 0},
            }
            for n, row in seeds.items():
                tables[n] = con.create_table(n, data=pa.Table.from_pylist([row], schema=schemas[n]))
        ready_q.put(tag)
        go.wait()
        t_start = time.time()
        for i in range(steps):
            t0 = time.perf_counter()
            nid = f"{tag}-{i}"
            tables["nodes"].add(pa.Table.from_pylist([node_row(i)], schema=schemas["nodes"]))
            if kind == "lancedb-tables":
                data = code[i].encode()
                h = hashlib.sha256(data).hexdigest()
                if i:
                    edge = {"src": f"{tag}-{i - 1}", "dst": nid, "kind": "derived_from", "session_id": tag, "commit_id": 0}
                    tables["edges"].add(pa.Table.from_pylist([edge], schema=schemas["edges"]))
                art = {"hash": h, "media_type": "text/plain", "size": len(data), "content": data, "commit_id": 0}
                tables["artifacts"].add(pa.Table.from_pylist([art], schema=schemas["artifacts"]))
                link = {"node_id": nid, "name": "code", "hash": h, "commit_id": 0}
                tables["node_artifacts"].add(pa.Table.from_pylist([link], schema=schemas["node_artifacts"]))
                rows = [
                    {"node_id": nid, "channel": c, "value": v, "verifier": "evaluator.py",
                     "created_at": dt.datetime.now(dt.UTC), "commit_id": 0}
                    for c, v in zip(channels, metrics[i].tolist(), strict=True)
                ]
                tables["rewards"].add(pa.Table.from_pylist(rows, schema=schemas["rewards"]))
            lat.append(time.perf_counter() - t0)
        t_end = time.time()
    return {"tag": tag, "latencies": lat, "start": t_start, "end": t_end,
            "peak_rss_mb": peak_rss_mb()}


def run_writers(kind: str, path: str, payloads: list[dict]) -> dict[str, Any]:
    """Start one spawned writer process per payload, release them together, collect latencies."""
    ctx = mp.get_context("spawn")
    ready_q, result_q, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=_step_worker, args=(kind, path, f"w{i}", p, ready_q, go, result_q), daemon=True)
        for i, p in enumerate(payloads)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        msg = ready_q.get(timeout=300)
        if str(msg).startswith("error"):
            break
    go.set()
    results = [result_q.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise SystemExit(f"{kind} writer failed: {errors[0]}")
    lat = [x for r in results for x in r["latencies"]]
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    return {
        "writers": len(payloads),
        "commits": len(lat),
        "wall_seconds": wall,
        "commits_per_s": len(lat) / wall,
        "p50_ms": pct(lat, 50) * 1e3,
        "p99_ms": pct(lat, 99) * 1e3,
        "mean_ms": float(np.mean(lat)) * 1e3,
        "max_ms": float(np.max(lat)) * 1e3,
        "child_peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "latency_growth_writer0": growth(results[0]["latencies"]),
    }


def bench_commits(g: ExperienceGraph, steps: int, writers: int, work: str) -> dict[str, Any]:
    import trellisdb

    res: dict[str, Any] = {"steps_1_writer": steps, "steps_per_writer_multi": max(1, steps // writers)}
    one = [step_payload(g, steps, 0)]
    multi = [step_payload(g, max(1, steps // writers), (i + 1) * steps) for i in range(writers)]

    for label, kind, payloads in (
        ("trellis_1", "trellis", one),
        (f"trellis_{writers}", "trellis", multi),
        ("lancedb_1row_1", "lancedb-1row", one),
        ("lancedb_tables_1", "lancedb-tables", one),
    ):
        path = os.path.join(work, f"commits-{label}")
        if kind == "trellis":
            trellisdb.connect(path, embedding_dim=g.dim).close()
        sync()
        log(f"b. {label}: {len(payloads)} writer process(es) x {len(payloads[0]['code'])} commits")
        res[label] = run_writers(kind, path, payloads)
        if kind == "trellis":
            db = trellisdb.connect(path)
            n = db.sql("SELECT count(*) AS n FROM nodes").to_pylist()[0]["n"]
            res[label]["nodes_visible"] = n
            expect = sum(len(p["code"]) for p in payloads)
            if n != expect:
                raise SystemExit(f"{label}: {n} nodes visible after the writers finished, expected {expect}")
            db.close()
        res[label]["du"] = du(path)
        shutil.rmtree(path)
    return res


# --------------------------------------------------------------------------- c: scans after small commits
def _small_commit_worker(path: str, auto_compact: bool, n: int, node_ids: list[str], result_q: Any) -> None:
    try:
        import trellisdb

        db = trellisdb.connect(path, auto_compact=auto_compact)
        with db.transaction():
            s = db.session(task=TASK, agent="rescorer")
        rng = np.random.default_rng(7)
        vals = rng.random(n).tolist()
        lat = []
        t_start = time.time()
        for i in range(n):
            t0 = time.perf_counter()
            with db.transaction():
                s.add_reward(node_ids[i % len(node_ids)], "combined_score", vals[i], verifier="rescore")
            lat.append(time.perf_counter() - t0)
        wall = time.time() - t_start
        db.close()
        result_q.put({"auto_compact": auto_compact, "commits": n, "wall_seconds": wall, "commits_per_s": n / wall,
                      "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3, **growth(lat)})
    except BaseException as e:
        result_q.put({"auto_compact": auto_compact, "error": f"{type(e).__name__}: {e}"})


SCAN_QUERIES = {
    "rewards_history": "SELECT count(*) AS n, sum(value) AS s FROM rewards_history",
    "rewards_current": "SELECT count(*) AS n, avg(value) AS s FROM rewards",
}


def time_scans(db: Any, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, q in SCAN_QUERIES.items():
        db.sql(q)  # warm-up
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            db.sql(q).to_pylist()
            ts.append(time.perf_counter() - t0)
        out[name] = {"median_ms": statistics.median(ts) * 1e3, "min_ms": min(ts) * 1e3}
    return out


def bench_scans(base_nodes: int, commits: int, dim: int, seed: int, work: str, reps: int) -> dict:
    import trellisdb

    g = ExperienceGraph(GeneratorConfig.for_nodes(base_nodes, embedding_dim=dim, seed=seed + 2))
    t = g.chunk(0, g.n_nodes)
    base = os.path.join(work, "scan-base.db")
    db = trellisdb.connect(base, embedding_dim=dim)
    db.ingest({k: v for k, v in t.items() if k not in ("artifacts", "node_artifacts")}, message="base")
    db.close()
    rng = np.random.default_rng(seed)
    node_ids = pc_take_list(g.node_ids, rng.choice(g.n_nodes, min(200, g.n_nodes), replace=False))
    paths = {True: os.path.join(work, "scan-auto.db"), False: os.path.join(work, "scan-noauto.db")}
    for p in paths.values():
        shutil.copytree(base, p)
    shutil.rmtree(base)
    sync()
    ctx = mp.get_context("spawn")
    builds = []
    for ac, p in paths.items():  # one after the other: on 2 CPUs two at once only slow each other
        log(f"c. {commits} small commits (one re-score each) on a {g.n_nodes}-node base, auto_compact={ac}")
        q = ctx.Queue()
        proc = ctx.Process(target=_small_commit_worker, args=(p, ac, commits, node_ids, q))
        proc.start()
        builds.append(q.get(timeout=7200))
        proc.join(timeout=60)
        sync()
    for b in builds:
        if "error" in b:
            raise SystemExit(f"small-commit writer failed: {b['error']}")
    res: dict[str, Any] = {"base_nodes": g.n_nodes, "base_reward_rows": g.n_nodes * len(g.channels),
                           "small_commits": commits, "builders": builds}
    for ac, path in paths.items():
        key = "auto_compact_on" if ac else "auto_compact_off"
        log(f"c. scans, {key}: before and after db.compact()")
        db = trellisdb.connect(path, auto_compact=False)
        r: dict[str, Any] = {"fragments_before": fragments(db, "rewards"), "du_before": du(path)}
        r["before"] = time_scans(db, reps)
        t0 = time.perf_counter()
        db.compact()
        r["compact_seconds"] = time.perf_counter() - t0
        r["fragments_after"] = fragments(db, "rewards")
        r["after"] = time_scans(db, reps)
        r["ratio"] = {k: r["before"][k]["median_ms"] / r["after"][k]["median_ms"] for k in SCAN_QUERIES}
        n = db.sql("SELECT count(*) AS n FROM rewards_history").to_pylist()[0]["n"]
        r["reward_rows"] = n
        db.close()
        res[key] = r
        shutil.rmtree(path)
    return res


def pc_take_list(arr: pa.Array, idx: np.ndarray) -> list[str]:
    import pyarrow.compute as pc

    return pc.take(arr, pa.array(idx)).to_pylist()


# --------------------------------------------------------------------------- report
def report(res: dict[str, Any]) -> tuple[str, dict[str, float]]:
    rows: list[tuple[str, str, str, str, str]] = []
    ratios: dict[str, float] = {}

    def add(label: str, mine: str, base: str, ratio: float | None, target: str = "") -> None:
        rows.append((label, mine, base, "" if ratio is None else f"{ratio:.2f}", target))

    a = res.get("ingest")
    if a:
        tr, lb, js = a["trellis"], a["lancedb"], a["json"]
        ratios["ingest_vs_lancedb"] = tr["nodes_per_s"] / lb["nodes_per_s"]
        ratios["ingest_vs_json_files"] = tr["nodes_per_s"] / js["nodes_per_s"]
        add("a. ingest nodes/s: trellis vs bare lancedb", f"{tr['nodes_per_s']:,.0f}", f"{lb['nodes_per_s']:,.0f}",
            ratios["ingest_vs_lancedb"], ">= 0.8")
        add("a. ingest MB/s (Arrow bytes)", f"{tr['mb_per_s']:,.0f}", f"{lb['mb_per_s']:,.0f}",
            tr["mb_per_s"] / lb["mb_per_s"])
        add("a. ingest nodes/s: trellis vs JSON file/program", f"{tr['nodes_per_s']:,.0f}",
            f"{js['nodes_per_s']:,.0f}", ratios["ingest_vs_json_files"], "")
    b = res.get("commits")
    if b:
        w = b.get("writers", 4)
        t1, tm, l1, lt = b["trellis_1"], b[f"trellis_{w}"], b["lancedb_1row_1"], b["lancedb_tables_1"]
        ratios["commits_1w_vs_lancedb_1row"] = t1["commits_per_s"] / l1["commits_per_s"]
        ratios["commits_1w_vs_lancedb_same_rows"] = t1["commits_per_s"] / lt["commits_per_s"]
        ratios[f"commits_{w}w_vs_lancedb_1row"] = tm["commits_per_s"] / l1["commits_per_s"]
        ratios[f"commits_{w}w_vs_1w"] = tm["commits_per_s"] / t1["commits_per_s"]
        ratios["commit_p50_1w_vs_lancedb_1row"] = t1["p50_ms"] / l1["p50_ms"]
        add("b. commits/s, 1 writer vs lancedb 1-row add", f"{t1['commits_per_s']:.1f}",
            f"{l1['commits_per_s']:.1f}", ratios["commits_1w_vs_lancedb_1row"])
        add("b. commits/s, 1 writer vs lancedb same rows", f"{t1['commits_per_s']:.1f}",
            f"{lt['commits_per_s']:.1f}", ratios["commits_1w_vs_lancedb_same_rows"])
        add(f"b. commits/s, {w} writers vs lancedb 1-row", f"{tm['commits_per_s']:.1f}",
            f"{l1['commits_per_s']:.1f}", ratios[f"commits_{w}w_vs_lancedb_1row"])
        add(f"b. commits/s, {w} writers vs 1 writer", f"{tm['commits_per_s']:.1f}", f"{t1['commits_per_s']:.1f}",
            ratios[f"commits_{w}w_vs_1w"])
        add("b. latency p50/p99 ms, 1 writer vs lancedb 1-row", f"{t1['p50_ms']:.1f}/{t1['p99_ms']:.1f}",
            f"{l1['p50_ms']:.1f}/{l1['p99_ms']:.1f}", ratios["commit_p50_1w_vs_lancedb_1row"], "(p50 ratio)")
        add(f"b. latency p50/p99 ms, {w} writers", f"{tm['p50_ms']:.1f}/{tm['p99_ms']:.1f}",
            f"{lt['p50_ms']:.1f}/{lt['p99_ms']:.1f}", None, "(base: lancedb same rows)")
    c = res.get("scans")
    if c:
        n = c["small_commits"]
        for key, label in (("auto_compact_on", "auto_compact on"), ("auto_compact_off", "auto_compact off")):
            r = c[key]
            for q in SCAN_QUERIES:
                ratios[f"scan_{q}_{key}_vs_compacted"] = r["ratio"][q]
                add(f"c. scan {q} after {n} commits, {label}", f"{r['before'][q]['median_ms']:.1f} ms",
                    f"{r['after'][q]['median_ms']:.1f} ms", r["ratio"][q],
                    "<= 1.5" if key == "auto_compact_on" else "(contrast)")
            add(f"c. rewards fragments, {label}", str(r["fragments_before"]), str(r["fragments_after"]), None,
                "(before / after compact)")
        for bld in c["builders"]:
            label = "on" if bld["auto_compact"] else "off"
            add(f"c. small-commit mean ms, last vs first tenth, auto_compact {label}",
                f"{bld['last_tenth_mean_ms']:.1f}", f"{bld['first_tenth_mean_ms']:.1f}",
                bld["last_tenth_mean_ms"] / bld["first_tenth_mean_ms"], f"({bld['commits_per_s']:.0f} commits/s)")
    if a:
        tr, pqr = a["trellis"], a["parquet"]
        ratios["disk_per_node_vs_parquet"] = tr["disk_bytes_per_node"] / pqr["disk_bytes_per_node"]
        add("d. disk bytes/node after compact vs Parquet", f"{tr['disk_bytes_per_node']:,.0f}",
            f"{pqr['disk_bytes_per_node']:,.0f}", ratios["disk_per_node_vs_parquet"])
        add("d. disk bytes/node: bare lancedb / JSON files", f"{a['lancedb']['disk_bytes_per_node']:,.0f}",
            f"{a['json']['disk_bytes_per_node']:,.0f}", None, f"(Arrow: {a['logical_bytes_per_node']:,.0f})")
    head = ("measure", "trellisdb", "baseline", "ratio", "target")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(5)]
    line = "  ".join("-" * w for w in widths)
    fmt = lambda r: "  ".join(x.ljust(widths[i]) if i == 0 else x.rjust(widths[i]) for i, x in enumerate(r))  # noqa: E731
    return "\n".join([fmt(head), line, *(fmt(r) for r in rows)]), ratios


# --------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=None, help="nodes for the ingest/disk benchmarks (default 100000; smoke 2000)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes; finishes in well under a minute")
    ap.add_argument("--chunk", type=int, default=None, help="nodes per db.ingest call (default 10000; smoke 500)")
    ap.add_argument("--steps", type=int, default=None, help="per-step commits in (b) (default 1000; smoke 30)")
    ap.add_argument("--writers", type=int, default=4, help="concurrent writer processes in (b)")
    ap.add_argument("--commits", type=int, default=None, help="small commits before the scans of (c) (10000; smoke 500)")
    ap.add_argument("--scan-base", type=int, default=None, help="nodes ingested before the small commits of (c)")
    ap.add_argument("--dim", type=int, default=384, help="embedding dimension")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default="abcd", help="subset of a,b,c,d to run (d needs a)")
    ap.add_argument("--workdir", default=None, help="scratch folder (default benchmarks/out/work)")
    ap.add_argument("--out", default=os.path.join(HERE, "out", "storage.json"))
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder")
    args = ap.parse_args(argv)
    if args.nodes is None:
        args.nodes = 2000 if args.smoke else 100_000
    chunk = args.chunk or (500 if args.smoke else 10_000)
    steps = args.steps or (30 if args.smoke else 1000)
    commits = args.commits or (500 if args.smoke else 10_000)
    scan_base = args.scan_base or min(args.nodes, 2000 if args.smoke else 10_000)
    reps = 9
    work = args.workdir or os.path.join(HERE, "out", "work")
    if os.path.exists(work):
        shutil.rmtree(work)
    os.makedirs(work)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    import lance
    import lancedb

    import trellisdb

    t_all = time.perf_counter()
    cal = calibrate()
    notes: list[str] = []
    cfg = GeneratorConfig.for_nodes(args.nodes, embedding_dim=args.dim, seed=args.seed)
    g = ExperienceGraph(cfg, cal)
    res: dict[str, Any] = {
        "args": {"nodes": g.n_nodes, "smoke": args.smoke, "chunk": chunk, "steps": steps, "writers": args.writers,
                 "small_commits": commits, "scan_base": scan_base, "dim": args.dim, "seed": args.seed},
        "env": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
                "trellisdb": getattr(trellisdb, "__version__", "?"), "lancedb": lancedb.__version__,
                "pylance": lance.__version__, "pyarrow": pa.__version__},
        "calibration": cal.summary(),
        "generator": {**{k: v for k, v in cfg.__dict__.items()}, **graph_stats(g)},
        "notes": notes,
    }
    if "a" in args.phases:
        res["ingest"] = bench_ingest(g, chunk, work)
    if "b" in args.phases:
        res["commits"] = bench_commits(g, steps, args.writers, work)
        res["commits"]["writers"] = args.writers
    if "c" in args.phases:
        res["scans"] = bench_scans(scan_base, commits, args.dim, args.seed, work, reps)
    res["total_seconds"] = time.perf_counter() - t_all
    res["maxrss_mb"] = peak_rss_mb()
    table, ratios = report(res)
    res["ratios"] = ratios
    res["table"] = table
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"trellisdb storage benchmark: {g.n_nodes} nodes, dim {args.dim}, {os.cpu_count()} CPUs"
          f"{' (smoke)' if args.smoke else ''}; {res['total_seconds']:.0f} s, peak RSS {res['maxrss_mb']:.0f} MB")
    print(table)
    for n in notes:
        print("note:", n)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
