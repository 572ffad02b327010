"""A commit log that lost records is found, named and repaired; no id is used twice.

Each damage (a cut at a line boundary, a cut mid-line, a flipped last line) is made
after acknowledged commits whose writes the test records, then: verify() and open
name it, writes are refused (pointing at repair), reads answer as of the log that
is left, repair() gives back every acknowledged commit whole, the next commit takes
a new id, and no row of an old commit comes back inside it.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lance
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import trellisdb
from trellisdb.errors import TrellisWarning
from trellisdb.schema import DATA_TABLES


def _store(path: Path, commits: int = 6) -> tuple[dict[int, set[str]], int]:
    """A store with ``commits`` acknowledged commits; (node ids each wrote, highest id used)."""
    db = trellisdb.connect(path, embedding_dim=4, auto_compact=False)
    db._committer.wal_max_rows = 0  # these tests damage the commit log: commits go to it (and Lance) directly
    s = db.session(task="t", agent="a", id="s1")
    written: dict[int, set[str]] = {}
    for i in range(commits):
        with db.transaction(message=f"c{i}") as tx:
            ids = {s.add_node(id=f"n{i}-{j}", summary=f"node {i}.{j}", artifacts={"code": f"x = {i}{j}"})
                   for j in range(1 + i % 3)}
            for n in ids:
                s.add_reward(n, "score", float(i))
        assert tx.commit_id is not None
        written[tx.commit_id] = ids
    top = db._store.log.refresh().max_id
    db.close()
    return written, top


def _lines(path: Path) -> list[bytes]:
    return (path / "commits.log").read_bytes().splitlines(keepends=True)


def _damage(path: Path, how: str) -> None:
    log = path / "commits.log"
    lines = _lines(path)
    if how == "cut-1-line":
        log.write_bytes(b"".join(lines[:-1]))
    elif how == "cut-5-lines":
        log.write_bytes(b"".join(lines[:-5]))
    elif how == "cut-mid-line":
        data = b"".join(lines)
        log.write_bytes(data[: len(data) - len(lines[-1]) // 2])
    elif how == "flip-last-line":
        last = bytearray(lines[-1])
        for k in (3, 10, 20):
            last[k] ^= 0x5A
        log.write_bytes(b"".join([*lines[:-1], bytes(last)]))
    else:
        raise AssertionError(how)


def _connect_warned(path: Path) -> tuple[trellisdb.Database, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        db = trellisdb.connect(path)
    return db, [str(w.message) for w in caught if issubclass(w.category, TrellisWarning)]


def _nodes_by_commit(db: trellisdb.Database) -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for r in db.sql("SELECT id, commit_id FROM nodes_history").to_pylist():
        out.setdefault(r["commit_id"], set()).add(r["id"])
    return out


def _physical_commit_ids(path: Path) -> set[int]:
    ids: set[int] = set()
    for name in DATA_TABLES:
        t = lance.dataset(str(path / "tables" / f"{name}.lance")).to_table(columns=["commit_id"])
        ids |= set(t.column("commit_id").to_pylist())
    return ids


@pytest.mark.parametrize("how", ["cut-1-line", "cut-5-lines", "cut-mid-line", "flip-last-line"])
def test_lost_log_tail_is_named_refused_and_repaired(tmp_path: Path, how: str) -> None:
    p = tmp_path / "db"
    written, top = _store(p)
    _damage(p, how)

    db, warned = _connect_warned(p)
    assert warned and "commits.log" in warned[0] and "repair" in warned[0], warned
    problems = db.verify()
    assert any("commits.log" in x and "lost records" in x for x in problems), problems
    # reads answer as of the log that is left
    last = db.log()[-1]["id"]
    assert last < max(written)
    visible = {r["id"] for r in db.sql("SELECT id FROM nodes").to_pylist()}
    assert visible == set().union(*(ids for c, ids in written.items() if c <= last))
    # writes (commits and tags) are refused, pointing at repair
    with pytest.raises(trellisdb.CorruptionError, match=r"repair"), db.transaction():
        db.session(task="t", agent="a").add_node(id="refused", summary="refused")
    with pytest.raises(trellisdb.CorruptionError, match=r"repair"):
        db.tag("refused")

    report = db.repair()
    assert report["damage"] and report["unrecoverable"] == []
    assert {r["id"] for r in report["recovered"]} == {c for c in written if c > last}
    assert Path(report["lost_found"], "commits.log").exists()
    # every acknowledged commit is back, whole, as its own commit
    assert _nodes_by_commit(db) == written
    log_ids = [c["id"] for c in db.log()]
    assert log_ids == sorted(set(log_ids)) and set(written) <= set(log_ids)
    assert db.verify() == []

    with db.transaction(message="after") as tx:
        db.session(task="t", agent="a").add_node(id="after", summary="after the repair")
    assert tx.commit_id is not None and tx.commit_id > top
    db.close()
    db2, warned = _connect_warned(p)
    assert warned == []
    assert _nodes_by_commit(db2) == {**written, tx.commit_id: {"after"}}  # no old row came back inside it
    assert db2.sql("SELECT count(*) AS n FROM rewards_history").to_pylist()[0]["n"] == sum(map(len, written.values()))
    assert _physical_commit_ids(p) <= {c["id"] for c in db2.log()}
    assert db2.verify() == []
    assert db2.repair()["damage"] == []  # nothing left to do


def test_damaged_commit_record_followed_by_a_tag_is_recovered(tmp_path: Path) -> None:
    """The last commit's record is damaged, and a later line (a tag) is not: damage in the middle."""
    p = tmp_path / "db"
    written, _top = _store(p, commits=3)
    db = trellisdb.connect(p)
    db.tag("done")
    db.close()
    lines = _lines(p)
    assert b'"op":"commit"' in lines[-2]
    lines[-2] = lines[-2].replace(b'"op":"commit"', b'"op":"cmmit"')
    (p / "commits.log").write_bytes(b"".join(lines))
    db, warned = _connect_warned(p)
    assert warned
    assert any("line" in x and "fails its checksum" in x for x in db.verify())
    report = db.repair()
    assert [r["id"] for r in report["recovered"]] == [max(written)] and report["damaged_lines"] == 1
    assert _nodes_by_commit(db) == written
    assert db.tags() == {"done": max(written)}  # the tag line was intact
    assert db.verify() == []


def _fail_after_appends(monkeypatch: pytest.MonkeyPatch, tables: set[str]) -> None:
    """Make a commit die after appending to ``tables`` (its commit record never written)."""
    from trellisdb.storage.tables import LanceTables

    real = LanceTables.append

    def append(self: LanceTables, name: str, data: pa.Table) -> None:
        real(self, name, data)
        if name in tables:
            raise OSError("simulated crash after the Lance append")

    monkeypatch.setattr(LanceTables, "append", append)


def test_rows_of_an_unacknowledged_commit_are_quarantined(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer died after its appends, and the log then lost its ``begin``: the rows are stranded."""
    p = tmp_path / "db"
    written, _top = _store(p, commits=3)
    db = trellisdb.connect(p, auto_compact=False)
    db._committer.wal_max_rows = 0  # a commit written to Lance directly (as big ones are)
    with monkeypatch.context() as m:
        _fail_after_appends(m, {"nodes"})
        with pytest.raises(Exception, match="simulated crash"), db.transaction():
            db.session(task="t", agent="a", id="s1").add_node(id="ghost", summary="never acknowledged")
    dead = db._store.log.refresh().max_id
    db.close()
    lines = _lines(p)
    assert json.loads(lines[-1].split(b"\t")[0]) == {"op": "begin", "id": dead}
    (p / "commits.log").write_bytes(b"".join(lines[:-1]))  # the begin record is lost

    db, warned = _connect_warned(p)
    assert warned
    problems = db.verify()
    assert any(f"commit(s) {dead} were never acknowledged" in x for x in problems), problems
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE id = 'ghost'").to_pylist() == [{"n": 0}]
    report = db.repair()
    assert [r["id"] for r in report["removed"]] == [dead] and report["recovered"] == []
    quarantined = pa.Table.from_batches(lance.dataset(str(p / "tables" / "nodes.lance")).to_batches()).num_rows
    assert quarantined == sum(map(len, written.values()))  # the stranded row left the table
    kept = pq.read_table(Path(report["lost_found"]) / "nodes.parquet")
    assert kept.column("id").to_pylist() == ["ghost"] and kept.column("commit_id").to_pylist() == [dead]
    with db.transaction() as tx:
        db.session(task="t", agent="a").add_node(id="next", summary="next")
    assert tx.commit_id is not None and tx.commit_id > dead
    assert _nodes_by_commit(db) == {**written, tx.commit_id: {"next"}}
    assert db.verify() == []


def test_rows_no_record_mentions_are_found_by_verify_and_collected(tmp_path: Path) -> None:
    """Rows whose commit no line of the log, nor the mark, ever named (a log and mark restored from
    an older backup): a writer does not scan for them (see ARCHITECTURE.md), verify does."""
    p = tmp_path / "db"
    written, top = _store(p, commits=2)
    _append_stray_node(p, top + 5, "stray")
    db = trellisdb.connect(p)
    assert any(f"commit(s) {top + 5} were never acknowledged" in x for x in db.verify())
    report = db.repair()
    assert [r["id"] for r in report["removed"]] == [top + 5]
    assert (Path(report["lost_found"]) / "nodes.parquet").exists()
    with db.transaction() as tx:
        db.session(task="t", agent="a").add_node(id="next", summary="next")
    assert tx.commit_id is not None and tx.commit_id > top + 5
    assert _nodes_by_commit(db) == {**written, tx.commit_id: {"next"}}


def _append_stray_node(path: Path, commit_id: int, node_id: str) -> None:
    """A node row stamped ``commit_id`` appended to Lance behind the log's back."""
    stray = trellisdb.connect(path).sql("SELECT * FROM nodes_full LIMIT 1").to_arrow()
    stray = stray.set_column(stray.schema.get_field_index("commit_id"), "commit_id", pa.array([commit_id], pa.int64()))
    stray = stray.set_column(stray.schema.get_field_index("id"), "id", pa.array([node_id]))
    ds = lance.dataset(str(path / "tables" / "nodes.lance"))
    lance.write_dataset(stray.select(ds.schema.names).cast(ds.schema), ds.uri, mode="append")


def test_repair_collects_a_commit_a_writer_died_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted commit (its begin logged, some rows written) next to stranded rows of a higher id: the
    ids repair logs as begun must not make the aborted one look complete later."""
    p = tmp_path / "db"
    written, _top = _store(p, commits=2)
    db = trellisdb.connect(p, auto_compact=False)
    db._committer.wal_max_rows = 0  # a commit written to Lance directly (as big ones are)
    with monkeypatch.context() as m:
        _fail_after_appends(m, {"nodes"})
        with pytest.raises(Exception, match="simulated crash"), db.transaction():
            db.session(task="t", agent="a", id="s1").add_node(id="half", summary="half-written")
    dead = db._store.log.refresh().max_id
    db.close()
    _append_stray_node(p, dead + 3, "stray")
    db = trellisdb.connect(p)
    report = db.repair()
    assert [r["id"] for r in report["removed"]] == [dead, dead + 3] and report["recovered"] == []
    kept = pq.read_table(Path(report["lost_found"]) / "nodes.parquet").column("id").to_pylist()
    assert sorted(kept) == ["half", "stray"]
    assert db.verify() == []
    with db.transaction() as tx:
        db.session(task="t", agent="a").add_node(id="next", summary="next")
    assert tx.commit_id == dead + 4
    assert _nodes_by_commit(db) == {**written, dead + 4: {"next"}}


def test_log_shrinking_under_an_open_handle_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "db"
    written, _top = _store(p, commits=4)
    before = trellisdb.connect(p)
    assert before.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": sum(map(len, written.values()))}]
    _damage(p, "cut-5-lines")
    with pytest.raises(trellisdb.CorruptionError, match=r"commits\.log shrank"):
        before.sql("SELECT count(*) AS n FROM nodes").to_pylist()
    # a handle opened on the damaged log goes on reading once another one repaired it (only appended to),
    # and its mirror, built before the repair, takes in the recovered commits
    during, _ = _connect_warned(p)
    last = during.log()[-1]["id"]
    seen = {r["id"] for r in during.sql("SELECT id FROM nodes").to_pylist()}
    assert seen == set().union(*(ids for c, ids in written.items() if c <= last))
    fixer, _ = _connect_warned(p)
    assert fixer.repair()["recovered"]
    assert {r["id"] for r in during.sql("SELECT id FROM nodes").to_pylist()} == set().union(*written.values())


def test_a_replaced_log_that_differs_where_a_handle_read_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "db"
    _store(p, commits=3)
    db = trellisdb.connect(p)
    db.tag("t1")
    lines = _lines(p)
    lines[2] = lines[2].replace(b'"op"', b'"oq"')  # a damaged line in the middle, dropped by repair
    (p / "commits.log").write_bytes(b"".join(lines))
    fixer, _ = _connect_warned(p)
    assert fixer.repair()["damaged_lines"] == 1
    with pytest.raises(trellisdb.CorruptionError, match="replaced"):
        db.log()


def test_store_without_a_mark_and_a_torn_mark_raise_no_alarm(tmp_path: Path) -> None:
    p = tmp_path / "db"
    _written, top = _store(p, commits=2)
    (p / "commits.hwm").unlink()  # a store written before the mark existed
    db, warned = _connect_warned(p)
    assert warned == [] and db.verify() == []
    with db.transaction() as tx:
        db.session(task="t", agent="a").add_node(id="a1", summary="x")
    assert tx.commit_id == top + 1 and (p / "commits.hwm").exists()
    db.close()
    (p / "commits.hwm").write_bytes(b"trellis-hwm 1 id=9")  # a write torn by a crash
    db, warned = _connect_warned(p)
    assert warned == [] and db.verify() == []
    with db.transaction() as tx:
        db.session(task="t", agent="a").add_node(id="a2", summary="y")
    assert tx.commit_id == top + 2
    assert db.repair()["damage"] == []


def test_cli_repair_prints_what_it_did(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trellisdb.cli import main

    p = tmp_path / "db"
    written, _top = _store(p, commits=3)
    assert main(["--db", str(p), "repair"]) == 0
    assert "nothing to repair" in capsys.readouterr().out
    _damage(p, "cut-1-line")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TrellisWarning)
        assert main(["--db", str(p), "verify"]) == 1
        assert "lost records" in capsys.readouterr().out
        assert main(["--db", str(p), "repair"]) == 0
    out = capsys.readouterr().out
    assert f"recovered commit {max(written)}" in out and "lost+found" in out
    assert main(["--db", str(p), "verify"]) == 0


def test_repair_of_a_healthy_store_does_nothing(tmp_path: Path) -> None:
    p = tmp_path / "db"
    _store(p, commits=2)
    before = (p / "commits.log").read_bytes()
    db = trellisdb.connect(p)
    report = db.repair()
    assert report["damage"] == [] and report["lost_found"] is None
    assert set(report) >= {"recovered", "removed", "unrecoverable", "tail_bytes", "last_commit", "notes"}
    assert (p / "commits.log").read_bytes() == before and not (p / "lost+found").exists()
