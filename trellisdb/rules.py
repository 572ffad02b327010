"""The value rules every write obeys, stated once.

Two paths write rows: the session writer (``writer.py``) checks one value at
the call that brings it, and bulk ingest (``bulk.py``) checks whole Arrow
columns at once. Both read here which columns a rule covers and the error it
raises. A rule's message has two phrasings, kept side by side in one
:class:`Rule`: ``at_call`` names the value in the caller's words (``"cost
seconds"``), ``in_table`` names the table and column (``"nodes.seconds"``)::

    >>> NEGATIVE.in_table.format(table="nodes", column="seconds", value=-1.0)
    'nodes.seconds holds -1.0; it must be finite and >= 0'
    >>> check_number("nodes", "seconds", -1.0, "cost seconds")
    Traceback (most recent call last):
    ...
    trellisdb.errors.ValidationError: cost seconds must be >= 0.0, got -1.0

Strings are the exception: ``names.py`` holds the name and text rules (one
value: ``check_name``; a column: ``bad_names``), and :data:`NAME_COLUMNS` says
which columns they cover.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from trellisdb.errors import EmbeddingDimensionError, InvalidRewardError, ValidationError
from trellisdb.names import check_text
from trellisdb.schema import DATA_TABLES, EDGE_KINDS, table_schema

__all__ = [
    "COST_FIELDS", "EDGE_KINDS", "FINITE", "INT64_MAX", "NAME_COLUMNS", "NOT_NEGATIVE", "Rule",
    "check_edge_kind", "check_embedding", "check_number", "config_text",
]

# --------------------------------------------------------------- which columns


#: The columns of each table that hold names (``trellisdb/names.py``): ingest checks them whole,
#: the write API checks each value at its call.
NAME_COLUMNS: dict[str, tuple[str, ...]] = {
    "tasks": ("id", "tags"),
    "sessions": ("id", "task_id", "agent", "model", "status"),
    "nodes": ("id", "session_id", "task_id", "kind", "status"),
    "edges": ("src", "dst", "kind", "session_id"),
    "artifacts": ("hash", "media_type"),
    "node_artifacts": ("node_id", "name", "hash"),
    "rewards": ("node_id", "channel", "verifier", "verifier_version"),
    "comparisons": ("id", "a", "b", "preferred", "judge"),
    "attributes": ("scope", "entity", "key", "session_id"),
    "labels": ("node_id", "label", "session_id"),
}

#: What an attribute may describe (``attributes.scope``).
ATTRIBUTE_SCOPES: tuple[str, ...] = ("node", "session", "task")

#: The fields of a node's ``cost`` (``add_node(cost={...})``): each is a column of ``nodes``.
COST_FIELDS: tuple[str, ...] = ("tokens_in", "tokens_out", "seconds", "usd")

#: Numeric columns that count or measure something: never negative (and finite, for floats).
NOT_NEGATIVE: dict[str, tuple[str, ...]] = {"nodes": ("step", *COST_FIELDS)}

#: Float columns that may be negative but must be finite. ``rewards.value`` is finite too,
#: under its own rule and error (:data:`REWARD_NOT_FINITE`, ``InvalidRewardError``).
FINITE: dict[str, tuple[str, ...]] = {"comparisons": ("margin",)}

#: The range of the int64 columns (steps, token counts).
INT64_MAX = 2**63 - 1

#: The stored type of every column, for :func:`check_number` (the embedding dimension is irrelevant here).
_TYPES: dict[str, dict[str, pa.DataType]] = {t: {f.name: f.type for f in table_schema(t, 1)} for t in DATA_TABLES}


# --------------------------------------------------------------- the messages


@dataclass(frozen=True)
class Rule:
    """One rule's error: its class and its message, as a call states it (``at_call``, one value
    named in the caller's words) and as ingest states it (``in_table``, a row of a table; empty
    where ingest has no such check). Both are ``str.format`` templates."""

    error: type[ValidationError]
    at_call: str
    in_table: str = ""

    def call(self, **values: object) -> ValidationError:
        """The error a write call raises."""
        return self.error(self.at_call.format(**values))

    def table(self, **values: object) -> ValidationError:
        """The error ingest raises."""
        assert self.in_table, "this rule has no table phrasing"
        return self.error(self.in_table.format(**values))


_KINDS = ", ".join(EDGE_KINDS)

NOT_AN_INTEGER = Rule(ValidationError, "{what} must be an integer, got {type} {value!r}")
OUT_OF_RANGE = Rule(ValidationError, "{what} must be a whole number in [{minimum}, 2**63 - 1], got {value}")
NOT_A_NUMBER = Rule(ValidationError, "{what} must be a number, got {type} {value!r}")
NOT_FINITE = Rule(ValidationError, "{what} must be finite, got {value!r}",
                  "{table}.{column} holds NaN or an infinity; {column}s are finite")
#: A count or measure (:data:`NOT_NEGATIVE`) below zero; ingest states it for non-finite values too.
NEGATIVE = Rule(ValidationError, "{what} must be >= {minimum}, got {value!r}",
                "{table}.{column} holds {value!r}; it must be finite and >= 0")

UNKNOWN_COST_FIELD = Rule(ValidationError, f"unknown cost field(s) {{fields}}; use {', '.join(COST_FIELDS)}")

UNKNOWN_EDGE_KIND = Rule(ValidationError, f"unknown edge kind {{kind!r}}; use one of {_KINDS}",
                         f"edge {{src!r}} -> {{dst!r}} has unknown kind {{kind!r}}; use one of {_KINDS}")
_LOOP = "edge {src!r} -> {dst!r} is a self-loop; lineage edges join two different nodes"
SELF_LOOP = Rule(ValidationError, _LOOP, _LOOP)

SAME_NODES = Rule(ValidationError, "comparison of {a!r} with itself; a comparison judges two different nodes",
                  "comparison {id!r} compares {a!r} with itself")
NOT_PREFERRED = Rule(ValidationError, "preferred {preferred!r} must be {a!r}, {b!r} or None (a tie)",
                     "comparison {id!r}: preferred {preferred!r} must be {a!r}, {b!r} or null (a tie)")

_REWARD = "reward {channel!r} of node {node_id!r} is {value!r}; rewards must be finite"
REWARD_NOT_A_NUMBER = Rule(InvalidRewardError,
                           "reward {channel!r} of node {node_id!r} must be a number, got {type} {value!r}")
REWARD_NOT_FINITE = Rule(InvalidRewardError,
                         _REWARD + " (record a failed evaluation as a status, or as a separate channel)", _REWARD)

EMBEDDING_DIMENSION = Rule(
    EmbeddingDimensionError,
    "{what} has dimension {got}, but this database's embedding space has dimension {dim}",
    "{table}.{column} has vectors of dimension {got}; this database's dimension is {dim}",
)
_NAN = "contains NaN or infinite values"
EMBEDDING_NOT_FINITE = Rule(
    ValidationError,
    "{what} " + _NAN + " (or values beyond float32's range, |x| > 3.4e38: embeddings are stored as float32)",
    "{table}.{column} " + _NAN,
)


# --------------------------------------------------------------- one value


def check_number(table: str, column: str, value: object, what: str) -> Any:
    """``value`` as column ``table.column`` stores it (int or float; None stays None), by the
    rules declared above: int64 range, :data:`NOT_NEGATIVE`, finite floats. ``what`` names it."""
    if value is None:
        return None
    floating = pa.types.is_floating(_TYPES[table][column])
    minimum = 0 if column in NOT_NEGATIVE.get(table, ()) else None
    if not floating:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise NOT_AN_INTEGER.call(what=what, type=type(value).__name__, value=value)
        v = int(value)
        low = -INT64_MAX - 1 if minimum is None else minimum
        if not low <= v <= INT64_MAX:
            raise OUT_OF_RANGE.call(what=what, minimum=low, value=v)
        return v
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise NOT_A_NUMBER.call(what=what, type=type(value).__name__, value=value)
    try:
        f = float(value)
    except OverflowError:
        raise NOT_FINITE.call(what=what, value=value) from None
    if not math.isfinite(f) and (minimum is not None or column in FINITE.get(table, ())):
        raise NOT_FINITE.call(what=what, value=f)
    if minimum is not None and f < minimum:
        raise NEGATIVE.call(what=what, minimum=float(minimum), value=f)
    return f


def check_edge_kind(kind: object) -> None:
    if kind not in EDGE_KINDS:
        raise UNKNOWN_EDGE_KIND.call(kind=kind)


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
        raise EMBEDDING_DIMENSION.call(what=what, got=len(vec), dim=dim)
    if not np.isfinite(vec).all():
        raise EMBEDDING_NOT_FINITE.call(what=what)
    out: list[float] = vec.tolist()
    return out


def config_text(config: Mapping[str, Any] | str | None) -> str | None:
    """A session config as the JSON text stored: a mapping is serialized (keys sorted), a string
    must be JSON already. NaN, infinities and objects JSON has no form for are refused.

    The same code for both paths: ingest runs it on each session's config."""
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
    return check_text(_json_text(config, "session config"), "session config")


def _json_text(value: object, what: str, string_keys: bool = False) -> str:
    """``value`` as JSON text (keys sorted), or a ValidationError naming ``what``; with
    ``string_keys``, a key that is not a string is refused (json.dumps would turn 1, True or
    None into a string key silently)."""
    try:
        if string_keys:
            _string_keys(value)
        return json.dumps(value, sort_keys=True, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValidationError(
            f"{what} must hold only JSON values (strings, finite numbers, booleans, null, lists and "
            f"mappings with string keys): {e}"
        ) from None


#: The most bytes a commit's metadata may take as JSON: it lives in the commit log, which every
#: reader reads whole (run-level state, not data: rows go in the tables).
META_MAX_BYTES = 64 * 1024


def commit_meta(meta: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A commit's metadata checked: a mapping of JSON values (string keys, finite numbers), at
    most ``META_MAX_BYTES`` as JSON; returned as the plain JSON value stored (None if empty).

    >>> commit_meta({"best_program_id": "p7", "island_generations": [3, 4]})
    {'best_program_id': 'p7', 'island_generations': [3, 4]}
    """
    if meta is None:
        return None
    if not isinstance(meta, Mapping):
        raise ValidationError(f"commit meta must be a mapping (a dict of JSON values), got {type(meta).__name__}")
    text = _json_text(meta, "commit meta", string_keys=True)
    check_text(text, "commit meta")
    if len(text.encode()) > META_MAX_BYTES:
        raise ValidationError(
            f"commit meta is {len(text.encode()):,} bytes as JSON; at most {META_MAX_BYTES:,} are kept in the "
            "commit log. Store bulky run state as an artifact of a node and name its hash here"
        )
    value: dict[str, Any] = json.loads(text)
    return value or None


def _string_keys(value: object) -> None:
    """TypeError at a mapping key that is not a string, at any depth."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, Mapping):
            bad = [k for k in v if not isinstance(k, str)]
            if bad:
                raise TypeError(f"key {bad[0]!r} is not a string")
            stack.extend(v.values())
        elif isinstance(v, list | tuple):
            stack.extend(v)


#: The most bytes one attribute value may take as JSON (bulky values are artifacts).
ATTR_MAX_BYTES = 64 * 1024


def attribute_value(key: str, value: object) -> dict[str, Any]:
    """The stored columns of attribute ``key`` = ``value``: ``value`` (JSON text), ``num``
    (numbers, not booleans), ``text`` (strings), ``retracted``. ``None`` retracts the key.

    >>> attribute_value("island", 2)
    {'value': '2', 'num': 2.0, 'text': None, 'retracted': False}
    >>> attribute_value("cell", "a")["text"], attribute_value("gone", None)["retracted"]
    ('a', True)
    """
    if value is None:
        return {"value": None, "num": None, "text": None, "retracted": True}
    what = f"attribute {key!r}"
    text = _json_text(value, what, string_keys=True)
    check_text(text, what)
    if len(text.encode()) > ATTR_MAX_BYTES:
        raise ValidationError(
            f"{what} is {len(text.encode()):,} bytes as JSON; at most {ATTR_MAX_BYTES:,} are kept per attribute. "
            "Store bulky values as an artifact of the node"
        )
    num = float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None
    return {"value": text, "num": num, "text": value if isinstance(value, str) else None, "retracted": False}


def event_time(value: object, what: str = "at") -> dt.datetime | None:
    """An event time as stored (UTC): a timezone-aware ``datetime``, seconds since the Unix
    epoch (int or float), or ISO-8601 text with an offset (``Z`` allowed). A time without a
    timezone is refused: it would mean different instants on different machines.

    >>> event_time(0)
    datetime.datetime(1970, 1, 1, 0, 0, tzinfo=datetime.timezone.utc)
    >>> event_time("2026-12-01T10:00:00Z").hour
    10
    """
    if value is None:
        return None
    if isinstance(value, str):
        check_text(value, what)
        try:
            value = dt.datetime.fromisoformat(value)
        except ValueError:
            raise ValidationError(
                f"{what} {value!r} is not an ISO-8601 time; write e.g. '2026-12-01T10:00:00Z'"
            ) from None
    if isinstance(value, dt.datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValidationError(
                f"{what} {value.isoformat()!r} has no timezone; give one (e.g. datetime.timezone.utc, or 'Z')"
            )
        try:
            t = value.astimezone(dt.UTC)
        except OverflowError:
            raise ValidationError(f"{what} {value.isoformat()!r} is outside the years 1-9999 in UTC") from None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        f = float(value)
        if not math.isfinite(f):
            raise ValidationError(f"{what} must be a finite number of seconds, got {value!r}")
        try:
            t = dt.datetime.fromtimestamp(f, dt.UTC)
        except (OverflowError, OSError, ValueError):
            raise ValidationError(f"{what} = {value!r} seconds is outside the years 1-9999") from None
    else:
        raise ValidationError(
            f"{what} must be a timezone-aware datetime, seconds since the epoch, or ISO-8601 text; "
            f"got {type(value).__name__}"
        )
    return t
