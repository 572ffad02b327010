"""The rules for every string that reaches disk, checked at the call that brings it.

Two kinds of string are stored:

- a **name** (an id, a tag, a channel, a kind, a status, a role, a view, a
  space, a judge, a verifier, ...): valid UTF-8, not empty, at most
  ``MAX_NAME_BYTES`` bytes, and without control characters (``\\x00``-``\\x1f``,
  ``\\x7f``-``\\x9f``), line or paragraph separators, or the bidirectional
  overrides that make a name print as another;
- a **text** (a summary, a spec, a config, a commit message, an artifact
  given as ``str``): any valid UTF-8.

Python strings can hold what UTF-8 cannot (a lone surrogate such as
``'\\ud800'``); such a string accepted at a call would fail only when its
batch is committed, or, in the commit log, at every later read. A
``ValidationError`` naming the field is raised instead::

    >>> check_name("kern-7", "session id")
    'kern-7'
    >>> check_name("", "reward channel")
    Traceback (most recent call last):
    ...
    trellisdb.errors.ValidationError: reward channel must not be empty (got '')
    >>> check_name("a\\tb", "tag name")
    Traceback (most recent call last):
    ...
    trellisdb.errors.ValidationError: tag name 'a\\tb' contains the control character U+0009; names are printable text
    >>> check_text("\\ud800", "summary")
    Traceback (most recent call last):
    ...
    trellisdb.errors.ValidationError: summary is not valid UTF-8 text (a lone surrogate at position 0: U+D800)

``bad_names`` applies the name rules to a whole Arrow column at once (bulk
ingest).

Labels and attribute keys starting with ``trellis:`` (``SYSTEM_PREFIX``) belong to trellisdb
itself: ``trellis:quarantined`` marks a quarantined node (``docs/data-model.md``, Trust), and only
``quarantine`` / ``release`` write it. A caller's label, unlabel, attribute or ingest naming one is
refused (``check_not_reserved``, ``reserved_names``)::

    >>> check_not_reserved("trellis:quarantined", "label")
    Traceback (most recent call last):
    ...
    trellisdb.errors.ValidationError: label 'trellis:quarantined' is reserved: names starting 'trellis:' belong to trellisdb (quarantine a node with db.quarantine(ids, reason=...), release it with db.release(ids))
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import ValidationError

#: The longest name, in UTF-8 bytes. Ids of real runs are UUIDs or paths of a
#: few dozen characters; a name is a key, not a document.
MAX_NAME_BYTES = 512

#: Characters no name may hold: C0 and C1 controls, line and paragraph separators,
#: and the bidirectional embeddings, overrides and isolates.
_FORBIDDEN = "\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"
_FORBIDDEN_RE = re.compile(f"[{_FORBIDDEN}]")
#: The same class for Arrow's RE2 (which takes ``\\x{...}`` escapes).
_FORBIDDEN_RE2 = r"[\x{0}-\x{1f}\x{7f}-\x{9f}\x{2028}\x{2029}\x{202a}-\x{202e}\x{2066}-\x{2069}]"

#: Labels and attribute keys starting with this belong to trellisdb: callers may not write them.
SYSTEM_PREFIX = "trellis:"
#: The label of a quarantined node (a held write, or one found poisoned): RETRIEVE, FRONTIER and
#: the training views leave such nodes out unless asked (``INCLUDE QUARANTINED``).
QUARANTINED = "trellis:quarantined"
#: The node attribute holding why a node was quarantined (JSON text; retracted on release).
QUARANTINE_REASON = "trellis:quarantine_reason"
#: The session attribute naming who opened the session (its writer's provenance, when it named
#: one): a served store's agents may write only the sessions their token opened.
SESSION_PROVENANCE = "trellis:provenance"
_RESERVED_HINT = ("names starting 'trellis:' belong to trellisdb (quarantine a node with db.quarantine(ids, "
                  "reason=...), release it with db.release(ids))")


def surrogate_at(value: str) -> int | None:
    """Where the first character of ``value`` that UTF-8 cannot hold (a lone surrogate) is; None
    when there is none."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return int(e.start)
    return None


def utf8_problem(value: str) -> str | None:
    """Why ``value`` cannot be written as UTF-8 (None: it can)."""
    at = surrogate_at(value)
    return None if at is None else f"a lone surrogate at position {at}: U+{ord(value[at]):04X}"


def value_problem(value: object) -> str | None:
    """Why a caller's value (a query parameter: a string, or strings inside lists, tuples and
    dicts, keys included) cannot be handed on as UTF-8, naming where; None when it can.

    >>> value_problem(["ok", {"k": 3}]) is None
    True
    >>> value_problem(["ok", {"k": "x" + chr(0xD800)}])
    "[1]['k']: a lone surrogate at position 1: U+D800"
    """
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            problem = utf8_problem(v)
            if problem:
                return f"{where}: {problem}" if where else problem
        elif isinstance(v, list | tuple):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                if isinstance(k, str) and (problem := utf8_problem(k)):
                    return f"{where + ': ' if where else ''}the key '{printable(k)}': {problem}"
                stack.append((f"{where}[{k!r}]", x))
    return None


def printable(value: str) -> str:
    """``value`` as a message can hold it: what UTF-8 cannot hold (a lone surrogate) written as its
    escape, ``\\ud800``; any other text as it is.

    >>> print(printable("a" + chr(0xD800) + "b"))
    a\\ud800b
    """
    return value if surrogate_at(value) is None else value.encode("utf-8", "backslashreplace").decode("utf-8")


def check_text(value: object, what: str, *, optional: bool = True) -> str | None:
    """``value`` if it is a string that UTF-8 can hold (or None, when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValidationError(f"{what} must be a string, got {type(value).__name__} {value!r}")
    problem = utf8_problem(value)
    if problem:
        raise ValidationError(f"{what} is not valid UTF-8 text ({problem})")
    return value


def check_name(value: object, what: str, *, optional: bool = False) -> str | None:
    """``value`` if it is an acceptable name (or None, when ``optional``); see the module notes."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValidationError(f"{what} must be a string, got {type(value).__name__} {value!r}")
    if not value:
        raise ValidationError(f"{what} must not be empty (got '')")
    problem = utf8_problem(value)
    if problem:
        raise ValidationError(f"{what} {value!r} is not valid UTF-8 ({problem}); names are text")
    if len(value) * 4 > MAX_NAME_BYTES and len(value.encode("utf-8")) > MAX_NAME_BYTES:
        raise ValidationError(
            f"{what} is {len(value.encode('utf-8'))} bytes long ({value[:40]!r}...); names are at most "
            f"{MAX_NAME_BYTES} bytes: put long text in a summary, spec or artifact"
        )
    m = _FORBIDDEN_RE.search(value)
    if m:
        raise ValidationError(
            f"{what} {value!r} contains the control character U+{ord(m.group()):04X}; names are printable text"
        )
    return value


def name_problem(value: str) -> str | None:
    """Why the stored string ``value`` is not an acceptable name (None: it is)."""
    try:
        check_name(value, "name")
    except ValidationError as e:
        return str(e).removeprefix("name ")
    return None


def bad_names(column: pa.ChunkedArray | pa.Array, what: str) -> None:
    """Raise for the first value of a string ``column`` that breaks the name rules (nulls pass):
    vectorized, for whole tables."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        column = pc.list_flatten(column)
    if not len(column) or column.null_count == len(column):
        return
    try:
        column.validate(full=True)  # UTF-8 of every value
    except pa.ArrowInvalid as e:
        raise ValidationError(f"{what} holds a value that is not valid UTF-8 ({e}); names are text") from None
    bad = pc.or_kleene(
        pc.or_kleene(pc.equal(pc.binary_length(column), 0), pc.greater(pc.binary_length(column), MAX_NAME_BYTES)),
        pc.match_substring_regex(column, _FORBIDDEN_RE2),
    )
    if pc.any(bad).as_py():
        first = pc.filter(column, bad)[0].as_py()
        check_name(first, what)  # raises with the value's own reason


def check_not_reserved(value: str, what: str) -> None:
    """Refuse a label or attribute key of trellisdb's own (``SYSTEM_PREFIX``) given by a caller."""
    if value.startswith(SYSTEM_PREFIX):
        raise ValidationError(f"{what} {value!r} is reserved: {_RESERVED_HINT}")


def reserved_names(column: pa.ChunkedArray | pa.Array, what: str) -> None:
    """``check_not_reserved`` over a whole string column (bulk ingest; nulls pass)."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not len(column) or column.null_count == len(column):
        return
    bad = pc.starts_with(column, pattern=SYSTEM_PREFIX)
    if pc.any(bad).as_py():
        check_not_reserved(pc.filter(column, bad)[0].as_py(), what)


def did_you_mean(name: str, options: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the option closest to a mistyped ``name`` (empty if none is close):
    the one place every "unknown name" error gets its suggestion."""
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def known(what: str, options: Iterable[str], limit: int = 12) -> str:
    """``"; <what>: 'a', 'b', ..."``: the names that do exist, for an error message."""
    opts = sorted(options)
    if not opts:
        return f"; there are no {what} yet"
    more = f", ... ({len(opts)} in all)" if len(opts) > limit else ""
    return f"; {what}: {', '.join(repr(o) for o in opts[:limit])}{more}"
