"""Transactions (one atomic commit over many tables) and group commit (timer and flush)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trellisdb

TABLES = ("tasks", "sessions", "nodes", "edges", "artifacts", "node_artifacts", "rewards", "comparisons")


def counts(db: trellisdb.Database) -> dict[str, int]:
    return {t: db.sql(f"SELECT count(*) AS n FROM {t}_history").to_pylist()[0]["n"] for t in TABLES}


def poll(pred: Any, timeout: float = 1.0) -> float:
    """Seconds until ``pred()`` is true; fails after ``timeout``."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"not visible within {timeout} s")
        time.sleep(0.005)
    return time.monotonic() - t0


@pytest.fixture
def seeded(db: trellisdb.Database) -> trellisdb.SessionWriter:
    s = db.session(task="t", agent="a", id="s")
    s.add_node(id="root", summary="root")
    db.flush()
    return s


@pytest.fixture
def slow_db(tmp_path: Path) -> Iterator[trellisdb.Database]:
    """A database whose group commit waits 5 s: only flush() commits within a test."""
    d = trellisdb.connect(tmp_path / "slow", embedding_dim=4, commit_delay=5.0)
    try:
        yield d
    finally:
        d.close()


def test_transaction_is_invisible_until_exit_then_one_commit(
    db: trellisdb.Database, seeded: trellisdb.SessionWriter, tmp_path: Path
) -> None:
    s = seeded
    before, log_before = counts(db), db.log()
    other = trellisdb.connect(tmp_path / "db")  # a second handle on the same folder
    try:
        with db.transaction(message="atomic") as tx:
            assert db.in_transaction()
            n1 = s.add_node(id="n1", parents=["root"], summary="one", artifacts={"code": "a = 1"})
            n2 = s.add_node(id="n2", parents=["root", n1], edge_kind="crossover_of", embedding=[1, 2, 3, 4])
            s.add_edge(n1, n2, "inspired_by")
            s.add_reward(n1, "score", 0.25)
            s.add_reward("root", "score", 0.5)
            s.add_artifact(n2, "log", b"\x00log")
            s.add_comparison(n1, n2, n2, id="k")
            s.set_status("root", "expanded")
            time.sleep(0.2)  # well past commit_delay: the group-commit timer must not commit these
            assert counts(db) == before
            assert counts(other) == before
            assert db.log() == log_before
            assert db.sql("SELECT status FROM nodes WHERE id = 'root'").to_pylist() == [{"status": "pending"}]
            assert tx.commit_id is None
        assert not db.in_transaction()
        after = counts(db)
        assert after == {**before, "nodes": before["nodes"] + 3, "edges": 4, "artifacts": 2, "node_artifacts": 2,
                         "rewards": 2, "comparisons": 1}
        log = db.log()
        assert log[:-1] == log_before and len(log) == len(log_before) + 1
        assert log[-1]["id"] == tx.commit_id and log[-1]["message"] == "atomic"
        assert log[-1]["rows"] == sum(after.values()) - sum(before.values())
        for t in ("nodes", "edges", "artifacts", "node_artifacts", "rewards", "comparisons"):
            got = db.sql(f"SELECT DISTINCT commit_id FROM {t}_history WHERE commit_id > {log_before[-1]['id']}")
            assert got.to_pylist() == [{"commit_id": tx.commit_id}], t
        assert db.sql("SELECT status FROM nodes WHERE id = 'root'").to_pylist() == [{"status": "expanded"}]
        assert counts(other) == after  # the other handle sees the commit too
        assert counts(db) == counts(other)
    finally:
        other.close()


def test_exception_discards_everything(db: trellisdb.Database, seeded: trellisdb.SessionWriter) -> None:
    s = seeded
    before, log_before = counts(db), db.log()
    with pytest.raises(RuntimeError, match="agent crashed"), db.transaction() as tx:
        s.add_node(id="n1", parents=["root"], artifacts={"code": "discarded bytes"})
        s.add_reward("n1", "score", 1.0)
        s.add_edge("root", "n1", "repair_of")
        s.set_status("root", "closed")
        db.add_task("t2", name="discarded task")
        raise RuntimeError("agent crashed")
    assert tx.commit_id is None
    assert not db.in_transaction()
    time.sleep(0.1)  # nothing may leak into a later group commit either
    assert db.flush() is None
    assert counts(db) == before and db.log() == log_before
    assert db.sql("SELECT status FROM nodes WHERE id = 'root'").to_pylist() == [{"status": "pending"}]
    # the discarded node is not known: it cannot be a parent
    with pytest.raises(trellisdb.UnknownParentError, match="'n1'"):
        s.add_node(parents=["n1"])
    # discarded content is really absent: written again, it is stored
    s.add_node(id="n1b", artifacts={"code": "discarded bytes"})
    db.flush()
    assert db.sql("SELECT content FROM artifacts_full").to_pylist() == [{"content": b"discarded bytes"}]


def test_validation_error_inside_transaction_discards_block(
    db: trellisdb.Database, seeded: trellisdb.SessionWriter
) -> None:
    before = counts(db)
    with pytest.raises(trellisdb.InvalidRewardError), db.transaction():
        seeded.add_node(id="ok", parents=["root"])
        seeded.add_reward("ok", "score", float("nan"))
    assert db.flush() is None
    assert counts(db) == before


def test_nested_transaction_raises(db: trellisdb.Database, seeded: trellisdb.SessionWriter) -> None:
    n_commits = len(db.log())
    with db.transaction() as outer:
        seeded.add_reward("root", "a", 1.0)
        with pytest.raises(trellisdb.TransactionError, match="nest"), db.transaction():
            seeded.add_reward("root", "inner", 1.0)  # never runs
        assert db.in_transaction()  # the outer one is still open
        seeded.add_reward("root", "b", 2.0)
    assert outer.commit_id is not None
    assert len(db.log()) == n_commits + 1
    assert db.sql("SELECT channel, value, commit_id FROM rewards ORDER BY channel").to_pylist() == [
        {"channel": "a", "value": 1.0, "commit_id": outer.commit_id},
        {"channel": "b", "value": 2.0, "commit_id": outer.commit_id},
    ]
    # and a fresh transaction works afterwards
    with db.transaction() as again:
        seeded.add_reward("root", "c", 3.0)
    assert again.commit_id == outer.commit_id + 1


def test_uncaught_nested_transaction_discards_outer(db: trellisdb.Database, seeded: trellisdb.SessionWriter) -> None:
    before = counts(db)
    with pytest.raises(trellisdb.TransactionError), db.transaction(), db.transaction():
        pass
    with pytest.raises(trellisdb.TransactionError), db.transaction():
        seeded.add_reward("root", "x", 1.0)
        with db.transaction():
            pass
    assert not db.in_transaction()
    assert db.flush() is None
    assert counts(db) == before


def test_empty_transaction_makes_no_commit(db: trellisdb.Database, seeded: trellisdb.SessionWriter) -> None:
    log = db.log()
    with db.transaction() as tx:
        pass
    assert tx.commit_id is None
    assert db.log() == log


def test_session_block_inside_transaction_is_one_commit(db: trellisdb.Database) -> None:
    with db.transaction(message="whole run") as tx:
        with db.session(task="new-task", agent="a", id="s") as s:
            a = s.add_node(summary="a")
            s.add_node(parents=[a], summary="b")
        assert db.log() == []  # leaving the session block inside a transaction does not commit
    assert [c["id"] for c in db.log()] == [tx.commit_id]
    assert db.sql("SELECT id, status FROM sessions").to_pylist() == [{"id": "s", "status": "completed"}]
    assert db.sql("SELECT id FROM tasks").to_pylist() == [{"id": "new-task"}]
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 2}]


def test_transaction_survives_reopen(db: trellisdb.Database, seeded: trellisdb.SessionWriter, tmp_path: Path) -> None:
    with db.transaction() as tx:
        seeded.add_node(id="kid", parents=["root"])
        seeded.add_reward("kid", "score", 0.75)
    again = trellisdb.connect(tmp_path / "db")
    try:
        assert again.log()[-1]["id"] == tx.commit_id
        assert again.sql("SELECT node_id, value FROM rewards").to_pylist() == [{"node_id": "kid", "value": 0.75}]
    finally:
        again.close()


def test_transaction_does_not_overtake_pending_writes(slow_db: trellisdb.Database) -> None:
    s = slow_db.session(task="t", agent="a", id="s")
    s.add_node(id="parent")  # pending in the group buffer
    with slow_db.transaction() as tx:
        s.add_node(id="child", parents=["parent"])
    assert tx.commit_id is not None
    visible = slow_db.sql("SELECT id FROM nodes ORDER BY id", as_of=tx.commit_id).to_pylist()
    assert visible == [{"id": "child"}, {"id": "parent"}]


def test_writes_of_other_threads_are_not_part_of_the_transaction(
    db: trellisdb.Database, seeded: trellisdb.SessionWriter
) -> None:
    with db.transaction() as tx:
        seeded.add_reward("root", "mine", 1.0)
        t = threading.Thread(target=lambda: seeded.add_reward("root", "theirs", 2.0))
        t.start()
        t.join()
        poll(lambda: db.sql("SELECT channel FROM rewards").to_pylist() == [{"channel": "theirs"}])
    assert db.sql("SELECT channel, commit_id FROM rewards ORDER BY channel").to_pylist()[0] == {
        "channel": "mine", "commit_id": tx.commit_id}


# ------------------------------------------------------------------ group commit


def test_group_commit_becomes_visible_within_a_second(db: trellisdb.Database, seeded: trellisdb.SessionWriter) -> None:
    n_commits = len(db.log())
    seeded.add_reward("root", "score", 0.5)
    kid = seeded.add_node(parents=["root"], summary="kid")
    seeded.add_artifact(kid, "code", "k = 1")
    poll(lambda: db.sql("SELECT count(*) AS n FROM node_artifacts").to_pylist() == [{"n": 1}], timeout=1.0)
    assert db.sql("SELECT value FROM rewards").to_pylist() == [{"value": 0.5}]
    assert db.sql("SELECT src, dst FROM edges").to_pylist() == [{"src": "root", "dst": kid}]
    assert len(db.log()) > n_commits
    assert db.flush() is None  # the timer already committed everything


def test_flush_makes_pending_writes_visible_at_once(slow_db: trellisdb.Database) -> None:
    s = slow_db.session(task="t", agent="a")
    a = s.add_node(summary="a")
    s.add_node(parents=[a], summary="b")
    s.add_reward(a, "score", 1.0)
    time.sleep(0.2)
    assert slow_db.log() == []
    assert slow_db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 0}]
    cid = slow_db.flush()
    assert cid == 1
    assert slow_db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 2}]  # no waiting
    assert slow_db.sql("SELECT node_id, value FROM rewards").to_pylist() == [{"node_id": a, "value": 1.0}]
    log = slow_db.log()
    assert [c["id"] for c in log] == [1]
    assert log[0]["rows"] == 1 + 1 + 2 + 1 + 1  # task, session, nodes, edge, reward: all group-committed as one
    assert slow_db.flush() is None


def test_close_flushes_pending_writes(tmp_path: Path) -> None:
    d = trellisdb.connect(tmp_path / "c", embedding_dim=4, commit_delay=5.0)
    s = d.session(task="t", agent="a")
    s.add_node(id="n")
    d.close()
    again = trellisdb.connect(tmp_path / "c")
    try:
        assert again.sql("SELECT id FROM nodes").to_pylist() == [{"id": "n"}]
    finally:
        again.close()
    with pytest.raises(trellisdb.TransactionError, match="closed"):
        s.add_node(id="late")


def test_max_batch_rows_commits_a_full_batch(tmp_path: Path) -> None:
    d = trellisdb.connect(tmp_path / "m", embedding_dim=4, commit_delay=5.0, max_batch_rows=5)
    try:
        s = d.session(task="t", agent="a")  # 2 rows: task, session
        s.add_node(id="a")                  # 3
        s.add_reward("a", "r1", 1.0)        # 4
        assert d.log() == []
        s.add_reward("a", "r2", 2.0)        # 5: full, committed at once
        assert [c["rows"] for c in d.log()] == [5]
        assert d.sql("SELECT count(*) AS n FROM rewards").to_pylist() == [{"n": 2}]
    finally:
        d.close()
