"""Runs DuckDB SQL over a consistent snapshot of the Lance tables.

A snapshot is a commit id ``S``. The rows visible at ``S`` are those with
``commit_id <= S`` whose commit is in the log (ids of aborted commits are
excluded until they are collected). For each table ``T`` the connection has:

- ``T_history``: every visible row (all versions of every key);
- ``T``: current state, the latest visible row per key (visible rows minus
  the versions a later commit superseded, see ``SqlEngine._refresh``), less the
  keys whose latest row retracts them (``schema.HIDDEN``: attributes, labels);
- ``nodes*`` also have ``seq``, the insertion order (``schema.SEQ_SQL``);
- for ``nodes``, ``tasks`` (``embedding``) and ``artifacts`` (``content``),
  whose bulky column the two views above leave out, ``T_full_history`` and
  ``T_full`` with every column;
- ``commits``: the commit log up to ``S``.

DuckDB specifics stay in this module.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import (
    CorruptionError,
    QueryCancelledError,
    QueryError,
    QueryLimitError,
    QueryMemoryError,
    QueryTimeoutError,
    ValidationError,
)
from trellisdb.graph import Adjacency
from trellisdb.names import utf8_problem
from trellisdb.schema import COMMITS_SCHEMA, DATA_TABLES, HIDDEN, KEYS, SEQ_SQL
from trellisdb.storage.log import LogState
from trellisdb.storage.tables import LanceTables
from trellisdb.storage.wal import WalView

DUCKDB_CONFIG: dict[str, str | bool | int | float | list[str]] = {
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    # No SQL, the callers' included, reaches a file, an extension or a Python variable: the
    # engine reads only what this module registers (Lance datasets, Arrow tables). The
    # configuration is locked once the engine is set up (SqlEngine.__init__).
    "enable_external_access": False,
    "python_enable_replacements": False,
    # The mirror stays uncompressed. DuckDB compresses in-memory tables at its automatic
    # checkpoints, so a mirror grown by many commits ended up FSST-compressed while one copied
    # at open did not; the compressed one made a 1M-node view refresh ~25% slower (string-key
    # semi-joins decode every value), for about half the memory (0.9 GiB vs 1.7 GiB at 1M nodes).
    "force_compression": "uncompressed",
    # Nothing spills to disk: a query past the memory limit fails (QueryMemoryError) instead of
    # writing temporary files under the process's working folder (DuckDB's default for an
    # in-memory database), up to 90% of the disk.
    "temp_directory": "",
}

#: The share of DuckDB's memory limit that its block allocator keeps mapped between queries
#: (``SqlEngine``'s ``keep_memory`` default).
KEEP_MEMORY_SHARE = 0.5

#: Seconds a caller's query (``db.query``, ``db.sql``) may run by default (``query_timeout``).
QUERY_TIMEOUT = 60.0
#: The share of the memory DuckDB finds (RAM, or the cgroup's limit) that one store's engine may
#: use by default (``memory_limit``). DuckDB's own default is 80%, of which some operators
#: overshoot, for one process; a server holds an engine per tenant.
MEMORY_SHARE = 0.5
#: The smallest ``memory_limit`` accepted: below it DuckDB cannot set up the views.
MIN_MEMORY = 64 << 20
#: The largest ``memory_limit`` accepted (DuckDB refuses a setting far above it).
MAX_MEMORY = 1 << 60

_SIZE = re.compile(r"^\s*([0-9.]+)\s*(bytes|B|KB|MB|GB|TB|PB|KiB|MiB|GiB|TiB|PiB)\s*$")
_UNITS = {"bytes": 1, "B": 1, **{u: 1000 ** (i + 1) for i, u in enumerate(("KB", "MB", "GB", "TB", "PB"))},
          **{u: 1024 ** (i + 1) for i, u in enumerate(("KiB", "MiB", "GiB", "TiB", "PiB"))}}


def size_bytes(text: str) -> int | None:
    """Bytes in a size as DuckDB prints its settings (``'18.8 GiB'``), None if it is not one."""
    m = _SIZE.match(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def _strict_overcommit() -> bool:
    """Whether the kernel accounts every reserved page against a commit limit (Linux mode 2)."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as fh:
            return fh.read().strip() == "2"
    except OSError:
        return False


#: The snapshot as the views read it: a connection variable, set per query.
SNAPSHOT = "getvariable('trellis_snapshot')"

#: New fragments holding at most this many rows are read whole into the mirror.
SMALL_FRAGMENTS = 65_536

#: Seconds after which a reader re-reads table manifests even if the log is unchanged.
REFRESH_EVERY = 30.0


def _shown(text: object) -> object:
    """A log string as a table shows it: one UTF-8 cannot hold (a lone surrogate written by a
    release that did not check) is shown escaped, so that it cannot fail every read."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(text, str) and utf8_problem(text) else text


def commits_table(state: LogState, upto: int, ids: Sequence[int] | None = None) -> pa.Table:
    """The ``commits`` relation: the log's commits up to ``upto`` (or those of ``ids``)."""
    by_commit: dict[int, list[str]] = {}
    for name, cid in list(state.tags.items()):
        by_commit.setdefault(cid, []).append(name)
    recs = [state.commits[i] for i in (sorted(i for i in list(state.commits) if i <= upto) if ids is None else ids)]
    return pa.table(
        {
            "id": pa.array([r["id"] for r in recs], pa.int64()),
            "time": pa.array([int(r["time"] * 1_000_000) for r in recs], pa.int64()).cast(
                COMMITS_SCHEMA.field("time").type
            ),
            "writer": [_shown(r.get("writer")) for r in recs],
            "session_id": [_shown(r.get("session")) for r in recs],
            "message": [_shown(r.get("message")) for r in recs],
            "rows": pa.array([r.get("rows", 0) for r in recs], pa.int64()),
            "tags": pa.array([sorted(by_commit.get(r["id"], [])) for r in recs], pa.list_(pa.string())),
            "meta": [None if r.get("meta") is None else _shown(json.dumps(r["meta"], sort_keys=True, ensure_ascii=False))
                     for r in recs],
        },
        schema=COMMITS_SCHEMA,
    )


class CommitsRelation:
    """The ``commits`` relation kept up to date with the log: extended by the commits since the
    last look (a commit per agent step must not cost a rebuild of every commit), rebuilt only
    when tags change or a repair added records below the last one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key: tuple[int, int, int] = (-1, -1, -1)
        self._table = COMMITS_SCHEMA.empty_table()
        self._top = 0

    def get(self, state: LogState) -> tuple[tuple[int, int, int], pa.Table]:
        with self._lock:
            key = (len(state.commits), len(state.tags), len(state.invalid_tags))
            if key == self._key:
                return key, self._table
            last = state.last_committed
            new = [i for i in range(self._top + 1, last + 1) if i in state.commits]
            if key[1:] == self._key[1:] and key[0] == self._key[0] + len(new) and new:
                self._table = pa.concat_tables([self._table, commits_table(state, last, new)]).combine_chunks() \
                    if len(new) > 64 or self._table.column(0).num_chunks > 64 else \
                    pa.concat_tables([self._table, commits_table(state, last, new)])
            else:
                self._table = commits_table(state, last).combine_chunks()
            self._top, self._key = last, key
            return key, self._table


#: Bulky columns left out of the mirror (and of the views ``T``, ``T_history``);
#: the views ``T_full``, ``T_full_history`` add them, read from Lance.
WIDE: dict[str, tuple[str, ...]] = {"nodes": ("embedding",), "tasks": ("embedding",), "artifacts": ("content",)}

#: The relations callers' SQL may read (``usersql.check``); every other name is internal.
PUBLIC_RELATIONS = frozenset(
    {"commits"}
    | {f"{name}{suffix}" for name in DATA_TABLES for suffix in ("", "_history")}
    | {f"{name}_full{suffix}" for name in WIDE for suffix in ("", "_history")}
)

#: Mirror columns with an ART index: a filter on a constant or parameter key (the
#: write path's existence and retry checks, ``WHERE id = $n``) probes the index
#: instead of scanning the column. DuckDB does not use them for joins.
#: (Not rewards' node_id: no lookup probes it, and at 5 rewards per node its index was the
#: largest, ~250 MB at 1M nodes.)
LOOKUP_COLUMNS: dict[str, tuple[str, ...]] = {"nodes": ("id",), "edges": ("dst",)}

#: Mirror tables whose copied rows are inserted sorted by a column that most queries filter
#: on with a constant: a reward channel (``reward('x')``). Each DuckDB row group then holds
#: one channel or a few, and its min/max lets a channel filter skip the others.
CLUSTER: dict[str, str] = {"rewards": "channel"}
#: A large copy of such a table is sorted in parts of this many rows (~80 MB of rewards).
CLUSTER_ROWS = 1 << 20


def gathered(
    batches: Iterable[pa.RecordBatch], limit: int, size: Callable[[pa.RecordBatch], int] = lambda b: b.num_rows
) -> Iterator[pa.Table]:
    """``batches`` gathered into tables of about ``limit`` rows (or whatever ``size`` counts:
    ``lambda b: b.nbytes`` for bytes), the last one smaller."""
    held: list[pa.RecordBatch] = []
    n = 0
    for b in batches:
        held.append(b)
        n += size(b)
        if n >= limit:
            yield pa.Table.from_batches(held)
            held, n = [], 0
    if held:
        yield pa.Table.from_batches(held)


#: The last commit whose rows Lance holds (``LogState.lance_upto``): a connection variable.
LANCE_UPTO = "getvariable('trellis_lance_upto')"


def _derived(name: str) -> str:
    """The columns a table's views add to its stored ones (``, expr AS col``): ``seq`` of nodes,
    the insertion order (a row cannot hold it: it is written before its commit id is known).
    The mirror stores it, computed once as rows are copied."""
    return f", {SEQ_SQL} AS seq" if name == "nodes" else ""


def _narrow(name: str) -> str:
    wide = WIDE.get(name)
    return f"SELECT * EXCLUDE ({', '.join(wide)}) FROM __src_{name}" if wide else f"SELECT * FROM __src_{name}"


def _visible(snapshot: int, aborted: list[int], table: str = "") -> str:
    """The predicate for rows visible at ``snapshot`` (ids are ints we produced),
    on the columns of ``table`` (an alias) if given."""
    col = f"{table}.commit_id" if table else "commit_id"
    pred = f"{col} <= {int(snapshot)}"
    if aborted:
        pred += f" AND {col} NOT IN ({', '.join(str(int(i)) for i in aborted)})"
    return pred


def _superseded_since(name: str, source: str, done: int, snapshot: int, aborted: list[int]) -> str:
    """SQL inserting into ``__sup_<name>`` the supersessions that commits in
    ``(done, snapshot]`` made: every visible version of their keys (read
    from ``source``), paired with the next version (``lead``), where that
    next one is new. On the first build (``done == 0``) only keys written
    more than once can have been superseded."""
    keys = ", ".join(KEYS[name])
    on = " AND ".join(f"h.{k} = d.{k}" for k in KEYS[name])
    if done:
        changed = f"SELECT DISTINCT {keys} FROM {source} WHERE commit_id > {int(done)} AND {_visible(snapshot, aborted)}"
    else:
        changed = f"SELECT {keys} FROM {source} WHERE {_visible(snapshot, aborted)} GROUP BY ALL HAVING count(*) > 1"
    return (
        f"INSERT INTO __sup_{name} "
        f"WITH d AS ({changed}), "
        f"v AS (SELECT h.{', h.'.join(KEYS[name])}, h.commit_id FROM {source} h SEMI JOIN d ON {on} "
        f"WHERE {_visible(snapshot, aborted, 'h')}) "
        f"SELECT * FROM (SELECT {keys}, commit_id, "
        f"lead(commit_id) OVER (PARTITION BY {keys} ORDER BY commit_id) AS by_commit FROM v) "
        f"WHERE by_commit > {int(done)}"
    )


#: The scope of the caller's queries running on this thread (``QueryScope``), if any.
_scoped = threading.local()


def active_scope() -> QueryScope | None:
    """The :class:`QueryScope` the statements of this thread run under (None: none)."""
    scope: QueryScope | None = getattr(_scoped, "scope", None)
    return scope


@contextlib.contextmanager
def unbounded() -> Iterator[None]:
    """The database's own work inside a caller's call (a view statement: materialize, export),
    run outside the thread's scope: no time limit, no cancel."""
    outer = active_scope()
    _scoped.scope = None
    try:
        yield
    finally:
        _scoped.scope = outer


class QueryScope:
    """What bounds a caller's queries on one thread: a time limit, and a cancel from any thread.

    ``db.query`` and ``db.sql`` run under one (the store's ``query_timeout``), or under the one
    the thread is already in: a server makes the scope, runs the call inside it on a worker
    thread, and cancels it from the event loop when the client goes away.

    >>> scope = QueryScope(timeout=0.2)
    >>> with scope:                              # the clock starts here
    ...     pass                                 # db.query(...): its statements run under the scope
    >>> scope.cancel("the client went away")     # from another thread: the statement running stops

    Only the caller's statements are interrupted, never the engine's own upkeep (the mirror's
    copies); a statement that would start once the scope is stopped raises at once. Work outside
    DuckDB (a vector search in Lance, a walk over the adjacency) is not interrupted: the next
    statement is where it stops."""

    def __init__(self, timeout: float | None = QUERY_TIMEOUT) -> None:
        self.timeout = check_timeout(timeout)
        #: when the time is up (``time.monotonic``; None until entered, or with no time limit)
        self.deadline: float | None = None
        #: why the scope's queries stop: ``"timeout"``, a cancel's reason (None: they run)
        self.stopped: str | None = None
        self._lock = threading.Lock()
        self._con: duckdb.DuckDBPyConnection | None = None  # the caller's statement running now
        self._outer: QueryScope | None = None
        self._active = False

    def __enter__(self) -> QueryScope:
        self._outer, _scoped.scope = active_scope(), self
        with self._lock:
            self._active = True
            if self.timeout is not None:
                self.deadline = time.monotonic() + self.timeout
        if self.deadline is not None:
            _WATCHDOG.watch(self, self.deadline)
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        with self._lock:
            self._active = False
        _scoped.scope, self._outer = self._outer, None

    @property
    def live(self) -> bool:
        """Whether the scope is entered (its statements may still run)."""
        return self._active

    def cancel(self, reason: str = "it was cancelled") -> None:
        """Stop the scope's queries: the statement running now is interrupted (it raises
        ``QueryCancelledError`` with ``reason``), and no other starts. Any thread may call it."""
        self._stop(reason)
        _WATCHDOG.watch(self, time.monotonic() + _REINTERRUPT)

    def check(self) -> None:
        """Raise the scope's error if it is stopped (or its time is up)."""
        with self._lock:
            if self.stopped is None and self.deadline is not None and time.monotonic() >= self.deadline:
                self.stopped = "timeout"
            if self.stopped is not None:
                raise self.error()

    @contextlib.contextmanager
    def running(self, con: duckdb.DuckDBPyConnection) -> Iterator[None]:
        """A caller's statement on ``con``: interruptible by the scope while it runs."""
        self.check()
        with self._lock:
            self._con = con
        try:
            yield
        finally:
            with self._lock:
                self._con = None

    def error(self) -> QueryLimitError:
        """The error a statement stopped by this scope raises."""
        if self.stopped == "timeout":
            return QueryTimeoutError(
                f"the query ran past its time limit of {self.timeout:g} s and was stopped (query_timeout); narrow "
                "it (a WHERE, a LIMIT) or raise the limit where the store is opened: trellisdb.connect(path, "
                "query_timeout=SECONDS), trellis serve --query-timeout SECONDS")
        return QueryCancelledError(f"the query was stopped before it finished: {self.stopped or 'it was cancelled'}")

    def _stop(self, reason: str) -> None:
        with self._lock:
            if self.stopped is None:
                self.stopped = reason
            con = self._con
        if con is not None:
            with contextlib.suppress(duckdb.Error):  # closed meanwhile: nothing runs on it
                con.interrupt()

    def tick(self, now: float) -> float | None:
        """The watchdog's look: stop the scope once its time is up, interrupt its statement again
        while one still runs (an interrupt that came before DuckDB began it is lost); when to
        look next (None: never)."""
        with self._lock:
            if not self._active:
                return None
            if self.stopped is None:
                if self.deadline is None or now < self.deadline:
                    return self.deadline
                self.stopped = "timeout"
            con = self._con
        if con is None:
            return None  # nothing runs; the next statement raises at its start
        con.interrupt()
        return now + _REINTERRUPT


#: Seconds between interrupts of a stopped scope's statement that still runs.
_REINTERRUPT = 0.05


def check_timeout(timeout: object, name: str = "query_timeout") -> float | None:
    """``timeout`` as seconds > 0 (None: no limit), or ``ValidationError`` naming ``name``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not math.isfinite(timeout) \
            or not 0 < timeout <= MAX_TIMEOUT:
        raise ValidationError(f"{name} must be seconds in (0, {MAX_TIMEOUT:g}] (or None for no limit), "
                              f"not {timeout!r}")
    return float(timeout)


#: The longest time limit a query may be given (a year; None is no limit at all).
MAX_TIMEOUT = 365 * 86400.0


class _Watchdog:
    """One thread per process that stops scopes whose time is up (``QueryScope.tick``)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Start empty, with no thread (also in a forked child, whose thread did not come along)."""
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, QueryScope]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, scope: QueryScope, when: float) -> None:
        with self._cv:
            if len(self._heap) > 1024 and len(self._heap) > 2 * sum(1 for e in self._heap if e[2].live):
                # scopes that ended wait in the heap until their deadline: drop them now and then
                self._heap = [e for e in self._heap if e[2].live]
                heapq.heapify(self._heap)
            heapq.heappush(self._heap, (when, next(self._seq), scope))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="trellisdb-query-watchdog", daemon=True)
                self._thread.start()
            if self._heap[0][2] is scope:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    wait = None if not self._heap else min(self._heap[0][0] - time.monotonic(), threading.TIMEOUT_MAX)
                    self._cv.wait(wait)
                _, _, scope = heapq.heappop(self._heap)
            try:
                later = scope.tick(time.monotonic())
            except Exception:  # a closed connection (nothing runs on it), or a bug: the others are still watched
                later = None
            if later is not None:
                self.watch(scope, later)


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.reset)


class SqlEngine:
    """One in-memory DuckDB database per open store; one connection (cursor)
    per thread, re-pointed at a snapshot per query.

    The database holds, shared by every thread, the *mirror* ``__mir_T`` of
    each table: the visible rows up to the newest snapshot
    asked for, every column but the bulky ones (``WIDE``), copied from Lance
    once and then by the rows of each new commit. Queries read the mirror:
    DuckDB scans its own columnar tables in parallel, with statistics, 2-3x
    faster than it scans Lance through the Arrow stream. The bulky columns
    are read from Lance, through the ``T_full`` views. Ids at or below a
    snapshot are final (committed or aborted), so mirrored rows never change.

    ``mirror=False`` serves every view from Lance scans instead: no memory
    and no copy on the first query (the right trade for a one-shot process
    such as the CLI), slower queries.

    ``keep_memory`` (bytes; None: ``KEEP_MEMORY_SHARE`` of DuckDB's memory
    limit; 0: none) is how much memory DuckDB's block allocator keeps mapped
    once used, instead of handing it back to the operating system after each
    query. Handed back, the next query faults it in again: in a VM, a refresh
    that followed a full materialization spent up to 0.1 s of system time
    doing so (0.13-0.22 s against 0.08 s for the same statement, 1M nodes).
    The process keeps its peak DuckDB memory up to that bound until ``close``.

    ``memory_limit`` (bytes; None: ``MEMORY_SHARE`` of the memory DuckDB finds) is the most
    the engine may use, the mirror and every running query together (DuckDB has no per-query
    bound: its limit is per database, here per store); a query needing more raises
    ``QueryMemoryError``. Nothing spills to disk (``DUCKDB_CONFIG``). ``query_timeout``
    (seconds; None: no limit) is the default time limit of a caller's query (:meth:`scope`,
    :class:`QueryScope`).
    """

    def __init__(
        self, tables: LanceTables, top: Callable[[], int], mirror: bool = True, keep_memory: int | None = None,
        memory_limit: int | None = None, query_timeout: float | None = QUERY_TIMEOUT,
    ) -> None:
        self._tables = tables
        #: the highest commit id begun, read from the log now
        self._top = top
        #: tables served from the mirror (none when ``mirror`` is off: every query scans Lance)
        self.mirrored = frozenset(DATA_TABLES) if mirror else frozenset()
        #: the time limit of a caller's query (seconds; None: none)
        self.query_timeout = check_timeout(query_timeout)
        self._local = threading.local()
        self._db = duckdb.connect(config=DUCKDB_CONFIG)
        #: the bytes the engine may use (see the class notes)
        self.memory_limit = self._limit_memory(memory_limit)
        #: the bytes DuckDB's block allocator keeps (see the class notes)
        self.kept_memory = self._keep_memory(keep_memory)
        self._db.execute("SET lock_configuration = true")  # no statement may change a setting from here on
        self._lock = threading.Lock()  # guards the shared tables and the bookkeeping below
        #: per table: the snapshot the mirror (and __sup_T) covers
        self._upto: dict[str, int] = {}
        #: tables whose Lance files could not be read at the last refresh
        self._broken: set[str] = set()
        #: per mirrored table: fragments up to this id are fully mirrored
        self._mark: dict[str, int] = {}
        #: tables where some commit superseded a version (their current views take the anti-join)
        self._superseded: set[str] = set()
        #: the edges as adjacency arrays (built by the first walk) and the lock its extension holds
        self._adj: Adjacency | None = None
        self._adj_lock = threading.RLock()  # re-entrant: a walk's query may find a purge (``reset``)
        #: bumped by ``reset`` (a purge deleted rows): each thread's connection starts over on its next query
        self._generation = 0
        #: the last purge (its audit commit, ``LogState.purged``) this engine has started over after
        self._purge_seen = 0
        #: the ``commits`` relation, shared by the threads' connections
        self._commits = CommitsRelation()

    def _limit_memory(self, limit: int | None) -> int:
        """Cap DuckDB's memory at ``limit`` bytes (None: ``MEMORY_SHARE`` of what it finds); the
        bytes. (Nothing spills to disk: ``DUCKDB_CONFIG``.)"""
        if limit is None:
            found = size_bytes(str(self._db.sql("SELECT current_setting('memory_limit')").fetchall()[0][0]))
            limit = max(MIN_MEMORY, int((found or 0) / 0.8 * MEMORY_SHARE))  # DuckDB's default: 80% of it
        elif limit < MIN_MEMORY:
            raise ValidationError(f"memory_limit={limit} is below the {MIN_MEMORY >> 20} MiB the engine needs; "
                                  "pass more (or None)")
        elif limit > MAX_MEMORY:
            raise ValidationError(f"memory_limit={limit} is above the {MAX_MEMORY >> 50} PiB DuckDB can be given; "
                                  "pass less (or None: half the memory it finds)")
        self._db.execute(f"SET memory_limit = '{int(limit)} bytes'")
        return int(limit)

    def scope(self) -> QueryScope:
        """A new scope for a caller's queries, with the engine's ``query_timeout``; enter it on
        the thread that runs them (:class:`QueryScope`)."""
        return QueryScope(self.query_timeout)

    @contextlib.contextmanager
    def bounded(self) -> Iterator[QueryScope]:
        """The caller's queries of this block, bounded: under the scope this thread is in already
        (a server's, with its cancel), else under a new one with the engine's ``query_timeout``."""
        outer = active_scope()
        if outer is not None:
            yield outer
            return
        with self.scope() as scope:
            yield scope

    def _keep_memory(self, keep: int | None) -> int:
        """Let DuckDB's block allocator keep ``keep`` bytes (None: the default share of its
        memory limit); the bytes it keeps. Only speed depends on the default: where DuckDB
        refuses it (more than the address space it may reserve), it keeps none."""
        asked = keep is not None
        if keep is None:
            limit = size_bytes(str(self._db.sql("SELECT current_setting('memory_limit')").fetchall()[0][0]))
            # DuckDB reserves the bound up front: under strict overcommit accounting that
            # reservation would count against every other allocation of the process
            keep = int(limit * KEEP_MEMORY_SHARE) if limit and not _strict_overcommit() else 0
        if keep <= 0:
            return 0
        try:
            self._db.execute(f"SET block_allocator_memory = '{int(keep)} bytes'")
        except duckdb.Error as e:
            if asked:
                raise ValidationError(f"keep_memory={keep} was refused: {e}; pass less (or None)") from None
            return 0
        return int(keep)

    def _con(self) -> duckdb.DuckDBPyConnection:
        con = getattr(self._local, "con", None)
        if con is None:
            con = self._db.cursor()
            self._local.con = con
        return con

    def prepare(
        self, state: LogState, snapshot: int, tables: Sequence[str] = DATA_TABLES
    ) -> duckdb.DuckDBPyConnection:
        """A connection whose views show the database as of ``snapshot``.

        Only the views of ``tables`` are guaranteed current: an internal
        lookup that reads one table refreshes only that table's mirror."""
        con = self._con()
        self._after_purge(state)
        if getattr(self._local, "generation", 0) != self._generation:  # a purge: re-read every manifest,
            self._local.generation = self._generation  # re-create every view
            self._local.log_key = self._local.views_key = None
        wal = state.wal  # before the checkouts: Lance holds every row of the commits up to wal.upto
        aborted = state.aborted(below=snapshot)
        registered: dict[str, int] = getattr(self._local, "registered", {})
        # Re-read the Lance manifests only when the log moved (new rows may
        # exist) or now and then (to pick up another process's compaction well
        # within the cleanup grace period); otherwise the pinned versions hold
        # exactly the committed rows and re-reading costs a manifest per table.
        # The key changes whenever a commit or collection record appears (a
        # begin alone does not: its rows stay invisible until its commit).
        log_key = (len(state.commits), len(state.collected), wal.upto)
        now = time.monotonic()
        stale = getattr(self._local, "log_key", None) != log_key or now - getattr(self._local, "refreshed", 0.0) > REFRESH_EVERY
        if stale:
            self._local.log_key = log_key
            self._local.refreshed = now
        for name in DATA_TABLES:
            ds = self._tables.dataset(name, refresh=stale)
            if registered.get(name) != id(ds):
                con.register(f"__lance_{name}", ds)
                registered[name] = id(ds)
        self._local.registered = registered
        # the WAL's rows: Arrow tables next to Lance's, read through the views __src_T; registered
        # for the tables this query needs (an internal lookup reads one), once per WAL view
        wal_reg: dict[str, WalView] = getattr(self._local, "wal_reg", {})
        moved = getattr(self._local, "lance_upto", None) != wal.upto  # a checkpoint: every table's rows moved
        for name in DATA_TABLES if moved or not wal_reg else tables:
            if wal_reg.get(name) is not wal:
                con.register(f"__wal_{name}", wal.table(name, self._tables.dataset(name, refresh=False).schema))
                wal_reg[name] = wal
        if getattr(self._local, "wal_reg", None) is None:
            self._local.wal_reg = wal_reg
            for name in DATA_TABLES:
                con.execute(f"CREATE OR REPLACE TEMP VIEW __src_{name} AS SELECT * FROM __lance_{name} "
                            f"WHERE commit_id <= {LANCE_UPTO} UNION ALL SELECT * FROM __wal_{name}")
        if moved:
            con.execute(f"SET VARIABLE trellis_lance_upto = {int(wal.upto)}")
            self._local.lance_upto = wal.upto
        top = self._top()  # after the checkouts: no row in them has a higher id
        with self._lock:
            self._refresh(con, snapshot, aborted, top, tables, wal)
            # a table never asked for yet is not copied (a frontier reads three of them): its
            # views read Lance directly until a query names it
            broken = frozenset(self._broken) | (frozenset(DATA_TABLES) - frozenset(self._upto))
            # tables where some version is superseded (at any commit: the join filters by the snapshot):
            # only their views need the anti-join, and the views stay as they are when queries move
            # between snapshots (re-creating them cost ~10 ms a switch)
            superseded = frozenset(self._superseded)
        # The views read the snapshot from a connection variable, so they are
        # re-created only when what they are made of changes, not per snapshot.
        if getattr(self._local, "snapshot", None) != snapshot:
            con.execute(f"SET VARIABLE trellis_snapshot = {int(snapshot)}")
            self._local.snapshot = snapshot
        key = (tuple(aborted), broken, superseded)
        old = getattr(self._local, "views_key", None)
        if old != key:
            # only the tables whose views changed (a table copied, or one found superseded, for the
            # first time); every table when the aborted ids changed
            changed = DATA_TABLES if old is None or old[0] != key[0] else tuple(
                n for n in DATA_TABLES if (n in old[1]) != (n in broken) or (n in old[2]) != (n in superseded))
            self._create_views(con, aborted, broken, superseded, changed)
            self._local.views_key = key
        commits_key, table = self._commits.get(state)
        if getattr(self._local, "commits_key", None) != commits_key:
            con.register("__commits", table)
            if getattr(self._local, "commits_key", None) is None:
                con.execute(f"CREATE OR REPLACE TEMP VIEW commits AS SELECT * FROM __commits WHERE id <= {SNAPSHOT}")
            self._local.commits_key = commits_key
        return con

    def scan(
        self, state: LogState, snapshot: int, name: str, columns: Sequence[str], batch_rows: int = 1 << 20,
        where: str | None = None, with_row_address: bool = False,
    ) -> Iterator[pa.RecordBatch]:
        """Every version of table ``name``'s rows visible at ``snapshot`` (``T_full_history``),
        ``columns`` only, streamed straight from Lance in batches of at most ``batch_rows``
        (``where``: a Lance filter on them too; ``with_row_address``: with each row's Lance
        address, ``_rowaddr``).

        For reading a bulky column in bulk: Lance scans it 2-3x faster than DuckDB
        reads the same rows through the Arrow stream of the ``T_full`` views."""
        pred = _visible(snapshot, state.aborted(below=snapshot))
        if where:
            pred = f"({pred}) AND ({where})"
        try:
            ds = self._tables.dataset(name)
            yield from ds.to_batches(columns=list(columns), filter=pred, batch_size=batch_rows,
                                     with_row_address=with_row_address)
        except (OSError, ValueError, RuntimeError) as e:
            raise CorruptionError(f"table {name!r} could not be read ({e}); run `trellis verify` to name the damaged file") from e

    @property
    def adjacency_built(self) -> bool:
        return self._adj is not None

    def adjacency(self, state: LogState) -> Adjacency:
        """The committed edges as of ``state`` as adjacency arrays (``trellisdb/graph.py``):
        built on first use, then extended by the edge rows of the commits since."""
        with self._adj_lock:
            self._after_purge(state)  # before the adjacency is read: it may hold purged edges
            adj = self._adj
            last = state.last_committed
            if adj is not None and adj.upto >= last:
                return adj
            since = -1 if adj is None else adj.upto
            rows = self.run(
                state, last, f"SELECT src, dst, kind, commit_id FROM edges_history WHERE commit_id > {int(since)}",
                tables=("edges",),
            )
            adj = Adjacency.build(rows, last) if adj is None else adj.extended(rows, last)
            self._adj = adj
            return adj

    def _after_purge(self, state: LogState) -> None:
        """Start over (``reset``) if the log records a purge this engine has not seen yet
        (made by this process or another)."""
        if state.purged > self._purge_seen:  # read unlocked (an int); checked again under the locks
            self.reset(state.purged)

    def reset(self, purge: int | None = None) -> None:
        """Forget every row mirrored and everything derived from the tables' rows (the mirror and
        its watermarks, the supersessions, the adjacency), and make each thread's connection
        re-read the Lance manifests and re-create its views before its next query. A purge
        deleted rows, which nothing else does (mirrored rows never change otherwise); the next
        query naming a table copies it again. ``purge``: the purge's audit commit, now seen
        (nothing is done if it was seen already: threads that find it at once reset once)."""
        with self._adj_lock, self._lock:
            if purge is not None:
                if purge <= self._purge_seen:
                    return
                self._purge_seen = purge
            self._generation += 1
            self._upto.clear()
            self._mark.clear()
            self._superseded.clear()
            self._broken.clear()
            self._adj = None
            # until a table is copied again its views read Lance (``prepare``: not in ``_upto``)
            con = self._db.cursor()
            try:
                for name in DATA_TABLES:
                    con.execute(f"DROP TABLE IF EXISTS __mir_{name}")
                    con.execute(f"DROP TABLE IF EXISTS __sup_{name}")
            finally:
                con.close()

    def saw_purge(self, purge: int) -> None:
        """Record that purge ``purge`` (its audit commit) needs no ``reset``: the purging
        handle reset its engine once the rows were gone, before its audit commit."""
        with self._lock:
            self._purge_seen = max(self._purge_seen, purge)

    def _refresh(
        self, con: duckdb.DuckDBPyConnection, snapshot: int, aborted: list[int], top: int,
        tables: Sequence[str], wal: WalView,
    ) -> None:
        """Extend the mirror and ``__sup_T`` (superseded row versions) to ``snapshot``.

        The mirror gains the visible rows of the commits since the last
        refresh (aborted ids are left out: at or below ``snapshot`` they are
        final). Only Lance fragments newer than the table's *watermark* are
        read: once a refresh has seen every row of a dataset version (no
        commit had begun above ``snapshot`` when the log was read after the
        version was checked out, ``top`` being the highest begun id then;
        writers log ``begin`` before they append), the fragments of that
        version hold nothing new. Appends and compactions add fragments with
        higher ids, so a table no commit touched costs nothing.

        ``__sup_T`` holds ``(key, commit_id, by_commit)`` for every visible
        row that a later visible row of the same key replaced, ``by_commit``
        being the replacing commit. The current state as of any ``S``
        covered is then the visible rows minus those with ``by_commit <= S``:
        an anti-join with a table as small as the number of updates, instead
        of a window over every key. It grows by the keys of the commits since
        the last refresh (their versions are found with one semi-join).
        """
        todo: list[tuple[str, int | None, list[Any], int]] = []
        for name in tables:
            done = self._upto.get(name)
            if done is not None and snapshot <= done:
                continue
            new: list[Any] = []
            mark = -1
            if name in self.mirrored:
                try:
                    frags = self._tables.dataset(name, refresh=False).get_fragments()  # as registered by prepare
                except (OSError, ValueError, RuntimeError):
                    self._broken.add(name)
                    continue
                mark = self._mark.get(name, -1)
                new = [f for f in frags if f.fragment_id > mark]
                mark = max((f.fragment_id for f in frags), default=mark)
                if not new and done is not None and not wal.touches(name, done, snapshot):
                    # nothing was written to this table: no SQL at all
                    self._advance(name, snapshot, top, mark, False)
                    continue
            todo.append((name, done, new, mark))
        if not todo:
            return
        # the tables copied for the first time get their indexes after the copy is committed
        first = [name for name, done, _new, _mark in todo
                 if name in LOOKUP_COLUMNS and name in self.mirrored and not done and not self._indexed(con, name)]
        # One transaction for every table touched (a statement costs ~1 ms
        # here); should one table fail, redo them one by one to isolate it.
        try:
            con.execute("BEGIN")
            outcomes: list[bool | None] = [
                self._refresh_table(con, name, done, new, snapshot, aborted, wal) for name, done, new, _ in todo]
            con.execute("COMMIT")
        except (duckdb.Error, OSError, ValueError, RuntimeError):
            con.execute("ROLLBACK")
            outcomes = []  # None: the table failed
            for name, done, new, _mark in todo:
                try:
                    con.execute("BEGIN")
                    outcomes.append(self._refresh_table(con, name, done, new, snapshot, aborted, wal))
                    con.execute("COMMIT")
                except (duckdb.Error, OSError, ValueError, RuntimeError):
                    con.execute("ROLLBACK")
                    # A damaged table: leave it to the query that reads it, which
                    # reports it as corruption; other tables stay readable.
                    self._broken.add(name)
                    outcomes.append(None)
        for (name, _done, _new, mark), superseded in zip(todo, outcomes, strict=True):
            if superseded is not None:
                self._broken.discard(name)
                self._advance(name, snapshot, top, mark, superseded)
        for name in first:
            if name not in self._broken:
                self._index(con, name)

    @staticmethod
    def _index(con: duckdb.DuckDBPyConnection, name: str) -> None:
        """The ART indexes of a mirror table and its supersessions, built once over the first
        copy, outside its transaction, then kept up by DuckDB. Built in bulk: inside the
        transaction DuckDB defers them to the commit and inserts row by row (5M rewards:
        2.3-2.7 s vs 1.3-1.4 s). An index only speeds lookups: one that fails to build is left out."""
        with contextlib.suppress(duckdb.Error):
            for col in LOOKUP_COLUMNS[name]:
                con.execute(f"CREATE INDEX IF NOT EXISTS __ix_{name}_{col} ON __mir_{name}({col})")
            # the current view's anti-join probes superseded versions by key
            con.execute(f"CREATE INDEX IF NOT EXISTS __ix_sup_{name} ON __sup_{name}({KEYS[name][0]})")

    def _advance(self, name: str, snapshot: int, top: int, mark: int, superseded: bool) -> None:
        self._upto[name] = snapshot
        if superseded:
            self._superseded.add(name)
        if name in self.mirrored and top <= snapshot:
            self._mark[name] = mark

    def _refresh_table(
        self, con: duckdb.DuckDBPyConnection, name: str, done: int | None, new: list[Any], snapshot: int,
        aborted: list[int], wal: WalView,
    ) -> bool:
        """Mirror the new rows of ``name`` and extend ``__sup_<name>``; returns
        whether any version was found superseded."""
        keys = ", ".join(KEYS[name])
        mirrored = name in self.mirrored
        if done is None:
            if mirrored:
                con.execute(f"CREATE OR REPLACE TABLE __mir_{name} AS SELECT *{_derived(name)} FROM "
                            f"({_narrow(name)}) LIMIT 0")
            con.execute(
                f"CREATE OR REPLACE TABLE __sup_{name} AS "
                f"SELECT {keys}, commit_id, commit_id AS by_commit FROM __lance_{name} LIMIT 0"
            )
            done = 0
        copied = mirrored and self._mirror_new(con, name, new, done, snapshot, aborted, wal)
        if mirrored and not copied:
            return False  # no new rows: nothing superseded either
        source = f"__mir_{name}" if mirrored else f"__src_{name}"
        row = con.execute(_superseded_since(name, source, done, snapshot, aborted)).fetchone()
        return bool(row and row[0])

    @staticmethod
    def _indexed(con: duckdb.DuckDBPyConnection, name: str) -> bool:
        rows = con.execute("SELECT count(*) FROM duckdb_indexes() WHERE table_name = $1", [f"__mir_{name}"]).fetchall()
        return bool(rows[0][0])

    def _mirror_new(
        self, con: duckdb.DuckDBPyConnection, name: str, new: list[Any], done: int, snapshot: int, aborted: list[int],
        wal: WalView,
    ) -> bool:
        """Copy the rows of commits in ``(done, snapshot]`` held by fragments
        ``new`` (those above the watermark; rows up to ``wal.upto``) and by the WAL into the
        mirror; True if any."""
        added = 0
        if wal.touches(name, done, snapshot):
            order = f" ORDER BY {CLUSTER[name]}" if name in CLUSTER else ""
            row = con.execute(f"INSERT INTO __mir_{name} SELECT *{_derived(name)} FROM "
                              f"({_narrow(name).replace('__src_', '__wal_')} "
                              f"WHERE commit_id > {int(done)} AND commit_id <= {int(snapshot)}){order}").fetchone()
            added += int(row[0]) if row and row[0] else 0
        if not new or done >= wal.upto:
            return added > 0
        snapshot_lance = min(snapshot, wal.upto)
        ds = self._tables.dataset(name, refresh=False)
        cols = [f.name for f in ds.schema if f.name not in WIDE.get(name, ())]
        rows: pa.Table | pa.RecordBatchReader
        if sum(f.physical_rows for f in new) <= SMALL_FRAGMENTS:
            # a commit's few rows: reading them whole beats planning a filtered scan
            rows = pa.concat_tables([f.to_table(columns=cols) for f in new])
        else:  # the first copy, or a compaction's output: stream, filtered in Lance
            rows = ds.scanner(
                columns=cols, fragments=new, filter=f"commit_id > {int(done)} AND commit_id <= {int(snapshot_lance)}"
            ).to_reader()
        insert = f"INSERT INTO __mir_{name} SELECT *{_derived(name)} FROM __new_rows WHERE commit_id > {int(done)} AND " \
            f"{_visible(snapshot_lance, aborted)}"
        parts: Iterable[pa.Table | pa.RecordBatchReader] = [rows]
        if name in CLUSTER:
            # sorted a part at a time, in Arrow: what the sort holds besides the mirror is about
            # one part (DuckDB's ORDER BY kept its sort buffers: 0.5 GB more peak at 5M rewards)
            key = [(CLUSTER[name], "ascending")]
            parts = (p.take(pc.sort_indices(p, key)) for p in
                     (gathered(rows, CLUSTER_ROWS) if isinstance(rows, pa.RecordBatchReader) else [rows]))
        for part in parts:
            if isinstance(part, pa.Table):  # streamed: a registered table is inserted by parallel scans, whose
                part = pa.RecordBatchReader.from_batches(part.schema, part.to_batches())  # buffers cost ~2x
            con.register("__new_rows", part)
            try:
                row = con.execute(insert).fetchone()
            finally:
                con.unregister("__new_rows")
            added += int(row[0]) if row and row[0] else 0
        return added > 0

    def _create_views(
        self, con: duckdb.DuckDBPyConnection, aborted: list[int], broken: frozenset[str], superseded: frozenset[str],
        tables: Sequence[str] = DATA_TABLES,
    ) -> None:
        visible = f"commit_id <= {SNAPSHOT}"
        if aborted:
            visible += f" AND commit_id NOT IN ({', '.join(str(int(i)) for i in aborted)})"
        for name in tables:
            on = " AND ".join(f"h.{k} = s.{k}" for k in (*KEYS[name], "commit_id"))
            full = f"SELECT * FROM __src_{name} WHERE {visible}"
            if name in self.mirrored and name not in broken:  # aborted rows never enter the mirror
                narrow = f"SELECT * FROM __mir_{name} WHERE commit_id <= {SNAPSHOT}"
            else:
                narrow = _narrow(name) + f" WHERE {visible}"
            history = {name: narrow, f"{name}_full": full} if name in WIDE else {name: narrow}
            for view, rows in history.items():
                if name == "nodes" and not rows.startswith("SELECT * FROM __mir_"):  # the mirror stores it
                    rows = f"SELECT *{_derived(name)} FROM ({rows})"
                con.execute(f"CREATE OR REPLACE TEMP VIEW {view}_history AS {rows}")
                if name in broken:  # unreadable now (a plain definition that fails clearly only when
                    # used), or never refreshed (correct, without the mirror's speed)
                    window = f"QUALIFY row_number() OVER (PARTITION BY {', '.join(KEYS[name])} ORDER BY commit_id DESC) = 1"
                    current = f"SELECT * FROM {view}_history {window}"
                elif name in superseded:
                    sup = f"(SELECT * FROM __sup_{name} WHERE by_commit <= {SNAPSHOT})"
                    current = f"SELECT h.* FROM {view}_history h ANTI JOIN {sup} s ON {on}"
                else:  # nothing superseded (yet): current = visible, no join to pay
                    current = f"SELECT * FROM {view}_history"
                if name in HIDDEN:  # the latest row of a key says it is gone: a retraction, a removal
                    current = f"SELECT * FROM ({current}) WHERE NOT ({HIDDEN[name]})"
                con.execute(f"CREATE OR REPLACE TEMP VIEW {view} AS {current}")

    def run(
        self,
        state: LogState,
        snapshot: int,
        text: str,
        params: Sequence[Any] | Mapping[str, Any] | None = None,
        tables: Sequence[str] = DATA_TABLES,
        relations: Mapping[str, pa.Table] | None = None,
    ) -> pa.Table:
        """Rows of ``text`` as of ``snapshot``; ``relations`` are Arrow tables the text may read by
        name. Under a :class:`QueryScope` (the thread's) the statement is stopped at its limits."""
        scope = active_scope()
        if scope is not None:
            scope.check()
        con = self.prepare(state, snapshot, tables)
        for name, t in (relations or {}).items():
            con.register(name, t)
        try:
            with scope.running(con) if scope is not None else contextlib.nullcontext():
                rel = con.sql(text, params=params)
                if rel is None:  # a statement without a result (DDL, SET)
                    return pa.table({})
                return rel.to_arrow_table()
        except duckdb.InterruptException:
            raise (scope.error() if scope is not None else QueryCancelledError(
                "the query was interrupted before it finished")) from None
        except duckdb.OutOfMemoryException:
            raise QueryMemoryError(
                f"the query needed more memory than the store's query engine may use ({self.memory_limit / 2**20:,.0f} "
                "MiB: memory_limit, for the mirror and every running query together) and was stopped; narrow it "
                "(a WHERE, fewer groups, a LIMIT) or raise the limit where the store is opened: "
                "trellisdb.connect(path, memory_limit=BYTES), trellis serve --memory-limit SIZE") from None
        except duckdb.IOException as e:
            raise CorruptionError(
                f"reading the tables failed: {e}; run `trellis verify` to find the damaged file"
            ) from e
        except duckdb.Error as e:
            m = re.search(r"registered as '__lance_(\w+)' failed", str(e))
            if m:
                raise CorruptionError(
                    f"table {m.group(1)!r} could not be read ({e}); run `trellis verify` to name the damaged file"
                ) from e
            raise QueryError(f"SQL failed: {e}") from e
        finally:
            for name in relations or {}:
                con.unregister(name)
