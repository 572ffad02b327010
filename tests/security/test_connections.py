"""No client holds a connection of ``trellis serve`` for ever (issue 35, item 8): real sockets
against a real server process. Connections that send nothing, trickle their headers or sit idle
after a response are closed within their bounds, and descriptors stay under the connection
bound however many are opened (2,000 idle connections held 2,021 descriptors before)."""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import httpx
import pytest

from ..serving import free_port, start, stop

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")

TOKEN = "conn-token"
HEADER_TIMEOUT = 1.0
KEEP_ALIVE = 1
MAX_CONNECTIONS = 40


class Served(NamedTuple):
    port: int
    pid: int


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    proc = start(tmp_path_factory.mktemp("conn") / "db", port, TOKEN, "--header-timeout", str(HEADER_TIMEOUT),
                 "--keep-alive", str(KEEP_ALIVE), "--max-connections", str(MAX_CONNECTIONS))
    try:
        yield Served(port, proc.pid)
    finally:
        stop(proc)


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _until_closed(s: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the server closes ``s`` (at most ``limit``), and what it sent meanwhile."""
    t0 = time.monotonic()
    got = b""
    s.settimeout(limit)
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        pytest.fail(f"the server kept the connection open over {limit} s (it sent {got[:200]!r})")
    except ConnectionResetError:
        pass
    return time.monotonic() - t0, got


def _response(s: socket.socket) -> bytes:
    """One whole response (its headers, then content-length bytes)."""
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(65536)
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def test_a_connection_that_sends_nothing_is_closed(served: Served) -> None:
    with _connect(served.port) as s:
        took, got = _until_closed(s, HEADER_TIMEOUT + 3)
    assert took >= HEADER_TIMEOUT * 0.8 and got == b""  # nothing to answer: closed


def test_headers_trickled_in_are_answered_408_and_closed(served: Served) -> None:
    with _connect(served.port) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while not select.select([s], [], [], 0.1)[0]:  # a byte of a header every 100 ms, until answered
            assert time.monotonic() - t0 < HEADER_TIMEOUT + 3, "the server kept taking header bytes"
            s.sendall(b"X")
        _, got = _until_closed(s, 3)
    assert HEADER_TIMEOUT * 0.8 <= time.monotonic() - t0 < HEADER_TIMEOUT + 3
    assert got.startswith(b"HTTP/1.1 408") and b'"error": "RequestTimeout"' in got, got[:300]


def test_an_idle_keep_alive_connection_is_closed_and_a_busy_one_kept(served: Served) -> None:
    request = f"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode()
    with _connect(served.port) as s:
        for _ in range(3):  # requests on one connection, each well within the bounds
            s.sendall(request)
            answer = _response(s)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"}"), answer[:200]
            time.sleep(KEEP_ALIVE / 3)
        took, _ = _until_closed(s, KEEP_ALIVE + 3)
    assert took >= KEEP_ALIVE * 0.4


def test_descriptors_stay_under_the_connection_bound(served: Served) -> None:
    """300 connections opened at once and left idle: those past the bound are answered 503 and
    closed at once, the others once the header timeout passes; the server's descriptors never
    grow by more than the bound, and come back to where they were; it answers throughout."""
    base = _descriptors(served.pid)
    held = []
    peak = base
    for k in range(300):
        held.append(_connect(served.port))
        if k % 20 == 0:
            peak = max(peak, _descriptors(served.pid))
    peak = max(peak, _descriptors(served.pid))
    assert peak <= base + MAX_CONNECTIONS + 10, (base, peak)
    refused = 0
    for s in held[MAX_CONNECTIONS + 5:]:  # the late ones: refused at once
        s.settimeout(2)
        refused += s.recv(4096).startswith(b"HTTP/1.1 503")
    assert refused == len(held) - MAX_CONNECTIONS - 5
    deadline = time.monotonic() + HEADER_TIMEOUT + 5
    while _descriptors(served.pid) > base + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _descriptors(served.pid) <= base + 2, (base, _descriptors(served.pid))
    for s in held:
        s.close()
    r = httpx.get(f"http://127.0.0.1:{served.port}/v1/health", headers={"authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200


def test_serve_refuses_bounds_that_are_not_bounds(tmp_path: Path) -> None:
    from trellisdb.errors import ValidationError
    from trellisdb.server import serve

    for bad in ({"header_timeout": 0}, {"keep_alive": -1}, {"max_connections": 0}):
        with pytest.raises(ValidationError, match="must be"):
            serve(str(tmp_path / "db"), **bad)  # type: ignore[arg-type]
