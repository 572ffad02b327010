"""Embedding spaces as stored: the record of a space, its table's schema, and the registry
``spaces.json`` (the named spaces of a database, written under the writer lock).

A *space* is a named set of vectors of one dimension (and, usually, one model) attached to
nodes or tasks. Every database has the built-in space ``embedding``: the ``embedding``
column of ``nodes`` and of ``tasks``. Named spaces are Lance tables ``vec_<target>_<name>``
of ``(id, vector, commit_id)`` rows. Search and index upkeep live in ``trellisdb/vectors/``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from trellisdb.errors import CorruptionError, EmbeddingDimensionError, ValidationError

#: The space every database has: the ``embedding`` column of nodes and tasks.
BUILTIN = "embedding"

#: The text column keyword search (and ``db.embed``) reads, per target.
TEXT_COLUMN = {"nodes": "summary", "tasks": "spec"}
TARGETS = ("nodes", "tasks")
_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}$")


@dataclass(frozen=True)
class Space:
    """A named embedding space of ``target`` rows (nodes or tasks)."""

    name: str
    target: str
    dim: int
    model: str | None = None
    #: the target column ``db.embed`` embeds (default: summary / spec)
    text: str | None = None

    @property
    def builtin(self) -> bool:
        return self.name == BUILTIN

    @property
    def table(self) -> str:
        return self.target if self.builtin else f"vec_{self.target}_{self.name}"

    @property
    def column(self) -> str:
        return "embedding" if self.builtin else "vector"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "dim": self.dim, "model": self.model,
                "text": self.text or TEXT_COLUMN[self.target], "table": self.table}


def space_schema(dim: int) -> pa.Schema:
    return pa.schema([
        pa.field("id", pa.string(), nullable=False, metadata={"doc": "node or task id"}),
        pa.field("vector", pa.list_(pa.float32(), dim), metadata={"doc": "the embedding"}),
        pa.field("commit_id", pa.int64(), nullable=False, metadata={"doc": "id of the commit that wrote this row"}),
    ])


def check_space_name(name: object) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValidationError(
            f"space name {name!r} must be lower-case letters, digits and _ (starting with a letter), at most 63"
        )
    return name


def as_matrix(vectors: Any, dim: int, what: str) -> np.ndarray:
    """``vectors`` as a finite float32 (n, dim) array, or a clear error."""
    try:
        arr = np.asarray(vectors, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValidationError(f"{what} must be numbers, got {type(vectors).__name__}") from e
    if arr.ndim == 1:
        arr = arr.reshape(1, -1)
    if arr.ndim != 2 or arr.shape[1] != dim:
        got = arr.shape[-1] if arr.ndim else 0
        raise EmbeddingDimensionError(f"{what} has dimension {got}, but the space has dimension {dim}")
    if not np.isfinite(arr).all():
        raise ValidationError(f"{what} contains NaN or infinite values")
    return arr


def vector_column(arr: np.ndarray) -> pa.FixedSizeListArray:
    return pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(arr, np.float32).ravel()), arr.shape[1])


# ------------------------------------------------------------------ registry
class SpaceRegistry:
    """The spaces of a database: the built-in ones plus ``spaces.json``."""

    def __init__(self, path: str, builtin_dim: int) -> None:
        self.path = path
        self.builtin_dim = builtin_dim
        self._mtime: float | None = None
        self._spaces: dict[tuple[str, str], Space] = {}

    def all(self) -> list[Space]:
        self._load()
        return [Space(BUILTIN, t, self.builtin_dim) for t in TARGETS] + list(self._spaces.values())

    def get(self, target: str, name: str) -> Space | None:
        if name == BUILTIN:
            return Space(BUILTIN, target, self.builtin_dim)
        self._load()
        return self._spaces.get((target, name))

    def names(self, target: str) -> list[str]:
        return [s.name for s in self.all() if s.target == target]

    def _load(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            self._spaces = {}
            return
        if mtime == self._mtime:
            return
        try:
            with open(self.path) as fh:
                raw = json.load(fh)
            spaces = {(d["target"], d["name"]): Space(d["name"], d["target"], int(d["dim"]), d.get("model"),
                                                      d.get("text")) for d in raw["spaces"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptionError(f"{self.path} is unreadable ({e}); restore it or remove the spaces it named") from e
        self._spaces, self._mtime = spaces, mtime

    def add(self, space: Space) -> None:
        """Record ``space`` (the caller holds the writer lock); atomic: written aside, then renamed."""
        self._load()
        spaces = {**self._spaces, (space.target, space.name): space}
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"spaces": [{"name": s.name, "target": s.target, "dim": s.dim, "model": s.model,
                                   "text": s.text} for s in spaces.values()]}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._mtime = None
