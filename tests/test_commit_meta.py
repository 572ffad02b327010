"""Commit metadata (issue 24): run-level state recorded with a commit, queryable in ``commits``,
seen as of its commit, kept through the WAL, checkpoints and a reopen, and refused clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

import trellisdb
from trellisdb.cli import main
from trellisdb.errors import ValidationError


def _metas(db: trellisdb.Database) -> list[dict[str, object] | None]:
    return [None if r["meta"] is None else json.loads(r["meta"]) for r in db.log()]


def test_meta_from_transaction_flush_and_ingest_is_queryable_and_durable(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db")
    state = {"best_program_id": "p1", "island_best_programs": ["p1", None], "last_iteration": 10}
    with db.transaction(message="checkpoint 10", meta=state) as tx:
        db.add_task("t")
    s = db.session(id="s", task="t")
    s.add_node(id="p2")
    flushed = db.flush(meta={"last_iteration": 20, "best_program_id": "p2"})
    assert flushed is not None and flushed > (tx.commit_id or 0)
    # nothing pending: a commit is still written, to carry the metadata
    empty = db.flush(meta={"last_iteration": 30})
    assert empty is not None and db.log()[-1]["rows"] == 0
    assert db.flush() is None  # without meta, nothing pending is still nothing
    ingested = db.ingest({"nodes": pa.table({"id": ["p3"], "session_id": ["s"], "task_id": ["t"]})},
                         meta={"source": "bulk"})
    assert _metas(db) == [state, {"best_program_id": "p2", "last_iteration": 20}, {"last_iteration": 30},
                          {"source": "bulk"}]
    got = db.sql("SELECT id, json_extract_string(meta, '$.best_program_id') AS best FROM commits "
                  "WHERE meta IS NOT NULL ORDER BY id").to_pylist()
    assert [r["best"] for r in got] == ["p1", "p2", None, None]
    # as of the first commit, only its metadata exists
    old = db.sql("SELECT meta FROM commits", as_of=tx.commit_id).to_pylist()
    assert [json.loads(r["meta"]) for r in old] == [state]
    # another handle reads the WAL's commit records; a reopen after the checkpoint reads the log's
    other = trellisdb.connect(tmp_path / "db")
    assert _metas(other) == _metas(db)
    other.close()
    db.close()
    again = trellisdb.connect(tmp_path / "db")
    assert _metas(again) == [state, {"best_program_id": "p2", "last_iteration": 20}, {"last_iteration": 30},
                             {"source": "bulk"}]
    assert again.log()[-1]["id"] == ingested
    again.close()


@pytest.mark.parametrize(
    ("meta", "says"),
    [
        (["not", "a", "mapping"], "must be a mapping"),
        ({"x": float("nan")}, "JSON values"),
        ({1: "int key"}, "JSON values"),
        ({"x": object()}, "JSON values"),
        ({"x": "\ud800"}, "commit meta"),
        ({"x": "y" * (70 * 1024)}, "at most 65,536"),
    ],
)
def test_bad_meta_is_refused_and_nothing_is_committed(tmp_path: Path, meta: object, says: str) -> None:
    db = trellisdb.connect(tmp_path / "db", commit_delay=60)  # no timer commits the pending node meanwhile
    db.add_task("t")
    db.flush()
    before = len(db.log())
    with pytest.raises(ValidationError, match=says), db.transaction(meta=meta):  # type: ignore[arg-type]
        db.add_task("u")
    s = db.session(id="s", task="t")
    s.add_node(id="n")
    with pytest.raises(ValidationError, match=says):
        db.flush(meta=meta)  # type: ignore[arg-type]
    assert len(db.log()) == before
    assert db.flush() is not None  # the pending write is still pending, and commits without the bad meta
    assert db.sql("SELECT count(*) AS n FROM tasks").to_pylist() == [{"n": 1}]
    db.close()


def test_trellis_log_shows_meta(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "db"
    db = trellisdb.connect(path)
    with db.transaction(message="cp", meta={"best_program_id": "p9"}):
        db.add_task("t")
    db.close()
    assert main(["--db", str(path), "log"]) == 0
    out = capsys.readouterr().out
    assert "| meta" in out.splitlines()[0] and '{"best_program_id": "p9"}' in out
