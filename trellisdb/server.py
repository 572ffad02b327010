"""``trellis serve``: one process owns the store and answers over HTTP; ``service.py`` does the
work, this module carries it (routes, bodies, tokens, errors).

Endpoints (JSON bodies, values wire-encoded as in ``trellisdb/wire.py``; JSON answers are
``{"result": ...}``, rows come back as an Arrow IPC stream, or as JSON with ``"format": "json"``
on ``/v1/query`` and ``/v1/sql``):

- ``GET /v1/health``: ``{"result": {"ok": true, "commit": <latest commit>}}``; ``GET /v1/log``: the commits;
- ``POST /v1/query`` ``{"tql", "params", "format"}``: TQL; ``POST /v1/sql`` ``{"sql", "params",
  "as_of", "format"}``: read-only SQL;
- ``POST /v1/steps`` ``{"session", "task", "agent", "model", "node": {add_node's arguments},
  "rewards": {channel: value}}``: a whole step in one call, answered ``{"id", "commit"}`` once
  durable (``commit``: a commit as of which the step is visible);
- ``POST /v1/sessions`` ``{"kwargs": {Database.session's arguments}}``, ``/v1/sessions/resume``
  ``{"session"}``, ``/v1/sessions/close`` ``{"session", "status"}``;
- ``POST /v1/call`` ``{"method", "args", "kwargs", "session", "tx"}``: one method of the embedded
  handle or of a session writer (``service.DB_CALLS``, ``service.SESSION_CALLS``);
- ``POST /v1/tokens`` ``{"role", "name", "expires"}``, ``GET /v1/tokens``, ``POST /v1/tokens/revoke`` ``{"name"}``:
  the tenant's tokens (admin); ``POST /v1/tenant/purge`` ``{"tenant"}``: delete the caller's
  tenant, its store and tokens (admin; the name repeated as a confirmation);
- ``POST /v1/flush`` ``{"meta"}``: every write so far durable; ``POST /v1/tx/begin`` ``{"message",
  "meta", "timeout"}`` → ``{"tx"}``, ``/v1/tx/commit`` and ``/v1/tx/rollback`` ``{"tx"}``;
- ``/mcp``: the MCP server (``trellisdb/mcp_server.py``) over streamable HTTP, same token.

Writes from every client are group-committed together (``service.py``): a call that must be
durable takes a ticket, one committer thread flushes a couple of milliseconds after the first
ticket it has not covered, and each call returns once the flush covering it is done.

Requests larger than ``max_body`` bytes are refused (413) before they are read whole; errors are
JSON ``{"error": <class>, "message": ...}`` with 400 (bad input, a query past its limits), 401 (no,
unknown or expired token), 403 (role, read-only store, another agent's session or node, another
token's transaction), 408 (a body trickled in too slowly), 413, 429 / 503 (the token's or tenant's
/ the server's reads are all running: ``BusyError``, with ``Retry-After``), 500 (a damaged store, a
bug). With tokens, every request must carry ``Authorization: Bearer <token>`` (the scheme in any
case; nothing else is read as a token). Connections are bounded by ``trellisdb/http_limits.py``
(headers within a timeout, idle ones closed, at most so many open at once).

Reads cannot starve the rest: TQL and SQL (``/v1/query``, ``/v1/sql``) run in worker threads of
their own, at a lower CPU priority, at most ``token_reads`` per agent's or analyst's token,
``tenant_reads`` per tenant and ``max_reads`` in all; one that finds them taken waits up to
``read_wait`` seconds, then is refused (``BusyError``). Each runs under the store's
``query_timeout`` and ``memory_limit`` (``reader.QueryScope``), and is interrupted when its
client goes away. Steps and the other writes have their own threads; health is answered on the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb import wire
from trellisdb.errors import (
    AccessError,
    BusyError,
    CorruptionError,
    QueryCancelledError,
    ReadOnlyError,
    TrellisError,
    ValidationError,
)
from trellisdb.http_limits import HEADER_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS
from trellisdb.reader import QUERY_TIMEOUT
from trellisdb.service import Caller, Service, Services, Verify, field, need_of_call, result_table

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.types import Receive, Scope, Send

    from trellisdb.database import Database
    from trellisdb.tenants import Principal

#: The largest request body accepted by default (a step with its artifacts; bulk data goes through ingest).
MAX_BODY = 16 << 20
#: Seconds a request body may take to arrive (a client that trickles it is answered 408).
BODY_TIMEOUT = 30.0
#: Media type of an Arrow IPC stream.
ARROW_STREAM = "application/vnd.apache.arrow.stream"
#: Reads (TQL, SQL) running at once, per tenant and in all; seconds one waits for a turn.
TENANT_READS = max(2, os.cpu_count() or 1)
MAX_READS = max(4, 2 * (os.cpu_count() or 1))
READ_WAIT = 10.0


def token_reads_of(tenant_reads: int) -> int:
    """Reads one agent's or analyst's token may run at once by default: half its tenant's turns
    (at least one), so that one caller's long queries leave the others a turn. An admin's token
    is not held to it."""
    return max(1, tenant_reads // 2)

#: Worker threads for steps and the other writes (anyio's default pool is the rest's).
WRITE_THREADS = 40


class HttpError(Exception):
    """An error with its HTTP status (raised by the handlers, turned into a JSON response)."""

    def __init__(self, status: int, kind: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.headers = status, kind, headers


def _status(e: TrellisError) -> int:
    """A refusal is the caller's to mend (400), a read-only store 403, damage the server's (500)."""
    if isinstance(e, ReadOnlyError | AccessError):
        return 403
    return 500 if isinstance(e, CorruptionError) else 400


def _table_response(t: pa.Table, fmt: Any) -> Response:
    from starlette.responses import JSONResponse, Response

    if fmt == "arrow":
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, t.schema) as w:
            w.write_table(t)
        return Response(sink.getvalue(), media_type=ARROW_STREAM)
    if fmt not in (None, "json"):
        raise ValidationError(f"format must be 'json' or 'arrow', got {fmt!r}")
    return JSONResponse({"columns": t.column_names, "rows": json.loads(_json_rows(t))})


def _json(value: Any) -> Response:
    """A call's result as JSON ``{"result": ...}``, its values wire-encoded (``trellisdb/wire.py``)."""
    from starlette.responses import JSONResponse

    return JSONResponse({"result": wire.encode(value)})


def _json_rows(t: pa.Table) -> str:
    """The rows as JSON text (times as ISO text, bytes as text when they are UTF-8, else hex)."""
    def default(v: Any) -> Any:
        if hasattr(v, "isoformat"):
            return v.isoformat()
        if isinstance(v, bytes):
            try:
                return v.decode()
            except UnicodeDecodeError:
                return v.hex()
        return str(v)

    return json.dumps(t.to_pylist(), default=default, allow_nan=False)


async def _body(request: Request, limit: int, timeout: float) -> dict[str, Any]:
    """The JSON object of a request, refused past ``limit`` bytes without reading the rest, and
    when it takes over ``timeout`` seconds to arrive (408: a slow client holds a connection, not
    the server). (Starlette's own ``max_body_size`` answers a too-large declared length in plain
    text, before any handler: the JSON error, with the limit, needs this check.)"""
    import anyio

    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, "PayloadTooLarge", f"the request is {int(declared):,} bytes; at most {limit:,} are read")
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HttpError(413, "PayloadTooLarge", f"the request is over {limit:,} bytes, the most read")
                chunks.append(chunk)
    except TimeoutError:
        raise HttpError(408, "RequestTimeout", f"the request body took over {timeout:g} s to arrive ({size:,} "
                                               "bytes came); send it whole") from None
    try:
        value = json.loads(b"".join(chunks) or b"null")
    except (ValueError, RecursionError) as e:
        raise HttpError(400, "MalformedBody", f"the body is not JSON ({e}); send a JSON object") from None
    if not isinstance(value, dict):
        raise HttpError(400, "MalformedBody", "the body must be a JSON object")
    return value


def build_app(db: Database, *, token: str | None = None, max_body: int = MAX_BODY, host: str = "127.0.0.1",
              allowed_hosts: Sequence[str] | None = None, body_timeout: float = BODY_TIMEOUT,
              verify: Verify | None = None, tenant_reads: int = TENANT_READS, max_reads: int = MAX_READS,
              read_wait: float = READ_WAIT, token_reads: int | None = None,
              store_options: Mapping[str, Any] | None = None) -> Starlette:
    """The HTTP application serving ``db`` and its tenants (see the module notes): the REST routes
    under ``/v1`` and MCP at ``/mcp``. ``host`` is the address it is bound to and ``allowed_hosts``
    the names clients may reach it by (MCP's DNS-rebinding check; ``trellisdb/mcp_server.py``);
    ``body_timeout`` the seconds a request body may take to arrive; ``verify`` the
    verify-before-insert hook every node an agent writes passes (``service.py``);
    ``token_reads`` (None: :func:`token_reads_of` ``tenant_reads``), ``tenant_reads``, ``max_reads``
    and ``read_wait`` the admission of reads (the module notes);
    ``store_options`` what the tenants' stores are opened with (``open_local``'s options:
    ``query_timeout``, ``memory_limit``; ``db`` is opened by the caller)."""
    import anyio
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.datastructures import Headers
    from starlette.responses import JSONResponse
    from starlette.routing import BaseRoute, Mount, Route

    from trellisdb.mcp_server import McpHttp, http_app

    token_reads = token_reads_of(tenant_reads) if token_reads is None else token_reads
    for name, n in (("token_reads", token_reads), ("tenant_reads", tenant_reads), ("max_reads", max_reads)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValidationError(f"{name} must be a whole number >= 1, not {n!r}")
    if isinstance(read_wait, bool) or not isinstance(read_wait, int | float) or not 0 <= read_wait <= 3600:
        raise ValidationError(f"read_wait must be seconds in [0, 3600] (0: a read finding no free turn is refused "
                              f"at once), not {read_wait!r}")
    services = Services(db, token=token, verify=verify, options=store_options)
    # reads (TQL, SQL) and writes each on threads of their own: neither can take the other's; the
    # reads' run at a lower CPU priority, so that a core busy with them still serves steps and health
    read_threads = ThreadPoolExecutor(max_reads, thread_name_prefix="trellisdb-read", initializer=_lower_priority)
    write_threads = anyio.CapacityLimiter(WRITE_THREADS)
    all_reads = anyio.CapacityLimiter(max_reads)
    tenant_slots: dict[str, anyio.CapacityLimiter] = {}
    token_slots: dict[tuple[str, str], anyio.CapacityLimiter] = {}

    async def turn(limiter: anyio.CapacityLimiter, wait: float, status: int, whose: str, option: str) -> None:
        """A turn to read, waited for at most ``wait`` seconds (else ``BusyError``; a free turn is
        taken at once, however short the wait)."""
        try:
            limiter.acquire_nowait()
            return
        except anyio.WouldBlock:
            pass
        try:
            if not wait > 0:
                raise TimeoutError
            with anyio.fail_after(wait):
                await limiter.acquire()
        except TimeoutError:
            raise HttpError(status, "BusyError", f"the {limiter.total_tokens:g} queries {whose} runs at once are all "
                                                 f"running and none finished within {read_wait:g} s; retry in a "
                                                 f"moment (trellis serve {option} N allows more)",
                            {"Retry-After": "1"}) from None

    async def admitted(service: Service, who: Principal, work: Callable[[], pa.Table],
                       gone: Callable[[], Awaitable[None]] | None) -> pa.Table:
        """``work`` (a read) once the caller's token, its tenant and the server have a turn for it,
        in a read thread under a query scope of the tenant's store (its time limit); cancelled
        when ``gone`` returns (the client went away), while it waits for a turn too. Every door's
        reads come here: ``/v1/query``, ``/v1/sql`` and MCP's reading tools."""
        scope = service.db.query_scope()
        done: list[pa.Table] = []
        failed: list[Exception] = []  # raised after the task group (which would wrap it in a group)

        def scoped() -> pa.Table:
            with scope:
                return work()

        async with anyio.create_task_group() as tg:
            if gone is not None:
                async def watch() -> None:
                    await gone()
                    scope.cancel("the client went away")
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
            turns = [(tenant_slots.setdefault(who.tenant, anyio.CapacityLimiter(tenant_reads)), 429,
                      f"tenant {who.tenant!r}", "--tenant-reads"), (all_reads, 503, "the server", "--max-reads")]
            if not who.may("admin"):  # one caller's turns, then its tenant's, then the server's
                turns.insert(0, (token_slots.setdefault((who.tenant, who.name), anyio.CapacityLimiter(token_reads)),
                                 429, f"token {who.name!r}", "--token-reads"))
            until = anyio.current_time() + read_wait
            try:
                async with contextlib.AsyncExitStack() as held:
                    for limiter, status, whose, option in turns:
                        await turn(limiter, max(0.0, until - anyio.current_time()), status, whose, option)
                        held.callback(limiter.release)
                    running = asyncio.wrap_future(read_threads.submit(scoped))
                    with anyio.CancelScope(shield=True):  # a cancel interrupts it: wait for its end
                        done.append(await running)
            except Exception as e:
                failed.append(e)
            finally:
                tg.cancel_scope.cancel()
        if failed:
            raise failed[0]
        if not done:  # the client went away: nobody reads this
            raise QueryCancelledError("the client went away")
        return done[0]

    async def read(request: Request, service: Service, who: Principal, work: Callable[[], pa.Table]) -> pa.Table:
        """A request's read (``admitted``), cancelled when its client goes away."""
        async def gone() -> None:  # the body is read: the next message is the client leaving
            while (await request.receive())["type"] != "http.disconnect":
                pass

        return await admitted(service, who, work, gone)

    def mcp_reads(service: Service, who: Principal) -> Callable[[Callable[[], pa.Table]], Awaitable[pa.Table]]:
        """MCP's reading tools' door to ``admitted`` (the same turns and limits as REST): a refusal
        reaches the agent as ``BusyError`` (a tool error), not an HTTP status."""
        async def reads(work: Callable[[], pa.Table]) -> pa.Table:
            try:
                return await admitted(service, who, work, None)
            except HttpError as e:
                raise BusyError(str(e)) from None
        return reads

    def caller(authorization: str | None, need: str) -> Principal:
        try:
            who = services.principal(authorization)
        except AccessError as e:  # an expired token
            raise HttpError(401, "Unauthorized", str(e)) from None
        if who is None:
            raise HttpError(401, "Unauthorized", "a valid 'Authorization: Bearer <token>' header is needed")
        if not who.may(need):
            raise HttpError(403, "Forbidden", who.refusal(need))
        return who

    def guarded(handler: Callable[[Request, Service, Principal], Awaitable[Response]],
                need: str = "read") -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                who = caller(request.headers.get("authorization"), need)
                service = services.opened(who.tenant)
                if service is None:  # opened (created) on first use: I/O, in a worker thread
                    service = await run_in_threadpool(services.service, who.tenant)
                return await handler(request, service, who)
            except HttpError as e:
                return JSONResponse({"error": e.kind, "message": str(e)}, status_code=e.status, headers=e.headers)
            except TrellisError as e:
                return JSONResponse({"error": type(e).__name__, "message": str(e)}, status_code=_status(e))
            except Exception as e:  # a bug: say so without the traceback, keep serving
                return JSONResponse({"error": "InternalError", "message": f"{type(e).__name__}: {e}"},
                                    status_code=500)
        return endpoint

    async def health(request: Request, service: Service, who: Principal) -> Response:
        # on the event loop, no thread: it answers however busy the worker threads are
        return _json({**service.health(), "tenant": who.tenant, "role": who.role})

    async def query(request: Request, service: Service, who: Principal) -> Response:
        body = await _body(request, max_body, body_timeout)  # (the statement's role: checked by the service)
        return _table_response(await read(request, service, who, lambda: service.query(body, who)),
                               body.get("format"))

    async def sql(request: Request, service: Service, who: Principal) -> Response:
        body = await _body(request, max_body, body_timeout)
        return _table_response(await read(request, service, who, lambda: service.sql(body)), body.get("format"))

    async def log(request: Request, service: Service, who: Principal) -> Response:
        return _json(await run_in_threadpool(service.log))

    def posted(work: Callable[[Service, dict[str, Any], Principal], Any],
               need: Callable[[dict[str, Any]], str] | None = None) -> Callable[[Request, Service, Principal],
                                                                              Awaitable[Response]]:
        """A handler taking a JSON body (wire-encoded values) and answering the work's result;
        ``need``: the right a body asks for, beyond the route's own."""
        async def handler(request: Request, service: Service, who: Principal) -> Response:
            body = wire.decode(await _body(request, max_body, body_timeout))
            if need is not None:
                caller(request.headers.get("authorization"), need(body))
            out = await anyio.to_thread.run_sync(lambda: work(service, body, who), limiter=write_threads)
            table = result_table(out)
            return _table_response(table, "arrow") if table is not None else _json(out)
        return handler

    async def step(request: Request, service: Service, who: Principal) -> Response:
        """A whole step: staged in a worker thread, then awaited on the loop until its group
        commit is durable (no thread held while it waits)."""
        body = wire.decode(await _body(request, max_body, body_timeout))
        out, ticket = await anyio.to_thread.run_sync(lambda: service.stage_step(body, who), limiter=write_threads)
        return _json({**out, "commit": await service.durable_async(ticket)})

    async def flush(request: Request, service: Service, who: Principal) -> Response:
        body = wire.decode(await _body(request, max_body, body_timeout))
        if body.get("meta") is not None:  # a commit carrying run state: its own
            return _json(await anyio.to_thread.run_sync(lambda: service.flush(body, who), limiter=write_threads))
        return _json(await service.durable_async(service.ticket()))

    def tokens(work: Callable[[Principal, dict[str, Any]], Any]) -> Callable[[Request, Service, Principal],
                                                                             Awaitable[Response]]:
        async def handler(request: Request, service: Service, who: Principal) -> Response:
            body = {} if request.method == "GET" else wire.decode(await _body(request, max_body, body_timeout))
            out = await run_in_threadpool(work, who, body)
            if request.method == "POST":  # a token revoked (or a tenant purged): its MCP server goes
                await forget_mcp()
            return _json(out)
        return handler

    def make_token(who: Principal, body: dict[str, Any]) -> dict[str, Any]:
        role = field(body, "role", str)
        name = field(body, "name", str, optional=True)
        expires = field(body, "expires", str, optional=True)
        secret = services.tokens.create(who.tenant, role, name=name, expires=expires)
        made = services.tokens.lookup(secret)
        assert made is not None
        return {"token": secret, "name": made.name, "tenant": made.tenant, "role": made.role,
                "expires": None if made.expires is None else made.expires.isoformat(timespec="seconds")}

    def purge_tenant(who: Principal, body: dict[str, Any]) -> dict[str, Any]:
        named = field(body, "tenant", str)
        if named != who.tenant:
            raise ValidationError(f"tenant {named[:80]!r} is not this token's ({who.tenant!r}); name your own "
                                  "tenant to confirm its purge")
        return services.purge_tenant(who.tenant, by=who.name)

    routes: list[BaseRoute] = [
        Route("/v1/health", guarded(health), methods=["GET"]),
        Route("/v1/query", guarded(query), methods=["POST"]),
        Route("/v1/sql", guarded(sql), methods=["POST"]),
        Route("/v1/log", guarded(log), methods=["GET"]),
        Route("/v1/steps", guarded(step, "write"), methods=["POST"]),
        Route("/v1/call", guarded(posted(Service.call, need_of_call)), methods=["POST"]),
        Route("/v1/flush", guarded(flush, "write"), methods=["POST"]),
        Route("/v1/sessions", guarded(posted(Service.open_session), "write"), methods=["POST"]),
        Route("/v1/sessions/resume", guarded(posted(Service.resume_session), "write"), methods=["POST"]),
        Route("/v1/sessions/close", guarded(posted(Service.close_session), "write"), methods=["POST"]),
        Route("/v1/tx/begin", guarded(posted(Service.begin), "write"), methods=["POST"]),
        Route("/v1/tx/commit", guarded(posted(lambda s, b, w: s.end(b, commit=True, who=w)), "write"),
              methods=["POST"]),
        Route("/v1/tx/rollback", guarded(posted(lambda s, b, w: s.end(b, commit=False, who=w)), "write"),
              methods=["POST"]),
        Route("/v1/tokens", guarded(tokens(lambda who, b: services.tokens.list(who.tenant)), "admin"),
              methods=["GET"]),
        Route("/v1/tokens", guarded(tokens(make_token), "admin"), methods=["POST"]),
        Route("/v1/tenant/purge", guarded(tokens(purge_tenant), "admin"), methods=["POST"]),
        Route("/v1/tokens/revoke", guarded(tokens(lambda who, b: services.tokens.revoke(
            field(b, "name", str), tenant=who.tenant)), "admin"), methods=["POST"]),
    ]

    # MCP over streamable HTTP at /mcp: one MCP server per token (its tenant's store, its name the
    # provenance of its steps; an analyst's has only the reading tools), made on first use, its session manager run in the app's task group; its
    # steps join that tenant's group commit. Mounted last: "/" takes every path the routes do not.
    # Keyed by the token's hash, not its name: a token revoked and made again under its name (as
    # another role) is another server; one whose token stopped working is stopped and dropped.
    mcp_apps: dict[str, tuple[McpHttp, anyio.CancelScope]] = {}  # by Principal.key
    mcp_lock = anyio.Lock()
    group: list[anyio.abc.TaskGroup] = []

    def forget_stale_mcp() -> None:
        """Stop and drop the MCP servers whose tokens were revoked or expired (on the loop)."""
        live = services.active_keys()
        for key in [k for k in mcp_apps if k not in live]:
            mcp_apps.pop(key)[1].cancel()

    async def forget_mcp() -> None:
        async with mcp_lock:
            forget_stale_mcp()

    async def mcp_for(who: Principal) -> McpHttp:
        async with mcp_lock:
            forget_stale_mcp()
            entry = mcp_apps.get(who.key)
            if entry is None:
                service = await run_in_threadpool(services.service, who.tenant)
                app = http_app(service.db, writes=Caller(service, who, reads=mcp_reads(service, who)), host=host,
                               allowed_hosts=allowed_hosts, max_body=max_body, read_only=not who.may("write"))

                async def run_manager(*, task_status: anyio.abc.TaskStatus[anyio.CancelScope] =
                                      anyio.TASK_STATUS_IGNORED) -> None:
                    with anyio.CancelScope() as scope:
                        async with app.lifespan():
                            task_status.started(scope)
                            await anyio.sleep_forever()

                entry = mcp_apps[who.key] = (app, await group[0].start(run_manager))
            return entry[0]

    async def mcp_endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        try:
            if not scope["path"].startswith("/mcp"):
                raise HttpError(404, "NotFound", f"no route {scope['path'][:200]!r}; see GET /v1/health, /v1/...,"
                                                 " /mcp")
            who = caller(Headers(scope=scope).get("authorization"), "read")
            app = await mcp_for(who)
        except HttpError as e:
            headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
            await JSONResponse({"error": e.kind, "message": str(e)}, status_code=e.status,
                               headers=headers)(scope, receive, send)
            return
        await app.app(scope, receive, send)

    routes.append(Mount("/", app=mcp_endpoint))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            group.append(tg)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
                await run_in_threadpool(services.close)
                read_threads.shutdown(wait=False)

    return Starlette(routes=routes, lifespan=lifespan)


#: How much lower the reads' threads run (``nice``; Linux: a thread's own priority).
READ_NICE = 10


def _lower_priority() -> None:
    """Lower this thread's CPU priority by ``READ_NICE`` (Linux only: elsewhere it would be the
    process's). A read thread holds it for its life: an unprivileged thread cannot raise it again."""
    import sys
    import threading

    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + READ_NICE)


_ROLE_HELP = ("agent: read, and write its own sessions; analyst: read; admin: also any session, views, exports, "
              "tags, ingest, quarantine, purge, tokens")


def serve(path: str, *, host: str = "127.0.0.1", port: int = 7437, token: str | None = None,
          max_body: int = MAX_BODY, allowed_hosts: Sequence[str] | None = None,
          export_root: str | None = None, body_timeout: float = BODY_TIMEOUT, verify: Verify | None = None,
          header_timeout: float = HEADER_TIMEOUT, keep_alive: int = KEEP_ALIVE,
          max_connections: int = MAX_CONNECTIONS, query_timeout: float | None = QUERY_TIMEOUT,
          memory_limit: int | None = None, tenant_reads: int = TENANT_READS, max_reads: int = MAX_READS,
          read_wait: float = READ_WAIT, token_reads: int | None = None) -> None:
    """Open the store at ``path`` and serve it (and its tenants) until interrupted (``trellis serve``).
    ``header_timeout``: seconds a client has to send a request's headers; ``keep_alive``: seconds
    an idle connection is kept after a response; ``max_connections``: connections open at once
    (``trellisdb/http_limits.py``); ``query_timeout`` and ``memory_limit`` are every tenant's
    store's (``open_local``)."""
    import uvicorn

    from trellisdb.database import open_local
    from trellisdb.http_limits import bounded

    for name, value in (("header_timeout", header_timeout), ("keep_alive", keep_alive)):
        if not value > 0:
            raise ValidationError(f"{name} must be seconds above 0, got {value!r}")
    if max_connections < 1:
        raise ValidationError(f"max_connections must be at least 1, got {max_connections!r}")
    limits = {"query_timeout": query_timeout, "memory_limit": memory_limit}
    with open_local(path, export_root=export_root, query_timeout=query_timeout, memory_limit=memory_limit) as db:
        app = build_app(db, token=token, max_body=max_body, host=host, allowed_hosts=allowed_hosts,
                        body_timeout=body_timeout, verify=verify, tenant_reads=tenant_reads, max_reads=max_reads,
                        read_wait=read_wait, token_reads=token_reads, store_options=limits)
        uvicorn.run(app, host=host, port=port, log_level="warning", http=bounded(header_timeout, max_connections),
                    timeout_keep_alive=keep_alive)
