"""A view's rows as of a snapshot: its kind's SQL over the selected nodes, run by DuckDB.

``compute`` gives the rows (hashes, provenance), ``build`` the rows with their text codes and
the texts they name (``texts.py``), ``check`` refuses a definition whose condition does not
compile or whose reward is not a number. ``statement`` is the SQL text a compute runs (the
golden files of ``tests/test_view_golden.py`` hold it per kind).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb.errors import ValidationError
from trellisdb.training import sql, texts
from trellisdb.training.kinds import KINDS
from trellisdb.training.options import ViewOptions

if TYPE_CHECKING:
    from trellisdb.snapshot import Snapshot
    from trellisdb.training.texts import TextStore


def check(snap: Snapshot, spec: ViewOptions) -> None:
    """Raise if the view's conditions do not compile or its reward is not a number."""
    base = sql.base_at(snap, spec)
    text = f"SELECT __reward FROM ({base.full}) LIMIT 0"
    typ = snap.execute(text, sql.used(text, base.params)).schema.field("__reward").type
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_decimal(typ)
            or pa.types.is_null(typ)):
        raise ValidationError(f"view {spec.name!r}: reward must be a number, but {spec.reward!r} is {typ}; "
                              "e.g. reward=\"reward('score')\" (in TQL: WITH reward = reward('score'))")


def statement(spec: ViewOptions, base: sql.Base, dirty: Mapping[str, pa.Table] | None = None) -> str:
    """The SQL a compute of ``spec`` over the selected nodes ``base`` runs (``dirty``: the
    relations a refresh restricts it to)."""
    given = dirty is not None and "__group_edges" in dirty
    return KINDS[spec.kind].statement(spec, base, dirty is not None, given)


def compute(snap: Snapshot, spec: ViewOptions, dirty: Mapping[str, pa.Table] | None = None) -> pa.Table:
    """The view's rows as of the snapshot, sorted by their key (``dirty``: only those groups / nodes)."""
    kind = KINDS[spec.kind]
    base = sql.base_at(snap, spec)
    text = statement(spec, base, dirty)
    args: dict[str, Any] = {**base.params, **sql.option_params(spec)}
    rows = snap.execute(text, sql.used(text, args), relations=dict(dirty) if dirty else None)
    return kind.finish(snap, spec, rows)


def build(store: TextStore, snap: Snapshot, spec: ViewOptions,
          step: Callable[[str], None] | None = None) -> tuple[pa.Table, pa.Table | None]:
    """The view's rows as of the snapshot with their text codes, and the texts (``texts.py``;
    without ``keep_texts``: the rows alone, and None). ``step(label)`` is told as each step
    starts (``compute rows``, ``resolve texts``: a progress bar's)."""
    if step:
        step("compute rows")
    rows = compute(snap, spec)
    if not spec.keep_texts:
        return rows, None
    if step:
        step("resolve texts")
    return texts.encode(store, rows, snap)
