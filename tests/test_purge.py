"""``db.purge``: a session's rows gone from every stored version (queries, time travel, every
file under the store), the other session intact, an audit entry in the log, a clean verify.

The file scan looks for marker strings (and their base64 forms: the WAL carries bytes and
vectors as base64) in the raw bytes of every file under the store. Each marker kind is checked
against a control: the survivor's marker of the same kind must be found, so the scan is shown
able to see it (Lance 2.x stores these short strings and zstd-compressed artifacts of this size
as they are). The full-text index stores its tokens as an FST, where no marker is visible in
either session, so indexes are checked structurally instead: no index directory that existed
before the purge is left.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

import trellisdb
from trellisdb import purge as purge_module
from trellisdb.cli import main
from trellisdb.database import open_local
from trellisdb.errors import ReadOnlyError, UnknownSessionError, ValidationError
from trellisdb.reader import PUBLIC_RELATIONS
from trellisdb.storage import purge as storage_purge

SESSIONS = ("alpha", "beta")
SHARED = "a prompt both sessions use: the bytes stay, since beta links them too"
KINDS = ("summary", "response", "node-attr", "session-attr", "label", "config", "verifier", "state")


def mark(sid: str, kind: str) -> str:
    """A marker no identifier contains (the session id is kept in the log)."""
    return "PM" + hashlib.sha256(f"{sid}/{kind}".encode()).hexdigest()[:30]  # 32 characters: a full-text token (at most 40)


def blob(sid: str) -> bytes:
    return b"\x00\x01BIN" + mark(sid, "blob").encode() + b"\xff\xfe"


def vec(sid: str, i: int, sign: float = 1.0) -> list[float]:
    """Vectors whose float32 bytes are distinctive (exactly representable values)."""
    base = 7001.25 if sid == "alpha" else 3001.25
    return [sign * (base + 16 * i + k * 1.5) for k in range(4)]


def forms(value: str | bytes | list[float]) -> list[bytes]:
    """The byte strings a value may be stored as: raw, and base64 of the whole (WAL frames)."""
    raw = np.asarray(value, np.float32).tobytes() if isinstance(value, list) else (
        value if isinstance(value, bytes) else value.encode())
    return [raw, base64.b64encode(raw)]


def markers(sid: str) -> dict[str, list[bytes]]:
    out = {k: forms(mark(sid, k)) for k in KINDS}
    out["blob"] = forms(blob(sid))
    out["vector"] = forms(vec(sid, 1))
    out["space-vector"] = forms(vec(sid, 1, -1.0))
    return out


def scan(root: str, wanted: dict[str, list[bytes]]) -> dict[str, list[str]]:
    """Per marker kind, the files under ``root`` (every one) holding any form of it."""
    found: dict[str, list[str]] = {k: [] for k in wanted}
    for folder, _, files in os.walk(root):
        for f in files:
            path = os.path.join(folder, f)
            with open(path, "rb") as fh:
                data = fh.read()
            for k, fs in wanted.items():
                if any(b in data for b in fs):
                    found[k].append(os.path.relpath(path, root))
    return found


def build(path: Path) -> trellisdb.Database:
    """Sessions alpha and beta on task t: four nodes each (a root and three children), every kind
    of row carrying its session's markers, a beta node derived from an alpha node, a comparison
    across them, vectors in the built-in space and in space ``sp`` (both indexed), two
    materialized views exported under the store, and the tag ``before``."""
    db = open_local(path, embedding_dim=4)
    db.create_space("sp", dim=4)
    for sid in SESSIONS:
        with db.session(task="t", agent=f"agent-{sid[0]}", id=sid, config={"secret": mark(sid, "config")},
                        attrs={"note": mark(sid, "session-attr")}) as s:
            for i in range(4):
                s.add_node(id=f"{sid}-n{i}", parents=[f"{sid}-n0"] if i else [],
                           summary=f"{mark(sid, 'summary')} step {i}", state=mark(sid, "state"),
                           artifacts={"prompt": SHARED, "response": f"{mark(sid, 'response')} {i}",
                                      **({"blob": blob(sid)} if i == 1 else {})},
                           attrs={"k": mark(sid, "node-attr")}, labels=[mark(sid, "label")],
                           embedding=vec(sid, i))
                s.add_reward(f"{sid}-n{i}", "score", 0.5 + 0.1 * i)
        ids = [f"{sid}-n{i}" for i in range(4)]
        db.add_vectors("sp", ids, [vec(sid, i, -1.0) for i in range(4)])
    with db.session(task="t", id="beta") as s:  # reopened: a child of alpha's node, and a comparison across
        s.add_node(id="beta-x", parents=["alpha-n1"], summary="derived across sessions",
                   artifacts={"prompt": SHARED, "response": "a child of the other session's node"})
        s.add_reward("beta-x", "score", 0.8)
        s.add_comparison("alpha-n2", "beta-n2", preferred="beta-n2", judge="human")
    db.build_index("embedding")
    db.build_index("sp")
    db.create_view("all", "sft", reward="reward('score')", threshold=0.0)
    db.create_view("betas", "sft", reward="reward('score')", threshold=0.0, where="session_id = 'beta'")
    for v in ("all", "betas"):
        db.materialize(v)
        db.export(v, db.export_target(v))
    db.tag("before")
    return db


def _rows_everywhere(db: trellisdb.Database, as_of: Any = None) -> str:
    """Every row of every public relation (bulky columns included), as text."""
    out = []
    for rel in sorted(PUBLIC_RELATIONS - {"commits"}):
        out.append(repr(db.sql(f"SELECT * FROM {rel}", as_of=as_of).to_pylist()))
    return "\n".join(out)


def _indexes(path: str) -> set[str]:
    return {f"{t}/{d}" for t in ("nodes.lance", "vec_nodes_sp.lance")
            for d in os.listdir(os.path.join(path, "tables", t, "_indices"))}


def _ids(result: Any) -> set[str]:
    return {r["id"] for r in result.to_pylist()}


def test_purge_removes_a_session_from_every_version(tmp_path: Path) -> None:
    path = str(tmp_path / "db")
    db = build(Path(path))
    # later writes of both sessions, left in the WAL: a purge must reach rows not yet in Lance
    db._committer.checkpoint_delay = 3600.0
    for sid in SESSIONS:
        w = db.resume(sid)
        w.add_reward(f"{sid}-n3", "audit", 1.0, verifier=mark(sid, "verifier"))
        w.set_status(f"{sid}-n2", "closed")
        db.flush()
    wal = [f for f in os.listdir(path) if f.startswith("wal-")]
    assert wal and scan(path, {"v": forms(mark("alpha", "verifier"))})["v"] == wal
    before = {k: db.sql(q).to_pylist() for k, q in {
        "beta_nodes": "SELECT * EXCLUDE (seq) FROM nodes_full_history WHERE session_id = 'beta' ORDER BY id, commit_id",
        "beta_rewards": "SELECT * FROM rewards_history WHERE node_id LIKE 'beta%' ORDER BY node_id, channel, commit_id",
        "commits": "SELECT id, message FROM commits ORDER BY id"}.items()}
    assert "alpha" in _rows_everywhere(db, "before")
    assert _ids(db.query("RETRIEVE 5 MATCHING $w RETURN id", w=mark("alpha", "summary"))) == {
        f"alpha-n{i}" for i in range(4)}
    indexes_before = _indexes(path)
    # another handle, its mirror and adjacency warm: it must not show the purged rows afterwards
    other = open_local(path)
    assert "alpha-n1" in _ids(other.query("NODES RETURN id"))
    for _ in range(2):
        assert "alpha-n1" in _ids(other.query("LINEAGE OF 'beta-x' ANCESTORS RETURN id"))

    report = db.purge("alpha")

    assert report["sessions"] == ["alpha"]
    rows = report["rows"]
    # a session's rows: as many as its group commits held (a batch keeps a key's latest row)
    assert rows["sessions"] >= 1 and rows["nodes"] == 5 and rows["comparisons"] == 1  # n2's rewrite is a row too
    assert rows["edges"] == 4 and rows["vec_nodes_sp"] == 4 and rows["rewards"] == 5
    assert rows["labels"] == 4 and rows["attributes"] == 5  # four nodes' and the session's
    assert rows["node_artifacts"] == 9 and rows["artifacts"] == 5  # four responses and the blob
    assert report["shared_artifacts"] == 1  # the prompt: beta links it too, its bytes stay
    assert report["views_rebuilt"] == ["all", "betas"] and report["views_cleared"] == []
    assert [os.path.basename(p) for p in report["exports_removed"]] == ["all"]
    assert report["indexes"]["nodes"] == {"embedding_idx": "rebuilt", "summary_idx": "rebuilt"}
    assert report["indexes"]["vec_nodes_sp"] == {"vector_idx": "rebuilt"}

    # queries, as of now and as of the tag before the purge, in this handle and the other one
    for h in (db, other):
        for as_of in (None, "before"):
            assert "alpha" not in _rows_everywhere(h, as_of)
        assert _ids(h.query("NODES RETURN id")) == {f"beta-n{i}" for i in range(4)} | {"beta-x"}
        assert _ids(h.query("NODES RETURN id AS OF TAG 'before'")) == {f"beta-n{i}" for i in range(4)} | {"beta-x"}
        assert not {i for i in _ids(h.query("FRONTIER RANK BY reward('score') DESC RETURN id")) if "alpha" in i}
        assert _ids(h.query("LINEAGE OF 'beta-x' ANCESTORS RETURN id")) == {"beta-x"}
        for space, v in (("embedding", vec("alpha", 1)), ("sp", vec("alpha", 1, -1.0))):
            found = _ids(h.query(f"RETRIEVE 20 SIMILAR TO $v IN {space} RETURN id", v=v))
            assert found == {f"beta-n{i}" for i in range(4)}, space
        assert not h.query("RETRIEVE 5 MATCHING $w RETURN id", w=mark("alpha", "summary")).to_pylist()
        assert _ids(h.query("RETRIEVE 5 MATCHING $w RETURN id", w=mark("beta", "summary"))) == {
            f"beta-n{i}" for i in range(4)}
        assert not {i for i in _ids(h.query("RETRIEVE 20 MATCHING 'step' RETURN id")) if "alpha" in i}
    other.close()
    # the other session and every commit intact; the audit entry in the log
    for k, q in {"beta_nodes": "SELECT * EXCLUDE (seq) FROM nodes_full_history WHERE session_id = 'beta' "
                 "ORDER BY id, commit_id",
                 "beta_rewards": "SELECT * FROM rewards_history WHERE node_id LIKE 'beta%' "
                 "ORDER BY node_id, channel, commit_id"}.items():
        assert db.sql(q).to_pylist() == before[k]
    log = db.log()
    assert [{"id": c["id"], "message": c["message"]} for c in log[:-1]] == before["commits"]
    audit = log[-1]
    assert audit["message"] == "purge" and audit["id"] == report["commit"] and '"sessions": ["alpha"]' in audit["meta"]
    assert '"nodes": 5' in audit["meta"]
    # views: computed again without alpha; the export naming alpha is gone, beta's stays
    assert all(not any("alpha" in n for n in r["node_ids"]) for r in db.view("all").to_pylist())
    assert db.view("betas").to_pylist() and os.path.isdir(db.export_target("betas"))
    assert not os.path.exists(db.export_target("all"))
    # every file under the store: none holds alpha's markers, each kind of beta's is found
    assert not [f for f in os.listdir(path) if f.startswith("wal-")]
    gone = scan(path, markers("alpha"))
    assert gone == {k: [] for k in gone}, gone
    kept = scan(path, markers("beta"))
    assert all(kept.values()), kept
    assert not indexes_before & _indexes(path)  # every index built before was built again
    assert db.verify() == []
    db.close()
    db = open_local(path)
    assert db.verify() == []
    assert "alpha" not in _rows_everywhere(db, "before") and "alpha" not in _rows_everywhere(db)
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE session_id = 'beta'").to_pylist() == [{"n": 5}]
    db.close()


@pytest.fixture
def two(tmp_path: Path) -> trellisdb.Database:
    db = open_local(tmp_path / "db", embedding_dim=4)
    for sid, task in (("s1", "t1"), ("s2", "t1"), ("s3", "t2")):
        with db.session(task=task, id=sid) as s:
            n = s.add_node(id=f"{sid}-n", summary=mark(sid, "summary"))
            s.add_reward(n, "score", 1.0)
    return db


def test_unknown_session_is_a_clear_error_and_changes_nothing(two: trellisdb.Database) -> None:
    log = two.log()
    with pytest.raises(UnknownSessionError, match=r"unknown session 's4'.*nothing was purged"):
        two.purge(["s1", "s4"])
    with pytest.raises(UnknownSessionError, match="did you mean 's1'"):
        two.purge("s1x")
    with pytest.raises(ValidationError, match="task 'nope' has no sessions"):
        two.purge(task="nope")
    with pytest.raises(ValidationError, match="one of them"):
        two.purge()
    with pytest.raises(ValidationError, match="one of them"):
        two.purge("s1", task="t1")
    assert two.log() == log
    assert two.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 3}]
    two.close()


def test_read_only_handle_refuses(two: trellisdb.Database) -> None:
    two.close()
    ro = open_local(two.path, read_only=True)
    with pytest.raises(ReadOnlyError):
        ro.purge("s1")
    ro.close()


def test_purge_by_task_and_several_sessions(two: trellisdb.Database) -> None:
    r = two.purge(task="t1")
    assert r["sessions"] == ["s1", "s2"] and r["task"] == "t1"
    assert _ids(two.query("NODES RETURN id")) == {"s3-n"}
    assert two.sql("SELECT id FROM tasks ORDER BY id").to_pylist() == [{"id": "t1"}, {"id": "t2"}]  # tasks stay
    assert two.purge(["s3"])["rows"]["nodes"] == 1
    assert two.sql("SELECT count(*) AS n FROM nodes_history").to_pylist() == [{"n": 0}]
    assert two.verify() == []
    two.close()


def test_lost_and_found_copies_are_filtered(two: trellisdb.Database) -> None:
    """A repair's copies of rows (``lost+found/<time>/<table>.parquet``) lose the purged rows too."""
    folder = Path(two.path) / "lost+found" / "20260101T000000Z"
    folder.mkdir(parents=True)
    nodes = two.sql("SELECT * EXCLUDE (seq) FROM nodes_full_history ORDER BY id").to_arrow()
    pq.write_table(nodes, folder / "nodes.parquet")
    pq.write_table(nodes.filter(pc.equal(nodes["session_id"], "s1")), folder / "sessions_only_s1.parquet")
    pq.write_table(two.sql("SELECT * FROM rewards_history WHERE node_id = 's1-n'").to_arrow(), folder / "rewards.parquet")
    r = two.purge("s1")
    assert r["lost_found_rows"] == 2
    assert pq.read_table(folder / "nodes.parquet")["id"].to_pylist() == ["s2-n", "s3-n"]
    assert not (folder / "rewards.parquet").exists()  # nothing left in it
    assert (folder / "sessions_only_s1.parquet").exists()  # not a table's copy: left alone
    two.close()


def test_a_purge_a_crash_interrupted_is_reported_and_finished(two: trellisdb.Database,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    real = storage_purge.remove_rows

    def dies(tables: Any, name: str, *a: Any) -> tuple[int, bool]:
        if name == "nodes":
            raise OSError("killed")
        return real(tables, name, *a)

    monkeypatch.setattr(purge_module, "remove_rows", dies)
    with pytest.raises(OSError, match="killed"):
        two.purge("s1")
    monkeypatch.undo()
    problems = two.verify()
    assert len(problems) == 1 and "purge of sessions ['s1'] began and did not finish" in problems[0]
    # the handle dropped what it mirrored: the rows already gone are gone from its answers too
    assert two.sql("SELECT count(*) AS n FROM rewards_history WHERE node_id = 's1-n'").to_pylist() == [{"n": 0}]
    assert two.sql("SELECT count(*) AS n FROM nodes_history WHERE id = 's1-n'").to_pylist() == [{"n": 1}]
    path = two.path
    two.close()
    db = open_local(path)  # as after a crash: the rewards went, the nodes did not
    assert _ids(db.query("NODES RETURN id")) == {"s1-n", "s2-n", "s3-n"}
    r = db.purge("s2")  # any purge finishes the interrupted one
    assert r["sessions"] == ["s1", "s2"] and r["rows"]["nodes"] == 2
    assert _ids(db.query("NODES RETURN id")) == {"s3-n"}
    assert db.verify() == []
    gone = scan(path, {s: forms(mark(s, "summary")) for s in ("s1", "s2", "s3")})
    assert gone["s1"] == gone["s2"] == [] and gone["s3"]
    with pytest.raises(UnknownSessionError):
        db.purge("s1")  # finished: unknown now
    db.close()


def test_a_purge_that_died_before_its_indexes_is_finished_by_the_next(two: trellisdb.Database,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows all gone, old versions and indexes not yet: running the purge of the (now unknown,
    but pending) session again rebuilds every index and prunes the old versions."""
    path = two.path
    old = set(os.listdir(os.path.join(path, "tables", "nodes.lance", "_indices")))
    assert old  # the full-text index of nodes.summary, made at init

    def dies(ds: Any) -> dict[str, str]:
        raise OSError("killed")

    monkeypatch.setattr(purge_module, "rebuild_indexes", dies)
    with pytest.raises(OSError, match="killed"):
        two.purge("s1")
    monkeypatch.undo()
    assert scan(path, {"s1": forms(mark("s1", "summary"))})["s1"]  # in an old version still
    assert _ids(two.query("NODES RETURN id")) == {"s2-n", "s3-n"}
    r = two.purge("s1")  # unknown now, but its purge is pending: finished
    assert r["sessions"] == ["s1"] and sum(r["rows"].values()) == 0
    assert r["indexes"]["nodes"] == {"summary_idx": "rebuilt"}
    assert not old & set(os.listdir(os.path.join(path, "tables", "nodes.lance", "_indices")))
    assert scan(path, {"s1": forms(mark("s1", "summary"))})["s1"] == []
    assert two.verify() == []
    two.close()


def test_cli_purge_needs_yes(two: trellisdb.Database, capsys: pytest.CaptureFixture[str]) -> None:
    path = two.path
    two.close()
    assert main(["--db", path, "purge", "--session", "s1"]) == 1
    assert "--yes" in capsys.readouterr().err
    assert main(["--db", path, "--read-only", "purge", "--session", "s1", "--yes"]) == 1
    assert "read-only" in capsys.readouterr().err
    assert main(["--db", path, "purge", "--session", "s1", "--session", "s2", "--yes"]) == 0
    out = capsys.readouterr().out
    assert "purged session(s) s1, s2" in out and "nodes 2" in out
    assert main(["--db", path, "purge", "--session", "s1", "--yes"]) == 1
    assert "unknown session 's1'" in capsys.readouterr().err
    assert main(["--db", path, "purge", "--task", "t2", "--yes"]) == 0
    db = open_local(path)
    assert db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist() == [{"n": 0}]
    assert [c["message"] for c in db.log()][-2:] == ["purge", "purge"]
    db.close()
