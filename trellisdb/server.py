"""``trellis serve``: one process owns the store and answers over HTTP (issue 25, first slice).

Endpoints (JSON bodies; results as JSON, or as an Arrow IPC stream with ``"format": "arrow"``):

- ``GET /v1/health``: ``{"ok": true, "commit": <latest commit>}``;
- ``POST /v1/query`` ``{"tql": ..., "params": {...}, "format": "json" | "arrow"}``: a TQL query;
- ``POST /v1/sql`` ``{"sql": ..., "params": [...] | {...}, "as_of": ..., "format": ...}``: read-only SQL;
- ``POST /v1/steps`` ``{"session": id, "task": id, "agent": ..., "model": ..., "node": {add_node's
  arguments}, "rewards": {channel: value}}``: a whole step in one call; returns ``{"id", "commit"}``
  once it is durable (``commit``: a commit as of which the step is visible);
- ``GET /v1/log``: the commits.

Writes from every client are group-committed together: a step is staged in the group batch and
takes a ticket; one committer thread flushes, ``window`` seconds after the first step it has
not flushed yet (more steps join meanwhile), and wakes the calls whose tickets the flush covered
(everything staged before it started). So each call returns when its own writes are durable and
concurrent steps share one fsync. A failed flush is raised to the calls it covered (their
writes stay pending in the committer, which retries them).

Requests larger than ``max_body`` bytes are refused (413) before they are read whole; errors are
JSON ``{"error": <class>, "message": ...}`` with 400 (bad input), 401 (token), 403 (read-only),
413, 500 (a damaged store, a bug). With a ``token``, every request must carry ``Authorization:
Bearer <token>``. Tenants, roles and MCP come next (issue 25).
"""

from __future__ import annotations

import hmac
import io
import json
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb.errors import CommitError, CorruptionError, ReadOnlyError, TrellisError, ValidationError
from trellisdb.writer import reward_value

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response

    from trellisdb.database import Database
    from trellisdb.writer import SessionWriter

#: The largest request body accepted by default (a step with its artifacts; bulk data goes through ingest).
MAX_BODY = 16 << 20
#: Seconds the server's committer waits after the first unflushed step, for others to join its commit.
WINDOW = 0.002
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


class Service:
    """What the endpoints do, on one open database (no HTTP here: testable in-process)."""

    def __init__(self, db: Database, *, window: float = WINDOW) -> None:
        self.db = db
        self.window = window
        self._writers: dict[str, SessionWriter] = {}
        self._lock = threading.Lock()
        # group commit: tickets staged, tickets durable (or failed), the committer thread
        self._stage = threading.Lock()
        self._done = threading.Condition()
        self._staged = 0
        self._durable = 0
        self._commit = 0
        self._failed: tuple[int, BaseException] | None = None
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._commit_loop, name="trellisdb-server-commit", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join()

    def _commit_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            if self._closed:
                return
            time.sleep(self.window)  # let the steps arriving meanwhile join this commit
            self._wake.clear()
            with self._stage:
                upto = self._staged  # every ticket up to here is staged: the flush takes it
            try:
                commit = self.db.flush() or self.db.snapshot().commit
                failed: tuple[int, BaseException] | None = None
            except BaseException as e:  # told to the calls it covered
                failed = (upto, e)
            with self._done:
                if failed is None:
                    self._durable, self._commit = upto, commit
                else:
                    self._failed = failed
                self._done.notify_all()

    def _wait_durable(self, ticket: int) -> int:
        """Block until the flush covering ``ticket`` is done; its commit id (or its error)."""
        self._wake.set()
        with self._done:
            while self._durable < ticket:
                if self._failed is not None and self._failed[0] >= ticket:
                    raise CommitError(f"the group commit holding this step failed: {self._failed[1]}; the "
                                      "step is kept and retried by the server") from self._failed[1]
                self._done.wait()
            return self._commit

    def health(self) -> dict[str, Any]:
        return {"ok": True, "commit": self.db.snapshot().commit}

    def query(self, body: Mapping[str, Any]) -> pa.Table:
        text = _field(body, "tql", str)
        params = _field(body, "params", dict, optional=True) or {}
        return self.db.query(text, **params).to_arrow()

    def sql(self, body: Mapping[str, Any]) -> pa.Table:
        text = _field(body, "sql", str)
        params = body.get("params")
        if params is not None and not isinstance(params, list | dict):
            raise ValidationError("params must be a list (for $1, $2...) or an object (for $name)")
        as_of = body.get("as_of")
        if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, int | str)):
            raise ValidationError("as_of must be a commit id, a tag or an ISO timestamp")
        return self.db.sql(text, as_of=as_of, params=params).to_arrow()

    def writer(self, body: Mapping[str, Any]) -> SessionWriter:
        """The session writer of a step's session: opened (or resumed) once, kept for the server's life."""
        sid = _field(body, "session", str)
        with self._lock:
            w = self._writers.get(sid)
            if w is None:
                task = _field(body, "task", str)
                w = self.db.session(task=task, id=sid, agent=body.get("agent"), model=body.get("model"))
                self._writers[sid] = w
        return w

    def step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """A whole step: the node (``add_node``'s arguments), its rewards; durable on return."""
        node = _field(body, "node", dict)
        rewards = _field(body, "rewards", dict, optional=True) or {}
        allowed = {"id", "parents", "edge_kind", "kind", "step", "status", "summary", "cost", "embedding",
                   "artifacts", "source", "attrs", "labels", "at", "action", "state"}
        unknown = sorted(set(node) - allowed)
        if unknown:
            raise ValidationError(f"node has unknown field(s) {unknown}; fields: {', '.join(sorted(allowed))}")
        for channel, value in rewards.items():  # all or nothing: a bad reward stages no node
            reward_value(str(node.get("id") or "(new node)"), channel, value)
        w = self.writer(body)
        with self._stage:  # staged, then ticketed: a ticket below a flush's mark is in that flush
            node_id = w.add_node(**node)
            for channel, value in rewards.items():
                w.add_reward(node_id, channel, value)
            self._staged += 1
            ticket = self._staged
        return {"id": node_id, "commit": self._wait_durable(ticket)}

    def log(self) -> list[dict[str, Any]]:
        return [{**c, "time": c["time"].isoformat() if c.get("time") is not None else None} for c in self.db.log()]


def _field(body: Mapping[str, Any], name: str, kind: type, *, optional: bool = False) -> Any:
    v = body.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, kind):
        raise ValidationError(f"the request needs {name!r} as a {kind.__name__}, got {type(v).__name__}")
    return v


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


def build_app(db: Database, *, token: str | None = None, max_body: int = MAX_BODY) -> Starlette:
    """The HTTP application serving ``db`` (see the module notes)."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

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
        return JSONResponse(await run_in_threadpool(service.health))

    async def query(request: Request) -> Response:
        body = await _body(request, max_body)
        return _table_response(await run_in_threadpool(service.query, body), body.get("format"))

    async def sql(request: Request) -> Response:
        body = await _body(request, max_body)
        return _table_response(await run_in_threadpool(service.sql, body), body.get("format"))

    async def steps(request: Request) -> Response:
        body = await _body(request, max_body)
        return JSONResponse(await run_in_threadpool(service.step, body))

    async def log(request: Request) -> Response:
        return JSONResponse(await run_in_threadpool(service.log))

    routes = [
        Route("/v1/health", guarded(health), methods=["GET"]),
        Route("/v1/query", guarded(query), methods=["POST"]),
        Route("/v1/sql", guarded(sql), methods=["POST"]),
        Route("/v1/steps", guarded(steps), methods=["POST"]),
        Route("/v1/log", guarded(log), methods=["GET"]),
    ]
    return Starlette(routes=routes)


def serve(path: str, *, host: str = "127.0.0.1", port: int = 7437, token: str | None = None,
          max_body: int = MAX_BODY) -> None:
    """Open the store at ``path`` and serve it until interrupted (``trellis serve``)."""
    import uvicorn

    from trellisdb.database import connect

    with connect(path) as db:
        uvicorn.run(build_app(db, token=token, max_body=max_body), host=host, port=port, log_level="warning")
