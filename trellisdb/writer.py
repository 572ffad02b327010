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
import math
import numbers
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from trellisdb.batch import Batch
from trellisdb.errors import (
    DuplicateIdError,
    UnknownNodeError,
    UnknownParentError,
    UnknownSessionError,
    ValidationError,
)
from trellisdb.ids import new_id
from trellisdb.names import (
    QUARANTINE_REASON,
    QUARANTINED,
    SESSION_PROVENANCE,
    check_name,
    check_not_reserved,
    check_text,
)
from trellisdb.rules import (
    ATTRIBUTE_SCOPES,
    COST_FIELDS,
    NOT_PREFERRED,
    REWARD_NOT_A_NUMBER,
    REWARD_NOT_FINITE,
    SAME_NODES,
    SELF_LOOP,
    UNKNOWN_COST_FIELD,
    attribute_value,
    check_edge_kind,
    check_embedding,
    check_number,
    config_text,
    event_time,
)

if TYPE_CHECKING:
    from trellisdb.committer import Committer


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


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

    def __init__(self, committer: Committer, session_id: str, task_id: str, step: int = 0,
                 provenance: str | None = None) -> None:
        self._c = committer
        self.id = session_id
        self.task_id = task_id
        #: who writes through this writer: the ``provenance`` of its nodes (None: the database's default)
        self.provenance = check_name(provenance, "provenance", optional=True)
        self._step = step
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
        write_session_status(self._c, self.id, status)
        if not self._c.in_transaction():
            self._c.flush()

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
        attrs: Mapping[str, Any] | None = None,
        labels: Sequence[str] = (),
        at: object = None,
        action: str | None = None,
        state: str | None = None,
        quarantine: str | bool | None = None,
    ) -> str:
        """Add a node (an attempt, step, tool call...) and its parent edges; return its id.

        ``attrs`` are its first attributes (see :meth:`set_attrs`), ``labels`` its first
        memberships (see :meth:`label`), ``at`` its event time (when it happened in the
        agent's world: an aware datetime, epoch seconds or ISO-8601 text; the commit keeps
        the write time), ``action`` and ``state`` a step record's action and the state it
        was taken from (queryable columns; embed them with a space whose ``text`` names them).
        ``quarantine`` (True, or the reason as text) holds the node in quarantine from its
        first commit (see :meth:`quarantine`): a write kept out of RETRIEVE, FRONTIER and the
        training views until released. The node's ``provenance`` is the writer's, never an argument.

        All or nothing: the node, its edges, artifacts, attributes and labels are staged
        together once every value has passed its checks."""
        c = self._c
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
        check_edge_kind(edge_kind)
        step_v = check_number("nodes", "step", step, "step")
        if step_v is None:
            step_v = self._step + 1
        if cost is not None and not isinstance(cost, Mapping):
            raise ValidationError(f"cost must be a mapping like {{'tokens_in': 10}}, got {type(cost).__name__}")
        cost = dict(cost or {})
        unknown = set(cost) - set(COST_FIELDS)
        if unknown:
            raise UNKNOWN_COST_FIELD.call(fields=sorted(unknown, key=str))
        vec = check_embedding(embedding, c.embedding_dim, f"embedding of node {node_id!r}")
        if artifacts is not None and not isinstance(artifacts, Mapping):
            raise ValidationError(f"artifacts must be a mapping of role -> content, got {type(artifacts).__name__}")
        arts = [artifact(aname, content) for aname, content in (artifacts or {}).items()]
        when = event_time(at)
        check_text(action, "action")
        check_text(state, "state")
        attr_rows = attribute_rows("node", node_id, attrs, when, self.id)
        label_rows = label_rows_for([node_id], labels, True, when, self.id)
        if quarantine is not None and quarantine is not False:  # held: quarantined from its first commit
            held_labels, held_attrs = quarantine_rows([node_id], True, quarantine_reason(quarantine), when, self.id)
            label_rows += held_labels
            attr_rows += held_attrs
        row = {
            "id": node_id,
            "session_id": self.id,
            "task_id": self.task_id,
            "kind": kind,
            "step": step_v,
            "status": status,
            "summary": summary,
            **{k: check_number("nodes", k, cost.get(k), f"cost {k}") for k in COST_FIELDS},
            "source": source,
            "embedding": vec,
            "created_at": _now(),
            "born": None,
            "ordinal": None,
            "event_time": when,
            "action": action,
            "state": state,
            "provenance": self.provenance if self.provenance is not None else c.provenance,
        }
        if id is not None:
            original = c.node_original(node_id, edge_kind)
            if original is not None:
                diff = _node_difference(original, row, set(parents), explicit_step=step is not None)
                if diff:
                    raise DuplicateIdError(
                        f"node id {node_id!r} already exists with a different {diff}; "
                        "use a new id, or omit id= to have one generated"
                    )
                if attr_rows or label_rows:  # the retry's attributes and labels hold after it, as asked
                    with c.sink(self.id) as b:
                        b.rows["attributes"].extend(attr_rows)
                        b.rows["labels"].extend(label_rows)
                return node_id  # idempotent retry of the same write
        missing = c.missing_nodes(list(parents))
        if missing:
            raise UnknownParentError(
                f"parent {missing[0]!r} of node {node_id!r} does not exist; add the parent first "
                f"(or flush it from the writer that made it)"
            )
        self._step = max(self._step, step_v)  # only a node actually written advances the counter
        with c.sink(self.id) as b:
            row["ordinal"] = b.next_ordinal
            b.next_ordinal += 1
            b.rows["nodes"].append(row)
            b.nodes[node_id] = row
            b.added.add(node_id)
            for p in parents:
                b.rows["edges"].append({"src": p, "dst": node_id, "kind": edge_kind, "session_id": self.id,
                                        "event_time": when})
            for a in arts:
                self._stage_artifact(b, node_id, a)
            b.rows["attributes"].extend(attr_rows)
            b.rows["labels"].extend(label_rows)
        return node_id

    def set_attrs(self, entity: str, attrs: Mapping[str, Any], *, scope: str = "node", at: object = None) -> None:
        """Set attributes of a node (or, with ``scope``, of a session or task): JSON values by
        key, commit-stamped like every fact (``AS OF`` sees the values of that moment). A key
        set again supersedes its value; ``None`` retracts it. Queryable in TQL as
        ``attr('key')`` and in SQL as the ``attributes`` table (``num`` for numbers, ``text``
        for strings, ``value`` as JSON)."""
        write_attrs(self._c, scope, entity, attrs, at, self.id)

    def label(self, node_ids: str | Sequence[str], *labels: str, at: object = None) -> None:
        """Give nodes memberships (``population``, ``island_2``, ``archive``...): several per node,
        kept until :meth:`unlabel` removes them; ``AS OF`` sees the memberships of that moment.
        TQL tests them with ``has_label('archive')``."""
        write_labels(self._c, node_ids, labels, True, at, self.id)

    def unlabel(self, node_ids: str | Sequence[str], *labels: str, at: object = None) -> None:
        """Remove memberships given by :meth:`label` (a label a node does not have is ignored)."""
        write_labels(self._c, node_ids, labels, False, at, self.id)

    def quarantine(self, node_ids: str | Sequence[str], reason: str | None = None, *, at: object = None) -> None:
        """Quarantine nodes (see :meth:`Database.quarantine`)."""
        write_quarantine(self._c, node_ids, True, reason, at, self.id)

    def release(self, node_ids: str | Sequence[str], *, at: object = None) -> None:
        """Release quarantined nodes (see :meth:`Database.release`)."""
        write_quarantine(self._c, node_ids, False, None, at, self.id)

    def add_edge(self, src: str, dst: str, kind: str = "derived_from", *, at: object = None) -> None:
        """Add a typed lineage edge ``src -> dst`` between existing nodes (``at``: its event time)."""
        check_name(src, "edge source")
        check_name(dst, "edge target")
        check_edge_kind(kind)
        when = event_time(at)
        if src == dst:
            raise SELF_LOOP.call(src=src, dst=dst)
        missing = self._c.missing_nodes([src, dst])
        if missing:
            raise UnknownNodeError(f"edge {src!r} -> {dst!r}: node {missing[0]!r} does not exist")
        with self._c.sink(self.id) as b:
            b.rows["edges"].append({"src": src, "dst": dst, "kind": kind, "session_id": self.id, "event_time": when})

    def add_artifact(self, node_id: str, name: str, content: str | bytes, media_type: str | None = None) -> str:
        """Attach a content-addressed payload to a node; return its sha256 hash."""
        check_name(node_id, "node id")
        a = artifact(name, content, media_type)
        if self._c.missing_nodes([node_id]):
            raise UnknownNodeError(f"artifact {name!r}: node {node_id!r} does not exist")
        with self._c.sink(self.id) as b:
            self._stage_artifact(b, node_id, a)
        return a.hash

    def _stage_artifact(self, b: Batch, node_id: str, a: Artifact) -> None:
        if a.hash not in b.hashes and not self._c.has_artifact(a.hash):
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
        at: object = None,
    ) -> None:
        """Record a reward; a later reward on the same (node, channel) supersedes it (``at``: its
        event time, e.g. when the evaluation finished)."""
        check_name(node_id, "node id")
        v = reward_value(node_id, channel, value)
        check_name(verifier, "verifier", optional=True)
        check_name(verifier_version, "verifier_version", optional=True)
        when = event_time(at)
        if self._c.missing_nodes([node_id]):
            raise UnknownNodeError(f"reward {channel!r}: node {node_id!r} does not exist")
        with self._c.sink(self.id) as b:
            b.rows["rewards"].append(
                {
                    "node_id": node_id,
                    "channel": channel,
                    "value": v,
                    "verifier": verifier,
                    "verifier_version": verifier_version,
                    "created_at": _now(),
                    "event_time": when,
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
        at: object = None,
    ) -> str:
        """Record a pairwise judgment; ``preferred`` is ``a``, ``b`` or None for a tie.

        An ``id`` that exists already is an error unless the judgment is the same (a retry)."""
        check_name(a, "comparison node a")
        check_name(b, "comparison node b")
        if a == b:
            raise SAME_NODES.call(a=a)
        if preferred is not None and preferred not in (a, b):
            raise NOT_PREFERRED.call(preferred=preferred, a=a, b=b)
        comparison_id = check_name(id, "comparison id", optional=True) or new_id()
        row = {
            "id": comparison_id,
            "a": a,
            "b": b,
            "preferred": preferred,
            "margin": check_number("comparisons", "margin", margin, "margin"),
            "judge": check_name(judge, "judge", optional=True),
            "event_time": event_time(at),
        }
        missing = self._c.missing_nodes([a, b])
        if missing:
            raise UnknownNodeError(f"comparison: node {missing[0]!r} does not exist")
        if id is not None:
            old = self._c.comparison_row(comparison_id)
            if old is not None:
                if any(old.get(k) != v for k, v in row.items() if k != "event_time"):
                    raise DuplicateIdError(
                        f"comparison id {id!r} already exists with another judgment ({old['a']!r} vs {old['b']!r}, "
                        f"preferred {old['preferred']!r}); use a new id, or omit id="
                    )
                return comparison_id  # the same judgment again: a retry
        with self._c.sink(self.id) as batch:
            batch.rows["comparisons"].append(row)
        return comparison_id

    def sessions_of(self, node_ids: Sequence[str]) -> dict[str, str]:
        """The session of each of ``node_ids`` that exists, pending in this process or committed
        (what a server checks before an agent changes a node: ``service.py``)."""
        return self._c.node_sessions(node_ids)

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
        set_status(self._c, list(ids), status, self.id)


#: Node fields a retried ``add_node`` with the same id must repeat exactly.
#: Not compared: status and created_at (state that later writes change), and
#: step unless the caller gives it (it is otherwise the session's counter).
_IDENTITY_FIELDS = ("session_id", "kind", "summary", "source", "tokens_in", "tokens_out", "seconds", "usd",
                    "event_time", "action", "state")


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


def reward_value(node_id: str, channel: object, value: object) -> float:
    """A reward's channel and value checked (a name; a finite number, not a boolean): the value
    as stored. Whole-step calls check their rewards with it before they stage the node."""
    check_name(channel, "reward channel")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise REWARD_NOT_A_NUMBER.call(channel=channel, node_id=node_id, type=type(value).__name__, value=value)
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v):
        raise REWARD_NOT_FINITE.call(channel=channel, node_id=node_id, value=v)
    return v


# ------------------------------------------------------- sessions and tasks
def open_session(
    c: Committer,
    *,
    task: str,
    agent: str | None = None,
    model: str | None = None,
    config: Mapping[str, Any] | str | None = None,
    id: str | None = None,
    task_spec: str | None = None,
    at: object = None,
    attrs: Mapping[str, Any] | None = None,
    provenance: str | None = None,
) -> SessionWriter:
    """Start (or reopen, with the same identity) a session; see :meth:`Database.session`."""
    c.store.writable("session")
    check_name(task, "task id")
    sid = check_name(id, "session id", optional=True) or new_id()
    when = event_time(at)
    row = {
        "id": sid,
        "task_id": task,
        "agent": check_name(agent, "agent", optional=True),
        "model": check_name(model, "model", optional=True),
        "config": config_text(config),
        "status": "running",
        "created_at": _now(),
        "event_time": when,
    }
    check_text(task_spec, "task spec")
    check_name(provenance, "provenance", optional=True)
    attr_rows = attribute_rows("session", sid, attrs, when, sid)
    old = c.session_row(sid) if id is not None else None
    if old is not None:
        given = {k: v for k, v in row.items() if k in ("task_id", "agent", "model", "config") and
                 (v is not None or k == "task_id")}
        diff = [k for k, v in given.items() if old.get(k) != v]
        if diff:
            raise DuplicateIdError(
                f"session {sid!r} exists with {', '.join(f'{k} {old.get(k)!r}' for k in diff)}, not "
                f"{', '.join(repr(given[k]) for k in diff)}; continue it with db.resume({sid!r}) or choose "
                "another id"
            )
        row = {**old, "status": "running", "created_at": row["created_at"],
               "event_time": row["event_time"] or old.get("event_time")}
    with c.sink(sid) as b:
        if task not in b.tasks and not c.exists("tasks", "id", task):
            _add_task_row(c, b, task, None, task_spec, None, None)
        b.rows["sessions"].append(row)
        b.sessions[sid] = row
        b.session_id = sid
        b.rows["attributes"].extend(attr_rows)
        if old is None and provenance is not None:  # who opened it (``SESSION_PROVENANCE``)
            b.rows["attributes"].append({"scope": "session", "entity": sid, "key": SESSION_PROVENANCE,
                                         **attribute_value(SESSION_PROVENANCE, provenance), "session_id": sid,
                                         "event_time": when})
    return SessionWriter(c, sid, task, c.max_step(sid) if old is not None else 0, provenance)


def resume_session(c: Committer, session_id: str, provenance: str | None = None) -> SessionWriter:
    """A writer for an existing session, its step counter where it stopped (``provenance``: who
    writes through it; None: the database's default)."""
    c.store.writable("resume")
    check_name(provenance, "provenance", optional=True)
    row = c.session_row(check_name(session_id, "session id") or "")
    if row is None:
        raise UnknownSessionError(f"session {session_id!r} does not exist")
    return SessionWriter(c, session_id, row["task_id"], c.max_step(session_id), provenance)


def add_task(
    c: Committer,
    id: str,
    *,
    name: str | None = None,
    spec: str | None = None,
    tags: Sequence[str] | None = None,
    embedding: Sequence[float] | None = None,
) -> str:
    """Declare a task; see :meth:`Database.add_task`."""
    c.store.writable("add_task")
    check_name(id, "task id")
    with c.sink() as b:
        _add_task_row(c, b, id, name, spec, tags, embedding, old=c.task_row(id, b))
    return id


def _add_task_row(
    c: Committer,
    b: Batch,
    id: str,
    name: str | None,
    spec: str | None,
    tags: Sequence[str] | None,
    embedding: Sequence[float] | None,
    old: dict[str, Any] | None = None,
) -> None:
    if isinstance(tags, str) or (tags is not None and not isinstance(tags, Sequence | set | frozenset)):
        raise ValidationError(f"tags of task {id!r} must be a list of strings, got {tags!r}")
    for t in tags or ():
        check_name(t, f"tag of task {id!r}")
    row = {
        "id": id,
        "name": id if name is None else check_text(name, "task name", optional=False),
        "spec": check_text(spec, "task spec"),
        "tags": list(tags) if tags else None,
        "embedding": check_embedding(embedding, c.embedding_dim, f"embedding of task {id!r}"),
        "created_at": _now(),
    }
    if old is not None:
        given = {"name": name, "spec": spec, "tags": tags, "embedding": embedding}
        diff = [k for k, v in given.items() if v is not None and old.get(k) != row[k]]
        if diff:
            raise DuplicateIdError(
                f"task {id!r} exists with another {', '.join(diff)}; a task is declared once (choose another id)"
            )
        return  # declared again, the same: nothing to write
    b.rows["tasks"].append(row)
    b.tasks.add(id)


def write_session_status(c: Committer, session_id: str, status: str) -> None:
    """A new row of the session with ``status``."""
    with c.sink(session_id) as b:
        row = b.sessions.get(session_id)
        if row is None:
            row = c.session_row(session_id)
            if row is None:
                raise UnknownSessionError(f"session {session_id!r} does not exist")
            b.rows["sessions"].append(row)
            b.sessions[session_id] = row
        row["status"] = status


def set_status(c: Committer, node_ids: str | Sequence[str], status: str, session_id: str | None = None) -> None:
    """New rows for the nodes with ``status``; committed rows are looked up in one query."""
    ids = [node_ids] if isinstance(node_ids, str) else list(dict.fromkeys(node_ids))
    with c.sink() as b:
        b.session_id = session_id or b.session_id
        owners: dict[str, Batch] = {}
        found = c.node_rows([i for i in ids if i not in b.nodes], owners)
        missing = [i for i in ids if i not in b.nodes and i not in found]
        if missing:  # before any row changes: all or nothing
            raise UnknownNodeError(
                f"set_status: node(s) {missing[:5]!r} do not exist" + (f" ({len(missing)} in all)" if len(missing) > 5 else "")
            )
        now = _now()
        for node_id in ids:
            row = b.nodes.get(node_id)
            if row is None:
                row = dict(found[node_id])
                row["created_at"] = now
                b.rows["nodes"].append(row)
                b.nodes[node_id] = row
                if row.get("born") is None and node_id in owners:  # first written by another pending batch:
                    b.born_in[node_id] = owners[node_id]           # born when that batch commits
            row["status"] = status


# ------------------------------------------------------- attributes and labels
#: The most attributes one call sets, and labels one call gives (bigger sets: several calls).
MAX_ATTRS_PER_CALL = 1024


def attribute_rows(scope: str, entity: str, attrs: Mapping[str, Any] | None, at: dt.datetime | None,
                   session_id: str | None) -> list[dict[str, Any]]:
    """The checked ``attributes`` rows of ``attrs`` (nothing staged)."""
    if attrs is None:
        return []
    if not isinstance(attrs, Mapping):
        raise ValidationError(f"attributes must be a mapping of key -> JSON value, got {type(attrs).__name__}")
    if len(attrs) > MAX_ATTRS_PER_CALL:
        raise ValidationError(f"{len(attrs)} attributes in one call; at most {MAX_ATTRS_PER_CALL} (split the call)")
    rows = []
    for key, value in attrs.items():
        check_name(key, "attribute key")
        check_not_reserved(key, "attribute key")
        rows.append({"scope": scope, "entity": entity, "key": key, **attribute_value(key, value),
                     "session_id": session_id, "event_time": at})
    return rows


def label_rows_for(node_ids: Sequence[str], labels: Sequence[str], present: bool, at: dt.datetime | None,
                   session_id: str | None) -> list[dict[str, Any]]:
    """The checked ``labels`` rows giving (``present``) or removing ``labels`` of ``node_ids``."""
    if isinstance(labels, str):
        labels = [labels]
    if not isinstance(labels, Sequence | set | frozenset):
        raise ValidationError(f"labels must be a list of names, got {type(labels).__name__}")
    if len(labels) > MAX_ATTRS_PER_CALL:
        raise ValidationError(f"{len(labels)} labels in one call; at most {MAX_ATTRS_PER_CALL} (split the call)")
    for lab in labels:
        check_name(lab, "label")
        check_not_reserved(lab, "label")
    return [{"node_id": n, "label": lab, "present": present, "session_id": session_id, "event_time": at}
            for n in node_ids for lab in dict.fromkeys(labels)]


def write_attrs(c: Committer, scope: str, entity: str, attrs: Mapping[str, Any], at: object,
                session_id: str | None) -> None:
    """Stage attributes of an existing node, session or task (see ``SessionWriter.set_attrs``)."""
    c.store.writable("set_attrs")
    if scope not in ATTRIBUTE_SCOPES:
        raise ValidationError(f"scope must be one of {', '.join(ATTRIBUTE_SCOPES)}, got {scope!r}")
    check_name(entity, f"{scope} id")
    rows = attribute_rows(scope, entity, attrs, event_time(at), session_id)
    if scope == "node":
        missing = bool(c.missing_nodes([entity]))
    elif scope == "session":
        missing = c.session_row(entity) is None
    else:
        missing = not c.pending_task(entity) and not c.exists("tasks", "id", entity)
    if missing:
        err = UnknownNodeError if scope == "node" else UnknownSessionError if scope == "session" else ValidationError
        raise err(f"attributes of {scope} {entity!r}: it does not exist; add it first")
    if rows:
        with c.sink(session_id) as b:
            b.rows["attributes"].extend(rows)


def write_labels(c: Committer, node_ids: str | Sequence[str], labels: Sequence[str], present: bool, at: object,
                 session_id: str | None) -> None:
    """Stage labels given to or removed from existing nodes (see ``SessionWriter.label``)."""
    c.store.writable("label" if present else "unlabel")
    ids = [node_ids] if isinstance(node_ids, str) else node_ids
    if not isinstance(ids, Sequence | set | frozenset):
        raise ValidationError(f"label takes a node id or a list of them, got {type(node_ids).__name__}")
    ids = list(dict.fromkeys(ids))
    for i in ids:
        check_name(i, "node id")
    rows = label_rows_for(ids, labels, present, event_time(at), session_id)
    missing = c.missing_nodes(ids)
    if missing:
        raise UnknownNodeError(f"labels: node {missing[0]!r} does not exist ({len(missing)} of {len(ids)} unknown)")
    if rows:
        with c.sink(session_id) as b:
            b.rows["labels"].extend(rows)


# ------------------------------------------------------- trust: quarantine
def quarantine_reason(value: object) -> str | None:
    """The reason a quarantine gives: text, or None for ``True`` / ``None`` (no reason)."""
    if value is None or value is True:
        return None
    if not isinstance(value, str):
        raise ValidationError(f"quarantine takes True or the reason as text, not {type(value).__name__} {value!r}")
    return check_text(value, "quarantine reason")


def quarantine_rows(node_ids: Sequence[str], quarantined: bool, reason: str | None, at: dt.datetime | None,
                    session_id: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The ``labels`` and ``attributes`` rows quarantining (or releasing) ``node_ids``: the
    reserved label ``trellis:quarantined`` given or removed, and the reason attribute set (a
    quarantine with a reason) or retracted (a release)."""
    labels = [{"node_id": n, "label": QUARANTINED, "present": quarantined, "session_id": session_id,
               "event_time": at} for n in node_ids]
    attrs: list[dict[str, Any]] = []
    if not quarantined or reason is not None:
        value = attribute_value(QUARANTINE_REASON, reason)
        attrs = [{"scope": "node", "entity": n, "key": QUARANTINE_REASON, **value, "session_id": session_id,
                  "event_time": at} for n in node_ids]
    return labels, attrs


def write_quarantine(c: Committer, node_ids: str | Sequence[str], quarantined: bool, reason: object, at: object,
                     session_id: str | None) -> None:
    """Stage the quarantine (or release) of existing nodes: commit-stamped label and reason rows."""
    c.store.writable("quarantine" if quarantined else "release")
    ids = [node_ids] if isinstance(node_ids, str) else node_ids
    if not isinstance(ids, Sequence | set | frozenset):
        raise ValidationError(f"{'quarantine' if quarantined else 'release'} takes a node id or a list of them, "
                              f"got {type(node_ids).__name__}")
    ids = list(dict.fromkeys(ids))
    for i in ids:
        check_name(i, "node id")
    why = quarantine_reason(reason) if quarantined else None
    labels, attrs = quarantine_rows(ids, quarantined, why, event_time(at), session_id)
    missing = c.missing_nodes(ids)
    if missing:
        raise UnknownNodeError(f"{'quarantine' if quarantined else 'release'}: node {missing[0]!r} does not exist "
                               f"({len(missing)} of {len(ids)} unknown)")
    if labels:
        with c.sink(session_id) as b:
            b.rows["labels"].extend(labels)
            b.rows["attributes"].extend(attrs)
