"""Time travel: as_of a commit id, a timestamp (datetime or ISO text) or a tag shows exactly that commit's state."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trellisdb

TABLES = ("tasks", "sessions", "nodes", "edges", "artifacts", "node_artifacts", "rewards", "comparisons")


def state(db: trellisdb.Database, as_of: Any) -> dict[str, Any]:
    """Everything a reader can see as of ``as_of``, in a comparable form."""
    q = lambda sql: db.sql(sql, as_of=as_of).to_pylist()  # noqa: E731
    return {
        "nodes": q("SELECT id, status, summary FROM nodes ORDER BY id"),
        "rewards": q("SELECT node_id, channel, value FROM rewards ORDER BY node_id, channel"),
        "edges": q("SELECT src, dst, kind FROM edges ORDER BY src, dst"),
        "artifacts": q("SELECT node_id, name, content FROM node_artifacts JOIN artifacts_full USING (hash) ORDER BY 1"),
        "comparisons": q("SELECT id, preferred FROM comparisons ORDER BY id"),
        "sessions": q("SELECT id, status FROM sessions ORDER BY id"),
        "commits": [r["id"] for r in q("SELECT id FROM commits ORDER BY id")],
        "reward_history": q("SELECT node_id, value, commit_id FROM rewards_history ORDER BY node_id, commit_id"),
        "node_history": q("SELECT id, status, commit_id FROM nodes_history ORDER BY id, commit_id"),
    }


def build_history(db: trellisdb.Database) -> dict[str, Any]:
    """Three commits, each one transaction, 20 ms apart; returns their ids, times and expected states."""
    with db.transaction() as t1:
        s = db.session(task="t", agent="a", id="s")
        s.add_node(id="a", summary="first")
        s.add_reward("a", "score", 0.5)
    db.tag("v1")
    db.tag("baseline")
    time.sleep(0.02)
    with db.transaction() as t2:
        s.add_reward("a", "score", 0.8)  # re-scored
        s.set_status("a", "expanded")
        s.add_node(id="b", parents=["a"], summary="second")
        s.add_reward("b", "score", 0.3)
    db.tag("v2")
    time.sleep(0.02)
    with db.transaction() as t3:
        s.add_reward("a", "score", 0.9)  # re-scored again
        s.set_status("b", "closed")
        s.add_node(id="c", parents=["b"], summary="third", artifacts={"code": "x = 3"})
        s.add_comparison("b", "c", "c", id="k")
        s.close()
    c1, c2, c3 = t1.commit_id, t2.commit_id, t3.commit_id
    assert (c1, c2, c3) == (1, 2, 3)
    assert [c["id"] for c in db.log()] == [1, 2, 3]
    s1 = {
        "nodes": [{"id": "a", "status": "pending", "summary": "first"}],
        "rewards": [{"node_id": "a", "channel": "score", "value": 0.5}],
        "edges": [],
        "artifacts": [],
        "comparisons": [],
        "sessions": [{"id": "s", "status": "running"}],
        "commits": [1],
        "reward_history": [{"node_id": "a", "value": 0.5, "commit_id": 1}],
        "node_history": [{"id": "a", "status": "pending", "commit_id": 1}],
    }
    s2 = {
        "nodes": [{"id": "a", "status": "expanded", "summary": "first"},
                  {"id": "b", "status": "pending", "summary": "second"}],
        "rewards": [{"node_id": "a", "channel": "score", "value": 0.8},
                    {"node_id": "b", "channel": "score", "value": 0.3}],
        "edges": [{"src": "a", "dst": "b", "kind": "derived_from"}],
        "artifacts": [],
        "comparisons": [],
        "sessions": [{"id": "s", "status": "running"}],
        "commits": [1, 2],
        "reward_history": [{"node_id": "a", "value": 0.5, "commit_id": 1},
                           {"node_id": "a", "value": 0.8, "commit_id": 2},
                           {"node_id": "b", "value": 0.3, "commit_id": 2}],
        "node_history": [{"id": "a", "status": "pending", "commit_id": 1},
                         {"id": "a", "status": "expanded", "commit_id": 2},
                         {"id": "b", "status": "pending", "commit_id": 2}],
    }
    s3 = {
        "nodes": [{"id": "a", "status": "expanded", "summary": "first"},
                  {"id": "b", "status": "closed", "summary": "second"},
                  {"id": "c", "status": "pending", "summary": "third"}],
        "rewards": [{"node_id": "a", "channel": "score", "value": 0.9},
                    {"node_id": "b", "channel": "score", "value": 0.3}],
        "edges": [{"src": "a", "dst": "b", "kind": "derived_from"}, {"src": "b", "dst": "c", "kind": "derived_from"}],
        "artifacts": [{"node_id": "c", "name": "code", "content": b"x = 3"}],
        "comparisons": [{"id": "k", "preferred": "c"}],
        "sessions": [{"id": "s", "status": "completed"}],
        "commits": [1, 2, 3],
        "reward_history": [{"node_id": "a", "value": 0.5, "commit_id": 1},
                           {"node_id": "a", "value": 0.8, "commit_id": 2},
                           {"node_id": "a", "value": 0.9, "commit_id": 3},
                           {"node_id": "b", "value": 0.3, "commit_id": 2}],
        "node_history": [{"id": "a", "status": "pending", "commit_id": 1},
                         {"id": "a", "status": "expanded", "commit_id": 2},
                         {"id": "b", "status": "pending", "commit_id": 2},
                         {"id": "b", "status": "closed", "commit_id": 3},
                         {"id": "c", "status": "pending", "commit_id": 3}],
    }
    times = [c["time"] for c in db.log()]
    return {"ids": [c1, c2, c3], "times": times, "states": [s1, s2, s3]}


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[trellisdb.Database, dict[str, Any]]]:
    """One history for the read-only tests of this module (built once: they only read)."""
    database = trellisdb.connect(tmp_path_factory.mktemp("tt") / "db", embedding_dim=4)
    try:
        hist = build_history(database)
        yield database, hist
        assert [c["id"] for c in database.log()] == [1, 2, 3], "a read-only test wrote"
        assert database.tags() == {"v1": 1, "baseline": 1, "v2": 2}, "a read-only test tagged"
    finally:
        database.close()


@pytest.fixture
def db(shared: tuple[trellisdb.Database, dict[str, Any]]) -> trellisdb.Database:  # overrides conftest's
    return shared[0]


@pytest.fixture
def history(shared: tuple[trellisdb.Database, dict[str, Any]]) -> dict[str, Any]:
    return shared[1]


EMPTY = {k: [] for k in ("nodes", "rewards", "edges", "artifacts", "comparisons", "sessions", "commits",
                         "reward_history", "node_history")}


def test_latest_is_default(db: trellisdb.Database, history: dict[str, Any]) -> None:
    assert state(db, None) == history["states"][2]


@pytest.mark.parametrize("i", [0, 1, 2])
def test_as_of_commit_id(db: trellisdb.Database, history: dict[str, Any], i: int) -> None:
    cid = history["ids"][i]
    assert state(db, cid) == history["states"][i]
    assert state(db, str(cid)) == history["states"][i]  # a commit id given as text


def test_as_of_interleaved_reads_do_not_leak_between_snapshots(db: trellisdb.Database, history: dict[str, Any]) -> None:
    for i in (2, 0, 1, 0, 2, 1):
        assert state(db, history["ids"][i]) == history["states"][i]


@pytest.mark.parametrize("i", [0, 1])
def test_as_of_timestamp_between_commits(db: trellisdb.Database, history: dict[str, Any], i: int) -> None:
    t0, t1 = history["times"][i], history["times"][i + 1]
    assert (t1 - t0) >= dt.timedelta(milliseconds=15)
    mid = t0 + (t1 - t0) / 2
    expected = history["states"][i]
    assert state(db, mid) == expected                                          # aware datetime
    assert state(db, mid.astimezone(dt.timezone(dt.timedelta(hours=-5)))) == expected  # other zone, same instant
    assert state(db, mid.isoformat()) == expected                              # ISO text with offset
    assert state(db, mid.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")) == expected  # ISO text, Z


def test_as_of_timestamp_before_first_and_after_last(db: trellisdb.Database, history: dict[str, Any]) -> None:
    first, last = history["times"][0], history["times"][-1]
    assert state(db, first - dt.timedelta(seconds=1)) == EMPTY
    assert state(db, (first - dt.timedelta(days=365)).isoformat()) == EMPTY
    assert state(db, last + dt.timedelta(hours=1)) == history["states"][2]
    assert state(db, dt.datetime.now(dt.UTC)) == history["states"][2]


def test_as_of_a_commits_own_timestamp_is_that_commit(tmp_path: Path) -> None:
    # commits only at the explicit flushes: with the default 50 ms group-commit delay, a slow
    # machine committed the session row on its own before the first node (16 commits, not 15)
    db = trellisdb.connect(tmp_path / "own", embedding_dim=4, commit_delay=60.0)
    try:
        _check_own_timestamps(db)
    finally:
        db.close()


def _check_own_timestamps(db: trellisdb.Database) -> None:
    s = db.session(task="t", agent="a")
    for i in range(15):
        s.add_node(id=f"n{i}")
        db.flush()
    log = db.log()
    assert len(log) == 15
    resolved = [db.resolve_as_of(c["time"]) for c in log]
    resolved_iso = [db.resolve_as_of(c["time"].isoformat()) for c in log]
    from_sql = [db.resolve_as_of(r["time"]) for r in db.sql("SELECT time FROM commits ORDER BY id").to_pylist()]
    ids = [c["id"] for c in log]
    assert (resolved, resolved_iso, from_sql) == (ids, ids, ids)


def test_as_of_tag(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "own", embedding_dim=4)  # this test adds tags: its own database
    try:
        _check_tags(db, build_history(db))
    finally:
        db.close()


def _check_tags(db: trellisdb.Database, history: dict[str, Any]) -> None:
    s1, s2, s3 = history["states"]
    assert db.tags() == {"v1": 1, "baseline": 1, "v2": 2}
    assert state(db, "v1") == s1
    assert state(db, "baseline") == s1
    assert state(db, "v2") == s2
    # tagging an older commit after the fact
    assert db.tag("late", commit=1) == 1
    assert state(db, "late") == s1
    assert db.tag("head") == 3
    assert state(db, "head") == s3
    tags = {r["id"]: r["tags"] for r in db.sql("SELECT id, tags FROM commits").to_pylist()}
    assert tags == {1: ["baseline", "late", "v1"], 2: ["v2"], 3: ["head"]}
    assert db.log()[0]["tags"] == ["baseline", "late", "v1"]


def test_as_of_zero_is_empty(db: trellisdb.Database, history: dict[str, Any]) -> None:
    assert state(db, 0) == EMPTY
    assert state(db, "0") == EMPTY
    for t in TABLES:
        assert db.sql(f"SELECT count(*) AS n FROM {t}", as_of=0).to_pylist() == [{"n": 0}], t
        assert db.sql(f"SELECT count(*) AS n FROM {t}_history", as_of=0).to_pylist() == [{"n": 0}], t
    assert state(db, None) == history["states"][2]  # and the latest is untouched


def test_history_tables_as_of(db: trellisdb.Database, history: dict[str, Any]) -> None:
    # every table's _history holds exactly the rows with commit_id <= as_of
    for cid in history["ids"]:
        for t in TABLES:
            hist = db.sql(f"SELECT max(commit_id) AS hi FROM {t}_history", as_of=cid).to_pylist()[0]["hi"]
            assert hist is None or hist <= cid, (t, cid)
            latest = db.sql(f"SELECT count(*) AS n FROM {t}_history WHERE commit_id <= {cid}").to_pylist()
            assert db.sql(f"SELECT count(*) AS n FROM {t}_history", as_of=cid).to_pylist() == latest, (t, cid)
    assert db.sql("SELECT count(*) AS n FROM sessions_history").to_pylist() == [{"n": 2}]  # running, completed


def test_unknown_tag_suggests_close_match(db: trellisdb.Database, history: dict[str, Any]) -> None:
    with pytest.raises(trellisdb.UnknownTagError, match=r"'baselin'.*did you mean 'baseline'\?"):
        db.sql("SELECT 1", as_of="baselin")
    with pytest.raises(trellisdb.UnknownTagError, match="'zzzzzz'") as ei:
        db.sql("SELECT 1", as_of="zzzzzz")
    assert "did you mean" not in str(ei.value)
    assert issubclass(trellisdb.UnknownTagError, trellisdb.TrellisError)


@pytest.mark.parametrize("bad", [999, "999", -1, 4])
def test_unknown_commit(db: trellisdb.Database, history: dict[str, Any], bad: object) -> None:
    with pytest.raises(trellisdb.UnknownCommitError, match=rf"commit {bad} does not exist"):
        db.sql("SELECT 1", as_of=bad)  # type: ignore[arg-type]


def test_tag_unknown_commit(db: trellisdb.Database, history: dict[str, Any]) -> None:
    with pytest.raises(trellisdb.UnknownCommitError, match="999"):
        db.tag("nope", commit=999)
    assert "nope" not in db.tags()


@pytest.mark.parametrize("bad", [True, 1.5, ["v1"]])
def test_as_of_of_wrong_type(db: trellisdb.Database, history: dict[str, Any], bad: object) -> None:
    with pytest.raises(trellisdb.ValidationError, match="as_of"):
        db.sql("SELECT 1", as_of=bad)  # type: ignore[arg-type]
