"""What a connection to ``trellis serve`` may hold: uvicorn's HTTP protocol (httptools) with
bounds uvicorn does not set.

uvicorn closes a keep-alive connection ``timeout_keep_alive`` seconds after its last response,
but it never closes a connection that has not sent a whole request's headers: one that sends
nothing, or trickles its headers a byte at a time (each byte cancels the keep-alive timer), is
kept for ever (2,000 idle connections held 2,021 descriptors). :func:`bounded` adds:

- a **header timeout**: from the moment a connection opens, and from the first byte of each
  later request, its headers must be whole within ``header_timeout`` seconds; else the
  connection is closed (with a 408 when a request had begun);
- a **header size** bound: past ``max_header_bytes`` before the headers end, 431 and closed;
- a **connection bound**: past ``max_connections`` open at once, a new connection is answered
  503 and closed at once, so descriptors never grow past it (plus the store's own files).

A request's body has its own timeout (``server.BODY_TIMEOUT``, answered 408 by the app).
"""

from __future__ import annotations

import asyncio
import json

#: Seconds a client has to send a request's headers (from connecting, or from its first byte).
HEADER_TIMEOUT = 10.0
#: Seconds an idle keep-alive connection is kept after a response (clients keep theirs for less).
KEEP_ALIVE = 5
#: Connections open at once; a new one past it is answered 503 and closed.
MAX_CONNECTIONS = 1000
#: Bytes of one request's start line and headers.
MAX_HEADER_BYTES = 64 << 10


def refusal(status: int, reason: str, kind: str, message: str) -> bytes:
    """A whole HTTP response closing the connection, its body the app's JSON error."""
    body = json.dumps({"error": kind, "message": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def bounded(header_timeout: float = HEADER_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
            max_header_bytes: int = MAX_HEADER_BYTES) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with these bounds (see the module notes), for
    ``uvicorn.run(..., http=bounded(...))``."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # (the server extra: imported to serve)

    class Bounded(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None  # armed while a request's headers are awaited
        _begun = False  # whether bytes of the awaited request came
        _header_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                self._refuse(503, "Service Unavailable", "TooManyConnections",
                             f"{max_connections:,} connections are open; retry in a moment")
                return
            self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._headers_done()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._timer is not None:
                self._header_bytes += len(data)
            super().data_received(data)
            if self._timer is not None and self._header_bytes > max_header_bytes:
                self._refuse(431, "Request Header Fields Too Large", "HeadersTooLarge",
                             f"the request's headers are over {max_header_bytes:,} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._timer is None:  # a later request on a kept connection: its headers are awaited
                self._await_headers()
            self._begun = True

        def on_headers_complete(self) -> None:
            self._headers_done()
            super().on_headers_complete()

        def _await_headers(self) -> None:
            self._headers_done()
            self._begun, self._header_bytes = False, 0
            self._timer = self.loop.call_later(header_timeout, self._headers_late)

        def _headers_done(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_late(self) -> None:
            self._timer = None
            if self._begun:
                self._refuse(408, "Request Timeout", "RequestTimeout",
                             f"the request's headers took over {header_timeout:g} s to arrive; send them whole")
            elif not self.transport.is_closing():
                self.transport.close()  # it sent nothing: nobody to answer

        def _refuse(self, status: int, reason: str, kind: str, message: str) -> None:
            self._headers_done()
            if not self.transport.is_closing():
                self.transport.write(refusal(status, reason, kind, message))
                self.transport.close()

    return Bounded
