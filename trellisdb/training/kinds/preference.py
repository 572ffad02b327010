"""``preference``: one row per (chosen, rejected) pair: siblings (same parent, or same prompt)
whose rewards differ by at least ``margin`` (ties never pair), and explicit ``comparisons``
(the majority of votes; they override rewards for the pairs they judge).

Exported as ``prompt`` [system?, user], ``chosen`` / ``rejected`` [assistant] (trl), or
``input.messages``, ``preferred_output`` / ``non_preferred_output`` (openai).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import polars as pl
import pyarrow as pa

from trellisdb.training.kinds.base import F64, HASHES, IDS, STR, ViewKind
from trellisdb.training.layout import frame, msg, prompt_msgs
from trellisdb.training.options import ViewOptions

SCHEMA = pa.schema([("chosen_id", STR), ("rejected_id", STR), ("task_id", STR), ("group_key", STR),
                    ("margin", F64), ("source", STR), *HASHES, ("chosen_hash", STR),
                    ("rejected_hash", STR), ("node_ids", IDS)])


class Preference(ViewKind):
    name = "preference"
    options = ("group_by", "margin", "pairs_from")
    schemas: ClassVar[Mapping[str, pa.Schema]] = {"preference": SCHEMA}
    keys: ClassVar[Mapping[str, tuple[str, ...]]] = {"preference": ("chosen_id", "rejected_id")}
    export_texts = ("prompt_hash", "chosen_hash", "rejected_hash")
    layouts: ClassVar[Mapping[str, str]] = {"trl": "conversational preference: prompt, chosen, rejected",
                                           "openai": "OpenAI preference fine-tuning: input, preferred_output, non_preferred_output"}

    def reads_comparisons(self, spec: ViewOptions) -> bool:
        return "comparisons" in spec.pairs_from

    def body(self, spec: ViewOptions, ctes: list[str], restrict: bool) -> tuple[bool, str]:
        parts = []
        if "siblings" in spec.pairs_from:
            ctes.append(
                "sib AS (SELECT c.id AS chosen_id, r.id AS rejected_id, min(c.grp) AS group_key, "
                "any_value(c.__reward - r.__reward) AS margin FROM g c JOIN g r ON c.grp = r.grp "
                "AND c.__reward > r.__reward AND c.__reward - r.__reward >= $__margin GROUP BY c.id, r.id)"
            )
            parts.append("SELECT chosen_id, rejected_id, group_key, margin, 'siblings' AS source FROM sib")
        if "comparisons" in spec.pairs_from:
            cfilter = (" AND (c.a IN (SELECT id FROM __dirty_nodes) OR c.b IN (SELECT id FROM __dirty_nodes))"
                       if restrict else "")
            ctes.append(
                "votes AS (SELECT c.preferred AS chosen_id, CASE WHEN c.preferred = c.a THEN c.b ELSE c.a END "
                "AS rejected_id, c.margin FROM comparisons c WHERE c.preferred IS NOT NULL "
                "AND c.preferred IN (c.a, c.b) AND c.a <> c.b AND c.a IN (SELECT id FROM a) "
                f"AND c.b IN (SELECT id FROM a){cfilter})"
            )
            ctes.append("tally AS (SELECT chosen_id, rejected_id, count(*) AS n, "
                        "list_avg(list(margin ORDER BY margin)) AS margin FROM votes GROUP BY ALL)")
            ctes.append("cmp AS (SELECT t.chosen_id, t.rejected_id, t.margin FROM tally t LEFT JOIN tally o "
                        "ON o.chosen_id = t.rejected_id AND o.rejected_id = t.chosen_id "
                        "WHERE t.n > coalesce(o.n, 0))")
            # ties included: a pair the comparisons judged (either way) is theirs to decide
            ctes.append("judged AS (SELECT a AS x, b AS y FROM comparisons UNION SELECT b, a FROM comparisons)")
            parts = [p + " WHERE (chosen_id, rejected_id) NOT IN (SELECT x, y FROM judged)" for p in parts]
            parts.append("SELECT chosen_id, rejected_id, NULL AS group_key, margin, 'comparison' AS source FROM cmp")
        ctes.append(f"pairs AS ({' UNION ALL '.join(parts)})")
        return False, ("SELECT p.chosen_id, p.rejected_id, c.task_id, p.group_key, p.margin, p.source, "
                       "c.system_hash, c.prompt_hash, c.response_hash AS chosen_hash, "
                       "r.response_hash AS rejected_hash, [p.chosen_id, p.rejected_id] AS node_ids "
                       "FROM pairs p JOIN a c ON c.id = p.chosen_id JOIN a r ON r.id = p.rejected_id")

    def layout(self, format: str, shape: str, t: pa.Table) -> pl.DataFrame:
        df = frame(t)
        if format == "trl":
            return df.select(prompt_msgs().alias("prompt"),
                             pl.concat_list([msg("assistant", "chosen")]).alias("chosen"),
                             pl.concat_list([msg("assistant", "rejected")]).alias("rejected"))
        return df.select(pl.struct(messages=prompt_msgs()).alias("input"),  # openai
                         pl.concat_list([msg("assistant", "chosen")]).alias("preferred_output"),
                         pl.concat_list([msg("assistant", "rejected")]).alias("non_preferred_output"))


KIND = Preference()
