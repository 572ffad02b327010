"""``sft``: one row per selected node with ``reward >= threshold`` (every selected node if no
threshold); with ``path=True`` its root-to-node path along first parents, a prompt and a
response per step (a multi-turn conversation; the threshold applies to the path's last node).

Exported as ``messages`` [system?, user, assistant] (trl and openai); a path as [system?,
(user?, assistant?) per step, root first].

With ``messages="<artifact>"`` a node's turns are that artifact instead: a JSON array of chat
messages ``{"role", "content", ...}`` (roles as written, e.g. system, user, assistant, tool),
exported as they are, ``role`` and ``content`` kept, other keys dropped. A row per selected
node that has the artifact: without a path its own turns; with ``path=True`` the turns of
every node on its root-to-node path, root first (a node on it without the artifact adds none). An
importer that stores each step's new turns this way (``trellis import swe-agent``) exports the
conversation the model saw, message for message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import ExportError
from trellisdb.training import sql
from trellisdb.training.kinds.base import F64, HASHES, IDS, STR, ViewKind
from trellisdb.training.layout import conversation, plain
from trellisdb.training.options import ViewOptions

SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), ("reward", F64), *HASHES, ("response_hash", STR),
                    ("node_ids", IDS)])
#: path=True: the root-to-node path, a prompt and a response per step (multi-turn)
PATH_SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), ("reward", F64), *HASHES, ("response_hash", STR),
                         ("node_ids", IDS), ("prompt_hashes", IDS), ("response_hashes", IDS)])
#: messages=...: a node's chat turns (``message_hash``); with path=True every step's, root first
MESSAGES_SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), ("reward", F64), ("message_hash", STR),
                             ("node_ids", IDS)])
MESSAGES_PATH_SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), ("reward", F64), ("message_hash", STR),
                                  ("node_ids", IDS), ("message_hashes", IDS)])


class Sft(ViewKind):
    name = "sft"
    options = ("threshold", "path", "messages")
    needs_reward = False
    schemas: ClassVar[Mapping[str, pa.Schema]] = {"sft": SCHEMA, "sft_path": PATH_SCHEMA,
                                                 "sft_messages": MESSAGES_SCHEMA,
                                                 "sft_messages_path": MESSAGES_PATH_SCHEMA}
    keys: ClassVar[Mapping[str, tuple[str, ...]]] = {"sft": ("node_id",), "sft_path": ("node_id",),
                                                    "sft_messages": ("node_id",), "sft_messages_path": ("node_id",)}
    # a path's first prompt and its last response; a step without a prompt (response) has no user (assistant) turn
    export_texts = ("prompt_hash", "response_hash")
    layouts: ClassVar[Mapping[str, str]] = {"trl": "conversational language modeling: messages",
                                           "openai": "OpenAI supervised fine-tuning: messages"}

    def shape(self, spec: ViewOptions) -> str:
        base = "sft_messages" if spec.messages is not None else "sft"
        return base + "_path" if spec.path else base

    def roles_of(self, spec: ViewOptions) -> tuple[tuple[str, str], ...]:
        return sql.MESSAGE_ROLES if spec.messages is not None else self.roles

    def texts_needed(self, spec: ViewOptions) -> tuple[str, ...]:
        # the row's own node's turns (a step of its path may have none)
        return ("message_hash",) if spec.messages is not None else self.export_texts

    def paths(self, spec: ViewOptions) -> bool:
        return spec.path

    def scored(self, spec: ViewOptions) -> bool:
        # paths keep unscored ancestors (the threshold applies to the path's last node)
        return spec.threshold is not None and not spec.path

    def body(self, spec: ViewOptions, ctes: list[str], restrict: bool) -> tuple[bool, str]:
        cond = "__reward >= $__threshold" if spec.threshold is not None else "true"
        texts = "message_hash" if spec.messages is not None else "system_hash, prompt_hash, response_hash"
        if spec.messages is not None:  # a row per node with turns of its own
            cond += " AND message_hash IS NOT NULL"
        if not spec.path:
            node_filter = " AND id IN (SELECT id FROM __dirty_nodes)" if restrict else ""
            return False, (f"SELECT id AS node_id, task_id, __reward AS reward, {texts}, "
                           f"[id] AS node_ids FROM a WHERE {cond}{node_filter}")
        leaf_filter = " AND id IN (SELECT id FROM __dirty_leaves)" if restrict else ""
        ctes.append(sql.first_parents(spec))
        ctes.append(f"sel AS (SELECT id FROM a WHERE {cond}{leaf_filter})")
        ctes.append(sql.paths_from("sel"))
        if spec.messages is not None:
            return True, ("SELECT pth.leaf AS node_id, any_value(l.task_id) AS task_id, any_value(l.__reward) AS reward, "
                          "any_value(l.message_hash) AS message_hash, list(pth.id ORDER BY pth.depth DESC) AS node_ids, "
                          "list(s.message_hash ORDER BY pth.depth DESC) AS message_hashes "
                          "FROM path pth JOIN a s ON s.id = pth.id JOIN a l ON l.id = pth.leaf GROUP BY pth.leaf")
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
        if shape in ("sft_messages", "sft_messages_path"):
            return pl.DataFrame(pl.from_arrow(pa.table({"messages": stored_turns(plain(t), shape)})))
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


#: A chat message as exported: its role and content.
MESSAGE = pa.struct([("role", STR), ("content", STR)])


def stored_turns(t: pa.Table, shape: str) -> pa.Array:
    """Per row of an sft ``messages=`` view: the turns its nodes' message artifacts hold (with a
    path, every step's that has one, root first), as ``{role, content}``. A text that is not a
    JSON array of messages with a string ``role`` is an ``ExportError`` naming its node; a
    ``content`` that is not a string (nor null) is written as its JSON text."""
    path = shape.endswith("_path")
    texts = t["messages" if path else "message"].to_pylist()
    nodes = t["node_ids"].to_pylist()
    rows = []
    for row_texts, ids in zip(texts, nodes, strict=True):
        per_step = row_texts if path else [row_texts]
        steps = ids if path else ids[-1:]
        turns: list[dict[str, Any]] = []
        for text, node in zip(per_step, steps, strict=True):
            if text is not None:
                turns.extend(_messages(text, node))
        rows.append(turns)
    return pa.array(rows, pa.list_(MESSAGE))


def _messages(text: str, node: str) -> list[dict[str, Any]]:
    """The ``{role, content}`` turns of one node's message artifact."""
    try:
        got = json.loads(text)
    except ValueError as e:
        raise ExportError(f"the messages artifact of node {node!r} is not JSON ({e}); it must hold a JSON array "
                          'of chat messages like [{"role": "user", "content": "..."}]') from None
    if not isinstance(got, list):
        raise ExportError(f"the messages artifact of node {node!r} holds a JSON {type(got).__name__}, not an array "
                          'of chat messages like [{"role": "user", "content": "..."}]')
    out = []
    for i, m in enumerate(got):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or not role:
            raise ExportError(f"message {i} of node {node!r}'s messages artifact has no string 'role': "
                              f"{json.dumps(m)[:120]}; each message is {{\"role\": ..., \"content\": ...}}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            content = json.dumps(content, ensure_ascii=False)
        out.append({"role": role, "content": content})
    return out


KIND = Sft()
