"""SWE-agent trajectories (``.traj``): one session, and one commit, per file.

A ``.traj`` file is one JSON object: ``trajectory`` (per step ``thought``, ``action``,
``observation``, ``response``, ``state`` -- the environment state after the step --, and in
newer files ``execution_time``), ``history`` (the chat messages as the model saw them),
``info`` (``exit_status``, ``submission``, ``model_stats``, ...), ``environment`` and, in
newer files, ``replay_config``. The path is one ``.traj`` file or a folder searched
recursively for them (in sorted order); each file is a unit, named by what it holds:
``<stem>@<hash>``, the file's name without ``.traj`` and the first 16 hex digits of the sha256
of its bytes. Ids derive from that name and the import's source is the constant
:data:`SOURCE`, so the same trajectory imported through any path (its folder, a parent
folder, the file itself, a copy of the same name) is one unit: imported once, skipped after. See
``docs/import-swe-agent.md`` for the whole mapping; in short:

- the session ``swe-agent:<stem>@<hash>`` (agent ``swe-agent``, the model the replay config names,
  config = ``{"environment", "replay_config"}`` as JSON), of the task the replay config's
  problem statement names, else the file's stem (``task=`` overrides);
- per step a node ``<session>#<k>`` (kind ``step``, step ``k``), ``derived_from`` the step
  before; ``action`` and ``state`` in their columns; ``thought``, ``observation``, ``response``
  as artifacts; ``messages``: the history messages the step added (JSON), so that an ``sft``
  view with ``messages="messages", path=True`` exports the history message for message;
- ``info``: ``exit_status`` and ``model_stats`` as session attributes, a ``submitted`` reward
  on the last step, the ``submission`` patch as its artifact; another ``info`` field under its
  own name, or ``info_<name>`` where the import uses that name already.

>>> _split_history([{"role": "system"}, {"role": "user"}, {"role": "assistant", "action": "ls"},
...                 {"role": "user"}], [{"action": "ls"}, {"action": "submit"}])
[[{'role': 'system'}, {'role': 'user'}, {'role': 'assistant', 'action': 'ls'}], [{'role': 'user'}]]
>>> [len(p) for p in _split_history([{"role": "system"}, {"role": "assistant", "action": "ls", "is_demo": True},
...                                  {"role": "assistant", "action": "ls"}], [{"action": "ls"}, {"action": "x"}])]
[3, 0]
>>> _summary("Let's look.\\nThen edit.")
"Let's look."
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from trellisdb.errors import ImportFormatError, ValidationError
from trellisdb.importers.units import (
    SURROGATE_ESCAPE,
    Unit,
    inside,
    listed_file,
    lone_surrogate,
    outside_error,
    unreadable,
)
from trellisdb.names import check_name, did_you_mean

__all__ = ["AGENT", "FORMAT", "SOURCE", "source_name", "units"]

FORMAT = "swe-agent"
AGENT = "swe-agent"
#: The source every swe-agent import is recorded under: units are named by their content.
SOURCE = "trajectories"
#: Hex digits of the sha256 of a file's bytes in its unit's name.
HASH_DIGITS = 16
#: The longest file stem a unit's name keeps (in characters).
STEM_CHARS = 120
#: The options ``units`` takes (``import_run(db, "swe-agent", path, **options)``).
OPTIONS = ("task",)
#: The artifact of each step holding the history messages it added (a JSON array).
MESSAGES = "messages"
#: A node's summary: the first line of its thought, at most this many characters.
SUMMARY_CHARS = 200
#: Attributes above this size as JSON are kept as artifacts instead (the write API's limit).
ATTR_MAX_BYTES = 64 * 1024
#: The step fields the import maps itself; any other is kept under its own name.
_STEP_FIELDS = ("thought", "action", "observation", "response", "state", "execution_time")
#: The artifact names the import gives a step; a step field of one of these names gets ``step_`` before it.
_RESERVED = frozenset({"thought", "observation", "response", MESSAGES, "submission"})
#: The ``info`` fields the import maps itself; any other is kept under its own name.
_INFO_FIELDS = ("exit_status", "submission", "model_stats")
#: The reward channel saying the agent submitted (not that the submission is right).
SUBMITTED = "submitted"
VERIFIER = "swe-agent exit_status"

JsonPath = tuple[str | int, ...]


# ------------------------------------------------------------------ options and files


def _options(options: Mapping[str, Any]) -> str | None:
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        raise ValidationError(f"unknown swe-agent import option {unknown[0]!r}{did_you_mean(unknown[0], OPTIONS)}; "
                              f"options are {', '.join(OPTIONS)}")
    task = options.get("task")
    if task is not None:
        check_name(task, "task id (task=)")
    return task


def _files(path: str) -> list[tuple[str, str]]:
    """(file, relpath) of every trajectory: the file itself, or the folder's ``*.traj`` files by
    their path relative to it (``/``-separated), sorted. A file of the folder that links outside
    it is refused."""
    if os.path.isfile(path):
        return [(path, os.path.basename(path))]
    if not os.path.isdir(path):
        raise ImportFormatError(f"{path}: neither a .traj file nor a folder of them")
    root = Path(path)
    found = sorted((p.relative_to(root).as_posix(), str(p)) for p in root.rglob("*.traj") if listed_file(str(p)))
    if not found:
        raise ImportFormatError(f"{path}: no .traj files in this folder or below; give a SWE-agent trajectory "
                                "file or the folder SWE-agent wrote them to")
    for _, f in found:
        if not inside(f, path):
            raise outside_error(f, path)
    return [(f, rel) for rel, f in found]


def unit_name(file: str, data: bytes) -> str:
    """The name of the unit of the trajectory file ``file`` holding ``data``: its stem (cut to
    ``STEM_CHARS``) and the first ``HASH_DIGITS`` hex digits of the sha256 of its bytes.

    >>> unit_name("runs/a/pydicom-1458.traj", b"{}")
    'pydicom-1458@44136fa355b3678a'
    """
    stem = _printable(Path(file).stem[:STEM_CHARS])
    return f"{stem}@{hashlib.sha256(data).hexdigest()[:HASH_DIGITS]}"


def _printable(text: str) -> str:
    """``text`` with what UTF-8 cannot hold (a file name's undecodable bytes) escaped."""
    return text.encode("utf-8", "backslashreplace").decode()


def source_name(path: str, **options: Any) -> str:
    """What identifies the import (its units are skipped when imported again): :data:`SOURCE`,
    whatever the path (units are named by their files' contents)."""
    _options(options)
    return SOURCE


# ------------------------------------------------------------------ locating errors


def _line_of(text: str, path: JsonPath) -> int:
    """The line of the JSON value at ``path`` in ``text`` (of the object or list holding it, for
    a scalar). Parses again in pure Python, recording where each object and list starts: run
    only to report an error."""
    starts: dict[int, int] = {}
    dec = json.JSONDecoder()

    def track(parse: Callable[..., tuple[Any, int]]) -> Callable[..., tuple[Any, int]]:
        def run(state: tuple[str, int], *args: Any) -> tuple[Any, int]:
            value, end = parse(state, *args)
            starts[id(value)] = state[1] - 1
            return value, end
        return run

    dec.parse_object = track(json.decoder.JSONObject)  # type: ignore[attr-defined]
    dec.parse_array = track(json.decoder.JSONArray)  # type: ignore[attr-defined]
    dec.scan_once = json.scanner.py_make_scanner(dec)  # type: ignore[attr-defined]
    try:
        doc, _ = dec.raw_decode(text)
    except (ValueError, RecursionError):
        return 1
    node, pos = doc, starts.get(id(doc), 0)
    for key in path:
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            break
        pos = starts.get(id(node), pos)
    return text.count("\n", 0, pos) + 1


class _File:
    """One trajectory file being read: its text (for the lines of errors), its name and its
    unit's name."""

    def __init__(self, file: str, text: str, name: str) -> None:
        self.file = file
        self.text = text
        self.name = name

    def error(self, path: JsonPath, what: str) -> ImportFormatError:
        where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path).lstrip(".") or "the file"
        where = _printable(where)  # a key holding a lone surrogate, escaped
        return ImportFormatError(f"{self.file}:{_line_of(self.text, path)}: {where}: {what}")

    def text_field(self, obj: Mapping[str, Any], key: str, path: JsonPath) -> str | None:
        v = obj.get(key)
        if v is not None and not isinstance(v, str):
            raise self.error((*path, key), f"is a {_kind(v)}, not text; SWE-agent writes it as a string")
        return v


def _kind(v: Any) -> str:
    return {dict: "JSON object", list: "JSON list", str: "string", bool: "boolean", int: "number",
            float: "number"}.get(type(v), type(v).__name__)


def _read(file: str) -> tuple[_File, dict[str, Any]]:
    try:
        with open(file, "rb") as fh:
            data = fh.read()
    except OSError as e:
        raise unreadable(file, e) from None
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ImportFormatError(f"{file}:{line}: not UTF-8 text (byte {e.start}); a .traj file is JSON") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ImportFormatError(f"{file}:{e.lineno}:{e.colno}: not valid JSON ({e.msg}); a .traj file is one "
                                "JSON object") from None
    except (ValueError, RecursionError) as e:  # a number of thousands of digits; nesting too deep
        why = "values nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ImportFormatError(f"{file}: JSON this reader cannot take ({why})") from None
    f = _File(file, text, unit_name(file, data))
    if SURROGATE_ESCAPE.search(text):
        bad = lone_surrogate(doc)
        if bad is not None:  # e.g. an observation of binary output, escaped by a lenient writer
            raise f.error(bad[0], f"is not valid UTF-8 text ({bad[1]}); the file escapes half of a UTF-16 "
                                  "surrogate pair, which no text can hold: replace it (e.g. with \\ufffd)")
    if not isinstance(doc, dict):
        raise f.error((), f"is a {_kind(doc)}; a .traj file is one JSON object with 'trajectory' and 'history'")
    if "trajectory" not in doc and "history" not in doc:
        raise f.error((), "has neither 'trajectory' nor 'history'; is it a SWE-agent .traj file?")
    return f, doc


# ------------------------------------------------------------------ mapping


def _summary(thought: str | None) -> str | None:
    """The first non-empty line of a thought, at most ``SUMMARY_CHARS`` characters."""
    for line in (thought or "").splitlines():
        if line.strip():
            return line.strip()[:SUMMARY_CHARS]
    return None


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _match(msg: Mapping[str, Any], steps: Sequence[Mapping[str, Any]], start: int) -> int | None:
    """The first step from ``start`` whose action (or response) is the assistant message's."""
    action, content = msg.get("action"), msg.get("content")
    for j in range(start, len(steps)):
        s = steps[j]
        if (isinstance(action, str) and s.get("action") == action) or \
                (isinstance(content, str) and s.get("response") == content):
            return j
    return None


def _split_history(history: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]]
                   ) -> list[list[Mapping[str, Any]]]:
    """Per step, the history messages it added: everything after the previous step's assistant
    message up to and including its own (an assistant message belongs to the first step, from
    the one after the previous message's, whose action or response it repeats; else to that
    next step). Messages after the last assistant message go to the last step. Demonstration
    messages (``is_demo``) end no step: they stay with the messages around them (before the
    first step's own: in the first step's part). Read in step order, the parts are the history,
    message for message."""
    parts: list[list[Mapping[str, Any]]] = [[] for _ in steps]
    pending: list[Mapping[str, Any]] = []
    nxt = 0
    for m in history:
        pending.append(m)
        if m.get("role") == "assistant" and not m.get("is_demo"):
            j = _match(m, steps, nxt)
            if j is None:
                j = min(nxt, len(steps) - 1)
            parts[j].extend(pending)
            pending = []
            nxt = j + 1
    parts[-1].extend(pending)
    return parts


class _Rows:
    """The rows of one unit, by table, with its artifacts stored once."""

    def __init__(self, f: _File) -> None:
        self.f = f
        self.rows: dict[str, list[dict[str, Any]]] = {}
        self._hashes: set[str] = set()
        #: entity -> the artifact and attribute names given it so far
        self.names: dict[str, set[str]] = {}

    def add(self, table: str, row: dict[str, Any]) -> None:
        self.rows.setdefault(table, []).append(row)
        if table == "node_artifacts":
            self.names.setdefault(row["node_id"], set()).add(row["name"])
        elif table == "attributes":
            self.names.setdefault(row["entity"], set()).add(row["key"])

    def taken(self, entity: str | None, name: str) -> bool:
        return entity is not None and name in self.names.get(entity, ())

    def content(self, data: bytes, media_type: str | None) -> str:
        h = hashlib.sha256(data).hexdigest()
        if h not in self._hashes:
            self._hashes.add(h)
            self.add("artifacts", {"hash": h, "media_type": media_type, "size": len(data), "content": data})
        return h

    def artifact(self, node: str, name: str, text: str, media_type: str = "text/plain") -> None:
        self.add("node_artifacts", {"node_id": node, "name": name, "hash": self.content(text.encode(), media_type)})

    def attr(self, scope: str, entity: str, key: str, value: Any, session: str, path: JsonPath) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _DOUBLE_MAX:
            raise self.f.error(path, "is a number beyond the range of a double, which an attribute cannot hold")
        self.add("attributes", {"scope": scope, "entity": entity, "key": key, "value": _json(value),
                                "session_id": session})

    def keep(self, scope: str, entity: str, key: str, value: Any, session: str, node: str | None,
             path: JsonPath) -> None:
        """An extra field: a string as an artifact of ``node`` (when there is one), other values
        as an attribute while their JSON fits ``ATTR_MAX_BYTES``, else as an artifact of ``node``
        (JSON text) or, without one, a stored artifact the attribute ``<key>_sha256`` names."""
        if isinstance(value, str) and node is not None:
            self.artifact(node, key, value)
            return
        text = _json(value)
        if len(text.encode()) <= ATTR_MAX_BYTES:
            self.attr(scope, entity, key, value, session, path)
        elif node is not None:
            self.artifact(node, key, text, "application/json")
        else:
            self.attr(scope, entity, f"{key}_sha256", self.content(text.encode(), "application/json"), session, path)


#: The largest finite double: an integer beyond it has no number an attribute can hold.
_DOUBLE_MAX = 1.7976931348623157e308


def _replay_config(f: _File, doc: Mapping[str, Any]) -> dict[str, Any] | None:
    rc = doc.get("replay_config")
    if isinstance(rc, str):  # some versions write it as JSON text
        try:
            rc = json.loads(rc)
        except (ValueError, RecursionError):
            raise f.error(("replay_config",), "is text that is not JSON (or JSON this reader cannot take); "
                                              "SWE-agent writes the run's config there (an object, or its JSON "
                                              "text)") from None
        bad = lone_surrogate(rc)
        if bad is not None:
            raise f.error(("replay_config",), f"is JSON text whose value at {'.'.join(map(str, bad[0]))!r} is not "
                                              f"valid UTF-8 text ({bad[1]})")
    if rc is not None and not isinstance(rc, dict):
        raise f.error(("replay_config",), f"is a {_kind(rc)}, not a JSON object")
    return rc


def _dig(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _seconds(f: _File, t: Any, path: JsonPath) -> float | None:
    """A step's ``execution_time`` (seconds): a finite number >= 0, or None."""
    if t is None:
        return None
    try:
        x = float(t) if isinstance(t, int | float) and not isinstance(t, bool) else math.nan
    except OverflowError:
        x = math.nan
    if not (math.isfinite(x) and x >= 0):
        raise f.error(path, f"is {str(t)[:40]!r}, not a number of seconds (a finite number >= 0)")
    return x


def _unit(file: str, rel: str, task_opt: str | None) -> Unit:
    f, doc = _read(file)
    name = f.name
    steps = doc.get("trajectory", [])
    if not isinstance(steps, list):
        raise f.error(("trajectory",), f"is a {_kind(steps)}; it is the list of steps")
    history = doc.get("history", [])
    if not isinstance(history, list):
        raise f.error(("history",), f"is a {_kind(history)}; it is the list of chat messages")
    info = doc.get("info", {})
    if not isinstance(info, dict):
        raise f.error(("info",), f"is a {_kind(info)}, not a JSON object")
    rc = _replay_config(f, doc)
    for i, m in enumerate(history):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise f.error(("history", i), "is not a chat message: each is an object with a string 'role' "
                                          "(system, user, assistant, tool) and its 'content'")
    seconds = []
    for i, s in enumerate(steps):
        if not isinstance(s, dict):
            raise f.error(("trajectory", i), f"is a {_kind(s)}; each step is an object (thought, action, "
                                             "observation, response, state)")
        for key in ("thought", "action", "observation", "response"):
            f.text_field(s, key, ("trajectory", i))
        if s.get("state") is not None and not isinstance(s["state"], str | dict):
            raise f.error(("trajectory", i, "state"), f"is a {_kind(s['state'])}; the state is JSON text or an object")
        seconds.append(_seconds(f, s.get("execution_time"), ("trajectory", i, "execution_time")))
    exit_status = f.text_field(info, "exit_status", ("info",))
    submission = f.text_field(info, "submission", ("info",))
    stats = info.get("model_stats")
    if stats is not None and not isinstance(stats, dict):
        raise f.error(("info", "model_stats"), f"is a {_kind(stats)}, not a JSON object")
    spec = _dig(rc, "problem_statement", "text")
    if spec is not None and not isinstance(spec, str):
        raise f.error(("replay_config", "problem_statement", "text"), f"is a {_kind(spec)}, not text; it is the "
                                                                     "task's statement")

    sid = f"swe-agent:{name}"
    task = task_opt or _dig(rc, "problem_statement", "id") or Path(file).stem
    model = _dig(rc, "agent", "model", "name") or _dig(rc, "agent", "model", "model_name")
    try:
        check_name(sid, "session id (swe-agent:<stem>@<hash>)")
        check_name(task, "task id")
        if model is not None:
            check_name(model, "model")
    except ValidationError as e:
        raise f.error((), str(e)) from None
    config = {k: v for k, v in (("environment", doc.get("environment")), ("replay_config", rc)) if v is not None}
    out = _Rows(f)
    out.add("tasks", {"id": task, "name": task, "spec": spec})
    out.add("sessions", {"id": sid, "task_id": task, "agent": AGENT, "model": model,
                         "config": _json(config) if config else None, "status": "completed"})
    ids = [f"{sid}#{k}" for k in range(1, len(steps) + 1)]
    parts = _split_history(history, steps) if steps else []
    for i, (nid, s) in enumerate(zip(ids, steps, strict=True)):
        state = s.get("state")
        out.add("nodes", {"id": nid, "session_id": sid, "task_id": task, "kind": "step", "step": i + 1,
                          "summary": _summary(s.get("thought")), "seconds": seconds[i],
                          "source": AGENT, "action": s.get("action"),
                          "state": state if state is None or isinstance(state, str) else _json(state)})
        if i:
            out.add("edges", {"src": ids[i - 1], "dst": nid, "kind": "derived_from", "session_id": sid})
        for key in ("thought", "observation", "response"):
            if s.get(key) is not None:
                out.artifact(nid, key, s[key])
        if parts[i]:
            out.artifact(nid, MESSAGES, _json(parts[i]), "application/json")
        for key, v in s.items():
            if key not in _STEP_FIELDS and v is not None:
                out.keep("node", nid, f"step_{key}" if key in _RESERVED else key, v, sid, nid, ("trajectory", i, key))
    last = ids[-1] if ids else None
    if not steps and history:  # no step to hold the messages: the session keeps it whole
        out.keep("session", sid, "history", history, sid, None, ("history",))
    if exit_status is not None:
        out.attr("session", sid, "exit_status", exit_status, sid, ("info", "exit_status"))
        if last is not None:
            out.add("rewards", {"node_id": last, "channel": SUBMITTED, "verifier": VERIFIER,
                                "value": 1.0 if exit_status.startswith("submitted") else 0.0})
    for key, v in (stats or {}).items():
        if v is not None:
            out.keep("session", sid, key, v, sid, None, ("info", "model_stats", key))
    if submission is not None:
        if last is not None:
            out.artifact(last, "submission", submission, "text/x-diff")
        else:
            out.keep("session", sid, "submission", submission, sid, None, ("info", "submission"))
    for key, v in info.items():
        if key not in _INFO_FIELDS and v is not None:
            # a name the import gave the session or the last step already (thought, tokens_sent, ...)
            free = f"info_{key}" if out.taken(sid, key) or out.taken(last, key) or key in _RESERVED else key
            out.keep("session", sid, free, v, sid, last, ("info", key))
    return Unit(name=name, rows=out.rows, where=file, message=f"import swe-agent {name}",
                meta={"swe-agent": {"file": _printable(rel)}})


def units(path: str, **options: Any) -> Iterator[Unit]:
    """One :class:`Unit` per trajectory file, in sorted order (see the module notes and
    ``docs/import-swe-agent.md``); a file that cannot be read raises ImportFormatError naming
    it and the line, when its turn comes (the files before it are committed by then)."""
    task = _options(options)
    for file, rel in _files(path):
        yield _unit(file, rel, task)
