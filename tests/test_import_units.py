"""The import framework's read-ahead (``importers.units.prefetched``): units arrive in order,
a reader's error arrives at the unit it stopped at, and a consumer that stops early stops the
reader thread too (no thread left blocked on a full queue)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from trellisdb.errors import ImportFormatError
from trellisdb.importers.units import Unit, prefetched


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
