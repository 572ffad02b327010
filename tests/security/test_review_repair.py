"""Adversarial review of repair (issue 35, items 1-2): scenarios that broke the rule that repair
keeps only provable commits, names every acknowledged commit it cannot give back, and that a
healthy store raises no false alarm, also while another process writes (each failed before its fix)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import lance
import pytest

import trellisdb
from trellisdb.storage import log as log_mod
from trellisdb.storage import recovery
from trellisdb.storage.tables import LanceTables

from .test_double_faults import _checkpoint_dies_after, _connect_warned, _open, _steps

# ---------------------------------------------------------------- false alarms under a concurrent writer


def test_open_raises_no_false_alarm_when_a_checkpoint_lands_between_the_log_and_the_segment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store opened while another handle (another process, in real life) checkpoints: the opener
    reads the log before the checkpoint's record, then the WAL segment after the checkpoint
    deleted it (CommitLog._refresh reads the two one after the other; Segment.read takes a missing
    segment for an empty one). Nothing was lost, yet open warns that acknowledged commits are gone and
    that writes are refused, and the handle's first reads miss them. Not a rare window: a read-only
    handle opened in a loop next to tests/writer_process.py (checkpoints every 3 commits) warned on 4
    of 93 opens, and guard.problems() (verify) named the same false loss in 5 of 279 calls."""
    p = tmp_path / "db"
    writer = _open(p)
    _steps(writer, 0, 3)  # WAL commits, not checkpointed
    wlog = writer._store.log
    real = log_mod.CommitLog._refresh_wal
    armed = [True]

    def refresh_wal(self: log_mod.CommitLog) -> None:
        if armed[0] and self is not wlog:
            armed[0] = False
            writer._committer.checkpoint()  # the other writer's whole checkpoint, in the window
        real(self)

    monkeypatch.setattr(log_mod.CommitLog, "_refresh_wal", refresh_wal)
    reader, warned = _connect_warned(p)
    monkeypatch.setattr(log_mod.CommitLog, "_refresh_wal", real)
    assert not armed[0], "the window was never reached"
    assert warned == [], warned
    assert reader.verify() == []


def test_verify_raises_no_false_alarm_when_a_checkpoint_lands_before_the_segments_are_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verify() reads the log, scans the tables, reads the log again, then lists the WAL segments.
    A checkpoint of another writer that finishes in between (the old segment deleted) makes every
    WAL commit it moved look lost: verify names acknowledged commits 'cannot be recovered'."""
    p = tmp_path / "db"
    writer = _open(p)
    _steps(writer, 0, 3)
    real = recovery.WalFiles.read.__func__  # type: ignore[attr-defined]
    armed = [True]

    def read(cls: type[recovery.WalFiles], folder: str) -> recovery.WalFiles:
        if armed[0]:
            armed[0] = False
            writer._committer.checkpoint()
        return real(cls, folder)  # type: ignore[no-any-return]

    checker = trellisdb.connect(p)
    monkeypatch.setattr(recovery.WalFiles, "read", classmethod(read))
    problems = checker.verify()
    assert not armed[0]
    assert problems == [], problems


def test_verify_raises_no_false_alarm_when_a_checkpoint_and_a_commit_land_before_the_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As above, but the writer also commits once after its checkpoint (segment 2 exists) and
    had not deleted segment 1 yet: verify says the log lost the records of segment 1's commits."""
    p = tmp_path / "db"
    writer = _open(p)
    _steps(writer, 0, 3)
    real = recovery.WalFiles.read.__func__  # type: ignore[attr-defined]
    armed = [True]
    keep = writer._committer._remove_old_segments

    def read(cls: type[recovery.WalFiles], folder: str) -> recovery.WalFiles:
        if armed[0]:
            armed[0] = False
            with monkeypatch.context() as m:  # the checkpoint has not deleted segment 1 yet
                m.setattr(writer._committer, "_remove_old_segments", lambda: None)
                writer._committer.checkpoint()
            _steps(writer, 3, 1)
        return real(cls, folder)  # type: ignore[no-any-return]

    checker = trellisdb.connect(p)
    monkeypatch.setattr(recovery.WalFiles, "read", classmethod(read))
    problems = checker.verify()
    assert not armed[0]
    keep()
    assert problems == [], problems


# ---------------------------------------------------------------- an aborted direct commit, then a purge


def _direct_commit_dies_after(db: trellisdb.Database, monkeypatch: pytest.MonkeyPatch, last_table: str) -> None:
    """A big (direct) commit whose writer dies right after its Lance append to ``last_table``:
    ``begin`` logged, some tables' rows in Lance, no commit record."""
    real = LanceTables.append

    def append(self: LanceTables, name: str, data: Any) -> None:
        real(self, name, data)
        if name == last_table:
            raise OSError("simulated kill inside a direct commit")

    db._committer.wal_max_rows = 0  # every commit goes to Lance directly
    with monkeypatch.context() as m:
        m.setattr(LanceTables, "append", append)
        with pytest.raises(trellisdb.TrellisError, match="simulated kill"), db.transaction(message="big"):
            s = db.resume("s")
            nid = s.add_node(id="partial", parents=["n0"], artifacts={"code": "partial"})
            s.add_reward(nid, "score", 42.0)
    db._committer.closed = True  # the writer process is dead


def test_a_purge_after_a_writer_died_in_a_direct_commit_never_makes_that_commit_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer dies inside a big commit (nodes appended, edges and rewards not). Another process
    purges an unrelated session: the purge's audit commit takes an id above the dead commit without
    collecting it first (only ``_commit`` collects aborted commits). From then on the dead commit
    looks 'acknowledged' (below the mark's commit): verify() says repair recovers it, and repair
    writes it a commit record, making a partial commit visible (a node with no parent edge and no
    reward)."""
    p = tmp_path / "db"
    db = _open(p)
    _steps(db, 0, 2)
    other = db.session(id="victim", task="t")
    other.add_node(id="v0")
    db.flush()
    db._committer.checkpoint()
    _direct_commit_dies_after(db, monkeypatch, "nodes")
    del db

    db = trellisdb.connect(p)
    assert db.verify() == []
    db.purge("victim")
    problems = db.verify()
    report = db.repair()
    nodes = db.sql("SELECT id FROM nodes WHERE id = 'partial'").to_pylist()
    assert nodes == [], "a partial commit was made visible"
    assert report["recovered"] == [], report
    assert problems == [], problems


def test_verify_raises_no_false_alarm_when_a_writer_collects_an_aborted_commit_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer died inside a big commit (its rows partly in Lance, its ``begin`` logged). verify()
    in one process scans the tables; meanwhile another process's next commit collects the dead
    commit (deletes its rows, logs ``collected``); verify then reads the log again and takes the
    rows it saw for rows still to be taken out: 'commit(s) N were never acknowledged: repair moves
    their rows to lost+found/', on a store that is healthy."""
    p = tmp_path / "db"
    db = _open(p)
    _steps(db, 0, 2)
    db._committer.checkpoint()
    _direct_commit_dies_after(db, monkeypatch, "nodes")
    del db
    writer = _open(p)
    checker = trellisdb.connect(p)
    assert checker.verify() == []
    real = recovery.scan_unlogged
    armed = [True]

    def scan(*args: Any, **kwargs: Any) -> dict[int, recovery.Unlogged]:
        out = real(*args, **kwargs)
        if armed[0]:
            armed[0] = False
            _steps(writer, 2, 1)  # the other process's next commit, right after the scan
        return out

    monkeypatch.setattr(recovery, "scan_unlogged", scan)
    problems = checker.verify()
    assert not armed[0]
    assert problems == [], problems


# ---------------------------------------------------------------- a damaged last WAL frame


def test_a_damaged_last_wal_frame_is_named_as_damaged_and_kept_in_lost_found(tmp_path: Path) -> None:
    """One bit of the last WAL frame's rows flips (the writer died; the frame is whole and was
    acknowledged). The segment reader takes a bad checksum on the last frame for a torn append, so
    repair says 'no WAL frame or row of it is left', copies nothing of the segment to lost+found/
    (rewrite_wal copies only a segment with damage in the middle), and the next commit's
    repair_tail cuts the frame off: the acknowledged commit's rows are gone from every copy."""
    p = tmp_path / "db"
    db = _open(p)
    acked = _steps(db, 0, 3)
    db._committer.closed = True
    del db
    seg = p / "wal-00000001.log"
    data = bytearray(seg.read_bytes())
    data[-3] ^= 0x01  # inside the last frame's payload
    seg.write_bytes(bytes(data))
    last = max(acked)

    db, warned = _connect_warned(p)
    assert warned
    report = db.repair()
    assert report["unrecoverable"] == [last], report
    folder = Path(report["lost_found"])
    why = report["lost"][str(last)]
    with db.transaction():
        db.resume("s").add_node(id="after", parents=["n1"])
    kept = [f for f in folder.iterdir() if f.name.startswith("wal-")]
    assert kept, f"nothing of the damaged frame of commit {last} was kept in {folder}: {sorted(os.listdir(folder))}"
    assert "damaged" in why, why


# ---------------------------------------------------------------- a checkpoint that skips the row check


def test_a_checkpoint_after_a_lost_checkpoint_begin_and_no_mark_never_doubles_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint killed after its nodes and edges appends; its checkpoint-begin line (the log's
    last) is damaged and the mark is gone (damaged or deleted: read as none). Open warns of nothing;
    closing the store checkpoints: checkpoint() takes no row check (only _commit and purge call
    check_rows), the log says no checkpoint began, so the rows the dead one left are not deleted and
    every node and edge of the WAL is appended a second time. verify() stays clean, and the
    current ``nodes`` view shows none of the three nodes (a kill plus two damages: the line, the mark)."""
    p = tmp_path / "db"
    db = _open(p)
    _steps(db, 0, 3)
    _checkpoint_dies_after(db, monkeypatch, "edges")
    db._committer.closed = True
    del db
    log = p / "commits.log"
    lines = log.read_bytes().splitlines(keepends=True)
    assert b"checkpoint-begin" in lines[-1]
    last = bytearray(lines[-1])
    last[5] ^= 0x5A
    log.write_bytes(b"".join([*lines[:-1], bytes(last)]))
    (p / "commits.hwm").write_bytes(b"x" * 202)  # a damaged mark: read as none

    db, warned = _connect_warned(p)
    db.close()  # flush + checkpoint
    ids = lance.dataset(str(p / "tables" / "nodes.lance")).to_table(columns=["id", "commit_id"]).to_pylist()
    again = trellisdb.connect(p)
    assert warned == [] and again.verify() == []  # nothing says anything is wrong ...
    # ... yet every node row is there twice, and the current view shows no node at all
    assert again.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 3}]
    assert len({(r["id"], r["commit_id"]) for r in ids}) == len(ids), f"node rows doubled: {sorted(r['id'] for r in ids)}"


# ---------------------------------------------------------------- a repair while another process has the store open


def test_a_process_open_during_a_repair_that_rewrote_the_wal_sees_later_commits(tmp_path: Path) -> None:
    """Process B has the store open (it wrote four WAL commits). A frame in the middle of the
    segment is damaged; process A repairs (drops the frame, retires its id: only *appends* records to
    the log, so B was not told to open again) and commits once more. B's WAL reader kept its byte
    offset into the segment that the repair replaced with a shorter one: B never saw A's commit,
    still served the retired commit, and its next write was refused with a false 'lost records'.
    Now B is told, as for a replaced log, and a new handle sees the repaired store."""
    p = tmp_path / "db"
    b = _open(p)
    acked = _steps(b, 0, 4)
    seg = p / "wal-00000001.log"
    data = bytearray(seg.read_bytes())
    starts = [i for i in range(len(data)) if data.startswith(b'{"bytes":', i)]
    header = data.index(b"\n", starts[2])
    retired = int(json.loads(bytes(data[starts[2]:header]).split(b"\t")[0])["id"])  # the third frame's commit
    assert retired in acked
    data[header + 5] ^= 0x01  # inside its rows
    seg.write_bytes(bytes(data))

    a = _open(p)
    report = a.repair()
    assert report["unrecoverable"] == [retired], report
    with a.transaction() as tx:
        a.resume("s").add_node(id="byA", parents=["n0"])
    a._committer.closed = True
    assert tx.commit_id is not None
    fresh = trellisdb.connect(p)
    assert fresh.verify() == []
    # B is told its WAL segment was replaced (as a replaced log is told): it must open the store again
    with pytest.raises(trellisdb.CorruptionError, match=r"replaced.*open the database again"):
        b.sql("SELECT id FROM nodes").to_pylist()
    b._committer.closed = True
    b = trellisdb.connect(p)
    seen = {r["id"] for r in b.sql("SELECT id FROM nodes").to_pylist()}
    assert "byA" in seen, f"B never sees commit {tx.commit_id}"
    assert acked[retired] not in seen, f"B still serves commit {retired}, which the repair retired"
    with b.transaction():  # a healthy store: B's write goes through
        b.resume("s").add_node(id="byB", parents=["n0"])
