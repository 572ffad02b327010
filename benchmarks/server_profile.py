"""``trellis serve`` with a profiler inside (for ``bench_server.py --profile``; issue 25).

Runs ``trellisdb.server.serve`` as ``trellis serve`` does, with, in every Python thread of the
server (the event loop, the thread pool's workers, the committer), a ``cProfile`` profiler on
the thread's CPU clock (``time.thread_time``: waiting for the GIL, a lock or the disk costs
nothing), and wall-clock timers around the parts of the write path (nothing in
``trellisdb/server.py`` is changed: its functions are wrapped here). Signals drive it:

- ``SIGUSR1``: start the measured window (profiles cleared, timers zeroed, CPU per thread read);
- ``SIGUSR2``: end it: write ``--out`` (JSON: timers, CPU per thread role, profile buckets and
  top functions) and ``--out`` + ``.pstats`` (the merged profile, for ``python -m pstats``).

``--no-cprofile`` keeps the timers and the CPU per thread only (the profilers slow the server
~4x; the timers cost little). Knobs for trying a change without editing the server:
``--window`` (the group-commit window, s), ``--threads`` (the thread pool's size: anyio's
default limiter, 40), ``--switch-interval`` (``sys.setswitchinterval``, default 0.005 s).

    .venv/bin/python benchmarks/server_profile.py --db PATH --port 7437 --out prof.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

_profiles: list[tuple[str, cProfile.Profile]] = []
_plock = threading.Lock()
# wall-clock timers: name -> [count, seconds]
_timers: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
_tlock = threading.Lock()


def _add(name: str, seconds: float) -> None:
    with _tlock:
        t = _timers[name]
        t[0] += 1
        t[1] += seconds


def _thread_hook(*_: Any) -> None:
    """Called at a new thread's first event (``threading.setprofile``): gives it its own profiler."""
    p = cProfile.Profile(time.thread_time)
    with _plock:
        _profiles.append((threading.current_thread().name, p))
    p.enable()  # replaces this hook in this thread


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            _add(name, time.perf_counter() - t0)
    wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _instrument(window: float | None = None, threads: int | None = None) -> None:
    """Wrap the write path's parts with timers, wherever the server keeps them (``server.py``, or
    ``service.py`` once the Service moved there): what is missing is left unwrapped."""
    import starlette.concurrency

    import trellisdb.database
    import trellisdb.server as server

    os.fsync = _timed("fsync", os.fsync)
    if hasattr(os, "fdatasync"):
        os.fdatasync = _timed("fsync", os.fdatasync)

    class _Time:  # the service module's ``time``: its sleep (the group-commit window) timed
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def sleep(s: float) -> None:
            t0 = time.perf_counter()
            time.sleep(s)
            _add("commit window sleep", time.perf_counter() - t0)

    service_cls = server.Service
    if window is not None:
        service_cls.__init__.__kwdefaults__["window"] = window
    service_mod = sys.modules[service_cls.__module__]
    if getattr(service_mod, "time", None) is time:
        service_mod.time = _Time()  # type: ignore[attr-defined]

    flush = trellisdb.database.Database.flush

    def timed_flush(self: Any, *a: Any, **k: Any) -> Any:
        if threading.current_thread().name != "trellisdb-server-commit":
            return flush(self, *a, **k)
        t0 = time.perf_counter()
        try:
            return flush(self, *a, **k)
        finally:
            _add("committer db.flush (the commit, fsync included)", time.perf_counter() - t0)

    trellisdb.database.Database.flush = timed_flush  # type: ignore[method-assign]

    for name, label in (("step", "Service.step (in a worker thread)"),
                        ("_wait_durable", "  of which waiting for the flush")):
        if hasattr(service_cls, name):
            setattr(service_cls, name, _timed(label, getattr(service_cls, name)))

    body = server._body

    async def timed_body(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await body(*a, **k)
        finally:
            _add("request body read + json.loads", time.perf_counter() - t0)

    server._body = timed_body

    run_in_threadpool = starlette.concurrency.run_in_threadpool

    async def timed_pool(func: Callable[..., Any], *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        started: list[float] = []

        def inner() -> Any:
            started.append(time.perf_counter())
            try:
                return func(*a, **k)
            finally:
                started.append(time.perf_counter())

        try:
            return await run_in_threadpool(inner)
        finally:
            if len(started) == 2:
                _add("thread pool: handler -> worker start", started[0] - t0)
                _add("thread pool: worker end -> handler resumes", time.perf_counter() - started[1])

    starlette.concurrency.run_in_threadpool = timed_pool

    build_app = server.build_app

    def timed_build_app(*a: Any, **k: Any) -> Any:
        app = build_app(*a, **k)
        sized = [threads is None]

        async def asgi(scope: Any, receive: Any, send: Any) -> None:
            if not sized[0]:  # in the event loop (the lifespan scope comes first): size its thread pool
                import anyio.to_thread

                anyio.to_thread.current_default_thread_limiter().total_tokens = threads
                sized[0] = True
            if scope.get("type") != "http":
                await app(scope, receive, send)
                return
            t0 = time.perf_counter()
            try:
                await app(scope, receive, send)
            finally:
                _add(f"ASGI app {scope.get('method')} {scope.get('path')} (request in -> response out)",
                     time.perf_counter() - t0)
        return asgi

    server.build_app = timed_build_app


def _cpu_by_thread() -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds so far) for every thread of this process."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid_s in os.listdir("/proc/self/task"):
        tid = int(tid_s)
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as fh:
                comm = fh.read().strip()
        except OSError:
            continue
        out[tid] = (names.get(tid, f"native:{comm}"), (int(fields[11]) + int(fields[12])) / tick)
    return out


def _role(name: str) -> str:
    if name == "MainThread":
        return "event loop (HTTP, routing, JSON)"
    if name == "trellisdb-server-commit":
        return "group committer"
    if name.startswith("AnyIO worker"):
        return "thread pool workers (Service.step)"
    if name.startswith("native:"):
        return "native threads (Lance, DuckDB, tokio)"
    return "other Python threads (checkpoint, compaction, index)"


#: profile buckets: the first whose pattern is in a function's file (or name) takes its own time
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("profiler's own wrappers", ("server_profile.py", "time.perf_counter")),
    ("fsync (os.fsync/fdatasync)", ("posix.fsync", "posix.fdatasync")),
    ("HTTP parsing and writing (h11, uvicorn)", ("/h11/", "/uvicorn/")),
    ("Starlette routing, requests, responses", ("/starlette/",)),
    ("thread pool handoff (anyio)", ("/anyio/",)),
    ("asyncio event loop, selectors, sockets", ("/asyncio/", "selectors.py", "select.", "_socket.", "socket.")),
    ("JSON (json module)", ("/json/", "_json.")),
    ("threading locks and conditions", ("threading.py", "_thread.")),
    ("trellisdb server module", ("trellisdb/server.py",)),
    ("trellisdb staging: writer, ids, membership (add_node, add_reward)",
     ("trellisdb/writer.py", "trellisdb/ids.py", "trellisdb/membership.py", "trellisdb/names.py",
      "trellisdb/batch.py")),
    ("trellisdb commit: committer, WAL frame, log", ("trellisdb/committer.py", "trellisdb/storage/",)),
    ("trellisdb other", ("trellisdb/",)),
    ("Arrow / Lance / DuckDB (native calls)", ("pyarrow", "lance", "duckdb")),
]


#: inclusive CPU of the write path's parts (functions that do not nest in one another):
#: (label, file name ends with, function name)
PARTS: list[tuple[str, str, str]] = [
    ("HTTP request parsing (uvicorn h11 data_received -> h11, task start)", "h11_impl.py", "data_received"),
    ("HTTP response writing (uvicorn h11 send -> h11, socket send)", "h11_impl.py", "send"),
    ("request body read + json.loads (server._body)", "server.py", "_body"),
    ("wire.decode of the body", "wire.py", "decode"),
    ("JSON response rendering (starlette JSONResponse.render)", "responses.py", "render"),
    ("thread pool handoff, event-loop side (anyio run_sync_in_worker_thread)", "_asyncio.py",
     "run_sync_in_worker_thread"),
    ("Service.step in the worker (validation, add_node, add_reward, ticket, wait)", "service.py", "step"),
    ("  of which add_node", "writer.py", "add_node"),
    ("  of which add_reward", "writer.py", "add_reward"),
    ("group committer: db.flush (frame encode, WAL append, fsync)", "database.py", "flush"),
    ("asyncio loop's own work (_run_once, own time only)", "base_events.py", "_run_once"),
]


def _parts(raw: dict[Any, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, file, name in PARTS:
        tot = 0.0
        for (f, _line, n), (_cc, _nc, tt, ct, _callers) in raw.items():
            if n == name and f.endswith(file) and (file != "service.py" or "trellisdb" in f):
                tot += tt if "own time" in label else ct
        out[label] = tot
    return out


def _bucket(func: tuple[str, int, str]) -> str:
    file, _, name = func
    key = f"{file}:{name}" if file != "~" else name
    for label, pats in BUCKETS:
        if any(p in key for p in pats):
            return label
    return "other (Python builtins, stdlib)"


class _Recorded:
    """Stats already taken, in the shape ``pstats.Stats`` loads."""

    def __init__(self, stats: dict[Any, Any]) -> None:
        self.stats = stats

    def create_stats(self) -> None:
        pass


class Window:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.t0 = 0.0
        self.cpu0: dict[int, tuple[str, float]] = {}

    def start(self, *_: Any) -> None:
        with _plock:
            for _, p in _profiles:
                p.clear()
        with _tlock:
            _timers.clear()
        self.cpu0 = _cpu_by_thread()
        self.t0 = time.perf_counter()

    def stop(self, *_: Any) -> None:
        wall = time.perf_counter() - self.t0
        cpu1 = _cpu_by_thread()
        with _tlock:
            timers = {k: {"count": int(v[0]), "total_s": round(v[1], 4),
                          "mean_ms": round(v[1] / v[0] * 1e3, 3) if v[0] else None} for k, v in _timers.items()}
        roles: dict[str, float] = defaultdict(float)
        for tid, (name, c) in cpu1.items():
            roles[_role(name)] += c - self.cpu0.get(tid, (name, 0.0))[1]
        with _plock:
            profs = list(_profiles)
        stats: pstats.Stats | None = None
        for _, p in profs:
            # the stats so far, calls in progress left out: create_stats() would disable the profiler
            # (from this thread) and close every open call of its thread with this thread's clock
            p.snapshot_stats()
            if not p.stats:  # type: ignore[attr-defined]
                continue
            st = pstats.Stats(_Recorded(p.stats))  # type: ignore[attr-defined]
            if stats is None:
                stats = st
            else:
                stats.add(st)
        buckets: dict[str, float] = defaultdict(float)
        top: list[dict[str, Any]] = []
        parts: dict[str, float] = {}
        if stats is not None:
            raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
            parts = _parts(raw)
            for func, (_cc, _nc, tt, _ct, _callers) in raw.items():
                buckets[_bucket(func)] += tt
            for func, (_cc, nc, tt, ct, _callers) in sorted(raw.items(), key=lambda kv: -kv[1][2])[:25]:
                top.append({"function": f"{Path(func[0]).name}:{func[1]}({func[2]})", "calls": nc,
                            "tottime_s": round(tt, 4), "cumtime_s": round(ct, 4)})
            stats.dump_stats(str(self.out) + ".pstats")
            buf = io.StringIO()
            pstats.Stats(str(self.out) + ".pstats", stream=buf).sort_stats("cumulative").print_stats(40)
            Path(str(self.out) + ".txt").write_text(buf.getvalue())
        total_cpu = sum(roles.values())
        self.out.write_text(json.dumps({
            "wall_s": round(wall, 3),
            "cpu_s_by_role": {k: round(v, 3) for k, v in sorted(roles.items(), key=lambda kv: -kv[1])},
            "cpu_s_total": round(total_cpu, 3),
            "timers": timers,
            "profile_cpu_s_by_part": {k: round(v, 4) for k, v in parts.items()},
            "profile_cpu_s_by_bucket": {k: round(v, 4) for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])},
            "profile_top_by_own_cpu": top,
        }, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-cprofile", action="store_true", help="timers and CPU per thread only")
    ap.add_argument("--window", type=float, default=None, help="the group-commit window in seconds")
    ap.add_argument("--threads", type=int, default=None, help="the thread pool's size")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval")
    a = ap.parse_args()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    _instrument(a.window, a.threads)
    w = Window(Path(a.out))
    signal.signal(signal.SIGUSR1, w.start)
    signal.signal(signal.SIGUSR2, w.stop)
    if not a.no_cprofile:
        threading.setprofile(_thread_hook)
        main_profile = cProfile.Profile(time.thread_time)
        with _plock:
            _profiles.append(("MainThread", main_profile))
        main_profile.enable()
    from trellisdb.server import serve

    print(f"serving {a.db} on http://127.0.0.1:{a.port} (profiled)", file=sys.stderr, flush=True)
    serve(a.db, port=a.port)


if __name__ == "__main__":
    main()
