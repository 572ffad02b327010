"""A client of ``trellis serve`` (issue 25, first slice): queries, SQL and whole steps over HTTP.

Results come back as Arrow IPC streams and are the embedded handle's ``Result``; errors are
raised as the same ``TrellisError`` subclasses the server met (``QuerySyntaxError``,
``UnknownNodeError``...), with its message. Needs the ``server`` extra (httpx).

    >>> from trellisdb.client import RemoteDatabase
    >>> db = RemoteDatabase("http://127.0.0.1:7437")   # doctest: +SKIP
    >>> db.record_step(session="s1", task="t", summary="try", rewards={"score": 0.5})  # doctest: +SKIP
    {'id': '01a2...', 'commit': 12}
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from trellisdb import errors
from trellisdb.errors import TrellisError, ValidationError
from trellisdb.result import Result


class RemoteError(TrellisError):
    """The server could not be reached, or answered something that is not trellisdb's."""


class RemoteDatabase:
    """A store served by ``trellis serve`` at ``url``."""

    def __init__(self, url: str, *, token: str | None = None, timeout: float = 30.0) -> None:
        import httpx

        headers = {"authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def __enter__(self) -> RemoteDatabase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def __repr__(self) -> str:
        return f"<trellisdb.RemoteDatabase {self.url}>"

    # -------------------------------------------------------------- calls
    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            r = self._http.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise RemoteError(f"{self.url}{path}: {e}; is `trellis serve` running there?") from e
        if r.status_code >= 400:
            try:
                err = r.json()
                kind, message = str(err["error"]), str(err["message"])
            except (ValueError, KeyError, TypeError):
                raise RemoteError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:200]}") from None
            cls = getattr(errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, TrellisError)):
                cls = RemoteError
            try:
                exc = cls(message)
            except TypeError:
                exc = RemoteError(f"{kind}: {message}")
            raise exc
        if r.headers.get("content-type", "").startswith("application/vnd.apache.arrow.stream"):
            return pa.ipc.open_stream(r.content).read_all()
        return r.json()

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = self._call("GET", "/v1/health")
        return out

    def query(self, text: str, **params: Any) -> Result:
        """Run TQL on the server (see ``Database.query``); the rows as a ``Result``."""
        return Result(self._call("POST", "/v1/query", {"tql": text, "params": params, "format": "arrow"}))

    def sql(self, text: str, as_of: int | str | None = None,
            params: list[Any] | dict[str, Any] | None = None) -> Result:
        """Read-only SQL on the server (see ``Database.sql``)."""
        return Result(self._call("POST", "/v1/sql", {"sql": text, "as_of": as_of, "params": params,
                                                      "format": "arrow"}))

    def record_step(self, *, session: str, task: str, rewards: dict[str, float] | None = None,
                    agent: str | None = None, model: str | None = None, **node: Any) -> dict[str, Any]:
        """One step in one call: a node (``add_node``'s arguments) and its rewards, in ``session``
        of ``task``; returns ``{"id", "commit"}`` once the step is durable."""
        body = {"session": session, "task": task, "agent": agent, "model": model, "node": node,
                "rewards": rewards or {}}
        try:
            json.dumps(body, allow_nan=False)  # a value JSON cannot carry is refused here, nothing sent
        except (TypeError, ValueError) as e:
            raise ValidationError(f"the step holds a value JSON cannot carry ({e}); send finite numbers, "
                                  "strings, lists and mappings") from None
        out: dict[str, Any] = self._call("POST", "/v1/steps", body)
        return out

    def log(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self._call("GET", "/v1/log")
        return out
