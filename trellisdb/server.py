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
- ``POST /v1/flush`` ``{"meta"}``: every write so far durable; ``POST /v1/tx/begin`` ``{"message",
  "meta", "timeout"}`` → ``{"tx"}``, ``/v1/tx/commit`` and ``/v1/tx/rollback`` ``{"tx"}``;
- ``/mcp``: the MCP server (``trellisdb/mcp_server.py``) over streamable HTTP, same token.

Writes from every client are group-committed together (``service.py``): a call that must be
durable takes a ticket, one committer thread flushes a couple of milliseconds after the first
ticket it has not covered, and each call returns once the flush covering it is done.

Requests larger than ``max_body`` bytes are refused (413) before they are read whole; errors are
JSON ``{"error": <class>, "message": ...}`` with 400 (bad input), 401 (token), 403 (read-only),
413, 500 (a damaged store, a bug). With a ``token``, every request must carry ``Authorization:
Bearer <token>``.
"""

from __future__ import annotations

import hmac
import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb import wire
from trellisdb.errors import CorruptionError, ReadOnlyError, TrellisError, ValidationError
from trellisdb.service import Service, result_table

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from trellisdb.database import Database

#: The largest request body accepted by default (a step with its artifacts; bulk data goes through ingest).
MAX_BODY = 16 << 20
#: Media type of an Arrow IPC stream.
ARROW_STREAM = "application/vnd.apache.arrow.stream"


class HttpError(Exception):
    """An error with its HTTP status (raised by the handlers, turned into a JSON response)."""

    def __init__(self, status: int, kind: str, message: str) -> None:
        super().__init__(message)
        self.status, self.kind = status, kind


def _status(e: TrellisError) -> int:
    """A refusal is the caller's to mend (400), a read-only store 403, damage the server's (500)."""
    if isinstance(e, ReadOnlyError):
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


async def _body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object of a request, refused past ``limit`` bytes without reading the rest.
    (Starlette's own ``max_body_size`` answers a too-large declared length in plain text, before
    any handler: the JSON error, with the limit, needs this check.)"""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, "PayloadTooLarge", f"the request is {int(declared):,} bytes; at most {limit:,} are read")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, "PayloadTooLarge", f"the request is over {limit:,} bytes, the most read")
        chunks.append(chunk)
    try:
        value = json.loads(b"".join(chunks) or b"null")
    except (ValueError, RecursionError) as e:
        raise HttpError(400, "MalformedBody", f"the body is not JSON ({e}); send a JSON object") from None
    if not isinstance(value, dict):
        raise HttpError(400, "MalformedBody", "the body must be a JSON object")
    return value


def build_app(db: Database, *, token: str | None = None, max_body: int = MAX_BODY, host: str = "127.0.0.1",
              allowed_hosts: Sequence[str] | None = None) -> Starlette:
    """The HTTP application serving ``db`` (see the module notes): the REST routes under ``/v1``
    and MCP at ``/mcp``. ``host`` is the address it is bound to and ``allowed_hosts`` the names
    clients may reach it by (MCP's DNS-rebinding check; ``trellisdb/mcp_server.py``)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import BaseRoute, Mount, Route

    from trellisdb.mcp_server import http_app

    service = Service(db)

    def guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                if token is not None:
                    given = request.headers.get("authorization", "")
                    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                        raise HttpError(401, "Unauthorized", "a valid 'Authorization: Bearer <token>' header is needed")
                return await handler(request)
            except HttpError as e:
                return JSONResponse({"error": e.kind, "message": str(e)}, status_code=e.status)
            except TrellisError as e:
                return JSONResponse({"error": type(e).__name__, "message": str(e)}, status_code=_status(e))
            except Exception as e:  # a bug: say so without the traceback, keep serving
                return JSONResponse({"error": "InternalError", "message": f"{type(e).__name__}: {e}"},
                                    status_code=500)
        return endpoint

    async def health(request: Request) -> Response:
        return _json(await run_in_threadpool(service.health))

    async def query(request: Request) -> Response:
        body = await _body(request, max_body)
        return _table_response(await run_in_threadpool(service.query, body), body.get("format"))

    async def sql(request: Request) -> Response:
        body = await _body(request, max_body)
        return _table_response(await run_in_threadpool(service.sql, body), body.get("format"))

    async def log(request: Request) -> Response:
        return _json(await run_in_threadpool(service.log))

    def posted(work: Callable[[dict[str, Any]], Any]) -> Callable[[Request], Awaitable[Response]]:
        """An endpoint taking a JSON body (wire-encoded values) and answering the work's result."""
        async def handler(request: Request) -> Response:
            body = wire.decode(await _body(request, max_body))
            out = await run_in_threadpool(work, body)
            table = result_table(out)
            return _table_response(table, "arrow") if table is not None else _json(out)
        return handler

    routes: list[BaseRoute] = [
        Route("/v1/health", guarded(health), methods=["GET"]),
        Route("/v1/query", guarded(query), methods=["POST"]),
        Route("/v1/sql", guarded(sql), methods=["POST"]),
        Route("/v1/log", guarded(log), methods=["GET"]),
        Route("/v1/steps", guarded(posted(service.step)), methods=["POST"]),
        Route("/v1/call", guarded(posted(service.call)), methods=["POST"]),
        Route("/v1/flush", guarded(posted(service.flush)), methods=["POST"]),
        Route("/v1/sessions", guarded(posted(service.open_session)), methods=["POST"]),
        Route("/v1/sessions/resume", guarded(posted(service.resume_session)), methods=["POST"]),
        Route("/v1/sessions/close", guarded(posted(service.close_session)), methods=["POST"]),
        Route("/v1/tx/begin", guarded(posted(service.begin)), methods=["POST"]),
        Route("/v1/tx/commit", guarded(posted(lambda body: service.end(body, commit=True))), methods=["POST"]),
        Route("/v1/tx/rollback", guarded(posted(lambda body: service.end(body, commit=False))), methods=["POST"]),
    ]
    # MCP over streamable HTTP at /mcp, its steps group-committed with everyone's; mounted last
    # ("/" takes every path the routes above do not)
    mcp = http_app(db, step=service.step, token=token, host=host, allowed_hosts=allowed_hosts, max_body=max_body)
    routes.append(Mount("/", app=mcp.app))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with mcp.lifespan():  # the MCP session manager runs while the app does
            try:
                yield
            finally:
                await run_in_threadpool(service.close)

    return Starlette(routes=routes, lifespan=lifespan)


def serve(path: str, *, host: str = "127.0.0.1", port: int = 7437, token: str | None = None,
          max_body: int = MAX_BODY) -> None:
    """Open the store at ``path`` and serve it until interrupted (``trellis serve``)."""
    import uvicorn

    from trellisdb.database import open_local

    with open_local(path) as db:
        uvicorn.run(build_app(db, token=token, max_body=max_body, host=host), host=host, port=port,
                    log_level="warning")
