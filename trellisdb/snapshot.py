"""The read side: a ``Snapshot`` is the database as of one commit, with what every reader needs.

``Reads`` (one per open database) resolves a point in time (``trellisdb/asof.py``) and hands
out snapshots; it keeps the catalog caches (the distinct channels, sessions and tasks,
extended by the commits since the last look). A ``Snapshot`` runs SQL over the snapshot views
(``sql`` for a caller's checked text; ``execute`` and ``rows`` for trellisdb's own), streams a table's columns from Lance (``scan``), gives the
in-memory lineage adjacency (``adjacency``), a Lance dataset for vector search (``dataset``),
and the catalog: commits, tags, names, embedding spaces. TQL, views, texts and export read
through it, never through the database handle.

>>> import tempfile, trellisdb
>>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
>>> with db.session(task="t", agent="a") as s:
...     _ = s.add_node(id="n1")
>>> snap = db.snapshot()
>>> snap.sql("SELECT id FROM nodes WHERE id = $1", ["n1"]).to_pylist(), sorted(snap.names("tasks", "id"))
([{'id': 'n1'}], ['t'])
>>> db.snapshot(as_of=0).sql("SELECT count(*) AS n FROM nodes").to_pylist()
[{'n': 0}]
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from trellisdb import asof, usersql
from trellisdb.errors import UnknownSpaceError
from trellisdb.names import did_you_mean
from trellisdb.reader import PUBLIC_RELATIONS
from trellisdb.result import Result
from trellisdb.schema import DATA_TABLES
from trellisdb.storage.log import LogState
from trellisdb.storage.spaces import TARGETS, Space

if TYPE_CHECKING:
    import lance

    from trellisdb.graph import Adjacency
    from trellisdb.store import Store

#: A table named in SQL text (``nodes``, ``nodes_full_history``, ...).
_TABLE_NAMES = re.compile(rf"\b({'|'.join(DATA_TABLES)})(?:_full)?(?:_history)?\b")


def tables_named(text: str) -> tuple[str, ...]:
    """The data tables an internal SQL text reads: the ones whose mirror must be current."""
    return tuple(dict.fromkeys(m.group(1) for m in _TABLE_NAMES.finditer(text)))


def _no_checkpoint(upto: int) -> None:
    return None


class Reads:
    """Snapshots of one open store, and the catalog caches they share."""

    def __init__(self, store: Store) -> None:
        #: the open folder the snapshots read
        self.store = store
        #: moves the WAL's commits up to a given id into Lance (set by the facade to the
        #: committer's ``checkpoint``; a read-only handle leaves them where they are)
        self.checkpoint: Callable[[int], object] = _no_checkpoint
        #: graph walks (LINEAGE) asked so far: the second one builds the in-memory adjacency
        self.graph_walks = 0
        self._names: dict[tuple[str, str], tuple[set[str], int]] = {}
        self._names_lock = threading.Lock()
        #: the purge (``LogState.purged``) the name caches were last emptied after
        self._names_purge = 0

    def state(self) -> LogState:
        """The commit log as it is now (re-read if it grew)."""
        return self.store.log.refresh()

    def resolve(self, as_of: object = None) -> int:
        """The commit id a point in time names: a commit id, tag, timestamp or None (latest)."""
        return self.at(as_of).commit

    def at(self, as_of: object = None) -> Snapshot:
        """The database as of ``as_of`` (default: the latest commit)."""
        st = self.state()
        return Snapshot(self, st, asof.resolve(st.commits, st.tags, st.last_committed, as_of))

    def at_commit(self, commit: int, state: LogState | None = None) -> Snapshot:
        """The database as of commit id ``commit``, already resolved."""
        return Snapshot(self, state or self.state(), commit)

    def names(self, table: str, col: str) -> set[str]:
        """Distinct values of a name column (channels, session ids, task ids) as of the latest
        commit, cached and extended incrementally by the commits since the last look (emptied
        after a purge: purged names are gone from every version)."""
        st = self.state()
        last = st.last_committed
        with self._names_lock:
            if st.purged != self._names_purge:
                self._names.clear()
                self._names_purge = st.purged
            known, upto = self._names.get((table, col), (set(), 0))
        if upto < last:
            rows = self.at_commit(last).rows(
                f"SELECT DISTINCT {col} AS v FROM {table}_history WHERE commit_id > $1", [upto])
            known = known | {r["v"] for r in rows}
            with self._names_lock:
                if self._names.get((table, col), (set(), 0))[1] < last:
                    self._names[(table, col)] = (known, last)
        return known

    def seen(self, table: str, col: str, value: object) -> bool:
        """Whether ``value`` is among the names of ``table.col`` the cache already holds: true
        means it is a name as of the latest commit (names only come and go by a purge, which
        empties the cache), false means look (:meth:`names`)."""
        purged = self.state().purged
        with self._names_lock:
            return purged == self._names_purge and value in self._names.get((table, col), (set(), 0))[0]

    def spaces(self) -> list[Space]:
        """Every embedding space (built-in and named)."""
        return self.store.spaces.all()

    def space(self, name: str, target: str) -> Space:
        """Embedding space ``name`` of ``target``, or ``UnknownSpaceError`` naming the ones that exist."""
        reg = self.store.spaces
        sp = reg.get(target, name) if target in TARGETS else None
        if sp is None:
            names = reg.names(target) if target in TARGETS else []
            raise UnknownSpaceError(
                f"unknown embedding space {name!r} of {target}{did_you_mean(name, names)}; spaces: "
                f"{', '.join(names) or 'none'} (create one with db.create_space)"
            )
        return sp


class Names(AbstractSet[str]):
    """The names of ``table.col`` as of the latest commit, as a set read lazily: testing a name
    the cache has seen reads nothing (an agent's query per step names the same session and
    channels every time; looking again after every commit cost a SQL read each), a miss or a
    listing reads the commits since the last look (:meth:`Reads.names`)."""

    def __init__(self, reads: Reads, table: str, col: str) -> None:
        self._reads, self._table, self._col = reads, table, col

    def __contains__(self, value: object) -> bool:
        return self._reads.seen(self._table, self._col, value) or value in self._reads.names(self._table, self._col)

    def __iter__(self) -> Iterator[str]:
        return iter(self._reads.names(self._table, self._col))

    def __len__(self) -> int:
        return len(self._reads.names(self._table, self._col))


class Snapshot:
    """The database as of commit ``commit``: SQL, scans, the adjacency and the catalog."""

    def __init__(self, reads: Reads, state: LogState, commit: int) -> None:
        self._reads = reads
        self._store = reads.store
        #: the commit log when the snapshot was taken
        self.state = state
        #: the commit id this snapshot shows
        self.commit = commit

    @property
    def latest(self) -> int:
        """The last commit when the snapshot was taken."""
        return self.state.last_committed

    # -------------------------------------------------------------- SQL
    def sql(self, text: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> Result:
        """A caller's SQL over the snapshot: one read-only query over the public views, checked
        like ``db.sql`` (``trellisdb/usersql.py``); values go in ``params``."""
        usersql.check(text, PUBLIC_RELATIONS)
        usersql.check_params(params)
        return Result(self.execute(text, params), sql=text)

    def execute(
        self,
        text: str,
        params: Sequence[Any] | Mapping[str, Any] | None = None,
        *,
        relations: Mapping[str, pa.Table] | None = None,
        tables: Sequence[str] | None = None,
    ) -> pa.Table:
        """trellisdb's own SQL over the snapshot views, unchecked: internal relations allowed
        (``relations``: Arrow tables it may read by name; ``tables``: the tables whose mirror
        must be current, default those the text names, so a query never copies a table it
        does not read). Never pass a caller's text here: that is :meth:`sql`."""
        need = tables_named(text) if tables is None else tables
        return self._store.engine.run(self.state, self.commit, text, params, need, relations)

    def rows(self, text: str, params: Sequence[Any] | Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Rows of trellisdb's own query as dicts (unchecked, like :meth:`execute`); only the
        tables its text names are refreshed."""
        return self._store.engine.run(self.state, self.commit, text, params, tables_named(text)).to_pylist()  # type: ignore[no-any-return]

    def scan(
        self, table: str, columns: Sequence[str], *, batch_rows: int = 1 << 20, where: str | None = None,
        with_row_address: bool = False,
    ) -> Iterator[pa.RecordBatch]:
        """Every visible version of ``table``'s rows, ``columns`` only, streamed from Lance."""
        self._reads.checkpoint(self.commit)
        return self._store.engine.scan(self.state, self.commit, table, columns, batch_rows=batch_rows, where=where,
                                       with_row_address=with_row_address)

    def adjacency(self) -> Adjacency:
        """The committed lineage edges as in-memory adjacency arrays (``trellisdb/graph.py``); a walk
        masks them to this snapshot's commit."""
        return self._store.engine.adjacency(self.state)

    def adjacency_built(self) -> bool:
        """Whether the in-memory adjacency exists already (a walk over it costs no build)."""
        return self._store.engine.adjacency_built

    def dataset(self, table: str, *, settle: bool = True) -> lance.LanceDataset:
        """The Lance dataset of ``table`` (latest version): for vector and keyword search, and
        reads by row address. Rows above the snapshot are filtered by the caller (``aborted``).
        The snapshot's commits still in the WAL are checkpointed into Lance first, unless
        ``settle`` is off: then the caller reads them with :meth:`wal_rows` (and keeps Lance's
        rows to ``commit_id <= lance_upto``)."""
        if settle:
            self._reads.checkpoint(self.commit)
        return self._store.tables.dataset(table)

    @property
    def lance_upto(self) -> int:
        """The last commit whose rows Lance holds; later ones are in the WAL (``wal_rows``)."""
        return self.state.wal.upto

    def wal_rows(self, table: str, schema: pa.Schema) -> pa.Table:
        """The rows of ``table`` that commits up to the snapshot left in the WAL (not yet in Lance)."""
        wal = self.state.wal
        t = wal.table(table, schema)
        if t.num_rows and wal.frames and wal.frames[-1].id > self.commit:
            t = t.filter(pc.less_equal(t["commit_id"], self.commit))
        return t

    def aborted(self) -> list[int]:
        """Ids at or below the snapshot of commits that never committed (their rows are invisible)."""
        return self.state.aborted(below=self.commit)

    # ---------------------------------------------------------- catalog
    @property
    def tags(self) -> dict[str, int]:
        return dict(self.state.tags)

    @property
    def commits(self) -> Mapping[int, Mapping[str, Any]]:
        return self.state.commits

    def names(self, table: str, col: str) -> set[str]:
        """Distinct values of a name column as of the latest commit (cached; see ``Reads.names``)."""
        return self._reads.names(table, col)

    def name_set(self, table: str, col: str) -> Names:
        """The same names as a lazily read set: membership of a name seen before costs no read."""
        return Names(self._reads, table, col)

    def step_commit(self, session_id: str, step: int) -> int | None:
        """The commit at which step ``step`` of a session was complete (TQL's ``AS OF STEP k OF
        SESSION s``, ``docs/tql.md``); None if the session has no node with that step.

        Let ``later`` be the first commit that wrote a node of the session with a step above
        ``step``. If every node of the step was written before it: the last commit before ``later``
        that wrote a node of the session with a step up to ``step``, or a reward of one (every
        flush of the step is visible, nothing of a later step). Otherwise (the step was finished
        only in or after the commit that started a later one: one flush holding both, or steps
        written out of order): the commit that wrote the step's last new node."""
        rows = self.rows(
            "WITH mine AS (SELECT id, step, commit_id FROM nodes_history WHERE session_id = $1), "
            "done AS (SELECT max(first) AS c FROM (SELECT min(commit_id) AS first FROM mine WHERE step = $2 "
            "GROUP BY id)), "
            "later AS (SELECT min(commit_id) AS c FROM mine WHERE step > $2), "
            "wrote AS (SELECT commit_id FROM mine WHERE step <= $2 UNION ALL SELECT commit_id FROM rewards_history "
            "WHERE node_id IN (SELECT id FROM mine WHERE step <= $2)) "
            "SELECT CASE WHEN done.c IS NULL THEN NULL WHEN later.c IS NOT NULL AND done.c >= later.c THEN done.c "
            "ELSE (SELECT max(commit_id) FROM wrote WHERE later.c IS NULL OR commit_id < later.c) END AS c "
            "FROM done, later", [session_id, step]
        )
        c = rows[0]["c"]
        return int(c) if c is not None else None

    def spaces(self) -> list[Space]:
        return self._reads.spaces()

    def space(self, name: str, target: str) -> Space:
        return self._reads.space(name, target)

    def __repr__(self) -> str:
        return f"<trellisdb.Snapshot commit={self.commit} of {self._store.path!r}>"
