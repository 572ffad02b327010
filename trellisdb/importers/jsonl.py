"""Generic JSONL runs (schema ``trellis-jsonl/1``): one record a line, a commit per unit.

Any agent can write its run as JSON Lines and import it with ``trellis import jsonl PATH``.
Each line is one JSON object whose ``type`` says what it records, its fields mirroring the
write API: ``session`` (``db.session``), ``node`` (``add_node``: parents, kind, step, status,
summary, cost, action, state, attrs, labels, artifacts and rewards inline), ``edge``,
``reward``, ``artifact``, ``attr`` (``set_attrs``), ``label`` / ``unlabel``,
``comparison``, and ``commit``, which ends a unit (with its message, ``meta`` and ``tag``).
The lines after the last commit record are a unit of their own. The first line may be a
``header`` naming the schema version; another version is refused. The JSON Schema of a line
is ``jsonl-v1.schema.json`` beside this module (:func:`schema`); the records are checked here,
in code, with the write API's own rules, and a bad line stops the import with an
``ImportFormatError`` "file:line: what is wrong; what to write instead" before its unit is
written. See ``docs/import-jsonl.md``.

The path is one file or a folder searched recursively for ``*.jsonl`` (sorted). A unit is
named ``<file>:<first line>-<last line>`` (the file relative to the folder), so an import is
idempotent: importing again skips the units already in the store.

>>> [r["type"] for r in map(json.loads, EXAMPLE.splitlines())][:3]
['header', 'session', 'node']
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from trellisdb.errors import ImportFormatError, ValidationError
from trellisdb.importers.units import Unit, inside, listed_file, outside_error, unreadable
from trellisdb.names import check_name, check_text, did_you_mean
from trellisdb.rules import (
    ATTRIBUTE_SCOPES,
    COST_FIELDS,
    EDGE_KINDS,
    INT64_MAX,
    check_edge_kind,
    commit_meta,
    config_text,
    event_time,
)
from trellisdb.writer import attribute_rows, label_rows_for

__all__ = ["FORMAT", "SCHEMA_FILE", "SCHEMA_VERSION", "schema", "source_name", "units"]

FORMAT = "jsonl"
#: The version a header names; the only one this reader reads.
SCHEMA_VERSION = "trellis-jsonl/1"
#: The JSON Schema (draft 2020-12) of one line, packaged beside this module.
SCHEMA_FILE = "jsonl-v1.schema.json"
#: The options ``units`` takes (``import_run(db, "jsonl", path, **options)``).
OPTIONS = ("tag_prefix",)

#: A small run in the format (the docs show it; the tests import it).
EXAMPLE = """\
{"type": "header", "schema": "trellis-jsonl/1"}
{"type": "session", "id": "run-1", "task": "sort", "agent": "my-agent", "model": "gpt-4o", "config": {"temperature": 0.2}}
{"type": "node", "id": "n1", "kind": "step", "summary": "read the input", "action": "cat input.txt", "state": {"cwd": "/work"}, "artifacts": {"prompt": "Sort the numbers.", "response": "cat input.txt"}, "cost": {"tokens_in": 120, "tokens_out": 8, "seconds": 0.4}, "at": "2026-01-05T10:00:00Z"}
{"type": "node", "id": "n2", "parents": ["n1"], "kind": "step", "action": "sort -n input.txt", "rewards": {"score": 1.0}, "labels": ["final"], "attrs": {"exit_code": 0}, "at": 1767607260}
{"type": "commit", "message": "first two steps", "tag": "run-1-steps", "meta": {"iteration": 2}}
"""


def schema() -> dict[str, Any]:
    """The JSON Schema of one line (``jsonl-v1.schema.json``)."""
    text = resources.files("trellisdb.importers").joinpath(SCHEMA_FILE).read_text(encoding="utf-8")
    value: dict[str, Any] = json.loads(text)
    return value


class _Bad(Exception):
    """What is wrong with the line being read (the reader adds the file and line)."""


# ------------------------------------------------------------------ field checks
# Each takes the field's name and value and returns the value as stored, or raises _Bad.


def _name(what: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _Bad(f"{what} is {_show(v)}; write a string (a name)")
    try:
        check_name(v, what)
    except ValidationError as e:
        raise _Bad(str(e)) from None
    return v


def _text(what: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _Bad(f"{what} is {_show(v)}; write a string")
    try:
        check_text(v, what)
    except ValidationError as e:
        raise _Bad(str(e)) from None
    return v


def _names(what: str, v: Any) -> list[str]:
    if not isinstance(v, list):
        raise _Bad(f"{what} is {_show(v)}; write a list of names, e.g. [\"a\", \"b\"]")
    return [_name(f"{what}[{i}]", x) for i, x in enumerate(v)]


def _one_or_more(what: str, v: Any) -> list[str]:
    return [_name(what, v)] if isinstance(v, str) else _names(what, v)


def _count(what: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= INT64_MAX:
        raise _Bad(f"{what} is {_show(v)}; write a whole number >= 0, e.g. 3")
    return v


def _number(what: str, v: Any, *, negative: bool = True) -> float:
    try:
        x = float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else math.nan
    except OverflowError:  # an integer beyond a double's range (JSON allows any number of digits)
        x = math.nan
    if not math.isfinite(x) or (not negative and x < 0):
        raise _Bad(f"{what} is {_show(v)}; write a finite number{'' if negative else ' >= 0'}, e.g. 0.5")
    return x


def _object(what: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _Bad(f"{what} is {_show(v)}; write a JSON object, e.g. {{\"key\": 1}}")
    return v


def _time(what: str, v: Any) -> Any:
    if isinstance(v, bool) or not isinstance(v, str | int | float):
        raise _Bad(f"{what} is {_show(v)}; write ISO-8601 text with an offset ('2026-01-05T10:00:00Z') "
                   "or epoch seconds")
    try:
        return event_time(v, what)
    except ValidationError as e:
        raise _Bad(f"{e}; or write epoch seconds") from None
    except OverflowError:  # epoch seconds beyond a double's range
        raise _Bad(f"{what} is {_show(v)}, outside the years 1-9999; write epoch seconds or ISO-8601 text") from None


def _json_text(what: str, v: Any) -> str:
    """A state: text as it is, any other JSON value as its JSON text."""
    return _text(what, v if isinstance(v, str) else json.dumps(v, ensure_ascii=False))


def _show(v: Any) -> str:
    kind = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number",
            float: "a number", type(None): "null"}.get(type(v), type(v).__name__)
    text = json.dumps(v, ensure_ascii=False) if v is not None else "null"
    text = text.encode("utf-8", "backslashreplace").decode()  # a lone surrogate, shown escaped
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({kind})" if v is not None else "null"


# ------------------------------------------------------------------ record types

#: type -> field -> required?  (the checks are in the readers below)
FIELDS: dict[str, dict[str, bool]] = {
    "header": {"schema": True},
    "session": {"id": True, "task": True, "agent": False, "model": False, "config": False, "status": False,
                "task_spec": False, "at": False, "attrs": False},
    "node": {"id": True, "session": False, "parents": False, "edge_kind": False, "kind": False, "step": False,
             "status": False, "summary": False, "cost": False, "source": False, "action": False, "state": False,
             "embedding": False, "attrs": False, "labels": False, "at": False, "artifacts": False, "rewards": False},
    "edge": {"src": True, "dst": True, "kind": False, "session": False, "at": False},
    "reward": {"node": True, "channel": True, "value": True, "verifier": False, "verifier_version": False,
               "at": False},
    "artifact": {"node": True, "name": True, "text": False, "base64": False, "media_type": False},
    "attr": {"entity": True, "attrs": True, "scope": False, "session": False, "at": False},
    "label": {"nodes": True, "labels": True, "session": False, "at": False},
    "unlabel": {"nodes": True, "labels": True, "session": False, "at": False},
    "comparison": {"a": True, "b": True, "preferred": False, "margin": False, "judge": False, "id": False,
                   "at": False},
    "commit": {"message": False, "meta": False, "tag": False},
}
TYPES = tuple(t for t in FIELDS if t != "header")


@dataclass
class _Run:
    """What the lines read so far established (across the units of one file)."""

    file: str
    tag_prefix: str
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> task id
    last_session: str | None = None
    steps: dict[str, int] = field(default_factory=dict)  # session id -> last step given
    nodes: dict[str, int] = field(default_factory=dict)  # node id -> its line


class _Rows:
    """The rows of one unit, by table (artifacts stored once)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self.hashes: set[str] = set()
        self.records = 0

    def add(self, table: str, row: dict[str, Any]) -> None:
        self.rows.setdefault(table, []).append(row)

    def extend(self, table: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            self.rows.setdefault(table, []).extend(rows)

    def artifact(self, node: str, name: str, data: bytes, media_type: str | None) -> None:
        h = hashlib.sha256(data).hexdigest()
        if h not in self.hashes:
            self.hashes.add(h)
            self.add("artifacts", {"hash": h, "media_type": media_type, "size": len(data), "content": data})
        self.add("node_artifacts", {"node_id": node, "name": name, "hash": h})


def _payload(what: str, v: Any) -> tuple[bytes, str | None]:
    """An artifact's bytes and media type: text, or {"text" | "base64": ..., "media_type": ...}."""
    if isinstance(v, str):
        return _text(what, v).encode(), "text/plain"
    if not isinstance(v, dict):
        raise _Bad(f"{what} is {_show(v)}; write its text, or {{\"base64\": \"...\", \"media_type\": \"...\"}} "
                   "for bytes")
    extra = set(v) - {"text", "base64", "media_type"}
    if extra:
        raise _Bad(f"{what} has field {sorted(extra)[0]!r}; an artifact object has 'text' or 'base64', and "
                   "'media_type'")
    return _content(what, v)


def _content(what: str, v: Mapping[str, Any]) -> tuple[bytes, str | None]:
    media = None if v.get("media_type") is None else _name(f"{what}.media_type", v["media_type"])
    if (v.get("text") is None) == (v.get("base64") is None):  # null is absent
        raise _Bad(f"{what} needs exactly one of 'text' (the content as text) and 'base64' (bytes, base64-encoded)")
    if v.get("text") is not None:
        return _text(f"{what}.text", v["text"]).encode(), media or "text/plain"
    raw = v["base64"]
    if not isinstance(raw, str):
        raise _Bad(f"{what}.base64 is {_show(raw)}; write the bytes base64-encoded, as a string")
    try:
        return base64.b64decode(raw, validate=True), media
    except (binascii.Error, ValueError):
        raise _Bad(f"{what}.base64 is not valid base64; write the bytes as standard base64 (A-Z a-z 0-9 + / =)"
                   ) from None


def _session_of(run: _Run, rec: Mapping[str, Any], what: str) -> str:
    sid = _name(f"{what}.session", rec["session"]) if rec.get("session") is not None else run.last_session
    if sid is None:
        raise _Bad(f"a {what} record needs its session: no session record comes before it; add "
                   "{\"type\": \"session\", \"id\": ..., \"task\": ...} above it, or give \"session\"")
    if sid not in run.sessions:
        raise _Bad(f"{what}.session {sid!r} has no session record above it in this file; declare it first with "
                   f"{{\"type\": \"session\", \"id\": {json.dumps(sid)}, \"task\": ...}}")
    return sid


def _session(run: _Run, rec: Mapping[str, Any], out: _Rows) -> None:
    sid = _name("session.id", rec["id"])
    task = _name("session.task", rec["task"])
    if run.sessions.get(sid, task) != task:
        raise _Bad(f"session {sid!r} was declared with task {run.sessions[sid]!r} above; a session has one task")
    config = rec.get("config")
    try:
        cfg = config_text(config) if config is None or isinstance(config, str) else config_text(_object("config", config))
    except ValidationError as e:
        raise _Bad(f"session.config: {e}") from None
    at = _time("session.at", rec["at"]) if rec.get("at") is not None else None
    spec = _text("session.task_spec", rec["task_spec"]) if rec.get("task_spec") is not None else None
    out.add("tasks", {"id": task, "name": task, "spec": spec})
    out.add("sessions", {"id": sid, "task_id": task, "event_time": at, "config": cfg,
                         **{k: _name(f"session.{k}", rec[k]) if rec.get(k) is not None else None
                            for k in ("agent", "model", "status")}})
    out.extend("attributes", _attrs(rec.get("attrs"), "session", sid, at, sid, "session.attrs"))
    run.sessions[sid] = task
    run.last_session = sid


def _attrs(v: Any, scope: str, entity: str, at: Any, sid: str | None, what: str) -> list[dict[str, Any]]:
    if v is None:
        return []
    try:
        return attribute_rows(scope, entity, _object(what, v), at, sid)
    except ValidationError as e:
        raise _Bad(f"{what}: {e}") from None
    except OverflowError:  # an integer beyond a double's range
        big = next((k for k, x in v.items() if isinstance(x, int) and not isinstance(x, bool)
                    and abs(x) > 2**1023), "?")
        raise _Bad(f"{what}.{big} is a number beyond the range of a double; write it as a string") from None


def _labels(nodes: list[str], v: Any, present: bool, at: Any, sid: str | None, what: str) -> list[dict[str, Any]]:
    if v is None:
        return []
    try:
        return label_rows_for(nodes, _names(what, v), present, at, sid)
    except ValidationError as e:
        raise _Bad(f"{what}: {e}") from None


def _node(run: _Run, rec: Mapping[str, Any], out: _Rows, line: int) -> None:
    nid = _name("node.id", rec["id"])
    if nid in run.nodes:
        raise _Bad(f"node {nid!r} is written at line {run.nodes[nid]} already; a node is written once (change "
                   "it with attr or label records, or give this one another id)")
    sid = _session_of(run, rec, "node")
    parents = _names("node.parents", _given(rec, "parents", []))
    kind_edge = _given(rec, "edge_kind", "derived_from")
    try:
        check_edge_kind(kind_edge)
    except ValidationError as e:
        raise _Bad(f"node.edge_kind: {e}") from None
    at = _time("node.at", rec["at"]) if rec.get("at") is not None else None
    if rec.get("step") is not None:
        step = _count("node.step", rec["step"])
    else:
        step = run.steps.get(sid, 0) + 1
        if step > INT64_MAX:
            raise _Bad(f"node.step is not given and the session's last step is {INT64_MAX}, the largest there "
                       "is; give this node its step")
    cost = _object("node.cost", rec.get("cost") or {})
    for k, v in cost.items():
        if k not in COST_FIELDS:
            raise _Bad(f"node.cost has {k!r}{did_you_mean(k, COST_FIELDS)}; its fields are {', '.join(COST_FIELDS)}")
        if v is None:  # null is absent
            continue
        if k.startswith("tokens"):
            _count(f"node.cost.{k}", v)
        else:
            _number(f"node.cost.{k}", v, negative=False)
    emb = rec.get("embedding")
    if emb is not None:
        if not isinstance(emb, list):
            raise _Bad(f"node.embedding is {_show(emb)}; write a list of numbers")
        emb = [_number(f"node.embedding[{i}]", x) for i, x in enumerate(emb)]
    row = {"id": nid, "session_id": sid, "task_id": run.sessions[sid],
           "kind": _name("node.kind", _given(rec, "kind", "attempt")), "step": step,
           "status": _name("node.status", _given(rec, "status", "pending")),
           "summary": _text("node.summary", rec["summary"]) if rec.get("summary") is not None else None,
           "source": _text("node.source", rec["source"]) if rec.get("source") is not None else None,
           "action": _text("node.action", rec["action"]) if rec.get("action") is not None else None,
           "state": _json_text("node.state", rec["state"]) if rec.get("state") is not None else None,
           "embedding": emb, "event_time": at, **{k: cost.get(k) for k in COST_FIELDS}}
    arts = _object("node.artifacts", rec.get("artifacts") or {})
    payloads = [(_name("node.artifacts name", k), *_payload(f"node.artifacts.{k}", v)) for k, v in arts.items()]
    rewards = [(_name("node.rewards channel", k), _number(f"node.rewards.{k}", v))
               for k, v in _object("node.rewards", rec.get("rewards") or {}).items()]
    attrs = _attrs(rec.get("attrs"), "node", nid, at, sid, "node.attrs")
    labels = _labels([nid], rec.get("labels"), True, at, sid, "node.labels")
    if nid in parents:
        raise _Bad(f"node {nid!r} names itself as a parent")
    # every value checked: the rows
    out.add("nodes", row)
    for p in parents:
        out.add("edges", {"src": p, "dst": nid, "kind": kind_edge, "session_id": sid, "event_time": at})
    for name, data, media in payloads:
        out.artifact(nid, name, data, media)
    for channel, value in rewards:
        out.add("rewards", {"node_id": nid, "channel": channel, "value": value, "event_time": at})
    out.extend("attributes", attrs)
    out.extend("labels", labels)
    run.nodes[nid] = line
    run.steps[sid] = max(run.steps.get(sid, 0), step)


def _given(rec: Mapping[str, Any], key: str, default: Any) -> Any:
    """An optional field's value; its default when it is absent or null."""
    v = rec.get(key)
    return default if v is None else v


def _optional_session(run: _Run, rec: Mapping[str, Any], what: str) -> str | None:
    return None if rec.get("session") is None else _session_of(run, rec, what)


def _edge(run: _Run, rec: Mapping[str, Any], out: _Rows) -> None:
    src, dst = _name("edge.src", rec["src"]), _name("edge.dst", rec["dst"])
    if src == dst:
        raise _Bad(f"edge {src!r} -> {dst!r} is a self-loop; an edge joins two nodes")
    kind = _given(rec, "kind", "derived_from")
    if kind not in EDGE_KINDS:
        raise _Bad(f"edge.kind {kind!r} is not an edge kind{did_you_mean(str(kind), EDGE_KINDS)}; kinds are "
                   f"{', '.join(EDGE_KINDS)}")
    at = _time("edge.at", rec["at"]) if rec.get("at") is not None else None
    out.add("edges", {"src": src, "dst": dst, "kind": kind, "session_id": _optional_session(run, rec, "edge"),
                      "event_time": at})


def _reward(run: _Run, rec: Mapping[str, Any], out: _Rows) -> None:
    at = _time("reward.at", rec["at"]) if rec.get("at") is not None else None
    out.add("rewards", {"node_id": _name("reward.node", rec["node"]), "channel": _name("reward.channel", rec["channel"]),
                        "value": _number("reward.value", rec["value"]),
                        **{k: _name(f"reward.{k}", rec[k]) if rec.get(k) is not None else None
                           for k in ("verifier", "verifier_version")}, "event_time": at})


def _artifact(run: _Run, rec: Mapping[str, Any], out: _Rows) -> None:
    node, name = _name("artifact.node", rec["node"]), _name("artifact.name", rec["name"])
    data, media = _content("artifact", rec)
    out.artifact(node, name, data, media)


def _attr(run: _Run, rec: Mapping[str, Any], out: _Rows) -> None:
    scope = _given(rec, "scope", "node")
    if scope not in ATTRIBUTE_SCOPES:
        raise _Bad(f"attr.scope is {_show(scope)}; write one of {', '.join(ATTRIBUTE_SCOPES)}")
    entity = _name("attr.entity", rec["entity"])
    at = _time("attr.at", rec["at"]) if rec.get("at") is not None else None
    sid = _optional_session(run, rec, "attr")
    out.extend("attributes", _attrs(rec["attrs"], scope, entity, at, sid, "attr.attrs"))


def _label(present: bool) -> Callable[[_Run, Mapping[str, Any], _Rows], None]:
    what = "label" if present else "unlabel"

    def read(run: _Run, rec: Mapping[str, Any], out: _Rows) -> None:
        nodes = _one_or_more(f"{what}.nodes", rec["nodes"])
        at = _time(f"{what}.at", rec["at"]) if rec.get("at") is not None else None
        sid = _optional_session(run, rec, what)
        out.extend("labels", _labels(nodes, rec["labels"], present, at, sid, f"{what}.labels"))
    return read


def _comparison(run: _Run, rec: Mapping[str, Any], out: _Rows) -> None:
    a, b = _name("comparison.a", rec["a"]), _name("comparison.b", rec["b"])
    if a == b:
        raise _Bad(f"comparison of {a!r} with itself; a comparison judges two nodes")
    pref = rec.get("preferred")
    if pref is not None and pref not in (a, b):
        raise _Bad(f"comparison.preferred is {_show(pref)}; write a's id ({a!r}), b's id ({b!r}), or null for a tie")
    cid = _name("comparison.id", rec["id"]) if rec.get("id") is not None else \
        "cmp-" + hashlib.sha256(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:20]
    out.add("comparisons", {
        "id": cid, "a": a, "b": b, "preferred": pref,
        "margin": _number("comparison.margin", rec["margin"]) if rec.get("margin") is not None else None,
        "judge": _name("comparison.judge", rec["judge"]) if rec.get("judge") is not None else None,
        "event_time": _time("comparison.at", rec["at"]) if rec.get("at") is not None else None,
    })


_READERS: dict[str, Callable[[_Run, Mapping[str, Any], _Rows], None]] = {
    "session": _session, "edge": _edge, "reward": _reward, "artifact": _artifact, "attr": _attr,
    "label": _label(True), "unlabel": _label(False), "comparison": _comparison,
}


# ------------------------------------------------------------------ lines -> units


def _record(text: str) -> dict[str, Any]:
    """One line as a checked record (its fields known, the required ones there)."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        raise _Bad(f"not valid JSON ({e.msg} at column {e.colno}); each line is one JSON object like "
                   "{\"type\": \"node\", \"id\": \"n1\"}") from None
    except (ValueError, RecursionError) as e:  # a number of thousands of digits; nesting too deep
        raise _Bad(f"JSON this reader cannot take ({'nested too deep' if isinstance(e, RecursionError) else e}); "
                   "write numbers of at most a few hundred digits, and values nested less deeply") from None
    if not isinstance(rec, dict):
        raise _Bad(f"the line is {_show(rec)}; each line is one JSON object like {{\"type\": \"node\", \"id\": \"n1\"}}")
    kind = rec.get("type")
    if kind is None:
        raise _Bad(f"the record has no \"type\"; give one of {', '.join(TYPES)}")
    if not isinstance(kind, str) or kind not in FIELDS:
        raise _Bad(f"unknown record type {_show(kind)}{did_you_mean(str(kind), FIELDS)}; types are {', '.join(TYPES)}")
    allowed = FIELDS[kind]
    for k in rec:
        if k != "type" and k not in allowed:
            raise _Bad(f"a {kind} record has no field {k!r}{did_you_mean(k, allowed)}; its fields are "
                       f"{', '.join(allowed)}")
    for k, required in allowed.items():
        if required and rec.get(k) is None:
            raise _Bad(f"a {kind} record needs {k!r}; e.g. {_EXAMPLES[kind]}")
    return rec


_EXAMPLES = {
    "header": '{"type": "header", "schema": "trellis-jsonl/1"}',
    "session": '{"type": "session", "id": "run-1", "task": "sort"}',
    "node": '{"type": "node", "id": "n1", "parents": ["n0"]}',
    "edge": '{"type": "edge", "src": "n1", "dst": "n2", "kind": "repair_of"}',
    "reward": '{"type": "reward", "node": "n1", "channel": "score", "value": 0.5}',
    "artifact": '{"type": "artifact", "node": "n1", "name": "code", "text": "print(1)"}',
    "attr": '{"type": "attr", "entity": "n1", "attrs": {"island": 2}}',
    "label": '{"type": "label", "nodes": ["n1"], "labels": ["archive"]}',
    "unlabel": '{"type": "unlabel", "nodes": ["n1"], "labels": ["archive"]}',
    "comparison": '{"type": "comparison", "a": "n1", "b": "n2", "preferred": "n2"}',
    "commit": '{"type": "commit", "message": "step 3", "tag": "t3"}',
}


def _file_units(file: str, name: str, prefix: str) -> Iterator[Unit]:
    run = _Run(file, prefix)
    out, start, last = _Rows(), 0, 0
    try:
        fh = open(file, "rb")  # noqa: SIM115 (closed below)
    except OSError as e:
        raise unreadable(file, e) from None
    with fh:
        first = True
        for n, raw in enumerate(fh, 1):
            try:
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a byte order mark may start the file
            except UnicodeDecodeError as e:
                raise ImportFormatError(f"{file}:{n}: not UTF-8 text (byte {e.start} of the line); "
                                        "write the file as UTF-8") from None
            if not text.strip():
                continue
            try:
                rec = _record(text)
                kind = rec["type"]
                if kind == "header":
                    if not first:
                        raise _Bad("a header may only be the first line; remove it, or move it to the top")
                    if rec["schema"] != SCHEMA_VERSION:
                        raise _Bad(f"schema {_show(rec['schema'])} is not one this trellisdb reads; it reads "
                                   f"{SCHEMA_VERSION!r} (write {{\"type\": \"header\", \"schema\": "
                                   f"\"{SCHEMA_VERSION}\"}}, or a newer trellisdb for a newer schema)")
                    first = False
                    continue
                first = False
                start = start or n
                last = n
                if kind == "commit":
                    unit = _commit(run, rec, out, name, file, start, n)
                    out, start = _Rows(), 0
                    yield unit
                    continue
                if kind == "node":
                    _node(run, rec, out, n)
                else:
                    _READERS[kind](run, rec, out)
                out.records += 1
            except _Bad as e:
                raise ImportFormatError(f"{file}:{n}: {e}") from None
    if start:
        yield Unit(name=f"{name}:{start}-{last}", rows=out.rows, where=f"{file}:{start}-{last}",
                   message=f"import jsonl {name}:{start}-{last}")


def _commit(run: _Run, rec: Mapping[str, Any], out: _Rows, name: str, file: str, start: int, end: int) -> Unit:
    meta = rec.get("meta")
    if meta is not None:
        _object("commit.meta", meta)
        if "import" in meta:
            raise _Bad("commit.meta key 'import' is the import's own (format, source, unit); use another key")
        try:
            meta = commit_meta(meta)
        except ValidationError as e:
            raise _Bad(f"commit.meta: {e}") from None
    tag = None
    if rec.get("tag") is not None:
        tag = _name("commit.tag (tag_prefix + tag)", run.tag_prefix + _name("commit.tag", rec["tag"]))
    message = _text("commit.message", rec["message"]) if rec.get("message") is not None else None
    unit = f"{name}:{start}-{end}"
    return Unit(name=unit, rows=out.rows, where=f"{file}:{start}-{end}", meta=meta, tag=tag,
                message=message or f"import jsonl {unit}")


# ------------------------------------------------------------------ the format's entry points


def _options(options: Mapping[str, Any]) -> str:
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        raise ValidationError(f"unknown jsonl import option {unknown[0]!r}{did_you_mean(unknown[0], OPTIONS)}; "
                              f"options are {', '.join(OPTIONS)}")
    prefix = options.get("tag_prefix") or ""
    if not isinstance(prefix, str):
        raise ValidationError(f"tag_prefix must be a string, not {prefix!r}")
    return prefix


def _files(path: str) -> list[tuple[str, str]]:
    if os.path.isfile(path):
        return [(path, os.path.basename(path))]
    if not os.path.isdir(path):
        raise ImportFormatError(f"{path}: neither a .jsonl file nor a folder of them")
    root = Path(path)
    found = sorted((p.relative_to(root).as_posix(), str(p)) for p in root.rglob("*.jsonl") if listed_file(str(p)))
    if not found:
        raise ImportFormatError(f"{path}: no .jsonl files in this folder or below")
    for _, f in found:
        if not inside(f, path):
            raise outside_error(f, path)
    return [(f, name) for name, f in found]


def source_name(path: str, **options: Any) -> str:
    """What identifies the import (its units are skipped when imported again): the absolute path
    given (a folder, or one file)."""
    _options(options)
    return os.path.abspath(path)


def units(path: str, **options: Any) -> Iterator[Unit]:
    """The units of every file, in order (see the module notes and ``docs/import-jsonl.md``): a
    bad line raises ImportFormatError naming the file and line before its unit is yielded (the
    units before it are committed by then)."""
    prefix = _options(options)
    for file, name in _files(path):
        yield from _file_units(file, name, prefix)
