"""``trellis serve`` under many agents (issue 25): steps/s and latency against the embedded store.

Figures (baselines measured in the same run, on fresh stores):

1. ``--clients`` agents (threads spread over ``--procs`` client processes) each recording
   ``--steps`` steps through the server (``RemoteDatabase.record_step``: a node with a parent
   edge, a ~2 KB code artifact and 3 rewards, acknowledged once durable): total steps/s, p50 and
   p99 latency;
2. the same steps written by one embedded process, one ``db.transaction()`` per step (the
   embedded per-step figure of ``bench_write.py``): the target is remote >= 0.5x embedded.

    .venv/bin/python benchmarks/bench_server.py --smoke
    .venv/bin/python benchmarks/bench_server.py --clients 64 --procs 4 --steps 50
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

CODE = "def pack():\n" + "".join(f"    x{i} = {i} * 0.5\n" for i in range(120))


def _step(i: int, k: int) -> dict[str, Any]:
    return {"summary": f"agent {i} step {k}", "artifacts": {"code": CODE + f"# {i} {k}\n"},
            "rewards": {"combined_score": (k % 10) / 10, "validity": 1.0, "eval_time": 0.1}}


def _client_proc(url: str, agents: list[int], steps: int, out: Any, go: Any) -> None:
    from trellisdb.client import RemoteDatabase

    dbs = {i: RemoteDatabase(url) for i in agents}
    for db in dbs.values():
        db.health()  # connected before the clock starts
    out.put("ready")
    go.wait()

    def agent(i: int) -> list[float]:
        lat = []
        with dbs[i] as db:
            parent = None
            for k in range(steps):
                s = _step(i, k)
                t0 = time.perf_counter()
                r = db.record_step(session=f"agent-{i}", task="bench", parents=[parent] if parent else [],
                                   summary=s["summary"], artifacts=s["artifacts"], rewards=s["rewards"])
                lat.append(time.perf_counter() - t0)
                parent = r["id"]
        return lat

    with ThreadPoolExecutor(len(agents)) as pool:
        out.put([x for lat in pool.map(agent, agents) for x in lat])


def remote(work: Path, clients: int, procs: int, steps: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "trellisdb.cli", "--db", str(work / "remote.db"), "serve",
                               "--port", str(port)], stderr=subprocess.PIPE)
    try:
        import httpx

        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/v1/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
        ctx = mp.get_context("spawn")
        q: Any = ctx.Queue()
        go = ctx.Event()
        groups = [list(range(p, clients, procs)) for p in range(procs)]
        ps = [ctx.Process(target=_client_proc, args=(url, g, steps, q, go)) for g in groups if g]
        for p in ps:
            p.start()
        for _ in ps:
            assert q.get() == "ready"  # imported and connected: the clock measures the steps only
        t0 = time.perf_counter()
        go.set()
        lat = [x for _ in ps for x in q.get()]
        wall = time.perf_counter() - t0
        for p in ps:
            p.join()
        log = httpx.get(f"{url}/v1/log").json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    lat.sort()
    return {"steps": len(lat), "steps_per_s": round(len(lat) / wall, 1), "p50_ms": round(lat[len(lat) // 2] * 1e3, 2),
            "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1e3, 2), "commits": len(log)}


def embedded(work: Path, steps: int) -> dict[str, Any]:
    import trellisdb

    db = trellisdb.connect(work / "embedded.db")
    s = db.session(task="bench", id="agent-0")
    lat, parent = [], None
    t_all = time.perf_counter()
    for k in range(steps):
        st = _step(0, k)
        t0 = time.perf_counter()
        with db.transaction():
            n = s.add_node(parents=[parent] if parent else [], summary=st["summary"], artifacts=st["artifacts"])
            for ch, v in st["rewards"].items():
                s.add_reward(n, ch, v)
        lat.append(time.perf_counter() - t0)
        parent = n
    wall = time.perf_counter() - t_all
    db.close()
    lat.sort()
    return {"steps": steps, "steps_per_s": round(steps / wall, 1), "p50_ms": round(statistics.median(lat) * 1e3, 2),
            "p99_ms": round(lat[int(len(lat) * 0.99) - 1] * 1e3, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default=str(HERE / "out" / "server.json"))
    args = p.parse_args()
    if args.smoke:
        args.clients, args.procs, args.steps = 8, 2, 10
    work = Path(tempfile.mkdtemp(prefix="bench-server-"))
    try:
        emb = embedded(work, max(200, args.clients * args.steps // 4))
        rem = remote(work, args.clients, args.procs, args.steps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ratio = rem["steps_per_s"] / emb["steps_per_s"]
    print(f"{'':<44} {'steps/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    print(f"{f'remote, {args.clients} clients in {args.procs} processes':<44} {rem['steps_per_s']:>9} "
          f"{rem['p50_ms']:>8} {rem['p99_ms']:>8}   ({rem['steps']} steps in {rem['commits']} commits)")
    print(f"{'embedded, 1 process, a transaction per step':<44} {emb['steps_per_s']:>9} {emb['p50_ms']:>8} "
          f"{emb['p99_ms']:>8}")
    print(f"remote / embedded steps/s: {ratio:.2f}x (target >= 0.5x)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({"args": vars(args), "remote": rem, "embedded": emb, "ratio": round(ratio, 3)}, fh, indent=2)


if __name__ == "__main__":
    main()
