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
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
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
from trellisdb.storage.lines import encode_line

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
    """A repair's copies of rows in ``lost+found/`` lose the purged rows too, whatever their names:
    the table a Parquet copy holds is told by its name, else by its columns; a file of no kind a
    purge can filter is removed, and the audit commit says so."""
    folder = Path(two.path) / "lost+found" / "20260101T000000Z"
    (folder / "partial").mkdir(parents=True)
    nodes = two.sql("SELECT * EXCLUDE (seq) FROM nodes_full_history ORDER BY id").to_arrow()
    pq.write_table(nodes, folder / "nodes.parquet")
    pq.write_table(nodes.filter(pc.equal(nodes["session_id"], "s1")), folder / "sessions_only_s1.parquet")
    pq.write_table(two.sql("SELECT * FROM rewards_history WHERE node_id = 's1-n'").to_arrow(), folder / "rewards.parquet")
    pq.write_table(two.sql("SELECT * FROM rewards_history").to_arrow(), folder / "partial" / "rewards.17.parquet")
    pq.write_table(two.sql("SELECT id FROM tasks").to_arrow(), folder / "tasks.parquet")  # tasks stay
    (folder / "notes.bin").write_bytes(b"\x00\x01" + mark("s1", "summary").encode())
    (folder / "report.json").write_text(json.dumps({
        "removed": [{"id": 5, "node": "s1-n", "rows": 2}, {"id": 6, "node": "s2-n", "rows": 1}],
        "sessions": ["s1", "s2"], "s1": {"rows": 3}, "note": "commit 5 of session s1 (free text stays)"}))
    record = encode_line({"op": "commit", "id": 9, "session": "s1", "time": 0.0})
    damaged_s1 = b'{"op":"commit","id":10,"session":"s1"}\tdeadbeef\n'
    damaged_other = b'{"op":"commit","id":11,"session":"s2"}\tdeadbeef\n'
    (folder / "commits.log").write_bytes(record + damaged_s1 + damaged_other)
    r = two.purge("s1")
    assert json.loads((folder / "report.json").read_text()) == {
        "removed": [{"id": 6, "node": "s2-n", "rows": 1}], "sessions": ["s2"],
        "note": "commit 5 of session s1 (free text stays)"}
    # the log copy keeps its records (the live log keeps them too); a damaged line naming s1 goes
    assert (folder / "commits.log").read_bytes() == record + damaged_other
    assert r["lost_found_rows"] == 4
    assert pq.read_table(folder / "nodes.parquet")["id"].to_pylist() == ["s2-n", "s3-n"]
    assert not (folder / "rewards.parquet").exists()  # nothing left in it
    assert not (folder / "sessions_only_s1.parquet").exists()  # a copy of nodes (by its columns): all s1's
    assert sorted(pq.read_table(folder / "partial" / "rewards.17.parquet")["node_id"].to_pylist()) == ["s2-n", "s3-n"]
    assert pq.read_table(folder / "tasks.parquet").num_rows == 2
    assert not (folder / "notes.bin").exists()
    audit = json.loads(two.log()[-1]["meta"])["purge"]["lost_found"]
    assert audit["removed"] == [{"file": "20260101T000000Z/notes.bin", "why": "not a kind a purge can filter "
                                 "(Parquet, a WAL segment, a commit log, JSON)"}]
    assert scan(two.path, {"s1": forms(mark("s1", "summary"))})["s1"] == []
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


def _step(db: trellisdb.Database, sid: str, name: str, **extra: Any) -> None:
    """One node of session ``sid`` in its own commit (one WAL frame): every kind of row, each
    carrying the session's markers and the node's name."""
    w = db.resume(sid)
    w.add_node(id=name, summary=f"{mark(sid, 'summary')} {name}-text", state=mark(sid, "state"),
               artifacts={"response": f"{mark(sid, 'response')} {name}"}, attrs={"k": mark(sid, "node-attr")},
               labels=[mark(sid, "label")], embedding=vec(sid, 1), **extra)
    w.add_reward(name, "score", 0.5, verifier=mark(sid, "verifier"))
    db.add_vectors("sp", [name], [vec(sid, 1, -1.0)])  # a vector table's rows: an Arrow IPC part of the frame
    db.flush()


def _flip(data: bytearray, needle: bytes, offset: int, to: bytes) -> None:
    at = data.index(needle) + offset
    assert data[at:at + 1] != to
    data[at:at + 1] = to


def _wal_copies(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("wal-*.log"))


def _copied(folder: Path, column: str) -> dict[str, str]:
    """Per row id of the Parquet copies under ``folder`` that have ``column`` (``id`` or ``node_id``
    first), that column's value."""
    out = {}
    for f in folder.rglob("*.parquet"):
        t = pq.read_table(f)
        key = "id" if "id" in t.column_names else "node_id"
        if column in t.column_names and key in t.column_names:
            out.update(zip(t[key].to_pylist(), t[column].to_pylist(), strict=True))
    return out


def test_purge_reaches_a_repairs_copies_of_a_damaged_wal_segment_and_of_rows(tmp_path: Path) -> None:
    """A repair put in ``lost+found/`` the raw copy of a damaged WAL segment (frames of both
    sessions: whole ones, ones whose rows fail their checksum but still decode, ones past decoding,
    one whose commit record is damaged, and whole ones after it) and Parquet copies of stranded
    rows (of a node the tables no longer hold). After the purge no file under the store holds the
    purged session's bytes; the other session's rows in those copies remain, and the segment copy
    still reads as one."""
    from trellisdb.schema import table_schema
    from trellisdb.storage.wal import Segment

    path = tmp_path / "db"
    db = open_local(path, embedding_dim=4)
    db._committer.checkpoint_delay = 3600.0  # the frames stay in the WAL
    db.create_space("sp", dim=4)
    for sid in SESSIONS:
        with db.session(task="t", id=sid, config={"secret": mark(sid, "config")}) as s:
            s.add_node(id=f"{sid}-root", summary="root")
    db._committer.checkpoint()
    _step(db, "alpha", "alpha-n1")
    _step(db, "beta", "beta-n1", parents=["alpha-root"])  # beta's edge names alpha's node: it goes
    _step(db, "alpha", "alpha-n3")   # its rows will fail their checksum, still decoding
    _step(db, "beta", "beta-n3")    # damaged past decoding, naming no alpha id: kept as it is
    _step(db, "alpha", "alpha-n4")   # damaged past decoding: dropped
    _step(db, "beta", "beta-n4")
    _step(db, "alpha", "alpha-n5")   # its commit record damaged: the frame is no frame
    _step(db, "beta", "beta-n5")    # a whole frame after it
    # stranded rows (a commit no record names: its writer died before its record): repair copies them
    # to lost+found/*.parquet
    doomed = db._store.log.state.max_id + 1
    stranded = {
        "nodes": [{"id": f"{sid}-lost", "session_id": sid, "task_id": "t", "summary": f"{mark(sid, 'summary')} lost",
                   "commit_id": doomed} for sid in SESSIONS],
        "rewards": [{"node_id": f"{sid}-lost", "channel": "score", "value": 1.0,
                     "verifier": mark(sid, "verifier") + "-lost", "commit_id": doomed} for sid in SESSIONS],
    }
    for name, rows in stranded.items():
        db._store.tables.append(name, pa.Table.from_pylist(rows, schema=table_schema(name, 4)))
    [seg] = [p for p in path.iterdir() if p.name.startswith("wal-")]
    data = bytearray(seg.read_bytes())
    _flip(data, b"alpha-n3-text", 0, b"A")               # rows still JSON, failing their checksum
    _flip(data, b'"summary":"' + mark("beta", "summary").encode() + b" beta-n3", 0, b"#")  # JSON no more
    _flip(data, b'"summary":"' + mark("alpha", "summary").encode() + b" alpha-n4", 0, b"#")
    n5 = data.index(b"alpha-n5-text")
    record_end = data.rfind(b"\n", 0, n5)
    data[record_end - 20:record_end - 19] = b"X" if data[record_end - 20:record_end - 19] != b"X" else b"Y"
    seg.write_bytes(bytes(data))

    report = db.repair()
    assert report["damage"] and report["lost_found"]
    lost = Path(report["lost_found"])
    [copy] = [c for c in _wal_copies(lost) if b"beta-n5-text" in c.read_bytes()]  # the damaged segment's copy
    assert _copied(lost, "session_id") == {"alpha-lost": "alpha", "beta-lost": "beta"}  # Parquet copies
    assert (lost / "report.json").is_file()
    alpha, beta = markers("alpha"), markers("beta")
    before = scan(str(lost), {**{f"a-{k}": v for k, v in alpha.items()}, **{f"b-{k}": v for k, v in beta.items()}})
    assert all(before[f"{w}-{k}"] for w in "ab" for k in ("summary", "verifier", "vector", "space-vector"))
    copy_before = copy.read_bytes()

    r = db.purge("alpha")

    # no file under the store holds alpha's bytes: not the tables, not the copies
    gone = scan(str(path), alpha)
    assert gone == {k: [] for k in gone}, gone
    assert scan(str(path), {"lost": forms(mark("alpha", "summary") + " lost")})["lost"] == []
    # beta's rows remain in the copies: the stranded node and reward, every frame of the segment copy
    assert _copied(lost, "session_id") == {"beta-lost": "beta"}
    assert _copied(lost, "channel") == {"beta-lost": "score"}  # alpha-lost's reward went: its node is only here
    assert scan(str(lost), {"b": forms(mark("beta", "verifier") + "-lost")})["b"]
    kept = scan(str(lost), beta)
    assert all(kept[k] for k in ("summary", "node-attr", "label", "state", "verifier", "vector", "space-vector")), kept
    texts = scan(str(lost), {n: forms(f"{mark(n.split('-')[0], 'response')} {n}") for n in (
        "alpha-n1", "alpha-n3", "alpha-n4", "beta-n1", "beta-n4", "beta-n5")})  # artifacts: base64 in a frame
    assert [n for n, found in texts.items() if found] == ["beta-n1", "beta-n4", "beta-n5"], texts
    text = copy.read_bytes()
    for name in ("beta-n1", "beta-n4", "beta-n5"):
        assert f"{mark('beta', 'summary')} {name}-text".encode() in text, name
    assert b'#summary":"' + mark("beta", "summary").encode() + b" beta-n3" in text  # damaged, naming no alpha id
    # the copy is still a segment: its whole frames read, with beta's rows only (beta-n1's edge to alpha is gone)
    seg_after = Segment(str(copy))
    frames = seg_after.read()
    rows = [(t, row) for f in frames for t, rs in f.rows().items() for row in rs]
    # beta-n3's frame fails its checksum still; alpha's damaged record went, so beta-n5's frame reads on
    assert {row["id"] for t, row in rows if t == "nodes"} == {"beta-n1", "beta-n4", "beta-n5"}
    assert rows and all("alpha" not in json.dumps(row, default=str) for _, row in rows)
    assert seg_after.problems  # the frame whose rows failed their checksum fails it still
    from trellisdb.storage.wal import pieces  # (after the scan: the check that fails before the fix)

    copy_frames = [p for p in pieces(copy_before) if p.record is not None]
    after = [p for p in pieces(text) if p.record is not None]
    # every commit record stays (the live log keeps them too); alpha's frames hold no rows now
    assert [p.record["id"] for p in after] == [p.record["id"] for p in copy_frames]
    assert all(p.parts == () for p in after if p.record["session"] == "alpha")
    assert [p.intact for p in after] == [p.intact for p in copy_frames]
    # the audit commit says what it did to the copies
    lf = r["lost_found"]
    assert lf["rows"] == r["lost_found_rows"] > 0 and lf["removed"] == []
    assert os.path.relpath(copy, lost.parent) in {d["file"] for d in lf["dropped"]}
    assert os.path.relpath(copy, lost.parent) in lf["rewritten"]
    assert '"lost_found"' in db.log()[-1]["meta"]
    assert db.verify() == []
    db.close()
