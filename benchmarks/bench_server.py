"""``trellis serve`` under many agents (issue 25): writes and reads against the embedded store.

Figures (baselines measured in the same run; every write figure on fresh stores; the server is
``trellis serve`` started as a subprocess; clients are threads, one ``RemoteDatabase`` (its own
``httpx.Client``) each, spread over ``--procs`` client processes: 64 client processes would each
import the client and be scheduled on the 2 cores the server runs on; an agent mostly waits on
its call, so threads in a few processes add little besides the calls' own CPU, which is reported):

1. whole steps (a node with a parent edge, a ~2 KB code artifact and 3 rewards) recorded by
   ``--clients`` agents through the server (``RemoteDatabase.record_step``: acknowledged once
   durable): steps/s, p50 and p99 latency, against one embedded process writing the same steps,
   one ``db.transaction()`` each; target remote >= 0.5x;
2. per-step writes under load (issue 25's load figure): ``--clients`` agents each recording light
   steps (a node with a parent edge and 2 rewards) through ``POST /v1/steps``: steps/s (= steps
   acknowledged durable), p50/p99 latency and the commits the server actually made (``GET
   /v1/log``, during the measured window), against
   a. embedded, 1 process, one session: ``with db.transaction(): add_node + 2 add_reward`` per step,
   b. embedded, ``--writers`` processes on one store folder (cross-process writer lock), the same,
   c. SQLite in WAL mode, ``synchronous=NORMAL`` (its documented fast path) and ``FULL``, the same
      rows (tables nodes, edges, rewards with primary keys), ``BEGIN IMMEDIATE`` per step, 1 process;
   target remote >= 0.5x of a. Each client's first step (which opens its session on the server)
   is made before the clock starts and reported apart ("first step");
3. read latency at ``--nodes`` (built with ``generator.py`` through ``db.ingest``, ``--dim``-d
   embeddings, an ANN index at >= ``vectors.INDEX_MIN_ROWS`` vectors): ``FRONTIER ... LIMIT 10``,
   ``LINEAGE OF $id ANCESTORS`` (deep nodes), ``RETRIEVE 10 SIMILAR TO $q EXPAND LINEAGE 2``,
   p50 over ``--reps`` interleaved repetitions, ``RemoteDatabase.query`` through the server vs
   ``db.query`` on a read-only handle of the same store in this process (the server holds the
   writer); target remote <= 1.5x embedded + 2 ms;
4. with ``--profile`` (on in ``--smoke``): figure 2's remote run again under
   ``server_profile.py`` (``trellis serve`` with wall-clock timers around the write path's
   parts, and in a second run a CPU profiler in every server thread): where the server's time
   goes. The profiler slows the server ~4x: its steps/s are not a figure;
5. with ``--experiments``: figure 2's remote run with one server knob changed at a time (group
   commit window 0 and 5 ms, a 128-thread pool, a 0.5 ms GIL switch interval; ``--extra-path DIR``
   adds a run with DIR on the server's PYTHONPATH, e.g. ``pip install --target DIR httptools
   uvloop``, which uvicorn then uses), each against the unchanged server measured just before it;
6. hostile reads (issue 35): ``--hostile-agents`` agents (an agent token) record light steps and
   a poller asks ``/v1/health`` every 20 ms, in rounds of ``--hostile-seconds`` that alternate
   unloaded and loaded; in a loaded round ``--hostile`` analyst clients (an analyst token, their
   own process) each keep one long ``SELECT`` in flight (a ``range()`` cross join: hours of
   DuckDB), sent again at once when it is refused (``BusyError``), hung up at the round's end.
   Reported per round and as medians over rounds: health p50/p99, steps p50/p99 and steps/s,
   server CPU, what became of the hostile queries; targets (issue 35): loaded health p99 <= 100 ms
   and loaded steps p99 <= 2x unloaded.

Also reported: CPU seconds per step in the server and in the client processes (on 2 cores the
clients' HTTP work competes with the server's).

    .venv/bin/python benchmarks/bench_server.py --smoke
    .venv/bin/python benchmarks/bench_server.py --clients 64 --procs 4 --steps 50 --nodes 100000 --profile
    .venv/bin/python benchmarks/bench_server.py --skip 1,2,3 --experiments --extra-path /tmp/srv-extra
    .venv/bin/python benchmarks/bench_server.py --skip 1,2,3 --hostile-rounds 3 --hostile-seconds 20
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

CODE = "def pack():\n" + "".join(f"    x{i} = {i} * 0.5\n" for i in range(120))
TASK = "bench"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of ``xs``."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))] if s else float("nan")


def _step(kind: str, i: int, k: int) -> dict[str, Any]:
    """Step ``k`` of agent ``i``: ``heavy`` (figure 1) or ``light`` (figure 2); no parents here."""
    if kind == "heavy":
        return {"summary": f"agent {i} step {k}", "artifacts": {"code": CODE + f"# {i} {k}\n"},
                "rewards": {"combined_score": (k % 10) / 10, "validity": 1.0, "eval_time": 0.1}}
    return {"summary": f"agent {i} step {k}", "rewards": {"score": (k % 10) / 10, "valid": 1.0}}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used (all its threads)."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ the server
@contextmanager
def serving(path: Path, profile_out: Path | None = None, wrapper_args: tuple[str, ...] = (),
            extra_path: str | None = None, probe: str | None = None
            ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``trellis serve`` on ``path`` (``server_profile.py`` with ``profile_out`` and ``wrapper_args``;
    ``extra_path`` on its PYTHONPATH; ``probe``: a token its health is asked with): its url, its
    process."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    if profile_out is None:
        cmd = [sys.executable, "-m", "trellisdb.cli", "--db", str(path), "serve", "--port", str(port)]
    else:
        cmd = [sys.executable, str(HERE / "server_profile.py"), "--db", str(path), "--port", str(port),
               "--out", str(profile_out), *wrapper_args]
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = os.pathsep.join(x for x in (extra_path, env.get("PYTHONPATH")) if x)
    err = tempfile.TemporaryFile()  # noqa: SIM115  (closed below, after the server)
    server = subprocess.Popen(cmd, stderr=err, cwd=HERE.parent, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/v1/health", headers={"authorization": f"Bearer {probe}"} if probe else {}
                             ).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
            if time.monotonic() > deadline or server.poll() is not None:
                err.seek(0)
                raise RuntimeError(f"the server did not start: {err.read().decode()[-2000:]}")
        yield url, server
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        err.close()


# ------------------------------------------------------------------ remote writers
def _client_proc(url: str, agents: list[int], steps: int, kind: str, out: Any, go: Any) -> None:
    """One client process: a thread and a ``RemoteDatabase`` per agent. Each agent's first step
    (it opens the session on the server) is made before ``go``; then ``steps`` steps, timed."""
    try:
        from trellisdb.client import RemoteDatabase

        dbs = {i: RemoteDatabase(url) for i in agents}
        last: dict[int, str] = {}

        def first(i: int) -> float:
            s = _step(kind, i, 0)
            t0 = time.perf_counter()
            last[i] = dbs[i].record_step(session=f"agent-{i}", task=TASK, agent="bench", **s)["id"]
            return time.perf_counter() - t0

        def agent(i: int) -> list[float]:
            lat = []
            db, parent = dbs[i], last[i]
            for k in range(1, steps + 1):
                s = _step(kind, i, k)
                t0 = time.perf_counter()
                r = db.record_step(session=f"agent-{i}", task=TASK, agent="bench", parents=[parent], **s)
                lat.append(time.perf_counter() - t0)
                parent = r["id"]
            return lat

        with ThreadPoolExecutor(len(agents)) as pool:
            firsts = list(pool.map(first, agents))
            out.put({"ready": firsts})
            go.wait()
            cpu0, t0 = time.process_time(), time.time()
            lat = [x for xs in pool.map(agent, agents) for x in xs]
            out.put({"lat": lat, "start": t0, "end": time.time(), "cpu_s": time.process_time() - cpu0})
        for db in dbs.values():
            db.close()
    except BaseException as e:
        out.put({"error": f"{type(e).__name__}: {e}"})


def _get(q: Any, timeout: float = 600) -> dict[str, Any]:
    r: dict[str, Any] = q.get(timeout=timeout)
    if "error" in r:
        raise SystemExit(f"a client failed: {r['error']}")
    return r


def _commits(url: str) -> int:
    """The commits the server's store holds (``GET /v1/log``)."""
    from trellisdb.client import RemoteDatabase

    with RemoteDatabase(url) as db:
        return len(db.log())


def remote(path: Path, clients: int, procs: int, steps: int, kind: str, profile_out: Path | None = None,
           wrapper_args: tuple[str, ...] = (), extra_path: str | None = None) -> dict[str, Any]:
    """``clients`` agents in ``procs`` processes, ``steps`` timed steps each, against a fresh server
    (``server_profile.py`` with ``profile_out``: the profile is written there)."""
    with serving(path, profile_out, wrapper_args, extra_path) as (url, server):
        ctx = mp.get_context("spawn")
        q: Any = ctx.Queue()
        go = ctx.Event()
        groups = [g for g in (list(range(p, clients, procs)) for p in range(procs)) if g]
        ps = [ctx.Process(target=_client_proc, args=(url, g, steps, kind, q, go)) for g in groups]
        for p in ps:
            p.start()
        firsts = [x for _ in ps for x in _get(q)["ready"]]  # imported, connected, sessions open
        commits0 = _commits(url)
        cpu0 = _cpu_s(server.pid)
        if profile_out is not None:
            server.send_signal(signal.SIGUSR1)
            time.sleep(0.2)
        go.set()
        res = [_get(q) for _ in ps]
        server_cpu = _cpu_s(server.pid) - cpu0
        if profile_out is not None:
            server.send_signal(signal.SIGUSR2)
            deadline = time.monotonic() + 60
            while not profile_out.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            time.sleep(0.2)  # (written whole: the JSON is the last file it writes)
        for p in ps:
            p.join()
        commits = _commits(url) - commits0
    lat = [x for r in res for x in r["lat"]]
    wall = max(r["end"] for r in res) - min(r["start"] for r in res)
    n = len(lat)
    return {"steps": n, "steps_per_s": n / wall, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
            "commits": commits, "steps_per_commit": n / max(1, commits),
            "first_step_p50_ms": pct(firsts, 50) * 1e3, "first_step_max_ms": max(firsts) * 1e3,
            "server_cpu_ms_per_step": server_cpu / n * 1e3,
            "clients_cpu_ms_per_step": sum(r["cpu_s"] for r in res) / n * 1e3, "wall_s": wall}


# ------------------------------------------------------------------ embedded writers
def _embedded_steps(path: str, tag: str, steps: int, kind: str) -> tuple[list[float], float, float]:
    """``steps`` per-step transactions in session ``tag`` (made beforehand): latencies, start, end."""
    import trellisdb

    db = trellisdb.connect(path)
    s = db.resume(tag)
    lat: list[float] = []
    parent: str | None = None
    begin = time.time()
    for k in range(steps):
        st = _step(kind, 0, k)
        t0 = time.perf_counter()
        with db.transaction():
            n = s.add_node(parents=[parent] if parent else [], summary=st["summary"], artifacts=st.get("artifacts"))
            for ch, v in st["rewards"].items():
                s.add_reward(n, ch, v)
        lat.append(time.perf_counter() - t0)
        parent = n
    end = time.time()
    db.close()
    return lat, begin, end


def _embedded_worker(path: str, tag: str, steps: int, kind: str, go: Any, out: Any) -> None:
    try:
        import trellisdb  # noqa: F401  (imported before the clock)

        go.wait()
        lat, begin, end = _embedded_steps(path, tag, steps, kind)
        out.put({"lat": lat, "start": begin, "end": end})
    except BaseException as e:
        out.put({"error": f"{type(e).__name__}: {e}"})


def embedded(path: Path, writers: int, steps: int, kind: str) -> dict[str, Any]:
    """``writers`` processes (1: this one) writing ``steps`` per-step transactions each, on a fresh store."""
    import trellisdb

    db = trellisdb.connect(path)
    with db.transaction():
        for w in range(writers):
            db.session(task=TASK, agent="bench", id=f"w{w}")
    db.close()
    if writers == 1:
        lat, begin, end = _embedded_steps(str(path), "w0", steps, kind)
        res = [{"lat": lat, "start": begin, "end": end}]
    else:
        ctx = mp.get_context("spawn")
        go, q = ctx.Event(), ctx.Queue()
        ps = [ctx.Process(target=_embedded_worker, args=(str(path), f"w{w}", steps, kind, go, q))
              for w in range(writers)]
        for p in ps:
            p.start()
        time.sleep(1.5)  # let the children import
        go.set()
        res = [_get(q) for _ in ps]
        for p in ps:
            p.join()
    lat = [x for r in res for x in r["lat"]]
    wall = max(r["end"] for r in res) - min(r["start"] for r in res)
    return {"steps": len(lat), "steps_per_s": len(lat) / wall, "p50_ms": pct(lat, 50) * 1e3,
            "p99_ms": pct(lat, 99) * 1e3}


SQLITE_SCHEMA = """
CREATE TABLE nodes (id TEXT PRIMARY KEY, session_id TEXT NOT NULL, task_id TEXT NOT NULL, kind TEXT NOT NULL,
  step INTEGER, status TEXT NOT NULL, summary TEXT, created_at TEXT NOT NULL);
CREATE TABLE edges (src TEXT NOT NULL, dst TEXT NOT NULL, kind TEXT NOT NULL, PRIMARY KEY (src, dst, kind));
CREATE INDEX edges_dst ON edges(dst);
CREATE TABLE rewards (node_id TEXT NOT NULL, channel TEXT NOT NULL, value REAL NOT NULL, created_at TEXT NOT NULL,
  PRIMARY KEY (node_id, channel));
"""


def sqlite(path: Path, steps: int, sync: str) -> dict[str, Any]:
    """Figure 2's light steps in SQLite (WAL, ``synchronous=sync``), one ``BEGIN IMMEDIATE`` each."""
    import uuid

    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute(f"PRAGMA synchronous={sync}")
    con.executescript(SQLITE_SCHEMA)
    lat: list[float] = []
    parent: str | None = None
    t_all = time.perf_counter()
    for k in range(steps):
        st = _step("light", 0, k)
        t0 = time.perf_counter()
        nid = uuid.uuid4().hex
        now = dt.datetime.now(dt.UTC).isoformat()
        con.execute("BEGIN IMMEDIATE")
        con.execute("INSERT INTO nodes VALUES (?,?,?,?,?,?,?,?)",
                    (nid, "w0", TASK, "attempt", k + 1, "pending", st["summary"], now))
        if parent is not None:
            con.execute("INSERT INTO edges VALUES (?,?,?)", (parent, nid, "derived_from"))
        con.executemany("INSERT OR REPLACE INTO rewards VALUES (?,?,?,?)",
                        [(nid, c, v, now) for c, v in st["rewards"].items()])
        con.execute("COMMIT")
        lat.append(time.perf_counter() - t0)
        parent = nid
    wall = time.perf_counter() - t_all
    con.close()
    return {"steps": steps, "steps_per_s": steps / wall, "p50_ms": pct(lat, 50) * 1e3, "p99_ms": pct(lat, 99) * 1e3}


# ------------------------------------------------------------------ reads
def build_read_store(path: Path, nodes: int, dim: int) -> dict[str, Any]:
    """A store of ``nodes`` generated nodes (no artifacts: queries do not read them), its ANN index
    built when big enough; the deep nodes and some stored vectors, for the queries."""
    import numpy as np
    from generator import ExperienceGraph, GeneratorConfig

    import trellisdb
    from trellisdb import vectors

    g = ExperienceGraph(GeneratorConfig.for_nodes(nodes, embedding_dim=dim, embedding_clusters=max(10, nodes // 1000),
                                                  artifact_names=(), shared_system_prompt=False))
    db = trellisdb.connect(path, embedding_dim=dim, auto_index=False)
    sample: list[np.ndarray] = []
    for a, b in g.chunk_bounds(50_000):
        t = {k: v for k, v in g.chunk(a, b).items() if k not in ("artifacts", "node_artifacts")}
        db.ingest(t, message=f"nodes {a}..")
        x = t["nodes"]["embedding"].combine_chunks().flatten().to_numpy().reshape(-1, dim)
        sample.append(x[:: max(1, len(x) // 200)])
    db.compact()
    if g.n_nodes >= vectors.INDEX_MIN_ROWS:
        db._vectors.indexer.poke(db._reads.space("embedding", "nodes"), force="create")  # internal, as bench_retrieve
        db._vectors.indexer.wait()
    index = db.index_status()[0]["state"]
    db.close()
    deep = np.argsort(-g.generation, kind="stable")[:50]
    ids = g.node_ids.to_pylist()
    return {"nodes": g.n_nodes, "deep": [ids[i] for i in deep], "max_generation": int(g.generation.max()),
            "vectors": np.concatenate(sample), "index": index}


def interleaved(named: dict[str, list[Callable[[], Any]]], rounds: int = 2) -> dict[str, dict[str, float]]:
    """p50/p95 (ms) of each named list of calls, run round-robin (call i of every list, then
    i + 1...) ``rounds`` times, after a warm-up call each, so drift hits all sides alike."""
    for fns in named.values():
        fns[0]()
        fns[0]()
    ts: dict[str, list[float]] = {k: [] for k in named}
    n = len(next(iter(named.values())))
    for _ in range(rounds):
        for i in range(n):
            for k, fns in named.items():
                t0 = time.perf_counter()
                fns[i]()
                ts[k].append((time.perf_counter() - t0) * 1e3)
    return {k: {"p50_ms": statistics.median(v), "p95_ms": pct(v, 95)} for k, v in ts.items()}


QUERIES = {
    "frontier": "FRONTIER RANK BY reward('combined_score') DESC LIMIT 10",
    "lineage": "LINEAGE OF $id ANCESTORS",
    "retrieve": "RETRIEVE 10 SIMILAR TO $q EXPAND LINEAGE 2",
}


def reads(path: Path, nodes: int, dim: int, reps: int) -> dict[str, Any]:
    import numpy as np

    import trellisdb
    from trellisdb.client import RemoteDatabase

    t0 = time.perf_counter()
    built = build_read_store(path, nodes, dim)
    log(f"read store: {built['nodes']} nodes x {dim}-d built in {time.perf_counter() - t0:.1f} s "
        f"(vectors: {built['index']}, deepest lineage {built['max_generation']} hops)")
    rng = np.random.default_rng(1)
    vs = built["vectors"]
    qs = [vs[i] + 0.1 * rng.standard_normal(dim).astype(np.float32) for i in rng.integers(0, len(vs), reps)]
    deep = [built["deep"][i % len(built["deep"])] for i in range(reps)]
    args = {"frontier": [{}] * reps, "lineage": [{"id": d} for d in deep],
            "retrieve": [{"q": [float(x) for x in q]} for q in qs]}
    out: dict[str, Any] = {"nodes": built["nodes"], "dim": dim, "reps": reps, "vectors": built["index"]}
    with serving(path) as (url, _), RemoteDatabase(url) as rdb:
        edb = trellisdb.connect(path, read_only=True)
        try:
            for name, text in QUERIES.items():
                a = args[name]
                same = rdb.query(text, **a[0]).to_arrow().num_rows == edb.query(text, **a[0]).to_arrow().num_rows
                lat = interleaved({
                    "remote": [lambda p=p, t=text: rdb.query(t, **p).to_arrow() for p in a],
                    "embedded": [lambda p=p, t=text: edb.query(t, **p).to_arrow() for p in a],
                })
                r, e = lat["remote"]["p50_ms"], lat["embedded"]["p50_ms"]
                out[name] = {"remote": lat["remote"], "embedded": lat["embedded"], "ratio_p50": r / e,
                             "target_ms": 1.5 * e + 2, "meets_target": r <= 1.5 * e + 2, "same_rows": same,
                             "rows": rdb.query(text, **a[0]).to_arrow().num_rows}
        finally:
            edb.close()
    return out


# ------------------------------------------------------------------ profile, experiments
def _profiled(work: Path, args: argparse.Namespace, name: str, wrapper_args: tuple[str, ...] = (),
              extra_path: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Figure 2's remote run under ``server_profile.py``: the run's figures and the profile."""
    out = HERE / "out" / f"server_profile{'' if name == 'cprofile' else '_' + name}.json"
    os.makedirs(out.parent, exist_ok=True)
    out.unlink(missing_ok=True)
    rem = remote(work / f"f4-{name}.db", args.clients, args.procs, args.steps, "light", profile_out=out,
                 wrapper_args=wrapper_args, extra_path=extra_path)
    return rem, json.loads(out.read_text())


def _timer_lines(prof: dict[str, Any], steps: int) -> list[str]:
    lines = ["wall-clock timers (count, total s, mean ms), server side:"]
    lines += [f"  {v['count']:6d} {v['total_s']:8.3f} {v['mean_ms'] or 0:8.3f}  {k}" for k, v in prof["timers"].items()]
    lines.append(f"server CPU {prof['cpu_s_total']:.2f} s over {prof['wall_s']:.2f} s wall "
                 f"({prof['cpu_s_total'] / steps * 1e3:.2f} ms per step), by thread:")
    lines += [f"  {v:7.3f} s  {k}" for k, v in prof["cpu_s_by_role"].items()]
    return lines


def profile(work: Path, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Figure 4: the server's write path under figure 2's load, in two runs: timers only (close to
    the plain server's speed), then with a CPU profiler in every thread."""
    rem_t, timers = _profiled(work, args, "timers", ("--no-cprofile",))
    log(f"4. timers-only server: {rem_t['steps_per_s']:.0f} steps/s")
    rem_p, prof = _profiled(work, args, "cprofile")
    log(f"4. profiled server: {rem_p['steps_per_s']:.0f} steps/s")
    lines = ["", f"4. the server's write path under figure 2's load ({args.clients} clients)",
             f"a. timers only: {rem_t['steps_per_s']:.0f} steps/s, p50 {rem_t['p50_ms']:.1f} ms, "
             f"{rem_t['commits']} commits ({rem_t['steps_per_commit']:.1f} steps/commit)"]
    lines += _timer_lines(timers, rem_t["steps"])
    lines += [f"b. CPU profile (cProfile per thread on the thread CPU clock; {rem_p['steps_per_s']:.0f} steps/s "
              "under it; server_profile.json, .txt, .pstats):",
              f"server CPU {prof['cpu_s_total']:.2f} s; the write path's parts (inclusive CPU s, share):"]
    tot = max(prof["cpu_s_total"], 1e-9)
    lines += [f"  {v:7.3f} s {v / tot:5.0%}  {k}" for k, v in prof["profile_cpu_s_by_part"].items()]
    lines.append("by library (own CPU s, share):")
    lines += [f"  {v:7.3f} s {v / tot:5.0%}  {k}" for k, v in list(prof["profile_cpu_s_by_bucket"].items())[:10]]
    lines.append("top functions by own CPU:")
    lines += [f"  {t['tottime_s']:7.3f} s {t['calls']:8d}  {t['function']}" for t in prof["profile_top_by_own_cpu"][:12]]
    return {"timers_run": rem_t, "timers": timers, "cprofile_run": rem_p, "cprofile": prof}, lines


EXPERIMENTS: dict[str, tuple[str, ...]] = {
    "as served (timers only)": ("--no-cprofile",),
    "window 0 ms": ("--no-cprofile", "--window", "0"),
    "window 5 ms": ("--no-cprofile", "--window", "0.005"),
    "thread pool 128": ("--no-cprofile", "--threads", "128"),
    "GIL switch interval 0.5 ms": ("--no-cprofile", "--switch-interval", "0.0005"),
}


def experiments(work: Path, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Figure 5 (``--experiments``): figure 2's remote run with one server knob changed at a time
    (``server_profile.py``'s knobs; ``--extra-path``: a folder with ``httptools``/``uvloop``, which
    uvicorn then uses), each against the unchanged server run just before it."""
    variants = dict(EXPERIMENTS)
    if args.extra_path:
        variants[f"with {args.extra_path} (httptools, uvloop)"] = ("--no-cprofile",)
    out: dict[str, Any] = {}
    base_name = next(iter(variants))
    lines = ["", f"5. server knobs, figure 2's load ({args.clients} clients); each against the unchanged server "
                 "measured just before it",
             "| variant | steps/s | p50 ms | p99 ms | steps/commit | server CPU ms/step | vs unchanged |",
             "|---|---|---|---|---|---|---|"]
    for name, wargs in variants.items():
        if name == base_name:
            continue
        base, _ = _profiled(work, args, "exp-base", variants[base_name])
        extra = args.extra_path if name.startswith("with ") else None
        rem, prof = _profiled(work, args, "exp", wargs, extra_path=extra)
        out[name] = {"run": rem, "unchanged": base, "ratio": rem["steps_per_s"] / base["steps_per_s"],
                     "timers": prof["timers"]}
        log(f"5. {name}: {rem['steps_per_s']:.0f} steps/s vs {base['steps_per_s']:.0f}")
        for label, r in ((f"unchanged (before {name})", base), (name, rem)):
            lines.append(f"| {label} | {r['steps_per_s']:,.0f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
                         f"{r['steps_per_commit']:.1f} | {r['server_cpu_ms_per_step']:.2f} | "
                         f"{'**%.2fx**' % (r['steps_per_s'] / base['steps_per_s']) if r is rem else ''} |")
    for f in (HERE / "out").glob("server_profile_exp*.json"):
        f.unlink()
    return out, lines


# ------------------------------------------------------------------ hostile reads
#: A long analyst query: a cross join of two ranges, hours of DuckDB in little memory.
HOSTILE_SQL = "SELECT count(*) AS n FROM range(1000000000) a, range(100000) b"


def _agents_proc(url: str, token: str, agents: list[int], cmds: Any, out: Any) -> None:
    """One process of agents: a thread and a ``RemoteDatabase`` each. Their first step (the
    session opened) before ``ready``; then per command ``seconds``: light steps until then, timed."""
    try:
        from trellisdb.client import RemoteDatabase

        dbs = {i: RemoteDatabase(url, token=token) for i in agents}
        last = {i: dbs[i].record_step(session=f"agent-{i}", task=TASK, agent="bench", **_step("light", i, 0))["id"]
                for i in agents}
        out.put({"ready": True})
        k = 0
        while (seconds := cmds.get()) is not None:
            k += 1

            def agent(i: int, until: float, k: int = k) -> list[float]:
                lat, n = [], 0
                while time.monotonic() < until:
                    n += 1
                    t0 = time.perf_counter()
                    last[i] = dbs[i].record_step(session=f"agent-{i}", task=TASK, agent="bench", parents=[last[i]],
                                                 **_step("light", i, k * 100_000 + n))["id"]
                    lat.append(time.perf_counter() - t0)
                return lat

            until = time.monotonic() + seconds
            with ThreadPoolExecutor(len(agents)) as pool:
                lat = [x for xs in pool.map(agent, agents, [until] * len(agents)) for x in xs]
            out.put({"lat": lat})
        for db in dbs.values():
            db.close()
    except BaseException as e:
        out.put({"error": f"{type(e).__name__}: {e}"})


def _hostile_proc(url: str, token: str, clients: int, cmds: Any, out: Any) -> None:
    """``clients`` analysts (threads, an ``httpx.Client`` each): per command ``seconds``, each keeps
    one long query in flight until then (sent again when refused), then hangs up."""
    try:
        import httpx

        hs = [httpx.Client(base_url=url, headers={"authorization": f"Bearer {token}"}) for _ in range(clients)]
        out.put({"ready": True})
        while (seconds := cmds.get()) is not None:
            until = time.monotonic() + seconds

            def analyst(h: httpx.Client, until: float = until) -> dict[str, int]:
                seen: dict[str, int] = {}
                while (left := until - time.monotonic()) > 0.05:
                    try:
                        r = h.post("/v1/sql", json={"sql": HOSTILE_SQL}, timeout=left)
                        kind = r.json().get("error", "answered") if r.status_code != 200 else "answered"
                    except httpx.TimeoutException:
                        kind = "hung up (cancelled by the server)"
                    except httpx.HTTPError as e:
                        kind = f"{type(e).__name__}"
                    seen[kind] = seen.get(kind, 0) + 1
                return seen

            with ThreadPoolExecutor(clients) as pool:
                counts: dict[str, int] = {}
                for seen in pool.map(analyst, hs):
                    for kind, n in seen.items():
                        counts[kind] = counts.get(kind, 0) + n
            out.put({"outcomes": counts})
        for h in hs:
            h.close()
    except BaseException as e:
        out.put({"error": f"{type(e).__name__}: {e}"})


def _settled(pid: int, timeout: float = 30.0) -> float:
    """Wait until the server is idle (< 10% of a core over 0.5 s); seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        c0 = _cpu_s(pid)
        time.sleep(0.5)
        if _cpu_s(pid) - c0 < 0.05:
            break
    return time.monotonic() - t0


def hostile_reads(work: Path, args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """Figure 6 (see the module notes): steps and health with and without hostile reads."""
    import httpx

    import trellisdb
    from trellisdb.tenants import Tokens

    path = work / "f6-hostile.db"
    trellisdb.connect(path).close()
    tokens = Tokens(str(path))
    analyst = tokens.create("default", "analyst", name="hostile-analyst")
    agent = tokens.create("default", "agent", name="bench-agent")
    rounds: list[dict[str, Any]] = []
    with serving(path, probe=agent) as (url, server):
        ctx = mp.get_context("spawn")
        out: Any = ctx.Queue()
        groups = [g for g in (list(range(p, args.hostile_agents, args.procs)) for p in range(args.procs)) if g]
        agent_cmds = [ctx.Queue() for _ in groups]
        hostile_cmds = ctx.Queue()
        ps = [ctx.Process(target=_agents_proc, args=(url, agent, g, c, out)) for g, c in zip(groups, agent_cmds,
                                                                                           strict=True)]
        ps.append(ctx.Process(target=_hostile_proc, args=(url, analyst, args.hostile, hostile_cmds, out)))
        for p in ps:
            p.start()
        for _ in ps:
            _get(out)  # ready
        health = httpx.Client(base_url=url, headers={"authorization": f"Bearer {agent}"}, timeout=30)
        try:
            for c in agent_cmds:  # a warm-up, not counted: the first commits, the mirror's first copies
                c.put(2.0)
            for _ in agent_cmds:
                _get(out)
            for r in range(2 * args.hostile_rounds):
                loaded = r % 2 == 1
                waited = _settled(server.pid)
                load0, cpu0, t0 = os.getloadavg()[0], _cpu_s(server.pid), time.monotonic()
                for c in agent_cmds:
                    c.put(args.hostile_seconds)
                if loaded:
                    hostile_cmds.put(args.hostile_seconds)
                lat: list[float] = []
                while time.monotonic() - t0 < args.hostile_seconds:
                    t1 = time.perf_counter()
                    assert health.get("/v1/health").status_code == 200
                    lat.append(time.perf_counter() - t1)
                    time.sleep(0.02)
                got = [_get(out) for _ in range(len(agent_cmds) + (1 if loaded else 0))]
                steps = [x for g in got if "lat" in g for x in g["lat"]]
                wall = time.monotonic() - t0
                rounds.append({
                    "loaded": loaded, "health_p50_ms": pct(lat, 50) * 1e3, "health_p99_ms": pct(lat, 99) * 1e3,
                    "health_max_ms": max(lat) * 1e3, "health_calls": len(lat),
                    "steps": len(steps), "steps_per_s": len(steps) / wall, "steps_p50_ms": pct(steps, 50) * 1e3,
                    "steps_p99_ms": pct(steps, 99) * 1e3, "server_cores": (_cpu_s(server.pid) - cpu0) / wall,
                    "loadavg_1m_before": load0, "settled_after_s": waited,
                    "hostile": next((g["outcomes"] for g in got if "outcomes" in g), None)})
                x = rounds[-1]
                log(f"6. {'loaded' if loaded else 'unloaded'} round {r // 2 + 1}: health p99 {x['health_p99_ms']:.1f} "
                    f"ms, steps p99 {x['steps_p99_ms']:.1f} ms ({x['steps_per_s']:.0f}/s), server "
                    f"{x['server_cores']:.2f} cores{'; hostile: ' + str(x['hostile']) if loaded else ''}")
        finally:
            health.close()
            for c in [*agent_cmds, hostile_cmds]:
                c.put(None)
            for p in ps:
                p.join(timeout=60)
    calm = [x for x in rounds if not x["loaded"]]
    busy = [x for x in rounds if x["loaded"]]

    def med(xs: list[dict[str, Any]], k: str) -> float:
        return statistics.median(x[k] for x in xs)

    def spread(xs: list[dict[str, Any]], k: str) -> str:
        return f"{min(x[k] for x in xs):.1f}-{max(x[k] for x in xs):.1f}"

    summary = {k: {"unloaded": med(calm, k), "loaded": med(busy, k)}
               for k in ("health_p50_ms", "health_p99_ms", "steps_p50_ms", "steps_p99_ms", "steps_per_s", "server_cores")}
    ratio = summary["steps_p99_ms"]["loaded"] / summary["steps_p99_ms"]["unloaded"]
    meets = {"health_p99_le_100ms": summary["health_p99_ms"]["loaded"] <= 100, "steps_p99_le_2x": ratio <= 2}
    lines = ["", f"6. hostile reads: {args.hostile} analyst clients each keeping a long SELECT (range() cross join) in "
                 f"flight vs none; {args.hostile_agents} agents recording light steps, health every 20 ms; "
                 f"{args.hostile_rounds} x 2 alternating rounds of {args.hostile_seconds:g} s; medians over rounds "
                 "(min-max)",
             "| | health p50 ms | health p99 ms | steps p50 ms | steps p99 ms | steps/s | server cores |",
             "|---|---|---|---|---|---|---|"]
    for name, xs in (("unloaded", calm), ("50 hostile reads" if args.hostile == 50 else f"{args.hostile} hostile reads",
                                          busy)):
        lines.append("| " + name + " | " + " | ".join(f"{med(xs, k):.1f} ({spread(xs, k)})" for k in (
            "health_p50_ms", "health_p99_ms", "steps_p50_ms", "steps_p99_ms", "steps_per_s", "server_cores")) + " |")
    lines += [f"hostile queries per loaded round: {[x['hostile'] for x in busy]}",
              f"targets: loaded health p99 {summary['health_p99_ms']['loaded']:.1f} ms <= 100 ms: "
              f"{'met' if meets['health_p99_le_100ms'] else 'MISSED'}; loaded steps p99 / unloaded = {ratio:.2f}x "
              f"<= 2x: {'met' if meets['steps_p99_le_2x'] else 'MISSED'}",
              f"load average (1 min) before each round: {[round(x['loadavg_1m_before'], 2) for x in rounds]}"]
    return {"rounds": rounds, "summary": summary, "steps_p99_ratio": ratio, "meets": meets}, lines


# ------------------------------------------------------------------ main
def fmt_row(name: str, r: dict[str, Any], base: dict[str, Any] | None = None, note: str = "") -> str:
    ratio = f"**{r['steps_per_s'] / base['steps_per_s']:.2f}x**" if base else ""
    return f"| {name} | {r['steps_per_s']:,.0f}/s | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {ratio} | {note} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--procs", type=int, default=4, help="client processes the clients are spread over")
    p.add_argument("--steps", type=int, default=50, help="timed steps per client")
    p.add_argument("--writers", type=int, default=4, help="embedded processes of figure 2b")
    p.add_argument("--nodes", type=int, default=100_000, help="store size of figure 3")
    p.add_argument("--dim", type=int, default=32, help="embedding dimension of figure 3")
    p.add_argument("--reps", type=int, default=30, help="repetitions per query in figure 3")
    p.add_argument("--profile", action="store_true", help="figure 4: profile the server under figure 2's load")
    p.add_argument("--experiments", action="store_true", help="figure 5: server knobs, one at a time")
    p.add_argument("--extra-path", default=None,
                   help="figure 5: a folder put on the server's PYTHONPATH as one more variant (httptools, uvloop)")
    p.add_argument("--hostile", type=int, default=50, help="figure 6: analyst clients keeping a long query in flight")
    p.add_argument("--hostile-agents", type=int, default=16, help="figure 6: agents recording steps meanwhile")
    p.add_argument("--hostile-rounds", type=int, default=3, help="figure 6: rounds of each kind (alternating)")
    p.add_argument("--hostile-seconds", type=float, default=15.0, help="figure 6: seconds per round")
    p.add_argument("--skip", default="", help="comma-separated figures to leave out: 1,2,3,6")
    p.add_argument("--out", default=str(HERE / "out" / "server.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.clients, args.procs, args.steps, args.writers, args.nodes, args.reps = 16, 2, 10, 2, 3000, 5
        args.profile = True
        args.hostile_agents, args.hostile_rounds, args.hostile_seconds = 4, 1, 4.0
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    total = args.clients * args.steps
    emb_steps = max(200, total)
    work = Path(tempfile.mkdtemp(prefix="bench-server-"))
    results: dict[str, Any] = {"date": dt.date.today().isoformat(), "machine": platform.platform(),
                               "cpus": os.cpu_count(), "loadavg_before": os.getloadavg(), "args": vars(args)}
    lines: list[str] = []
    head = "| figure | steps/s | p50 ms | p99 ms | ratio | notes |\n|---|---|---|---|---|---|"
    try:
        if "1" not in skip:
            emb = embedded(work / "f1-embedded.db", 1, emb_steps, "heavy")
            log(f"1. embedded heavy steps: {emb['steps_per_s']:.0f}/s")
            rem = remote(work / "f1-remote.db", args.clients, args.procs, args.steps, "heavy")
            log(f"1. remote heavy steps: {rem['steps_per_s']:.0f}/s")
            results["1 whole steps"] = {"remote": rem, "embedded": emb, "ratio": rem["steps_per_s"] / emb["steps_per_s"]}
            lines += ["", "1. whole steps (node + parent edge + ~2 KB artifact + 3 rewards), acknowledged durable",
                      head,
                      fmt_row(f"remote, {args.clients} clients in {args.procs} processes", rem, emb,
                              f"{rem['steps']} steps in {rem['commits']} commits; first step p50 "
                              f"{rem['first_step_p50_ms']:.0f} ms, max {rem['first_step_max_ms']:.0f} ms"),
                      fmt_row("embedded, 1 process, a transaction per step (baseline)", emb),
                      "target: remote >= 0.5x embedded"]
        if "2" not in skip:
            f2: dict[str, Any] = {}
            f2["embedded 1 process"] = embedded(work / "f2-embedded1.db", 1, emb_steps, "light")
            log(f"2a. embedded, 1 process: {f2['embedded 1 process']['steps_per_s']:.0f}/s")
            f2["sqlite NORMAL"] = sqlite(work / "f2-normal.sqlite", emb_steps, "NORMAL")
            f2["sqlite FULL"] = sqlite(work / "f2-full.sqlite", emb_steps, "FULL")
            log(f"2c. sqlite NORMAL {f2['sqlite NORMAL']['steps_per_s']:.0f}/s, "
                f"FULL {f2['sqlite FULL']['steps_per_s']:.0f}/s")
            f2[f"embedded {args.writers} processes"] = embedded(work / "f2-embeddedN.db", args.writers,
                                                                max(50, emb_steps // args.writers), "light")
            log(f"2b. embedded, {args.writers} processes: "
                f"{f2[f'embedded {args.writers} processes']['steps_per_s']:.0f}/s")
            rem = remote(work / "f2-remote.db", args.clients, args.procs, args.steps, "light")
            log(f"2. remote: {rem['steps_per_s']:.0f}/s")
            results["2 per-step writes"] = {"remote": rem, **f2,
                                            "ratios": {k: rem["steps_per_s"] / v["steps_per_s"] for k, v in f2.items()}}
            lines += ["", "2. per-step writes (node + parent edge + 2 rewards), each acknowledged durable",
                      head,
                      fmt_row(f"remote, {args.clients} clients in {args.procs} processes", rem, None,
                              f"{rem['steps']} steps in {rem['commits']} commits ({rem['steps_per_commit']:.1f} "
                              f"steps/commit); first step p50 {rem['first_step_p50_ms']:.0f} ms, max "
                              f"{rem['first_step_max_ms']:.0f} ms; CPU ms/step: server "
                              f"{rem['server_cpu_ms_per_step']:.2f}, clients {rem['clients_cpu_ms_per_step']:.2f}")]
            for k, v in f2.items():
                lines.append(fmt_row(f"remote vs {k}", rem, v, f"baseline: {v['steps_per_s']:,.0f}/s, "
                                                              f"p50 {v['p50_ms']:.2f}, p99 {v['p99_ms']:.2f} ms"))
            lines.append("target: remote >= 0.5x embedded 1 process")
        if "3" not in skip:
            f3 = reads(work / "f3-reads.db", args.nodes, args.dim, args.reps)
            results["3 reads"] = f3
            lines += ["", f"3. read latency, {f3['nodes']:,} nodes, {args.dim}-d ({f3['vectors']}), p50 of "
                          f"{2 * args.reps} interleaved calls",
                      "| query | remote p50 ms | embedded p50 ms | ratio | target (1.5x + 2 ms) | rows |",
                      "|---|---|---|---|---|---|"]
            for name in QUERIES:
                q = f3[name]
                lines.append(f"| {name} | {q['remote']['p50_ms']:.2f} | {q['embedded']['p50_ms']:.2f} | "
                             f"**{q['ratio_p50']:.2f}x** | {q['target_ms']:.2f} ms: "
                             f"{'met' if q['meets_target'] else 'MISSED'} | {q['rows']} |")
        if args.profile:
            prof, prof_lines = profile(work, args)
            results["4 profile"] = prof
            lines += prof_lines
        if args.experiments:
            exp, exp_lines = experiments(work, args)
            results["5 experiments"] = exp
            lines += exp_lines
        if "6" not in skip:
            hos, hos_lines = hostile_reads(work, args)
            results["6 hostile reads"] = hos
            lines += hos_lines
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["loadavg_after"] = os.getloadavg()
    print("\n".join(lines))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
