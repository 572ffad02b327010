"""The client of ``trellis serve``: ``trellisdb.connect("http://host:port", token=...)``.

A :class:`RemoteDatabase` has the embedded handle's API: sessions and their writers, tasks,
attributes and labels, ``flush``, transactions, ``query`` (TQL), ``sql``, tags, views and
exports, spaces, ``ingest``, ``log``. A script moves from an embedded store to a served one by
changing the connect string. Semantics match the embedded handle: a write is checked when it is
made (a bad value raises at the call) and group-committed, durable after ``flush()``, at the end
of a session or a transaction, or a few milliseconds later on its own; ``record_step`` writes a
whole step in one call and returns once it is durable. Results are the embedded ``Result``
(rows travel as Arrow IPC); errors are raised as the ``TrellisError`` subclass the server met,
with its message. Needs the ``server`` extra (httpx).

What a remote handle does not have: ``snapshot()`` (ask ``sql(..., as_of=)`` or TQL's ``AS OF``),
callables (an embedder, export progress), maintenance (``compact``, ``verify``, ``repair``:
run them where the store is). A remote export writes under the server's export root.

    >>> import trellisdb
    >>> db = trellisdb.connect("http://127.0.0.1:7437", token="...")   # doctest: +SKIP
    >>> with db.session(task="t", agent="me") as s:                    # doctest: +SKIP
    ...     n = s.add_node(summary="try")
    ...     s.add_reward(n, "score", 0.5)
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb import errors, wire
from trellisdb.errors import TrellisError
from trellisdb.result import Result

if TYPE_CHECKING:
    import httpx

#: Media type of an Arrow IPC stream.
ARROW_STREAM = "application/vnd.apache.arrow.stream"
#: Seconds a connection is kept for the next request: under the server's keep-alive (5 s).
KEEPALIVE = 2.0


class RemoteError(TrellisError):
    """The server could not be reached, or answered something that is not trellisdb's."""


class RemoteTransaction:
    """Handle of a remote :meth:`RemoteDatabase.transaction` block: ``id`` on the server,
    ``commit_id`` once committed (None if nothing was written)."""

    def __init__(self, tx_id: str) -> None:
        self.id = tx_id
        self.commit_id: int | None = None


#: Seconds a request may take by default: more than a server's default query limit (60 s) plus its
#: wait for a read turn (10 s), so that a caller gets the server's error naming the limit.
TIMEOUT = 120.0


class RemoteDatabase:
    """A store served by ``trellis serve`` at ``url`` (see the module notes)."""

    read_only = False

    def __init__(self, url: str, *, token: str | None = None, timeout: float = TIMEOUT) -> None:
        import httpx  # (the server extra: missing, connect says so)

        self._limits = httpx.Limits(max_connections=4, max_keepalive_connections=1, keepalive_expiry=KEEPALIVE)
        self.url = url.rstrip("/")
        self.path = self.url
        self._headers = {"authorization": f"Bearer {token}"} if token else {}
        self._timeout = timeout
        self._local = threading.local()  # this thread's HTTP client and open transaction
        self._lock = threading.Lock()
        self._clients: list[tuple[threading.Thread, httpx.Client]] = []  # every thread's, to close
        self._closed = False

    def __enter__(self) -> RemoteDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connections (the server keeps everything written; sessions stay open there)."""
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, []
        for _, http in clients:
            http.close()

    def _http(self) -> httpx.Client:
        """This thread's HTTP client. Each thread has its own (its own connection pool): one
        ``httpx.Client`` shared by threads lost requests (``[Errno 9] Bad file descriptor``):
        httpcore's pool hands a request an idle connection under its lock, but the connection
        turns active only once the request's thread starts sending, outside the lock, and another
        thread's pass over the pool meanwhile closes it as surplus or expired. Connections are
        kept idle for ``KEEPALIVE`` seconds, less than the server keeps them
        (``http_limits.KEEP_ALIVE``), so the server never closes one a request is about to reuse."""
        import httpx

        http: httpx.Client | None = getattr(self._local, "http", None)
        if self._closed:
            raise RemoteError(f"{self.url}: this handle is closed; connect again")
        if http is not None:
            return http
        http = httpx.Client(base_url=self.url, headers=self._headers, timeout=self._timeout, limits=self._limits)
        with self._lock:
            closed = self._closed
            if not closed:
                ended = [c for c in self._clients if not c[0].is_alive()]  # of threads that ended
                self._clients = [c for c in self._clients if c[0].is_alive()]
                self._clients.append((threading.current_thread(), http))
        if closed:
            http.close()
            raise RemoteError(f"{self.url}: this handle is closed; connect again")
        for _, old in ended:
            old.close()
        self._local.http = http
        return http

    def __repr__(self) -> str:
        return f"<trellisdb.RemoteDatabase {self.url}>"

    # -------------------------------------------------------------- the wire
    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """One HTTP call: the decoded result (a ``pa.Table`` for rows); the server's error raised
        as its ``TrellisError`` class. The API below is made of these."""
        import httpx

        payload = None if body is None else wire.encode(body)
        try:
            r = self._http().request(method, path, json=payload)
        except httpx.HTTPError as e:
            raise RemoteError(f"{self.url}{path}: {e}; is `trellis serve` running there?") from e
        if r.status_code >= 400:
            try:
                err = r.json()
                kind, message = str(err["error"]), str(err["message"])
            except (ValueError, KeyError, TypeError):
                raise RemoteError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:200]}") from None
            cls = errors.AccessError if kind in ("Unauthorized", "Forbidden") else getattr(errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, TrellisError)):
                cls = RemoteError
            try:
                exc = cls(message)
            except TypeError:
                exc = RemoteError(f"{kind}: {message}")
            raise exc
        if r.headers.get("content-type", "").startswith(ARROW_STREAM):
            return pa.ipc.open_stream(r.content).read_all()
        try:
            return wire.decode(r.json()["result"])
        except (ValueError, KeyError, TypeError):
            raise RemoteError(f"{self.url}{path}: the answer is not trellisdb's: {r.text[:200]}") from None

    def call(self, method: str, *args: Any, session: str | None = None, **kwargs: Any) -> Any:
        """Call ``method`` of the served handle (or of session ``session``'s writer) with these
        arguments, inside this thread's open transaction if any."""
        return self.request("POST", "/v1/call", {"method": method, "args": list(args), "kwargs": kwargs,
                                                 "session": session, "tx": self.current_tx()})

    def current_tx(self) -> str | None:
        tx: RemoteTransaction | None = getattr(self._local, "tx", None)
        return None if tx is None else tx.id

    # -------------------------------------------------------------- writing
    def session(self, *, task: str, agent: str | None = None, model: str | None = None,
                config: Mapping[str, Any] | str | None = None, id: str | None = None,
                task_spec: str | None = None, at: object = None,
                attrs: Mapping[str, Any] | None = None) -> RemoteSession:
        """Start (or reopen) a session on the server; its writer (see ``Database.session``)."""
        kw = {"task": task, "agent": agent, "model": model, "config": config, "id": id, "task_spec": task_spec,
              "at": at, "attrs": attrs}
        out = self.request("POST", "/v1/sessions", {"kwargs": {k: v for k, v in kw.items() if v is not None},
                                                     "tx": self.current_tx()})
        return RemoteSession(self, out["id"], out["task_id"])

    def resume(self, session_id: str) -> RemoteSession:
        """A writer for an existing session."""
        out = self.request("POST", "/v1/sessions/resume", {"session": session_id})
        return RemoteSession(self, out["id"], out["task_id"])

    def record_step(self, *, session: str, task: str, rewards: Mapping[str, float] | None = None,
                    agent: str | None = None, model: str | None = None, **node: Any) -> dict[str, Any]:
        """One step in one call: a node (``add_node``'s arguments) and its rewards, in ``session``
        of ``task`` (opened if new); returns ``{"id", "commit"}`` once the step is durable (with
        ``"held": reason`` when the server's verify hook held it in quarantine). A retry with the
        same ``id=`` is idempotent."""
        body = {"session": session, "task": task, "agent": agent, "model": model, "node": node,
                "rewards": dict(rewards or {})}
        out: dict[str, Any] = self.request("POST", "/v1/steps", body)
        return out

    def add_task(self, id: str, *, name: str | None = None, spec: str | None = None,
                 tags: Sequence[str] | None = None, embedding: Sequence[float] | None = None) -> str:
        out: str = self.call("add_task", id, name=name, spec=spec, tags=tags, embedding=embedding)
        return out

    def set_attrs(self, entity: str, attrs: Mapping[str, Any], *, scope: str = "node", at: object = None) -> None:
        self.call("set_attrs", entity, attrs, scope=scope, at=at)

    def label(self, node_ids: str | Sequence[str], *labels: str, at: object = None) -> None:
        self.call("label", node_ids, *labels, at=at)

    def unlabel(self, node_ids: str | Sequence[str], *labels: str, at: object = None) -> None:
        self.call("unlabel", node_ids, *labels, at=at)

    def quarantine(self, node_ids: str | Sequence[str], reason: str | None = None, *, at: object = None) -> None:
        """Quarantine nodes (an admin's call; see ``Database.quarantine``)."""
        self.call("quarantine", node_ids, reason, at=at)

    def release(self, node_ids: str | Sequence[str], *, at: object = None) -> None:
        """Release quarantined nodes (an admin's call; see ``Database.release``)."""
        self.call("release", node_ids, at=at)

    def purge(self, session: str | Sequence[str] | None = None, *, task: str | None = None) -> dict[str, Any]:
        """Delete sessions' data from every stored version (an admin's call; see ``Database.purge``)."""
        out: dict[str, Any] = self.call("purge", session, task=task)
        return out

    def purge_tenant(self, tenant: str) -> dict[str, Any]:
        """Delete this token's tenant (``tenant`` repeats its name, as a confirmation): its whole
        store and its tokens (an admin's call; the default tenant, the served folder itself,
        cannot be). This token stops working with it."""
        out: dict[str, Any] = self.request("POST", "/v1/tenant/purge", {"tenant": tenant})
        return out

    def add_vectors(self, space: str, ids: Sequence[str], vectors: Any, *, target: str = "nodes") -> None:
        self.call("add_vectors", space, list(ids), vectors, target=target)

    def ingest(self, tables: Mapping[str, pa.Table], message: str | None = None,
               meta: Mapping[str, Any] | None = None) -> int:
        """Bulk-write Arrow tables as one commit (see ``Database.ingest``); sent as Arrow IPC."""
        out: int = self.call("ingest", dict(tables), message, meta)
        return out

    def flush(self, meta: Mapping[str, Any] | None = None) -> int | None:
        """Make every write made so far durable (with other clients' writes: one commit); the
        commit that holds them."""
        out: int | None = self.request("POST", "/v1/flush", {"meta": meta})
        return out

    def in_transaction(self) -> bool:
        return self.current_tx() is not None

    @contextmanager
    def transaction(self, message: str | None = None, meta: Mapping[str, Any] | None = None, *,
                    timeout: float = 30.0) -> Iterator[RemoteTransaction]:
        """Commit every write made in the block (in this thread) as one commit, as
        ``Database.transaction``. The server holds it open between calls; ``timeout`` seconds
        without a call roll it back (the block's next call then raises ``TransactionError``)."""
        if self.in_transaction():
            raise errors.TransactionError("transactions do not nest; commit the outer one first")
        out = self.request("POST", "/v1/tx/begin", {"message": message, "meta": meta, "timeout": timeout})
        tx = RemoteTransaction(out["tx"])
        self._local.tx = tx
        try:
            yield tx
        except BaseException:
            self._local.tx = None
            with contextlib.suppress(TrellisError):  # the block's own error matters more; the server drops it
                self.request("POST", "/v1/tx/rollback", {"tx": tx.id})
            raise
        self._local.tx = None
        tx.commit_id = self.request("POST", "/v1/tx/commit", {"tx": tx.id})["commit_id"]

    def tag(self, name: str, commit: int | None = None, *, move: bool = False) -> int:
        out: int = self.call("tag", name, commit, move=move)
        return out

    def untag(self, name: str) -> int:
        out: int = self.call("untag", name)
        return out

    # -------------------------------------------------------------- reading
    def query(self, text: str, **params: Any) -> Result:
        """Run TQL on the server (see ``Database.query``); the rows as a ``Result``."""
        return Result(self.request("POST", "/v1/query", {"tql": text, "params": params, "format": "arrow"}))

    def sql(self, text: str, as_of: int | str | None = None,
            params: Sequence[Any] | Mapping[str, Any] | None = None) -> Result:
        """Read-only SQL on the server (see ``Database.sql``)."""
        p = dict(params) if isinstance(params, Mapping) else (list(params) if params is not None else None)
        return Result(self.request("POST", "/v1/sql", {"sql": text, "as_of": as_of, "params": p,
                                                        "format": "arrow"}))

    def log(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.request("GET", "/v1/log")
        return out

    def tags(self) -> dict[str, int]:
        out: dict[str, int] = self.call("tags")
        return out

    def resolve_as_of(self, as_of: int | str | None) -> int:
        out: int = self.call("resolve_as_of", as_of)
        return out

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = self.request("GET", "/v1/health")
        return out

    # -------------------------------------------------------------- spaces
    def create_space(self, name: str, *, target: str = "nodes", dim: int | None = None,
                     model: str | None = None, text: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = self.call("create_space", name, target=target, dim=dim, model=model, text=text)
        return out

    def spaces(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.call("spaces")
        return out

    def index_status(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.call("index_status")
        return out

    def build_index(self, space: str = "embedding", *, target: str = "nodes", wait: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = self.call("build_index", space, target=target, wait=wait)
        return out

    # -------------------------------------------------------------- views
    def create_view(self, name: str, kind: str, *, replace: bool = False, **options: Any) -> dict[str, Any]:
        out: dict[str, Any] = self.call("create_view", name, kind, replace=replace, **options)
        return out

    def views(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.call("views")
        return out

    def materialize(self, name: str, as_of: int | str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = self.call("materialize", name, as_of)
        return out

    def refresh(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = self.call("refresh", name)
        return out

    def view(self, name: str) -> Result:
        return Result(self.call("view", name))

    def drop_view(self, name: str) -> None:
        self.call("drop_view", name)

    def export(self, name: str, path: str | os.PathLike[str], format: str = "trl", *, validation: float = 0.0,
               overwrite: bool = False, skip_missing: bool = False) -> dict[str, Any]:
        """Export a materialized view on the server, into ``path`` under the server's export root
        (``trellis serve --export-root``; default ``<db>/exports``)."""
        out: dict[str, Any] = self.call("export", name, os.fspath(path), format, validation=validation,
                                        overwrite=overwrite, skip_missing=skip_missing)
        return out


class RemoteSession:
    """The writer of one session on a served store (see ``SessionWriter``): each call is checked
    by the server when it is made, and group-committed."""

    def __init__(self, db: RemoteDatabase, session_id: str, task_id: str) -> None:
        self.db = db
        self.id = session_id
        self.task_id = task_id
        self._closed = False

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if not self._closed:
            self.close(status="failed" if et is not None else "completed")

    def __repr__(self) -> str:
        return f"<trellisdb.RemoteSession {self.id!r} of {self.db.url}>"

    def close(self, status: str = "completed") -> None:
        """Record the session's final status; its writes are durable on return (outside a transaction)."""
        self._closed = True
        self.db.request("POST", "/v1/sessions/close", {"session": self.id, "status": status,
                                                       "tx": self.db.current_tx()})

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.db.call(method, *args, session=self.id, **kwargs)

    def add_node(self, **fields: Any) -> str:
        """Add a node: ``SessionWriter.add_node``'s arguments (``id``, ``parents``, ``summary``,
        ``artifacts``, ``embedding``, ``attrs``, ``labels``, ``at``...); its id."""
        out: str = self._call("add_node", **fields)
        return out

    def add_edge(self, src: str, dst: str, kind: str = "derived_from", *, at: object = None) -> None:
        self._call("add_edge", src, dst, kind, at=at)

    def add_artifact(self, node_id: str, name: str, content: str | bytes, media_type: str | None = None) -> str:
        out: str = self._call("add_artifact", node_id, name, content, media_type)
        return out

    def add_reward(self, node_id: str, channel: str, value: float, *, verifier: str | None = None,
                   verifier_version: str | None = None, at: object = None) -> None:
        self._call("add_reward", node_id, channel, value, verifier=verifier, verifier_version=verifier_version,
                   at=at)

    def add_comparison(self, a: str, b: str, preferred: str | None, *, margin: float | None = None,
                       judge: str | None = None, id: str | None = None, at: object = None) -> str:
        out: str = self._call("add_comparison", a, b, preferred, margin=margin, judge=judge, id=id, at=at)
        return out

    def set_status(self, node_id: str | Sequence[str], status: str) -> None:
        self._call("set_status", node_id, status)

    def set_attrs(self, entity: str, attrs: Mapping[str, Any], *, scope: str = "node", at: object = None) -> None:
        self._call("set_attrs", entity, attrs, scope=scope, at=at)

    def label(self, node_ids: str | Sequence[str], *labels: str, at: object = None) -> None:
        self._call("label", node_ids, *labels, at=at)

    def unlabel(self, node_ids: str | Sequence[str], *labels: str, at: object = None) -> None:
        self._call("unlabel", node_ids, *labels, at=at)
