"""A caller's query is bounded in time and memory (issue 35, item 6), embedded.

Every ``db.query`` and ``db.sql`` runs under the handle's ``query_timeout`` (``connect(...,
query_timeout=SECONDS)``, default 60 s): past it the statement running is interrupted in DuckDB
and ``QueryTimeoutError`` names the limit and how to raise it; the engine's threads are free
again. ``memory_limit`` caps the store's engine (mirror and queries together), so a query that
needs more raises ``QueryMemoryError`` instead of taking the machine's memory (or filling the
disk with spill files). A ``QueryScope`` lets a server cancel a caller's query from another
thread. View statements and the store's own upkeep are not bounded.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import trellisdb

#: A SELECT that runs for hours in little memory: a cross join of two ranges (raw SQL admits range()).
LONG_SQL = "SELECT count(*) AS n FROM range(1000000000) a, range(100000) b"
#: More groups than 200 MiB hold (nothing spills to disk).
BIG_GROUP_BY = "SELECT count(*) AS n FROM (SELECT i % 20000000 AS k, count(*) FROM range(40000000) t(i) GROUP BY k)"


def clique(db: trellisdb.Database, k: int = 100) -> None:
    """``k`` nodes each a parent of every other (and ``z``, reached by none): ``PATH FROM 'n0' TO
    'z'`` walks the cycles up to TQL's hop bound, seconds of DuckDB over this small store."""
    with db.session(task="t", id="clique") as s:
        ids = [s.add_node(id=f"n{i}") for i in range(k)]
        for a in ids:
            for b in ids:
                if a != b:
                    s.add_edge(a, b, "derived_from")
        s.add_node(id="z")


def cpu_seconds_over(seconds: float) -> float:
    """CPU time this process (all its threads, DuckDB's included) uses in the next ``seconds``."""
    start = time.process_time()
    time.sleep(seconds)
    return time.process_time() - start


@pytest.fixture
def db(tmp_path: Path) -> Iterator[trellisdb.Database]:
    handle = trellisdb.connect(tmp_path / "db", query_timeout=0.5)
    assert isinstance(handle, trellisdb.Database)
    with handle.session(task="t", id="s") as s:
        s.add_node(id="a", summary="root")
    try:
        yield handle
    finally:
        handle.close()


def test_sql_past_its_time_limit_is_stopped_with_the_limit_named_and_the_cores_freed(db: trellisdb.Database) -> None:
    start = time.monotonic()
    with pytest.raises(trellisdb.QueryTimeoutError) as e:
        db.sql(LONG_SQL)
    took = time.monotonic() - start
    assert 0.4 < took < 5, took
    assert "0.5 s" in str(e.value) and "query_timeout" in str(e.value) and e.value.limit == "query_timeout"
    assert isinstance(e.value, trellisdb.QueryLimitError) and isinstance(e.value, trellisdb.QueryError)
    assert cpu_seconds_over(1.0) < 0.3  # DuckDB stopped: no core keeps burning
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 1}]  # the handle still answers


def test_tql_past_its_time_limit_is_stopped(tmp_path: Path) -> None:
    with trellisdb.connect(tmp_path / "db", query_timeout=1.0) as db:
        clique(db)
        start = time.monotonic()
        with pytest.raises(trellisdb.QueryTimeoutError, match="query_timeout"):
            db.query("PATH FROM 'n0' TO 'z'")
        assert time.monotonic() - start < 6
        assert cpu_seconds_over(1.0) < 0.3
        assert db.query("NODES WHERE id = 'z' RETURN id").to_pylist() == [{"id": "z"}]


def test_no_time_limit_lets_a_query_finish(tmp_path: Path) -> None:
    with trellisdb.connect(tmp_path / "db", query_timeout=None) as db:
        clique(db, 40)
        assert db.query("PATH FROM 'n0' TO 'z'").to_pylist() == []


def test_a_scope_cancelled_from_another_thread_stops_the_running_query(db: trellisdb.Database) -> None:
    from trellisdb.reader import QueryScope

    scope = QueryScope(timeout=None)
    threading.Timer(0.3, scope.cancel, args=("the client went away",)).start()
    start = time.monotonic()
    with scope, pytest.raises(trellisdb.QueryCancelledError, match="the client went away"):
        db.sql(LONG_SQL)  # under the thread's scope (no time limit of its own), not the handle's 0.5 s
    assert 0.25 < time.monotonic() - start < 0.5 + 0.2  # the cancel stopped it, before the handle's limit
    assert cpu_seconds_over(0.5) < 0.2


def test_tql_and_sql_run_under_the_threads_scope(db: trellisdb.Database) -> None:
    from trellisdb.reader import QueryScope

    stopped = db.query_scope()
    stopped.cancel("stopped before it began")
    with stopped:
        with pytest.raises(trellisdb.QueryCancelledError, match="stopped before it began"):
            db.query("NODES RETURN id")
        with pytest.raises(trellisdb.QueryCancelledError):
            db.sql("SELECT 1 AS x")
    late = QueryScope(timeout=0.01)
    with late:
        time.sleep(0.05)  # the time is up before the statement starts: it raises at once
        with pytest.raises(trellisdb.QueryTimeoutError, match=r"0\.01 s"):
            db.query("NODES RETURN id")
    assert db.query("NODES RETURN id").to_pylist() == [{"id": "a"}]  # outside the scopes: as usual


def test_view_statements_are_the_stores_own_work_and_run_whatever_the_scope(db: trellisdb.Database) -> None:
    db.create_view("all", "sft")
    stopped = db.query_scope()
    stopped.cancel("stopped")
    with stopped:
        assert db.query("MATERIALIZE all").to_pylist()[0]["rows"] == 1


def test_a_query_past_the_memory_limit_is_stopped_with_the_limit_named(tmp_path: Path) -> None:
    with trellisdb.connect(tmp_path / "db", memory_limit=200 << 20) as db:
        with db.session(task="t") as s:
            s.add_node(summary="x")
        with pytest.raises(trellisdb.QueryMemoryError) as e:
            db.sql(BIG_GROUP_BY)
        assert "200 MiB" in str(e.value) and "memory_limit" in str(e.value) and e.value.limit == "memory_limit"
        assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 1}]
        # nothing spilled to disk: no temporary folder, under the working one or anywhere
        assert db.sql("SELECT current_setting('temp_directory') AS v").to_pylist() == [{"v": ""}]
        assert not (Path.cwd() / ".tmp").exists()


def test_the_default_memory_limit_is_below_duckdbs_own(tmp_path: Path) -> None:
    import duckdb

    from trellisdb.reader import MEMORY_SHARE, size_bytes

    duckdbs = size_bytes(str(duckdb.connect().sql("SELECT current_setting('memory_limit')").fetchall()[0][0]))
    assert duckdbs is not None
    with trellisdb.connect(tmp_path / "db") as db:
        got = size_bytes(str(db.sql("SELECT current_setting('memory_limit') AS v").to_pylist()[0]["v"]))
    assert got == pytest.approx(duckdbs / 0.8 * MEMORY_SHARE, rel=0.02) and got < duckdbs


@pytest.mark.parametrize(("option", "bad"), [("query_timeout", 0), ("query_timeout", -1.0), ("query_timeout", "60"),
                                             ("query_timeout", float("nan")), ("query_timeout", True),
                                             ("memory_limit", 1 << 20), ("memory_limit", "4GB"),
                                             ("memory_limit", 1.5)])
def test_bad_limits_are_refused_naming_the_option(tmp_path: Path, option: str, bad: object) -> None:
    with pytest.raises(trellisdb.ValidationError, match=option):
        trellisdb.connect(tmp_path / "db", **{option: bad})  # type: ignore[arg-type]


def test_limits_are_options_of_an_embedded_store_not_of_a_url() -> None:
    with pytest.raises(trellisdb.ValidationError, match=r"query_timeout.*configured where it is served"):
        trellisdb.connect("http://127.0.0.1:1", query_timeout=5)
