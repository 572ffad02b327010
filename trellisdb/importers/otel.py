"""OpenTelemetry traces (OTLP JSON) as experience graphs: ``trellis import otel PATH``.

PATH is an OTLP JSON file (one ``ExportTraceServiceRequest`` object, or JSON Lines of them as
the collector's file exporter writes), or a folder of such files (``*.json``, ``*.jsonl``,
``*.ndjson``, each optionally ``.gz``; read recursively in sorted order). Spans follow the
GenAI semantic conventions of OpenTelemetry (semantic-conventions v1.41.0, the last release
holding them; the older event-based message content of v1.26-v1.36 is read too). See
``docs/import-otel.md`` for the whole mapping; in short:

- one unit (one commit) per trace, in order of first appearance; its session is
  ``otel:<traceId>``, its task the option ``task``, else ``gen_ai.conversation.id``, else the
  ``service.name`` of the resource, else ``otel``;
- each span is a node ``otel:<spanId>`` (hex, lower case) whose kind comes from
  ``gen_ai.operation.name``, and a ``derived_from`` edge runs from its parent span to it;
- span attributes become node attributes under their OpenTelemetry names; message contents
  become artifacts (``input_messages``, ``output_messages``, ``system_instructions``, and for
  model calls the texts training views read, ``prompt`` / ``response`` / ``system_prompt``,
  when derivable); tool results
  become ``observation``.

The unit's name is the trace id and the import's source is the constant :data:`SOURCE`: trace
ids are unique, so a trace imported once (from any file) is skipped by every later import.

>>> node_kind("execute_tool"), node_kind("chat"), node_kind("invoke_agent"), node_kind(None)
('tool_call', 'llm_call', 'agent', 'span')
>>> _any({"arrayValue": {"values": [{"intValue": "3"}, {"doubleValue": "NaN"}, {}]}}, _Loc("f"), "v")
[3, 'NaN', None]
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import gzip
import hashlib
import heapq
import json
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn

from trellisdb.errors import ImportFormatError, ValidationError
from trellisdb.importers.units import (
    SURROGATE_ESCAPE,
    Unit,
    inside,
    json_path,
    listed_file,
    lone_surrogate,
    outside_error,
    unreadable,
)
from trellisdb.names import check_name, name_problem
from trellisdb.rules import ATTR_MAX_BYTES, INT64_MAX

__all__ = ["SOURCE", "node_kind", "source_name", "units"]

#: The source every OTLP import is recorded under: units are traces, named by their ids.
SOURCE = "traces"
#: Files of a folder that are read.
SUFFIXES = (".json", ".jsonl", ".ndjson")
#: The prefix of the node and session ids an import writes.
PREFIX = "otel:"

#: ``gen_ai.operation.name`` -> node kind (any other operation, or none: ``span``).
KINDS: dict[str, str] = {
    "invoke_agent": "agent",
    "create_agent": "agent",
    "invoke_workflow": "agent",
    "execute_tool": "tool_call",
    "chat": "llm_call",
    "text_completion": "llm_call",
    "generate_content": "llm_call",
}
#: Span attributes holding message contents: artifacts, not attributes.
CONTENT_KEYS = frozenset({
    "gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions", "gen_ai.tool.call.result",
    "gen_ai.prompt", "gen_ai.completion",
})
#: Span attributes of type ``any`` that the conventions allow as JSON text: stored parsed.
STRUCTURED_KEYS = frozenset({"gen_ai.tool.call.arguments", "gen_ai.tool.definitions", "gen_ai.retrieval.documents"})
#: Events (span events, or log records of the span) carrying message content.
LEGACY_ROLES = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}
DETAILS_EVENT = "gen_ai.client.inference.operation.details"
CONTENT_EVENTS = frozenset({*LEGACY_ROLES, "gen_ai.choice", "gen_ai.content.prompt", "gen_ai.content.completion",
                            DETAILS_EVENT})

_SPAN_KINDS = ("unspecified", "internal", "server", "client", "producer", "consumer")
_STATUS = ("unset", "ok", "error")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def node_kind(operation: object) -> str:
    """The node kind of a span whose ``gen_ai.operation.name`` is ``operation``."""
    return KINDS.get(operation, "span") if isinstance(operation, str) else "span"


def _kind_of(attrs: Mapping[str, Any]) -> str:
    """The node kind of a span: by its operation; a span of the conventions before v1.27 (no
    operation name, but a requested model) is a model call."""
    op = attrs.get("gen_ai.operation.name")
    if op is None and attrs.get("gen_ai.request.model") is not None:
        return "llm_call"
    return node_kind(op)


def _task_option(options: Mapping[str, Any]) -> str | None:
    unknown = sorted(set(options) - {"task"})
    if unknown:
        raise ValidationError(f"the otel import takes option 'task' only, not {', '.join(map(repr, unknown))}")
    task = options.get("task")
    return check_name(task, "task id", optional=True)


def source_name(path: str, **options: Any) -> str:
    """The source imports of OTLP traces are recorded under: :data:`SOURCE`, whatever the file
    (trace ids name the units, and are unique across files)."""
    _task_option(options)
    return SOURCE


# ------------------------------------------------------------------ reading


@dataclass(frozen=True)
class _Loc:
    """Where something was read: a file, a line of it (JSON Lines), a path inside the object."""

    file: str
    line: int | None = None

    def __str__(self) -> str:
        return self.file if self.line is None else f"{self.file}:{self.line}"


def _fail(loc: _Loc, path: str, message: str) -> NoReturn:
    where = f"{loc}: {path}" if path else str(loc)
    raise ImportFormatError(f"{where}: {message}")


@dataclass
class _Event:
    name: str
    time: int | None
    attrs: dict[str, Any]
    body: Any = None


@dataclass
class _Span:
    trace_id: str
    span_id: str
    parent: str | None
    name: str
    kind: str
    start: int | None
    end: int | None
    attrs: dict[str, Any]
    events: list[_Event]
    links: list[dict[str, Any]]
    status: str
    status_message: str | None
    resource: dict[str, Any]
    scope: dict[str, Any]
    loc: _Loc = field(compare=False)
    path: str = field(compare=False)
    file_index: int = field(compare=False)

    @property
    def where(self) -> str:
        return f"{self.loc}: {self.path} (span {self.span_id}, {self.name!r})"


@dataclass
class _Trace:
    trace_id: str
    spans: dict[str, _Span] = field(default_factory=dict)
    files: dict[int, str] = field(default_factory=dict)
    first: _Loc | None = None
    #: span id -> content events read from log records
    log_events: dict[str, list[_Event]] = field(default_factory=dict)


def _obj(v: object, loc: _Loc, path: str) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        _fail(loc, path, f"must be a JSON object, got {type(v).__name__}")
    return v


def _list(v: object, loc: _Loc, path: str) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        _fail(loc, path, f"must be a JSON array, got {type(v).__name__}")
    return v


def _str(v: object, loc: _Loc, path: str) -> str:
    if v is None:
        return ""
    if not isinstance(v, str):
        _fail(loc, path, f"must be a string, got {type(v).__name__} {v!r}")
    return v


def _int(v: object, loc: _Loc, path: str) -> int:
    """A 64-bit integer of the protobuf JSON mapping: a number or a decimal string."""
    if isinstance(v, bool):
        _fail(loc, path, f"must be an integer, got {v!r}")
    n: int | None = None
    if isinstance(v, int):
        n = v
    elif isinstance(v, float) and v.is_integer():
        n = int(v)
    elif isinstance(v, str) and v.strip().lstrip("+-").isascii() and v.strip().lstrip("+-").isdigit():
        n = int(v.strip())  # ASCII digits only: int() takes other scripts' digits, and '_'
    if n is None:
        _fail(loc, path, f"must be an integer (a number or a decimal string), got {_short(v)}")
    if not -INT64_MAX - 1 <= n <= INT64_MAX:
        _fail(loc, path, f"{_short(n)} is out of the range of a 64-bit integer (OTLP's int64)")
    return n


def _short(v: object) -> str:
    """``repr(v)``, cut to 60 characters (a number of thousands of digits is shown by its start)."""
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**60 else f"{str(v)[:20]}... ({len(str(abs(v)))} digits)"
    return text if len(text) <= 60 else text[:57] + "..."


def _double(v: object, loc: _Loc, path: str) -> float | str:
    """A double of the protobuf JSON mapping; NaN and the infinities (which JSON cannot hold)
    are kept as the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            x = float(v)
        except OverflowError:  # an integer of hundreds of digits
            _fail(loc, path, f"{_short(v)} is out of the range of a double")
    elif isinstance(v, str):
        try:
            x = float(v)
        except ValueError:
            _fail(loc, path, f"must be a number, got {v!r}")
    else:
        _fail(loc, path, f"must be a number, got {v!r}")
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    return x


def _any(v: object, loc: _Loc, path: str) -> Any:
    """An OTLP ``AnyValue`` as a JSON value (``bytesValue`` stays its base64 text; an empty
    value is null)."""
    o = _obj(v, loc, path)
    if "stringValue" in o:
        return _str(o["stringValue"], loc, path + ".stringValue")
    if "boolValue" in o:
        b = o["boolValue"]
        if not isinstance(b, bool):
            _fail(loc, path + ".boolValue", f"must be true or false, got {b!r}")
        return b
    if "intValue" in o:
        return _int(o["intValue"], loc, path + ".intValue")
    if "doubleValue" in o:
        return _double(o["doubleValue"], loc, path + ".doubleValue")
    if "arrayValue" in o:
        vs = _list(_obj(o["arrayValue"], loc, path + ".arrayValue").get("values"), loc, path + ".arrayValue.values")
        return [_any(x, loc, f"{path}.arrayValue.values[{i}]") for i, x in enumerate(vs)]
    if "kvlistValue" in o:
        kvs = _list(_obj(o["kvlistValue"], loc, path + ".kvlistValue").get("values"), loc, path + ".kvlistValue.values")
        return _attrs(kvs, loc, path + ".kvlistValue.values", keep_null=True)
    if "bytesValue" in o:
        return _str(o["bytesValue"], loc, path + ".bytesValue")
    return None


def _attrs(kvs: object, loc: _Loc, path: str, keep_null: bool = False) -> dict[str, Any]:
    """A list of ``{key, value}`` as a mapping (a repeated key: the last wins; null values are
    dropped unless ``keep_null``)."""
    out: dict[str, Any] = {}
    for i, kv in enumerate(_list(kvs, loc, path)):
        o = _obj(kv, loc, f"{path}[{i}]")
        key = o.get("key")
        if not isinstance(key, str) or not key:
            _fail(loc, f"{path}[{i}].key", f"must be a non-empty string, got {key!r}")
        value = _any(o.get("value"), loc, f"{path}[{i}].value")
        if value is not None or keep_null:
            out[key] = value
    return out


def _hex_id(v: object, size: int, loc: _Loc, path: str, *, optional: bool = False) -> str | None:
    """A trace (16 bytes) or span (8 bytes) id as lower-case hex; '' (and, for an optional id,
    all zeros) is None."""
    s = _str(v, loc, path)
    if not s or (optional and s.strip("0") == ""):
        if optional:
            return None
        _fail(loc, path, "is missing; every span has a traceId and a spanId")
    digits = 2 * size
    if len(s) == digits:
        try:
            bytes.fromhex(s)
        except ValueError:
            pass
        else:
            if s.strip("0") == "":
                _fail(loc, path, f"{s!r} is all zeros, which OpenTelemetry reserves for an invalid id")
            return s.lower()
    hint = ""
    try:
        if len(base64.b64decode(s, validate=True)) == size:
            hint = " (it looks base64-encoded, as the plain protobuf JSON mapping writes bytes; OTLP JSON writes ids as hex)"
    except (binascii.Error, ValueError):
        pass
    _fail(loc, path, f"{s!r} is not an id of {digits} hex digits{hint}")


def _nanos(v: object, loc: _Loc, path: str) -> int | None:
    if v is None or v == "":
        return None
    n = _int(v, loc, path)
    if n < 0:
        _fail(loc, path, f"must be >= 0 (nanoseconds since the Unix epoch), got {n}")
    return n or None


def _enum(v: object, names: tuple[str, ...], prefix: str, loc: _Loc, path: str) -> str:
    """An enum value: its number (OTLP JSON), or its protobuf name (which proto parsers accept)."""
    if v is None:
        return names[0]
    if isinstance(v, str) and v.upper().removeprefix(prefix) in (n.upper() for n in names):
        return v.upper().removeprefix(prefix).lower()
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(names):
        return names[v]
    _fail(loc, path, f"must be one of 0..{len(names) - 1} ({', '.join(names)}), got {v!r}")


def _json_constant(name: str) -> str:
    return name  # NaN / Infinity / -Infinity, which JSON has no form for: kept as text


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_json_constant)


def _parse_text(text: str, file: str, line: int | None) -> Any:
    """A file's JSON (``line`` None) or one line's; ImportFormatError naming the file and line if
    it is not JSON, is JSON this reader cannot take, or holds text UTF-8 cannot hold."""
    try:
        doc = _loads(text)
    except json.JSONDecodeError as e:
        raise ImportFormatError(f"{file}:{e.lineno if line is None else line}:{e.colno}: is not valid JSON: "
                                f"{e.msg}") from None
    except (ValueError, RecursionError) as e:  # a number of thousands of digits; nesting too deep
        why = "values nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ImportFormatError(f"{_Loc(file, line)}: is JSON this reader cannot take ({why})") from None
    if SURROGATE_ESCAPE.search(text):
        bad = lone_surrogate(doc)
        if bad is not None:
            at = json_path(bad[0]).encode("utf-8", "backslashreplace").decode()
            raise ImportFormatError(f"{_Loc(file, line)}: {at or 'the value'}: is not valid UTF-8 text ({bad[1]}); "
                                    "the file escapes half of a UTF-16 surrogate pair, which no text can hold")
    return doc


class _Reader:
    """Reads OTLP JSON files into traces; keeps the first error and goes on reading (a trace
    with spans in or after the file of the first error is not imported)."""

    def __init__(self) -> None:
        self.traces: dict[str, _Trace] = {}
        self.span_traces: dict[str, str] = {}
        self.error: ImportFormatError | None = None
        self.error_file: int | None = None

    def read_file(self, index: int, path: str) -> None:
        try:
            raw = gzip.decompress(_read_bytes(path)) if path.endswith(".gz") else _read_bytes(path)
        except (OSError, EOFError) as e:
            self._error(index, unreadable(path, e) if isinstance(e, OSError) else
                        ImportFormatError(f"{path}: cannot be read: {e}"))
            return
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            line = raw[: e.start].count(b"\n") + 1
            self._error(index, ImportFormatError(f"{path}:{line}: is not UTF-8 text ({e.reason} at byte {e.start})"))
            return
        lines = text.split("\n")
        filled = [(i + 1, ln) for i, ln in enumerate(lines) if ln.strip()]
        if len(filled) >= 2 and _is_object(filled[0][1]):  # JSON Lines: one request per line
            for no, ln in filled:
                try:
                    doc = _parse_text(ln, path, no)
                except ImportFormatError as e:
                    self._error(index, e)
                    continue
                self._request(index, doc, _Loc(path, no))
            return
        if not filled:
            return
        try:
            doc = _parse_text(text, path, None)
        except ImportFormatError as e:
            self._error(index, e)
            return
        self._request(index, doc, _Loc(path))

    def _error(self, index: int, error: ImportFormatError) -> None:
        if self.error is None:
            self.error, self.error_file = error, index

    def _request(self, index: int, doc: object, loc: _Loc) -> None:
        try:
            self._parse(index, doc, loc)
        except ImportFormatError as e:
            self._error(index, e)

    def _parse(self, index: int, doc: object, loc: _Loc) -> None:
        if not isinstance(doc, dict):
            _fail(loc, "", f"must be a JSON object (an OTLP ExportTraceServiceRequest), got {type(doc).__name__}")
        if "resourceSpans" not in doc and "resourceLogs" not in doc:
            if "resource_spans" in doc:
                _fail(loc, "", "has 'resource_spans': OTLP JSON writes keys in lowerCamelCase ('resourceSpans')")
            if doc and not {"resourceMetrics", "resourceProfiles"} & set(doc):
                _fail(loc, "", f"is not an OTLP trace export: no 'resourceSpans' (keys: {', '.join(sorted(doc)[:8])})")
            return  # an empty request, or another signal
        for i, rs in enumerate(_list(doc.get("resourceSpans"), loc, "resourceSpans")):
            p = f"resourceSpans[{i}]"
            rs = _obj(rs, loc, p)
            resource = _attrs(_obj(rs.get("resource"), loc, p + ".resource").get("attributes"), loc,
                              p + ".resource.attributes")
            key = "scopeSpans" if "scopeSpans" in rs else "instrumentationLibrarySpans"  # its name before scopes
            for j, ss in enumerate(_list(rs.get(key), loc, f"{p}.{key}")):
                q = f"{p}.{key}[{j}]"
                ss = _obj(ss, loc, q)
                sc = _obj(ss.get("scope", ss.get("instrumentationLibrary")), loc, q + ".scope")
                scope = {"name": _str(sc.get("name"), loc, q + ".scope.name"),
                         "version": _str(sc.get("version"), loc, q + ".scope.version")}
                for k, sp in enumerate(_list(ss.get("spans"), loc, q + ".spans")):
                    self._add(self._span(_obj(sp, loc, f"{q}.spans[{k}]"), resource, scope, index, loc,
                                         f"{q}.spans[{k}]"))
        for i, rl in enumerate(_list(doc.get("resourceLogs"), loc, "resourceLogs")):
            p = f"resourceLogs[{i}]"
            for j, sl in enumerate(_list(_obj(rl, loc, p).get("scopeLogs"), loc, p + ".scopeLogs")):
                q = f"{p}.scopeLogs[{j}]"
                for k, rec in enumerate(_list(_obj(sl, loc, q).get("logRecords"), loc, q + ".logRecords")):
                    self._log(_obj(rec, loc, f"{q}.logRecords[{k}]"), index, loc, f"{q}.logRecords[{k}]")

    def _span(self, sp: dict[str, Any], resource: dict[str, Any], scope: dict[str, Any], index: int, loc: _Loc,
              p: str) -> _Span:
        trace_id = _hex_id(sp.get("traceId"), 16, loc, p + ".traceId")
        span_id = _hex_id(sp.get("spanId"), 8, loc, p + ".spanId")
        assert trace_id is not None and span_id is not None
        events = []
        for i, ev in enumerate(_list(sp.get("events"), loc, p + ".events")):
            ev = _obj(ev, loc, f"{p}.events[{i}]")
            events.append(_Event(_str(ev.get("name"), loc, f"{p}.events[{i}].name"),
                                 _nanos(ev.get("timeUnixNano"), loc, f"{p}.events[{i}].timeUnixNano"),
                                 _attrs(ev.get("attributes"), loc, f"{p}.events[{i}].attributes")))
        links = []
        for i, ln in enumerate(_list(sp.get("links"), loc, p + ".links")):
            ln = _obj(ln, loc, f"{p}.links[{i}]")
            link: dict[str, Any] = {"trace_id": _hex_id(ln.get("traceId"), 16, loc, f"{p}.links[{i}].traceId"),
                                    "span_id": _hex_id(ln.get("spanId"), 8, loc, f"{p}.links[{i}].spanId")}
            la = _attrs(ln.get("attributes"), loc, f"{p}.links[{i}].attributes")
            if la:
                link["attributes"] = la
            links.append(link)
        status = _obj(sp.get("status"), loc, p + ".status")
        return _Span(
            trace_id=trace_id, span_id=span_id,
            parent=_hex_id(sp.get("parentSpanId"), 8, loc, p + ".parentSpanId", optional=True),
            name=_str(sp.get("name"), loc, p + ".name"),
            kind=_enum(sp.get("kind"), _SPAN_KINDS, "SPAN_KIND_", loc, p + ".kind"),
            start=_nanos(sp.get("startTimeUnixNano"), loc, p + ".startTimeUnixNano"),
            end=_nanos(sp.get("endTimeUnixNano"), loc, p + ".endTimeUnixNano"),
            attrs=_attrs(sp.get("attributes"), loc, p + ".attributes"),
            events=events, links=links,
            status=_enum(status.get("code"), _STATUS, "STATUS_CODE_", loc, p + ".status.code"),
            status_message=_str(status.get("message"), loc, p + ".status.message") or None,
            resource=resource, scope=scope, loc=loc, path=p, file_index=index,
        )

    def _trace(self, trace_id: str, index: int, loc: _Loc) -> _Trace:
        t = self.traces.get(trace_id)
        if t is None:
            t = self.traces[trace_id] = _Trace(trace_id, first=loc)
        t.files.setdefault(index, loc.file)
        return t

    def _add(self, span: _Span) -> None:
        other = self.span_traces.setdefault(span.span_id, span.trace_id)
        if other != span.trace_id:
            first = self.traces[other].spans[span.span_id]
            _fail(span.loc, span.path, f"span id {span.span_id} is used in trace {span.trace_id} and in trace "
                  f"{other} ({first.loc}); the import names span nodes otel:<spanId>, which must be unique")
        t = self._trace(span.trace_id, span.file_index, span.loc)
        seen = t.spans.get(span.span_id)
        if seen is None:
            t.spans[span.span_id] = span
        elif seen != span:  # the same span delivered twice (OTLP allows duplicates) is read once
            _fail(span.loc, span.path, f"span {span.span_id} of trace {span.trace_id} appears again with other "
                  f"content (first at {seen.loc}: {seen.path})")

    def _log(self, rec: dict[str, Any], index: int, loc: _Loc, p: str) -> None:
        """A log record holding GenAI message content (an event of v1.28-v1.36, or the
        inference details event of later versions), kept with its span."""
        attrs = _attrs(rec.get("attributes"), loc, p + ".attributes")
        name = _str(rec.get("eventName"), loc, p + ".eventName") or attrs.pop("event.name", None)
        if name not in CONTENT_EVENTS:
            return
        trace_id = _hex_id(rec.get("traceId"), 16, loc, p + ".traceId", optional=True)
        span_id = _hex_id(rec.get("spanId"), 8, loc, p + ".spanId", optional=True)
        if trace_id is None or span_id is None:
            return  # not in a span's context: nothing to attach it to
        time = _nanos(rec.get("timeUnixNano"), loc, p + ".timeUnixNano") or _nanos(
            rec.get("observedTimeUnixNano"), loc, p + ".observedTimeUnixNano")
        body = _any(rec["body"], loc, p + ".body") if rec.get("body") is not None else None
        self._trace(trace_id, index, loc).log_events.setdefault(span_id, []).append(_Event(str(name), time, attrs, body))


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _is_object(line: str) -> bool:
    try:
        return isinstance(_loads(line), dict)
    except (ValueError, RecursionError):
        return False


def _files(path: str) -> list[str]:
    if not os.path.isdir(path):
        return [path]
    found = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for n in sorted(names):
            if not n.startswith(".") and n.removesuffix(".gz").endswith(SUFFIXES) and listed_file(os.path.join(root, n)):
                found.append(os.path.join(root, n))
    if not found:
        raise ImportFormatError(f"{path}: no OTLP JSON files in this folder (*.json, *.jsonl, *.ndjson, or .gz of them)")
    for f in found:
        if not inside(f, path):
            raise outside_error(f, path)
    return sorted(found, key=lambda f: os.path.relpath(f, path))


# ------------------------------------------------------------------ writing


def units(path: str, **options: Any) -> Iterator[Unit]:
    """One unit per trace of the files at ``path``, in order of first appearance. A malformed
    file stops the import: the traces with spans only in the files before it are yielded, then
    its error is raised (naming the file and line)."""
    task = _task_option(options)
    reader = _Reader()
    for i, f in enumerate(_files(path)):
        reader.read_file(i, f)
    cut = reader.error_file
    now = dt.datetime.now(dt.UTC)
    for trace in reader.traces.values():
        if not trace.spans or (cut is not None and max(trace.files) >= cut):
            continue  # log records of spans not in the input; or a trace the bad file may hold more of
        yield _TraceUnit(trace, task, now).unit()
    if reader.error is not None:
        raise reader.error


def _time(ns: int | None, where: str) -> dt.datetime | None:
    if ns is None:
        return None
    try:
        return _EPOCH + dt.timedelta(microseconds=ns // 1000)
    except OverflowError:
        raise ImportFormatError(f"{where}: time {ns} ns is out of range") from None


def _maybe_json(v: Any) -> Any:
    """A value that may be JSON text, parsed (as the conventions allow structured values to be
    recorded as JSON strings); other text stays as it is."""
    if isinstance(v, str) and v[:1] in ("[", "{"):
        try:
            parsed = _loads(v)
        except (ValueError, RecursionError):
            return v
        # JSON text escaping half of a surrogate pair stays the text it is (which UTF-8 holds)
        return v if "\\u" in v and lone_surrogate(parsed) is not None else parsed
    return v


def _json_bytes(v: Any) -> bytes:
    return json.dumps(v, ensure_ascii=False).encode("utf-8")


def _legacy_message(m: Any, role: str) -> dict[str, Any]:
    """A message of the event-based conventions (v1.26-v1.36: ``{role, content, tool_calls,
    id}``) in the message schema of later versions (``{role, parts: [...]}``)."""
    if not isinstance(m, dict):
        m = {"content": m}
    role = str(m.get("role") or role)
    parts: list[dict[str, Any]] = []
    content = m.get("content")
    if role == "tool":
        if content is not None:
            parts.append({"type": "tool_call_response", "id": m.get("id") or m.get("tool_call_id"),
                          "response": _maybe_json(content)})
    elif isinstance(content, str):
        parts.append({"type": "text", "content": content})
    elif isinstance(content, list) and all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in content):
        parts.extend({"type": "text", "content": c["text"]} for c in content)
    elif content is not None:
        parts.append({"type": "text", "content": json.dumps(content, ensure_ascii=False)})
    calls = m.get("tool_calls")
    for tc in calls if isinstance(calls, list) else []:
        if isinstance(tc, dict):
            fn: dict[str, Any] = tc["function"] if isinstance(tc.get("function"), dict) else {}
            parts.append({"type": "tool_call", "id": tc.get("id"), "name": fn.get("name"),
                          "arguments": _maybe_json(fn.get("arguments"))})
    out: dict[str, Any] = {"role": role, "parts": parts}
    if m.get("finish_reason") is not None:
        out["finish_reason"] = m["finish_reason"]
    return out


def _event_body(ev: _Event) -> dict[str, Any]:
    """The fields of a content event: its log body, its attributes, and the JSON text some
    instrumentations put in ``gen_ai.event.content``."""
    body: dict[str, Any] = {k: v for k, v in ev.attrs.items() if k not in ("gen_ai.system", "gen_ai.event.content")}
    packed = _maybe_json(ev.attrs.get("gen_ai.event.content"))
    for extra in (packed, ev.body):
        if isinstance(extra, dict):
            body.update(extra)
        elif extra is not None:
            body.setdefault("content", extra)
    return body


def _texts(parts: Any, allowed: frozenset[str] = frozenset({"text"})) -> str | None:
    """The text of message parts when each is a text part (or of a kind in ``allowed`` that is
    not text, which is skipped); None when a part is anything else, or no text is there."""
    if not isinstance(parts, list):
        return None
    texts = []
    for p in parts:
        if not isinstance(p, dict) or p.get("type") not in allowed:
            return None
        if p.get("type") == "text":
            if not isinstance(p.get("content"), str):
                return None
            texts.append(p["content"])
    return "".join(texts) if texts else None


@dataclass
class _Content:
    """The message contents of a span."""

    input: Any = None
    output: Any = None
    system: Any = None
    consumed: set[int] = field(default_factory=set)  # indexes of the span events read here


def _content(span: _Span, events: list[_Event]) -> _Content:
    a = span.attrs
    c = _Content(_maybe_json(a.get("gen_ai.input.messages")), _maybe_json(a.get("gen_ai.output.messages")),
                 _maybe_json(a.get("gen_ai.system_instructions")))
    inputs: list[dict[str, Any]] = []
    outputs: list[dict[str, Any]] = []
    for i, ev in enumerate(events):
        if ev.name not in CONTENT_EVENTS:
            continue
        c.consumed.add(i)
        if ev.name == DETAILS_EVENT:
            c.input = c.input if c.input is not None else _maybe_json(ev.attrs.get("gen_ai.input.messages"))
            c.output = c.output if c.output is not None else _maybe_json(ev.attrs.get("gen_ai.output.messages"))
            c.system = c.system if c.system is not None else _maybe_json(ev.attrs.get("gen_ai.system_instructions"))
        elif ev.name == "gen_ai.content.prompt":
            msgs = _maybe_json(ev.attrs.get("gen_ai.prompt"))
            inputs.extend(_legacy_message(m, "user") for m in (msgs if isinstance(msgs, list) else [msgs]))
        elif ev.name == "gen_ai.content.completion":
            msgs = _maybe_json(ev.attrs.get("gen_ai.completion"))
            outputs.extend(_legacy_message(m, "assistant") for m in (msgs if isinstance(msgs, list) else [msgs]))
        elif ev.name == "gen_ai.choice":
            body = _event_body(ev)
            msg: dict[str, Any] = body["message"] if isinstance(body.get("message"), dict) else {}
            outputs.append(_legacy_message({**msg, "finish_reason": body.get("finish_reason")}, "assistant"))
        else:
            inputs.append(_legacy_message(_event_body(ev), LEGACY_ROLES[ev.name]))
    if c.input is None and inputs:
        c.input = inputs
    if c.output is None and outputs:
        c.output = outputs
    return c


def _artifact(value: Any, *, text: bool = False) -> tuple[bytes, str]:
    """Content and media type of an artifact: text as it is (``application/json`` when it is
    JSON text of an array or object, as structured values recorded as strings are), other
    values as JSON."""
    if isinstance(value, str):
        is_json = not text and isinstance(_maybe_json(value), list | dict)
        return value.encode("utf-8"), "application/json" if is_json else "text/plain"
    return _json_bytes(value), "application/json"


class _TraceUnit:
    """The rows of one trace."""

    def __init__(self, trace: _Trace, task: str | None, now: dt.datetime) -> None:
        self.trace = trace
        self.task_option = task
        self.now = now
        self.sid = PREFIX + trace.trace_id
        self.rows: dict[str, list[dict[str, Any]]] = {
            t: [] for t in ("tasks", "sessions", "nodes", "edges", "artifacts", "node_artifacts", "attributes")}
        self.hashes: set[str] = set()

    def ordered(self) -> list[_Span]:
        """Parents before children; among spans ready at once, the earliest start, then the id."""
        spans = self.trace.spans
        children: dict[str, list[_Span]] = {}
        ready: list[tuple[float, str]] = []
        for s in spans.values():
            if s.parent is not None and s.parent in spans and s.parent != s.span_id:
                children.setdefault(s.parent, []).append(s)
            elif s.parent != s.span_id:
                ready.append((_key(s), s.span_id))
        heapq.heapify(ready)
        out = []
        while ready:
            s = spans[heapq.heappop(ready)[1]]
            out.append(s)
            for c in children.get(s.span_id, ()):
                heapq.heappush(ready, (_key(c), c.span_id))
        if len(out) < len(spans):
            placed = {s.span_id for s in out}
            bad = sorted((s for s in spans.values() if s.span_id not in placed), key=lambda s: s.span_id)
            raise ImportFormatError(f"{bad[0].where}: the parentSpanId links of trace {self.trace.trace_id} form a "
                                    f"cycle (spans {', '.join(s.span_id for s in bad[:6])}); a trace is a tree")
        return out

    def add_artifact(self, node_id: str, name: str, content: bytes, media_type: str) -> None:
        h = hashlib.sha256(content).hexdigest()
        if h not in self.hashes:
            self.hashes.add(h)
            self.rows["artifacts"].append({"hash": h, "media_type": media_type, "size": len(content),
                                           "content": content})
        self.rows["node_artifacts"].append({"node_id": node_id, "name": name, "hash": h})

    def add_attr(self, scope: str, entity: str, key: str, value: Any, when: dt.datetime | None, where: str) -> None:
        """An attribute row; a value too big for an attribute goes to an artifact of that name
        (nodes), or is left out (sessions)."""
        if value is None:
            return
        problem = name_problem(key)
        if problem:
            raise ImportFormatError(f"{where}: attribute key {key!r} cannot be stored: {problem}")
        text = json.dumps(value, sort_keys=True, allow_nan=False, ensure_ascii=False)
        if len(text.encode("utf-8")) > ATTR_MAX_BYTES:
            if scope == "node":
                self.add_artifact(entity, key, *_artifact(value))
            return
        self.rows["attributes"].append({"scope": scope, "entity": entity, "key": key, "value": text,
                                        "session_id": self.sid, "event_time": when})

    def unit(self) -> Unit:
        spans = self.ordered()
        trace = self.trace
        first = spans[0]
        where = str(trace.first or first.loc)
        starts = [s.start for s in spans if s.start is not None]
        ends = [s.end for s in spans if s.end is not None]
        t0 = _time(min(starts), first.where) if starts else None

        # resource attributes the spans share describe the session; the others, each node
        shared = dict(first.resource)
        for s in spans[1:]:
            if s.resource is not first.resource:
                shared = {k: v for k, v in shared.items() if k in s.resource and s.resource[k] == v}
        task = self.task_option or self._task(spans, shared)
        agent = next((s.attrs.get("gen_ai.agent.name") for s in spans
                      if _kind_of(s.attrs) == "agent" and s.attrs.get("gen_ai.agent.name")),
                     None)
        models = {k: sorted({str(s.attrs[k]) for s in spans if s.attrs.get(k)})
                  for k in ("gen_ai.response.model", "gen_ai.request.model")}
        model = next((m[0] for m in models.values() if len(m) == 1), None)
        roots = [s for s in spans if s.parent is None or s.parent not in trace.spans]

        self.rows["tasks"].append({"id": task, "name": task, "created_at": self.now})
        self.rows["sessions"].append({
            "id": self.sid, "task_id": task, "agent": _name_or_none(agent), "model": _name_or_none(model),
            "status": "failed" if any(s.status == "error" for s in roots) else "completed",
            "created_at": self.now, "event_time": t0,
        })
        by_span = {s.span_id: s for s in spans}
        tool_results = self._tool_results(spans)
        usage: dict[str, tuple[int | None, int | None]] = {}
        for step, s in enumerate(spans, 1):
            usage[s.span_id] = self._node(s, step, task, shared, tool_results)

        # session totals: tokens of the spans no descendant of which reports usage (an agent
        # span's usage sums its model calls': counted once)
        below: dict[str, bool] = {}
        totals = [0, 0]
        counted = False
        for s in reversed(spans):
            has = usage[s.span_id] != (None, None)
            if has and not below.get(s.span_id):
                counted = True
                totals[0] += usage[s.span_id][0] or 0
                totals[1] += usage[s.span_id][1] or 0
            if s.parent is not None and s.parent in by_span and (has or below.get(s.span_id)):
                below[s.parent] = True
        kinds = [_kind_of(s.attrs) for s in spans]
        session_attrs: dict[str, Any] = {
            "spans": len(spans), "llm_calls": kinds.count("llm_call"), "tool_calls": kinds.count("tool_call"),
            "errors": sum(s.status == "error" for s in spans),
        }
        if counted:
            session_attrs["tokens_in"], session_attrs["tokens_out"] = totals
        if starts and ends and max(ends) >= min(starts):
            session_attrs["seconds"] = (max(ends) - min(starts)) / 1e9
        all_models = sorted(set(models["gen_ai.response.model"]) | set(models["gen_ai.request.model"]))
        if len(all_models) > 1:
            session_attrs["models"] = all_models
        for k, v in {**shared, **session_attrs}.items():
            self.add_attr("session", self.sid, k, v, t0, where)

        files = [trace.files[i] for i in sorted(trace.files)]
        meta = {"otel": {"trace_id": trace.trace_id, "spans": len(spans),
                         "files": files[:16] + ([f"... {len(files) - 16} more"] if len(files) > 16 else [])}}
        return Unit(name=trace.trace_id, rows={k: v for k, v in self.rows.items() if v}, where=where, meta=meta,
                    message=f"import otel trace {trace.trace_id}: {first.name}"[:200])

    def _task(self, spans: list[_Span], shared: dict[str, Any]) -> str:
        conv = next((s for s in spans if s.attrs.get("gen_ai.conversation.id") not in (None, "")), None)
        if conv is not None:
            value, what, where = conv.attrs["gen_ai.conversation.id"], "gen_ai.conversation.id", conv.where
        elif shared.get("service.name") not in (None, ""):
            value, what, where = shared["service.name"], "resource attribute service.name", spans[0].where
        else:
            return "otel"
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)  # a numeric id
        problem = name_problem(value) if isinstance(value, str) else f"is {type(value).__name__}, not a string"
        if problem:
            raise ImportFormatError(f"{where}: {what} {value!r} cannot be a task id: {problem}; pass task=")
        return str(value)

    def _tool_results(self, spans: list[_Span]) -> dict[str, Any]:
        """Tool call id -> the result a later model call was given (``tool_call_response`` parts
        of input messages), for tool spans that do not record their result."""
        out: dict[str, Any] = {}
        for s in spans:
            msgs = _maybe_json(s.attrs.get("gen_ai.input.messages"))
            for m in msgs if isinstance(msgs, list) else ():
                for p in m.get("parts") or () if isinstance(m, dict) else ():
                    if isinstance(p, dict) and p.get("type") == "tool_call_response" and isinstance(p.get("id"), str):
                        out.setdefault(p["id"], p.get("response"))
        return out

    def _node(self, s: _Span, step: int, task: str, shared: dict[str, Any],
              tool_results: dict[str, Any]) -> tuple[int | None, int | None]:
        nid = PREFIX + s.span_id
        a = s.attrs
        kind = _kind_of(a)
        when = _time(s.start, s.where)
        tokens_in = _tokens(a, ("gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"), s)
        tokens_out = _tokens(a, ("gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"), s)
        action = None
        if kind == "tool_call" and (a.get("gen_ai.tool.name") is not None or "gen_ai.tool.call.arguments" in a):
            call: dict[str, Any] = {"tool": a.get("gen_ai.tool.name")}
            if "gen_ai.tool.call.arguments" in a:
                call["arguments"] = _maybe_json(a["gen_ai.tool.call.arguments"])
            action = json.dumps(call, ensure_ascii=False)
        self.rows["nodes"].append({
            "id": nid, "session_id": self.sid, "task_id": task, "kind": kind, "step": step,
            "status": s.status, "summary": s.name, "tokens_in": tokens_in, "tokens_out": tokens_out,
            "seconds": (s.end - s.start) / 1e9 if s.start is not None and s.end is not None and s.end >= s.start else None,
            "source": "otel", "created_at": self.now, "event_time": when, "action": action,
        })
        if s.parent is not None and s.parent in self.trace.spans and s.parent != s.span_id:
            self.rows["edges"].append({"src": PREFIX + s.parent, "dst": nid, "kind": "derived_from",
                                       "session_id": self.sid, "event_time": when})

        events = sorted(s.events + self.trace.log_events.get(s.span_id, []),
                        key=lambda e: e.time if e.time is not None else -1)
        content = _content(s, events)
        if content.input is not None:
            self.add_artifact(nid, "input_messages", *_artifact(content.input))
        if content.output is not None:
            self.add_artifact(nid, "output_messages", *_artifact(content.output))
        if content.system is not None:
            self.add_artifact(nid, "system_instructions", *_artifact(content.system))
        if kind == "llm_call":
            for name, text in _training_texts(content).items():
                self.add_artifact(nid, name, text.encode("utf-8"), "text/plain")
        if kind == "tool_call":
            result = a.get("gen_ai.tool.call.result")
            if result is None and isinstance(a.get("gen_ai.tool.call.id"), str):
                result = tool_results.get(a["gen_ai.tool.call.id"])
            if result is not None:
                self.add_artifact(nid, "observation", *_artifact(result))
        for key in ("gen_ai.prompt", "gen_ai.completion"):  # deprecated span attributes of content
            if a.get(key) is not None:
                self.add_artifact(nid, key.removeprefix("gen_ai."), *_artifact(a[key], text=True))

        attrs = {k: v for k, v in s.resource.items() if k not in shared or shared[k] != v}
        attrs.update({k: _maybe_json(v) if k in STRUCTURED_KEYS else v for k, v in a.items() if k not in CONTENT_KEYS})
        extra = {
            "otel.span_kind": s.kind if s.kind != "unspecified" else None,
            "otel.status_description": s.status_message,
            "otel.scope.name": s.scope.get("name") or None,
            "otel.scope.version": s.scope.get("version") or None,
            "parent_span_missing": s.parent if s.parent is not None and s.parent not in self.trace.spans else None,
            "otel.events": [_event_json(e, s.where) for i, e in enumerate(events) if i not in content.consumed] or None,
            "otel.links": s.links or None,
        }
        attrs.update({k: v for k, v in extra.items() if v is not None})
        for k, v in attrs.items():
            self.add_attr("node", nid, k, v, when, s.where)
        return tokens_in, tokens_out


def _key(s: _Span) -> float:
    return float(s.start) if s.start is not None else math.inf


def _name_or_none(v: Any) -> str | None:
    return v if isinstance(v, str) and not name_problem(v) else None


def _tokens(a: dict[str, Any], keys: tuple[str, ...], s: _Span) -> int | None:
    for k in keys:
        v = a.get(k)
        if v is None:
            continue
        if isinstance(v, str) and v.strip().isascii() and v.strip().isdigit():
            v = int(v)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= INT64_MAX:
            raise ImportFormatError(f"{s.where}: {k} must be a whole number >= 0 (below 2**63), got {_short(v)}")
        return v
    return None


def _event_json(e: _Event, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": e.name}
    at = _time(e.time, where)
    if at is not None:
        out["time"] = at.isoformat().replace("+00:00", "Z")
    if e.attrs:
        out["attributes"] = e.attrs
    if e.body is not None:
        out["body"] = e.body
    return out


def _training_texts(c: _Content) -> dict[str, str]:
    """``prompt``, ``response`` and ``system_prompt`` texts of a model call, where the messages say
    them plainly: the input is user text (after system text), the first output choice is text
    (reasoning parts skipped). A conversation with tool calls or media keeps only its
    ``input_messages`` / ``output_messages``."""
    out: dict[str, str] = {}
    sys_texts = [] if c.system is None else [c.system if isinstance(c.system, str) else _texts(c.system)]
    inputs = c.input if isinstance(c.input, list) and all(isinstance(m, dict) for m in c.input) else None
    if inputs is not None:
        n = next((i for i, m in enumerate(inputs) if m.get("role") != "system"), len(inputs))
        sys_texts += [_texts(m.get("parts")) for m in inputs[:n]]
        rest = inputs[n:]
        if rest and all(m.get("role") == "user" for m in rest):
            texts = [_texts(m.get("parts")) for m in rest]
            if all(t is not None for t in texts):
                out["prompt"] = "\n\n".join(t for t in texts if t is not None)
    if sys_texts and all(t is not None for t in sys_texts):
        out["system_prompt"] = "\n\n".join(t for t in sys_texts if t is not None)
    outputs = c.output if isinstance(c.output, list) else None
    if outputs and isinstance(outputs[0], dict):
        text = _texts(outputs[0].get("parts"), frozenset({"text", "reasoning"}))
        if text is not None:
            out["response"] = text
    return out

