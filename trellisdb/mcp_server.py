"""trellisdb as an MCP server (issue 25): the tools an agent calls, over stdio (``trellis mcp
--db PATH``) or streamable HTTP mounted in ``trellis serve`` (:func:`http_app`). Built on the
official ``mcp`` SDK (the ``server`` extra).

Tools: ``query`` (any TQL), ``frontier``, ``lineage``, ``retrieve`` (vector-seeded, with lineage),
``record_step`` (a node with its artifacts and rewards in one call), ``add_reward``, ``compare``.
Resources: ``trellis://schema`` (the tables and columns) and ``trellis://tql`` (the TQL
reference). A ``TrellisError`` reaches the agent as a tool error with its message (a TQL
syntax error with its caret and hint), so the agent can correct itself.

Inside ``trellis serve``, the tools go through the server (``Writes``: every TQL statement of
``query``, ``frontier``, ``lineage`` and ``retrieve`` as the body of ``POST /v1/query``, so the
token's role is checked per statement as over REST; ``record_step`` as the body of ``POST
/v1/steps``, ``add_reward`` and ``compare`` as session calls), so MCP steps join the
cross-client group commit and carry the caller's token as their provenance and owner, and what
an agent may change is checked as for any client; the endpoint asks for the server's bearer
token.

>>> import tempfile, trellisdb
>>> server = build_server(trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4))
>>> sorted(t.name for t in server._tool_manager.list_tools())  # doctest: +SKIP
['add_reward', 'compare', 'frontier', 'lineage', 'query', 'record_step', 'retrieve']
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple, Protocol

import anyio.to_thread
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import DEFAULT_MAX_REQUEST_BODY_SIZE, TransportSecuritySettings
from pydantic import Field  # the SDK reads the tools' annotations, so their names live at module level
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from trellisdb.errors import TrellisError
from trellisdb.writer import reward_value

if TYPE_CHECKING:
    from trellisdb.database import Database
    from trellisdb.writer import SessionWriter

#: Rows a tool returns at most (an agent's context is small; the query says LIMIT for more).
MAX_ROWS = 200

_DOCS = Path(__file__).resolve().parents[1] / "docs"


def _rows(table: Any) -> dict[str, Any]:
    """A result as JSON-able rows (at most ``MAX_ROWS``), saying whether it was cut."""
    rows = table.to_pylist()
    out = json.loads(json.dumps(rows[:MAX_ROWS], default=str))
    return {"rows": out, "count": len(rows), "truncated": len(rows) > MAX_ROWS}


class Writes(Protocol):
    """What the tools call inside ``trellis serve`` (``service.Caller``: the server's ``Service``
    on behalf of the token the MCP session came with). The writes block, so they run in the tool's
    worker thread; ``query`` is awaited (a read waits for its turn on the event loop)."""

    async def query(self, body: Mapping[str, Any]) -> Any:
        """A ``POST /v1/query`` body in, its rows (an Arrow table) out; the token's role checked
        for the statement, the server's read turns and limits held (awaited on the event loop)."""

    def step(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        """A ``POST /v1/steps`` body in, ``{"id", "commit"}`` out once durable."""

    def call(self, body: Mapping[str, Any]) -> Any:
        """A ``POST /v1/call`` body (decoded) in, the method's result out."""

    def durable(self) -> int:
        """Every write made so far durable; the commit holding them."""


def build_server(db: Database, *, writes: Writes | None = None, read_only: bool = False) -> MCPServer:
    """The MCP server of the open database ``db``. With ``writes`` (the HTTP server's), the
    writing tools hand their writes to it instead of writing and flushing themselves, so MCP
    steps share the server's group commits with its other clients. ``read_only`` leaves out
    the writing tools (``record_step``, ``add_reward``, ``compare``): an analyst's."""
    mcp = MCPServer("trellisdb", instructions=(
        "An experience-graph store: attempts (nodes) with lineage, artifacts and rewards. Use `frontier` to pick "
        "what to expand, `record_step` to record what you did, `retrieve` to find similar past attempts with "
        "their lineage, `query` for any TQL (read trellis://tql)."))
    writers: dict[str, SessionWriter] = {}
    lock = threading.Lock()
    tasks: dict[str, str] = {}  # with ``writes``: the task of each session seen to exist

    def writing(fn: Any) -> Any:  # a writing tool: registered unless the server is read-only
        return fn if read_only else mcp.tool()(fn)

    async def run_tql(text: str, **params: Any) -> dict[str, Any]:
        """Every tool's TQL: through the server's one door for reads when served (the role check,
        its read turns and limits), else on a worker thread."""
        try:
            if writes is not None:
                table = await writes.query({"tql": text, "params": params})
            else:
                table = await anyio.to_thread.run_sync(lambda: db.query(text, **params).to_arrow())
        except TrellisError as e:  # its message reaches the agent (a plain exception's would not)
            raise ToolError(f"{type(e).__name__}: {e}") from e
        return _rows(table)

    def run(fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except TrellisError as e:  # its message reaches the agent (a plain exception's would not)
            raise ToolError(f"{type(e).__name__}: {e}") from e

    def writer(session: str, task: str | None) -> SessionWriter:
        with lock:
            w = writers.get(session)
            if w is None:
                existing = db.sql("SELECT task_id FROM sessions WHERE id = $1", params=[session]).to_pylist()
                if existing:
                    w = db.resume(session)
                elif task is None:
                    raise ToolError(f"session {session!r} is new: give its task")
                else:
                    w = db.session(task=task, id=session, agent="mcp")
                writers[session] = w
            return w

    @mcp.tool()
    async def query(tql: Annotated[str, Field(description="a TQL statement, e.g. NODES WHERE ... RETURN ...")],
              params: Annotated[dict[str, Any] | None, Field(description="values of $names")] = None
              ) -> dict[str, Any]:
        """Run a TQL query (see resource trellis://tql); rows as JSON."""
        return await run_tql(tql, **(params or {}))

    @mcp.tool()
    async def frontier(channel: Annotated[str, Field(description="reward channel to rank by")],
                 k: Annotated[int, Field(ge=1, le=MAX_ROWS)] = 10,
                 session: Annotated[str | None, Field(description="only this session's nodes")] = None,
                 per_parent: Annotated[int | None, Field(ge=1)] = None) -> dict[str, Any]:
        """The best nodes not yet expanded, by a reward channel: what to work on next."""
        scope = "FROM SESSION $s " if session else ""
        per = f" PER PARENT {int(per_parent)}" if per_parent else ""
        text = (f"FRONTIER {scope}RANK BY reward($ch) DESC{per} LIMIT {int(k)} "
                "RETURN id, summary, reward($ch) AS reward")
        return await run_tql(text, ch=channel, **({"s": session} if session else {}))

    @mcp.tool()
    async def lineage(node: str, direction: Annotated[str, Field(pattern="^(ancestors|descendants)$")] = "ancestors",
                hops: Annotated[int, Field(ge=1, le=10_000)] = 10) -> dict[str, Any]:
        """Where a node came from (ancestors) or what came of it (descendants), with hops."""
        text = f"LINEAGE OF $n {direction.upper()} {int(hops)} RETURN id, hop, summary, status"
        return await run_tql(text, n=node)

    @mcp.tool()
    async def retrieve(text: Annotated[str, Field(description="what to look for")],
                 k: Annotated[int, Field(ge=1, le=100)] = 5,
                 space: Annotated[str | None, Field(description="embedding space (a text space)")] = None,
                 expand_hops: Annotated[int, Field(ge=0, le=10)] = 2) -> dict[str, Any]:
        """Past attempts similar to ``text`` (vector search in ``space``, or keywords when there is
        none), with their lineage."""
        search = f"SIMILAR TO $t IN {space}" if space else "MATCHING $t"
        if space and not space.isidentifier():
            raise ToolError(f"space {space!r} is not a space name")
        expand = f" EXPAND LINEAGE {int(expand_hops)}" if expand_hops else ""
        q = f"RETRIEVE {int(k)} {search}{expand} RETURN id, relation, hop, summary"
        return await run_tql(q, t=text)

    @writing
    def record_step(session: str, summary: str, task: str | None = None,
                    parents: list[str] | None = None, kind: str = "attempt",
                    artifacts: dict[str, str] | None = None, rewards: dict[str, float] | None = None,
                    attrs: dict[str, Any] | None = None, action: str | None = None, state: str | None = None,
                    id: Annotated[str | None, Field(description="your id for the step: a retry with it is "
                                                               "idempotent")] = None) -> dict[str, Any]:
        """Record one step (a node, its parent edges, artifacts, rewards and attributes); returns
        its id once it is durable."""
        def write() -> dict[str, Any]:
            for ch, v in (rewards or {}).items():  # all or nothing: a bad reward stages no node
                reward_value(id or "(new node)", ch, v)
            w = writer(session, task)
            node_id = w.add_node(id=id, parents=parents or [], kind=kind, summary=summary, artifacts=artifacts,
                                 attrs=attrs, action=action, state=state)
            for ch, v in (rewards or {}).items():
                w.add_reward(node_id, ch, v)
            return {"id": node_id, "commit": db.flush() or db.snapshot().commit}

        def via_server(server: Writes) -> dict[str, Any]:
            body: dict[str, Any] = {
                "session": session, "rewards": rewards or {},
                "node": {"id": id, "parents": parents or [], "kind": kind, "summary": summary,
                         "artifacts": artifacts, "attrs": attrs, "action": action, "state": state}}
            known = tasks.get(session)
            if known is None:  # the server opens a session's writer from its task: find it once
                rows = db.sql("SELECT task_id FROM sessions WHERE id = $1", params=[session]).to_pylist()
                if rows:
                    known = str(rows[0]["task_id"])
                elif task is None:
                    raise ToolError(f"session {session!r} is new: give its task")
                else:
                    body["agent"] = "mcp"  # only for a new session: reopening checks a given agent
            body["task"] = task if task is not None else known
            out = dict(server.step(body))
            tasks[session] = body["task"]
            return {"id": out["id"], "commit": out["commit"]}

        # A plain ``def`` tool runs in a worker thread (anyio.to_thread), so blocking in ``step``
        # (until the group commit holding the step is durable) leaves the event loop free.
        result: dict[str, Any] = run(write) if writes is None else run(via_server, writes)
        return result

    @writing
    def add_reward(session: str, node: str, channel: str, value: float) -> dict[str, Any]:
        """Score a node on a reward channel (a later score of the same channel supersedes it)."""
        def score() -> dict[str, Any]:
            if writes is not None:
                writes.call({"method": "add_reward", "session": session, "args": [node, channel, value]})
                return {"commit": writes.durable()}
            writer(session, None).add_reward(node, channel, value)
            return {"commit": db.flush() or db.snapshot().commit}
        out: dict[str, Any] = run(score)
        return out

    @writing
    def compare(session: str, a: str, b: str,
                preferred: Annotated[str | None, Field(description="a, b, or null for a tie")],
                margin: float | None = None) -> dict[str, Any]:
        """Record a judgment between two nodes (for preference training data)."""
        def judge() -> dict[str, Any]:
            if writes is not None:
                cid = writes.call({"method": "add_comparison", "session": session, "args": [a, b, preferred],
                                   "kwargs": {"margin": margin, "judge": "mcp"}})
                return {"id": cid, "commit": writes.durable()}
            cid = writer(session, None).add_comparison(a, b, preferred, margin=margin, judge="mcp")
            return {"id": cid, "commit": db.flush() or db.snapshot().commit}
        out: dict[str, Any] = run(judge)
        return out

    @mcp.resource("trellis://schema", mime_type="text/markdown")
    def schema() -> str:
        """The tables and their columns."""
        return (_DOCS / "data-model.md").read_text() if (_DOCS / "data-model.md").exists() else "see trellisdb.schema"

    @mcp.resource("trellis://tql", mime_type="text/markdown")
    def tql() -> str:
        """The TQL reference."""
        return (_DOCS / "tql.md").read_text() if (_DOCS / "tql.md").exists() else "see docs/tql.md"

    return mcp


class McpHttp(NamedTuple):
    """What the HTTP server mounts: ``app``, the streamable-HTTP endpoint (an ASGI app), as
    ``Mount("/", app=app)`` after its own routes; ``lifespan``, which its lifespan must enter
    (``async with lifespan():``) while it serves; it can be entered once."""

    app: ASGIApp
    lifespan: Callable[[], AbstractAsyncContextManager[None]]


def http_app(db: Database, *, writes: Writes | None = None, token: str | None = None, path: str = "/mcp",
             host: str = "127.0.0.1", allowed_hosts: Sequence[str] | None = None,
             max_body: int = DEFAULT_MAX_REQUEST_BODY_SIZE, read_only: bool = False) -> McpHttp:
    """The MCP endpoint of ``db`` over streamable HTTP at ``path``, for ``trellis serve`` to mount.

    ``writes``: the server's (the writing tools join its group commit). ``token``:
    every request must carry ``Authorization: Bearer <token>`` (else 401, as the REST routes).
    ``host``: the address the server binds; on a loopback one, requests whose ``Host`` is not a
    loopback name are refused (421: DNS-rebinding protection); ``allowed_hosts`` (``"name"``,
    ``"name:port"`` or ``"name:*"``) are allowed besides the loopback names, on any address; on a
    non-loopback one without them the check is off. ``max_body``: the largest MCP message, in
    bytes (413 past it). ``read_only``: the reading tools only. Each call builds a fresh MCP
    server: its session manager runs once."""
    server = build_server(db, writes=writes, read_only=read_only)
    app: ASGIApp = server.streamable_http_app(
        streamable_http_path=path, max_request_body_size=max_body,
        transport_security=_transport_security(host, allowed_hosts))
    if token is not None:
        app = _require_token(app, token)
    return McpHttp(app, server.session_manager.run)  # the session manager exists once the app does


_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def _transport_security(host: str, allowed_hosts: Sequence[str] | None) -> TransportSecuritySettings:
    """The ``Host``/``Origin`` check of the MCP endpoint (see :func:`http_app`)."""
    if allowed_hosts is not None:  # loopback names stay allowed: a rebinding page never sends them
        names = [*_LOOPBACK_NAMES, *allowed_hosts]
    elif _is_loopback(host):
        names = [*_LOOPBACK_NAMES, *([] if host in ("127.0.0.1", "localhost", "::1") else [_bracket(host)])]
    else:
        # Bound to a network address (``--host 0.0.0.0``, a LAN IP): clients reach the server under
        # names it cannot know (its hostname, its IPs, a proxy's), so a fixed list would refuse them
        # all (421). DNS rebinding lets a web page reach a server that only localhost can reach; one
        # on the network is reachable directly anyway, and the bearer token is what guards it.
        return TransportSecuritySettings(enable_dns_rebinding_protection=False)
    hosts, origins = [], []
    for name in names:
        with_port = name.endswith(":*") or ":" in name.rsplit("]", 1)[-1]
        for h in (name,) if with_port else (name, f"{name}:*"):
            hosts.append(h)
            origins += [f"http://{h}", f"https://{h}"]
    return TransportSecuritySettings(enable_dns_rebinding_protection=True, allowed_hosts=hosts,
                                     allowed_origins=origins)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _require_token(app: ASGIApp, token: str) -> ASGIApp:
    """``app``, answering 401 (JSON, as the REST routes) to a request without the bearer token."""
    expected = f"Bearer {token}".encode()

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = Headers(scope=scope).get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                refusal = JSONResponse(
                    {"error": "Unauthorized", "message": "a valid 'Authorization: Bearer <token>' header is needed"},
                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await refusal(scope, receive, send)
                return
        await app(scope, receive, send)

    return guarded


def serve_stdio(path: str) -> None:
    """``trellis mcp --db PATH``: the MCP server of the store at ``path`` over stdio; what its
    agent writes has provenance ``mcp:stdio``."""
    from trellisdb.database import open_local as connect

    with connect(path, provenance="mcp:stdio") as db:
        build_server(db).run()
