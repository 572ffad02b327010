"""``ViewKind``: what one kind of training-data view is, filled in by one file per kind.

A kind names the options it reads, checks them (``validate``), declares its rows (``schemas``
and ``keys``, per shape: ``sft`` has two), the artifact roles its rows name (``roles``), its
SQL (``body``, over the CTEs of ``training/sql.py``) and its export layouts (``layouts``,
``layout``). The registry is ``kinds/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import polars as pl
import pyarrow as pa

from trellisdb.training import sql
from trellisdb.training.options import ViewOptions
from trellisdb.training.sql import Base
from trellisdb.training.texts import code_columns

if TYPE_CHECKING:
    from trellisdb.snapshot import Snapshot

STR, F64, I64, BOOL = pa.string(), pa.float64(), pa.int64(), pa.bool_()
#: The hash columns of the prompt a row is about (its system prompt, its prompt).
HASHES = [("system_hash", STR), ("prompt_hash", STR)]
#: ``node_ids``: a row's provenance, the nodes behind it.
IDS = pa.list_(STR)


class ViewKind:
    """One kind of view. Subclasses set the class attributes and ``body``; the defaults fit
    a kind with one shape whose rows are computed by SQL alone."""

    #: the kind's name (``create_view(name, kind)``)
    name: ClassVar[str]
    #: the options of ``ViewOptions`` the kind reads besides those every kind reads (``where``,
    #: ``reward``, ``prompt``, ``response``, ``system``, ``via``, ``keep_texts``)
    options: ClassVar[tuple[str, ...]] = ()
    #: whether a view of the kind needs ``reward=...``, ``threshold=...``
    needs_reward: ClassVar[bool] = True
    needs_threshold: ClassVar[bool] = False
    #: why a refresh recomputes the whole view (None: only what the commits since touched)
    rebuilds: ClassVar[str | None] = None
    #: per shape: the columns of the rows, and the columns that identify a row (the order rows
    #: are stored and compared in)
    schemas: ClassVar[Mapping[str, pa.Schema]]
    keys: ClassVar[Mapping[str, tuple[str, ...]]]
    #: the artifact roles (hash column prefix, parameter) the rows name
    roles: ClassVar[tuple[tuple[str, str], ...]] = sql.ALL_ROLES
    #: the hash columns whose texts every export layout needs (absent: an error, or skipped)
    export_texts: ClassVar[tuple[str, ...]]
    #: per export format: the layout (parquet, the rows as stored, fits every kind)
    layouts: ClassVar[Mapping[str, str]]

    def validate(self, spec: ViewOptions) -> None:
        """Checks of the kind's own options, after the common ones (``ValidationError``)."""

    def roles_of(self, spec: ViewOptions) -> tuple[tuple[str, str], ...]:
        """The artifact roles the rows of ``spec`` name (``roles``, unless an option changes them)."""
        return self.roles

    def texts_needed(self, spec: ViewOptions) -> tuple[str, ...]:
        """The hash columns whose texts an export of ``spec`` needs (``export_texts``, unless an
        option changes them)."""
        return self.export_texts

    def shape(self, spec: ViewOptions) -> str:
        """The rows' layout (a key of ``schemas``)."""
        return self.name

    def paths(self, spec: ViewOptions) -> bool:
        """Whether a row follows a node back to its root: its rows read ancestors."""
        return False

    def reads_comparisons(self, spec: ViewOptions) -> bool:
        """Whether the rows read the comparisons (a new comparison then touches the view)."""
        return False

    def scored(self, spec: ViewOptions) -> bool:
        """Whether only nodes with a reward are selected."""
        return True

    def body(self, spec: ViewOptions, ctes: list[str], restrict: bool) -> tuple[bool, str]:
        """The statement after the common CTEs (``ctes``, to append the kind's own to): whether
        it is recursive, and its final SELECT. With ``restrict``, only the rows of the groups in
        ``__dirty_groups`` and the nodes in ``__dirty_nodes`` (``__dirty_leaves`` for paths)."""
        raise NotImplementedError

    def sql(self, spec: ViewOptions, base: Base, restrict: bool, group_edges: bool = False) -> str:
        """The rows of ``spec`` over the selected nodes ``base`` (``training/sql.py``); see ``body``
        (``group_edges``: the restricted parent groups' edges are relation ``__group_edges``)."""
        ctes = sql.common(spec, base, restrict=restrict, group_edges=group_edges, roles=self.roles_of(spec),
                          scored=self.scored(spec), paths=self.paths(spec))
        recursive, body = self.body(spec, ctes, restrict)
        return ("WITH RECURSIVE " if recursive else "WITH ") + ", ".join(ctes) + " " + body

    def statement(self, spec: ViewOptions, base: Base, restrict: bool, group_edges: bool = False) -> str:
        """What ``compute`` runs: ``sql``, sorted by the rows' key (by DuckDB, in parallel and
        bytewise like Arrow: ~2x cheaper than an Arrow sort of the result)."""
        order = ", ".join(f"{k} ASC NULLS LAST" for k in self.keys[self.shape(spec)])
        return f"SELECT * FROM ({self.sql(spec, base, restrict, group_edges)}) ORDER BY {order}"

    def finish(self, snap: Snapshot, spec: ViewOptions, rows: pa.Table) -> pa.Table:
        """The view's rows from what ``statement`` returned."""
        return self.canonical(self.shape(spec), rows, sort=False)

    def canonical(self, shape: str, rows: pa.Table, sort: bool = True) -> pa.Table:
        """``rows`` in the shape's schema (and its text code columns, if it has them), sorted by key."""
        sch = self.schemas[shape]
        codes = code_columns(rows.column_names)
        sch = pa.schema([*sch, *(rows.schema.field(c) for c in codes)])
        rows = pa.table({f.name: rows.column(f.name).cast(f.type) for f in sch}, schema=sch)
        return rows.sort_by([(k, "ascending") for k in self.keys[shape]]) if sort else rows

    def layout(self, format: str, shape: str, t: pa.Table) -> pl.DataFrame:
        """A chunk of rows with their texts (``training/layout.py``) in ``format``'s layout."""
        raise NotImplementedError
