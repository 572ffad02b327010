"""Vectorized validation for bulk ingest (``Database.ingest``): no Python row loops."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import (
    DuplicateIdError,
    EmbeddingDimensionError,
    InvalidRewardError,
    UnknownNodeError,
    UnknownParentError,
    UnknownSessionError,
    ValidationError,
)
from trellisdb.schema import DATA_TABLES, table_schema

if TYPE_CHECKING:
    from trellisdb.database import Database


def conform(name: str, t: pa.Table, dim: int) -> pa.Table:
    """Reorder/cast ``t`` to the table's schema, filling absent nullable columns."""
    sch = table_schema(name, dim)
    extra = set(t.column_names) - set(sch.names)
    if extra:
        raise ValidationError(f"table {name!r} has no column(s) {sorted(extra)}; its columns are {sch.names}")
    cols = []
    for f in sch:
        if f.name in t.column_names:
            col = t.column(f.name)
            if pa.types.is_fixed_size_list(f.type) and (
                not pa.types.is_fixed_size_list(col.type) or col.type.list_size != dim
            ):
                sizes = pc.list_value_length(col).drop_null()
                bad = [s for s in pc.unique(sizes).to_pylist() if s != dim] if len(sizes) else []
                if bad:
                    raise EmbeddingDimensionError(
                        f"{name}.{f.name} has vectors of dimension {bad[0]}; this database's dimension is {dim}"
                    )
            if pa.types.is_fixed_size_list(f.type):
                flat = pc.list_flatten(col)
                if len(flat) and not pc.all(pc.is_finite(flat.cast(pa.float64()))).as_py():
                    raise ValidationError(f"{name}.{f.name} contains NaN or infinite values")
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValidationError(f"{name}.{f.name} cannot be read as {f.type}: {e}") from e
        elif f.name == "commit_id":
            col = pa.nulls(t.num_rows, pa.int64()).fill_null(0)
        elif not f.nullable:
            raise ValidationError(f"table {name!r} needs column {f.name!r}")
        else:
            col = pa.nulls(t.num_rows, f.type)
        if not f.nullable and col.null_count:
            raise ValidationError(f"{name}.{f.name} has {col.null_count} null(s); it is required")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=sch)


def _missing(db: Database, table: str, col: str, ids: pa.Array) -> list[str]:
    if not len(ids):
        return []
    st = db._log.refresh()
    con = db._engine.prepare(st, st.last_committed)
    con.register("__want", pa.table({"id": ids}))
    rows = con.execute(
        f"SELECT w.id FROM __want w ANTI JOIN (SELECT DISTINCT {col} AS id FROM {table}_history) h USING (id) LIMIT 5"
    ).fetchall()
    con.unregister("__want")
    return [r[0] for r in rows]


def prepare_bulk(db: Database, tables: Mapping[str, pa.Table]) -> dict[str, pa.Table]:
    unknown = set(tables) - set(DATA_TABLES)
    if unknown:
        raise ValidationError(f"unknown table(s) {sorted(unknown)}; tables are {list(DATA_TABLES)}")
    out = {n: conform(n, t, db.embedding_dim) for n, t in tables.items()}
    empty = pa.array([], pa.string())
    nodes = out.get("nodes")
    node_ids = nodes.column("id").combine_chunks() if nodes is not None else empty
    if nodes is not None:
        if pc.count_distinct(node_ids).as_py() != len(node_ids):
            vc = pc.value_counts(node_ids)
            dup = pc.filter(vc.field("values"), pc.greater(vc.field("counts"), 1))[0].as_py()
            raise DuplicateIdError(f"node id {dup!r} appears more than once in the batch")
        clash = _present(db, "nodes", "id", node_ids)
        if clash:
            raise DuplicateIdError(f"node id {clash[0]!r} already exists; bulk ingest writes new nodes only")
        sess = pc.unique(nodes.column("session_id")) if nodes.num_rows else empty
        if "sessions" in out:
            sess = pc.filter(sess, pc.invert(pc.is_in(sess, out["sessions"].column("id"))))
        miss = _missing(db, "sessions", "id", sess)
        if miss:
            raise UnknownSessionError(f"node(s) name session {miss[0]!r}, which does not exist")
    for name, col in (("edges", "src"), ("edges", "dst"), ("rewards", "node_id"), ("node_artifacts", "node_id")):
        if name not in out:
            continue
        want = pc.unique(out[name].column(col))
        want = pc.filter(want, pc.invert(pc.is_in(want, node_ids)))
        miss = _missing(db, "nodes", "id", want)
        if miss:
            err = UnknownParentError if col == "src" else UnknownNodeError
            raise err(f"{name}.{col} names node {miss[0]!r}, which does not exist")
    if "rewards" in out:
        v = out["rewards"].column("value")
        bad = pc.invert(pc.is_finite(v))
        if pc.any(bad).as_py():
            first = pc.filter(out["rewards"], bad).slice(0, 1).to_pylist()[0]
            raise InvalidRewardError(
                f"reward {first['channel']!r} of node {first['node_id']!r} is {first['value']!r}; rewards must be finite"
            )
    return out


def _present(db: Database, table: str, col: str, ids: pa.Array) -> list[str]:
    if not len(ids):
        return []
    st = db._log.refresh()
    con = db._engine.prepare(st, st.last_committed)
    con.register("__want", pa.table({"id": ids}))
    rows = con.execute(f"SELECT w.id FROM __want w SEMI JOIN {table}_history h ON h.{col} = w.id LIMIT 5").fetchall()
    con.unregister("__want")
    return [r[0] for r in rows]
