"""Incremental refresh: a view's rows brought from one commit to a later one by recomputing
only the groups and nodes the commits between touched; the result equals a full rebuild.

``refresh_rows`` finds the nodes the commits touched (``changed_since``), then in one statement
the groups they are in now and the members those groups read (``_dirty``), reruns the kind's
SQL restricted to those (``compute`` with the ``__dirty_*`` relations), and says which stored
rows to drop (those whose provenance names a touched node or group) and which to append.
The old rows' provenance and the text table's keys load on a thread meanwhile. Kinds that
cannot be refreshed by parts (``ViewKind.rebuilds``), and conditions that read other nodes,
are rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.names import QUARANTINED
from trellisdb.training import sql, texts
from trellisdb.training.compute import build, compute
from trellisdb.training.kinds import KINDS, SCHEMAS
from trellisdb.training.rows import ROW_ID, RowStore
from trellisdb.training.spec import ViewSpec

if TYPE_CHECKING:
    from trellisdb.snapshot import Snapshot

_S = pa.string()


def changed_since(since: int, comparisons: bool = True) -> str:
    """SQL for the nodes the commits after ``since`` touched: written, rewarded, given
    artifacts, joined by an edge (either end), compared (``comparisons``), quarantined or released."""
    return " UNION ".join(
        [f"SELECT {col} AS id FROM {t}_history WHERE commit_id > {int(since)}"
         for t, col in (("nodes", "id"), ("rewards", "node_id"), ("node_artifacts", "node_id"), ("edges", "src"),
                        ("edges", "dst"), *((("comparisons", "a"), ("comparisons", "b")) if comparisons else ()))]
        + [f"SELECT node_id AS id FROM labels_history WHERE commit_id > {int(since)} AND label = '{QUARANTINED}'"]
    )


def _compares(spec: ViewSpec) -> bool:
    """Whether the view's rows read the comparisons (only preference pairs taken from them do)."""
    return KINDS[spec.kind].reads_comparisons(spec)


def members_sql(spec: ViewSpec, nodes: str, groups: str, edges: str | None = None) -> str:
    """SQL for the nodes a restricted compute reads: the members of the groups in relation
    ``groups`` (column ``grp``; ``edges``: a relation of their edges ``(src, dst)``), the
    nodes in ``nodes`` (column ``id``) and, for a view that reads comparisons, the other side
    of theirs."""
    kinds = sql.kinds_in(spec)
    if edges is not None:
        grp_members = f"SELECT dst AS id FROM {edges}"
    elif spec.group_by == "parent":
        grp_members = f"SELECT dst AS id FROM edges WHERE kind IN ({kinds}) AND src IN (SELECT grp FROM {groups})"
    else:
        grp_members = f"SELECT node_id AS id FROM node_artifacts WHERE name = $p AND hash IN (SELECT grp FROM {groups})"
    partners = (f" UNION SELECT b FROM comparisons WHERE a IN (SELECT id FROM {nodes}) "
                f"UNION SELECT a FROM comparisons WHERE b IN (SELECT id FROM {nodes})") if _compares(spec) else ""
    return f"{grp_members} UNION SELECT id FROM {nodes}{partners}"


def _dirty(snap: Snapshot, spec: ViewSpec, since: int) -> tuple[pa.Array, pa.Array, pa.Array, pa.Table | None]:
    """The nodes the commits in ``(since, snapshot]`` touched, then in one statement the groups
    they are in now (the old rows name the groups they were in), what a restricted compute
    of those groups reads (``members_sql``) and, for parent groups, those groups' edges
    ``(src, dst)`` (else None), which the compute then joins rather than scan the edges again."""
    kinds = sql.kinds_in(spec)
    if spec.group_by == "parent":
        groups = (f"SELECT DISTINCT src AS grp FROM edges WHERE kind IN ({kinds}) "
                  "AND dst IN (SELECT id FROM __changed)")
    else:
        groups = ("SELECT DISTINCT hash AS grp FROM node_artifacts WHERE name = $p "
                  "AND node_id IN (SELECT id FROM __changed)")
    # the touched nodes first, on their own: as a CTE DuckDB guessed them at millions of rows and
    # built its hash tables on the edges (0.17 s at 1M nodes; 0.07 s in two statements)
    changed = snap.execute(changed_since(since, _compares(spec)))
    if spec.group_by == "parent":  # the groups' edges come back too (what = 3): the members are their ends
        edges = (f"__ge AS MATERIALIZED (SELECT DISTINCT src, dst FROM edges WHERE kind IN ({kinds}) "
                 "AND src IN (SELECT grp FROM __groups)), ")
        mem = members_sql(spec, "__changed", "__groups", "__ge")
        tail = " UNION ALL SELECT 3, src, dst FROM __ge"
    else:
        edges, mem, tail = "", members_sql(spec, "__changed", "__groups"), ""
    text = (f"WITH __groups AS MATERIALIZED ({groups}), {edges}__mem AS ({mem}) "
            f"SELECT 1 AS what, grp AS id, NULL::VARCHAR AS dst FROM __groups UNION ALL SELECT 2, id, NULL FROM __mem{tail}")
    t = snap.execute(text, {"p": spec.prompt} if "$p" in text else None, relations={"__changed": changed})
    what = pa.array(t["what"].combine_chunks().to_numpy())
    ids = t["id"].combine_chunks().cast(_S)
    groups_now, members = (ids.filter(pc.equal(what, k)) for k in (1, 2))
    group_edges = None
    if spec.group_by == "parent":
        on = pc.equal(what, 3)
        group_edges = pa.table({"src": ids.filter(on), "dst": t["dst"].combine_chunks().cast(_S).filter(on)})
    return changed["id"].combine_chunks().cast(_S), groups_now, members, group_edges


@dataclass
class Refresh:
    """What a refresh does to the stored rows: replace them all (``rows``, their texts
    ``texts``), or delete the row ids ``drop`` and append ``fresh`` (rows with their text codes)
    and the texts they add (``texts``)."""

    how: str
    texts: pa.Table | None
    rows: pa.Table | None = None
    drop: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    fresh: pa.Table | None = None


def refresh_rows(stored: RowStore, snap: Snapshot, spec: ViewSpec, entry: Mapping[str, Any], since: int,
                 step: Callable[[str], None] | None = None) -> Refresh:
    """The change that brings the view from its rows at ``since`` to the snapshot: rows behind
    the touched nodes and groups are recomputed, the rest kept. Views that cannot be refreshed
    by parts are rebuilt. ``step(label)`` is told as each step starts (a progress bar's)."""
    def at(label: str) -> None:
        if step:
            step(label)

    kind = KINDS[spec.kind]
    global_condition = sql.base_at(snap, spec).accessors
    if kind.rebuilds is not None or global_condition or "texts_version" not in entry:
        why = (kind.rebuilds if kind.rebuilds is not None else
               "its condition reads other nodes" if global_condition else "stored before views kept their texts")
        rows, text = build(stored.texts, snap, spec, step)
        return Refresh(f"rebuilt ({why})", text, rows=rows)
    # the old rows (kept, or a Lance read) load on a thread while DuckDB finds and recomputes the touched groups
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-refresh") as pool:
        reading = pool.submit(stored.provenance, entry)
        kept = entry["texts_version"] is not None
        known = pool.submit(stored.texts.known_of, entry) if kept else None
        # the artifacts written since, read ahead (their texts are the new rows' likeliest to lack)
        ahead = pool.submit(texts.written_since, snap, since) if kept else None
        at("find touched nodes")
        ids, groups, members, group_edges = _dirty(snap, spec, since)
        if len(ids) == 0:
            reading.cancel()
            for f in (known, ahead):
                if f is not None:
                    f.cancel()
            return Refresh("unchanged", pa.table({}) if kept else None, fresh=SCHEMAS[spec.shape].empty_table())
        touching = pool.submit(lambda: _touches(reading.result(), ids))
        kinds = sql.kinds_in(spec)
        rel = {"__changed": pa.table({"id": ids})}
        fresh: pa.Table | None = None
        at("recompute rows")
        if not spec.paths:  # recompute now; redone below if the old rows name more groups
            fresh = _recompute(snap, spec, ids, groups, members=members, edges=group_edges)
        old, touched = reading.result(), touching.result()
        have = None if known is None else known.result()
        new = None if ahead is None else ahead.result()
    dirty_leaves = None
    if "group_key" in old.column_names:
        before = pc.drop_null(old["group_key"].filter(touched)).combine_chunks().cast(_S)
        extra = pc.filter(before, pc.invert(pc.is_in(before, value_set=groups)))
        if len(extra):  # groups a touched node has left: they change too
            groups = pc.unique(pa.concat_arrays([groups, extra]))
            fresh = members = group_edges = None
        touched = pc.or_(touched, pc.fill_null(pc.is_in(old["group_key"], value_set=groups), False))
    if spec.paths:
        # trajectories through a touched node: their leaves, old and new (descendants of the touched)
        leaves = snap.execute(
            # from the touched nodes and their parents (a parent stops being a leaf when a child is selected)
            f"WITH RECURSIVE d AS (SELECT id, 0 AS h FROM __changed UNION SELECT src, 0 FROM edges "
            f"WHERE kind IN ({kinds}) AND dst IN (SELECT id FROM __changed) UNION SELECT e.dst, d.h + 1 FROM d "
            f"JOIN edges e ON e.src = d.id AND e.kind IN ({kinds}) WHERE d.h < {sql.MAX_DEPTH}) SELECT DISTINCT id FROM d",
            relations=rel,
        )["id"].combine_chunks()
        old_leaves = old["node_id"].filter(touched).combine_chunks()
        dirty_leaves = pc.unique(pa.concat_arrays([leaves, old_leaves]))
        touched = pc.or_(touched, pc.is_in(old["node_id"], value_set=dirty_leaves))
    if fresh is None:
        fresh = _recompute(snap, spec, ids, groups, dirty_leaves, members, group_edges)
    drop = old[ROW_ID].filter(touched).to_numpy()
    text = None
    if have is not None:
        at("resolve texts")
        fresh, text = texts.extend(stored.texts, fresh, have, since, snap, new)
    return Refresh(f"refreshed ({len(ids)} touched nodes, {len(drop)} rows replaced by {fresh.num_rows})",
                   text, drop=drop, fresh=fresh)


def _recompute(snap: Snapshot, spec: ViewSpec, ids: pa.Array, groups: pa.Array,
               leaves: pa.Array | None = None, members: pa.Array | None = None,
               edges: pa.Table | None = None) -> pa.Table:
    """The rows of the dirty groups and nodes (``leaves``: the path kinds' dirty trajectories),
    computed over the nodes they can read (``members``, found here when not given): the
    touched, the members of the touched groups, and the other side of their comparisons
    (``edges``: the dirty parent groups' edges, as ``_dirty`` found them with ``members``)."""
    dirty: dict[str, pa.Table] = {"__dirty_nodes": pa.table({"id": ids}), "__dirty_groups": pa.table({"grp": groups})}
    if leaves is not None:
        dirty["__dirty_leaves"] = pa.table({"id": leaves})
    if edges is not None and members is not None:
        dirty["__group_edges"] = edges
    if members is None:
        text = members_sql(spec, "__dirty_nodes", "__dirty_groups")
        members = snap.execute(text, {"p": spec.prompt} if "$p" in text else None,
                           relations=dirty)["id"].combine_chunks()
    dirty["__members"] = pa.table({"id": members})
    return compute(snap, spec, dirty)


def _touches(rows: pa.Table, ids: pa.Array) -> pa.ChunkedArray:
    """Per row: whether any of its provenance nodes is in ``ids``."""
    col = rows["node_ids"].combine_chunks()
    flat = pc.is_in(col.flatten(), value_set=ids)
    parent = pc.list_parent_indices(col)
    hit = np.zeros(rows.num_rows, bool)
    hit[parent.to_numpy()[flat.to_numpy(zero_copy_only=False)]] = True
    return pa.chunked_array([pa.array(hit)])
