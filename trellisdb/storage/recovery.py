"""A commit log that lost records: found, reported and repaired.

The log is the only record of which commits exist. A log that lost its tail (a
copy cut short, a damaged last block) would drop acknowledged commits without a
word, and the next writer would reuse their ids: their rows, still in the
tables, would come back inside the new commit (or, a ``begin`` surviving
without its ``commit``, be collected as aborted). Two witnesses outside the log
catch it:

- the high-water mark ``commits.hwm`` (``log.py``): the log's durable length,
  the highest id begun and the last acknowledged commit. A log holding less lost
  records. Checked at open (a ``TrellisWarning``), before every commit and tag
  (``CorruptionError``) and by ``verify``;
- the tables: every row carries its ``commit_id``. A row of a commit the log does
  not record is *stranded*. Finding them scans the ``commit_id`` column of every
  table (76 ms at 1M nodes), so a writer looks only when the mark and the log
  disagree in any way (no mark, another last commit, another length: after a
  crash, an older release, damage); ``verify`` always looks.

:meth:`LogGuard.repair` keeps only commits whose every row it can prove (:func:`diagnose`):
a whole WAL frame (its rows are in it; a frame of an older segment, whose checkpoint finished,
gets its own record back), or Lance rows that a record says are whole: the commit's own record,
a ``checkpoint`` record or the mark's ``upto`` (written after those), a WAL segment newer than
the one the log names (only a finished checkpoint starts one), or, for a direct commit (its
``begin`` logged), the mark's commit at or above it, or a later commit (had it been aborted, that
writer would have collected it first). Those get a recovered commit record
(``"recovered": true``). Rows a checkpoint that died half-way left in Lance are never taken for
whole: they are deleted while their frames remain, and a commit whose frame is gone with only
such rows left is named *lost*, with the reason. Rows of other ids were never acknowledged (the
writer may have died half-way). Rows taken out are copied to
``lost+found/<UTC time>/<table>.parquet``, deleted, and their ids logged as collected, so no id
is used twice. The log keeps its intact lines: a damaged tail, and damaged lines in the middle,
are dropped (the log as it was is copied to ``lost+found/<UTC time>/commits.log`` first), and a
``checkpoint`` record it lost is written again. What the lost lines said that no row or frame
witnesses (tags, the messages of commits recovered from rows) cannot be recovered.

    >>> import tempfile, trellisdb
    >>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
    >>> db.repair()["damage"]  # a healthy store: nothing to do
    []
"""

from __future__ import annotations

import datetime as dt
import json
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trellisdb.errors import CorruptionError, TrellisWarning
from trellisdb.storage.log import HWM_FILE, CommitLog, HighWaterMark, LogState
from trellisdb.storage.tables import LanceTables
from trellisdb.storage.wal import Frame, Segment, segment_files

#: Where repair puts what it takes out: ``<db>/lost+found/<UTC time>/``.
LOST_FOUND = "lost+found"

#: How the refusals end: what to run.
_RUN_REPAIR = "writes are refused until db.repair() (`trellis repair`) recovers what the tables still hold"


@dataclass
class Unlogged:
    """Rows of one commit id that the log has no commit record for."""

    rows: dict[str, int] = field(default_factory=dict)
    #: the newest ``created_at`` among them (seconds since the epoch), if a table has that column
    newest: float | None = None

    @property
    def total(self) -> int:
        return sum(self.rows.values())


def _ids(ids: Iterable[int]) -> str:
    """``1..3, 7`` for [1, 2, 3, 7]; long lists are cut."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}..{b}" for a, b in runs]
    return ", ".join(parts[:8]) + (f", ... ({len(parts) - 8} more runs)" if len(parts) > 8 else "")


def _without_commit(st: LogState) -> str:
    """A Lance filter for rows whose id this file of the log has no commit record of: above its
    last one (WAL commits whose checkpoint did not finish among them), and the gaps below it."""
    last = st.lance_upto
    gaps = sorted(i for i in (st.begun | st.collected) if i <= last and i not in st.logged)
    if last - len(st.logged) > len(gaps):  # ids below the last commit with no begin either
        gaps = [i for i in range(1, last + 1) if i not in st.logged]
    pred = f"commit_id > {int(last)} OR commit_id < 1"
    return pred + (f" OR commit_id IN ({', '.join(str(int(i)) for i in gaps)})" if gaps else "")


def scan_unlogged(tables: LanceTables, names: Iterable[str], st: LogState, times: bool = False) -> dict[int, Unlogged]:
    """The rows, per commit id, of every table whose commit the log's file does not record
    (including WAL commits a checkpoint that did not finish copied into Lance).

    One Lance scan per table, of the ``commit_id`` column (and ``created_at`` with
    ``times``) with a filter. A table that cannot be read is skipped: ``verify`` names it.
    """
    pred = _without_commit(st)
    out: dict[int, Unlogged] = {}
    for name in names:
        try:
            ds = tables.dataset(name)
            cols = [c for c in ("commit_id", "created_at") if c in ds.schema.names and (times or c == "commit_id")]
            t = ds.to_table(columns=cols, filter=pred)
        except (OSError, ValueError, RuntimeError, CorruptionError):
            continue
        if not t.num_rows:
            continue
        aggs: list[tuple[str, str]] = [("commit_id", "count")]
        if "created_at" in cols:
            aggs.append(("created_at", "max"))
            t = t.set_column(1, "created_at", pc.cast(t.column("created_at"), pa.timestamp("us", "UTC")).cast(pa.int64()))
        for r in t.group_by("commit_id").aggregate(aggs).to_pylist():
            u = out.setdefault(int(r["commit_id"]), Unlogged())
            u.rows[name] = int(r["commit_id_count"])
            newest = r.get("created_at_max")
            if newest is not None:
                u.newest = max(u.newest or 0.0, newest / 1e6)
    return out


@dataclass
class WalFiles:
    """Every WAL segment in the store's folder, read afresh: per generation its whole frames
    and its damage."""

    frames: dict[int, list[Frame]] = field(default_factory=dict)
    problems: dict[int, list[str]] = field(default_factory=dict)
    #: ids of damaged frames whose header names them: in the middle, or the last one (its rows failing
    #: their checksum, a torn append's sign too; a repair tells them apart by the mark)
    damaged: set[int] = field(default_factory=set)

    @classmethod
    def read(cls, folder: str) -> WalFiles:
        out = cls()
        for gen, path in segment_files(folder):
            seg = Segment(path)
            out.frames[gen] = seg.read()
            out.problems[gen] = [m for _, m in seg.problems]
            out.damaged |= seg.damaged_ids()
        return out


@dataclass
class Diagnosis:
    """What the log, its mark, the WAL segments and the tables say together (see the module
    notes): which commit ids a repair records, recovers, takes out, and which are lost."""

    #: the WAL segment that is current: the log's, or a newer one whose checkpoint record it lost
    gen: int
    #: Lance holds every row of every commit up to this id (a checkpoint or commit record says so,
    #: in the log or in the mark, or a newer WAL segment proves the checkpoint before it finished)
    proven: int
    #: commits the log has no record of whose rows Lance holds whole, with their WAL frames' records
    from_frames: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: commits proven complete with rows but no record anywhere: given back a recovered record
    recover: list[int] = field(default_factory=list)
    #: rows of commits never acknowledged (or aborted, or not provably whole): to lost+found
    remove: list[int] = field(default_factory=list)
    #: the commit a writer died in (begun, never committed, the last): the next writer collects it
    open_ids: list[int] = field(default_factory=list)
    #: WAL commits of the current segment with rows in Lance from a checkpoint that did not finish
    leftovers: list[int] = field(default_factory=list)
    #: those of them no ``checkpoint-begin`` record covers: the next checkpoint would add them twice
    uncovered: list[int] = field(default_factory=list)
    #: acknowledged commits that cannot be given back, with the reason
    lost: dict[int, str] = field(default_factory=dict)
    #: the highest commit id the log or any WAL frame holds
    used: int = 0

    @property
    def damage(self) -> bool:
        """Whether a repair has something to do (leftovers a checkpoint-begin covers are normal)."""
        return bool(self.from_frames or self.recover or self.remove or self.uncovered or self.lost)


def _frame_record(f: Frame) -> dict[str, Any]:
    """A frame's commit record as a checkpoint writes it to the log (without the payload's description)."""
    return {k: v for k, v in f.record.items() if k not in ("tables", "bytes", "pcrc")}


def diagnose(st: LogState, mark: HighWaterMark | None, wal: WalFiles, found: dict[int, Unlogged]) -> Diagnosis:
    """Weigh the witnesses (``st``: the log read whole; ``found``: ``scan_unlogged``'s rows).

    Lance rows of a commit are whole when a record says Lance holds that commit: the commit's own
    record in the log (its appends finished before it), a ``checkpoint`` record, the mark's
    ``upto`` (written after those records), or a newer WAL segment (frames go to one only after
    the checkpoint before it finished). A direct commit (``begin`` in the log) is also whole when
    acknowledged or followed by a later commit, as before. Nothing else is: the rows a checkpoint
    that died half-way left in Lance are some tables of some commits, and a commit whose WAL frame
    is gone with only such rows left is lost (named, its rows kept in lost+found), never recovered.
    """
    v2 = mark is not None and mark.upto is not None and mark.wal is not None
    acknowledged = mark.id if mark is not None else 0
    gen = max([st.wal_gen, *(wal.frames or [0]), (mark.wal or 0) if v2 and mark is not None else 0])
    current = {f.id: f for f in wal.frames.get(gen, [])}
    older = {f.id: f for g, fs in wal.frames.items() if g < gen for f in fs}
    proven = max(st.lance_upto, st.checkpointed, (mark.upto or 0) if v2 and mark is not None else 0)
    if gen > st.wal_gen:  # the checkpoint into ``gen`` finished, though the log lost its record
        proven = max(proven, *older, 0)
        if current and not wal.problems.get(gen):
            proven = max(proven, min(current) - 1)
    d = Diagnosis(gen=gen, proven=proven)
    for x, f in sorted(older.items()):
        if x not in st.logged:
            d.from_frames[x] = _frame_record(f)
    for x, f in sorted(current.items()):
        if x <= proven and x not in st.logged:
            d.from_frames[x] = _frame_record(f)
    # the highest id any witness knows was used: a begun commit below it was not the last
    d.used = used = max([st.max_id, *(f.id for fs in wal.frames.values() for f in fs), 0])
    for x in sorted(found):
        if x in st.logged or x in d.from_frames:
            continue
        if x in current:
            d.leftovers.append(x)
            if x > st.checkpoint_begun:
                d.uncovered.append(x)
        elif x in st.collected:
            d.remove.append(x)
        elif x in st.begun:  # a direct commit
            if x <= acknowledged or x < used:
                d.recover.append(x)
            else:
                d.open_ids.append(x)
        elif x <= proven:
            d.recover.append(x)
        else:
            d.remove.append(x)
            if x <= acknowledged:
                d.lost[x] = (f"its WAL frame is gone, and its rows in {', '.join(sorted(found[x].rows))} were "
                             "copied into Lance by a checkpoint that did not finish (not provably all of them)")
    accounted = (st.logged | set(st.commits) | st.collected | st.begun | set(current) | set(d.from_frames)
                 | set(d.recover))
    # acknowledged ids with no trace: above the last commit the log and the WAL hold (ids below it
    # may have been skipped: a repair's retired ids move the next one up), and damaged frames'
    for x in sorted({*range(st.last_committed + 1, acknowledged + 1), *(i for i in wal.damaged if i <= acknowledged)}):
        if x not in accounted and x not in d.lost:
            d.lost[x] = ("its WAL frame is damaged (kept in lost+found/)" if x in wal.damaged else
                         "the log lost its record, and no WAL frame or row of it is left")
    return d


def _stranded_message(log: CommitLog, tables: LanceTables, found: dict[int, Unlogged], d: Diagnosis,
                      acknowledged: int) -> str:
    """What ``d`` found, for ``verify`` and a repair's report ('' when nothing)."""
    ids = [*d.recover, *d.remove, *d.uncovered]
    parts = []
    if d.from_frames:
        parts.append(f"commit(s) {_ids(d.from_frames)} are whole in Lance and in WAL frames, but the log lost their "
                     "records: repair records them from their frames")
    if d.recover:
        parts.append(f"commit(s) {_ids(d.recover)} are complete (acknowledged up to {acknowledged}, says {HWM_FILE}, "
                     "or proven by a checkpoint, or followed by later commits): repair recovers them")
    removed = [x for x in d.remove if x not in d.lost]
    if removed:
        parts.append(f"commit(s) {_ids(removed)} were never acknowledged: repair moves their rows to {LOST_FOUND}/")
    if d.uncovered:
        parts.append(f"rows of WAL commit(s) {_ids(d.uncovered)} were copied into Lance by a checkpoint the log has "
                     "no checkpoint-begin record of (the next checkpoint would add them twice): repair deletes them, "
                     "their WAL frames keep them")
    for x, why in sorted(d.lost.items()):
        parts.append(f"commit {x} was acknowledged and cannot be recovered: {why}"
                     + (f"; repair moves its rows to {LOST_FOUND}/" if x in found else ""))
    if not parts:
        return ""
    names = sorted({t for x in ids if x in found for t in found[x].rows})
    rows = sum(found[x].total for x in ids if x in found)
    where = (f"{rows} rows in {', '.join(tables.uri(n) for n in names)} belong to commits that commit log "
             f"{log.path} does not record" if rows else f"commit log {log.path} does not record every commit")
    return f"{where} ({'; '.join(parts)})"


class LogGuard:
    """Holds one open database's commit log to its witnesses (see the module notes)."""

    def __init__(self, log: CommitLog, tables: LanceTables, names: Callable[[], list[str]]) -> None:
        self._log = log
        self._tables = tables
        self._names = names
        #: the highest commit id known to be used, in the log or beyond it (the mark, stranded rows):
        #: no new commit takes it, and the reader's mirror keeps fragments above it unsettled
        self.ceiling = 0

    def open(self) -> None:
        """Read the log (at connect); warn, naming the damage, when it lost acknowledged records."""
        mark = self._log.acknowledged()  # before the log: a commit in between must not look lost
        st = self._log.refresh()
        if mark is not None:
            self.ceiling = max(self.ceiling, mark.begun)
        lost = self._log.lost(mark)
        if lost:
            warnings.warn(TrellisWarning(f"{lost}. Reads work, as of commit {st.last_committed}; {_RUN_REPAIR}"),
                          stacklevel=4)  # LogGuard.open < Database.__init__ < connect < the caller

    def check_rows(self, st: LogState, mark: HighWaterMark | None) -> None:
        """Refuse a commit while rows of commits the log does not record exist (writer lock held,
        after ``repair_tail``). The tables are scanned only when the mark and the log disagree."""
        if mark is not None and mark.id == st.last_committed and mark.log_size == self._log.end_of_records:
            return  # the log ends exactly where the last acknowledgement left it
        acknowledged = mark.id if mark is not None else 0
        found = scan_unlogged(self._tables, self._names(), st)
        d = diagnose(st, mark, WalFiles.read(os.path.dirname(self._log.path)), found)
        if d.damage:
            self.ceiling = max(self.ceiling, *found, *d.lost, *d.from_frames)
            raise CorruptionError(
                f"{_stranded_message(self._log, self._tables, found, d, acknowledged)}; {_RUN_REPAIR}"
            )

    def next_id(self, st: LogState, mark: HighWaterMark | None) -> int:
        """The id of the next commit: above every id the log, the mark or the tables used."""
        return max(st.max_id, mark.begun if mark is not None else 0, self.ceiling) + 1

    def problems(self) -> list[str]:
        """Everything wrong with the log and its witnesses, each naming a file (for ``verify``).

        Reads the log afresh (a line damaged after this process read it is found too) and
        scans every table; takes no lock.
        """
        mark = self._log.acknowledged()
        fresh = CommitLog(self._log.path)
        st = fresh.refresh()
        out = [msg for _, msg in st.problems]
        if st.purging:
            out.append(f"{self._log.path}: a purge of sessions {list(st.purging)!r} began and did not finish (a "
                       "crash?); their rows may remain in the tables and their old versions: run the purge again "
                       "(db.purge, `trellis purge`; any purge finishes it)")
        lost = fresh.lost(mark)
        if lost:
            out.append(f"{lost}; run `trellis repair`")
        before = set(st.collected)
        found = scan_unlogged(self._tables, self._names(), st)
        # the WAL segments after the scan, the log after both: a commit in flight logged its begin (a
        # checkpoint its checkpoint-begin, after its frames) before its appends, and a checkpoint logs
        # its records before it deletes a segment, so what the scan or the listing saw of them the
        # log read last explains
        wal = WalFiles.read(os.path.dirname(self._log.path))
        try:
            st = fresh.refresh()
        except CorruptionError as e:  # replaced meanwhile by a repair in another process
            return [*out, str(e)]
        for x in st.collected - before:  # collected meanwhile by another writer: its rows are gone now
            found.pop(x, None)
        d = diagnose(st, mark, wal, found)
        if d.damage:
            msg = _stranded_message(fresh, self._tables, found, d, mark.id if mark else 0)
            out.append(f"{msg}; run `trellis repair`")
        return out

    def repair(self) -> dict[str, Any]:
        """Mend the log (writer lock held): see the module notes. Returns a report::

            damage         what was wrong (empty: healthy, nothing was done)
            recovered      [{id, rows, tables}] acknowledged commits given back their record: from
                           their WAL frames (``"from": "wal"``) or from their rows (``"rows"``)
            removed        [{id, rows, tables}] rows of unacknowledged (or aborted, or not provably
                           whole) commits, moved to lost+found
            unrecoverable  acknowledged ids that could not be given back (``lost`` says why)
            lost           {id: reason} for each of them
            tail_bytes     bytes of damaged log tail cut
            wal_frames_dropped  damaged frames dropped from the WAL (their commits are lost)
            wal_segment    the WAL segment current after the repair (a newer one than the log named,
                           when the log had lost the checkpoint record that started it)
            damaged_lines  damaged lines dropped from the middle of the log
            lost_found     the folder holding the copies: the log as it was, the rows removed, this report
            last_commit    the last commit after the repair
            notes          what could not be recovered
        """
        log, root = self._log, os.path.dirname(self._log.path)
        mark = log.acknowledged()
        st = log.reload()  # from the start: a line damaged after this process read it counts too
        acknowledged = mark.id if mark is not None else 0
        lost = log.lost(mark)
        found = scan_unlogged(self._tables, self._names(), st, times=True)
        d = diagnose(st, mark, WalFiles.read(root), found)
        # a commit a writer died in is collected here too (its rows copied first)
        aborted = sorted({*d.open_ids, *(x for x in st.open_ids if x not in d.recover)})
        # ids the mark says were begun and the log lost, with no rows or frames left: never to be used again
        known = max([st.max_id, d.used])
        vanished = [x for x in range(known + 1, mark.begun + 1) if x not in found] if mark is not None else []
        report: dict[str, Any] = {
            "damage": [msg for _, msg in st.problems] + ([lost] if lost else []), "recovered": [], "removed": [],
            "unrecoverable": sorted(d.lost), "lost": {str(x): why for x, why in sorted(d.lost.items())},
            "tail_bytes": 0, "damaged_lines": sum(1 for _, m in st.problems if m.startswith(log.path)), "lost_found": None, "wal_segment": d.gen,
            "last_commit": st.last_committed, "notes": [], "wal_frames_dropped": 0,
        }
        message = _stranded_message(log, self._tables, found, d, acknowledged)
        if message:
            report["damage"].append(message)
        if not report["damage"]:  # rows an unfinished checkpoint left are no damage: the next one deletes them
            return report
        folder = os.path.join(root, LOST_FOUND, dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ"))
        os.makedirs(folder)
        report["lost_found"] = folder
        keep = log.end_of_records
        # 1. copies first: the log as it was (its damaged lines and tail), and every row about to be deleted
        with open(log.path, "rb") as fh:
            before = fh.read()
        _write_durably(os.path.join(folder, "commits.log"), before)
        report["tail_bytes"] = len(before) - keep
        taken = sorted({*d.remove, *(x for x in aborted if x in found)})
        if taken:
            self._take_out(taken, folder)
        if d.leftovers:  # rows of an unfinished checkpoint: the WAL frames hold them whole
            pred = f"commit_id IN ({', '.join(str(int(i)) for i in d.leftovers)})"
            for name in self._names():
                self._tables.delete(name, pred)
        # the WAL's damaged frames (copied first): their commits are lost, the frames around them kept
        report["wal_frames_dropped"] = log.rewrite_wal(folder, d.gen)
        # 2. the log: its intact lines, then the commits recorded from frames and recovered from rows,
        # the checkpoint record it lost, and the removed and lost ids (never used again)
        records = self._records(st, mark, found, d, sorted({*d.remove, *aborted, *d.lost, *vanished}))
        st = log.rewrite(keep, records)
        self.ceiling = max(self.ceiling, st.max_id)
        report["last_commit"] = st.last_committed
        report["recovered"] = [*({"id": x, "from": "wal", "rows": int(r.get("rows", 0))}
                                 for x, r in d.from_frames.items()),
                               *({"id": x, "from": "rows", "rows": found[x].total, "tables": found[x].rows}
                                 for x in d.recover)]
        report["removed"] = [{"id": x, "rows": found[x].total, "tables": found[x].rows} for x in taken]
        if lost or report["damaged_lines"]:
            report["notes"].append(
                "what the lost or damaged lines of the log said that no row or WAL frame witnesses cannot be "
                "recovered: their tags and untags, and the messages and sessions of commits recovered from "
                "their rows; tag again what was tagged"
            )
        if d.lost:
            report["notes"].append(
                f"commit(s) {_ids(d.lost)} were acknowledged and cannot be given back (see 'lost' for each one's "
                f"reason); what rows of them were left are in {folder}"
            )
        _write_durably(os.path.join(folder, "report.json"), json.dumps(report, indent=1).encode())
        return report

    def _take_out(self, ids: list[int], folder: str) -> None:
        """Copy the rows of ``ids`` to ``folder/<table>.parquet``, then delete them."""
        pred = f"commit_id IN ({', '.join(str(int(i)) for i in ids)})"
        for name in self._names():
            try:
                rows = self._tables.dataset(name).to_table(filter=pred)
            except (OSError, ValueError, RuntimeError, CorruptionError):
                continue  # an unreadable table held none of the rows found
            if rows.num_rows:
                path = os.path.join(folder, f"{name}.parquet")
                pq.write_table(rows, path)
                with open(path, "rb+") as fh:
                    os.fsync(fh.fileno())
                self._tables.delete(name, pred)

    @staticmethod
    def _records(st: LogState, mark: HighWaterMark | None, found: dict[int, Unlogged], d: Diagnosis,
                 retire: list[int]) -> list[dict[str, Any]]:
        """Log records: the commits of ``d.from_frames`` as their frames say, a recovered commit
        for each of ``d.recover``, a ``checkpoint`` record naming segment ``d.gen`` when the log
        lost it, and ``retire`` begun and collected."""
        times = {i: float(r["time"]) for i, r in [*list(st.commits.items()), *d.from_frames.items()]}
        if mark is not None:
            times.setdefault(mark.id, mark.time)
        records: list[dict[str, Any]] = [r for _, r in sorted(d.from_frames.items())]
        for x in sorted({*d.recover, *retire}):
            if x not in st.begun:
                records.append({"op": "begin", "id": x})
            if x not in d.recover:
                continue
            # the mark's time, or the newest row it wrote; kept between its neighbours' times, in order
            lo = max((t for i, t in times.items() if i < x), default=0.0)
            hi = min((t for i, t in times.items() if i > x), default=float("inf"))
            at = times.get(x, found[x].newest or lo)
            times[x] = at = min(max(at, lo), max(hi, lo))
            records.append({
                "op": "commit", "id": x, "time": at, "writer": "trellis repair", "session": None,
                "message": "recovered by repair: the log had lost this commit's record", "rows": found[x].total,
                "recovered": True,
            })
        if d.gen > st.wal_gen:  # the checkpoint that started segment ``gen`` finished: its record again
            records.append({"op": "checkpoint", "upto": max([d.proven, *d.from_frames, *d.recover]), "wal": d.gen})
        retired = sorted(x for x in retire if x not in st.collected)
        if retired:
            records.append({"op": "collected", "ids": retired})
        return records


def describe(report: dict[str, Any]) -> list[str]:
    """The lines ``trellis repair`` prints for a report of :meth:`LogGuard.repair`."""
    if not report["damage"]:
        return [f"ok: nothing to repair (last commit {report['last_commit']})"]
    out = [f"found: {d}" for d in report["damage"]]
    for r in report["recovered"]:
        out.append(f"recovered commit {r['id']} ({r['rows']} rows)")
    for r in report["removed"]:
        out.append(f"removed {r['rows']} rows of unacknowledged commit {r['id']}")
    if report["tail_bytes"]:
        out.append(f"cut {report['tail_bytes']} bytes of damaged log tail")
    if report["damaged_lines"]:
        out.append(f"dropped {report['damaged_lines']} damaged line(s) from the middle of the log")
    if report["unrecoverable"]:
        out.append(f"unrecoverable: commit(s) {_ids(report['unrecoverable'])}")
    out += [f"note: {n}" for n in report["notes"]]
    if report["lost_found"]:
        out.append(f"copies of what was taken out: {report['lost_found']}")
    out.append(f"repaired: last commit is {report['last_commit']}")
    return out


def _write_durably(path: str, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
