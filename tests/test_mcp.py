"""trellisdb's MCP server (issue 25) through the SDK's own client: in-process, over stdio, and over
streamable HTTP mounted in a Starlette app served by a real uvicorn (its steps through the HTTP
server's group commit, its bearer token)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest

pytest.importorskip("mcp")

import httpx
import uvicorn
from mcp import Client, MCPError, StdioServerParameters
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from trellisdb.database import Database, open_local
from trellisdb.mcp_server import _transport_security, build_server, http_app
from trellisdb.service import Caller, Service

from .serving import mcp_calls

TOKEN = "mcp-s3cret"


def _call(server: Any, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    async def go() -> list[Any]:
        async with Client(server) as c:
            return [await c.call_tool(name, args) for name, args in calls]
    return anyio.run(go)


def test_an_agent_records_steps_and_queries_in_process(tmp_path: Path) -> None:
    db = open_local(tmp_path / "db", embedding_dim=4)
    try:
        server = build_server(db)
        r = _call(server, [
            ("record_step", {"session": "s1", "task": "pack", "summary": "root", "id": "r",
                             "rewards": {"score": 0.1}}),
            ("record_step", {"session": "s1", "summary": "greedy", "id": "a", "parents": ["r"],
                             "artifacts": {"code": "def f(): ..."}, "rewards": {"score": 0.7}}),
            ("record_step", {"session": "s1", "summary": "hexagonal", "id": "b", "parents": ["r"],
                             "rewards": {"score": 0.9}, "attrs": {"island": 1}}),
            ("frontier", {"channel": "score", "k": 5}),
            ("lineage", {"node": "b"}),
            ("query", {"tql": "NODES WHERE attr('island') = $i RETURN id", "params": {"i": 1}}),
            ("compare", {"session": "s1", "a": "a", "b": "b", "preferred": "b"}),
            ("add_reward", {"session": "s1", "node": "a", "channel": "score", "value": 0.95}),
            ("frontier", {"channel": "score", "k": 1}),
            ("retrieve", {"text": "hexagonal", "k": 1}),
        ])
        assert [x.is_error for x in r] == [False] * 10, [x.content for x in r if x.is_error]
        assert r[0].structured_content["id"] == "r" and isinstance(r[0].structured_content["commit"], int)
        assert [row["id"] for row in r[3].structured_content["rows"]] == ["b", "a"]
        assert [(row["id"], row["hop"]) for row in r[4].structured_content["rows"]] == [("b", 0), ("r", 1)]
        assert r[5].structured_content["rows"] == [{"id": "b"}]
        assert [row["id"] for row in r[8].structured_content["rows"]] == ["a"]  # re-scored
        assert r[9].structured_content["rows"][0]["id"] == "b"
        assert db.sql("SELECT preferred FROM comparisons").to_pylist() == [{"preferred": "b"}]
        assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 3}]
    finally:
        db.close()


def test_errors_reach_the_agent_with_their_message(tmp_path: Path) -> None:
    db = open_local(tmp_path / "db", embedding_dim=4)
    try:
        r = _call(build_server(db), [
            ("query", {"tql": "FRONTEIR LIMIT 3"}),
            ("record_step", {"session": "new", "summary": "x"}),
            ("record_step", {"session": "s", "task": "t", "summary": "x", "parents": ["ghost"]}),
            ("frontier", {"channel": "score", "k": 100000}),
            ("record_step", {"session": "s", "task": "t", "id": "half", "summary": "x", "rewards": {"": 1.0}}),
            ("retrieve", {"text": "x", "space": "minilm; DROP TABLE nodes"}),
        ])
        assert all(x.is_error for x in r)
        assert "reward channel must not be empty" in r[4].content[0].text
        db.flush()  # nothing of the refused step was staged either
        assert db.sql("SELECT count(*) AS n FROM nodes_history WHERE id = 'half'").to_pylist() == [{"n": 0}]
        text = [x.content[0].text for x in r]
        assert "QuerySyntaxError" in text[0] and "FRONTEIR" in text[0]
        assert "give its task" in text[1]
        assert "UnknownParentError" in text[2] and "ghost" in text[2]
        assert "validation error" in text[3]
    finally:
        db.close()


def test_resources_and_stdio(tmp_path: Path) -> None:
    path = tmp_path / "db"
    open_local(path, embedding_dim=4).close()
    params = StdioServerParameters(command=sys.executable, args=["-m", "trellisdb.cli", "--db", str(path), "mcp"])

    async def go() -> tuple[list[str], str, Any]:
        async with Client(params) as c:
            uris = [str(x.uri) for x in (await c.list_resources()).resources]
            tql = (await c.read_resource("trellis://tql")).contents[0].text  # type: ignore[union-attr]
            step = await c.call_tool("record_step", {"session": "s", "task": "t", "summary": "over stdio"})
            return uris, tql, step

    uris, tql, step = anyio.run(go)
    assert sorted(uris) == ["trellis://schema", "trellis://tql"]
    assert "FRONTIER" in tql
    assert not step.is_error
    db = open_local(path, read_only=True)
    try:
        assert db.sql("SELECT summary, provenance FROM nodes").to_pylist() == [
            {"summary": "over stdio", "provenance": "mcp:stdio"}]
    finally:
        db.close()
    assert json.dumps(step.structured_content)


# ---------------------------------------------------------------- streamable HTTP (issue 25)

class Served(NamedTuple):
    url: str
    db: Database
    steps: list[dict[str, Any]]  # the bodies record_step handed to the server's step


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The MCP endpoint mounted as ``trellis serve`` mounts it: after the host's own routes, its
    session manager run by the host's lifespan, its steps through ``Service.step``."""
    db = open_local(tmp_path_factory.mktemp("mcp-http") / "db", embedding_dim=4)
    service = Service(db)
    steps: list[dict[str, Any]] = []

    class Recorded(Caller):
        def step(self, body: Mapping[str, Any]) -> dict[str, Any]:
            steps.append(dict(body))
            return super().step(body)

    mcp_app, mcp_lifespan = http_app(db, writes=Recorded(service, None), token=TOKEN)

    async def health(request: Request) -> Response:
        return JSONResponse({"ok": True})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with mcp_lifespan():
            yield

    app = Starlette(routes=[Route("/v1/health", health), Mount("/", app=mcp_app)], lifespan=lifespan)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield Served(f"http://127.0.0.1:{port}", db, steps)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        service.close()
        db.close()


def _http_calls(url: str, calls: list[tuple[str, dict[str, Any]]], token: str = TOKEN) -> tuple[list[str], list[Any]]:
    return mcp_calls(url, token, calls)


def test_an_agent_over_streamable_http_steps_through_the_server_group_commit(served: Served) -> None:
    url, db, steps = served
    with db.session(task="pack", id="old", agent="someone") as s:  # a session the server did not open
        s.add_node(id="o1", summary="before")
    before = len(steps)
    names, r = _http_calls(url, [
        ("record_step", {"session": "h1", "task": "pack", "summary": "root", "id": "hr", "rewards": {"score": 0.1}}),
        ("record_step", {"session": "h1", "summary": "greedy", "id": "ha", "parents": ["hr"],
                         "artifacts": {"code": "def f(): ..."}, "rewards": {"score": 0.7}}),
        ("record_step", {"session": "h1", "summary": "hexagonal", "id": "hb", "parents": ["hr"],
                         "rewards": {"score": 0.9}, "attrs": {"island": 7}}),
        ("record_step", {"session": "old", "summary": "after", "id": "o2", "parents": ["o1"]}),  # task found
        ("frontier", {"channel": "score", "k": 5, "session": "h1"}),
        ("query", {"tql": "NODES WHERE attr('island') = $i RETURN id, summary", "params": {"i": 7}}),
        ("add_reward", {"session": "h1", "node": "ha", "channel": "score", "value": 0.95}),
        ("frontier", {"channel": "score", "k": 1, "session": "h1"}),
    ])
    assert names == ["add_reward", "compare", "frontier", "lineage", "query", "record_step", "retrieve"]
    assert [x.is_error for x in r] == [False] * 8, [x.content for x in r if x.is_error]
    assert [x.structured_content["id"] for x in r[:4]] == ["hr", "ha", "hb", "o2"]
    # every record_step went through the server's step, as a POST /v1/steps body
    new = steps[before:]
    assert [(b["session"], b["task"], b["node"]["id"], b["rewards"]) for b in new] == [
        ("h1", "pack", "hr", {"score": 0.1}), ("h1", "pack", "ha", {"score": 0.7}),
        ("h1", "pack", "hb", {"score": 0.9}), ("old", "pack", "o2", {})]
    assert new[0]["agent"] == "mcp" and "agent" not in new[3]  # a reopened session keeps its agent
    assert new[1]["node"]["parents"] == ["hr"] and new[1]["node"]["artifacts"] == {"code": "def f(): ..."}
    for x in r[:4]:  # durable on return: visible as of the commit the call returned
        n = db.sql("SELECT count(*) AS n FROM nodes WHERE id = $1", as_of=x.structured_content["commit"],
                   params=[x.structured_content["id"]]).to_pylist()
        assert n == [{"n": 1}]
    assert [(row["id"], row["reward"]) for row in r[4].structured_content["rows"]] == [("hb", 0.9), ("ha", 0.7)]
    assert r[5].structured_content["rows"] == [{"id": "hb", "summary": "hexagonal"}]
    assert isinstance(r[6].structured_content["commit"], int)
    assert [row["id"] for row in r[7].structured_content["rows"]] == ["ha"]  # re-scored over MCP
    assert db.sql("SELECT agent FROM sessions WHERE id = 'old'").to_pylist() == [{"agent": "someone"}]


def test_the_mcp_endpoint_wants_the_token_and_a_local_host(served: Served) -> None:
    url = served.url
    ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
    accept = {"accept": "application/json, text/event-stream"}
    for auth in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN}):
        r = httpx.post(f"{url}/mcp", json=ping, headers={**accept, **auth})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"] == "Unauthorized" and "Bearer <token>" in r.json()["message"]
    good = {**accept, "authorization": f"Bearer {TOKEN}"}
    assert httpx.post(f"{url}/mcp", json=ping, headers={**good, "host": "evil.example"}).status_code == 421
    assert httpx.get(f"{url}/v1/health").json() == {"ok": True}  # the host's routes come before the mount
    with pytest.raises(ExceptionGroup) as refused:  # the SDK client cannot even connect with a bad token
        _http_calls(url, [("query", {"tql": "NODES RETURN id"})], token="wrong")
    assert refused.group_contains(MCPError, match="error response", depth=None)


def test_errors_over_streamable_http_arrive_as_tool_errors(served: Served) -> None:
    before = len(served.steps)
    _, r = _http_calls(served.url, [
        ("query", {"tql": "FRONTEIR LIMIT 3"}),
        ("record_step", {"session": "e1", "task": "t", "summary": "x", "parents": ["ghost"]}),
        ("record_step", {"session": "brand-new", "summary": "x"}),
        ("record_step", {"session": "e1", "task": "t", "summary": "x", "rewards": {"": 1.0}}),
    ])
    assert [x.is_error for x in r] == [True] * 4
    text = [x.content[0].text for x in r]
    assert "QuerySyntaxError" in text[0] and "FRONTEIR" in text[0]
    assert "UnknownParentError" in text[1] and "ghost" in text[1]  # raised by the server's step
    assert "give its task" in text[2]
    assert "reward channel must not be empty" in text[3]
    assert len(served.steps) == before + 2  # the new session without a task never reached it


def test_dns_rebinding_protection_follows_the_bound_host() -> None:
    local = _transport_security("127.0.0.1", None)
    assert local.enable_dns_rebinding_protection and "localhost:*" in local.allowed_hosts
    assert "http://127.0.0.1:*" in local.allowed_origins
    assert not _transport_security("0.0.0.0", None).enable_dns_rebinding_protection  # --host: reached by any name
    named = _transport_security("0.0.0.0", ["trellis.lan", "10.0.0.5:7437"])
    assert named.enable_dns_rebinding_protection
    assert {"trellis.lan", "trellis.lan:*", "10.0.0.5:7437", "127.0.0.1:*"} <= set(named.allowed_hosts)
    assert "https://trellis.lan:*" in named.allowed_origins
    assert "127.0.0.2:*" in _transport_security("127.0.0.2", None).allowed_hosts
    assert "[::1]:*" in _transport_security("::1", None).allowed_hosts
