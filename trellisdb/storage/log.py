"""The commit log: an append-only file of checksummed JSON lines.

It is the single source of truth for which commits exist. A commit is durable
and visible exactly when its ``commit`` record is on disk (fsynced). Records::

    {"op": "begin", "id": N}                 id N reserved, data being written
    {"op": "commit", "id": N, "time": ...}   N is committed (the commit point)
    {"op": "tag", "name": "x", "id": N}      tag x names commit N
    {"op": "collected", "ids": [...]}        rows of aborted commits deleted

Each line is ``<json>\\t<crc32 hex>\\n``. A torn last line (a crash mid-append)
is ignored by readers and cut off by the next writer; a bad line in the middle
is corruption: it is reported and the database refuses writes.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp()
    >>> create(os.path.join(d, "commits.log"))
    >>> log = CommitLog(os.path.join(d, "commits.log"))
    >>> log.append([{"op": "begin", "id": 1}, {"op": "commit", "id": 1, "time": 0.0}])
    >>> log.refresh().last_committed
    1
"""

from __future__ import annotations

import datetime as dt
import json
import os
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trellisdb.errors import CorruptionError


def _encode(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True)
    crc = zlib.crc32(body.encode()) & 0xFFFFFFFF
    return f"{body}\t{crc:08x}\n".encode()


def _decode(line: bytes) -> dict[str, Any] | None:
    """The record of one complete line, or None when the line is damaged."""
    try:
        body, crc = line.rstrip(b"\n").rsplit(b"\t", 1)
        if int(crc, 16) != zlib.crc32(body) & 0xFFFFFFFF:
            return None
        rec = json.loads(body)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


@dataclass
class LogState:
    """What the log says, as of the bytes read so far."""

    commits: dict[int, dict[str, Any]] = field(default_factory=dict)
    begun: set[int] = field(default_factory=set)
    collected: set[int] = field(default_factory=set)
    #: begun ids neither committed nor collected (in flight or aborted)
    open_ids: set[int] = field(default_factory=set)
    tags: dict[str, int] = field(default_factory=dict)
    max_id: int = 0
    last_committed: int = 0
    #: (line number, message) for damaged lines in the middle of the log
    problems: list[tuple[int, str]] = field(default_factory=list)
    #: byte offset of the first damaged/torn byte at the end, if any
    torn_at: int | None = None

    def aborted(self, below: int | None = None) -> list[int]:
        """Reserved ids that never committed and whose rows are not yet collected.

        Only ids below ``below`` are returned (ids above the last commit may
        belong to a writer still in flight).
        """
        limit = self.last_committed if below is None else below
        return sorted(i for i in list(self.open_ids) if i <= limit)  # list(): atomic under a concurrent refresh


def last_commit_at(commits: Mapping[int, Mapping[str, Any]], ts: dt.datetime) -> int:
    """The last commit made at or before ``ts`` (0 if none); naive times are UTC.

    Times compare in whole microseconds, the precision ``log()`` and the
    ``commits`` table show, so a time copied from them names that commit.
    """
    ts = ts if ts.tzinfo else ts.replace(tzinfo=dt.UTC)
    us = (ts - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)) // dt.timedelta(microseconds=1)
    ids = [i for i, r in list(commits.items()) if int(r["time"] * 1_000_000) <= us]
    return max(ids) if ids else 0


class CommitLog:
    """Incremental reader and appender of one commit-log file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._state = LogState()
        self._offset = 0
        self._lineno = 0
        # Threads of one process share the state; two refreshing at once
        # would both apply the same bytes and move the offset twice.
        self._refreshing = threading.Lock()

    @property
    def state(self) -> LogState:
        return self._state

    def refresh(self) -> LogState:
        """Read records appended since the last call; return the state."""
        with self._refreshing:
            return self._refresh()

    def _refresh(self) -> LogState:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError as e:
            raise CorruptionError(f"commit log {self.path} is missing; restore it from a backup") from e
        if not data:
            return self._state
        st = self._state
        pos = 0
        st.torn_at = None
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if nl < 0:  # torn last line: a crash mid-append; not a record
                st.torn_at = self._offset + pos
                break
            line = data[pos : nl + 1]
            rec = _decode(line)
            if rec is None:
                if data.find(b"\n", nl + 1) < 0 and not data[nl + 1 :].strip():
                    # damaged final line: treat like a torn append
                    st.torn_at = self._offset + pos
                    break
                st.problems.append((self._lineno + 1, f"{self.path}: line {self._lineno + 1} fails its checksum"))
            else:
                self._apply(rec)
            self._lineno += 1
            pos = nl + 1
        self._offset += pos
        return st

    def _apply(self, rec: dict[str, Any]) -> None:
        st = self._state
        op = rec.get("op")
        if op == "begin":
            st.begun.add(int(rec["id"]))
            if int(rec["id"]) not in st.commits and int(rec["id"]) not in st.collected:
                st.open_ids.add(int(rec["id"]))
            st.max_id = max(st.max_id, int(rec["id"]))
        elif op == "commit":
            cid = int(rec["id"])
            st.commits[cid] = rec
            st.open_ids.discard(cid)
            st.max_id = max(st.max_id, cid)
            st.last_committed = max(st.last_committed, cid)
        elif op == "tag":
            st.tags[str(rec["name"])] = int(rec["id"])
        elif op == "untag":
            st.tags.pop(str(rec["name"]), None)
        elif op == "collected":
            ids = [int(i) for i in rec["ids"]]
            st.collected.update(ids)
            st.open_ids.difference_update(ids)

    def repair_tail(self) -> None:
        """Cut a torn final line off (call only while holding the writer lock)."""
        self.refresh()
        if self._state.torn_at is not None:
            with open(self.path, "r+b") as fh:
                fh.truncate(self._state.torn_at)
                os.fsync(fh.fileno())
            self._state.torn_at = None

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append records durably (call only while holding the writer lock)."""
        payload = b"".join(_encode(r) for r in records)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, payload)
            os.fsync(fd)
        finally:
            os.close(fd)


def create(path: str) -> None:
    """Create an empty commit log."""
    with open(path, "xb") as fh:
        os.fsync(fh.fileno())
