"""``replay``: a sample of ``size`` nodes without replacement, each at most once (in its smallest
group), with priority ``|advantage|`` within its group (``strategy='advantage'``) or by its
group's success-rate bucket (``strategy='bucket'``, ExGRPO-style: medium-difficulty groups
first, lower ``entropy`` channel first); deterministic under ``seed``.

The SQL gives the candidates with their groups' statistics; the sample is drawn in numpy.
A replay samples the whole view, so a refresh rebuilds it. Exported as ``messages`` (as sft).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import ValidationError
from trellisdb.training import sql
from trellisdb.training.kinds.base import F64, HASHES, I64, IDS, STR, ViewKind
from trellisdb.training.layout import conversation
from trellisdb.training.options import ViewOptions
from trellisdb.training.sql import Base

if TYPE_CHECKING:
    from trellisdb.snapshot import Snapshot

SCHEMA = pa.schema([("node_id", STR), ("task_id", STR), ("reward", F64), ("group_key", STR),
                    ("advantage", F64), ("priority", F64), ("sample_rank", I64), *HASHES,
                    ("response_hash", STR), ("node_ids", IDS)])


class Replay(ViewKind):
    name = "replay"
    options = ("group_by", "size", "strategy", "seed", "entropy", "threshold")
    rebuilds = "a replay samples the whole view"
    schemas: ClassVar[Mapping[str, pa.Schema]] = {"replay": SCHEMA}
    keys: ClassVar[Mapping[str, tuple[str, ...]]] = {"replay": ("sample_rank",)}
    export_texts = ("prompt_hash", "response_hash")
    layouts: ClassVar[Mapping[str, str]] = {"trl": "conversational language modeling: messages",
                                           "openai": "OpenAI supervised fine-tuning: messages"}

    def validate(self, spec: ViewOptions) -> None:
        if not isinstance(spec.size, int) or spec.size < 1:
            raise ValidationError("a replay view needs size=n (how many rows to sample), n >= 1")
        if spec.strategy not in ("advantage", "bucket"):
            raise ValidationError(f"replay strategy must be 'advantage' or 'bucket', not {spec.strategy!r}")
        if spec.strategy == "bucket" and spec.threshold is None:
            raise ValidationError("a bucket replay needs threshold=... (reward >= threshold counts as a success)")

    def body(self, spec: ViewOptions, ctes: list[str], restrict: bool) -> tuple[bool, str]:
        # the candidates, each once (its smallest group), with its group's statistics
        return False, ("SELECT g.id AS node_id, g.task_id, g.__reward AS reward, g.grp AS group_key, "
                       "CASE WHEN st.sd > 0 THEN (g.__reward - st.m) / st.sd ELSE 0.0 END AS advantage, "
                       "st.success, g.system_hash, g.prompt_hash, g.response_hash "
                       f"FROM g JOIN ({sql.GROUP_STATS}) st "
                       "USING (grp) QUALIFY row_number() OVER (PARTITION BY g.id ORDER BY g.grp) = 1")

    def statement(self, spec: ViewOptions, base: Base, restrict: bool, group_edges: bool = False) -> str:
        return self.sql(spec, base, restrict, group_edges)  # sorted and sampled in finish

    def finish(self, snap: Snapshot, spec: ViewOptions, rows: pa.Table) -> pa.Table:
        """A prioritized sample without replacement (Efraimidis-Spirakis keys ``u ** (1 / p)``
        from a generator seeded with ``seed``, over the candidates sorted by id)."""
        assert spec.size is not None  # validated
        cand = rows.sort_by("node_id")
        n = cand.num_rows
        if spec.strategy == "advantage":
            prio = np.abs(cand["advantage"].to_numpy(zero_copy_only=False)) + 1e-6
        else:
            success = cand["success"].to_numpy(zero_copy_only=False)
            prio = np.exp(-((success - 0.5) ** 2) / (2 * 0.2**2))  # medium difficulty first
            prio[(success <= 0) | (success >= 1)] *= 0.05  # all-fail / all-pass groups rarely
            if spec.entropy:
                ent = _channel(snap, spec.entropy, cand["node_id"])
                rank = np.argsort(np.argsort(np.nan_to_num(ent, nan=np.inf), kind="stable"), kind="stable")
                prio = prio * (1.0 - 0.5 * rank / max(1, n - 1))  # lower entropy first
        rng = np.random.default_rng(spec.seed)
        keys = rng.random(n) ** (1.0 / prio) if n else np.empty(0)
        take = np.argsort(-keys, kind="stable")[: spec.size]
        out = cand.take(pa.array(take, pa.int64()))
        out = out.append_column("priority", pa.array(prio[take], F64))
        out = out.append_column("sample_rank", pa.array(np.arange(1, len(take) + 1), I64))
        out = out.append_column("node_ids", pa.array([[i] for i in out["node_id"].to_pylist()], IDS))
        return self.canonical("replay", out)

    def layout(self, format: str, shape: str, t: pa.Table) -> pl.DataFrame:
        return conversation(t)


def _channel(snap: Snapshot, channel: str, ids: pa.ChunkedArray) -> np.ndarray:
    """Per id, its value of reward ``channel`` (NaN: none)."""
    t = snap.execute("SELECT node_id, value FROM rewards WHERE channel = $c AND node_id IN (SELECT id FROM __ids)",
                 {"c": channel}, relations={"__ids": pa.table({"id": ids})})
    joined = pa.table({"node_id": ids}).join(t, "node_id", join_type="left outer")
    order = pc.index_in(ids, value_set=joined["node_id"].combine_chunks())
    return joined["value"].take(order).to_numpy(zero_copy_only=False).astype(np.float64)  # type: ignore[no-any-return]


KIND = Replay()
