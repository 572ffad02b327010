"""``trellis serve`` (issue 25, first slice): a real server process, real HTTP, the client.

Many clients' steps are group-committed together and each returns once durable; queries and
SQL come back as Arrow; bad input, a bad token and an oversized body are clear 4xx errors that
leave the server serving the others."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

import trellisdb
from trellisdb.client import RemoteDatabase, RemoteError

from .serving import free_port, start, stop

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    path = tmp_path_factory.mktemp("srv") / "db"
    port = free_port()
    proc = start(path, port, TOKEN)
    try:
        yield f"http://127.0.0.1:{port}", path
    finally:
        stop(proc)


def test_steps_from_many_clients_share_commits_and_are_durable(server: tuple[str, Path]) -> None:
    url, _ = server

    def agent(i: int) -> list[dict[str, object]]:
        with RemoteDatabase(url, token=TOKEN) as db:
            out, parent = [], None
            for k in range(5):
                r = db.record_step(session=f"agent-{i}", task="t", agent="a", summary=f"a{i} step {k}",
                                   parents=[parent] if parent else [], rewards={"score": k / 10},
                                   artifacts={"code": f"print({i}, {k})"}, attrs={"agent": i})
                out.append(r)
                parent = r["id"]
            return out

    with ThreadPoolExecutor(8) as pool:
        results = [r for rs in pool.map(agent, range(8)) for r in rs]
    assert len({r["id"] for r in results}) == 40
    with RemoteDatabase(url, token=TOKEN) as db:
        for r in results:  # each step is visible as of the commit its call returned
            assert db.sql("SELECT count(*) AS n FROM nodes WHERE id = $1", as_of=r["commit"],
                          params=[r["id"]]).to_pylist() == [{"n": 1}]
        got = db.query("NODES GROUP BY session_id ORDER BY session_id RETURN session_id, count(*) AS n").to_pylist()
        assert got == [{"session_id": f"agent-{i}", "n": 5} for i in range(8)]
        best = db.query("FRONTIER WHERE attr('agent') = 3 RANK BY reward('score') DESC LIMIT 1 RETURN id").to_pylist()
        assert best == [{"id": results[3 * 5 + 4]["id"]}]
        assert db.sql("SELECT count(*) AS n FROM rewards").to_pylist() == [{"n": 40}]
        # the log says each call's commit held its step: fewer commits than steps when clients overlap
        log = db.log()
        assert sum(c["rows"] for c in log) >= 40 * 5 and len(log) <= 40 + 9


def test_a_step_returns_only_once_durable(server: tuple[str, Path]) -> None:
    url, path = server
    with RemoteDatabase(url, token=TOKEN) as db:
        r = db.record_step(session="durable", task="t", id="d1", summary="kept")
    # another process reads the folder: the acknowledged step is there
    out = subprocess.run(
        [sys.executable, "-c", f"import trellisdb; db = trellisdb.connect({str(path)!r}, read_only=True); "
         "print(db.sql(\"SELECT id FROM nodes WHERE id = 'd1'\").to_pylist())"],
        capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "'d1'" in out.stdout and r["id"] == "d1"


def test_errors_are_clear_and_the_server_keeps_serving(server: tuple[str, Path]) -> None:
    url, _ = server
    with RemoteDatabase(url, token=TOKEN) as db:
        with pytest.raises(trellisdb.QuerySyntaxError, match="FRONTEIR"):
            db.query("FRONTEIR LIMIT 3")
        with pytest.raises(trellisdb.QueryError, match="read-only"):
            db.sql("DELETE FROM nodes")
        with pytest.raises(trellisdb.UnknownParentError, match="ghost"):
            db.record_step(session="e", task="t", parents=["ghost"])
        with pytest.raises(trellisdb.ValidationError, match="unknown field"):
            db.record_step(session="e", task="t", colour="red")
        # a step whose reward is bad writes nothing, not even its node (all or nothing)
        with pytest.raises(trellisdb.ValidationError, match="JSON"):  # refused before it is sent
            db.record_step(session="e", task="t", id="half", summary="x", rewards={"score": float("inf")})
        r = httpx.post(f"{url}/v1/steps", headers={"authorization": f"Bearer {TOKEN}"},
                       content=b'{"session": "e", "task": "t", "node": {"id": "half"}, "rewards": {"score": 1e400}}')
        assert r.status_code == 400 and r.json()["error"] == "InvalidRewardError"
        with pytest.raises(trellisdb.ValidationError, match="reward channel"):
            db.record_step(session="e", task="t", id="half", summary="x", rewards={"": 1.0})
        with pytest.raises(trellisdb.ValidationError, match=r"control character|session id"):
            db.record_step(session="bad\x00id", task="t", summary="x")
        assert db.record_step(session="e", task="t", id="whole", summary="x", rewards={"score": 1.0})["id"] == "whole"
        assert db.sql("SELECT id FROM nodes_history WHERE id IN ('half', 'whole')").to_pylist() == [{"id": "whole"}]
    with RemoteDatabase(url, token="wrong") as bad, pytest.raises(trellisdb.AccessError, match="Bearer"):
        bad.health()
    h = {"authorization": f"Bearer {TOKEN}"}
    r = httpx.post(f"{url}/v1/query", content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"] == "MalformedBody"
    r = httpx.post(f"{url}/v1/steps", content=b"x" * (17 << 20), headers=h)
    assert r.status_code == 413
    r = httpx.post(f"{url}/v1/query", json=["a list"], headers=h)
    assert r.status_code == 400
    with RemoteDatabase(url, token=TOKEN) as db:  # still serving
        assert db.health()["ok"] is True


def test_an_unreachable_server_is_a_clear_error() -> None:
    with RemoteDatabase(f"http://127.0.0.1:{free_port()}") as db, pytest.raises(RemoteError, match="trellis serve"):
        db.health()


def test_kill_9_under_load_loses_nothing_acknowledged(tmp_path: Path) -> None:
    """Agents write steps with their own ids while the server is SIGKILLed: every acknowledged
    step survives the restart, a retry of an unacknowledged one (same id) is idempotent, and the
    store verifies clean."""
    path, port = tmp_path / "db", free_port()
    proc = start(path, port)
    url = f"http://127.0.0.1:{port}"
    acked: dict[str, int] = {}
    lost: list[tuple[int, int]] = []

    def agent(i: int) -> None:
        with RemoteDatabase(url, timeout=10) as db:
            for k in range(200):
                try:
                    r = db.record_step(session=f"a{i}", task="t", id=f"a{i}-{k}", summary=f"step {k}",
                                       rewards={"score": k / 200})
                    acked[r["id"]] = r["commit"]
                except (RemoteError, trellisdb.TrellisError):
                    lost.append((i, k))
                    return

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(agent, i) for i in range(4)]
        deadline = time.monotonic() + 30
        while len(acked) < 40 and time.monotonic() < deadline:
            time.sleep(0.01)
        proc.kill()  # SIGKILL, mid-load
        proc.wait(timeout=30)
        for f in futures:
            f.result()
    assert len(acked) >= 40 and lost, "the kill should have cut some agents off mid-step"
    proc = start(path, port)
    try:
        with RemoteDatabase(url) as db:
            have = {r["id"] for r in db.sql("SELECT id FROM nodes").to_pylist()}
            assert set(acked) <= have  # nothing acknowledged is lost
            for i, k in lost:  # the agents retry the step they lost, with its id
                r = db.record_step(session=f"a{i}", task="t", id=f"a{i}-{k}", summary=f"step {k}",
                                   rewards={"score": k / 200})
                assert r["id"] == f"a{i}-{k}"
            n = db.sql("SELECT count(*) AS n, count(DISTINCT id) AS d FROM nodes_history").to_pylist()[0]
            assert n["n"] == n["d"]  # no step written twice
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with trellisdb.connect(path) as db:
        assert db.verify() == []


def test_an_mcp_agent_and_an_http_client_share_the_served_store(server: tuple[str, Path]) -> None:
    """`trellis serve` answers MCP over streamable HTTP at /mcp (the SDK's own client), with the
    same token; its steps land in the store the REST client reads."""
    import anyio
    import httpx2
    from mcp import Client, MCPError
    from mcp.client.streamable_http import streamable_http_client

    url, _ = server

    async def agent(token: str) -> list[Any]:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30))
        async with http, Client(streamable_http_client(f"{url}/mcp", http_client=http)) as c:
            return [
                await c.call_tool("record_step", {"session": "mcp-1", "task": "mcp-task", "summary": "via mcp",
                                                  "id": "mcp-a", "rewards": {"score": 0.8}}),
                await c.call_tool("query", {"tql": "NODES WHERE task_id = 'mcp-task' RETURN id, summary"}),
            ]

    step, rows = anyio.run(agent, TOKEN)
    assert not step.is_error and step.structured_content["id"] == "mcp-a"
    assert rows.structured_content["rows"] == [{"id": "mcp-a", "summary": "via mcp"}]
    with RemoteDatabase(url, token=TOKEN) as db:  # durable as of the commit the tool returned
        assert db.sql("SELECT value FROM rewards WHERE node_id = 'mcp-a'", as_of=step.structured_content["commit"]
                      ).to_pylist() == [{"value": 0.8}]
    with pytest.raises(ExceptionGroup) as refused:  # the SDK client cannot connect with a bad token
        anyio.run(agent, "wrong-token")
    assert refused.group_contains(MCPError, depth=None)
    r = httpx.post(f"{url}/mcp", json={})
    assert r.status_code == 401 and r.json()["error"] == "Unauthorized"


def test_a_slow_client_gets_408_and_slows_no_one(tmp_path: Path) -> None:
    """A client that trickles its body holds its own connection only: others are answered at
    their usual pace meanwhile, and it gets a JSON 408 once the body timeout passes."""
    import socket

    port = free_port()
    proc = start(tmp_path / "db", port, TOKEN, "--body-timeout", "1.5")
    try:
        slow = []
        for _ in range(4):  # several trickling clients at once
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST /v1/steps HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"session\"")
            slow.append(s)
        t0 = time.monotonic()
        with RemoteDatabase(f"http://127.0.0.1:{port}", token=TOKEN) as db:
            for k in range(5):
                db.record_step(session="quick", task="t", summary=f"s{k}")
            assert db.query("NODES RETURN count(*) AS n").to_pylist() == [{"n": 5}]
        assert time.monotonic() - t0 < 1.5  # answered while the slow bodies were still arriving
        for s in slow:
            s.settimeout(10)
            answer = b""
            while b"RequestTimeout" not in answer and (chunk := s.recv(4096)):
                answer += chunk
            s.close()
            assert answer.startswith(b"HTTP/1.1 408") and b'"error":"RequestTimeout"' in answer
    finally:
        stop(proc)


def test_a_failed_group_commit_reaches_the_calls_it_covered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush that fails is raised to every call waiting on it (in a thread or on an event loop);
    the writes stay pending and the next group commit makes them durable."""
    import asyncio

    from trellisdb.database import open_local
    from trellisdb.service import Service

    db = open_local(tmp_path / "db")
    service = Service(db)
    real, failures = db.flush, [OSError("disk full"), OSError("disk still full")]

    def flaky(meta: Any = None) -> Any:
        if failures:
            raise failures.pop(0)
        return real(meta)

    monkeypatch.setattr(db, "flush", flaky)
    try:
        with pytest.raises(trellisdb.CommitError, match="disk full; they are kept and retried"):
            service.step({"session": "s", "task": "t", "node": {"id": "a"}})

        async def step(node_id: str) -> int:  # the server's path: no thread held while it waits
            out, ticket = service.stage_step({"session": "s", "task": "t", "node": {"id": node_id}})
            assert out == {"id": node_id}
            return await service.durable_async(ticket)

        with pytest.raises(trellisdb.CommitError, match="disk still full"):
            asyncio.run(step("b"))
        commit = asyncio.run(step("c"))
        assert db.sql("SELECT id FROM nodes ORDER BY id", as_of=commit).to_pylist() == [
            {"id": "a"}, {"id": "b"}, {"id": "c"}]
    finally:
        service.close()
        db.close()
