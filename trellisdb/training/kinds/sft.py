"""``sft``: one row per selected node with ``reward >= threshold`` (every selected node if no
threshold); with ``path=True`` its root-to-node path along first parents, a prompt and a
response per step (a multi-turn conversation; the threshold applies to the path's last node).

Exported as ``messages`` [system?, user, assistant] (trl and openai); a path as [system?,
(user?, assistant?) per step, root first].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.training import sql
from trellisdb.training.kinds.base import F64, HASHES, IDS, STR, ViewKind
from trellisdb.training.layout import conversation, plain
from trellisdb.training.options import ViewOptions

SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), ("reward", F64), *HASHES, ("response_hash", STR),
                    ("node_ids", IDS)])
#: path=True: the root-to-node path, a prompt and a response per step (multi-turn)
PATH_SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), ("reward", F64), *HASHES, ("response_hash", STR),
                         ("node_ids", IDS), ("prompt_hashes", IDS), ("response_hashes", IDS)])


class Sft(ViewKind):
    name = "sft"
    options = ("threshold", "path")
    needs_reward = False
    schemas: ClassVar[Mapping[str, pa.Schema]] = {"sft": SCHEMA, "sft_path": PATH_SCHEMA}
    keys: ClassVar[Mapping[str, tuple[str, ...]]] = {"sft": ("node_id",), "sft_path": ("node_id",)}
    # a path's first prompt and its last response; a step without a prompt (response) has no user (assistant) turn
    export_texts = ("prompt_hash", "response_hash")
    layouts: ClassVar[Mapping[str, str]] = {"trl": "conversational language modeling: messages",
                                           "openai": "OpenAI supervised fine-tuning: messages"}

    def shape(self, spec: ViewOptions) -> str:
        return "sft_path" if spec.path else "sft"

    def paths(self, spec: ViewOptions) -> bool:
        return spec.path

    def scored(self, spec: ViewOptions) -> bool:
        # paths keep unscored ancestors (the threshold applies to the path's last node)
        return spec.threshold is not None and not spec.path

    def body(self, spec: ViewOptions, ctes: list[str], restrict: bool) -> tuple[bool, str]:
        cond = "__reward >= $__threshold" if spec.threshold is not None else "true"
        if not spec.path:
            node_filter = " AND id IN (SELECT id FROM __dirty_nodes)" if restrict else ""
            return False, (f"SELECT id AS node_id, task_id, __reward AS reward, system_hash, prompt_hash, "
                           f"response_hash, [id] AS node_ids FROM a WHERE {cond}{node_filter}")
        leaf_filter = " AND id IN (SELECT id FROM __dirty_leaves)" if restrict else ""
        ctes.append(sql.first_parents(spec))
        ctes.append(f"sel AS (SELECT id FROM a WHERE {cond}{leaf_filter})")
        ctes.append(sql.paths_from("sel"))
        return True, ("SELECT pth.leaf AS node_id, any_value(l.task_id) AS task_id, any_value(l.__reward) AS reward, "
                      "arg_max(s.system_hash, pth.depth) AS system_hash, "
                      "arg_max(s.prompt_hash, pth.depth) AS prompt_hash, "
                      "any_value(l.response_hash) AS response_hash, list(pth.id ORDER BY pth.depth DESC) AS node_ids, "
                      "list(s.prompt_hash ORDER BY pth.depth DESC) AS prompt_hashes, "
                      "list(s.response_hash ORDER BY pth.depth DESC) AS response_hashes "
                      "FROM path pth JOIN a s ON s.id = pth.id JOIN a l ON l.id = pth.leaf GROUP BY pth.leaf")

    def layout(self, format: str, shape: str, t: pa.Table) -> pl.DataFrame:
        if shape == "sft_path":  # laid out in Arrow, over decoded texts
            return pl.DataFrame(pl.from_arrow(pa.table({"messages": turns(plain(t))})))
        return conversation(t)


def turns(t: pa.Table) -> pa.Array:
    """Per row of an sft path: [system?] then, per step root first, a user turn (the step's
    prompt, when it has one) and an assistant turn (its response, when it has one). Built from the flattened
    lists in numpy: a stable sort of (row, position) keys, no Python loop over rows."""
    responses = t["responses"].combine_chunks()
    prompts = t["prompts"].combine_chunks()
    system = t["system"].combine_chunks()
    n = t.num_rows
    step_row = pc.list_parent_indices(responses).to_numpy()
    starts = np.concatenate([[0], np.cumsum(pc.fill_null(pc.list_value_length(responses), 0).to_numpy())])[:-1]
    step = np.arange(len(step_row)) - starts[step_row]
    flat_p, flat_r = prompts.flatten(), responses.flatten()
    has_p = pc.is_valid(flat_p).to_numpy(zero_copy_only=False)
    has_r = pc.is_valid(flat_r).to_numpy(zero_copy_only=False)
    has_s = pc.is_valid(system).to_numpy(zero_copy_only=False)
    rows_key = np.concatenate([np.arange(n)[has_s], step_row[has_p], step_row[has_r]])
    order_key = np.concatenate([np.full(int(has_s.sum()), -1), 2 * step[has_p], 2 * step[has_r] + 1])
    content = pa.concat_arrays([system.filter(pa.array(has_s)), flat_p.filter(pa.array(has_p)),
                                flat_r.filter(pa.array(has_r))])
    role = np.concatenate([np.full(int(has_s.sum()), 0), np.full(int(has_p.sum()), 1), np.full(int(has_r.sum()), 2)])
    perm = np.lexsort((order_key, rows_key))
    roles = pa.array(["system", "user", "assistant"]).take(pa.array(role[perm]))
    msgs = pa.StructArray.from_arrays([roles, content.take(pa.array(perm))], names=["role", "content"])
    offsets = np.concatenate([[0], np.cumsum(np.bincount(rows_key, minlength=n))]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), msgs)


KIND = Sft()
