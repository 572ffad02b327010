"""``db.purge``: sessions' data deleted from every stored version, with an audit entry in the log.

Time travel is a predicate on ``commit_id``: a row written once is in every later version of
its table, in the older Lance versions kept for readers, in WAL frames, in the mirrors and
caches of open handles, in indexes, in view rows and in exports. A purge takes the rows of
the purged sessions ``S`` and of their nodes ``N`` (every node a row of which names a session
of ``S``) out of all of them:

================  =====================================================================
table             rows taken out
================  =====================================================================
sessions          ``id`` in S
nodes             ``session_id`` in S (every version of the node)
edges             ``src`` or ``dst`` in N, or recorded by a session of S
node_artifacts    ``node_id`` in N
artifacts         linked only by nodes of N; one another node links (in any version) stays:
                  ``shared_artifacts`` counts them
rewards           ``node_id`` in N
comparisons       ``a`` or ``b`` in N
attributes        of a node of N, of a session of S, or written by a session of S
labels            of a node of N, or written by a session of S
vec_nodes_<name>  ``id`` in N (every named space of nodes)
================  =====================================================================

Tasks stay (their rows, attributes and vectors), ``purge(task=...)`` included: a task is what
was being solved, the sessions' data is what goes. Commit records stay too (the log is the
record of which commits exist): their ids, times, writers, session ids, messages and meta;
so do the commit records in a repair's copies (of the log, and the frame records of WAL
segment copies), for the same reason. N includes the nodes of S that only a repair's copies in
``lost+found/`` still hold, and their artifacts count as linked.

The steps, under the writer lock, with no index build running (``ARCHITECTURE.md``, "Purge"):

1. the WAL is checkpointed into Lance and its old segments removed: no frame holds a row;
2. ``{"op": "purge-begin", "sessions": S}`` is logged (``storage/log.py``);
3. exports under ``<db>/exports`` and the handle's export root whose ``provenance.parquet``
   names a node of N are removed, and the rows go from every copy in ``lost+found/``, by kind
   (``storage/lost_found.py``: Parquet, WAL segments, commit-log copies, JSON; a file of no kind
   it can filter is removed, and the audit commit's ``lost_found`` says so);
4. each table's rows are taken out (``storage/purge.py``: each fragment holding one is
   rewritten), dependents first (artifacts, vectors, rewards, comparisons, labels, attributes,
   edges, node_artifacts, nodes, sessions), so that a purge run again after a crash still
   finds N and the shared artifacts;
5. this process's caches are dropped: the reader's mirror and adjacency, the writer's known
   ids, the views' kept provenance and artifact addresses;
6. every index of a rewritten table is rebuilt (``vectors/index.py``; a vector index too small
   to train is dropped; every purged table's, when this purge finishes one a crash interrupted);
7. every materialized view is computed again at its own commit (one that cannot be is
   cleared: declared, not materialized); view datasets no catalog entry names are removed;
8. every Lance version but the latest, of every table and view, is removed at once, with the
   files no version names;
9. the audit commit: message ``purge``, meta ``{"purge": {"sessions": S, "rows": {table: n},
   "lost_found": {"rows", "rewritten", "removed", "dropped"}, ...}}``, appended to the commit log itself; its ``"purge": true`` makes every reader, in
   this process or another, drop what it mirrored before its next query.

A crash leaves every table as it was or rewritten (each Lance commit is atomic), files no
version names, and the ``purge-begin`` record without its audit commit: ``verify`` names the
sessions, and any later purge (of them, or of others) finishes it. Until then readers in
other processes may still show rows from their memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trellisdb.errors import CorruptionError, TrellisError, UnknownSessionError, ValidationError
from trellisdb.names import check_name, did_you_mean
from trellisdb.paths import MANIFEST
from trellisdb.storage.lost_found import copied_ids, purge_copies
from trellisdb.storage.purge import Drop, matching, prune, remove_rows
from trellisdb.storage.recovery import LOST_FOUND
from trellisdb.training.files import VIEWS_DIR
from trellisdb.vectors.index import rebuild_indexes

if TYPE_CHECKING:
    from trellisdb.committer import Committer
    from trellisdb.snapshot import Reads
    from trellisdb.store import Store
    from trellisdb.training.service import ViewStore
    from trellisdb.vectors.service import Vectors

log = logging.getLogger("trellisdb")

#: The file of an export that names the nodes behind its rows (``training/export.py``).
PROVENANCE = "provenance.parquet"


def _nothing(data: object) -> None:
    return None


def _in(col: pa.ChunkedArray, values: pa.Array) -> pa.ChunkedArray:
    return pc.is_in(col, value_set=values)


def _any(*masks: Any) -> Any:
    out = masks[0]
    for m in masks[1:]:
        out = pc.or_kleene(out, m)
    return out


def drops(sessions: pa.Array, nodes: pa.Array, hashes: pa.Array, vector_tables: Sequence[str]
          ) -> dict[str, tuple[list[str], Drop]]:
    """Per table, the columns to read and which rows go (the table in the module notes)."""
    s, n, h = sessions, nodes, hashes
    out: dict[str, tuple[list[str], Drop]] = {
        "artifacts": (["hash"], lambda r: _in(r["hash"], h)),
        "rewards": (["node_id"], lambda r: _in(r["node_id"], n)),
        "comparisons": (["a", "b"], lambda r: _any(_in(r["a"], n), _in(r["b"], n))),
        "labels": (["node_id", "session_id"], lambda r: _any(_in(r["node_id"], n), _in(r["session_id"], s))),
        "attributes": (["scope", "entity", "session_id"], lambda r: _any(
            pc.and_kleene(pc.equal(r["scope"], "node"), _in(r["entity"], n)),
            pc.and_kleene(pc.equal(r["scope"], "session"), _in(r["entity"], s)),
            _in(r["session_id"], s))),
        "edges": (["src", "dst", "session_id"], lambda r: _any(_in(r["src"], n), _in(r["dst"], n),
                                                                  _in(r["session_id"], s))),
        "node_artifacts": (["node_id"], lambda r: _in(r["node_id"], n)),
        "nodes": (["id", "session_id"], lambda r: _any(_in(r["session_id"], s), _in(r["id"], n))),
        "sessions": (["id"], lambda r: _in(r["id"], s)),
    }
    for t in vector_tables:
        out[t] = (["id"], lambda r: _in(r["id"], n))
    return out


def order(vector_tables: Sequence[str]) -> list[str]:
    """The tables in the order their rows go: what finds the others (node_artifacts the
    artifacts, nodes the rest, sessions the nodes) last."""
    return ["artifacts", *vector_tables, "rewards", "comparisons", "labels", "attributes", "edges",
            "node_artifacts", "nodes", "sessions"]


def asked(session: str | Sequence[str] | None, task: str | None) -> list[str] | None:
    """The session ids asked for (None: a task's), checked."""
    if (session is None) == (task is None):
        raise ValidationError("purge takes session= (an id or a list of ids) or task=, one of them")
    if task is not None:
        check_name(task, "task id")
        return None
    ids = [session] if isinstance(session, str) else session
    if isinstance(ids, bytes | bytearray) or not isinstance(ids, Sequence) or not ids:
        raise ValidationError(f"session must be a session id or a non-empty list of them, not {session!r}")
    for i in ids:
        check_name(i, "session id")
    return list(dict.fromkeys(ids))


@contextmanager
def _quiet(store: Store, vectors: Vectors) -> Iterator[None]:
    """The writer lock, taken while no index build of this process runs (a build reads the
    fragments first and commits under the lock: it must not straddle the purge)."""
    while True:
        vectors.indexer.wait()
        with store.lock.held():
            if vectors.indexer.idle():
                yield
                return


def purge(store: Store, reads: Reads, committer: Committer, vectors: Vectors, views: ViewStore,
          session: str | Sequence[str] | None = None, *, task: str | None = None,
          export_roots: Sequence[str] = ()) -> dict[str, Any]:
    """Delete the data of ``session`` (an id or ids) or of ``task``'s sessions from every stored
    version (see the module notes); returns what was done (also the audit commit's meta)."""
    store.writable("purge")
    ids = asked(session, task)
    if committer.in_transaction():
        raise ValidationError("purge cannot run inside a transaction; commit it first")
    committer.flush()
    committer.checkpoint()  # outside the lock: the index upkeep it starts is done before the purge
    with _quiet(store, vectors):
        upkeep = committer.after_commit
        committer.after_commit = _nothing  # no index build may start over the fragments being rewritten
        try:
            return _purge(store, reads, committer, vectors, views, ids, task, export_roots)
        finally:
            committer.after_commit = upkeep


def _purge(store: Store, reads: Reads, committer: Committer, vectors: Vectors, views: ViewStore,
           ids: list[str] | None, task: str | None, export_roots: Sequence[str]) -> dict[str, Any]:
    mark = store.log.repair_tail()  # refuses when the log lost acknowledged records
    if store.log.state.problems:
        raise CorruptionError(f"the commit log is damaged ({store.log.state.problems[0][1]}); purge is refused "
                              "until db.repair() (`trellis repair`) mends it")
    store.guard.check_rows(store.log.state, mark)
    committer.checkpoint()  # 1. every WAL frame's rows into Lance
    for path in store.log.wal_segments():
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
    sessions = _sessions(store, reads, ids, task)
    interrupted = bool(store.log.state.purging)
    committer.begin_purge(sessions)  # 2.
    try:
        return _remove(store, committer, vectors, views, sessions, task, export_roots, interrupted)
    except BaseException:
        _forget(store, committer, views)  # some rows may be gone: nothing cached may stand for them
        raise


def _forget(store: Store, committer: Committer, views: ViewStore) -> None:
    """Drop what this process holds of the stored rows: the reader's mirror and adjacency, the
    writer's known ids, the views' kept provenance, texts and artifact addresses."""
    store.engine.reset()
    committer.forget()
    views.stored.kept.clear()
    views.texts.known.clear()
    views.texts.addresses = None


def _remove(store: Store, committer: Committer, vectors: Vectors, views: ViewStore, sessions: list[str],
            task: str | None, export_roots: Sequence[str], interrupted: bool) -> dict[str, Any]:
    """Steps 3 to 9 of the module notes, for ``sessions`` (``purge-begin`` logged). After an
    ``interrupted`` purge every table's indexes are rebuilt: it may have died after rewriting a
    table and before rebuilding them, and then no row is left to say so."""
    t = store.tables
    s = pa.array(sessions, pa.string())
    lost_found = os.path.join(store.path, LOST_FOUND)
    # a repair's copies may hold nodes (and links) the tables no longer do: they are the sessions' too
    copied_nodes, copied_links = copied_ids(lost_found, sessions)
    live = matching(t, "nodes", ["id", "session_id"], lambda r: _in(r["session_id"], s))["id"]
    # an id only a copy attributes to the sessions may have been taken since by a committed node of
    # another session (the repair freed it): the tables lose by id only the ids no other session holds
    copied = pa.array(sorted(copied_nodes), pa.string())
    others = set(matching(t, "nodes", ["id", "session_id"], lambda r: pc.and_kleene(
        _in(r["id"], copied), pc.invert(_in(r["session_id"], s))))["id"].to_pylist())
    nodes = pa.array(sorted(set(live.to_pylist()) | (copied_nodes - others)), pa.string())
    in_copies = pa.array(sorted(set(live.to_pylist()) | copied_nodes), pa.string())
    named = {n for n in in_copies.to_pylist() if n is not None}
    linked = pc.unique(pa.concat_arrays([
        pc.unique(matching(t, "node_artifacts", ["node_id", "hash"], lambda r: _in(r["node_id"], nodes))["hash"]),
        pa.array(sorted({h for n, h in copied_links if n in named}), pa.string())]))
    shared = pc.unique(pa.concat_arrays([
        pc.unique(matching(t, "node_artifacts", ["node_id", "hash"], lambda r: pc.and_kleene(
            _in(r["hash"], linked), pc.invert(_in(r["node_id"], nodes))))["hash"]),
        pa.array(sorted({h for n, h in copied_links if n not in named} & set(linked.to_pylist())), pa.string())]))
    hashes = linked.filter(pc.invert(_in(linked, shared)))
    vector_tables = [sp.table for sp in store.spaces.all() if sp.target == "nodes" and not sp.builtin]
    rules = drops(s, nodes, hashes, vector_tables)
    exports = _exports(store.path, export_roots, nodes)  # 3.
    ids = {*sessions, *named, *(h for h in hashes.to_pylist() if h is not None)}
    lost = purge_copies(lost_found, _rule_of(drops(s, in_copies, hashes, vector_tables), in_copies), ids)
    rows: dict[str, int] = {}
    rewritten: list[str] = []
    for name in order(vector_tables):  # 4.
        columns, rule = rules[name]
        rows[name], changed = remove_rows(t, name, columns, rule)
        if changed:
            rewritten.append(name)
    _forget(store, committer, views)  # 5.
    again = order(vector_tables) if interrupted else rewritten
    indexes = {name: done for name in again if (done := rebuild_indexes(t.dataset(name)))}  # 6.
    for sp in store.spaces.all():
        if sp.table in indexes:
            vectors.indexer.rebuilt(sp)
    rebuilt, cleared = _views(views)  # 7.
    for name in store.all_tables():  # 8.
        prune(t.uri(name))
    _prune_views(store.path, views)
    report: dict[str, Any] = {
        "sessions": sessions, **({"task": task} if task is not None else {}), "rows": rows,
        "shared_artifacts": len(shared), "indexes": indexes, "views_rebuilt": rebuilt, "views_cleared": cleared,
        "exports_removed": len(exports), "lost_found_rows": lost["rows"], "lost_found": lost,
    }
    cid = committer.end_purge({"purge": report})  # 9.
    store.engine.saw_purge(cid)
    return {**report, "commit": cid, "exports_removed": exports}


def _sessions(store: Store, reads: Reads, ids: list[str] | None, task: str | None) -> list[str]:
    """The sessions to purge: those asked for (each must exist: a row of it in ``sessions`` or
    ``nodes``), or the task's; and those of a purge a crash interrupted, which this one finishes."""
    t = store.tables
    pending = set(store.log.state.purging)
    if ids is None:
        found = {*matching(t, "sessions", ["id", "task_id"], lambda r: pc.equal(r["task_id"], task))["id"].to_pylist(),
                 *matching(t, "nodes", ["session_id", "task_id"],
                           lambda r: pc.equal(r["task_id"], task))["session_id"].to_pylist()}
        if not found:
            raise ValidationError(f"task {task!r} has no sessions to purge{did_you_mean(str(task), reads.names('tasks', 'id'))}")
    else:
        want = pa.array(ids, pa.string())
        found = {*matching(t, "sessions", ["id"], lambda r: _in(r["id"], want))["id"].to_pylist(),
                 *matching(t, "nodes", ["session_id"], lambda r: _in(r["session_id"], want))["session_id"].to_pylist()}
        unknown = [i for i in ids if i not in found and i not in pending]
        if unknown:
            raise UnknownSessionError(f"unknown session {unknown[0]!r}"
                                      f"{did_you_mean(unknown[0], reads.names('sessions', 'id'))}; nothing was purged")
        found |= set(ids) & pending
    if pending - found:
        log.warning("finishing the purge of sessions %s that a crash interrupted", sorted(pending - found))
    return sorted(found | pending)


def _exports(store_path: str, roots: Sequence[str], nodes: pa.Array) -> list[str]:
    """Remove the exports whose provenance names a purged node: every one under ``<db>/exports``,
    and those of this database (their manifest says so) under the other ``roots``."""
    own = os.path.realpath(os.path.join(store_path, "exports"))
    removed: list[str] = []
    seen: set[str] = set()
    for root in [own, *(os.path.realpath(r) for r in roots)]:
        if root in seen or not os.path.isdir(root):
            continue
        seen.add(root)
        for folder, subdirs, files in os.walk(root):
            if PROVENANCE not in files:
                continue
            subdirs[:] = []
            if root != own and not _ours(folder, store_path):
                continue
            try:
                prov = pq.read_table(os.path.join(folder, PROVENANCE), columns=["node_ids"])["node_ids"]
            except (OSError, ValueError, KeyError, pa.ArrowException) as e:
                log.warning("purge: the export %s has unreadable provenance (%s); left as it is", folder, e)
                continue
            if len(nodes) and pc.any(_in(pc.list_flatten(prov), nodes)).as_py():
                shutil.rmtree(folder)
                removed.append(folder)
    return removed


def _ours(folder: str, store_path: str) -> bool:
    """Whether the export in ``folder`` was made from this database (its manifest names it)."""
    try:
        with open(os.path.join(folder, MANIFEST), encoding="utf-8") as fh:
            m = json.load(fh)
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and os.path.realpath(str(m.get("database"))) == os.path.realpath(store_path)


def _rule_of(rules: dict[str, tuple[list[str], Drop]], nodes: pa.Array) -> Callable[[str], tuple[list[str], Drop] | None]:
    """Which rows of a table a copy in ``lost+found/`` loses: the table's rule, and for the table
    of a space of nodes no longer named (a copy outlives a dropped space) the nodes' vectors'."""
    vectors: tuple[list[str], Drop] = (["id"], lambda r: _in(r["id"], nodes))

    def rule_of(table: str) -> tuple[list[str], Drop] | None:
        got = rules.get(table)
        return vectors if got is None and table.startswith("vec_nodes_") else got
    return rule_of


def _views(views: ViewStore) -> tuple[list[str], list[str]]:
    """Compute every materialized view again at its own commit (the purged rows are gone from
    every commit now); clear one that cannot be computed. Returns (rebuilt, cleared)."""
    rebuilt: list[str] = []
    cleared: list[str] = []
    for name, entry in sorted(views.catalog().entries.items()):
        if entry.get("version") is None:
            continue
        try:
            views.materialize(name, int(entry["commit"]))
            rebuilt.append(name)
        except TrellisError as e:
            log.warning("purge: view %s could not be computed again (%s); its rows are cleared", name, e)
            views.clear(name)
            cleared.append(name)
    return rebuilt, cleared


def _prune_views(store_path: str, views: ViewStore) -> None:
    """Prune the views' datasets to their latest version; remove those no catalog entry names
    (left by a drop or a replace that died half-way)."""
    folder = os.path.join(store_path, VIEWS_DIR)
    if not os.path.isdir(folder):
        return
    named: set[str] = set()
    for name, entry in views.catalog().entries.items():
        if entry.get("version") is not None:
            named |= {os.path.realpath(views.stored.uri(name)), os.path.realpath(views.texts.path(name))}
    for f in sorted(os.listdir(folder)):
        path = os.path.join(folder, f)
        if not (f.endswith(".lance") and os.path.isdir(path)):
            continue
        if os.path.realpath(path) in named:
            prune(path)
        else:
            shutil.rmtree(path)
