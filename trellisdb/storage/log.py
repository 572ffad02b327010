"""The commit log: an append-only file of checksummed JSON lines.

It is the single source of truth for which commits exist. A commit is durable
and visible exactly when its ``commit`` record is on disk (fsynced). Records::

    {"op": "begin", "id": N}                 id N reserved, data being written
    {"op": "commit", "id": N, "time": ..., "meta": {...}}   N is committed (the commit point; meta optional)
    {"op": "tag", "name": "x", "id": N}      tag x names commit N
    {"op": "collected", "ids": [...]}        rows of aborted commits deleted
    {"op": "checkpoint-begin", "upto": N}     WAL commits up to N being appended to Lance
    {"op": "checkpoint", "upto": N, "wal": G} they are: their commit records precede this one;
                                             new small commits go to WAL segment G
    {"op": "purge-begin", "sessions": [...]}  a purge of these sessions' rows began (``trellisdb/purge.py``);
                                             its audit commit (``"purge": true``) says it finished

Small commits are not in this file until a checkpoint: they are frames of the write-ahead
log (``wal.py``), read after this file; ``LogState`` holds both (``wal``: the commits whose
rows are still in the WAL).

Each line is ``<json>\\t<crc32 hex>\\n``. A torn last line (a crash mid-append)
is ignored by readers and cut off by the next writer; a bad line in the middle
is corruption: it is reported and the database refuses writes.

After every append's fsync, ``commits.hwm`` (the *high-water mark*, outside the
log) records the log's durable length, the highest id begun and the last commit
(acknowledged only once the mark names it). A log that holds less than its mark
says lost records: its tail was cut or damaged. That is never mistaken for a torn
append: it is reported and writes are refused until ``trellis repair``
(``storage/recovery.py``).

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
import os
import threading
import warnings
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from trellisdb.errors import CorruptionError, TrellisWarning
from trellisdb.names import name_problem
from trellisdb.storage.lines import decode_line, encode_line, sync_dir
from trellisdb.storage.wal import Frame, Payload, Segment, WalRows, WalView, segment_files, segment_name

#: The high-water mark's file, next to the log.
HWM_FILE = "commits.hwm"

#: Width of the mark's text before its checksum: every mark has the same length, so a
#: rewrite in place always covers the last one (a version-1 mark was 128 wide: covered too).
_HWM_WIDTH = 192


@dataclass(frozen=True)
class HighWaterMark:
    """What ``commits.hwm`` says: commit ``id`` (made at ``time``) was acknowledged, id
    ``begun`` was the highest reserved, and the log was durably ``log_size`` bytes long;
    and where the checkpoints stood: Lance held every row of every commit up to ``upto``
    (the log's ``lance_upto``), a checkpoint of the WAL up to ``ckpt`` had begun, and new
    small commits went to WAL segment ``wal``.

    It is rewritten after the fsync of every append, so the log held at least that much
    then, and the log only grows (a torn tail that is cut lies beyond it). A commit is
    acknowledged once the mark names it; every commit up to ``id`` was complete then,
    since its Lance appends finished before its commit record. The checkpoint fields are
    what a repair needs when the log lost a checkpoint's records (``recovery.py``): which
    commits' rows in Lance are whole, and which WAL segment is current. A version-1 mark
    (written before them) has them as None: nothing is known of the checkpoints.

    >>> m = HighWaterMark(7, 1700000000.25, 8, 1234, upto=5, ckpt=6, wal=2)
    >>> len(m.encode()) == _HWM_WIDTH + 10, HighWaterMark.decode(m.encode()) == m
    (True, True)
    >>> HighWaterMark.decode(m.encode().replace(b"id=7", b"id=9")) is None  # fails its checksum
    True
    """

    id: int
    time: float
    begun: int
    log_size: int
    upto: int | None = None
    ckpt: int | None = None
    wal: int | None = None

    def encode(self) -> bytes:
        body = (f"trellis-hwm 2 id={self.id} time={self.time!r} begun={self.begun} "
                f"log_size={self.log_size} upto={self.upto or 0} ckpt={self.ckpt or 0} "
                f"wal={self.wal or 1}").ljust(_HWM_WIDTH)
        return f"{body}\t{zlib.crc32(body.encode()) & 0xFFFFFFFF:08x}\n".encode()

    @classmethod
    def decode(cls, data: bytes) -> HighWaterMark | None:
        """The mark in ``data``, or None when it is not a whole mark (a write torn by a crash)."""
        try:
            body, crc = data.split(b"\n", 1)[0].rsplit(b"\t", 1)
            if int(crc, 16) != zlib.crc32(body) & 0xFFFFFFFF:
                return None
            magic, version, *fields = body.decode().split()
            kv = dict(f.split("=", 1) for f in fields)
            if magic != "trellis-hwm" or version not in ("1", "2"):
                return None
            base = (int(kv["id"]), float(kv["time"]), int(kv["begun"]), int(kv["log_size"]))
            if version == "1":
                return cls(*base)
            return cls(*base, upto=int(kv["upto"]), ckpt=int(kv["ckpt"]), wal=int(kv["wal"]))
        except (ValueError, KeyError, UnicodeDecodeError):
            return None


def read_hwm(path: str) -> HighWaterMark | None:
    """The mark in file ``path``; None when there is none (a store written before marks
    existed) or it cannot be read whole: either way nothing is known of what the log held."""
    for _ in range(2):  # a read that overlapped a rewrite in place sees a mix: read again
        try:
            with open(path, "rb") as fh:
                data = fh.read(4096)
        except FileNotFoundError:
            return None
        mark = HighWaterMark.decode(data)
        if mark is not None:
            return mark
    return None


def write_hwm(path: str, mark: HighWaterMark, sync: bool = True) -> None:
    """Rewrite the mark in place (one fixed-size write), durably unless ``sync`` is off.

    The mark is written only after what it names is durable, so an unsynced mark that a power
    loss takes back only lags (a weaker witness), it never claims more than the log holds."""
    created = not os.path.exists(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, mark.encode(), 0)
        if sync or created:
            getattr(os, "fdatasync", os.fsync)(fd)
    finally:
        os.close(fd)
    if created:
        sync_dir(os.path.dirname(path))


@dataclass
class LogState:
    """What the log says, as of the bytes read so far."""

    commits: dict[int, dict[str, Any]] = field(default_factory=dict)
    begun: set[int] = field(default_factory=set)
    collected: set[int] = field(default_factory=set)
    #: begun ids neither committed nor collected (in flight or aborted)
    open_ids: set[int] = field(default_factory=set)
    tags: dict[str, int] = field(default_factory=dict)
    #: tags whose names break the name rules (``trellisdb/names.py``): not usable, listed by verify()
    invalid_tags: dict[str, int] = field(default_factory=dict)
    max_id: int = 0
    last_committed: int = 0
    #: (line number, message) for damaged lines in the middle of the log
    problems: list[tuple[int, str]] = field(default_factory=list)
    #: byte offset of the first damaged/torn byte at the end, if any
    torn_at: int | None = None
    #: the last commit this file records: Lance holds the rows of every commit up to it
    lance_upto: int = 0
    #: the commits this file records (the others of ``commits`` are WAL frames not yet checkpointed)
    logged: set[int] = field(default_factory=set)
    #: the ``upto`` of the last ``checkpoint`` record: Lance holds every WAL commit up to it
    checkpointed: int = 0
    #: the WAL segment new small commits go to
    wal_gen: int = 1
    #: the ``upto`` of the last checkpoint begun (a crash may have left its rows in Lance)
    checkpoint_begun: int = 0
    #: the commits above ``lance_upto`` whose rows are in the WAL
    wal: WalView = field(default_factory=WalView)
    #: the id of the last purge's audit commit (0: none): rows were deleted from every version
    #: then, so what a reader mirrored or cached before it is stale (``reader.py`` starts over)
    purged: int = 0
    #: sessions of a purge that began and has not finished (a crash): running it again finishes it
    purging: tuple[str, ...] = ()

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
        self.hwm_path = os.path.join(os.path.dirname(path), HWM_FILE)
        self._state = LogState()
        self._offset = 0
        self._lineno = 0
        #: the file's length at the last refresh, and its identity (a repair replaces the file)
        self._size = 0
        self._identity: tuple[int, int] | None = None
        #: the last whole line read, and where: a replaced file holding it there is the same log
        self._last_line: tuple[int, bytes] = (0, b"")
        # Threads of one process share the state; two refreshing at once
        # would both apply the same bytes and move the offset twice.
        self._refreshing = threading.Lock()
        #: the WAL segment being read, and the frames read from it above ``lance_upto``
        self._segment = Segment(self.wal_path(1))
        self._rows = WalRows()
        #: the log's and the segment's (device, inode, size) and the mark right after this
        #: process's last commit: while they are unchanged, the next commit reads nothing
        self._written: tuple[tuple[int, int, int], tuple[int, int, int], HighWaterMark] | None = None

    def wal_path(self, gen: int) -> str:
        return os.path.join(os.path.dirname(self.path), segment_name(gen))

    @property
    def state(self) -> LogState:
        return self._state

    def refresh(self) -> LogState:
        """Read records appended since the last call; return the state."""
        with self._refreshing:
            return self._refresh()

    @property
    def end_of_records(self) -> int:
        """Bytes of whole lines read: the log up to a torn or damaged final line, if any."""
        return self._offset

    def reload(self) -> LogState:
        """Forget what was read and read the log from its start (after a repair replaced it)."""
        with self._refreshing:
            self._written = None
            self._state = LogState()
            self._offset = self._lineno = self._size = 0
            self._identity = None
            self._last_line = (0, b"")
            self._segment = Segment(self.wal_path(1))
            self._rows = WalRows()
            return self._refresh()

    def _refresh(self) -> LogState:
        """Read the log's new records, then the current WAL segment's new frames. A checkpoint may
        land between the two: its record after the log was read, the segment the log named deleted
        before it was read. So a missing segment while the log grew meanwhile is read again, from
        the log on (the checkpoint's record names the next segment)."""
        st = self._refresh_once()
        for _ in range(8):
            if not self._segment.missing:
                break
            try:
                grew = os.path.getsize(self.path) > self._size
            except OSError:
                break
            if not grew:
                break
            st = self._refresh_once()
        return st

    def _refresh_once(self) -> LogState:
        try:
            with open(self.path, "rb") as fh:
                info = os.fstat(fh.fileno())
                self._check_same_file(fh, info)
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError as e:
            raise CorruptionError(f"commit log {self.path} is missing; restore it from a backup") from e
        self._size = self._offset + len(data)
        if not data:
            self._state.torn_at = None  # a torn tail read before has been cut since
            self._refresh_wal()
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
            rec = decode_line(line)
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
        if pos:
            start = data.rfind(b"\n", 0, pos - 1) + 1
            self._last_line = (self._offset + start, data[start:pos])
        self._offset += pos
        self._refresh_wal()
        return st

    def _refresh_wal(self) -> None:
        """Read the frames appended to the current WAL segment since the last read."""
        st = self._state
        if segment_name(st.wal_gen) != os.path.basename(self._segment.path):
            self._segment = Segment(self.wal_path(st.wal_gen))  # a checkpoint started a new segment
        new = self._segment.read()
        for f in new:
            self._apply_frame(f)
        st.problems.extend(p for p in self._segment.problems if p not in st.problems)
        self._publish(bool(new))

    def _apply_frame(self, f: Frame) -> None:
        st = self._state
        st.commits[f.id] = f.record
        st.open_ids.discard(f.id)
        st.max_id = max(st.max_id, f.id)
        st.last_committed = max(st.last_committed, f.id)
        if f.id > st.lance_upto:
            self._rows.add(f)

    def _publish(self, changed: bool) -> None:
        st = self._state
        if changed or st.wal.upto != st.lance_upto:
            if self._rows.frames and self._rows.frames[0].id <= st.lance_upto:  # checkpointed
                rows = WalRows()
                for f in self._rows.frames:
                    if f.id > st.lance_upto:
                        rows.add(f)
                self._rows = rows
            st.wal = self._rows.view(st.lance_upto)

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
            st.lance_upto = max(st.lance_upto, cid)
            st.logged.add(cid)
            if rec.get("purge") is True:  # a purge's audit commit: it finished
                st.purged = max(st.purged, cid)
                st.purging = ()
        elif op == "purge-begin":
            st.purging = tuple(sorted({*st.purging, *(str(x) for x in rec.get("sessions", []))}))
        elif op == "checkpoint-begin":
            st.checkpoint_begun = max(st.checkpoint_begun, int(rec["upto"]))
        elif op == "checkpoint":
            st.wal_gen = max(st.wal_gen, int(rec["wal"]))
            st.checkpointed = max(st.checkpointed, int(rec["upto"]))
        elif op == "tag":
            name = str(rec["name"])
            st.tags.pop(name, None)
            st.invalid_tags.pop(name, None)
            # a name no check let through (a store written before names were checked): kept
            # apart, so that every read does not fail on it; verify() names it
            (st.invalid_tags if name_problem(name) else st.tags)[name] = int(rec["id"])
        elif op == "untag":
            st.tags.pop(str(rec["name"]), None)
            st.invalid_tags.pop(str(rec["name"]), None)
        elif op == "collected":
            ids = [int(i) for i in rec["ids"]]
            st.collected.update(ids)
            st.open_ids.difference_update(ids)

    def _check_same_file(self, fh: BinaryIO, info: os.stat_result) -> None:
        """Refuse a log that shrank below what was read, or was replaced by one that differs
        there, since the last read: records this process holds may be gone, and reading on
        would misread lines. (A repair that only appended to the part read is no change.)"""
        identity = (info.st_dev, info.st_ino)
        if self._identity is not None and identity != self._identity:
            start, line = self._last_line
            fh.seek(start)
            if fh.read(len(line)) != line:
                raise CorruptionError(
                    f"commit log {self.path} was replaced while this process had it open (by `trellis repair` "
                    "in another process, or by hand), and what this process read is not where it was; open "
                    "the database again"
                )
        self._identity = identity
        if info.st_size < self._offset:
            raise CorruptionError(
                f"commit log {self.path} shrank to {info.st_size} bytes while this process had read "
                f"{self._offset}: records it had read are gone. Open the database again; `trellis verify` "
                "names what was lost and `trellis repair` recovers what the tables still hold"
            )

    def acknowledged(self) -> HighWaterMark | None:
        """The high-water mark (read it *before* a refresh that it is compared with)."""
        return read_hwm(self.hwm_path)

    def lost(self, mark: HighWaterMark | None) -> str | None:
        """What the log lacks of what ``mark`` says it held, or None (nothing, or no mark).

        Call right after a refresh that followed reading ``mark``: the log only grows once a mark
        is written, so a log read later that holds less lost records.
        """
        what = self._lost_checkpoints(mark)
        if mark is None:
            return f"commit log {self.path} lost records: {'; '.join(what)}" if what else None
        last = self._state.last_committed
        if mark.id > last:
            what.append(f"it ends at commit {last}, but commit {mark.id} was acknowledged")
        if self._offset < mark.log_size:
            if self._size < mark.log_size:
                what.append(f"it is {self._size} bytes long, but {mark.log_size} were written (its tail was cut)")
            else:
                what.append(f"its last line, line {self._lineno + 1} (at byte {self._offset}), is damaged, and it "
                            "was written whole")
        if not what:
            return None
        return f"commit log {self.path} lost records ({HWM_FILE} says so): {'; '.join(what)}"

    def _lost_checkpoints(self, mark: HighWaterMark | None) -> list[str]:
        """What the log lost of its checkpoints: a WAL segment newer than the one it names
        exists (frames go to a segment only after the ``checkpoint`` record naming it is
        durable), or the mark names a later checkpoint or Lance commit than the log holds."""
        st = self._state
        later = self.later_segments()
        for _ in range(4):  # listed after the log was read: checkpoints may have come between
            if not later:
                break
            st = self.refresh()
            later = self.later_segments()
        what = []
        if later:
            what.append(f"WAL segment {os.path.basename(later[-1])} exists, but the log's last checkpoint record names "
                        f"{segment_name(st.wal_gen)} (a checkpoint's record was lost)")
        if mark is not None and mark.upto is not None and mark.ckpt is not None and mark.wal is not None:
            if mark.wal > st.wal_gen and not later:
                what.append(f"a checkpoint started WAL segment {segment_name(mark.wal)}, but the log's last "
                            f"checkpoint record names {segment_name(st.wal_gen)}")
            if mark.upto > st.lance_upto:
                what.append(f"its records of commits in Lance end at {st.lance_upto}, but they reached {mark.upto}")
            if mark.ckpt > st.checkpoint_begun:
                what.append(f"a checkpoint of the WAL up to commit {mark.ckpt} began, but the log's last "
                            f"checkpoint-begin record says {st.checkpoint_begun}")
        return what

    def later_segments(self) -> list[str]:
        """Paths of WAL segments newer than the one the log names (ascending): only a log that
        lost a ``checkpoint`` record has any."""
        return [p for g, p in segment_files(os.path.dirname(self.path)) if g > self._state.wal_gen]

    def repair_tail(self) -> HighWaterMark | None:
        """Cut a torn final line off (call only while holding the writer lock); return the mark.

        A tail whose cut would lose what the mark says was written whole is damage, not a torn
        append: it is left as it is and ``CorruptionError`` refuses the write.
        """
        if self._quiet():  # nothing changed since this process's own last commit: nothing to read
            return self._written[2] if self._written is not None else None
        self._written = None
        mark = self.acknowledged()
        st = self.refresh()
        lost = self.lost(mark)
        if lost:
            raise CorruptionError(
                f"{lost}. Writes are refused until db.repair() (`trellis repair`) recovers the acknowledged "
                f"commits the tables still hold; reads still work, as of commit {st.last_committed}"
            )
        if st.torn_at is not None:
            with open(self.path, "r+b") as fh:
                fh.truncate(st.torn_at)
                os.fsync(fh.fileno())
            st.torn_at = None
            self._size = self._offset
        self._segment.cut_torn_tail()
        return mark

    def _files(self) -> tuple[tuple[int, int, int], tuple[int, int, int]] | None:
        """(device, inode, size) of the log and of the current WAL segment."""
        try:
            a, b = os.stat(self.path), os.stat(self._segment.path)
        except OSError:
            return None
        return (a.st_dev, a.st_ino, a.st_size), (b.st_dev, b.st_ino, b.st_size)

    def _quiet(self) -> bool:
        """Whether the log and the WAL segment are exactly as this process's last commit left
        them (no other writer, repair or damage since): its state and its mark are current."""
        return self._written is not None and self._files() == self._written[:2]

    def append_frame(self, record: dict[str, Any], payload: Payload) -> None:
        """Commit a small commit: one frame (its record and rows) appended to the WAL and
        fsynced, then the mark, unsynced (writer lock held, after ``repair_tail``)."""
        with self._refreshing:
            f = self._segment.append(record, payload)
            self._apply_frame(f)
            self._publish(True)
            st = self._state
            mark = HighWaterMark(f.id, float(record["time"]), st.max_id, self._offset, upto=st.lance_upto,
                                 ckpt=st.checkpoint_begun, wal=st.wal_gen)
            try:
                write_hwm(self.hwm_path, mark, sync=False)
                files = self._files()
                self._written = None if files is None or st.torn_at is not None else (*files, mark)
            except OSError as e:
                warnings.warn(TrellisWarning(f"could not update {self.hwm_path} ({e}); the commit is durable, "
                                             "but its witness is stale"), stacklevel=3)

    def rewrite_wal(self, folder: str, gen: int | None = None) -> int:
        """Drop the damaged frames of WAL segment ``gen`` (default: the current one; writer lock
        held; a repair): copy the segment to ``folder``, write its intact frames aside and rename
        them over it. Returns how many damaged frames were dropped (their commits are lost)."""
        seg = Segment(self.wal_path(self._state.wal_gen if gen is None else gen))
        frames = seg.read()
        if not seg.problems and seg.torn_at is None:
            return 0
        # a damaged last frame is cut too (a torn append's, or an acknowledged one's the mark names:
        # either way its copy is kept)
        with open(seg.path, "rb") as fh:
            before = fh.read()
        name = os.path.basename(seg.path)
        for path, data in ((os.path.join(folder, name), before),
                           (seg.path + ".repair", b"".join(f.raw() for f in frames))):
            with open(path, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(seg.path + ".repair", seg.path)
        sync_dir(os.path.dirname(seg.path))
        return len(seg.problems) + (seg.torn_id is not None)

    def wal_segments(self) -> list[str]:
        """Paths of WAL segments older than the current one (left by checkpoints; deletable). A
        newer one is never deleted: it holds commits of a checkpoint the log lost (a repair finds it)."""
        return [p for g, p in segment_files(os.path.dirname(self.path)) if g < self._state.wal_gen]

    def rewrite(self, keep: int, records: list[dict[str, Any]]) -> LogState:
        """Keep the whole, intact lines of the first ``keep`` bytes of the log, then ``records``
        (writer lock held); read it again and set the mark to its last commit. Only a repair does
        this (after copying the log aside).

        The new log is written aside and renamed over the old one: a crash leaves one or the
        other, and a process that had the old one open is told it was replaced (it must open
        the database again) instead of reading shifted lines.
        """
        with open(self.path, "rb") as fh:
            head = fh.read(keep)
        good = [line for line in head.splitlines(keepends=True) if decode_line(line) is not None]
        tmp = self.path + ".repair"
        with open(tmp, "wb") as fh:
            fh.write(b"".join(good) + b"".join(encode_line(r) for r in records))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        sync_dir(os.path.dirname(self.path))
        st = self.reload()
        at = float(st.commits[st.last_committed]["time"]) if st.last_committed else 0.0
        write_hwm(self.hwm_path, HighWaterMark(st.last_committed, at, st.max_id, self._size, upto=st.lance_upto,
                                               ckpt=st.checkpoint_begun, wal=st.wal_gen))
        return st

    def append(self, records: list[dict[str, Any]]) -> None:
        """Append records durably (call only while holding the writer lock, after a refresh);
        then rewrite the high-water mark (a ``commit`` is acknowledged from then on)."""
        payload = b"".join(encode_line(r) for r in records)
        self._written = None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, payload)
            os.fsync(fd)
            end = os.fstat(fd).st_size  # under the writer lock: no one appended after us
        finally:
            os.close(fd)
        self._mark(records, end)

    def _mark(self, records: list[dict[str, Any]], end: int) -> None:
        st = self._state
        cid, at = st.last_committed, float(st.commits[st.last_committed]["time"]) if st.last_committed else 0.0
        begun, upto, ckpt, wal = st.max_id, st.lance_upto, st.checkpoint_begun, st.wal_gen
        for r in records:  # what these records add to the state (the next refresh applies them)
            op = r.get("op")
            if op in ("begin", "commit"):
                begun = max(begun, int(r["id"]))
            if op == "commit":
                upto = max(upto, int(r["id"]))  # a commit record in this file: Lance holds its rows
                if int(r["id"]) >= cid:
                    cid, at = int(r["id"]), float(r["time"])
            elif op == "checkpoint-begin":
                ckpt = max(ckpt, int(r["upto"]))
            elif op == "checkpoint":
                wal = max(wal, int(r["wal"]))
        try:
            write_hwm(self.hwm_path, HighWaterMark(cid, at, begun, end, upto=upto, ckpt=ckpt, wal=wal))
        except OSError as e:
            # Past the commit point: raising would make a caller retry a commit that is durable.
            # A stale mark is only a weaker witness (a later loss of these records goes unnoticed
            # until verify scans the tables); the next append rewrites it.
            warnings.warn(TrellisWarning(f"could not update {self.hwm_path} ({e}); the records are durable, "
                                         "but their witness is stale"), stacklevel=3)


def create(path: str) -> None:
    """Create an empty commit log."""
    with open(path, "xb") as fh:
        os.fsync(fh.fileno())
