"""The registry of view kinds: one file per kind, each a ``ViewKind`` (``base.py``).

A new kind: a file here with its ``ViewKind`` subclass (options, schema, keys, SQL body,
export layouts) and ``KIND = ...``, its line in ``KINDS`` below, and its tests (its golden SQL
in ``tests/fixtures/views/``).
"""

from __future__ import annotations

import pyarrow as pa

from trellisdb.training.kinds import grpo, kto, preference, replay, sft, stepwise
from trellisdb.training.kinds.base import ViewKind

#: The kinds, by name (in the order error messages list them).
KINDS: dict[str, ViewKind] = {k.name: k for k in (sft.KIND, preference.KIND, grpo.KIND, kto.KIND,
                                                  stepwise.KIND, replay.KIND)}
#: Every row shape (``sft`` has two: ``sft`` and ``sft_path``), and the kind it belongs to.
SHAPES: dict[str, ViewKind] = {shape: k for k in KINDS.values() for shape in k.schemas}
#: The columns of each shape's rows; ``node_ids`` is the provenance: the nodes behind the row.
SCHEMAS: dict[str, pa.Schema] = {shape: k.schemas[shape] for shape, k in SHAPES.items()}
#: Columns that identify a row (the order rows are stored and compared in), per shape.
ROW_KEYS: dict[str, tuple[str, ...]] = {shape: k.keys[shape] for shape, k in SHAPES.items()}

__all__ = ["KINDS", "ROW_KEYS", "SCHEMAS", "SHAPES", "ViewKind"]
