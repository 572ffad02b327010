"""Every table round-trips: written through the session API or db.ingest, read back via db.sql, reopened."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from pathlib import Path

import pyarrow as pa
import pytest

import trellisdb

TABLES = ("tasks", "sessions", "nodes", "edges", "artifacts", "node_artifacts", "rewards", "comparisons",
          "attributes", "labels")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rows(db: trellisdb.Database, sql: str, **kw: object) -> list[dict[str, object]]:
    return db.sql(sql, **kw).to_pylist()  # type: ignore[arg-type]


def build_graph(db: trellisdb.Database) -> dict[str, object]:
    """Write one of everything through the session API; return what the test needs to know."""
    before = dt.datetime.now(dt.UTC)
    db.add_task("pack", name="pack circles", spec="maximize the sum of radii", tags=["geometry", "opt"],
                embedding=[1.0, 0.5, 0.25, -2.0])
    with db.session(task="pack", agent="evolve", model="o4-mini", config={"pop": 10, "islands": 2}, id="s1") as s:
        root = s.add_node(id="root", kind="attempt", step=1, status="evaluated", summary="initial program",
                          cost={"tokens_in": 100, "tokens_out": 250, "seconds": 1.5, "usd": 0.125},
                          embedding=[0.5, -0.25, 0.125, 4.0], artifacts={"code": "def pack(): ..."},
                          source="unit-test")
        a = s.add_node(id="a", parents=[root], summary="greedy", artifacts={"code": "def pack(): ..."})
        b = s.add_node(id="b", parents=[root], edge_kind="repair_of", kind="tool_call", summary="repair")
        c = s.add_node(id="c", parents=[a, b], edge_kind="crossover_of", summary="crossover")
        gen = s.add_node(summary="generated id")
        s.add_edge(a, b, "inspired_by")
        s.add_edge(root, c, "retrieved")
        s.add_edge(gen, c, "depends_on")
        blob = s.add_artifact(c, "log", b"\x00\x01\xffbinary log", media_type="application/octet-stream")
        prompt = s.add_artifact(c, "prompt", "improve it")
        s.add_reward(root, "combined_score", 0.5, verifier="evaluator.py", verifier_version="1.2")
        s.add_reward(a, "combined_score", 0.75)
        s.add_reward(a, "correct", 1)
        cmp1 = s.add_comparison(a, b, b, margin=0.25, judge="llm-judge", id="cmp1")
        cmp2 = s.add_comparison(b, c, None)
        s.set_status(root, "expanded")
        s.set_attrs(a, {"island": 1, "cell": "x"})
        s.label([a, c], "archive")
    after = dt.datetime.now(dt.UTC)
    return {"gen": gen, "blob": blob, "prompt": prompt, "cmp1": cmp1, "cmp2": cmp2, "before": before, "after": after}


def test_session_api_round_trips_every_table(db: trellisdb.Database) -> None:
    info = build_graph(db)
    gen = info["gen"]
    assert isinstance(gen, str) and re.fullmatch(r"[0-9a-f]{24}", gen)
    before, after = info["before"], info["after"]

    # The session block flushed: everything is visible, in the commits of the log (group commit may
    # have cut the writes into several), and every row carries the id of one of those commits.
    log = db.log()
    assert "s1" in {c["session_id"] for c in log} <= {"s1", None}  # None: see test_commit_names_session_*
    total = sum(rows(db, f"SELECT count(*) AS n FROM {t}_history")[0]["n"] for t in TABLES)  # type: ignore[misc]
    assert sum(c["rows"] for c in log) == total
    log_ids = {c["id"] for c in log}
    for t in TABLES:
        ids = {r["commit_id"] for r in rows(db, f"SELECT DISTINCT commit_id FROM {t}_history")}
        assert ids and ids <= log_ids, t

    tasks = rows(db, "SELECT * EXCLUDE (commit_id) FROM tasks_full")
    assert len(tasks) == 1
    task = tasks[0]
    assert before <= task.pop("created_at") <= after  # type: ignore[operator]
    assert task == {"id": "pack", "name": "pack circles", "spec": "maximize the sum of radii",
                    "tags": ["geometry", "opt"], "embedding": [1.0, 0.5, 0.25, -2.0]}

    sessions = rows(db, "SELECT * EXCLUDE (commit_id) FROM sessions")
    assert len(sessions) == 1
    assert before <= sessions[0].pop("created_at") <= after  # type: ignore[operator]
    assert sessions[0] == {"id": "s1", "task_id": "pack", "agent": "evolve", "model": "o4-mini",
                           "config": json.dumps({"islands": 2, "pop": 10}, sort_keys=True),
                           "status": "completed", "event_time": None}
    assert json.loads(sessions[0]["config"]) == {"pop": 10, "islands": 2}  # type: ignore[arg-type]

    nodes = {r["id"]: r for r in rows(db, "SELECT * EXCLUDE (commit_id) FROM nodes_full")}
    # the narrow views hold the same rows without the bulky vector column
    assert rows(db, "SELECT * FROM nodes ORDER BY id") == rows(db, "SELECT * EXCLUDE (embedding) FROM nodes_full ORDER BY id")
    assert "embedding" not in db.sql("SELECT * FROM nodes_history").to_arrow().column_names
    assert set(nodes) == {"root", "a", "b", "c", gen}
    order = {}
    for r in nodes.values():
        assert before <= r.pop("created_at") <= after  # type: ignore[operator]
        order[r["id"]] = r.pop("seq")
        del r["born"], r["ordinal"]
    assert sorted(order, key=order.__getitem__) == ["root", "a", "b", "c", gen]  # the insertion order
    step = {"event_time": None, "action": None, "state": None, "provenance": "api"}  # provenance: the handle's
    assert nodes["root"] == {
        "id": "root", "session_id": "s1", "task_id": "pack", "kind": "attempt", "step": 1, "status": "expanded",
        "summary": "initial program", "tokens_in": 100, "tokens_out": 250, "seconds": 1.5, "usd": 0.125,
        "source": "unit-test", "embedding": [0.5, -0.25, 0.125, 4.0], **step,
    }
    empty = {"tokens_in": None, "tokens_out": None, "seconds": None, "usd": None, "source": None, "embedding": None,
             **step}
    assert nodes["a"] == {"id": "a", "session_id": "s1", "task_id": "pack", "kind": "attempt", "step": 2,
                          "status": "pending", "summary": "greedy", **empty}
    assert nodes["b"] == {"id": "b", "session_id": "s1", "task_id": "pack", "kind": "tool_call", "step": 3,
                          "status": "pending", "summary": "repair", **empty}
    assert (nodes["c"]["step"], nodes["c"]["summary"]) == (4, "crossover")
    assert (nodes[gen]["step"], nodes[gen]["summary"]) == (5, "generated id")
    # every node's history is its insert, plus at most root's status change
    assert rows(db, "SELECT id, count(*) AS n FROM nodes_history GROUP BY id HAVING n > 1") in ([], [
        {"id": "root", "n": 2}])

    edges = rows(db, "SELECT src, dst, kind, session_id FROM edges ORDER BY src, dst, kind")
    assert edges == sorted([
        {"src": "root", "dst": "a", "kind": "derived_from", "session_id": "s1"},
        {"src": "root", "dst": "b", "kind": "repair_of", "session_id": "s1"},
        {"src": "a", "dst": "c", "kind": "crossover_of", "session_id": "s1"},   # multi-parent
        {"src": "b", "dst": "c", "kind": "crossover_of", "session_id": "s1"},   # multi-parent
        {"src": "a", "dst": "b", "kind": "inspired_by", "session_id": "s1"},
        {"src": "root", "dst": "c", "kind": "retrieved", "session_id": "s1"},
        {"src": gen, "dst": "c", "kind": "depends_on", "session_id": "s1"},
    ], key=lambda e: (e["src"], e["dst"], e["kind"]))
    assert rows(db, "SELECT list(src ORDER BY src) AS p FROM edges WHERE dst = 'c' AND kind = 'crossover_of'") == [
        {"p": ["a", "b"]}]

    code = b"def pack(): ..."
    assert info["blob"] == sha(b"\x00\x01\xffbinary log")
    assert info["prompt"] == sha(b"improve it")
    artifacts = rows(db, "SELECT hash, media_type, size, content FROM artifacts_full ORDER BY hash")
    assert artifacts == sorted([
        {"hash": sha(code), "media_type": "text/plain", "size": len(code), "content": code},
        {"hash": sha(b"\x00\x01\xffbinary log"), "media_type": "application/octet-stream", "size": 13,
         "content": b"\x00\x01\xffbinary log"},
        {"hash": sha(b"improve it"), "media_type": "text/plain", "size": 10, "content": b"improve it"},
    ], key=lambda r: r["hash"])  # type: ignore[arg-type,return-value]
    # the same bytes linked from two nodes are stored once, linked twice
    assert rows(db, "SELECT count(*) AS n FROM artifacts_history WHERE hash = $1", params=[sha(code)]) == [{"n": 1}]
    links = rows(db, "SELECT node_id, name, hash FROM node_artifacts ORDER BY node_id, name")
    assert links == [
        {"node_id": "a", "name": "code", "hash": sha(code)},
        {"node_id": "c", "name": "log", "hash": sha(b"\x00\x01\xffbinary log")},
        {"node_id": "c", "name": "prompt", "hash": sha(b"improve it")},
        {"node_id": "root", "name": "code", "hash": sha(code)},
    ]

    rewards = rows(db, "SELECT * EXCLUDE (created_at, commit_id) FROM rewards ORDER BY node_id, channel")
    assert rewards == [
        {"node_id": "a", "channel": "combined_score", "value": 0.75, "verifier": None, "verifier_version": None,
         "event_time": None},
        {"node_id": "a", "channel": "correct", "value": 1.0, "verifier": None, "verifier_version": None,
         "event_time": None},
        {"node_id": "root", "channel": "combined_score", "value": 0.5, "verifier": "evaluator.py",
         "verifier_version": "1.2", "event_time": None},
    ]
    assert isinstance(rewards[1]["value"], float)

    assert info["cmp1"] == "cmp1"
    cmp2 = info["cmp2"]
    assert isinstance(cmp2, str) and re.fullmatch(r"[0-9a-f]{24}", cmp2)
    assert rows(db, "SELECT * EXCLUDE (commit_id) FROM comparisons ORDER BY a") == [
        {"id": "cmp1", "a": "a", "b": "b", "preferred": "b", "margin": 0.25, "judge": "llm-judge", "event_time": None},
        {"id": cmp2, "a": "b", "b": "c", "preferred": None, "margin": None, "judge": None, "event_time": None},
    ]
    assert rows(db, "SELECT scope, entity, key, value FROM attributes ORDER BY key") == [
        {"scope": "node", "entity": "a", "key": "cell", "value": '"x"'},
        {"scope": "node", "entity": "a", "key": "island", "value": "1"},
    ]
    assert rows(db, "SELECT node_id, label, present, session_id FROM labels ORDER BY node_id") == [
        {"node_id": "a", "label": "archive", "present": True, "session_id": "s1"},
        {"node_id": "c", "label": "archive", "present": True, "session_id": "s1"},
    ]


def test_same_artifact_across_commits_and_reopen_is_stored_once(db: trellisdb.Database, tmp_path: Path) -> None:
    s = db.session(task="t", agent="a")
    s.add_node(id="n1", artifacts={"code": b"print(1)"})
    db.flush()
    s.add_node(id="n2", artifacts={"code": b"print(1)"})
    db.flush()
    db.close()
    again = trellisdb.connect(tmp_path / "db")
    try:
        w = again.resume(s.id)
        w.add_node(id="n3", artifacts={"main": "print(1)"})  # the same bytes, given as text
        again.flush()
        h = sha(b"print(1)")
        assert rows(again, "SELECT hash, size, content FROM artifacts_full_history") == [
            {"hash": h, "size": 8, "content": b"print(1)"}]
        assert rows(again, "SELECT node_id, name, hash FROM node_artifacts ORDER BY node_id") == [
            {"node_id": "n1", "name": "code", "hash": h},
            {"node_id": "n2", "name": "code", "hash": h},
            {"node_id": "n3", "name": "main", "hash": h},
        ]
    finally:
        again.close()


def test_status_change_after_commit_is_a_new_row(db: trellisdb.Database) -> None:
    s = db.session(task="t", agent="a", id="s")
    s.add_node(id="n", summary="x", embedding=[1, 2, 3, 4], cost={"usd": 2.0})
    first = db.flush()
    s.set_status("n", "evaluated")
    second = db.flush()
    assert first is not None and second is not None and second > first
    hist = rows(db, "SELECT status, summary, usd, embedding, commit_id FROM nodes_full_history ORDER BY commit_id")
    assert hist == [
        {"status": "pending", "summary": "x", "usd": 2.0, "embedding": [1.0, 2.0, 3.0, 4.0], "commit_id": first},
        {"status": "evaluated", "summary": "x", "usd": 2.0, "embedding": [1.0, 2.0, 3.0, 4.0], "commit_id": second},
    ]
    assert rows(db, "SELECT id, status FROM nodes") == [{"id": "n", "status": "evaluated"}]


def test_status_of_many_nodes_at_once_is_all_or_nothing(db: trellisdb.Database) -> None:
    s = db.session(task="t", agent="a", id="s")
    for i in range(4):
        s.add_node(id=f"n{i}", summary=f"x{i}", embedding=[1, 2, 3, i])
    db.flush()
    s.add_node(id="p", summary="pending")  # still in the group batch: changed in place
    with pytest.raises(trellisdb.UnknownNodeError, match="ghost"):
        s.set_status(["n0", "ghost", "n1"], "expanded")
    s.set_status(["n0", "n2", "p", "n0"], "expanded")
    db.flush()
    assert rows(db, "SELECT id, status, summary FROM nodes ORDER BY id") == [
        {"id": "n0", "status": "expanded", "summary": "x0"},
        {"id": "n1", "status": "pending", "summary": "x1"},
        {"id": "n2", "status": "expanded", "summary": "x2"},
        {"id": "n3", "status": "pending", "summary": "x3"},
        {"id": "p", "status": "expanded", "summary": "pending"},
    ]
    # one new row per changed committed node (its vector carried over), none for the failed call
    assert rows(db, "SELECT id, count(*) AS c, list(embedding[4]) AS e FROM nodes_full_history "
                    "GROUP BY id HAVING c > 1 ORDER BY id") == [
        {"id": "n0", "c": 2, "e": [0.0, 0.0]}, {"id": "n2", "c": 2, "e": [2.0, 2.0]}]


def test_rescore_in_same_commit_latest_wins(db: trellisdb.Database) -> None:
    s = db.session(task="t", agent="a")
    s.add_node(id="n")
    with db.transaction():
        for ch in ("c1", "c2", "c3"):
            s.add_reward("n", ch, 0.1)
            s.add_reward("n", ch, 0.9)
    assert rows(db, "SELECT channel, value FROM rewards ORDER BY channel") == [
        {"channel": ch, "value": 0.9} for ch in ("c1", "c2", "c3")]


def test_commit_names_session_of_reward_only_commit(db: trellisdb.Database) -> None:
    s = db.session(task="t", agent="a", id="s9")
    s.add_node(id="n")
    db.flush()
    assert [c["session_id"] for c in db.log()] == ["s9"]
    s.add_reward("n", "score", 1.0)
    db.flush()
    assert [c["session_id"] for c in db.log()] == ["s9", "s9"]


def test_ingest_round_trips_every_table_in_one_commit(db: trellisdb.Database) -> None:
    # one node written through the session API, so ingest can point at committed data too
    with db.session(task="pre", agent="a", id="s0") as s:
        s.add_node(id="old", summary="before ingest")
    log_before = db.log()
    n = 20
    ids = [f"n{i:02d}" for i in range(n)]
    blob = b"\x00bulk bytes"
    tables = {
        "tasks": pa.table({"id": ["bulk"], "name": ["bulk task"], "tags": [["x", "y"]],
                           "embedding": [[0.0, 1.0, 0.0, 0.5]]}),
        "sessions": pa.table({"id": ["sb"], "task_id": ["bulk"], "agent": ["importer"], "status": ["completed"]}),
        "nodes": pa.table({
            "id": ids, "session_id": ["sb"] * n, "task_id": ["bulk"] * n, "step": list(range(n)),
            "kind": ["attempt"] * n, "status": ["evaluated"] * n, "summary": [f"s{i}" for i in range(n)],
            "tokens_in": list(range(n)), "usd": [i / 4 for i in range(n)],
            "embedding": [[float(i), 0.5, -1.0, 0.25] for i in range(n)],
        }),
        "edges": pa.table({"src": ["old", *ids[:-1], "n00"], "dst": [ids[0], *ids[1:], "n05"],
                           "kind": ["derived_from"] * n + ["crossover_of"], "session_id": ["sb"] * (n + 1)}),
        "artifacts": pa.table({"hash": [sha(blob)], "media_type": ["application/x-bin"], "size": [len(blob)],
                               "content": pa.array([blob], pa.large_binary())}),
        "node_artifacts": pa.table({"node_id": ["n00", "old"], "name": ["code", "code"], "hash": [sha(blob)] * 2}),
        "rewards": pa.table({"node_id": ids, "channel": ["r"] * n, "value": [i / 8 for i in range(n)],
                             "verifier": ["bulk"] * n}),
        "comparisons": pa.table({"id": ["k1"], "a": ["n01"], "b": ["old"], "preferred": ["n01"], "margin": [0.5]}),
    }
    cid = db.ingest(tables, message="bulk load")

    log = db.log()
    assert len(log) == len(log_before) + 1
    assert log[-1]["id"] == cid and log[-1]["message"] == "bulk load"
    assert log[-1]["rows"] == sum(t.num_rows for t in tables.values())
    for name, t in tables.items():
        got = rows(db, f"SELECT count(*) AS n, min(commit_id) AS lo, max(commit_id) AS hi FROM {name}_history "
                       f"WHERE commit_id = {cid}")
        assert got == [{"n": t.num_rows, "lo": cid, "hi": cid}], name

    assert rows(db, "SELECT id, name, spec, tags, embedding FROM tasks_full WHERE id = 'bulk'") == [
        {"id": "bulk", "name": "bulk task", "spec": None, "tags": ["x", "y"], "embedding": [0.0, 1.0, 0.0, 0.5]}]
    assert rows(db, "SELECT id, task_id, agent, model, config, status, created_at FROM sessions WHERE id = 'sb'") == [
        {"id": "sb", "task_id": "bulk", "agent": "importer", "model": None, "config": None, "status": "completed",
         "created_at": None}]
    got_nodes = rows(db, "SELECT * EXCLUDE (commit_id, seq) FROM nodes_full WHERE session_id = 'sb' ORDER BY id")
    assert got_nodes == [
        {"id": ids[i], "session_id": "sb", "task_id": "bulk", "kind": "attempt", "step": i, "status": "evaluated",
         "summary": f"s{i}", "tokens_in": i, "tokens_out": None, "seconds": None, "usd": i / 4, "source": None,
         "embedding": [float(i), 0.5, -1.0, 0.25], "created_at": None, "born": None, "ordinal": i, "event_time": None,
         "action": None, "state": None, "provenance": "api"}
        for i in range(n)
    ]
    assert db.sql("SELECT embedding FROM nodes_full").to_arrow().schema.field("embedding").type == pa.list_(pa.float32(), 4)
    assert rows(db, "SELECT src, dst, kind FROM edges WHERE dst IN ('n00', 'n05') ORDER BY src") == [
        {"src": "n00", "dst": "n05", "kind": "crossover_of"},
        {"src": "n04", "dst": "n05", "kind": "derived_from"},
        {"src": "old", "dst": "n00", "kind": "derived_from"},
    ]
    assert rows(db, "SELECT count(*) AS n FROM edges") == [{"n": n + 1}]
    assert rows(db, "SELECT hash, media_type, size, content FROM artifacts_full") == [
        {"hash": sha(blob), "media_type": "application/x-bin", "size": len(blob), "content": blob}]
    assert rows(db, "SELECT node_id FROM node_artifacts ORDER BY node_id") == [{"node_id": "n00"}, {"node_id": "old"}]
    assert rows(db, "SELECT sum(value) AS s, count(*) AS n, min(verifier) AS v FROM rewards") == [
        {"s": sum(i / 8 for i in range(n)), "n": n, "v": "bulk"}]
    assert rows(db, "SELECT * EXCLUDE (commit_id) FROM comparisons") == [
        {"id": "k1", "a": "n01", "b": "old", "preferred": "n01", "margin": 0.5, "judge": None, "event_time": None}]
    # the session API keeps working on top of ingested data
    w = db.resume("sb")
    child = w.add_node(parents=["n19"], summary="after ingest")
    db.flush()
    assert rows(db, "SELECT step FROM nodes WHERE id = $1", params=[child]) == [{"step": n}]  # resumes after max step


def test_reopen_keeps_everything(db: trellisdb.Database, tmp_path: Path) -> None:
    build_graph(db)
    v1 = db.tag("v1")  # flushes: everything of build_graph is committed
    log = db.log()
    assert log[-1]["id"] == v1 and log[-1]["tags"] == ["v1"]
    s = db.resume("s1")
    s.add_reward("a", "combined_score", 0.875)  # pending (or just group-committed): close() flushes it
    db.close()

    again = trellisdb.connect(tmp_path / "db")
    try:
        assert again.embedding_dim == 4
        assert [c["id"] for c in again.log()] == [*(c["id"] for c in log), v1 + 1]
        assert again.log()[:-1] == log
        assert again.tags() == {"v1": v1}
        assert rows(again, "SELECT value FROM rewards WHERE node_id = 'a' AND channel = 'combined_score'") == [
            {"value": 0.875}]
        assert rows(again, "SELECT value FROM rewards WHERE node_id = 'a' AND channel = 'combined_score'",
                    as_of="v1") == [{"value": 0.75}]
        assert rows(again, "SELECT id, status FROM nodes WHERE id = 'root'") == [{"id": "root", "status": "expanded"}]
        counts = {t: rows(again, f"SELECT count(*) AS n FROM {t}")[0]["n"] for t in TABLES}
        assert counts == {"tasks": 1, "sessions": 1, "nodes": 5, "edges": 7, "artifacts": 3, "node_artifacts": 4,
                          "rewards": 3, "comparisons": 2, "attributes": 2, "labels": 2}
        assert rows(again, "SELECT embedding FROM nodes_full WHERE id = 'root'") == [{"embedding": [0.5, -0.25, 0.125, 4.0]}]
        # writing continues on the reopened database, against nodes committed before
        w = again.resume("s1")
        d = w.add_node(parents=["c"], summary="after reopen")
        again.flush()
        assert rows(again, "SELECT step FROM nodes WHERE id = $1", params=[d]) == [{"step": 6}]
        assert rows(again, "SELECT src FROM edges WHERE dst = $1", params=[d]) == [{"src": "c"}]
    finally:
        again.close()

    third = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    try:
        assert rows(third, "SELECT count(*) AS n FROM nodes") == [{"n": 6}]
        assert [c["id"] for c in third.log()][-3:] == [v1, v1 + 1, v1 + 2]
    finally:
        third.close()
