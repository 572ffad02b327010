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

:meth:`LogGuard.repair` keeps every row whose commit is proven complete: one at
or below the mark's commit (the mark names a commit only after the fsync of its
commit record, which follows every append of that commit), or one below a
later ``begin`` (that writer would have collected it, had it been aborted). Each
gets a recovered commit record (``"recovered": true``). Rows of other ids were
never acknowledged (the writer may have died half-way): they are copied to
``lost+found/<UTC time>/<table>.parquet``, deleted, and their ids logged as
collected, so no id is used twice. The log keeps its intact lines: a damaged
tail, and damaged lines in the middle, are dropped (the log as it was is copied
to ``lost+found/<UTC time>/commits.log`` first). What the lost lines said that
no row witnesses (tags, commit messages) cannot be recovered.

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
    """A Lance filter for rows whose id has no commit record (and aborted ids below it)."""
    last = st.last_committed
    gaps = sorted(i for i in (st.begun | st.collected) if i <= last and i not in st.commits)
    if last - sum(1 for i in st.commits if i <= last) > len(gaps):  # ids never begun below the last commit
        gaps = [i for i in range(1, last + 1) if i not in st.commits]
    pred = f"commit_id > {int(last)} OR commit_id < 1"
    return pred + (f" OR commit_id IN ({', '.join(str(int(i)) for i in gaps)})" if gaps else "")


def scan_unlogged(tables: LanceTables, names: Iterable[str], st: LogState, times: bool = False) -> dict[int, Unlogged]:
    """The rows, per commit id, of every table whose commit the log does not record.

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


def classify(ids: Iterable[int], st: LogState, acknowledged: int) -> tuple[list[int], list[int]]:
    """Of ids holding rows but no commit record: (those proven complete, to recover; others, to remove).

    Commit ``x`` is proven complete when ``x <= acknowledged`` (the mark), or when a later
    commit began (``x < st.max_id``): the writer of that one held the lock after ``x``'s
    writer let it go, and had ``x`` been aborted it would have deleted its rows before its
    own ``begin``. The highest begun id, above the mark, is a commit a writer died in: the
    next writer collects it, as always. Rows of a collected id must not exist at all.
    """
    recover, remove = [], []
    for x in sorted(ids):
        if x in st.commits:
            continue
        if x in st.collected:
            remove.append(x)
        elif x <= acknowledged or x < st.max_id:
            recover.append(x)
        elif x not in st.open_ids:  # never begun, above every id the log and the mark know
            remove.append(x)
    return recover, remove


def _stranded_message(log: CommitLog, tables: LanceTables, found: dict[int, Unlogged], recover: list[int],
                      remove: list[int], acknowledged: int) -> str:
    names = sorted({t for x in (*recover, *remove) for t in found[x].rows})
    rows = sum(found[x].total for x in (*recover, *remove))
    parts = []
    if recover:
        parts.append(f"commit(s) {_ids(recover)} are complete (acknowledged up to {acknowledged}, says {HWM_FILE}, "
                     "or followed by later commits): repair recovers them")
    if remove:
        parts.append(f"commit(s) {_ids(remove)} were never acknowledged: repair moves their rows to {LOST_FOUND}/")
    return (f"{rows} rows in {', '.join(tables.uri(n) for n in names)} belong to commits that commit log "
            f"{log.path} does not record ({'; '.join(parts)})")


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
        recover, remove = classify(found, st, acknowledged)
        if recover or remove:
            self.ceiling = max(self.ceiling, *recover, *remove)
            raise CorruptionError(
                f"{_stranded_message(self._log, self._tables, found, recover, remove, acknowledged)}; {_RUN_REPAIR}"
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
        found = scan_unlogged(self._tables, self._names(), st)
        try:
            st = fresh.refresh()  # a commit in flight logged its begin before its appends: not stranded
        except CorruptionError as e:  # replaced meanwhile by a repair in another process
            return [*out, str(e)]
        recover, remove = classify(found, st, mark.id if mark is not None else 0)
        if recover or remove:
            msg = _stranded_message(fresh, self._tables, found, recover, remove, mark.id if mark else 0)
            out.append(f"{msg}; run `trellis repair`")
        return out

    def repair(self) -> dict[str, Any]:
        """Mend the log (writer lock held): see the module notes. Returns a report::

            damage         what was wrong (empty: healthy, nothing was done)
            recovered      [{id, rows, tables}] acknowledged commits given back their record
            removed        [{id, rows, tables}] rows of unacknowledged (or aborted) commits, moved to lost+found
            unrecoverable  acknowledged ids with neither a record nor rows left
            tail_bytes     bytes of damaged log tail cut
            wal_frames_dropped  damaged frames dropped from the WAL (their commits are lost)
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
        recover, remove = classify(found, st, acknowledged)
        # a commit a writer died in is collected here too (its rows copied first): the ids this repair
        # logs as begun must not make it look complete (``classify``: a later begin proves a commit)
        aborted = sorted(x for x in st.open_ids if x not in recover)
        unrecoverable = [x for x in range(st.last_committed + 1, acknowledged + 1)
                         if x not in found and x not in st.collected]
        # ids the mark says were begun and the log lost, with no rows left: never to be used again
        vanished = [x for x in range(st.max_id + 1, mark.begun + 1) if x not in found] if mark is not None else []
        report: dict[str, Any] = {
            "damage": [msg for _, msg in st.problems] + ([lost] if lost else []), "recovered": [], "removed": [],
            "unrecoverable": unrecoverable, "tail_bytes": 0, "damaged_lines": len(st.problems), "lost_found": None,
            "last_commit": st.last_committed, "notes": [], "wal_frames_dropped": 0,
        }
        if recover or remove:
            report["damage"].append(_stranded_message(log, self._tables, found, recover, remove, acknowledged))
        if not report["damage"]:
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
        if remove or any(x in found for x in aborted):
            self._take_out(sorted({*remove, *aborted}), folder)
        # the WAL's damaged frames (copied first): their commits are lost, the frames around them kept
        report["wal_frames_dropped"] = log.rewrite_wal(folder)
        # 2. the log: its intact lines, then the recovered commits and the removed ids (never reused)
        records = self._records(st, mark, found, recover, sorted({*remove, *aborted, *unrecoverable, *vanished}))
        st = log.rewrite(keep, records)
        self.ceiling = max(self.ceiling, st.max_id)
        report["last_commit"] = st.last_committed
        report["recovered"] = [{"id": x, "rows": found[x].total, "tables": found[x].rows} for x in recover]
        report["removed"] = [{"id": x, "rows": found[x].total, "tables": found[x].rows}
                             for x in sorted({*remove, *aborted}) if x in found]
        if lost or report["damaged_lines"]:
            report["notes"].append(
                "what the lost or damaged lines of the log said that no row witnesses cannot be recovered: their "
                "tags and untags, and the messages and sessions of the recovered commits; tag again what was tagged"
            )
        if unrecoverable:
            report["notes"].append(
                f"commit(s) {_ids(unrecoverable)} at or below the acknowledged {acknowledged} have neither a commit "
                "record nor rows: their writes are lost (unless they were aborted, and their record of that lost)"
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
    def _records(st: LogState, mark: HighWaterMark | None, found: dict[int, Unlogged], recover: list[int],
                 retire: list[int]) -> list[dict[str, Any]]:
        """Log records: a recovered commit for each of ``recover``, and ``retire`` begun and collected."""
        times = {i: float(r["time"]) for i, r in list(st.commits.items())}
        if mark is not None:
            times.setdefault(mark.id, mark.time)
        records: list[dict[str, Any]] = []
        for x in sorted({*recover, *retire}):
            if x not in st.begun:
                records.append({"op": "begin", "id": x})
            if x not in recover:
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
