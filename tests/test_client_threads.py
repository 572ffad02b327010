"""One remote handle shared by many threads (issue 35, item 8): as thread-safe as the embedded one."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import trellisdb
from trellisdb.client import RemoteDatabase

from .serving import free_port, start, stop

TOKEN = "threads-token"
THREADS = 32
STEPS = 16


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = start(tmp_path / "db", port, TOKEN)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


def test_one_handle_shared_by_32_threads_loses_no_step(url: str) -> None:
    """32 threads share one ``connect("http://...")`` handle, each writing its own session a
    transaction per step (begin, node, reward, commit: four requests); every step is there
    afterwards, and no call failed.

    The race this catches (``/v1/tx/begin: [Errno 9] Bad file descriptor`` in one run of three)
    was in the connection pool that one shared ``httpx.Client`` gives all threads (httpcore
    1.0.9): a request is assigned an idle connection under the pool's lock, but the connection
    turns ACTIVE only later, when the request's thread starts sending on it, outside the lock.
    In between, another thread's pass over the pool (at each request's start and each response's
    end) still sees that connection idle and closes it as surplus (httpcore counts *every*
    connection against ``max_keepalive_connections``, 20 by default, so with more than 20
    threads each pass closes idle ones) or as expired: the socket is closed under the thread
    that is writing or reading it (EBADF), or the request is cut. It needs a thread switch inside
    that window of a few dozen bytecodes, so it is not deterministic: the test makes threads
    switch every 10 µs instead of every 5 ms (``sys.setswitchinterval``) to make one likely; on
    main it failed about one run in three (~2,000 requests). Each thread now has its own client."""
    db = trellisdb.connect(url, token=TOKEN)
    assert isinstance(db, RemoteDatabase)
    errors: list[BaseException] = []
    start_line = threading.Barrier(THREADS)

    def agent(k: int) -> None:
        try:
            s = db.session(task="threads", id=f"t{k}", agent=f"a{k}")
            start_line.wait()
            for step in range(STEPS):
                with db.transaction(message=f"t{k} step {step}"):
                    node = s.add_node(id=f"t{k}-{step}", summary=f"thread {k} step {step}")
                    s.add_reward(node, "score", step / STEPS)
            s.close()
        except BaseException as e:
            errors.append(e)
            start_line.abort()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(agent, range(THREADS)))
        sys.setswitchinterval(interval)
        assert errors == []
        rows = db.sql("SELECT n.id, r.value FROM nodes n JOIN rewards r ON r.node_id = n.id "
                      "WHERE n.task_id = 'threads'").to_pylist()
        assert sorted(r["id"] for r in rows) == sorted(f"t{k}-{s}" for k in range(THREADS) for s in range(STEPS))
        commits = [c for c in db.log() if (c.get("message") or "").startswith("t")]
        assert len(commits) == THREADS * STEPS  # a commit per step: each transaction stayed its thread's
    finally:
        sys.setswitchinterval(interval)
        db.close()
