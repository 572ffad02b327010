"""The import framework: the read-ahead (``importers.units.prefetched``: units arrive in order,
a reader's error arrives at the unit it stopped at, and a consumer that stops early stops the
reader thread too, no thread left blocked on a full queue), and ``commit_units``: a value the
store cannot hold refuses its unit by name, tags are checked before anything is written."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trellisdb
from trellisdb.errors import ImportFormatError, TrellisError
from trellisdb.importers.units import Unit, commit_units, prefetched


def _units(n: int, fail_at: int | None = None, read: list[int] | None = None) -> Iterator[Unit]:
    for i in range(n):
        if i == fail_at:
            raise ImportFormatError(f"file{i}.json:3: broken")
        if read is not None:
            read.append(i)
        yield Unit(name=f"u{i}", rows={}, where=f"file{i}.json")


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "trellisdb-import-reader"]


def test_units_arrive_in_order() -> None:
    assert [u.name for u in prefetched(_units(50))] == [f"u{i}" for i in range(50)]
    assert not _reader_threads()


def test_a_reader_error_arrives_after_the_units_before_it() -> None:
    got = []
    with pytest.raises(ImportFormatError, match=r"file3\.json:3"):
        for u in prefetched(_units(10, fail_at=3)):
            got.append(u.name)
    assert got == ["u0", "u1", "u2"]
    assert not _reader_threads()


def test_a_consumer_that_stops_early_stops_the_reader() -> None:
    read: list[int] = []
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="commit failed"):
        for u in prefetched(_units(10_000, read=read)):
            if u.name == "u2":
                raise RuntimeError("commit failed")
    assert time.monotonic() - t0 < 5
    assert not _reader_threads()
    assert len(read) <= 5  # read ahead by one unit (and the one being handed over), not to the end


def _broken(n: int) -> Iterator[Unit]:
    for i in range(n):
        yield Unit(name=f"u{i}", rows={}, where=f"file{i}.json")
    raise KeyError("a field the reader did not expect")


def test_a_reader_error_that_is_not_a_trellis_error_names_the_unit_before_it() -> None:
    got = []
    with pytest.raises(ImportFormatError, match=r"stopped after unit 'u1' .*\(KeyError: .*a field") as caught:
        for u in prefetched(_broken(2)):
            got.append(u.name)
    assert got == ["u0", "u1"] and isinstance(caught.value.__cause__, KeyError)
    with pytest.raises(ImportFormatError, match="before its first unit"):
        list(prefetched(_broken(0)))
    assert not _reader_threads()


def _db(tmp_path: Path) -> trellisdb.Database:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    s = db.session(task="t", id="s")
    s.add_node(id="root")
    db.flush()
    return db


def _node(nid: str, **cols: Any) -> dict[str, Any]:
    return {"id": nid, "session_id": "s", "task_id": "t", "kind": "step", **cols}


@pytest.mark.parametrize(("row", "why"), [
    (_node("n", summary="bin \udc00"), "UnicodeEncodeError"),
    (_node("n", step=2**64), "Overflow|ArrowInvalid|out of range"),
    (_node("n", step="three"), "ArrowInvalid|ArrowTypeError|TypeError"),
])
def test_a_value_the_store_cannot_hold_refuses_its_unit(tmp_path: Path, row: dict[str, Any], why: str) -> None:
    db = _db(tmp_path)
    before = len(db.log())
    units = [Unit(name="ok", rows={"nodes": [_node("a")]}, where="a.json"),
             Unit(name="bad", rows={"nodes": [row]}, where="b.json:3")]
    with pytest.raises(ImportFormatError, match=rf"^b\.json:3: a value cannot be stored \(({why}).*\) \(nothing of "
                                                r"'bad' was written; earlier units were\)"):
        commit_units(db, "test", "src", units, progress=False)
    assert len(db.log()) == before + 1


def test_tags_are_checked_before_a_unit_is_written(tmp_path: Path) -> None:
    db = _db(tmp_path)
    other = db.tag("t1")  # another run's
    units = [Unit(name="u1", rows={"nodes": [_node("a")]}, where="a.json", tag="t1")]
    for _ in range(2):  # refused, and again: nothing was written, nothing is skipped
        with pytest.raises(TrellisError, match=r"a\.json: tag 't1' names commit \d+ already .*nothing of 'u1' was "
                                               r"written.*tag_prefix"):
            commit_units(db, "test", "src", units, progress=False)
        assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 1}]
    db.untag("t1")
    report = commit_units(db, "test", "src", units, progress=False)
    assert report.imported == ["u1"] and db.tags()["t1"] == report.commits[0]
    # a tag removed by hand comes back when the unit is skipped (as after a crash before the tag)
    db.untag("t1")
    assert commit_units(db, "test", "src", units, progress=False).skipped == ["u1"]
    assert db.tags()["t1"] == report.commits[0]
    # one moved to another commit is an error, not skipped silently
    db.tag("t1", other, move=True)
    with pytest.raises(TrellisError, match=r"a\.json: 'u1' was imported as commit \d+, but its tag 't1' names "
                                           rf"commit {other}"):
        commit_units(db, "test", "src", units, progress=False)
