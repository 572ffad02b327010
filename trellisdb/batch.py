"""Rows waiting to be committed together: the unit the committer makes durable."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from trellisdb.schema import DATA_TABLES, KEYS, table_schema
from trellisdb.storage.spaces import space_schema, vector_column


@dataclass
class Batch:
    """Rows waiting to be committed together, per table."""

    rows: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {t: [] for t in DATA_TABLES})
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ids of nodes created (by add_node) in this batch, not just re-statused
    added: set[str] = field(default_factory=set)
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)
    tasks: set[str] = field(default_factory=set)
    hashes: set[str] = field(default_factory=set)
    session_id: str | None = None
    #: space table -> (ids, (n, dim) float32 vectors) chunks, in write order
    vectors: dict[str, list[tuple[list[str], Any]]] = field(default_factory=dict)
    #: the sessions whose writes the batch holds (None: writes made outside a session)
    writers: set[str | None] = field(default_factory=set)
    #: set by the commit once its commit record is durable
    commit_id: int | None = None
    #: the next node's ``ordinal`` (its position among the nodes first written by this batch)
    next_ordinal: int = 0
    #: nodes first written by another pending batch (committed before this one) whose rows this
    #: batch rewrites: their ``born`` is that batch's commit id, known once it commits
    born_in: dict[str, Batch] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(r) for r in self.rows.values()) + sum(len(i) for c in self.vectors.values() for i, _ in c)

    def vector_tables(self, commit_id: int) -> dict[str, pa.Table]:
        """The space rows of this batch as one Arrow table per space table (no per-row work)."""
        out = {}
        for name, chunks in self.vectors.items():
            ids = [i for c, _ in chunks for i in c]
            mat = np.concatenate([m for _, m in chunks])
            cols = [pa.array(ids, pa.string()), vector_column(mat), pa.array(np.full(len(ids), commit_id, np.int64))]
            out[name] = pa.Table.from_arrays(cols, schema=space_schema(mat.shape[1]))
        return out

    def settle_born(self) -> None:
        """Set ``born`` of the rows that rewrite nodes another batch first wrote (it has committed)."""
        for node_id, other in self.born_in.items():
            row = self.nodes.get(node_id)
            if row is not None and row.get("born") is None and other.commit_id is not None:
                row["born"] = other.commit_id

    def latest_rows(self) -> dict[str, list[dict[str, Any]]]:
        """The rows per table, the last write of each key only: two writes to one key in one
        commit, the later wins (a commit is atomic, so the earlier was never visible)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for name, all_rows in self.rows.items():
            if not all_rows:
                continue
            latest = {tuple(r[k] for k in KEYS[name]): r for r in all_rows}
            out[name] = list(latest.values()) if len(latest) < len(all_rows) else all_rows
        return out

    def approx_bytes(self) -> int:
        """About how many bytes the batch's rows take (artifact contents and vectors dominate)."""
        n = sum(len(r.get("content") or b"") for r in self.rows["artifacts"])
        n += sum(len(r) * 200 for r in self.rows.values())
        return n + sum(int(m.nbytes) for c in self.vectors.values() for _, m in c)

    def to_arrow(self, dim: int, commit_id: int) -> dict[str, pa.Table]:
        return {name: pa.Table.from_pylist([{**r, "commit_id": commit_id} for r in rows],
                                           schema=table_schema(name, dim))
                for name, rows in self.latest_rows().items()}
