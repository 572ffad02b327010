"""The final review of issue 35's merge: each test showed one defect found in the merged tree
(each failed before its fix).

Real components only: a store in ``tmp_path``, a repair that really copies rows to
``lost+found/``, a real ``trellis serve`` process (``tests/serving.py``), the real MCP client.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

import trellisdb
from trellisdb.client import RemoteDatabase
from trellisdb.database import open_local
from trellisdb.schema import table_schema
from trellisdb.tenants import Tokens

from ..serving import free_port, mcp_calls, start, stop


# ---------------------------------------------------------------- purge and lost+found
def test_purge_keeps_another_sessions_node_whose_id_a_repair_copy_names(tmp_path: Path) -> None:
    """A repair copied the rows of a never-acknowledged commit of session ``alpha`` (node
    ``n-1``) to ``lost+found/`` and deleted them, so the id ``n-1`` is free again; session
    ``beta`` then writes its own, committed node ``n-1``. Purging ``alpha`` must not touch
    ``beta``'s node: ``purge.py`` adds every node id the copies attribute to ``alpha`` to the
    set N it deletes *by id* from every live table (nodes, rewards, edges, ...)."""
    db = open_local(tmp_path / "db", embedding_dim=4)
    try:
        with db.session(task="t", id="alpha") as s:
            s.add_node(id="alpha-root", summary="alpha's")
        with db.session(task="t", id="beta") as s:
            s.add_node(id="beta-root", summary="beta's")
        db.flush()
        db._committer.checkpoint()
        # rows of a commit no record names (its writer died before its record): repair copies them out
        doomed = db._store.log.state.max_id + 1
        db._store.tables.append("nodes", pa.Table.from_pylist(
            [{"id": "n-1", "session_id": "alpha", "task_id": "t", "summary": "alpha's lost step",
              "commit_id": doomed}], schema=table_schema("nodes", 4)))
        report = db.repair()
        assert report["removed"] and report["removed"][0]["id"] == doomed, report
        assert list((tmp_path / "db" / "lost+found").rglob("nodes.parquet"))
        assert db.sql("SELECT count(*) AS n FROM nodes_full_history WHERE id = 'n-1'").to_pylist() == [{"n": 0}]
        # beta writes its own node under the freed id, with a reward and a child
        with db.resume("beta") as s:
            s.add_node(id="n-1", parents=["beta-root"], summary="beta's step")
            s.add_reward("n-1", "score", 0.75)
            s.add_node(id="beta-kid", parents=["n-1"], summary="beta's kid")
        db.flush()
        assert db.sql("SELECT session_id FROM nodes WHERE id = 'n-1'").to_pylist() == [{"session_id": "beta"}]

        db.purge("alpha")

        assert db.sql("SELECT session_id, summary FROM nodes WHERE id = 'n-1'").to_pylist() == [
            {"session_id": "beta", "summary": "beta's step"}]
        assert db.sql("SELECT value FROM rewards WHERE node_id = 'n-1'").to_pylist() == [{"value": 0.75}]
        assert db.sql("SELECT src FROM edges WHERE dst = 'beta-kid'").to_pylist() == [{"src": "n-1"}]
    finally:
        db.close()


# ---------------------------------------------------------------- MCP reads and the read turns
#: A SELECT that runs until its time limit stops it (raw SQL admits range()).
LONG_SQL = "SELECT count(*) AS n FROM range(1000000000) a, range(100000) b"


def _post(url: str, token: str, path: str, body: dict[str, Any], timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={"authorization": f"Bearer {token}"}, timeout=timeout)


@pytest.fixture
def one_turn(tmp_path: Path) -> Iterator[tuple[str, dict[str, str]]]:
    """A server with one read turn in all (per token, per tenant, per server) and a 3 s limit."""
    path = tmp_path / "db"
    with trellisdb.connect(path) as db:
        assert isinstance(db, trellisdb.Database)
        with db.session(task="t", id="s") as s:
            s.add_node(id="a", summary="root")
    tokens = Tokens(str(path))
    tok = {"analyst": tokens.create("default", "analyst", name="hostile"),
           "admin": tokens.create("default", "admin", name="boss")}
    port = free_port()
    proc = start(path, port, None, "--query-timeout", "3", "--token-reads", "1", "--tenant-reads", "1",
                 "--max-reads", "1", "--read-wait", "0.3", probe=tok["admin"])
    try:
        yield f"http://127.0.0.1:{port}", tok
    finally:
        stop(proc)


def test_mcp_queries_wait_for_the_same_read_turns_as_rest(one_turn: tuple[str, dict[str, str]]) -> None:
    """docs/server.md ("Limits: no caller can stall the server") and README "Safety": queries
    run a few at a time per token, per tenant and per server, and one that finds no turn gets
    ``BusyError``. MCP's ``query`` (and ``frontier``, ``lineage``, ``retrieve``) call
    ``Service.query`` straight from FastMCP's worker thread (``mcp_server.run_tql`` ->
    ``service.Caller.query``), never through ``server.read``: an analyst whose one turn is taken
    still runs queries over MCP, as many as anyio's default pool has threads (the pool REST's
    token routes, ``/v1/log`` and every MCP tool, ``record_step`` included, share), and none is
    cancelled when its client hangs up."""
    pytest.importorskip("mcp")
    url, tok = one_turn
    out: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: out.append(_post(url, tok["analyst"], "/v1/sql", {"sql": LONG_SQL})))
    holder.start()
    try:
        time.sleep(0.6)  # the long query has the analyst's (and the server's) one turn
        busy = _post(url, tok["analyst"], "/v1/sql", {"sql": "SELECT 1 AS x"})
        assert busy.status_code == 429 and busy.json()["error"] == "BusyError", busy.text  # REST: refused
        _, (answer,) = mcp_calls(url, tok["analyst"], [("query", {"tql": "NODES RETURN count(*) AS n"})])
        assert holder.is_alive()  # (asked while the turn was taken)
        assert answer.is_error and "BusyError" in str(answer.content[0].text), answer.content[0].text
    finally:
        holder.join()
    assert out and out[0].json()["error"] == "QueryTimeoutError"


def test_read_wait_zero_still_admits_a_read_when_a_turn_is_free(tmp_path: Path) -> None:
    """``--read-wait 0`` (take a free turn, never queue) refuses every query, on an idle server:
    ``server.turn`` waits with ``anyio.fail_after(0)``, whose scope is cancelled before
    ``CapacityLimiter.acquire`` checks for a free token, so it always times out. The CLI and
    ``build_app`` accept 0 (and negative values) without a word; the same happens to a query
    whose token turn came just at the end of its ``read_wait`` (its tenant and server turns get
    ``max(0, until - now)`` = 0)."""
    path = tmp_path / "db"
    trellisdb.connect(path).close()  # type: ignore[union-attr]
    token = "rw0-token"
    port = free_port()
    proc = start(path, port, token, "--read-wait", "0")
    try:
        r = _post(f"http://127.0.0.1:{port}", token, "/v1/sql", {"sql": "SELECT 1 AS x"})
        assert r.status_code == 200, r.text  # nothing else runs: every turn is free
    finally:
        stop(proc)


# ---------------------------------------------------------------- the query watchdog
_WATCHDOG_PROBE = """
import sys, tempfile, threading, time, trellisdb
LONG_SQL = "SELECT count(*) AS n FROM range(1000000000) a, range(100000) b"
try:
    trellisdb.connect(tempfile.mkdtemp() + "/c", query_timeout=1e10)
    print("1e10 taken")
except trellisdb.ValidationError:
    pass  # past the longest limit (a year): refused at the call
roomy = trellisdb.connect(tempfile.mkdtemp() + "/a", query_timeout=365 * 86400)  # the longest: a year
roomy.sql("SELECT 1 AS x")
time.sleep(0.5)
strict = trellisdb.connect(tempfile.mkdtemp() + "/b", query_timeout=0.5)
scope = strict.query_scope()
got = []
def run():
    with scope:
        try:
            strict.sql(LONG_SQL)
        except trellisdb.TrellisError as e:
            got.append(type(e).__name__)
t = threading.Thread(target=run)
t.start()
t.join(8)
stopped_in_time = not t.is_alive()
scope.cancel("the probe is over")  # (interrupts it directly: the core is freed either way)
t.join()
print("stopped" if stopped_in_time else "still running after 8 s", got)
"""


def test_one_handles_long_query_timeout_does_not_switch_off_every_handles_limit(tmp_path: Path) -> None:
    """``check_timeout`` accepts any finite number of seconds, but the one watchdog thread per
    process (``reader._Watchdog._run``) waits with ``Condition.wait(deadline - now)``, which
    raises ``OverflowError`` past ``threading.TIMEOUT_MAX`` (~9.2e9 s): one handle opened with
    ``query_timeout=1e10`` (or ``float(sys.maxsize)``, ``trellis serve --query-timeout 1e10``)
    kills the thread, which is never started again (``_thread`` stays set), and from then on no
    query of any handle in the process is stopped at its limit: a 0.5 s limit lets a cross join
    run for hours. (Run in a fresh process: the watchdog is process-wide.)"""
    out = subprocess.run([sys.executable, "-c", _WATCHDOG_PROBE], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=dict(os.environ))
    assert "stopped ['QueryTimeoutError']" in out.stdout and "1e10 taken" not in out.stdout, (
        out.stdout, out.stderr[-600:])


# ---------------------------------------------------------------- errors that escape
@pytest.mark.parametrize("expires", ["3000000d", "99999999999999999999d", "9999-12-31T23:59:59-01:00"])
def test_a_far_expiry_is_refused_as_a_validation_error(tmp_path: Path, expires: str) -> None:
    """``tenants.expiry`` adds the duration to now (or moves an ISO time to UTC) unguarded:
    ``OverflowError`` escapes from ``Tokens.create`` -- a traceback from ``trellis token create
    --expires``, a 500 ``InternalError`` from ``POST /v1/tokens``."""
    with pytest.raises(trellisdb.ValidationError):
        Tokens(str(tmp_path)).create("acme", "agent", expires=expires)


def test_a_memory_limit_duckdb_cannot_hold_is_a_validation_error(tmp_path: Path) -> None:
    """``SqlEngine._limit_memory`` checks only the lower bound: ``connect(memory_limit=10**30)``
    (and ``trellis serve --memory-limit 1000000PB``) raises DuckDB's own ``ParserException``."""
    with pytest.raises(trellisdb.ValidationError, match="memory_limit"):
        trellisdb.connect(tmp_path / "db", memory_limit=10**30)


# ---------------------------------------------------------------- defaults that meet
def test_the_default_remote_client_waits_past_the_default_query_limit() -> None:
    """docs/server.md: "give [the client's timeout] more than --query-timeout plus --read-wait to
    get the server's error rather than hang up first". The defaults do the opposite:
    ``RemoteDatabase(timeout=60.0)`` against ``QUERY_TIMEOUT = 60.0`` and ``READ_WAIT = 10.0``.
    A remote caller whose query meets the default limit gets ``RemoteError: ... timed out; is
    `trellis serve` running there?`` (checked with both at 2 s) instead of the
    ``QueryTimeoutError`` that names the limit (issue 35, item 6: "a clear error naming the
    limit")."""
    import inspect

    from trellisdb.reader import QUERY_TIMEOUT
    from trellisdb.server import READ_WAIT

    client = inspect.signature(RemoteDatabase).parameters["timeout"].default
    connect = inspect.signature(trellisdb.connect).parameters["timeout"].default
    assert min(client, connect) > QUERY_TIMEOUT + READ_WAIT, (client, connect, QUERY_TIMEOUT, READ_WAIT)


# ---------------------------------------------------------------- transactions: one agent, every slot
def test_one_agent_cannot_take_every_transaction_slot_of_its_tenant(tmp_path: Path) -> None:
    """``Service.begin`` caps open transactions per tenant (``MAX_TRANSACTIONS`` = 256) but not per
    token: one agent that begins 256 (each may ask ``timeout=600`` and renew them) leaves every
    other agent of the tenant "256 transactions are open on this server" -- the stall issue 35
    forbids for reads ("one caller's long queries leave the others a turn"), on the writes'
    side. (In-process: the same ``Service`` every HTTP door calls.)"""
    from trellisdb.errors import TransactionError
    from trellisdb.service import MAX_TRANSACTIONS, Service
    from trellisdb.tenants import Principal

    hog, other = Principal("hog", "default", "agent", key="k1"), Principal("worker", "default", "agent", key="k2")
    db = open_local(tmp_path / "db")
    service = Service(db)
    try:
        for _ in range(MAX_TRANSACTIONS):
            try:
                service.begin({"timeout": 600}, hog)
            except TransactionError:
                break  # refused its own share: what a per-token bound would do
        try:
            service.begin({"message": "an ordinary step"}, other)
        except TransactionError as e:
            pytest.fail(f"another agent of the tenant is refused a transaction: {e}")
    finally:
        service.close()
        db.close()
