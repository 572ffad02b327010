"""``kto``: one row per selected node, labelled desirable when ``reward >= threshold`` (unpaired
preference). Exported (trl) as ``prompt``, ``completion``, ``label``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import polars as pl
import pyarrow as pa

from trellisdb.training.kinds.base import BOOL, F64, HASHES, IDS, STR, ViewKind
from trellisdb.training.layout import frame
from trellisdb.training.options import ViewOptions

SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), ("reward", F64), ("label", BOOL), *HASHES,
                    ("response_hash", STR), ("node_ids", IDS)])


class Kto(ViewKind):
    name = "kto"
    options = ("threshold",)
    needs_threshold = True
    schemas: ClassVar[Mapping[str, pa.Schema]] = {"kto": SCHEMA}
    keys: ClassVar[Mapping[str, tuple[str, ...]]] = {"kto": ("node_id",)}
    export_texts = ("prompt_hash", "response_hash")
    layouts: ClassVar[Mapping[str, str]] = {"trl": "unpaired preference: prompt, completion, label"}

    def body(self, spec: ViewOptions, ctes: list[str], restrict: bool) -> tuple[bool, str]:
        node_filter = " AND id IN (SELECT id FROM __dirty_nodes)" if restrict else ""
        return False, ("SELECT id AS node_id, task_id, __reward AS reward, __reward >= $__threshold AS label, "
                       f"system_hash, prompt_hash, response_hash, [id] AS node_ids FROM a WHERE true{node_filter}")

    def layout(self, format: str, shape: str, t: pa.Table) -> pl.DataFrame:
        return frame(t).select(pl.col("prompt"), pl.col("response").alias("completion"), pl.col("label"))


KIND = Kto()
