"""The write-ahead log: small commits made durable by one fsynced append, rows included.

A Lance append costs a manifest write per table (~2.3 ms each); an agent step touches five
tables. So a small commit is not written to Lance: its rows, as Arrow IPC streams, follow
its commit record in one *frame* appended to the current WAL segment
``<db>/wal-<gen>.log`` and fsynced once. The frame is the commit point. Readers (in this
process and others) read the frames after the commit log (``log.py``) and serve their rows
next to Lance's (``reader.py``); a *checkpoint* (``committer.py``) appends the rows of many
frames to Lance in one append per table, then the frames' commit records to the commit log
with a ``checkpoint`` record naming the next segment, and deletes the old segment.

A frame is a commit record line (``<json>\\t<crc32>\\n``, as in the commit log) whose
record carries ``bytes`` (the payload's length), ``pcrc`` (its crc32) and ``tables``
(``[[name, bytes], ...]``), followed by the payload: one Arrow IPC stream per table. A frame
cut short or failing its checksum at the end of the segment is a torn append (never
acknowledged): readers stop before it, the next writer cuts it off. One in the middle is
damage, reported like a damaged log line.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "wal-00000001.log")
    >>> _ = Segment(path).append({"op": "commit", "id": 3, "time": 0.0}, {"tasks": pa.table({"id": ["t"]})})
    >>> [(f.id, f.tables()["tasks"].num_rows) for f in Segment(path).read()]
    [(3, 1)]
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa


def segment_name(gen: int) -> str:
    return f"wal-{int(gen):08d}.log"


def _header(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True)
    return f"{body}\t{zlib.crc32(body.encode()) & 0xFFFFFFFF:08x}\n".encode()


def _ipc(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    return bytes(sink.getvalue().to_pybytes())


def encode(record: Mapping[str, Any], tables: Mapping[str, pa.Table]) -> tuple[dict[str, Any], bytes]:
    """The record as written (with the payload's description) and the frame's bytes."""
    parts = [(name, _ipc(t)) for name, t in tables.items() if t.num_rows]
    payload = b"".join(p for _, p in parts)
    rec = {**record, "tables": [[name, len(p)] for name, p in parts], "bytes": len(payload),
           "pcrc": zlib.crc32(payload) & 0xFFFFFFFF}
    return rec, _header(rec) + payload


@dataclass
class Frame:
    """One committed frame: its commit record and its rows (decoded on first use)."""

    record: dict[str, Any]
    payload: bytes = b""
    _tables: dict[str, pa.Table] | None = field(default=None, repr=False)

    @property
    def id(self) -> int:
        return int(self.record["id"])

    def tables(self) -> dict[str, pa.Table]:
        if self._tables is None:
            out, pos = {}, 0
            for name, n in self.record.get("tables", []):
                out[str(name)] = pa.ipc.open_stream(pa.py_buffer(self.payload[pos : pos + n])).read_all()
                pos += n
            self._tables = out
            self.payload = b""
        return self._tables

    def raw(self) -> bytes:
        """The frame's bytes as read (a frame read from a file, rows not yet decoded)."""
        return _header(self.record) + self.payload

    @classmethod
    def of(cls, record: dict[str, Any], tables: Mapping[str, pa.Table]) -> Frame:
        """A frame this process wrote: its tables as they were, nothing decoded."""
        return cls(record, b"", {n: t for n, t in tables.items() if t.num_rows})


class Segment:
    """Incremental reader and appender of one WAL segment file."""

    def __init__(self, path: str) -> None:
        self.path = path
        #: bytes of whole frames read so far
        self.offset = 0
        #: where a torn (or in-progress) frame starts at the end, if one was seen
        self.torn_at: int | None = None
        #: (frame number, message) for damaged frames followed by whole ones
        self.problems: list[tuple[int, str]] = []
        self._count = 0

    def read(self) -> list[Frame]:
        """The whole frames appended since the last read (none if the file does not exist)."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        out: list[Frame] = []
        pos = 0
        self.torn_at = None
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if nl < 0:  # a header cut short: torn, or still being written
                self.torn_at = self.offset + pos
                break
            rec = _decode_header(data[pos:nl])
            if rec is None:
                if nl + 1 == len(data):  # a damaged last line, nothing after it: a torn append
                    self.torn_at = self.offset + pos
                else:  # where its rows end is unknown: nothing after it can be read
                    self._problem(f"frame {self._count + 1}'s commit record fails its checksum; the frames "
                                  "after it cannot be read")
                break
            end = nl + 1 + int(rec.get("bytes", 0))
            if end > len(data):  # rows cut short: torn, or still being written
                self.torn_at = self.offset + pos
                break
            payload = data[nl + 1 : end]
            self._count += 1
            if zlib.crc32(payload) & 0xFFFFFFFF != int(rec.get("pcrc", -1)):
                if end == len(data):
                    self._count -= 1
                    self.torn_at = self.offset + pos
                    break
                self._problem(f"frame {self._count} (commit {rec.get('id')})'s rows fail their checksum")
            else:
                out.append(Frame(rec, payload))
            pos = end
        self.offset += pos
        return out

    def _problem(self, what: str) -> None:
        msg = f"{self.path}: {what}"
        if all(m != msg for _, m in self.problems):
            self.problems.append((self._count, msg))

    def append(self, record: dict[str, Any], tables: Mapping[str, pa.Table]) -> Frame:
        """Append one frame durably (one write, one fsync; writer lock held, tail repaired)."""
        rec, data = encode(record, tables)
        created = not os.path.exists(self.path)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if created:
            _sync_dir(os.path.dirname(self.path))
        self.offset += len(data)
        self._count += 1
        return Frame.of(rec, tables)

    def cut_torn_tail(self) -> None:
        """Cut a torn frame off the end (writer lock held; never in a damaged segment)."""
        if self.torn_at is None or self.problems:
            return
        with open(self.path, "r+b") as fh:
            fh.truncate(self.torn_at)
            os.fsync(fh.fileno())
        self.torn_at = None


def _decode_header(line: bytes) -> dict[str, Any] | None:
    try:
        body, crc = line.rsplit(b"\t", 1)
        if int(crc, 16) != zlib.crc32(body) & 0xFFFFFFFF:
            return None
        rec = json.loads(body)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and rec.get("op") == "commit" else None


def _sync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class WalView:
    """The commits whose rows are in the WAL, not yet in Lance: ``upto`` is the last commit
    whose rows Lance holds (every commit the commit log records), ``frames`` the WAL's
    commits above it, ascending. Immutable: a reader takes one and reads it consistently."""

    upto: int = 0
    frames: tuple[Frame, ...] = ()
    _cache: dict[str, pa.Table] = field(default_factory=dict, compare=False, repr=False)

    def table(self, name: str, schema: pa.Schema) -> pa.Table:
        """Every WAL row of table ``name`` (empty, with ``schema``, if none)."""
        t = self._cache.get(name)
        if t is None:
            parts = [f.tables()[name] for f in self.frames if name in f.tables()]
            t = pa.concat_tables([p.select(schema.names).cast(schema) for p in parts]) if parts else schema.empty_table()
            self._cache[name] = t
        return t

    def touches(self, name: str, above: int, upto: int) -> bool:
        """Whether a frame with ``above < id <= upto`` holds rows of ``name``."""
        return any(above < f.id <= upto and name in f.tables() for f in self.frames)
