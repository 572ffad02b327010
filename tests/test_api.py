"""One API, two handles: every test here runs against an embedded store and against the same
calls through ``trellisdb.connect("http://...")`` to a real ``trellis serve`` process (issue 25:
"a script moves from embedded to remote by changing the connect string").

Each test writes its own task and session ids (the store of a handle is shared by the module's
tests) and asserts on the results, so a remote call that behaved differently fails here."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import trellisdb
from trellisdb.client import RemoteDatabase

from .serving import free_port, start, stop

TOKEN = "api-token"
UTC = dt.UTC


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("api-remote") / "db"
    port = free_port()
    proc = start(path, port, TOKEN)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[trellisdb.Database]:
    db = trellisdb.connect(tmp_path_factory.mktemp("api-embedded") / "db")
    assert isinstance(db, trellisdb.Database)
    yield db
    db.close()


@pytest.fixture(params=["embedded", "remote"])
def db(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "embedded":
        yield request.getfixturevalue("embedded")
        return
    remote = trellisdb.connect(request.getfixturevalue("served"), token=TOKEN)
    assert isinstance(remote, RemoteDatabase)
    yield remote
    remote.close()


def uid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_a_session_writes_and_queries_see_it(db: Any) -> None:
    task = uid("t")
    with db.session(task=task, agent="a", model="m") as s:
        root = s.add_node(summary="root", artifacts={"code": "print(1)", "blob": b"\x00\xff"})
        kid = s.add_node(parents=[root], summary="kid", attrs={"island": 2}, labels=["best"], action="edit",
                         state="s1")
        s.add_reward(root, "score", 0.25)
        s.add_reward(kid, "score", 0.75, verifier="v", verifier_version="1")
        sid = s.id
    assert s.task_id == task
    got = db.query("FRONTIER WHERE task_id = $t RANK BY reward('score') DESC RETURN id, reward('score') AS score",
                   t=task).to_pylist()
    assert got == [{"id": kid, "score": 0.75}]
    assert [r["id"] for r in db.query("LINEAGE OF $n ANCESTORS", n=kid).to_pylist()] == [kid, root]
    assert db.query("NODES WHERE has_label('best') AND attr('island') = 2 AND task_id = $t RETURN id, action, state",
                    t=task).to_pylist() == [{"id": kid, "action": "edit", "state": "s1"}]
    status = db.sql("SELECT status FROM sessions WHERE id = $1", params=[sid]).to_pylist()
    assert status == [{"status": "completed"}]
    arts = db.sql("SELECT a.content FROM node_artifacts na JOIN artifacts_full a ON a.hash = na.hash "
                  "WHERE na.node_id = $1 ORDER BY na.name", params=[root]).to_pylist()
    assert [r["content"] for r in arts] == [b"\x00\xff", b"print(1)"]


def test_a_failing_block_marks_the_session_failed(db: Any) -> None:
    with pytest.raises(RuntimeError), db.session(task=uid("t")) as s:
        s.add_node(summary="x")
        raise RuntimeError("agent crashed")
    assert db.sql("SELECT status FROM sessions WHERE id = $1", params=[s.id]).to_pylist() == [{"status": "failed"}]


def test_bad_input_raises_the_same_error_at_the_call(db: Any) -> None:
    s = db.session(task=uid("t"))
    n = s.add_node(summary="ok")
    with pytest.raises(trellisdb.UnknownParentError, match="nope"):
        s.add_node(parents=["nope"])
    with pytest.raises(trellisdb.InvalidRewardError):
        s.add_reward(n, "score", "high")
    with pytest.raises(trellisdb.UnknownNodeError):
        s.add_reward("no-such-node", "score", 1.0)
    with pytest.raises(trellisdb.ValidationError, match="no timezone"):
        s.add_node(summary="t", at=dt.datetime(2026, 1, 1))
    with pytest.raises(trellisdb.QuerySyntaxError):
        db.query("FRONTEIR LIMIT 3")
    with pytest.raises(trellisdb.QueryError):
        db.sql("DELETE FROM nodes")
    with pytest.raises(trellisdb.UnknownTagError):
        db.query("NODES LIMIT 1 AS OF TAG 'never-made'")
    s.close()
    # the session's good writes survived its bad calls
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE session_id = $1", params=[s.id]).to_pylist() == [{"n": 1}]


def test_flush_makes_writes_durable_and_names_the_commit(db: Any) -> None:
    s = db.session(task=uid("t"))
    n = s.add_node(summary="pending")
    commit = db.flush()
    assert isinstance(commit, int)
    assert db.sql("SELECT id FROM nodes WHERE id = $1", as_of=commit, params=[n]).to_pylist() == [{"id": n}]
    assert db.flush(meta={"checkpoint": 3}) > commit
    assert db.log()[-1]["meta"] == '{"checkpoint": 3}'
    assert isinstance(db.log()[-1]["time"], dt.datetime)


def test_a_transaction_commits_as_one_or_not_at_all(db: Any) -> None:
    task = uid("t")
    with db.transaction(message="two nodes", meta={"k": 1}) as tx:
        s = db.session(task=task, id=uid("s"))
        a = s.add_node(summary="a")
        b = s.add_node(summary="b", parents=[a])
        s.add_reward(b, "score", 1.0)
        assert db.in_transaction()
    assert not db.in_transaction()
    assert isinstance(tx.commit_id, int)
    entry = next(c for c in db.log() if c["id"] == tx.commit_id)
    assert entry["message"] == "two nodes" and entry["meta"] == '{"k": 1}'
    got = db.sql("SELECT id FROM nodes WHERE task_id = $1 ORDER BY id", as_of=tx.commit_id, params=[task])
    assert sorted(r["id"] for r in got.to_pylist()) == sorted([a, b])
    before = db.log()[-1]["id"]
    with pytest.raises(KeyError), db.transaction():
        s.add_node(summary="discarded", id=uid("gone"))
        raise KeyError("abort")
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE task_id = $1", params=[task]).to_pylist() == [{"n": 2}]
    assert db.log()[-1]["id"] == before
    with pytest.raises(trellisdb.TransactionError, match="nest"), db.transaction(), db.transaction():
        pass


def test_edges_comparisons_status_attrs_and_event_time(db: Any) -> None:
    s = db.session(task=uid("t"), at=dt.datetime(2026, 3, 1, tzinfo=UTC))
    when = dt.datetime(2026, 3, 1, 12, 30, tzinfo=UTC)
    a = s.add_node(summary="a", at=when)
    b = s.add_node(summary="b")
    s.add_edge(a, b, "crossover_of")
    cid = s.add_comparison(a, b, preferred=b, margin=0.5, judge="human")
    s.set_status([a, b], "expanded")
    s.set_attrs(a, {"temp": 0.5})
    db.set_attrs(b, {"temp": 0.9, "note": "x"})
    db.label([a, b], "seen")
    db.unlabel(b, "seen")
    s.close()
    rows = db.sql("SELECT id, status, event_time FROM nodes WHERE session_id = $1 ORDER BY seq",
                  params=[s.id]).to_pylist()
    assert [(r["id"], r["status"]) for r in rows] == [(a, "expanded"), (b, "expanded")]
    assert rows[0]["event_time"] == when
    assert db.sql("SELECT preferred FROM comparisons WHERE id = $1", params=[cid]).to_pylist() == [{"preferred": b}]
    assert db.sql("SELECT kind FROM edges WHERE src = $1 AND dst = $2", params=[a, b]).to_pylist() == \
        [{"kind": "crossover_of"}]
    got = db.query("NODES WHERE session_id = $s AND has_label('seen') RETURN id, attr('temp') AS t", s=s.id)
    assert got.to_pylist() == [{"id": a, "t": 0.5}]


def test_resume_continues_a_session(db: Any) -> None:
    s = db.session(task=uid("t"))
    s.add_node(summary="one")
    s.close("paused")
    r = db.resume(s.id)
    assert (r.id, r.task_id) == (s.id, s.task_id)
    r.add_node(summary="two")
    r.close()
    steps = db.sql("SELECT step FROM nodes WHERE session_id = $1 ORDER BY step", params=[s.id]).to_pylist()
    assert [x["step"] for x in steps] == [1, 2]


def test_tags_and_time_travel(db: Any) -> None:
    task = uid("t")
    s = db.session(task=task)
    first = s.add_node(summary="first")
    db.flush()
    tag = uid("tag")
    cid = db.tag(tag)
    assert db.tags()[tag] == cid and db.resolve_as_of(tag) == cid
    s.add_node(summary="second", parents=[first])
    s.close()
    then = db.query(f"NODES WHERE task_id = $t RETURN summary AS OF TAG '{tag}'", t=task).to_pylist()
    assert then == [{"summary": "first"}]
    assert db.untag(tag) == cid and tag not in db.tags()


def test_views_materialize_and_export(db: Any, tmp_path: Path) -> None:
    task = uid("t")
    with db.session(task=task) as s:
        root = s.add_node(artifacts={"prompt": "pack circles"})
        for k, v in enumerate([0.9, 0.2, 0.6]):
            n = s.add_node(parents=[root], artifacts={"prompt": "pack circles", "response": f"answer {k}"})
            s.add_reward(n, "score", v)
    name = uid("pairs").replace("-", "_")
    entry = db.create_view(name, "preference", reward="reward('score')", where=f"task_id = '{task}'")
    assert entry["spec"]["name"] == name and entry["spec"]["kind"] == "preference"
    assert db.materialize(name)["rows"] == 3
    rows = db.view(name).to_pylist()
    assert len(rows) == 3 and all(r["task_id"] == task for r in rows)
    assert any(v["name"] == name for v in db.views())
    # an embedded export writes where it is told; a remote one under the server's export root
    target = tmp_path / name if isinstance(db, trellisdb.Database) else f"out/{name}"
    manifest = db.export(name, target, "trl")
    assert manifest["rows"] == 3
    assert db.refresh(name)["rows"] == 3
    db.drop_view(name)
    assert all(v["name"] != name for v in db.views())


def test_ingest_arrow_tables(db: Any) -> None:
    task, sid = uid("t"), uid("s")
    tables = {
        "tasks": pa.table({"id": [task]}),
        "sessions": pa.table({"id": [sid], "task_id": [task]}),
        "nodes": pa.table({"id": [f"{sid}-a", f"{sid}-b"], "session_id": [sid, sid], "task_id": [task, task],
                           "summary": ["a", "b"]}),
        "edges": pa.table({"src": [f"{sid}-a"], "dst": [f"{sid}-b"], "kind": ["derived_from"]}),
        "rewards": pa.table({"node_id": [f"{sid}-b"], "channel": ["score"], "value": [0.5]}),
    }
    cid = db.ingest(tables, message="bulk", meta={"source": "test"})
    got = db.sql("SELECT id FROM nodes WHERE session_id = $1 ORDER BY id", as_of=cid, params=[sid]).to_pylist()
    assert got == [{"id": f"{sid}-a"}, {"id": f"{sid}-b"}]
    assert [r["id"] for r in db.query("LINEAGE OF $n ANCESTORS", n=f"{sid}-b").to_pylist()] == [f"{sid}-b",
                                                                                                  f"{sid}-a"]


def test_record_step_is_one_durable_call(served: str, embedded: trellisdb.Database) -> None:
    """The whole-step call (remote only: the embedded handle writes a step with add_node + add_reward)."""
    with RemoteDatabase(served, token=TOKEN) as db:
        sid = uid("s")
        one = db.record_step(session=sid, task=uid("t"), summary="step", rewards={"score": 0.5},
                             artifacts={"code": b"\x01"}, at=dt.datetime(2026, 1, 1, tzinfo=UTC))
        assert db.sql("SELECT summary FROM nodes WHERE id = $1", as_of=one["commit"],
                      params=[one["id"]]).to_pylist() == [{"summary": "step"}]


# ---------------------------------------------------------------- remote only
@pytest.fixture
def remote(served: str) -> Iterator[RemoteDatabase]:
    with RemoteDatabase(served, token=TOKEN) as db:
        yield db


def test_an_idle_transaction_times_out_and_is_rolled_back(remote: RemoteDatabase) -> None:
    task = uid("t")
    with pytest.raises(trellisdb.TransactionError, match="rolled back after"), \
            remote.transaction(timeout=0.3):
        s = remote.session(task=task)
        s.add_node(summary="slow")
        import time

        time.sleep(1.0)
        s.add_node(summary="too late")
    assert remote.sql("SELECT count(*) AS n FROM nodes WHERE task_id = $1", params=[task]).to_pylist() == [{"n": 0}]


def test_remote_refuses_what_it_cannot_do(remote: RemoteDatabase) -> None:
    with pytest.raises(trellisdb.ValidationError, match="unknown method 'close'"):
        remote.call("close")
    with pytest.raises(trellisdb.ValidationError, match="unknown method '_store'"):
        remote.call("_store")
    with pytest.raises(trellisdb.ValidationError, match="progress"):
        remote.call("export", "v", "out", progress="print")
    with pytest.raises(trellisdb.ValidationError, match="unexpected keyword"):
        remote.call("tags", evil=1)
    with pytest.raises(trellisdb.ExportError):
        remote.export("v", "/etc/evil")
    with pytest.raises(trellisdb.ExportError):
        remote.export("v", "../../outside")
    with pytest.raises(trellisdb.TransactionError, match="no open transaction"):
        remote.request("POST", "/v1/tx/commit", {"tx": "tx999-forged"})
    with pytest.raises(trellisdb.ValidationError, match="timeout"):
        remote.request("POST", "/v1/tx/begin", {"timeout": 10_000})
    with pytest.raises(trellisdb.ValidationError, match="JSON carries only finite"):
        remote.session(task="t").add_reward("n", "score", float("inf"))


def test_connect_says_which_options_go_where(tmp_path: Path) -> None:
    with pytest.raises(trellisdb.ValidationError, match="embedding_dim"):
        trellisdb.connect("http://127.0.0.1:1", embedding_dim=8)
    with pytest.raises(trellisdb.ValidationError, match="token is for a server"):
        trellisdb.connect(tmp_path / "db", token="x")
