"""The data model of issue 24: insertion order, attributes, labels, event time, step records,
and the in-place upgrade of a format-1 store. Real stores in temp dirs; assertions on rows."""

from __future__ import annotations

import datetime as dt
import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

import trellisdb
from trellisdb.errors import UnknownNodeError, UnknownSessionError, ValidationError

FIXTURES = Path(__file__).parent / "fixtures"


def rows(db: trellisdb.Database, sql: str, **kw: object) -> list[dict[str, object]]:
    return db.sql(sql, **kw).to_pylist()  # type: ignore[arg-type]


# ------------------------------------------------------------------ insertion order
def test_insertion_order_is_first_commit_then_position_and_survives_rewrites(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s") as s:
        root = s.add_node(summary="root")
        kids = [s.add_node(parents=[root], summary=f"k{i}") for i in range(6)]  # generated ids, one commit
    order = [r["id"] for r in rows(db, "SELECT id FROM nodes WHERE id != $r ORDER BY seq", params={"r": root})]
    assert order == kids
    # a status change, an attribute and a label (later commits) move nothing
    with db.session(task="t", id="s") as s:
        s.set_status(list(reversed(kids[:3])), "expanded")
        s.set_attrs(kids[4], {"visits": 3})
        s.label(kids[5], "archive")
    assert [r["id"] for r in rows(db, "SELECT id FROM nodes WHERE id != $r ORDER BY seq", params={"r": root})] == kids
    assert rows(db, "SELECT count(*) AS n FROM nodes WHERE status = 'expanded'") == [{"n": 3}]
    # and the seq of every version of a node is the same
    assert rows(db, "SELECT count(*) AS n FROM (SELECT id FROM nodes_history GROUP BY id "
                    "HAVING count(DISTINCT seq) > 1)") == [{"n": 0}]
    # a later commit's nodes come after
    with db.session(task="t", id="s") as s:
        late = s.add_node(parents=[root])
    assert rows(db, "SELECT id FROM nodes ORDER BY seq DESC LIMIT 1") == [{"id": late}]


def test_a_rewrite_in_a_transaction_of_a_node_still_pending_in_the_group_keeps_its_order(
    db: trellisdb.Database,
) -> None:
    s = db.session(task="t", id="s")
    first = s.add_node(summary="pending in the group batch")
    second = s.add_node(summary="also pending")
    with db.transaction():  # flushes the group batch first, then commits this one
        s.set_status(first, "expanded")
    got = rows(db, "SELECT id, status, seq FROM nodes ORDER BY seq")
    assert [(r["id"], r["status"]) for r in got] == [(first, "expanded"), (second, "pending")]
    assert rows(db, "SELECT DISTINCT born IS NOT NULL AS b FROM nodes_history WHERE id = $i AND commit_id = "
                    "(SELECT max(commit_id) FROM nodes_history WHERE id = $i)", params={"i": first}) == [{"b": True}]


def test_ingest_orders_nodes_by_row_and_refuses_system_columns(db: trellisdb.Database) -> None:
    db.add_task("t")
    db.session(task="t", id="s").close()
    ids = ["n5", "n1", "n9", "n3"]
    db.ingest({"nodes": pa.table({"id": ids, "session_id": ["s"] * 4, "task_id": ["t"] * 4})})
    assert [r["id"] for r in rows(db, "SELECT id FROM nodes ORDER BY seq")] == ids
    with pytest.raises(ValidationError, match="ordinal is set by trellisdb"):
        db.ingest({"nodes": pa.table({"id": ["x"], "session_id": ["s"], "task_id": ["t"], "ordinal": [0]})})


# ------------------------------------------------------------------ attributes
def test_attributes_typed_superseded_retracted_and_seen_as_of(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s", attrs={"config_hash": "abc"}) as s:
        n = s.add_node(id="p1", attrs={"island": 2, "cell": [1, 3], "migrant": False, "note": "from island 0"})
    before = db.log()[-1]["id"]
    with db.session(task="t", id="s") as s:
        s.set_attrs(n, {"island": 3, "note": None})
    db.set_attrs("t", {"family": "packing"}, scope="task")
    db.flush()
    cur = {r["key"]: r for r in rows(db, "SELECT key, value, num, text FROM attributes WHERE scope = 'node'")}
    assert set(cur) == {"island", "cell", "migrant"}  # note retracted
    assert (cur["island"]["num"], cur["island"]["value"]) == (3.0, "3")
    assert (cur["cell"]["num"], cur["cell"]["text"], json.loads(cur["cell"]["value"])) == (None, None, [1, 3])
    assert cur["migrant"]["value"] == "false" and cur["migrant"]["num"] is None
    old = {r["key"]: r for r in db.sql("SELECT key, num, text FROM attributes WHERE scope = 'node'",
                                       as_of=before).to_pylist()}
    assert old["island"]["num"] == 2.0 and old["note"]["text"] == "from island 0"
    assert rows(db, "SELECT scope, entity, key, text FROM attributes WHERE scope != 'node' ORDER BY scope") == [
        {"scope": "session", "entity": "s", "key": "config_hash", "text": "abc"},
        {"scope": "task", "entity": "t", "key": "family", "text": "packing"},
    ]
    # the history keeps every version, the retraction included
    assert rows(db, "SELECT count(*) AS n FROM attributes_history WHERE key = 'note'") == [{"n": 2}]


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s, n: s.set_attrs(n, {"x": float("nan")}), ValidationError, "JSON values"),
        (lambda s, n: s.set_attrs(n, {"x": {1: "a"}}), ValidationError, "not a string"),
        (lambda s, n: s.set_attrs(n, {"": 1}), ValidationError, "attribute key must not be empty"),
        (lambda s, n: s.set_attrs(n, {"x": "\udc80"}), ValidationError, "UTF-8"),
        (lambda s, n: s.set_attrs(n, {"x": "y" * 70_000}), ValidationError, "at most 65,536"),
        (lambda s, n: s.set_attrs(n, ["x"]), ValidationError, "must be a mapping"),
        (lambda s, n: s.set_attrs("nope", {"x": 1}), UnknownNodeError, "does not exist"),
        (lambda s, n: s.set_attrs("nope", {"x": 1}, scope="session"), UnknownSessionError, "does not exist"),
        (lambda s, n: s.set_attrs(n, {"x": 1}, scope="planet"), ValidationError, "scope must be one of"),
        (lambda s, n: s.label(n, ""), ValidationError, "label must not be empty"),
        (lambda s, n: s.label("nope", "archive"), UnknownNodeError, "does not exist"),
        (lambda s, n: s.add_node(at=dt.datetime(2026, 1, 1)), ValidationError, "has no timezone"),
        (lambda s, n: s.add_node(at="yesterday"), ValidationError, "not an ISO-8601 time"),
        (lambda s, n: s.add_reward(n, "r", 1.0, at=float("inf")), ValidationError, "finite number"),
        (lambda s, n: s.add_node(at=[1]), ValidationError, "timezone-aware datetime"),
        (lambda s, n: s.add_node(attrs={"x": 1}, labels="pop", at=1e20), ValidationError, "outside the years"),
    ],
)
def test_bad_attributes_labels_and_times_are_refused_and_stage_nothing(
    db: trellisdb.Database, call: object, error: type[Exception], match: str
) -> None:
    with db.session(task="t", id="s") as s:
        n = s.add_node(id="n")
    before = rows(db, "SELECT (SELECT count(*) FROM nodes_history) + (SELECT count(*) FROM attributes_history) + "
                      "(SELECT count(*) FROM labels_history) + (SELECT count(*) FROM rewards_history) AS n")
    s = db.resume("s")
    with pytest.raises(error, match=match):
        call(s, n)  # type: ignore[operator]
    db.flush()
    after = rows(db, "SELECT (SELECT count(*) FROM nodes_history) + (SELECT count(*) FROM attributes_history) + "
                     "(SELECT count(*) FROM labels_history) + (SELECT count(*) FROM rewards_history) AS n")
    assert after == before


def test_ingest_of_attributes_derives_typed_columns_and_checks_entities(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s") as s:
        s.add_node(id="n")
    db.ingest({"attributes": pa.table({"scope": ["node", "node", "session"], "entity": ["n", "n", "s"],
                                       "key": ["k", "s", "who"], "value": ["4.5", '"x"', "true"]})})
    got = rows(db, "SELECT key, num, text, retracted FROM attributes ORDER BY key")
    assert got == [{"key": "k", "num": 4.5, "text": None, "retracted": False},
                   {"key": "s", "num": None, "text": "x", "retracted": False},
                   {"key": "who", "num": None, "text": None, "retracted": False}]
    with pytest.raises(ValidationError, match="not JSON text"):
        db.ingest({"attributes": pa.table({"scope": ["node"], "entity": ["n"], "key": ["k"], "value": ["{oops"]})})
    with pytest.raises(UnknownNodeError, match="'ghost'"):
        db.ingest({"attributes": pa.table({"scope": ["node"], "entity": ["ghost"], "key": ["k"], "value": ["1"]})})
    with pytest.raises(ValidationError, match="has no value"):
        db.ingest({"attributes": pa.table({"scope": ["node"], "entity": ["n"], "key": ["k"],
                                           "value": pa.array([None], pa.string())})})


# ------------------------------------------------------------------ labels
def test_labels_are_memberships_that_change_and_time_travel(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s") as s:
        a = s.add_node(id="a", labels=["population", "island_0"])
        b = s.add_node(id="b", labels=["population", "island_1"])
    db.tag("c1")
    with db.session(task="t", id="s") as s:
        s.label([a, b], "archive")
        s.unlabel(a, "population", "island_0")
        s.unlabel(b, "never_had_it")  # removing a label a node lacks is harmless
    db.tag("c2")
    with db.session(task="t", id="s") as s:
        s.label(a, "population", "island_1")  # re-added

    def members(as_of: object) -> dict[str, list[str]]:
        got = db.sql("SELECT label, list(node_id ORDER BY node_id) AS ids FROM labels GROUP BY label",
                     as_of=as_of).to_pylist()  # type: ignore[arg-type]
        return {r["label"]: r["ids"] for r in got}

    assert members("c1") == {"population": ["a", "b"], "island_0": ["a"], "island_1": ["b"]}
    assert members("c2") == {"population": ["b"], "island_1": ["b"], "archive": ["a", "b"]}
    assert members(None) == {"population": ["a", "b"], "island_1": ["a", "b"], "archive": ["a", "b"]}


# ------------------------------------------------------------------ event time
def test_event_time_is_kept_apart_from_commit_time(db: trellisdb.Database) -> None:
    found = dt.datetime(2025, 3, 1, 12, 0, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    with db.session(task="t", id="s", at="2025-03-01T09:00:00Z") as s:
        n = s.add_node(id="n", at=found)
        m = s.add_node(id="m", parents=[n], at=1740830400.5)
        s.add_reward(m, "score", 0.5, at="2025-03-01T10:00:00+00:00")
        s.add_comparison(n, m, m, at=0)
    utc = dt.UTC
    got = {r["id"]: r["event_time"] for r in rows(db, "SELECT id, event_time FROM nodes")}
    assert got["n"] == dt.datetime(2025, 3, 1, 10, 0, tzinfo=utc)
    assert got["m"] == dt.datetime(2025, 3, 1, 12, 0, 0, 500000, tzinfo=utc)
    assert rows(db, "SELECT event_time FROM edges") == [{"event_time": got["m"]}]  # a parent edge: its node's
    assert rows(db, "SELECT event_time FROM rewards")[0]["event_time"].hour == 10  # type: ignore[union-attr]
    assert rows(db, "SELECT event_time FROM sessions")[0]["event_time"].hour == 9  # type: ignore[union-attr]
    assert rows(db, "SELECT event_time FROM comparisons")[0]["event_time"].year == 1970  # type: ignore[union-attr]
    # AS OF TIMESTAMP stays commit time: everything was committed now, long after its event time
    assert db.sql("SELECT count(*) AS n FROM nodes", as_of="2025-03-02T00:00:00+00:00").to_pylist() == [{"n": 0}]


# ------------------------------------------------------------------ step records
def test_step_records_keep_action_and_state_as_columns(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s") as s:
        s.add_node(id="s1", kind="step", action="ls -la", state='{"cwd": "/repo"}',
                   artifacts={"thought": "look around", "observation": "a b c"})
        s.add_node(id="s2", kind="step", parents=["s1"], action="open a", state='{"cwd": "/repo", "open": "a"}')
    assert rows(db, "SELECT id, action, json_extract_string(state, '$.cwd') AS cwd FROM nodes ORDER BY seq") == [
        {"id": "s1", "action": "ls -la", "cwd": "/repo"}, {"id": "s2", "action": "open a", "cwd": "/repo"}]
    with pytest.raises(ValidationError, match="state is not valid UTF-8"):
        db.resume("s").add_node(state="\udc80")


# ------------------------------------------------------------------ format upgrade
def test_a_format_1_store_is_upgraded_in_place_by_a_writable_open(tmp_path: Path) -> None:
    path = tmp_path / "v1"
    shutil.copytree(FIXTURES / "format-v1" / "store", path)  # made by the release before (see make_v1.py)
    with pytest.raises(trellisdb.FormatVersionError, match="open it once without read_only"):
        trellisdb.connect(path, read_only=True)
    assert json.loads((path / "trellis.json").read_text())["format_version"] == 1  # the refusal changed nothing
    db = trellisdb.connect(path)
    try:
        assert json.loads((path / "trellis.json").read_text())["format_version"] == 3
        assert db.verify() == []
        # every row is there, the WAL's included; old rows order by their commit, then id, and a node
        # rewritten before the upgrade (root's status change) by that rewrite, as format 1 ordered them
        assert [r["id"] for r in rows(db, "SELECT id FROM nodes ORDER BY seq, id")] == ["x", "y", "root", "z"]
        assert rows(db, "SELECT id, status FROM nodes WHERE id = 'root'") == [{"id": "root", "status": "expanded"}]
        assert db.sql("SELECT count(*) AS n FROM nodes", as_of="before").to_pylist() == [{"n": 3}]
        assert rows(db, "SELECT node_id, value FROM rewards ORDER BY node_id") == [
            {"node_id": "x", "value": 0.5}, {"node_id": "y", "value": 0.5}, {"node_id": "z", "value": 0.9}]
        with db.session(task="t", id="s3") as s:
            s.add_node(id="w", parents=["z"], attrs={"island": 1}, labels=["population"], at=0)
            s.set_status("x", "expanded")  # an old node's rewrite keeps its place
        assert [r["id"] for r in rows(db, "SELECT id FROM nodes ORDER BY seq, id")] == ["x", "y", "root", "z", "w"]
        assert rows(db, "SELECT entity, num FROM attributes") == [{"entity": "w", "num": 1.0}]
    finally:
        db.close()
    db = trellisdb.connect(path, read_only=True)  # upgraded: read-only opens work now
    try:
        assert rows(db, "SELECT count(*) AS n FROM labels") == [{"n": 1}]
    finally:
        db.close()


# ------------------------------------------------------------------ TQL over the model
@pytest.mark.parametrize("ids", ["generated", "reverse-sorted"])
def test_frontier_ties_come_out_in_insertion_order_before_and_after_status_changes(
    db: trellisdb.Database, ids: str
) -> None:
    """Issue 24's acceptance: generated ids (time + random bits) sort randomly within a
    millisecond; the frontier's tie-break is the insertion order, which status changes keep.
    (Ids that sort against the insertion order make the old tie-break, by id, fail for sure.)"""
    with db.session(task="t", id="s") as s:
        root = s.add_node(summary="root")
        s.set_status(root, "expanded")
        beam: list[str] = []
        for depth in range(3):  # a beam search: each level's children tie on reward
            parent = beam[0] if beam else root
            kids = [s.add_node(id=None if ids == "generated" else f"n{depth}-{9 - i}", parents=[parent],
                               summary=f"d{depth}") for i in range(8)]
            for k in kids:
                s.add_reward(k, "score", float(depth))  # ties within a level
            beam = kids
            db.flush()
    want = beam[:5]
    q = "FRONTIER RANK BY reward('score') DESC LIMIT 5 RETURN id"
    assert [r["id"] for r in db.query(q).to_pylist()] == want
    with db.session(task="t", id="s") as s:
        s.set_status(list(reversed(beam[:3])), "evaluated")  # rewrites, in reverse order, in a later commit
    assert [r["id"] for r in db.query(q).to_pylist()] == want
    # ORDER BY with ties, and NODES too
    got = db.query("NODES WHERE summary = 'd2' ORDER BY reward('score') DESC RETURN id").to_pylist()
    assert [r["id"] for r in got] == beam


def test_attr_and_has_label_in_tql(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s") as s:
        for i in range(6):
            n = s.add_node(id=f"p{i}", attrs={"island": i % 3, "cell": f"c{i % 2}"},
                           labels=["population"] + (["archive"] if i % 2 else []))
            s.add_reward(n, "score", i / 10)
    db.tag("one")
    with db.session(task="t", id="s") as s:
        s.unlabel("p5", "population")
        s.set_attrs("p4", {"island": 0})
    assert [r["id"] for r in db.query(
        "NODES WHERE has_label('population') AND attr('island') = 1 ORDER BY id RETURN id").to_pylist()] == ["p1"]
    assert [r["id"] for r in db.query(
        "NODES WHERE attr('island') = 1 ORDER BY id RETURN id AS OF TAG 'one'").to_pylist()] == ["p1", "p4"]
    assert [r["id"] for r in db.query(
        "NODES WHERE attr('cell') = 'c1' AND has_label('archive') ORDER BY id RETURN id").to_pylist()] == ["p1", "p3", "p5"]
    assert [r["id"] for r in db.query(
        "NODES WHERE has_label('population') ORDER BY id RETURN id AS OF TAG 'one'").to_pylist()] == [f"p{i}" for i in range(6)]
    best = db.query("FRONTIER WHERE has_label('population') RANK BY reward('score') DESC PER attr('island') 1 "
                    "RETURN id, attr('island') AS island").to_pylist()
    assert sorted((r["island"], r["id"]) for r in best) == [(0, "p4"), (1, "p1"), (2, "p2")]


def test_attr_of_a_key_with_mixed_values_still_compares_by_the_literal(db: trellisdb.Database) -> None:
    """One value of another type (an agent's mistake, or a real mix) must not break a key's
    comparisons: attr('k') compared with a number reads the numbers, with text the texts."""
    with db.session(task="t", id="s") as s:
        for i in range(4):
            s.add_node(id=f"n{i}", attrs={"island": i % 2})
    db.tag("numbers")
    with db.session(task="t", id="s") as s:
        s.set_attrs("n3", {"island": "far away"})
        s.set_attrs("n2", {"island": [1, 2]})

    def ids(q: str) -> list[str]:
        return [r["id"] for r in db.query(q).to_pylist()]

    assert ids("NODES WHERE attr('island') = 1 ORDER BY id RETURN id") == ["n1"]
    assert ids("NODES WHERE attr('island') = 'far away' RETURN id") == ["n3"]
    assert ids("NODES WHERE attr('island') IN (0, 1) ORDER BY id RETURN id") == ["n0", "n1"]
    assert ids("NODES WHERE attr('island') BETWEEN 1 AND 5 RETURN id") == ["n1"]
    assert ids("NODES WHERE attr('island') = 1 ORDER BY id RETURN id AS OF TAG 'numbers'") == ["n1", "n3"]
    # alone, a mixed key reads as its JSON text
    got = {r["id"]: r["island"] for r in db.query("NODES ORDER BY id RETURN id, attr('island')").to_pylist()}
    assert got == {"n0": "0", "n1": "1", "n2": "[1, 2]", "n3": '"far away"'}
    plan = db.query("EXPLAIN NODES WHERE attr('island') = 1").to_pylist()[0]["explain"]
    assert "attr('island') = 1" in plan


def test_a_group_commit_between_the_lookup_and_the_rewrite_keeps_the_order(
    db: trellisdb.Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The group-commit timer may commit the batch holding a node right after set_status (in a
    transaction) found its pending row: the rewrite still takes that batch's commit as born."""
    import threading

    from trellisdb.committer import Committer

    s = db.session(task="t", id="s")
    first = s.add_node(id="x")
    second = s.add_node(id="y")
    orig = Committer.node_rows

    def node_rows(self: Committer, ids: object, owners: object = None) -> object:
        out = orig(self, ids, owners)  # type: ignore[arg-type]
        t = threading.Thread(target=self.flush)  # the timer fires here, in its own thread
        t.start()
        t.join()
        return out

    monkeypatch.setattr(Committer, "node_rows", node_rows)
    with db.transaction():
        s.set_status(first, "expanded")
    monkeypatch.setattr(Committer, "node_rows", orig)
    assert [(r["id"], r["status"]) for r in rows(db, "SELECT id, status FROM nodes ORDER BY seq")] == [
        (first, "expanded"), (second, "pending")]


def test_an_explicit_id_retry_must_repeat_action_state_and_time_and_reasserts_attrs(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s") as s:
        s.add_node(id="x", action="ls", state="{}", at=5, attrs={"k": 1}, labels=["pop"])
    s = db.resume("s")
    for change in ({"action": "rm -rf /"}, {"state": '{"cwd": "/"}'}, {"at": 6}):
        with pytest.raises(trellisdb.DuplicateIdError, match="already exists with a different"):
            s.add_node(id="x", **{"action": "ls", "state": "{}", "at": 5, **change})  # type: ignore[arg-type]
    s.set_attrs("x", {"k": 2})
    s.unlabel("x", "pop")
    db.flush()
    assert s.add_node(id="x", action="ls", state="{}", at=5, attrs={"k": 1}, labels=["pop"]) == "x"  # a retry
    db.flush()
    assert rows(db, "SELECT num FROM attributes WHERE entity = 'x'") == [{"num": 1.0}]  # as the retry asks
    assert rows(db, "SELECT label FROM labels WHERE node_id = 'x'") == [{"label": "pop"}]
    assert rows(db, "SELECT count(*) AS n FROM nodes_history WHERE id = 'x'") == [{"n": 1}]


def test_read_only_handles_refuse_attributes_and_labels_first(tmp_path: Path) -> None:
    with trellisdb.connect(tmp_path / "db") as db, db.session(task="t", id="s") as s:
        s.add_node(id="n")
    with trellisdb.connect(tmp_path / "db", read_only=True) as ro:
        for call in (lambda: ro.set_attrs("n", {"k": 1}), lambda: ro.set_attrs("ghost", {"": 1}),
                     lambda: ro.label("ghost", "x"), lambda: ro.unlabel("n", "x")):
            with pytest.raises(trellisdb.ReadOnlyError):
                call()


def test_an_interrupted_upgrade_is_finished_by_the_next_open(tmp_path: Path) -> None:
    path = tmp_path / "v1"
    shutil.copytree(FIXTURES / "format-v1" / "store", path)
    (path / "tables" / "attributes.lance" / "data").mkdir(parents=True)  # created half-way, then a crash
    with trellisdb.connect(path) as db:
        assert db.verify() == []
        with db.session(task="t", id="s9") as s:
            s.add_node(id="w", attrs={"k": "v"})
        assert rows(db, "SELECT text FROM attributes") == [{"text": "v"}]


def test_an_ingest_commits_pending_writes_first_and_never_reuses_their_ids(db: trellisdb.Database) -> None:
    s = db.session(task="t", id="s")
    s.add_node(id="pending")  # in the group batch, not committed yet
    with pytest.raises(trellisdb.DuplicateIdError, match="'pending' already exists"):
        db.ingest({"nodes": pa.table({"id": ["pending"], "session_id": ["s"], "task_id": ["t"]})})
    db.ingest({"nodes": pa.table({"id": ["child"], "session_id": ["s"], "task_id": ["t"]}),
               "edges": pa.table({"src": ["pending"], "dst": ["child"], "kind": ["derived_from"]})})
    assert rows(db, "SELECT id FROM nodes ORDER BY seq") == [{"id": "pending"}, {"id": "child"}]


@pytest.mark.parametrize("hostile", ["x') OR 1=1 --", "k'; DROP TABLE nodes; --", "é'\"\\", "$param"])
def test_attribute_keys_and_labels_reach_sql_only_as_values(db: trellisdb.Database, hostile: str) -> None:
    """Keys and labels are an agent's names: written and queried as values, never SQL text."""
    with db.session(task="t", id="s") as s:
        s.add_node(id="n", attrs={hostile: 1, "plain": 2}, labels=[hostile])
        s.add_node(id="m", attrs={"plain": 3})
    lit = "'" + hostile.replace("'", "''") + "'"
    assert db.query(f"NODES WHERE attr({lit}) = 1 AND has_label({lit}) RETURN id").to_pylist() == [{"id": "n"}]
    assert db.query("NODES WHERE has_label($l) RETURN id", l=hostile).to_pylist() == [{"id": "n"}]
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 2}]  # nothing dropped
