"""Two faults at once: a checkpoint's records damaged or cut, a checkpoint killed half-way and
then the WAL's last frame lost. Repair keeps only commits whose every row it can prove (their
WAL frame, or a finished checkpoint), never moves the checkpoint mark past frames it has not
checkpointed, and names, with the reason, each acknowledged commit it cannot give back (its
rows kept in lost+found/) — never silently.
"""

from __future__ import annotations

import os
import warnings
import zlib
from pathlib import Path
from typing import Any

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trellisdb
from trellisdb.errors import TrellisWarning
from trellisdb.schema import DATA_TABLES
from trellisdb.storage.log import HWM_FILE, read_hwm
from trellisdb.storage.tables import LanceTables


def _open(path: Path) -> trellisdb.Database:
    db = trellisdb.connect(path, embedding_dim=4, auto_compact=False)
    db._committer.checkpoint_delay = 3600.0  # checkpoints only when the test says
    return db


def _steps(db: trellisdb.Database, first: int, n: int, after: str | None = None) -> dict[int, str]:
    """``n`` acknowledged commits, each a node with an artifact, an edge to the one before (the
    first to ``after``, default the node before it) and a reward; {commit id: node id}."""
    s = db.resume("s") if db.sql("SELECT 1 FROM sessions WHERE id = 's'").to_pylist() else db.session(id="s", task="t")
    out = {}
    for i in range(first, first + n):
        with db.transaction(message=f"step {i}") as tx:
            parent = (after or f"n{i - 1}") if i == first else f"n{i - 1}"
            nid = s.add_node(id=f"n{i}", parents=[parent] if i else [], artifacts={"code": f"x = {i}"})
            s.add_reward(nid, "score", float(i))
        assert tx.commit_id is not None
        out[tx.commit_id] = nid
    return out


def _die(db: trellisdb.Database) -> None:
    """The writer process dies: nothing is flushed or checkpointed at close."""
    db._committer.closed = True


def _connect_warned(path: Path) -> tuple[trellisdb.Database, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        db = trellisdb.connect(path)
    return db, [str(w.message) for w in caught if issubclass(w.category, TrellisWarning)]


def _whole(db: trellisdb.Database) -> dict[str, dict[str, Any]]:
    """Per node: its commit, reward, parent and artifact, as the current views say."""
    rows = db.sql(
        "SELECT n.id, n.commit_id, r.value, e.src, a.hash FROM nodes n "
        "LEFT JOIN rewards r ON r.node_id = n.id LEFT JOIN edges e ON e.dst = n.id "
        "LEFT JOIN node_artifacts a ON a.node_id = n.id ORDER BY n.id"
    ).to_pylist()
    return {r["id"]: r for r in rows}


def _assert_whole(db: trellisdb.Database, acked: dict[int, str], lost: frozenset[int] = frozenset()) -> None:
    """Every acknowledged commit not in ``lost`` is back under its own id with all its rows."""
    got = _whole(db)
    for cid, nid in acked.items():
        if cid in lost:
            assert nid not in got, (cid, nid)
            continue
        r = got.get(nid)
        assert r is not None, f"acknowledged commit {cid} ({nid}) is lost"
        i = int(nid[1:])
        assert (r["commit_id"], r["value"], r["src"] is not None or i == 0, r["hash"] is not None) == (
            cid, float(i), True, True), r
    assert len(got) == len(acked) - len(lost)


def _physical_ids(path: Path) -> dict[str, list[int]]:
    return {n: lance.dataset(str(path / "tables" / f"{n}.lance")).to_table(columns=["commit_id"])
            .column("commit_id").to_pylist() for n in DATA_TABLES}


def _no_stray_rows(db: trellisdb.Database, path: Path) -> None:
    """After a checkpoint: every physical row belongs to a logged commit, no row is there twice,
    no commit is also logged as collected (aborted)."""
    st = db._store.log.refresh()
    assert not st.collected & set(st.commits), sorted(st.collected & set(st.commits))
    for name, ids in _physical_ids(path).items():
        assert set(ids) <= set(st.commits), (name, set(ids) - set(st.commits))
    nodes = lance.dataset(str(path / "tables" / "nodes.lance")).to_table(columns=["id", "commit_id"]).to_pylist()
    assert len({(r["id"], r["commit_id"]) for r in nodes}) == len(nodes), "a node row was written twice"


def _damage_last_line(log: Path, how: str) -> None:
    lines = log.read_bytes().splitlines(keepends=True)
    if how == "flip":
        last = bytearray(lines[-1])
        last[5] ^= 0x5A
        log.write_bytes(b"".join([*lines[:-1], bytes(last)]))
    elif how == "cut-mid-line":
        data = b"".join(lines)
        log.write_bytes(data[: len(data) - len(lines[-1]) // 2])
    elif how == "cut-line":
        log.write_bytes(b"".join(lines[:-1]))
    elif how == "cut-3-lines":  # the checkpoint record and the last commit records of its write
        log.write_bytes(b"".join(lines[:-3]))
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["flip", "cut-mid-line", "cut-line", "cut-3-lines"])
@pytest.mark.parametrize("segment_left", [False, True])
def test_a_damaged_checkpoint_record_loses_no_commit_of_the_next_segment(
    tmp_path: Path, how: str, segment_left: bool
) -> None:
    """The log's last line is the checkpoint record that started WAL segment 2; it is damaged or
    cut (with the commit records before it, in one case) while segment 2 holds acknowledged
    commits. Before: repair declared them unrecoverable, and they came back later with no rows."""
    p = tmp_path / "db"
    db = _open(p)
    acked = _steps(db, 0, 5)
    old = (p / "wal-00000001.log").read_bytes()
    assert db._committer.checkpoint() == 6  # the session's commit and the five steps
    acked |= _steps(db, 5, 4)
    _die(db)
    del db
    assert sorted(f for f in os.listdir(p) if f.startswith("wal-")) == ["wal-00000002.log"]
    if segment_left:  # the checkpoint died after its record, before it deleted the old segment
        (p / "wal-00000001.log").write_bytes(old)
    _damage_last_line(p / "commits.log", how)

    db, warned = _connect_warned(p)
    assert warned and "wal-00000002.log" in warned[0], warned
    assert any("wal-00000002.log" in x for x in db.verify())
    with pytest.raises(trellisdb.CorruptionError, match="repair"), db.transaction():
        db.resume("s").add_node(id="refused")
    report = db.repair()
    assert report["unrecoverable"] == [] and report["lost"] == {}, report
    assert report["wal_segment"] == 2
    if how == "cut-3-lines":  # commit records the log lost: from the frames, or proven by segment 2
        assert {r["id"] for r in report["recovered"]} == set(sorted(acked)[3:5]), report
    assert db.verify() == []
    _assert_whole(db, acked)
    assert db.log()[-1]["id"] == max(acked)
    st = db._store.log.refresh()
    assert not st.collected & set(st.commits), "a live commit was retired as collected"
    # writes go on after the repair; the next checkpoint moves segment 2; nothing comes back empty
    acked |= _steps(db, 9, 2)
    assert db._committer.checkpoint() == 6
    _assert_whole(db, acked)
    _no_stray_rows(db, p)
    assert db.verify() == []
    db.close()
    again = trellisdb.connect(p)
    _assert_whole(again, acked)
    log = {c["id"]: c["message"] for c in again.log()}
    assert set(acked) <= set(log)
    recovered = {r["id"]: r["from"] for r in report["recovered"]}
    for cid in acked:  # a commit's own record (message included) came back unless only its rows were left
        assert log[cid] == (f"step {int(acked[cid][1:])}" if recovered.get(cid) != "rows" else
                            "recovered by repair: the log had lost this commit's record"), (cid, log[cid])
    assert ("rows" in recovered.values()) == (how == "cut-3-lines" and not segment_left)


def _checkpoint_dies_after(db: trellisdb.Database, monkeypatch: pytest.MonkeyPatch, last_table: str) -> None:
    """A checkpoint killed after its append to ``last_table`` (the tables after it never appended)."""
    real = LanceTables.append

    def append(self: LanceTables, name: str, data: Any) -> None:
        real(self, name, data)
        if name == last_table:
            raise OSError("simulated kill inside a checkpoint")

    with monkeypatch.context() as m:
        m.setattr(LanceTables, "append", append)
        with pytest.raises(OSError, match="simulated kill"):
            db._committer.checkpoint()


def _killed_in_a_checkpoint(p: Path, monkeypatch: pytest.MonkeyPatch, n: int) -> dict[int, str]:
    """A store at ``p`` with ``n`` acknowledged steps in the WAL, whose writer was killed inside a
    checkpoint after its nodes and edges appends; the steps written."""
    db = _open(p)
    acked = _steps(db, 0, n)
    _checkpoint_dies_after(db, monkeypatch, "edges")
    _die(db)
    return acked


def test_a_checkpoint_killed_half_way_then_a_lost_frame_keeps_every_other_commit_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nodes and edges of a checkpoint appended, rewards not, the writer killed; then the WAL's last
    frame is lost. Before: repair 'recovered' that commit from its partial rows, wrote its record
    (moving the checkpoint mark past every earlier frame) and the earlier commits lost their rewards,
    with verify clean."""
    p = tmp_path / "db"
    acked = _killed_in_a_checkpoint(p, monkeypatch, 5)
    seg = p / "wal-00000001.log"
    data = seg.read_bytes()
    seg.write_bytes(data[: data.rfind(b'{"bytes":')])  # the last frame lost (a copy cut short)
    last = max(acked)

    db, warned = _connect_warned(p)
    assert warned
    problems = db.verify()
    named = [x for x in problems if f"commit {last} was acknowledged and cannot be recovered" in x]
    assert named and "checkpoint that did not finish" in named[0], problems
    with pytest.raises(trellisdb.CorruptionError, match="repair"), db.transaction():
        db.resume("s").add_node(id="refused")
    report = db.repair()
    assert report["unrecoverable"] == [last] and "WAL frame is gone" in report["lost"][str(last)], report
    assert report["recovered"] == []
    kept = pq.read_table(Path(report["lost_found"]) / "nodes.parquet")
    assert kept.column("id").to_pylist() == [acked[last]] and kept.column("commit_id").to_pylist() == [last]
    assert db.verify() == []
    _assert_whole(db, acked, lost=frozenset({last}))
    # the mark did not move: the earlier commits are still read from the WAL, whole
    assert db._store.log.state.lance_upto < min(acked)
    acked |= _steps(db, 5, 2, after="n3")
    db._committer.checkpoint()
    _assert_whole(db, acked, lost=frozenset({last}))
    _no_stray_rows(db, p)
    assert db.verify() == []
    assert last not in {c["id"] for c in db.log()}  # the lost id is retired, never used again
    assert trellisdb.connect(p).sql("SELECT count(*) AS n FROM rewards").to_pylist() == [{"n": len(acked) - 1}]


@pytest.mark.parametrize("how", ["flip", "cut-line"])
def test_a_damaged_checkpoint_begin_record_never_doubles_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A checkpoint killed half-way, then its ``checkpoint-begin`` line (the log's last) damaged: the
    next checkpoint would not know to delete the rows it left, and would write them twice."""
    p = tmp_path / "db"
    acked = _killed_in_a_checkpoint(p, monkeypatch, 4)
    assert b"checkpoint-begin" in (p / "commits.log").read_bytes().splitlines()[-1]
    _damage_last_line(p / "commits.log", how)
    db, warned = _connect_warned(p)
    assert warned and "checkpoint" in warned[0], warned
    report = db.repair()
    assert report["unrecoverable"] == [] and report["recovered"] == [], report
    _assert_whole(db, acked)
    assert db._committer.checkpoint() == len(acked) + 1
    _no_stray_rows(db, p)
    _assert_whole(db, acked)
    assert db.verify() == []


def test_the_mark_carries_the_checkpoints_and_reads_a_version_1_mark(tmp_path: Path) -> None:
    p = tmp_path / "db"
    db = _open(p)
    _steps(db, 0, 3)
    db._committer.checkpoint()
    _steps(db, 3, 2)
    st = db._store.log.refresh()
    mark = read_hwm(str(p / HWM_FILE))
    assert mark is not None
    assert (mark.id, mark.upto, mark.ckpt, mark.wal) == (st.last_committed, st.lance_upto, st.checkpoint_begun, 2)
    db.close()
    # a store whose mark an earlier release wrote: nothing is known of its checkpoints, no alarm
    st = trellisdb.connect(p)._store.log.refresh()
    body = (f"trellis-hwm 1 id={st.last_committed} time={mark.time!r} begun={st.max_id} "
            f"log_size={os.path.getsize(p / 'commits.log')}").ljust(128)
    (p / HWM_FILE).write_bytes(f"{body}\t{zlib.crc32(body.encode()) & 0xFFFFFFFF:08x}\n".encode())
    decoded = read_hwm(str(p / HWM_FILE))
    assert decoded is not None and decoded.upto is None and decoded.id == st.last_committed
    again, warned = _connect_warned(p)
    assert warned == [] and again.verify() == []
    with again.transaction():
        again.resume("s").add_node(id="after")
    new = read_hwm(str(p / HWM_FILE))
    assert new is not None and new.upto is not None  # the next commit writes a version-2 mark


def test_ids_a_repair_skips_are_never_called_lost(tmp_path: Path) -> None:
    """A stranded row of a far-off id (1000) is taken out and its id retired: the next commit takes
    1001, and the ids in between, never used, are not 'acknowledged and lost' (verify stays clean)."""
    p = tmp_path / "db"
    db = _open(p)
    _steps(db, 0, 2)
    db._committer.checkpoint()
    row = lance.dataset(str(p / "tables" / "tasks.lance")).to_table()
    row = row.set_column(row.schema.get_field_index("commit_id"), "commit_id", pa.array([1000] * row.num_rows, pa.int64()))
    lance.write_dataset(row, str(p / "tables" / "tasks.lance"), mode="append")
    assert any("commit(s) 1000 were never acknowledged" in x for x in db.verify())
    report = db.repair()
    assert [r["id"] for r in report["removed"]] == [1000] and report["lost"] == {}, report
    acked = _steps(db, 2, 1)
    assert list(acked) == [1001]
    assert db.verify() == []
    assert db.repair()["damage"] == []
