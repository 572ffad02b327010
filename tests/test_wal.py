"""The write-ahead log: small commits durable in one fsynced frame, read next to Lance, checkpointed.

Every answer must be the same whether a commit's rows are still in the WAL or already in
Lance, in this handle, a second handle and a read-only one; damage to the WAL is found; a
checkpoint that dies half-way changes no answer and is finished by the next one.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import pytest

import trellisdb
from trellisdb.errors import TrellisWarning
from trellisdb.storage import wal
from trellisdb.storage.tables import LanceTables

Q = {
    "nodes": "SELECT id, status FROM nodes ORDER BY id",
    "history": "SELECT id, commit_id FROM nodes_history ORDER BY id, commit_id",
    "rewards": "SELECT node_id, channel, value FROM rewards ORDER BY node_id, channel",
    "artifacts": "SELECT hash, content FROM artifacts_full ORDER BY hash",
    "edges": "SELECT src, dst FROM edges ORDER BY src, dst",
}


def _segments(p: Path) -> list[str]:
    return sorted(f for f in os.listdir(p) if f.startswith("wal-"))


def _write(db: trellisdb.Database, n: int = 6) -> list[int]:
    s = db.session(id="s", task="t")
    cids, prev = [], None
    for i in range(n):
        with db.transaction() as tx:
            nid = s.add_node(id=f"n{i}", parents=[prev] if prev else [], artifacts={"code": f"x = {i}"})
            s.add_reward(nid, "score", float(i))
            if i % 3 == 2:
                s.set_status(f"n{i - 1}", "expanded")
                s.add_reward(f"n{i - 1}", "score", 10.0 + i)  # supersedes
        assert tx.commit_id is not None
        cids.append(tx.commit_id)
        prev = nid
    return cids


def _answers(db: trellisdb.Database, cids: list[int]) -> dict[tuple[int, str], Any]:
    out = {}
    for c in cids:
        for name, q in Q.items():
            out[(c, name)] = db.sql(q, as_of=c).to_pylist()
        out[(c, "frontier")] = db.query(f"FRONTIER RANK BY reward('score') DESC RETURN id "
                                        f"AS OF COMMIT {c}").to_pylist()
    return out


def test_as_of_a_commit_still_in_the_wal_answers_as_after_the_checkpoint(tmp_path: Path) -> None:
    p = tmp_path / "db"
    db = trellisdb.connect(p, embedding_dim=4)
    db._committer.checkpoint_delay = 3600.0  # nothing checkpoints on its own during the test
    cids = _write(db)
    assert db._store.log.state.wal.upto < cids[0]  # every commit is still in the WAL
    other = trellisdb.connect(p)  # another handle (as another process would) reads the WAL
    plain = trellisdb.connect(p, mirror=False, read_only=True)  # views over Lance scans + the WAL
    before = {name: _answers(h, cids) for name, h in (("db", db), ("other", other), ("plain", plain))}
    assert before["db"] == before["other"] == before["plain"]
    assert before["db"][(cids[0], "nodes")] == [{"id": "n0", "status": "pending"}]
    assert before["db"][(cids[2], "rewards")][1] == {"node_id": "n1", "channel": "score", "value": 12.0}
    assert db._committer.checkpoint() == len(cids) + 1  # and the session's commit
    assert _segments(p) == []  # the old segment is gone; the next commit starts a new one
    assert db._store.log.state.wal.upto == cids[-1]
    for name, h in (("db", db), ("other", other), ("plain", plain)):
        assert _answers(h, cids) == before[name], name
    # the rows are in Lance exactly once
    assert db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist() == [{"n": 6 + 2}]
    _write_more = db.session(id="s2", task="t")
    _write_more.add_node(id="late")
    db.flush()
    assert _segments(p) == ["wal-00000002.log"]
    assert other.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 7}]
    assert db.verify() == []
    for h in (db, other, plain):
        h.close()


def test_a_small_commit_costs_one_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    db._committer.checkpoint_delay = 3600.0
    s = db.session(id="s", task="t")
    with db.transaction():
        s.add_node(id="first")  # creates the segment (and syncs the folder once)
    calls: list[str] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "fdatasync", lambda fd: (calls.append("fdatasync"), real_fdatasync(fd))[1])
    with db.transaction():
        n = s.add_node(parents=["first"], artifacts={"code": "print(1)"})
        s.add_reward(n, "score", 1.0)
    assert calls == ["fsync"]
    monkeypatch.undo()
    db.close()


def test_a_torn_frame_is_ignored_then_cut_and_a_lost_frame_is_named(tmp_path: Path) -> None:
    p = tmp_path / "db"
    db = trellisdb.connect(p, embedding_dim=4)
    db._committer.checkpoint_delay = 3600.0
    cids = _write(db, 3)
    db._committer.closed = True  # a writer that dies: no checkpoint at close
    del db
    seg = p / _segments(p)[0]
    whole = seg.read_bytes()
    _rec, frame = wal.encode({"op": "commit", "id": 99, "time": 0.0}, wal.Payload.of({"tasks": [{"id": "x" * 400}]}))
    with open(seg, "ab") as fh:
        fh.write(frame[: len(frame) - 100])  # an append torn by a crash
    again = trellisdb.connect(p)
    assert [c["id"] for c in again.log()][-3:] == cids
    assert again.verify() == []
    s = again.resume("s")
    s.add_node(id="after")
    cid = again.flush()
    assert cid == cids[-1] + 1  # the torn frame's id was never acknowledged: it is reused
    assert again.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 4}]
    again.close()
    # the last acknowledged frame lost (a cut copy): named at open, writes refused until repair
    p2 = tmp_path / "db2"
    db = trellisdb.connect(p2, embedding_dim=4)
    db._committer.checkpoint_delay = 3600.0
    cids = _write(db, 3)
    db._committer.closed = True
    del db
    seg = p2 / _segments(p2)[0]
    data = seg.read_bytes()
    seg.write_bytes(data[: data.rfind(b'{"bytes":')])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hurt = trellisdb.connect(p2)
    assert any(issubclass(w.category, TrellisWarning) and "lost records" in str(w.message) for w in caught)
    assert [c["id"] for c in hurt.log()][-1] == cids[-2]
    with pytest.raises(trellisdb.CorruptionError, match="repair"), hurt.transaction():
        hurt.resume("s").add_node(id="refused")
    hurt.repair()
    assert hurt.verify() == []
    assert whole  # (the first store's frames were whole before the torn append)


def test_a_damaged_frame_in_the_middle_is_reported(tmp_path: Path) -> None:
    p = tmp_path / "db"
    db = trellisdb.connect(p, embedding_dim=4)
    db._committer.checkpoint_delay = 3600.0
    _write(db, 4)
    db._committer.closed = True
    del db
    seg = p / _segments(p)[0]
    data = bytearray(seg.read_bytes())
    second = data.find(b'{"bytes":', 10)
    data[data.find(b"\n", second) + 50] ^= 0x55  # inside the second frame's rows
    seg.write_bytes(bytes(data))
    hurt = trellisdb.connect(p)
    problems = hurt.verify()
    assert any("wal-00000001.log" in x and "checksum" in x for x in problems), problems
    assert hurt.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 3}]  # the frames after it are read
    with pytest.raises(trellisdb.CorruptionError, match="damaged"), hurt.transaction():
        hurt.resume("s").add_node(id="refused")
    report = hurt.repair()
    assert report["wal_frames_dropped"] == 1 and os.path.exists(os.path.join(report["lost_found"], seg.name))
    assert hurt.verify() == []
    with hurt.transaction():
        hurt.resume("s").add_node(id="after-repair")
    assert sorted(r["id"] for r in hurt.sql("SELECT id FROM nodes").to_pylist()) == ["after-repair", "n1", "n2", "n3"]


def test_a_checkpoint_that_dies_half_way_changes_no_answer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "db"
    db = trellisdb.connect(p, embedding_dim=4)
    db._committer.checkpoint_delay = 3600.0
    cids = _write(db)
    before = _answers(db, cids)
    real = LanceTables.append

    def dies_after_nodes(self: LanceTables, name: str, data: Any) -> None:
        real(self, name, data)
        if name == "nodes":
            raise OSError("simulated crash inside a checkpoint")

    with monkeypatch.context() as m:
        m.setattr(LanceTables, "append", dies_after_nodes)
        with pytest.raises(OSError, match="simulated"):
            db._committer.checkpoint()
    # Lance holds some of the WAL's rows now, without their commit records: no answer changes
    other = trellisdb.connect(p)
    assert _answers(db, cids) == before
    assert _answers(other, cids) == before
    assert db._committer.checkpoint() == len(cids) + 1  # removes the stray rows first
    assert _answers(db, cids) == before
    assert _answers(trellisdb.connect(p, mirror=False), cids) == before
    assert db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist() == [{"n": 8}]
    assert db.verify() == []


def test_a_frame_whose_sync_fails_is_cut_off_and_never_seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    db._committer.checkpoint_delay = 3600.0
    s = db.session(id="s", task="t")
    with db.transaction():
        s.add_node(id="kept")
    real = os.fsync
    calls = []

    def failing(fd: int) -> None:  # the frame's sync fails; the sync after cutting it off works
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(trellisdb.CommitError, match="Input/output"), db.transaction():
        s.add_node(id="lost", parents=["kept"])
    monkeypatch.setattr(os, "fsync", real)
    other = trellisdb.connect(tmp_path / "db")  # reads the segment from its start
    assert other.sql("SELECT id FROM nodes ORDER BY id").to_pylist() == [{"id": "kept"}]
    with db.transaction():
        s.add_node(id="after", parents=["kept"])
    assert sorted(r["id"] for r in other.sql("SELECT id FROM nodes").to_pylist()) == ["after", "kept"]
    assert db.verify() == []
    db.close()


def test_retrieve_reads_vectors_still_in_the_wal_without_a_checkpoint(tmp_path: Path) -> None:
    """Vectors of commits not yet checkpointed are searched exactly next to Lance's: the same
    answers before and after the checkpoint, in the writer (which checkpoints nothing for it)
    and in a read-only handle; AS OF an older commit hides the newer vectors."""
    import numpy as np

    p = tmp_path / "db"
    db = trellisdb.connect(p, embedding_dim=8)
    db._committer.checkpoint_delay = 3600.0
    rng = np.random.default_rng(3)
    s = db.session(id="s", task="t")
    vecs = rng.standard_normal((60, 8)).astype(np.float32)
    with db.transaction() as first:
        for i in range(30):
            s.add_node(id=f"a{i}", embedding=vecs[i])
    db._committer.checkpoint()  # the first half in Lance, the second in the WAL
    for i in range(30, 60):
        with db.transaction():
            s.add_node(id=f"a{i}", parents=[f"a{i - 30}"], embedding=vecs[i])
    s.set_status("a35", "expanded")  # a second version of a row in the WAL
    db.flush()
    frames = db._store.log.state.wal.n_frames
    assert frames >= 30
    ro = trellisdb.connect(p, read_only=True)
    queries = ["RETRIEVE 5 SIMILAR TO $q RETURN id, distance",
               "RETRIEVE 5 SIMILAR TO $q WHERE status = 'expanded' RETURN id",
               "RETRIEVE 3 SIMILAR TO $q EXPAND LINEAGE 1 RETURN id, relation",
               f"RETRIEVE 5 SIMILAR TO $q RETURN id AS OF COMMIT {first.commit_id}"]
    qs = [vecs[40] + 0.01, vecs[5] + 0.01, vecs[35]]

    def answers(h: trellisdb.Database) -> list[Any]:  # distances to float32 precision (numpy vs Lance)
        return [[{k: round(v, 5) if k == "distance" else v for k, v in r.items()}
                 for r in h.query(text, q=q.tolist()).to_pylist()] for text in queries for q in qs]

    before = answers(db)
    assert db._store.log.state.wal.n_frames == frames  # no checkpoint was needed
    assert before[0][0]["id"] == "a40" and abs(before[0][0]["distance"]) < 1e-3
    assert before[1 * 3 + 2] == [{"id": "a35"}]  # the WHERE sees the status change still in the WAL
    assert before[3 * 3] and all(int(r["id"][1:]) < 30 for r in before[3 * 3])  # AS OF the first commit
    assert answers(ro) == before
    db._committer.checkpoint()
    assert answers(db) == before
    assert answers(trellisdb.connect(p, read_only=True)) == before
    db.close()


def test_pieces_reads_a_damaged_copy_whole_and_past_its_damage(tmp_path: Path) -> None:
    """``pieces`` (a purge's reading of a repair's segment copy) covers every byte, finds every
    frame the damage did not touch (after a damaged record line too, where ``Segment`` stops), and
    never a frame that was not written; ``frame_bytes`` writes a frame ``Segment`` reads back."""
    import random

    from trellisdb.storage.wal import Payload, Segment, frame_bytes, pieces

    seg = Segment(str(tmp_path / "wal-00000001.log"))
    spans = []
    for i in range(6):
        start = seg.offset
        rows = {"nodes": [{"id": f"n{i}-{k}", "summary": "x" * (20 * k)} for k in range(i + 1)]}
        seg.append({"op": "commit", "id": i + 1, "time": 0.0, "meta": {"k": {"i": i}}}, Payload.of(rows))
        spans.append((start, seg.offset))
    data = (tmp_path / "wal-00000001.log").read_bytes()
    assert [p.record["id"] for p in pieces(data) if p.record] == [1, 2, 3, 4, 5, 6]
    rng = random.Random(5)
    for _ in range(300):
        bad = bytearray(data)
        at = rng.randrange(len(bad))
        bad[at] ^= 1 << rng.randrange(8)
        got = pieces(bytes(bad))
        assert b"".join(p.raw for p in got) == bytes(bad)
        whole = {p.record["id"] for p in got if p.record is not None and p.intact}
        untouched = {i + 1 for i, (a, b) in enumerate(spans) if not a <= at < b}
        assert whole == untouched, (at, whole, untouched)
    cut = pieces(data[: spans[3][0] + 10])  # a frame cut short at the end
    assert [p.record["id"] for p in cut if p.record] == [1, 2, 3] and cut[-1].record is None
    p = pieces(data)[2]
    assert p.record is not None
    again = frame_bytes(p.record, [(n, f, b) for n, f, b in p.parts if n != "nodes"])
    (tmp_path / "x.log").write_bytes(again)
    [read] = Segment(str(tmp_path / "x.log")).read()
    assert read.id == 3 and read.rows() == {}
    damaged = frame_bytes(p.record, p.parts, intact=False)
    (tmp_path / "y.log").write_bytes(damaged + data[spans[3][0]:spans[3][1]])
    s = Segment(str(tmp_path / "y.log"))
    assert [f.id for f in s.read()] == [4] and s.problems  # a damaged frame stays damaged
