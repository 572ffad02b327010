"""Trust labels and quarantine (issue 25): who wrote each node (``provenance``), and nodes held
out of retrieval, the frontier and training data (``trellis:quarantined``), commit-stamped so
that ``AS OF`` sees each moment. Real stores in temp dirs; assertions on the rows returned."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import trellisdb
from trellisdb.database import open_local as connect  # an embedded store (typed as one)
from trellisdb.errors import ReadOnlyError, UnknownNodeError, ValidationError
from trellisdb.importers import import_run

FIXTURES = Path(__file__).parent / "fixtures"
EXCLUDING = "excluding quarantined nodes (trellis:quarantined as of commit {}); INCLUDE QUARANTINED to include them"

#   root .1 ─┬─ good .5 ── kid .6
#            ├─ meh .3
#            └─ evil .99   (an injected "success", its embedding near the query)
EMB: dict[str, list[float]] = {"root": [1, 0, 0, 0], "good": [0, 1, 0, 0], "kid": [0, 0.9, 0.1, 0], "meh": [0, 0, 1, 0],
       "evil": [0.7, 0.7, 0, 0.1]}
SCORES = {"root": 0.1, "good": 0.5, "kid": 0.6, "meh": 0.3, "evil": 0.99}
NEAR_EVIL = [0.6, 0.8, 0, 0]


def ids(db: trellisdb.Database, text: str, **params: Any) -> list[str]:
    return [r["id"] for r in db.query(text, **params).to_pylist()]


def rows(db: trellisdb.Database, sql: str) -> list[dict[str, Any]]:
    return db.sql(sql).to_pylist()


@pytest.fixture
def tree(db: trellisdb.Database) -> trellisdb.Database:
    with db.session(task="t", id="s", agent="a") as s:
        for nid, parent in (("root", None), ("good", "root"), ("meh", "root"), ("evil", "root"), ("kid", "good")):
            s.add_node(id=nid, parents=[parent] if parent else [], embedding=EMB[nid], summary=f"node {nid}",
                       artifacts={"prompt": "pack circles", "response": f"answer {nid}"})
            s.add_reward(nid, "score", SCORES[nid])
    db.tag("before")
    return db


FRONTIER = "FRONTIER RANK BY reward('score') DESC RETURN id"


# ------------------------------------------------------------------ exclusion by default
def test_quarantine_hides_a_poisoned_node_from_frontier_retrieve_and_expand(tree: trellisdb.Database) -> None:
    db = tree
    assert ids(db, FRONTIER) == ["evil", "kid", "meh"]
    assert ids(db, "RETRIEVE 2 SIMILAR TO $v RETURN id", v=NEAR_EVIL) == ["evil", "good"]
    db.quarantine("evil", reason="injected success: reward without a verifier run")
    db.flush()
    assert ids(db, FRONTIER) == ["kid", "meh"]
    # the seeds are the nearest of the other nodes: k of them, as if searched among them alone
    assert ids(db, "RETRIEVE 2 SIMILAR TO $v RETURN id", v=NEAR_EVIL) == ["good", "kid"]
    assert ids(db, "RETRIEVE 2 SIMILAR TO $v WHERE step >= 0 RETURN id", v=NEAR_EVIL) == ["good", "kid"]  # prefilter
    assert ids(db, "RETRIEVE 2 MATCHING 'evil' RETURN id") == []  # keywords: the only match is held
    # EXPAND leaves it out of what it reaches too
    got = db.query("RETRIEVE 1 SIMILAR TO $v EXPAND DESCENDANTS 1 RETURN id, relation", v=EMB["root"]).to_pylist()
    assert got == [{"id": "root", "relation": "seed"}, {"id": "good", "relation": "descendant"},
                   {"id": "meh", "relation": "descendant"}]
    # INCLUDE QUARANTINED shows it again, everywhere
    assert ids(db, "FRONTIER INCLUDE QUARANTINED RANK BY reward('score') DESC RETURN id") == ["evil", "kid", "meh"]
    assert ids(db, "RETRIEVE 2 SIMILAR TO $v INCLUDE QUARANTINED RETURN id", v=NEAR_EVIL) == ["evil", "good"]
    got = db.query("RETRIEVE 1 SIMILAR TO $v INCLUDE QUARANTINED EXPAND DESCENDANTS 1 RETURN id",
                   v=EMB["root"]).to_pylist()
    assert [r["id"] for r in got] == ["root", "evil", "good", "meh"]
    # inspection is not filtered: NODES, LINEAGE, and the quarantined() predicate to find them
    assert len(ids(db, "NODES RETURN id")) == 5
    assert ids(db, "LINEAGE OF 'evil' ANCESTORS RETURN id") == ["evil", "root"]
    assert db.query("NODES WHERE quarantined() RETURN id, attr('trellis:quarantine_reason') AS why, quarantined()"
                    ).to_pylist() == [{"id": "evil", "why": "injected success: reward without a verifier run",
                                       "quarantined": True}]
    assert ids(db, "NODES WHERE has_label('trellis:quarantined') RETURN id") == ["evil"]
    assert ids(db, "FRONTIER INCLUDE QUARANTINED WHERE NOT quarantined() RANK BY reward('score') DESC RETURN id") \
        == ["kid", "meh"]


def test_a_quarantined_child_does_not_count_as_an_expansion(tree: trellisdb.Database) -> None:
    """An injected child must not push its parent off the frontier, nor add to its visits."""
    db = tree
    q = "FRONTIER RANK BY reward('score') DESC RETURN id, children"
    assert db.query(q).to_pylist() == [{"id": "evil", "children": 0}, {"id": "kid", "children": 0},
                                       {"id": "meh", "children": 0}]
    db.quarantine("kid")
    db.flush()
    assert db.query(q).to_pylist() == [{"id": "evil", "children": 0}, {"id": "good", "children": 0},
                                       {"id": "meh", "children": 0}]
    assert ids(db, "FRONTIER INCLUDE QUARANTINED RANK BY reward('score') DESC RETURN id") == ["evil", "kid", "meh"]
    assert db.query("NODES WHERE id = 'good' RETURN children").to_pylist() == [{"children": 1}]  # NODES: as stored


def test_release_restores_and_as_of_sees_each_moment(tree: trellisdb.Database) -> None:
    db = tree
    db.quarantine(["evil"])
    db.flush()
    db.tag("held")
    db.release("evil")
    db.flush()
    db.tag("released")
    assert ids(db, FRONTIER) == ["evil", "kid", "meh"]
    assert ids(db, "RETRIEVE 1 SIMILAR TO $v RETURN id", v=NEAR_EVIL) == ["evil"]
    # released later, still out as of the moment it was held; and in before it was held
    assert ids(db, FRONTIER + " AS OF TAG 'held'") == ["kid", "meh"]
    assert ids(db, "RETRIEVE 1 SIMILAR TO $v RETURN id AS OF TAG 'held'", v=NEAR_EVIL) == ["good"]
    assert ids(db, FRONTIER + " AS OF TAG 'before'") == ["evil", "kid", "meh"]
    assert ids(db, "NODES WHERE quarantined() RETURN id AS OF TAG 'held'") == ["evil"]
    assert ids(db, "NODES WHERE quarantined() RETURN id") == []
    # the history keeps both facts, each commit-stamped
    assert rows(db, "SELECT present FROM labels_history WHERE label = 'trellis:quarantined' ORDER BY commit_id") == [
        {"present": True}, {"present": False}]


def test_explain_says_quarantined_nodes_are_left_out(tree: trellisdb.Database) -> None:
    db = tree
    head = db.log()[-1]["id"]
    text = db.query("EXPLAIN " + FRONTIER).to_pylist()[0]["explain"]
    assert EXCLUDING.format(head) in text
    assert "EXCLUDING" not in db.query("EXPLAIN FRONTIER INCLUDE QUARANTINED").to_pylist()[0]["explain"].upper()
    text = db.query("EXPLAIN RETRIEVE 2 SIMILAR TO $v EXPAND ANCESTORS 1 AS OF TAG 'before'", v=NEAR_EVIL
                    ).to_pylist()[0]["explain"]
    before = db.tags()["before"]
    assert EXCLUDING.format(before) in text
    assert "leaving out the quarantined nodes it reaches" in text
    assert f"quarantine: no seed is a node labelled trellis:quarantined as of commit {before}" in text
    # NODES and the graph statements do not filter, and say nothing of it
    assert "quarantined" not in db.query("EXPLAIN NODES RETURN id").to_pylist()[0]["explain"]
    with pytest.raises(trellisdb.QueryError, match="INCLUDE QUARANTINED concerns nodes"):
        db.query("RETRIEVE 1 MATCHING 'x' FROM tasks INCLUDE QUARANTINED")
    with pytest.raises(trellisdb.QueryError, match="quarantined\\(\\) tests whether a node"):
        db.query("SESSIONS WHERE quarantined()")


# ------------------------------------------------------------------ training views
def test_views_leave_quarantined_nodes_out_unless_asked(tree: trellisdb.Database) -> None:
    db = tree
    db.create_view("good", "sft", reward="reward('score')", threshold=0.5)
    db.create_view("pairs", "preference", reward="reward('score')", pairs_from=["siblings"])
    db.query("CREATE VIEW everything AS sft WITH reward = reward('score'), threshold = 0.5, include_quarantined = true")
    for v in ("good", "pairs", "everything"):
        db.materialize(v)

    def sft(v: str) -> list[str]:
        return sorted(r["node_id"] for r in db.view(v).to_pylist())

    def pairs() -> list[tuple[str, str]]:
        return sorted((r["chosen_id"], r["rejected_id"]) for r in db.view("pairs").to_pylist())

    assert sft("good") == ["evil", "good", "kid"]
    assert pairs() == [("evil", "good"), ("evil", "meh"), ("good", "meh")]
    db.quarantine("evil", reason="poisoned")
    db.flush()
    held = db.log()[-1]["id"]
    for v in ("good", "pairs", "everything"):  # a refresh sees the quarantine as a change of the node
        db.refresh(v)
    assert sft("good") == ["good", "kid"]
    assert pairs() == [("good", "meh")]
    assert sft("everything") == ["evil", "good", "kid"]
    db.release("evil")
    db.flush()
    db.refresh("good")
    db.refresh("pairs")
    assert sft("good") == ["evil", "good", "kid"]
    assert pairs() == [("evil", "good"), ("evil", "meh"), ("good", "meh")]
    db.materialize("good", as_of=held)  # as of the moment it was held
    assert sft("good") == ["good", "kid"]
    with pytest.raises(ValidationError, match="include_quarantined must be True or False"):
        db.create_view("bad", "sft", include_quarantined="yes")


# ------------------------------------------------------------------ writes: held nodes, reserved names
def test_a_held_write_is_quarantined_in_the_commit_of_its_node(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s") as s:
        s.add_node(id="ok", embedding=[1, 0, 0, 0])
        s.add_node(id="held", embedding=[1, 0, 0, 0], quarantine="awaiting verification")
        s.add_node(id="held2", quarantine=True)
        s.add_node(id="not_held", quarantine=False)
    assert rows(db, "SELECT n.id, l.commit_id = n.commit_id AS same FROM labels_history l JOIN nodes n "
                    "ON n.id = l.node_id WHERE l.label = 'trellis:quarantined' ORDER BY n.id") == [
        {"id": "held", "same": True}, {"id": "held2", "same": True}]
    assert rows(db, "SELECT entity, text FROM attributes WHERE key = 'trellis:quarantine_reason'") == [
        {"entity": "held", "text": "awaiting verification"}]
    assert ids(db, "FRONTIER RETURN id") == ["ok", "not_held"]
    assert ids(db, "RETRIEVE 5 SIMILAR TO $v RETURN id", v=[1, 0, 0, 0]) == ["ok"]
    with db.session(task="t", id="s2") as s:
        s.release(["held", "held2"])
    assert ids(db, "FRONTIER RETURN id") == ["ok", "held", "held2", "not_held"]
    assert rows(db, "SELECT count(*) AS n FROM attributes WHERE key = 'trellis:quarantine_reason'") == [{"n": 0}]
    with pytest.raises(ValidationError, match="quarantine takes True or the reason as text"):
        db.session(task="t").add_node(quarantine=3)  # type: ignore[arg-type]


def test_reserved_names_are_refused_and_nothing_is_staged(db: trellisdb.Database) -> None:
    with db.session(task="t", id="s") as s:
        s.add_node(id="n")
    s = db.resume("s")
    calls: list[Callable[[], object]] = [lambda: db.label("n", "trellis:quarantined"), lambda: s.unlabel("n", "trellis:quarantined"),
             lambda: s.add_node(id="m", labels=["trellis:trusted"]),
             lambda: db.set_attrs("n", {"trellis:quarantine_reason": "x"}),
             lambda: s.add_node(id="m", attrs={"trellis:anything": 1}),
             lambda: db.ingest({"labels": pa.table({"node_id": ["n"], "label": ["trellis:quarantined"],
                                                    "present": [False]})}),
             lambda: db.ingest({"attributes": pa.table({"scope": ["node"], "entity": ["n"],
                                                        "key": ["trellis:quarantine_reason"], "value": ['"x"']})})]
    for call in calls:
        with pytest.raises(ValidationError, match="is reserved: names starting 'trellis:' belong to trellisdb"):
            call()
    db.flush()
    assert rows(db, "SELECT count(*) AS n FROM nodes") == [{"n": 1}]
    assert rows(db, "SELECT count(*) AS n FROM labels_history") == [{"n": 0}]
    assert rows(db, "SELECT count(*) AS n FROM attributes_history") == [{"n": 0}]
    with pytest.raises(UnknownNodeError, match="quarantine: node 'ghost' does not exist"):
        db.quarantine(["n", "ghost"])
    db.flush()
    assert rows(db, "SELECT count(*) AS n FROM labels_history") == [{"n": 0}]


def test_read_only_handles_refuse_quarantine(tmp_path: Path) -> None:
    with connect(tmp_path / "db", embedding_dim=4) as db, db.session(task="t") as s:
        n = s.add_node()
    with connect(tmp_path / "db", read_only=True) as ro:
        calls: list[Callable[[], object]] = [lambda: ro.quarantine(n), lambda: ro.release(n)]
        for call in calls:
            with pytest.raises(ReadOnlyError):
                call()


# ------------------------------------------------------------------ provenance
def test_provenance_is_the_writers_and_survives_rewrites(tmp_path: Path) -> None:
    db = connect(tmp_path / "db", embedding_dim=4)
    try:
        with db.session(task="t", id="s1") as s:
            s.add_node(id="a")
        with db.session(task="t", id="s2", provenance="token:alice") as s:
            s.add_node(id="b", parents=["a"])
            s.set_status("a", "expanded")  # a rewrite by alice of the api's node keeps who wrote it
        db.resume("s2").set_status("b", "closed")
        db.ingest({"nodes": pa.table({"id": ["c", "d"], "session_id": ["s1", "s1"], "task_id": ["t", "t"]})})
        db.ingest({"nodes": pa.table({"id": ["e"], "session_id": ["s1"], "task_id": ["t"],
                                      "provenance": ["importer:custom"]})})
        db.flush()
        assert rows(db, "SELECT id, status, provenance FROM nodes ORDER BY seq") == [
            {"id": "a", "status": "expanded", "provenance": "api"},
            {"id": "b", "status": "closed", "provenance": "token:alice"},
            {"id": "c", "status": None, "provenance": "api"}, {"id": "d", "status": None, "provenance": "api"},
            {"id": "e", "status": None, "provenance": "importer:custom"}]
        assert rows(db, "SELECT count(DISTINCT provenance) AS n FROM nodes_history WHERE id IN ('a', 'b') "
                        "GROUP BY id ORDER BY id") == [{"n": 1}, {"n": 1}]
        assert ids(db, "NODES WHERE provenance = 'token:alice' RETURN id") == ["b"]
        with pytest.raises(ValidationError, match="provenance must not be empty"):
            db.session(task="t", provenance="")
    finally:
        db.close()
    with connect(tmp_path / "db", provenance="service:evolver") as db2, db2.session(task="t") as s:
        s.add_node(id="f")
    with connect(tmp_path / "db", read_only=True) as ro:
        assert ro.sql("SELECT provenance FROM nodes WHERE id = 'f'").to_pylist() == [{"provenance": "service:evolver"}]
    with pytest.raises(ValidationError, match="provenance: options of an embedded store"):
        trellisdb.connect("http://localhost:1", provenance="x")


def test_importers_write_as_themselves(db: trellisdb.Database, tmp_path: Path) -> None:
    f = tmp_path / "run.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in (
        {"type": "header", "schema": "trellis-jsonl/1"}, {"type": "session", "id": "s1", "task": "t1"},
        {"type": "node", "id": "n1"}, {"type": "node", "id": "n2", "parents": ["n1"]})))
    import_run(db, "jsonl", f, progress=False)
    assert rows(db, "SELECT DISTINCT provenance FROM nodes") == [{"provenance": "importer:jsonl"}]


# ------------------------------------------------------------------ upgrades
@pytest.mark.parametrize("version", [1, 2])
def test_an_older_store_is_upgraded_provenance_null_and_quarantine_works(tmp_path: Path, version: int) -> None:
    path = tmp_path / f"v{version}"
    # v1: made by the release before format 2 (make_v1.py); v2: before format 3 (make_v2.py), its
    # last commits (an ingest's Arrow table of the version-2 columns among them) still in the WAL
    shutil.copytree(FIXTURES / f"format-v{version}" / "store", path)
    with pytest.raises(trellisdb.FormatVersionError, match="open it once without read_only"):
        trellisdb.connect(path, read_only=True)
    with connect(path) as db:
        assert json.loads((path / "trellis.json").read_text())["format_version"] == 3
        assert db.verify() == []
        old = rows(db, "SELECT id, provenance FROM nodes ORDER BY seq, id")
        assert len(old) == 4 and {r["provenance"] for r in old} == {None}
        with db.session(task="t", id="s9") as s:
            s.add_node(id="w", parents=["root"], embedding=[1, 0, 0, 0])
            s.set_status("x", "closed")  # an old node's rewrite keeps its unknown provenance
        db.quarantine("z", reason="suspicious")  # an old node (the labels table came with the upgrade)
        db.flush()
        assert rows(db, "SELECT id, provenance FROM nodes WHERE id IN ('w', 'x') ORDER BY id") == [
            {"id": "w", "provenance": "api"}, {"id": "x", "provenance": None}]
        assert ids(db, "NODES WHERE quarantined() RETURN id") == ["z"]
        assert ids(db, "FRONTIER WHERE id IN ('z', 'w') RETURN id") == ["w"]
        assert ids(db, "FRONTIER INCLUDE QUARANTINED WHERE id IN ('z', 'w') RETURN id") == ["z", "w"]
    with connect(path, read_only=True) as ro:  # upgraded: read-only opens work now
        assert ro.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 5}]
