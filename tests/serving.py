"""Starting a real ``trellis serve`` process for tests (shared by the server and API suites)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(path: Path, port: int, token: str | None = None, *extra: str,
          probe: str | None = None) -> subprocess.Popen[bytes]:
    """``trellis --db path serve [--token token]`` on ``port``; returns once it answers /v1/health
    (asked with ``probe``, default ``token``: a token the server knows)."""
    cmd = [sys.executable, "-m", "trellisdb.cli", "--db", str(path), "serve", "--port", str(port), *extra]
    if token is not None:
        cmd += ["--token", token]
    err = tempfile.TemporaryFile()  # noqa: SIM115 (the process writes it for its life; not a pipe: never blocks)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    probe = probe or token
    headers = {"authorization": f"Bearer {probe}"} if probe else {}
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/v1/health", headers=headers).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            err.seek(0)
            pytest.fail(f"the server did not start: {err.read().decode()[-2000:]}")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def mcp_calls(url: str, token: str, calls: list[tuple[str, dict[str, Any]]]) -> tuple[list[str], list[Any]]:
    """The MCP tools ``url``'s ``/mcp`` lists to ``token``, and the results of ``calls`` (tool name,
    arguments), through the official SDK's streamable-HTTP client."""
    import anyio
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    async def go() -> tuple[list[str], list[Any]]:
        http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=httpx2.Timeout(30))
        async with http, Client(streamable_http_client(f"{url}/mcp", http_client=http)) as c:
            names = sorted(t.name for t in (await c.list_tools()).tools)
            return names, [await c.call_tool(name, args) for name, args in calls]
    return anyio.run(go)
