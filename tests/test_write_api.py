"""Round-trip of every table through the agent write API, and every validation error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pytest

import trellisdb


@pytest.fixture
def db(tmp_path: Path) -> trellisdb.Database:
    return trellisdb.connect(tmp_path / "db", embedding_dim=4)


def test_every_table_round_trips(db: trellisdb.Database, tmp_path: Path) -> None:
    db.add_task("pack", name="pack circles", spec="maximize radii", tags=["geometry"], embedding=[1, 0, 0, 0])
    with db.session(task="pack", agent="evolve", model="m1", config={"pop": 10}, id="s1") as s:
        a = s.add_node(id="a", kind="attempt", summary="root", status="evaluated", step=1,
                       cost={"tokens_in": 10, "tokens_out": 20, "seconds": 1.5, "usd": 0.01},
                       embedding=[0.1, 0.2, 0.3, 0.4], artifacts={"code": "x = 1"}, source="test")
        b = s.add_node(id="b", parents=[a], summary="child", artifacts={"code": "x = 1"})  # same bytes
        c = s.add_node(id="c", parents=[a, b], edge_kind="crossover_of", summary="cross")
        s.add_edge(b, c, "inspired_by")
        h = s.add_artifact(c, "log", b"\x00\x01binary", media_type="application/octet-stream")
        s.add_reward(a, "score", 0.5, verifier="eval", verifier_version="1")
        s.add_reward(b, "score", 0.7, verifier="eval")
        s.add_comparison(a, b, b, margin=0.2, judge="llm", id="cmp1")
        s.add_comparison(b, c, None, id="cmp2")
        s.set_status(a, "expanded")

    assert db.sql("SELECT id, name, spec, tags, embedding FROM tasks_full").to_pylist() == [
        {"id": "pack", "name": "pack circles", "spec": "maximize radii", "tags": ["geometry"],
         "embedding": [1.0, 0.0, 0.0, 0.0]}]
    sess = db.sql("SELECT id, task_id, agent, model, config, status FROM sessions").to_pylist()
    assert sess == [{"id": "s1", "task_id": "pack", "agent": "evolve", "model": "m1",
                     "config": json.dumps({"pop": 10}), "status": "completed"}]
    nodes = {r["id"]: r for r in db.sql("SELECT * FROM nodes_full").to_pylist()}
    assert set(nodes) == {"a", "b", "c"}
    ra = nodes["a"]
    assert (ra["session_id"], ra["task_id"], ra["kind"], ra["step"], ra["status"], ra["summary"]) == (
        "s1", "pack", "attempt", 1, "expanded", "root")
    assert (ra["tokens_in"], ra["tokens_out"], ra["seconds"], ra["usd"], ra["source"]) == (10, 20, 1.5, 0.01, "test")
    assert [round(x, 6) for x in ra["embedding"]] == [0.1, 0.2, 0.3, 0.4]
    assert nodes["b"]["step"] == 2 and nodes["c"]["step"] == 3  # auto-numbered after step=1
    # a status change after the commit is a new row; the old one stays in history
    again_writer = db.resume("s1")
    again_writer.set_status("a", "closed")
    db.flush()
    hist = db.sql("SELECT status FROM nodes_history WHERE id = 'a' ORDER BY commit_id").to_pylist()
    # (whether 'evaluated' got its own row depends on group-commit timing)
    assert [h["status"] for h in hist][-2:] == ["expanded", "closed"]
    assert db.sql("SELECT status FROM nodes WHERE id = 'a'").to_pylist() == [{"status": "closed"}]
    edges = db.sql("SELECT src, dst, kind FROM edges ORDER BY src, dst, kind").to_pylist()
    assert edges == [
        {"src": "a", "dst": "b", "kind": "derived_from"},
        {"src": "a", "dst": "c", "kind": "crossover_of"},
        {"src": "b", "dst": "c", "kind": "crossover_of"},
        {"src": "b", "dst": "c", "kind": "inspired_by"},
    ]
    arts = db.sql("SELECT hash, media_type, size, content FROM artifacts_full ORDER BY size").to_pylist()
    assert len(arts) == 2  # 'x = 1' stored once although linked from two nodes
    assert arts[1]["content"] == b"\x00\x01binary" and arts[1]["hash"] == h
    assert arts[0]["content"] == b"x = 1" and arts[0]["media_type"] == "text/plain"
    links = db.sql("SELECT node_id, name FROM node_artifacts ORDER BY node_id, name").to_pylist()
    assert links == [{"node_id": "a", "name": "code"}, {"node_id": "b", "name": "code"},
                     {"node_id": "c", "name": "log"}]
    rewards = db.sql("SELECT node_id, channel, value, verifier, verifier_version FROM rewards ORDER BY node_id")
    assert rewards.to_pylist() == [
        {"node_id": "a", "channel": "score", "value": 0.5, "verifier": "eval", "verifier_version": "1"},
        {"node_id": "b", "channel": "score", "value": 0.7, "verifier": "eval", "verifier_version": None}]
    cmps = db.sql("SELECT id, a, b, preferred, margin, judge FROM comparisons ORDER BY id").to_pylist()
    assert cmps == [{"id": "cmp1", "a": "a", "b": "b", "preferred": "b", "margin": 0.2, "judge": "llm"},
                    {"id": "cmp2", "a": "b", "b": "c", "preferred": None, "margin": None, "judge": None}]
    # every row carries a commit id that is in the log
    log_ids = {c["id"] for c in db.log()}
    for t in ("tasks", "sessions", "nodes", "edges", "artifacts", "node_artifacts", "rewards", "comparisons"):
        ids = {r["commit_id"] for r in db.sql(f"SELECT DISTINCT commit_id FROM {t}_history").to_pylist()}
        assert ids and ids <= log_ids, t
    # a reopened database holds the same
    db.close()
    again = trellisdb.connect(tmp_path / "db")
    assert again.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 3}]
    assert again.sql("SELECT polars_ok FROM (SELECT 1 AS polars_ok)").pl().shape == (1, 1)


def test_bulk_ingest_round_trips_and_is_one_commit(db: trellisdb.Database) -> None:
    with db.transaction():
        db.session(task="t", agent="a", id="s")
    n = 50
    ids = [f"n{i}" for i in range(n)]
    cid = db.ingest({
        "nodes": pa.table({"id": ids, "session_id": ["s"] * n, "task_id": ["t"] * n, "step": list(range(n)),
                           "embedding": [[float(i), 0, 0, 1] for i in range(n)]}),
        "edges": pa.table({"src": ids[:-1], "dst": ids[1:], "kind": ["derived_from"] * (n - 1)}),
        "rewards": pa.table({"node_id": ids, "channel": ["r"] * n, "value": [i / n for i in range(n)]}),
    }, message="bulk")
    assert db.log()[-1]["id"] == cid and db.log()[-1]["message"] == "bulk"
    assert db.sql("SELECT count(*) AS n, min(commit_id) AS lo, max(commit_id) AS hi FROM nodes").to_pylist() == [
        {"n": n, "lo": cid, "hi": cid}]
    assert db.sql("SELECT sum(value) AS s FROM rewards").to_pylist()[0]["s"] == pytest.approx(sum(i / n for i in range(n)))
    assert db.sql("SELECT count(*) AS e FROM edges").to_pylist() == [{"e": n - 1}]


# ---------------------------------------------------------------- validation


@pytest.fixture
def writer(db: trellisdb.Database) -> trellisdb.SessionWriter:
    s = db.session(task="t", agent="a")
    s.add_node(id="root", summary="root")
    db.flush()
    return s


def test_unknown_parent(writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.UnknownParentError, match="'ghost'"):
        writer.add_node(parents=["ghost"])


@pytest.mark.parametrize("call", ["reward", "edge", "artifact", "status", "comparison"])
def test_unknown_node(writer: trellisdb.SessionWriter, call: str) -> None:
    with pytest.raises(trellisdb.UnknownNodeError, match="'ghost'"):
        if call == "reward":
            writer.add_reward("ghost", "score", 1.0)
        elif call == "edge":
            writer.add_edge("root", "ghost")
        elif call == "artifact":
            writer.add_artifact("ghost", "code", "x")
        elif call == "status":
            writer.set_status("ghost", "closed")
        else:
            writer.add_comparison("root", "ghost", "root")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "0.5", None, True])
def test_invalid_reward(writer: trellisdb.SessionWriter, value: object) -> None:
    with pytest.raises(trellisdb.InvalidRewardError, match="score"):
        writer.add_reward("root", "score", value)  # type: ignore[arg-type]


def test_wrong_embedding_dimension(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.EmbeddingDimensionError, match="dimension 3"):
        writer.add_node(embedding=[1.0, 2.0, 3.0])
    with pytest.raises(trellisdb.EmbeddingDimensionError, match="dimension 5"):
        db.ingest({"nodes": pa.table({"id": ["e"], "session_id": [writer.id], "task_id": ["t"],
                                      "embedding": [[1.0] * 5]})})


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"step": "3"}, "'3'"), ({"summary": 5}, "5"), ({"parents": "root"}, "'root'"),
    ({"kind": None}, "None"), ({"cost": {"tokens": 3}}, "tokens"), ({"cost": {"seconds": math.nan}}, "nan"),
    ({"edge_kind": "cousin_of"}, "cousin_of"), ({"embedding": ["a", "b", "c", "d"]}, "numbers"),
])
def test_wrong_types(writer: trellisdb.SessionWriter, kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(trellisdb.ValidationError, match=needle):
        writer.add_node(**kwargs)  # type: ignore[arg-type]


def test_duplicate_id(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    assert writer.add_node(id="root", summary="root") == "root"  # same content: idempotent retry
    db.flush()
    assert db.sql("SELECT count(*) AS n FROM nodes_history WHERE id = 'root'").to_pylist() == [{"n": 1}]
    with pytest.raises(trellisdb.DuplicateIdError, match="'root'"):
        writer.add_node(id="root", summary="something else")
    with pytest.raises(trellisdb.DuplicateIdError, match="'root'"):
        db.ingest({"nodes": pa.table({"id": ["root"], "session_id": [writer.id], "task_id": ["t"]})})
    with pytest.raises(trellisdb.DuplicateIdError, match="'x'"):
        db.ingest({"nodes": pa.table({"id": ["x", "x"], "session_id": [writer.id] * 2, "task_id": ["t"] * 2})})


def test_ingest_errors(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.UnknownSessionError, match="'nosuch'"):
        db.ingest({"nodes": pa.table({"id": ["q"], "session_id": ["nosuch"], "task_id": ["t"]})})
    with pytest.raises(trellisdb.UnknownParentError, match="'ghost'"):
        db.ingest({"edges": pa.table({"src": ["ghost"], "dst": ["root"], "kind": ["derived_from"]})})
    with pytest.raises(trellisdb.InvalidRewardError, match="nan"):
        db.ingest({"rewards": pa.table({"node_id": ["root"], "channel": ["c"], "value": [math.nan]})})
    with pytest.raises(trellisdb.ValidationError, match="bogus"):
        db.ingest({"nodes": pa.table({"id": ["q"], "bogus": [1]})})
    with pytest.raises(trellisdb.ValidationError, match="unknown table"):
        db.ingest({"nodez": pa.table({"id": ["q"]})})


def test_errors_lose_nothing_committed(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    before = db.sql("SELECT * FROM nodes_history").to_pylist()
    for bad in (lambda: writer.add_node(parents=["ghost"]), lambda: writer.add_reward("root", "s", math.nan)):
        with pytest.raises(trellisdb.TrellisError):
            bad()
    db.flush()
    assert db.sql("SELECT * FROM nodes_history").to_pylist() == before
    writer.add_reward("root", "s", 1.0)
    db.flush()
    assert db.sql("SELECT value FROM rewards").to_pylist() == [{"value": 1.0}]


def test_opening_something_else(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    with pytest.raises(trellisdb.NotADatabaseError, match="not a trellisdb database"):
        trellisdb.connect(other)
    with pytest.raises(trellisdb.NotADatabaseError, match="is a file"):
        trellisdb.connect(other / "notes.txt")
    with pytest.raises(trellisdb.NotADatabaseError, match="trellis init"):
        trellisdb.connect(tmp_path / "missing", create=False)
    good = tmp_path / "good"
    trellisdb.connect(good, embedding_dim=4).close()
    with pytest.raises(trellisdb.ValidationError, match="embedding_dim=4"):
        trellisdb.connect(good, embedding_dim=8)
    meta = json.loads((good / "trellis.json").read_text())
    meta["format_version"] = 999
    (good / "trellis.json").write_text(json.dumps(meta))
    with pytest.raises(trellisdb.FormatVersionError, match="999"):
        trellisdb.connect(good)
