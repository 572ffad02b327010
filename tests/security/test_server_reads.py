"""One analyst cannot stop ``trellis serve`` (issue 35, item 6): a real server process.

Queries run in read threads of their own, admitted a few at a time per token, per tenant and per
server (``--token-reads``, ``--tenant-reads``, ``--max-reads``; one that waits past
``--read-wait`` gets 429 / 503 ``BusyError``), each under the store's ``--query-timeout`` and ``--memory-limit``, and each is
interrupted when its client hangs up. Health is answered on the event loop and steps have
threads of their own, so neither waits behind the reads.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import trellisdb
from trellisdb.client import RemoteDatabase
from trellisdb.tenants import Tokens

from ..serving import free_port, start, stop
from .test_read_limits import BIG_GROUP_BY, LONG_SQL, clique


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system, every thread) process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_over(pid: int, seconds: float) -> float:
    start_cpu = cpu_s(pid)
    time.sleep(seconds)
    return cpu_s(pid) - start_cpu


def store(path: Path) -> dict[str, str]:
    """A store with the clique (a slow TQL PATH) and tokens: analysts of three tenants, an agent."""
    with trellisdb.connect(path) as db:
        assert isinstance(db, trellisdb.Database)
        clique(db, 160)  # a PATH over it runs ~20 s unlimited: well past the limits below
    tokens = Tokens(str(path))
    return {"analyst": tokens.create("default", "analyst", name="hostile"),
            "agent": tokens.create("default", "agent", name="worker"),
            "admin": tokens.create("default", "admin", name="boss"),
            "t2": tokens.create("t2", "analyst", name="t2-reader"),
            "t3": tokens.create("t3", "analyst", name="t3-reader")}


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, dict[str, str]]]:
    """A server with short limits: 4 s per query, 200 MiB per store, reads: 1 per token, 2 per
    tenant, 3 in all."""
    path = tmp_path_factory.mktemp("limited") / "db"
    tokens = store(path)
    port = free_port()
    proc = start(path, port, None, "--query-timeout", "4", "--memory-limit", "200MiB", "--token-reads", "1",
                 "--tenant-reads", "2", "--max-reads", "3", "--read-wait", "0.3", probe=tokens["admin"])
    url = f"http://127.0.0.1:{port}"
    for tenant in ("t2", "t3"):  # their stores made (on first use) before the tests time anything
        assert post(url, tokens[tenant], "/v1/sql", {"sql": "SELECT 1 AS x"}).status_code == 200
    try:
        yield f"http://127.0.0.1:{port}", proc.pid, tokens
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def default(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, dict[str, str]]]:
    """A server as `trellis serve` starts it: every limit at its default."""
    path = tmp_path_factory.mktemp("default") / "db"
    tokens = store(path)
    port = free_port()
    proc = start(path, port, None, probe=tokens["admin"])
    try:
        yield f"http://127.0.0.1:{port}", proc.pid, tokens
    finally:
        stop(proc)


def post(url: str, token: str, path: str, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"authorization": f"Bearer {token}"}, timeout=timeout)


def test_sql_and_tql_past_the_time_limit_are_stopped_and_free_the_cores(limited: tuple[str, int, dict[str, str]]
                                                                        ) -> None:
    url, pid, tokens = limited
    start_t = time.monotonic()
    r = post(url, tokens["analyst"], "/v1/sql", {"sql": LONG_SQL})
    assert r.status_code == 400 and r.json()["error"] == "QueryTimeoutError", r.text
    assert 3.5 < time.monotonic() - start_t < 12
    assert "4 s" in r.json()["message"] and "--query-timeout" in r.json()["message"]
    assert server_cpu_over(pid, 1.0) < 0.3  # the query is not running any more
    with RemoteDatabase(url, token=tokens["analyst"]) as db:
        with pytest.raises(trellisdb.QueryTimeoutError, match="query_timeout"):
            db.query("PATH FROM 'n0' TO 'z'")  # TQL: a walk around the cycles, seconds of DuckDB
        assert server_cpu_over(pid, 1.0) < 0.3
        assert db.query("NODES WHERE id = 'z' RETURN id").to_pylist() == [{"id": "z"}]


def test_a_query_past_the_memory_limit_is_stopped_with_the_limit_named(limited: tuple[str, int, dict[str, str]]
                                                                      ) -> None:
    url, _, tokens = limited
    with RemoteDatabase(url, token=tokens["analyst"]) as db:
        with pytest.raises(trellisdb.QueryMemoryError, match=r"200 MiB.*--memory-limit"):
            db.sql(BIG_GROUP_BY)
        assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 161}]


def test_reads_past_the_tokens_the_tenants_and_the_servers_turns_are_refused_clearly(
        limited: tuple[str, int, dict[str, str]]) -> None:
    url, _, tokens = limited
    out: dict[str, httpx.Response] = {}
    threads: list[threading.Thread] = []

    def long_read(who: str) -> None:
        def run() -> None:
            out[who] = post(url, tokens[who], "/v1/sql", {"sql": LONG_SQL})
        threads.append(threading.Thread(target=run))
        threads[-1].start()
        time.sleep(0.4)  # it has its turns

    def quick(who: str) -> httpx.Response:
        return post(url, tokens[who], "/v1/sql", {"sql": "SELECT 1 AS x"})

    long_read("analyst")  # the analyst's one turn
    r = quick("analyst")
    assert r.status_code == 429 and r.json()["error"] == "BusyError" and r.headers["retry-after"] == "1", r.text
    assert "token 'hostile'" in r.json()["message"] and "--token-reads" in r.json()["message"]
    assert quick("agent").status_code == 200  # one analyst's long query leaves its tenant a turn
    long_read("agent")  # both of the tenant's turns
    r = quick("admin")  # (an admin has no turns of its own: its tenant's)
    assert r.status_code == 429 and "tenant 'default'" in r.json()["message"], r.text
    assert "--tenant-reads" in r.json()["message"]
    long_read("t2")  # another tenant has turns of its own: the server's last one
    r = quick("t3")
    assert r.status_code == 503 and r.json()["error"] == "BusyError", r.text
    assert "the server" in r.json()["message"] and "--max-reads" in r.json()["message"]
    with RemoteDatabase(url, token=tokens["t3"]) as db, pytest.raises(trellisdb.BusyError):
        db.sql("SELECT 1 AS x")
    for t in threads:
        t.join()
    assert {who: r.json()["error"] for who, r in out.items()} == {  # each ran, stopped by its own time limit
        "analyst": "QueryTimeoutError", "agent": "QueryTimeoutError", "t2": "QueryTimeoutError"}
    assert quick("t3").json() == {"columns": ["x"], "rows": [{"x": 1}]}


def test_a_client_that_hangs_up_mid_query_gets_its_query_cancelled(default: tuple[str, int, dict[str, str]]) -> None:
    url, pid, tokens = default
    with pytest.raises(httpx.ReadTimeout):
        post(url, tokens["analyst"], "/v1/sql", {"sql": LONG_SQL}, timeout=1.0)  # gives up, closes the connection
    time.sleep(0.5)
    assert server_cpu_over(pid, 2.0) < 0.5  # before: both cores, until the query's end (hours)
    with pytest.raises(httpx.ReadTimeout):
        post(url, tokens["analyst"], "/v1/query", {"tql": "PATH FROM 'n0' TO 'z'"}, timeout=1.0)
    time.sleep(0.5)
    assert server_cpu_over(pid, 1.0) < 0.3
    start_t = time.monotonic()
    assert post(url, tokens["analyst"], "/v1/sql", {"sql": "SELECT 1 AS x"}).status_code == 200
    assert time.monotonic() - start_t < 2


def test_health_and_steps_answer_quickly_with_many_long_reads_in_flight(default: tuple[str, int, dict[str, str]]
                                                                       ) -> None:
    url, pid, tokens = default
    hostile = 50
    outcomes: list[Any] = []

    def long_read() -> None:
        try:
            outcomes.append(post(url, tokens["analyst"], "/v1/sql", {"sql": LONG_SQL}, timeout=8.0).json()["error"])
        except httpx.ReadTimeout:
            outcomes.append("hung up")

    threads = [threading.Thread(target=long_read) for _ in range(hostile)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # every one sent: the reads run or wait for a turn
    health = []
    with httpx.Client(headers={"authorization": f"Bearer {tokens['agent']}"}, timeout=10) as client:
        for _ in range(20):
            t0 = time.perf_counter()
            r = client.get(f"{url}/v1/health")
            health.append(time.perf_counter() - t0)
            assert r.status_code == 200
            time.sleep(0.05)
    assert max(health) < 1.0, health  # before: no answer at all once ~41 reads held every worker thread
    with RemoteDatabase(url, token=tokens["agent"]) as agent:
        t0 = time.perf_counter()
        step = agent.record_step(session="under-load", task="t", summary="still written")
        assert time.perf_counter() - t0 < 3.0
        for t in threads:
            t.join()
        assert len(outcomes) == hostile
        assert set(outcomes) <= {"hung up", "BusyError", "QueryTimeoutError"}
        time.sleep(0.5)
        assert server_cpu_over(pid, 1.0) < 0.3  # every hung-up client's query was cancelled
        t0 = time.perf_counter()
        assert agent.sql("SELECT summary FROM nodes WHERE id = $1", params=[step["id"]],
                         as_of=step["commit"]).to_pylist() == [{"summary": "still written"}]
        assert time.perf_counter() - t0 < 2  # the reads' turns are free again
