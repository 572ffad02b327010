"""``stepwise``: one row per trajectory: from each selected node without selected children back
to its root along first parents (the smallest parent id), with a label per step
(``reward >= threshold``). Exported (trl) as ``prompt``, ``completions``, ``labels``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import polars as pl
import pyarrow as pa

from trellisdb.training import sql
from trellisdb.training.kinds.base import HASHES, IDS, STR, ViewKind
from trellisdb.training.layout import frame
from trellisdb.training.options import ViewOptions

SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), *HASHES, ("node_ids", IDS),
                    ("response_hashes", IDS), ("rewards", pa.list_(pa.float64())),
                    ("labels", pa.list_(pa.bool_()))])


class Stepwise(ViewKind):
    name = "stepwise"
    options = ("threshold",)
    needs_threshold = True
    schemas: ClassVar[Mapping[str, pa.Schema]] = {"stepwise": SCHEMA}
    keys: ClassVar[Mapping[str, tuple[str, ...]]] = {"stepwise": ("node_id",)}
    export_texts = ("prompt_hash", "response_hashes")
    layouts: ClassVar[Mapping[str, str]] = {"trl": "stepwise supervision: prompt, completions, labels"}

    def paths(self, spec: ViewOptions) -> bool:
        return True

    def body(self, spec: ViewOptions, ctes: list[str], restrict: bool) -> tuple[bool, str]:
        # first parent = the smallest parent id among the selected nodes; leaves = no selected child
        ctes.append(sql.first_parents(spec))
        leaf_filter = " AND id IN (SELECT id FROM __dirty_leaves)" if restrict else ""
        ctes.append(f"leaf AS (SELECT id FROM a WHERE id NOT IN (SELECT src FROM edges WHERE kind IN "
                    f"({sql.kinds_in(spec)}) AND dst IN (SELECT id FROM a)){leaf_filter})")
        ctes.append(sql.paths_from("leaf"))
        return True, ("SELECT pth.leaf AS node_id, any_value(l.task_id) AS task_id, "
                      "arg_max(s.system_hash, pth.depth) AS system_hash, "
                      "arg_max(s.prompt_hash, pth.depth) AS prompt_hash, "
                      "list(pth.id ORDER BY pth.depth DESC) AS node_ids, "
                      "list(s.response_hash ORDER BY pth.depth DESC) AS response_hashes, "
                      "list(s.__reward ORDER BY pth.depth DESC) AS rewards, "
                      "list(s.__reward >= $__threshold ORDER BY pth.depth DESC) AS labels "
                      "FROM path pth JOIN a s ON s.id = pth.id JOIN a l ON l.id = pth.leaf GROUP BY pth.leaf")

    def layout(self, format: str, shape: str, t: pa.Table) -> pl.DataFrame:
        return frame(t).select(pl.col("prompt"), pl.col("responses").alias("completions"), pl.col("labels"))


KIND = Stepwise()
