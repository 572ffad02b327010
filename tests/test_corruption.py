"""Damaged files are found and named; the rest stays readable; nothing is lost."""

from __future__ import annotations

from pathlib import Path

import pytest

import trellisdb


def _populate(path: Path) -> trellisdb.Database:
    db = trellisdb.connect(path, embedding_dim=4, auto_compact=False)
    db._committer.wal_max_rows = 0  # one Lance fragment per commit, as without the WAL
    for i in range(3):
        with db.session(task="t", agent="a") as s:
            n = s.add_node(id=f"n{i}", summary=f"node {i}", artifacts={"code": f"x = {i}"})
            s.add_reward(n, "score", float(i))
    return db


def test_truncated_data_file_is_named_and_other_tables_stay_readable(tmp_path: Path) -> None:
    db = _populate(tmp_path / "db")
    assert db.verify() == []
    files = sorted((tmp_path / "db" / "tables" / "nodes.lance" / "data").glob("*.lance"))
    victim = files[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 3])
    db2 = trellisdb.connect(tmp_path / "db")
    problems = db2.verify()
    assert any(victim.name in p for p in problems), problems
    # the other tables are intact and readable
    assert sorted(r["value"] for r in db2.sql("SELECT value FROM rewards").to_pylist()) == [0.0, 1.0, 2.0]
    with pytest.raises(trellisdb.CorruptionError, match="nodes"):
        db2.sql("SELECT * FROM nodes").to_pylist()


def test_cli_verify_reports_damage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trellisdb.cli import main

    db = _populate(tmp_path / "db")
    db.close()
    assert main(["--db", str(tmp_path / "db"), "verify"]) == 0
    victim = sorted((tmp_path / "db" / "tables" / "rewards.lance" / "data").glob("*.lance"))[-1]
    victim.write_bytes(b"garbage" * 10)
    assert main(["--db", str(tmp_path / "db"), "verify"]) == 1
    assert victim.name in capsys.readouterr().out


def test_damaged_commit_log_line_refuses_writes_but_reads_work(tmp_path: Path) -> None:
    db = _populate(tmp_path / "db")
    db.close()
    log = tmp_path / "db" / "commits.log"
    lines = log.read_bytes().splitlines(keepends=True)
    lines[1] = lines[1].replace(b'"op"', b'"oq"')  # checksum no longer matches
    log.write_bytes(b"".join(lines))
    db2 = trellisdb.connect(tmp_path / "db")
    problems = db2.verify()
    assert problems and "commits.log: line 2" in problems[0]
    assert len(db2.sql("SELECT * FROM rewards").to_pylist()) >= 1
    with pytest.raises(trellisdb.CorruptionError, match="commit log is damaged"), db2.transaction():
        db2.session(task="t", agent="a").add_node(summary="refused")


def test_torn_log_tail_is_ignored_and_repaired(tmp_path: Path) -> None:
    db = _populate(tmp_path / "db")
    db.close()
    log = tmp_path / "db" / "commits.log"
    before = trellisdb.connect(tmp_path / "db").log()
    with log.open("ab") as fh:
        fh.write(b'{"op":"commit","id":99')  # a crash mid-append
    db2 = trellisdb.connect(tmp_path / "db", commit_delay=60.0)  # one commit, at the session's end
    assert db2.log() == before
    assert db2.verify() == []
    with db2.session(task="t", agent="a") as s:
        s.add_node(summary="after the torn tail")
    db3 = trellisdb.connect(tmp_path / "db")
    assert len(db3.log()) == len(before) + 1
    assert db3.verify() == []


def test_half_written_marker_is_not_a_database(tmp_path: Path) -> None:
    p = tmp_path / "db"
    _populate(p).close()
    (p / "trellis.json").write_text('{"format": "trell')
    with pytest.raises(trellisdb.CorruptionError, match=r"trellis\.json"):
        trellisdb.connect(p)
