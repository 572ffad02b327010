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
(``[[name, bytes, format], ...]``), followed by the payload: per table its rows as a JSON
list (data tables) or an Arrow IPC stream (vector tables). A frame
cut short or failing its checksum at the end of the segment is a torn append (never
acknowledged): readers stop before it, the next writer cuts it off. One in the middle is
damage, reported like a damaged log line.

    >>> import tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "wal-00000001.log")
    >>> _ = Segment(path).append({"op": "commit", "id": 3, "time": 0.0}, Payload.of({"tasks": [{"id": "t"}]}))
    >>> [(f.id, f.rows()["tasks"]) for f in Segment(path).read()]
    [(3, [{'id': 't'}])]
"""

from __future__ import annotations

import base64
import bisect
import datetime as dt
import errno
import json
import os
import re
import threading
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from trellisdb.errors import CorruptionError
from trellisdb.storage.lines import decode_line, encode_line, sync_dir


def segment_name(gen: int) -> str:
    return f"wal-{int(gen):08d}.log"


def segment_files(folder: str) -> list[tuple[int, str]]:
    """(generation, path) of every WAL segment in ``folder``, ascending."""
    out = []
    for n in os.listdir(folder):
        if n.startswith("wal-") and n.endswith(".log") and n[4:-4].isdigit():
            out.append((int(n[4:-4]), os.path.join(folder, n)))
    return sorted(out)


_PLAIN: dict[pa.Schema, pa.Schema] = {}
_OPTIONS = pa.ipc.IpcWriteOptions(use_threads=False)


def _plain(schema: pa.Schema) -> pa.Schema:
    """``schema`` without field and schema metadata (the column docs): smaller frames."""
    plain = _PLAIN.get(schema)
    if plain is None:
        plain = _PLAIN[schema] = pa.schema([f.remove_metadata() for f in schema])
    return plain


def _ipc(t: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    sch = _plain(t.schema)
    with pa.ipc.new_stream(sink, sch, options=_OPTIONS) as w:
        w.write_table(pa.Table.from_batches(t.to_batches(), sch) if sch is not t.schema else t)
    return bytes(sink.getvalue().to_pybytes())


def _json_value(v: object) -> object:
    if isinstance(v, dt.datetime):
        return {"$t": v.isoformat()}
    if isinstance(v, bytes):
        return {"$b": base64.b64encode(v).decode()}
    raise TypeError(f"a row value of type {type(v).__name__} has no WAL form")


def _json_hook(d: dict[str, Any]) -> object:
    if len(d) == 1:
        if "$t" in d:
            return dt.datetime.fromisoformat(d["$t"])
        if "$b" in d:
            return base64.b64decode(d["$b"])
        if "$f" in d:
            return np.frombuffer(base64.b64decode(d["$f"]), np.float32).tolist()
    return d


def _jsonable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with their embeddings as base64 float32 (what they are stored as: exact, and far
    cheaper to write than 384 JSON numbers)."""
    if not rows or "embedding" not in rows[0]:
        return rows
    return [{**r, "embedding": {"$f": base64.b64encode(np.asarray(r["embedding"], np.float32).tobytes()).decode()}}
            if r.get("embedding") is not None else r for r in rows]


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_json_value, allow_nan=False)


@dataclass(frozen=True)
class Payload:
    """A commit's rows encoded for a frame (done before the writer lock is taken): per data
    table its rows as JSON, per vector table an Arrow IPC stream (its ``commit_id`` column is
    a placeholder; readers take the frame's id). Keeps the rows for the writer's own reads."""

    rows: Mapping[str, list[dict[str, Any]]]
    tables: Mapping[str, pa.Table]
    parts: tuple[tuple[str, str, bytes], ...]

    @classmethod
    def of(cls, rows: Mapping[str, list[dict[str, Any]]], tables: Mapping[str, pa.Table] | None = None) -> Payload:
        """Building Arrow tables for one step's few rows costs more than the fsync, so data rows
        are written as JSON and readers build Arrow tables for many frames at once."""
        rows = {n: r for n, r in rows.items() if r}
        tables = {n: t for n, t in (tables or {}).items() if t.num_rows}
        parts = [(name, "json", _ENCODER.encode(_jsonable(r)).encode()) for name, r in rows.items()]
        parts += [(name, "ipc", _ipc(t)) for name, t in tables.items()]
        return cls(rows, tables, tuple(parts))

    @property
    def nbytes(self) -> int:
        return sum(len(p) for _, _, p in self.parts)


def encode(record: Mapping[str, Any], payload: Payload) -> tuple[dict[str, Any], bytes]:
    """The record as written (with the payload's description) and the frame's bytes."""
    data = b"".join(p for _, _, p in payload.parts)
    rec = {**record, "tables": [[name, len(p), fmt] for name, fmt, p in payload.parts], "bytes": len(data),
           "pcrc": zlib.crc32(data) & 0xFFFFFFFF}
    return rec, encode_line(rec) + data


@dataclass
class Frame:
    """One committed frame: its commit record and its rows (decoded on first use): per data
    table a list of row dicts, per vector table an Arrow table."""

    record: dict[str, Any]
    payload: bytes = b""
    _rows: dict[str, list[dict[str, Any]]] | None = field(default=None, repr=False)
    _tables: dict[str, pa.Table] | None = field(default=None, repr=False)

    @property
    def id(self) -> int:
        return int(self.record["id"])

    def _decode(self) -> None:
        rows: dict[str, list[dict[str, Any]]] = {}
        tables: dict[str, pa.Table] = {}
        pos = 0
        for name, n, *fmt in self.record.get("tables", []):
            part = self.payload[pos : pos + n]
            if fmt and fmt[0] == "json":
                rows[str(name)] = json.loads(part, object_hook=_json_hook)
            else:
                tables[str(name)] = pa.ipc.open_stream(pa.py_buffer(part)).read_all()
            pos += n
        self._rows, self._tables = rows, tables
        self.payload = b""

    def names(self) -> list[str]:
        """The tables the frame holds rows of."""
        return [str(t[0]) for t in self.record.get("tables", [])]

    def rows(self) -> dict[str, list[dict[str, Any]]]:
        """The data tables' rows (dicts without ``commit_id``)."""
        if self._rows is None:
            self._decode()
        assert self._rows is not None
        return self._rows

    def tables(self) -> dict[str, pa.Table]:
        """The vector tables' rows (Arrow tables, with ``commit_id``)."""
        if self._tables is None:
            self._decode()
        assert self._tables is not None
        return self._tables

    def values(self, table: str, column: str) -> list[Any]:
        """The values of ``table.column`` in this frame, from its row dicts and its whole tables
        (a small ingest's)."""
        out = [r[column] for r in self.rows().get(table, ())]
        t = self.tables().get(table)
        if t is not None:
            out += t.column(column).to_pylist()
        return out

    def raw(self) -> bytes:
        """The frame's bytes as read (a frame read from a file, rows not yet decoded)."""
        return encode_line(self.record) + self.payload

    @classmethod
    def of(cls, record: dict[str, Any], payload: Payload) -> Frame:
        """A frame this process wrote: its rows as they were, nothing decoded."""
        return cls(record, b"", dict(payload.rows), dict(payload.tables))


def rows_table(frames: Sequence[Frame], name: str, schema: pa.Schema) -> pa.Table:
    """The rows of table ``name`` in ``frames`` as one Arrow table of ``schema`` (one conversion
    for all of them), ``commit_id`` from each frame's record."""
    dicts = [{**r, "commit_id": f.id} for f in frames for r in f.rows().get(name, ())]
    parts = [pa.Table.from_pylist(dicts, schema=schema)] if dicts else []
    for f in frames:
        t = f.tables().get(name)
        if t is not None:
            t = t.set_column(t.schema.get_field_index("commit_id"), "commit_id",
                             pa.array(np.full(t.num_rows, f.id, np.int64)))
            for field in schema:  # a column a later format added (upgrade.py): null in older frames
                if field.name not in t.column_names:
                    t = t.append_column(field.name, pa.nulls(t.num_rows, field.type))
            parts.append(t.select(schema.names).cast(schema))
    if len(parts) == 1:
        return parts[0]
    return pa.concat_tables(parts) if parts else schema.empty_table()


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
        #: the commit id a torn last frame's header names, when its header is whole (its rows are not)
        self.torn_id: int | None = None
        #: whether the file was missing at the last read (a checkpoint may have deleted it meanwhile)
        self.missing = False
        #: (device, inode) of the file read: a segment a repair replaced is not the one this read
        self.identity: tuple[int, int] | None = None
        self._count = 0

    def read(self) -> list[Frame]:
        """The whole frames appended since the last read (none if the file does not exist)."""
        try:
            with open(self.path, "rb") as fh:
                info = os.fstat(fh.fileno())
                if self.identity is not None and (info.st_dev, info.st_ino) != self.identity and self.offset:
                    raise CorruptionError(
                        f"WAL segment {self.path} was replaced while this process had read {self.offset} bytes of "
                        "it (by `trellis repair` in another process, or by hand): what this process read may be "
                        "gone; open the database again"
                    )
                self.identity = (info.st_dev, info.st_ino)
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            self.missing = True
            return []
        self.missing = False
        out: list[Frame] = []
        pos = 0
        self.torn_at = None
        self.torn_id = None
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if nl < 0:  # a header cut short: torn, or still being written
                self.torn_at = self.offset + pos
                break
            rec = _decodeencode_line(data[pos:nl])
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
                    self.torn_id = int(rec["id"]) if isinstance(rec.get("id"), int) else None
                    break
                self._problem(f"frame {self._count} (commit {rec.get('id')})'s rows fail their checksum")
            else:
                out.append(Frame(rec, payload))
            pos = end
        self.offset += pos
        return out

    def damaged_ids(self) -> set[int]:
        """Commit ids of the damaged frames whose headers name them (in the middle, or last)."""
        out = {int(m.split("(commit ", 1)[1].split(")", 1)[0]) for _, m in self.problems
               if "(commit " in m and m.split("(commit ", 1)[1].split(")", 1)[0].isdigit()}
        return out | ({self.torn_id} if self.torn_id is not None else set())

    def _problem(self, what: str) -> None:
        msg = f"{self.path}: {what}"
        if all(m != msg for _, m in self.problems):
            self.problems.append((self._count, msg))

    def append(self, record: dict[str, Any], payload: Payload) -> Frame:
        """Append one frame durably (one write, one fsync; writer lock held, tail repaired).

        A write or sync that fails cuts the frame off again before raising: the caller is told
        the commit failed (and may retry it), so no reader may find it. Should the cut fail too,
        ``CorruptionError`` says the commit's fate is unknown."""
        rec, data = encode(record, payload)
        if not os.path.exists(self.path):  # a new segment: its folder entry made durable first
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644))
            sync_dir(os.path.dirname(self.path))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            try:
                if os.write(fd, data) != len(data):
                    raise OSError(errno.ENOSPC, "short write (disk full?)")
                os.fsync(fd)
            except OSError as e:
                try:
                    os.ftruncate(fd, self.offset)
                    os.fsync(fd)
                except OSError as cut:
                    raise CorruptionError(
                        f"appending commit {record.get('id')} to {self.path} failed ({e}) and cutting it off failed "
                        f"too ({cut}): it may be visible or not; run `trellis verify`"
                    ) from e
                raise
        finally:
            os.close(fd)
        self.offset += len(data)
        self._count += 1
        return Frame.of(rec, payload)

    def cut_torn_tail(self) -> None:
        """Cut a torn frame off the end (writer lock held; never in a damaged segment)."""
        if self.torn_at is None or self.problems:
            return
        with open(self.path, "r+b") as fh:
            fh.truncate(self.torn_at)
            os.fsync(fh.fileno())
        self.torn_at = None


def _decodeencode_line(line: bytes) -> dict[str, Any] | None:
    rec = decode_line(line)
    return rec if rec is not None and rec.get("op") == "commit" else None


@dataclass(frozen=True)
class WalView:
    """The commits whose rows are in the WAL, not yet in Lance: ``upto`` is the last commit
    whose rows Lance holds (every commit the commit log records); above it, the first
    ``n_frames`` frames of ``rows``. Immutable: a reader takes one and reads it consistently
    while writers add frames."""

    upto: int = 0
    rows: WalRows | None = None
    n_frames: int = 0
    _cache: dict[str, pa.Table] = field(default_factory=dict, compare=False, repr=False)

    @property
    def frames(self) -> list[Frame]:
        """The WAL's commits above ``upto``, ascending."""
        return self.rows.frames[: self.n_frames] if self.rows is not None else []

    def table(self, name: str, schema: pa.Schema) -> pa.Table:
        """Every WAL row of table ``name`` (empty, with ``schema``, if none)."""
        t = self._cache.get(name)
        if t is None:
            t = self.rows.table(name, self.n_frames, schema) if self.rows is not None else schema.empty_table()
            self._cache[name] = t
        return t

    def touches(self, name: str, above: int, upto: int) -> bool:
        """Whether a frame with ``above < id <= upto`` holds rows of ``name``."""
        if self.rows is None:
            return False
        ids, at = self.rows.ids.get(name, []), self.rows.at.get(name, [])
        n = bisect.bisect_left(at, self.n_frames)  # the frames of this view
        i = bisect.bisect_right(ids, above, 0, n)
        return i < n and ids[i] <= upto


class WalRows:
    """The WAL's frames above a checkpoint, in lists that only grow (a view names a prefix),
    and per table the frames holding its rows. Readers get each table as one Arrow table,
    built from the frames added since the last build (one conversion for all of them)."""

    def __init__(self) -> None:
        self.frames: list[Frame] = []
        #: per table: ids of the frames holding its rows, and their positions in ``frames``
        self.ids: dict[str, list[int]] = {}
        self.at: dict[str, list[int]] = {}
        self._built: dict[str, tuple[int, pa.Table]] = {}
        self._lock = threading.Lock()

    def add(self, f: Frame) -> None:
        for name in f.names():
            self.ids.setdefault(name, []).append(f.id)
            self.at.setdefault(name, []).append(len(self.frames))
        self.frames.append(f)

    def table(self, name: str, n: int, schema: pa.Schema) -> pa.Table:
        """The rows of ``name`` in the first ``n`` frames, as one table of ``schema``."""
        with self._lock:
            done, t = self._built.get(name, (0, schema.empty_table()))
            if n < done or t.schema != schema:
                done, t = 0, schema.empty_table()
            new = [self.frames[i] for i in self.at.get(name, []) if done <= i < n]
            if new:
                t = pa.concat_tables([t, rows_table(new, name, schema)])
                if t.column(0).num_chunks > 16:
                    t = t.combine_chunks()
            if n >= done:
                self._built[name] = (n, t)
            return t

    def view(self, upto: int) -> WalView:
        return WalView(upto, self, len(self.frames))


# ------------------------------------------------------------------ copies, read and rewritten whole

#: The longest frame record line looked for when reading past damage (a record holds a commit's
#: meta, at most 64 KiB as JSON, and its message).
MAX_RECORD_BYTES = 4 << 20
_LINE_END = re.compile(rb"\t[0-9a-f]{8}\n")


@dataclass(frozen=True)
class Piece:
    """A run of a segment file's bytes, as :func:`pieces` reads them: a frame whose commit record
    line is whole (``record``; its rows as ``parts``, ``(table, format, bytes)`` split as the
    record says, and whether they pass their checksum: ``intact``), or bytes that are no whole
    frame (``record`` None: a damaged record line and what follows it up to the next whole frame,
    or a frame cut short at the end)."""

    raw: bytes
    record: dict[str, Any] | None = None
    parts: tuple[tuple[str, str, bytes], ...] = ()
    intact: bool = True


def _frame_at(data: bytes, pos: int) -> tuple[dict[str, Any], int] | None:
    """The frame record starting at ``pos`` and where its frame ends, when the record line is whole
    and its rows are all there (their checksum is not checked)."""
    nl = data.find(b"\n", pos)
    if nl < 0:
        return None
    rec = _decodeencode_line(data[pos:nl])
    if rec is None or not isinstance(rec.get("bytes", 0), int):
        return None
    end = nl + 1 + int(rec.get("bytes", 0))
    return (rec, end) if end <= len(data) else None


def _next_frame(data: bytes, pos: int) -> int:
    """Where the next whole frame (record and rows passing their checksums) starts at or after
    ``pos``; ``len(data)`` if none does. A record line ends ``\\t<crc32>\\n``: for each such end,
    the line's start is looked for backwards (the nearest ``{"`` whose line checks out)."""
    for m in _LINE_END.finditer(data, pos):
        end = m.start()
        lo = max(pos, data.rfind(b"\n", pos, end) + 1, end - MAX_RECORD_BYTES)  # a record line holds no newline
        c = end
        while True:
            c = data.rfind(b'{"', lo, c)
            if c < 0:
                break
            got = _frame_at(data, c)
            if got is not None and zlib.crc32(data[data.find(b"\n", c) + 1 : got[1]]) & 0xFFFFFFFF == int(
                    got[0].get("pcrc", -1)):
                return c
    return len(data)


def pieces(data: bytes) -> list[Piece]:
    """The bytes of a WAL segment (a copy, damaged perhaps) as :class:`Piece` s, in order, covering
    every byte: whole frames, and the damage between them. Unlike :class:`Segment`, which stops at a
    damaged record line (a writer must not guess), this reads on at the next whole frame."""
    out: list[Piece] = []
    pos = 0
    while pos < len(data):
        got = _frame_at(data, pos)
        if got is None:  # a damaged record line, or a frame cut short: up to the next whole frame
            nxt = _next_frame(data, pos + 1)
            out.append(Piece(data[pos:nxt]))
            pos = nxt
            continue
        rec, end = got
        head = data.find(b"\n", pos) + 1
        payload = data[head:end]
        parts: list[tuple[str, str, bytes]] = []
        at = 0
        split = True
        for item in rec.get("tables", []):
            try:
                name, n, *fmt = item
                parts.append((str(name), str(fmt[0]) if fmt else "ipc", payload[at : at + int(n)]))
                at += int(n)
            except (TypeError, ValueError):
                split = False
                break
        if not split or at != len(payload):  # the record does not describe its rows: damage
            nxt = _next_frame(data, pos + 1)
            out.append(Piece(data[pos:nxt]))
            pos = nxt
            continue
        intact = zlib.crc32(payload) & 0xFFFFFFFF == int(rec.get("pcrc", -1))
        out.append(Piece(data[pos:end], rec, tuple(parts), intact))
        pos = end
    return out


def frame_bytes(record: Mapping[str, Any], parts: Sequence[tuple[str, str, bytes]], *, intact: bool = True) -> bytes:
    """A frame of ``record`` and ``parts`` (its ``tables``, ``bytes`` and ``pcrc`` set from them).
    A frame whose rows failed their checksum (``intact`` False) keeps failing it: a rewrite must
    not make damaged rows look whole."""
    data = b"".join(p for _, _, p in parts)
    crc = zlib.crc32(data) & 0xFFFFFFFF
    if not intact:
        crc = int(record.get("pcrc", crc ^ 1))
        crc = crc ^ 1 if crc == zlib.crc32(data) & 0xFFFFFFFF else crc
    rec = {**record, "tables": [[name, len(p), fmt] for name, fmt, p in parts], "bytes": len(data), "pcrc": crc}
    return encode_line(rec) + data


def json_rows(part: bytes) -> list[dict[str, Any]] | None:
    """A JSON part's rows as written (values in their WAL form: ``{"$t": ...}`` times, ``{"$b": ...}``
    bytes, ``{"$f": ...}`` embeddings), or None when the part is not a JSON list of rows."""
    try:
        rows = json.loads(part)
    except (ValueError, RecursionError):
        return None
    return rows if isinstance(rows, list) and all(isinstance(r, dict) for r in rows) else None


def json_part(rows: list[dict[str, Any]]) -> bytes:
    """Rows (as :func:`json_rows` reads them) written back as a JSON part, as a writer writes them."""
    return _ENCODER.encode(rows).encode()


def ipc_part(t: pa.Table) -> bytes:
    """A table written as an Arrow IPC part, as a writer writes one."""
    return _ipc(t)
