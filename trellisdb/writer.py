"""Pending writes and the session writer an agent uses.

>>> import tempfile, trellisdb
>>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
>>> with db.session(task="circle-packing", agent="evolve", model="m") as s:
...     root = s.add_node(summary="initial program", artifacts={"code": "print(1)"})
...     child = s.add_node(parents=[root], summary="mutated")
...     s.add_reward(child, "score", 0.7, verifier="eval.py")
>>> db.sql("SELECT count(*) AS n FROM nodes").to_pylist()
[{'n': 2}]
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import numbers
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from trellisdb.errors import (
    DuplicateIdError,
    EmbeddingDimensionError,
    InvalidRewardError,
    UnknownNodeError,
    UnknownParentError,
    ValidationError,
)
from trellisdb.ids import new_id
from trellisdb.names import check_name, check_text
from trellisdb.schema import DATA_TABLES, EDGE_KINDS, KEYS, table_schema

if TYPE_CHECKING:
    from trellisdb.database import Database


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


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

    def __len__(self) -> int:
        return sum(len(r) for r in self.rows.values()) + sum(len(i) for c in self.vectors.values() for i, _ in c)

    def vector_tables(self, commit_id: int) -> dict[str, pa.Table]:
        """The space rows of this batch as one Arrow table per space table (no per-row work)."""
        from trellisdb.vectors import space_schema, vector_column

        out = {}
        for name, chunks in self.vectors.items():
            ids = [i for c, _ in chunks for i in c]
            mat = np.concatenate([m for _, m in chunks])
            cols = [pa.array(ids, pa.string()), vector_column(mat), pa.array(np.full(len(ids), commit_id, np.int64))]
            out[name] = pa.Table.from_arrays(cols, schema=space_schema(mat.shape[1]))
        return out

    def to_arrow(self, dim: int, commit_id: int) -> dict[str, pa.Table]:
        out: dict[str, pa.Table] = {}
        for name, all_rows in self.rows.items():
            if not all_rows:
                continue
            # Two writes to one key in one commit: the later wins (a commit is
            # atomic, so the earlier was never visible to anyone).
            latest = {tuple(r[k] for k in KEYS[name]): r for r in all_rows}
            rows = list(latest.values()) if len(latest) < len(all_rows) else all_rows
            sch = table_schema(name, dim)
            cols = {f.name: [r.get(f.name) for r in rows] for f in sch if f.name != "commit_id"}
            cols["commit_id"] = [commit_id] * len(rows)
            out[name] = pa.Table.from_pydict(cols, schema=sch)
        return out


#: The range of the int64 columns (steps, token counts).
INT64_MAX = 2**63 - 1


def _check_int(value: object, what: str, *, minimum: int = 0) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValidationError(f"{what} must be an integer, got {type(value).__name__} {value!r}")
    v = int(value)
    if not minimum <= v <= INT64_MAX:
        raise ValidationError(f"{what} must be a whole number in [{minimum}, 2**63 - 1], got {v}")
    return v


def _check_float(value: object, what: str, *, minimum: float | None = None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValidationError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    try:
        f = float(value)
    except OverflowError:
        raise ValidationError(f"{what} must be finite, got {value!r}") from None
    if not math.isfinite(f):
        raise ValidationError(f"{what} must be finite, got {f!r}")
    if minimum is not None and f < minimum:
        raise ValidationError(f"{what} must be >= {minimum}, got {f!r}")
    return f


def check_embedding(value: object, dim: int, what: str) -> list[float] | None:
    """``value`` as the float32 values it is stored as; NaN, infinities and values beyond float32's
    range (which would be stored as infinities) are refused."""
    if value is None:
        return None
    if isinstance(value, str | bytes):
        raise ValidationError(f"{what} must be a sequence of numbers, got {type(value).__name__}")
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            vec = np.asarray(value, dtype=np.float64).astype(np.float32)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValidationError(f"{what} must be a sequence of numbers, got {type(value).__name__}") from e
    if vec.ndim != 1:
        raise ValidationError(f"{what} must be a flat sequence of numbers, got shape {vec.shape}")
    if len(vec) != dim:
        raise EmbeddingDimensionError(
            f"{what} has dimension {len(vec)}, but this database's embedding space has dimension {dim}"
        )
    if not np.isfinite(vec).all():
        raise ValidationError(
            f"{what} contains NaN or infinite values (or values beyond float32's range, |x| > 3.4e38: "
            "embeddings are stored as float32)"
        )
    out: list[float] = vec.tolist()
    return out


@dataclass(frozen=True)
class Artifact:
    """A payload checked and hashed at the call, staged only with the rest of its write."""

    name: str
    hash: str
    data: bytes
    media_type: str | None


def artifact(name: object, content: object, media_type: object = None) -> Artifact:
    check_name(name, "artifact name")
    assert isinstance(name, str)
    check_name(media_type, f"media type of artifact {name!r}", optional=True)
    if isinstance(content, str):
        check_text(content, f"artifact {name!r} content")
        data = content.encode()
        media = media_type or "text/plain"
    elif isinstance(content, bytes | bytearray | memoryview):
        data = bytes(content)
        media = media_type
    else:
        raise ValidationError(f"artifact {name!r} content must be str or bytes, got {type(content).__name__}")
    return Artifact(name, content_hash(data), data, media if isinstance(media, str) else None)


def content_hash(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


class SessionWriter:
    """Writes one session's nodes, edges, artifacts, rewards and comparisons.

    Obtain it from :meth:`Database.session`; every call validates all of its
    input before it stages anything (a call either stages all of its rows or
    none) and raises a :class:`~trellisdb.TrellisError` subclass naming the bad
    value. Writes are group-committed (see :meth:`Database.flush`) unless made
    inside :meth:`Database.transaction`.
    """

    def __init__(self, db: Database, session_id: str, task_id: str) -> None:
        self._db = db
        self.id = session_id
        self.task_id = task_id
        self._step = 0
        self._closed = False

    def __enter__(self) -> SessionWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        if not self._closed:
            self.close(status="failed" if et is not None else "completed")

    def close(self, status: str = "completed") -> None:
        """Record the session's final status and flush its writes."""
        check_name(status, "session status")
        self._closed = True
        self._db._write_session_status(self.id, status)
        if not self._db.in_transaction():
            self._db.flush()

    def add_node(
        self,
        *,
        id: str | None = None,
        parents: Sequence[str] = (),
        edge_kind: str = "derived_from",
        kind: str = "attempt",
        step: int | None = None,
        status: str = "pending",
        summary: str | None = None,
        cost: Mapping[str, float] | None = None,
        embedding: Sequence[float] | None = None,
        artifacts: Mapping[str, str | bytes] | None = None,
        source: str | None = None,
    ) -> str:
        """Add a node (an attempt, step, tool call...) and its parent edges; return its id.

        All or nothing: the node, its edges and its artifacts are staged together once every
        value has passed its checks."""
        db = self._db
        node_id = check_name(id, "node id", optional=True) or new_id()
        check_name(kind, "kind")
        check_name(status, "status")
        check_text(summary, "summary")
        check_text(source, "source")
        if isinstance(parents, str) or not isinstance(parents, Sequence | set | frozenset):
            raise ValidationError(
                f"parents must be a list of node ids, got {parents!r}; write parents=[{parents!r}]"
            )
        for p in parents:
            check_name(p, "parent id")
        if edge_kind not in EDGE_KINDS:
            raise ValidationError(f"unknown edge kind {edge_kind!r}; use one of {', '.join(EDGE_KINDS)}")
        step_v = _check_int(step, "step")
        if step_v is None:
            step_v = self._step + 1
        if cost is not None and not isinstance(cost, Mapping):
            raise ValidationError(f"cost must be a mapping like {{'tokens_in': 10}}, got {type(cost).__name__}")
        cost = dict(cost or {})
        unknown = set(cost) - {"tokens_in", "tokens_out", "seconds", "usd"}
        if unknown:
            raise ValidationError(f"unknown cost field(s) {sorted(unknown, key=str)}; use tokens_in, tokens_out, "
                                  "seconds, usd")
        vec = check_embedding(embedding, db.embedding_dim, f"embedding of node {node_id!r}")
        if artifacts is not None and not isinstance(artifacts, Mapping):
            raise ValidationError(f"artifacts must be a mapping of role -> content, got {type(artifacts).__name__}")
        arts = [artifact(aname, content) for aname, content in (artifacts or {}).items()]
        row = {
            "id": node_id,
            "session_id": self.id,
            "task_id": self.task_id,
            "kind": kind,
            "step": step_v,
            "status": status,
            "summary": summary,
            "tokens_in": _check_int(cost.get("tokens_in"), "cost tokens_in"),
            "tokens_out": _check_int(cost.get("tokens_out"), "cost tokens_out"),
            "seconds": _check_float(cost.get("seconds"), "cost seconds", minimum=0.0),
            "usd": _check_float(cost.get("usd"), "cost usd", minimum=0.0),
            "source": source,
            "embedding": vec,
            "created_at": _now(),
        }
        if id is not None:
            original = db._node_original(node_id, edge_kind)
            if original is not None:
                diff = _node_difference(original, row, set(parents), explicit_step=step is not None)
                if diff:
                    raise DuplicateIdError(
                        f"node id {node_id!r} already exists with a different {diff}; "
                        "use a new id, or omit id= to have one generated"
                    )
                return node_id  # idempotent retry of the same write
        missing = db._missing_nodes(list(parents))
        if missing:
            raise UnknownParentError(
                f"parent {missing[0]!r} of node {node_id!r} does not exist; add the parent first "
                f"(or flush it from the writer that made it)"
            )
        self._step = max(self._step, step_v)  # only a node actually written advances the counter
        with db._sink(self.id) as b:
            b.rows["nodes"].append(row)
            b.nodes[node_id] = row
            b.added.add(node_id)
            for p in parents:
                b.rows["edges"].append({"src": p, "dst": node_id, "kind": edge_kind, "session_id": self.id})
            for a in arts:
                self._stage_artifact(b, node_id, a)
        return node_id

    def add_edge(self, src: str, dst: str, kind: str = "derived_from") -> None:
        """Add a typed lineage edge ``src -> dst`` between existing nodes."""
        check_name(src, "edge source")
        check_name(dst, "edge target")
        if kind not in EDGE_KINDS:
            raise ValidationError(f"unknown edge kind {kind!r}; use one of {', '.join(EDGE_KINDS)}")
        if src == dst:
            raise ValidationError(f"edge {src!r} -> {dst!r} is a self-loop; lineage edges join two different nodes")
        missing = self._db._missing_nodes([src, dst])
        if missing:
            raise UnknownNodeError(f"edge {src!r} -> {dst!r}: node {missing[0]!r} does not exist")
        with self._db._sink(self.id) as b:
            b.rows["edges"].append({"src": src, "dst": dst, "kind": kind, "session_id": self.id})

    def add_artifact(self, node_id: str, name: str, content: str | bytes, media_type: str | None = None) -> str:
        """Attach a content-addressed payload to a node; return its sha256 hash."""
        check_name(node_id, "node id")
        a = artifact(name, content, media_type)
        if self._db._missing_nodes([node_id]):
            raise UnknownNodeError(f"artifact {name!r}: node {node_id!r} does not exist")
        with self._db._sink(self.id) as b:
            self._stage_artifact(b, node_id, a)
        return a.hash

    def _stage_artifact(self, b: Batch, node_id: str, a: Artifact) -> None:
        if a.hash not in b.hashes and not self._db._has_artifact(a.hash):
            b.rows["artifacts"].append({"hash": a.hash, "media_type": a.media_type, "size": len(a.data),
                                        "content": a.data})
            b.hashes.add(a.hash)
        b.rows["node_artifacts"].append({"node_id": node_id, "name": a.name, "hash": a.hash})

    def add_reward(
        self,
        node_id: str,
        channel: str,
        value: float,
        *,
        verifier: str | None = None,
        verifier_version: str | None = None,
    ) -> None:
        """Record a reward; a later reward on the same (node, channel) supersedes it."""
        check_name(node_id, "node id")
        check_name(channel, "reward channel")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise InvalidRewardError(
                f"reward {channel!r} of node {node_id!r} must be a number, got {type(value).__name__} {value!r}"
            )
        try:
            v = float(value)
        except OverflowError:
            v = math.inf
        if not math.isfinite(v):
            raise InvalidRewardError(
                f"reward {channel!r} of node {node_id!r} is {v!r}; rewards must be finite "
                "(record a failed evaluation as a status, or as a separate channel)"
            )
        check_name(verifier, "verifier", optional=True)
        check_name(verifier_version, "verifier_version", optional=True)
        if self._db._missing_nodes([node_id]):
            raise UnknownNodeError(f"reward {channel!r}: node {node_id!r} does not exist")
        with self._db._sink(self.id) as b:
            b.rows["rewards"].append(
                {
                    "node_id": node_id,
                    "channel": channel,
                    "value": v,
                    "verifier": verifier,
                    "verifier_version": verifier_version,
                    "created_at": _now(),
                }
            )

    def add_comparison(
        self,
        a: str,
        b: str,
        preferred: str | None,
        *,
        margin: float | None = None,
        judge: str | None = None,
        id: str | None = None,
    ) -> str:
        """Record a pairwise judgment; ``preferred`` is ``a``, ``b`` or None for a tie.

        An ``id`` that exists already is an error unless the judgment is the same (a retry)."""
        check_name(a, "comparison node a")
        check_name(b, "comparison node b")
        if a == b:
            raise ValidationError(f"comparison of {a!r} with itself; a comparison judges two different nodes")
        if preferred is not None and preferred not in (a, b):
            raise ValidationError(f"preferred {preferred!r} must be {a!r}, {b!r} or None (a tie)")
        comparison_id = check_name(id, "comparison id", optional=True) or new_id()
        row = {
            "id": comparison_id,
            "a": a,
            "b": b,
            "preferred": preferred,
            "margin": _check_float(margin, "margin"),
            "judge": check_name(judge, "judge", optional=True),
        }
        missing = self._db._missing_nodes([a, b])
        if missing:
            raise UnknownNodeError(f"comparison: node {missing[0]!r} does not exist")
        if id is not None:
            old = self._db._comparison_row(comparison_id)
            if old is not None:
                if any(old.get(k) != v for k, v in row.items()):
                    raise DuplicateIdError(
                        f"comparison id {id!r} already exists with another judgment ({old['a']!r} vs {old['b']!r}, "
                        f"preferred {old['preferred']!r}); use a new id, or omit id="
                    )
                return comparison_id  # the same judgment again: a retry
        with self._db._sink(self.id) as batch:
            batch.rows["comparisons"].append(row)
        return comparison_id

    def set_status(self, node_id: str | Sequence[str], status: str) -> None:
        """Change the status of a node, or of many at once (new rows; history keeps the old ones).

        Many ids are looked up in one query; an unknown id changes nothing:

        >>> s.set_status([a, b], "expanded")  # doctest: +SKIP
        """
        check_name(status, "status")
        ids = [node_id] if isinstance(node_id, str) else node_id
        if not isinstance(ids, Sequence | set | frozenset):
            raise ValidationError(f"set_status takes a node id or a list of them, got {type(node_id).__name__}")
        for i in ids:
            check_name(i, "node id")
        self._db._set_status(list(ids), status, self.id)


#: Node fields a retried ``add_node`` with the same id must repeat exactly.
#: Not compared: status and created_at (state that later writes change), and
#: step unless the caller gives it (it is otherwise the session's counter).
_IDENTITY_FIELDS = ("session_id", "kind", "summary", "source", "tokens_in", "tokens_out", "seconds", "usd")


def _node_difference(
    original: tuple[dict[str, Any], set[str]], row: dict[str, Any], parents: set[str], *, explicit_step: bool
) -> str | None:
    """What differs between a node's first write and a retry (None: nothing)."""
    old, old_parents = original
    for k in _IDENTITY_FIELDS:
        if old.get(k) != row[k]:
            return f"{k} ({old.get(k)!r}, not {row[k]!r})"
    if explicit_step and old.get("step") != row["step"]:
        return f"step ({old.get('step')!r}, not {row['step']!r})"
    a, b = old.get("embedding"), row["embedding"]
    if (a is None) != (b is None) or (
        a is not None and b is not None and array("f", a).tobytes() != array("f", b).tobytes()
    ):
        return "embedding"
    if old_parents != parents:
        return f"parents ({sorted(old_parents)}, not {sorted(parents)})"
    return None


def config_text(config: Mapping[str, Any] | str | None) -> str | None:
    """A session config as the JSON text stored: a mapping is serialized (keys sorted), a string
    must be JSON already. NaN, infinities and objects JSON has no form for are refused."""
    if config is None:
        return None
    if isinstance(config, str):
        check_text(config, "session config")

        def no_constant(c: str) -> None:
            raise ValueError(f"{c} is not JSON")

        try:
            json.loads(config, parse_constant=no_constant)
        except ValueError as e:
            raise ValidationError(f"session config text must be JSON ({e}); pass a dict to have it serialized") from None
        return config
    if not isinstance(config, Mapping):
        raise ValidationError(f"session config must be a mapping or JSON text, got {type(config).__name__}")
    try:
        text = json.dumps(config, sort_keys=True, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValidationError(
            f"session config must hold only JSON values (strings, finite numbers, booleans, null, lists and "
            f"mappings with string keys): {e}"
        ) from None
    return check_text(text, "session config")
