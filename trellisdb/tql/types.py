"""Static types of resolved TQL expressions, so that type errors name the TQL text.

Types are coarse, the ones a user reasons with: ``number``, ``text``,
``bool``, ``time``, ``list``, plus ``null`` (a NULL literal or a parameter
bound to None, compatible with everything). A mismatch raises
:class:`~trellisdb.errors.QueryTypeError` with the line and column of the
offending expression (and, as data, its ``span``) instead of a DuckDB binder
error on the compiled SQL::

    >>> from trellisdb.tql.parser import parse
    >>> where = parse("NODES WHERE status > 3").statement.where
    >>> check(where, {"status": "text"}.get)
    Traceback (most recent call last):
    ...
    trellisdb.errors.QueryTypeError: cannot compare status (text) with 3 (number) (line 1, column 13); ...
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import assert_never

import pyarrow as pa

from trellisdb.errors import QueryTypeError
from trellisdb.tql import ast as A
from trellisdb.tql.show import show

#: A column's type by name (None: not a column of this statement).
ColumnTypes = Callable[[str], str | None]

NULL = "null"

#: Result types of functions; "arg" means the type of the first non-null argument.
_RESULT = {
    "reward": "number", "ucb": "number", "abs": "number", "ln": "number", "log10": "number", "sqrt": "number",
    "exp": "number", "power": "number", "round": "number", "floor": "number", "ceil": "number",
    "length": "number", "lower": "text", "upper": "text", "contains": "bool", "starts_with": "bool",
    "least": "arg", "greatest": "arg", "coalesce": "arg", "has_label": "bool", "quarantined": "bool",
    "attr_number": "number", "attr_text": "text", "attr_bool": "bool",
}
#: What the arguments must be (None: any; "same": all alike).
_ARGS = {
    "ucb": "number", "abs": "number", "ln": "number", "log10": "number", "sqrt": "number", "exp": "number",
    "power": "number", "round": "number", "floor": "number", "ceil": "number", "lower": "text", "upper": "text",
    "length": "text", "contains": "text", "starts_with": "text", "least": "same", "greatest": "same",
    "coalesce": "same",
}


def arrow_type(t: pa.DataType) -> str:
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        return "time"
    return "list" if pa.types.is_list(t) or pa.types.is_fixed_size_list(t) else "any"


def literal_type(v: object) -> str:
    if v is None:
        return NULL
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, dt.datetime | dt.date):
        return "time"
    return "text"


def _where(e: A.Expr) -> str:
    s = e.span
    return f" (line {s.line}, column {s.column})" if s.line else ""


def _time_text(e: A.Expr, t: str, other: str) -> None:
    """A text literal compared with a time must be an ISO time (DuckDB would fail at run time, far from the text)."""
    if other == "time" and t == "text" and isinstance(e, A.Literal) and isinstance(e.value, str):
        try:
            dt.datetime.fromisoformat(e.value)
        except ValueError:
            raise _fail(f"{show(e)} is not a time", e, "write times in ISO form, e.g. '2026-01-31' or "
                        "'2026-01-31T12:00:00+00:00'") from None


def _alike(a: str, b: str) -> bool:
    # text compares with time: DuckDB reads an ISO string as a timestamp
    return NULL in (a, b) or "any" in (a, b) or a == b or {a, b} == {"text", "time"}


def _fail(what: str, e: A.Expr, hint: str) -> QueryTypeError:
    return QueryTypeError(f"{what}{_where(e)}; {hint}", span=A.place(e.span))


def typeof(e: A.Expr, columns: ColumnTypes) -> str:
    """The type of resolved expression ``e``; raises on a mismatch inside it."""
    match e:
        case A.Literal():
            return literal_type(e.value)
        case A.Param():  # pragma: no cover - resolved expressions hold literals
            return "any"
        case A.Column():
            return columns(e.name) or "any"
        case A.Neg():
            _need(e.operand, "number", columns, "a minus sign applies to numbers")
            return "number"
        case A.Not():
            _need(e.operand, "bool", columns, "NOT applies to a condition")
            return "bool"
        case A.IsNull():
            typeof(e.operand, columns)
            return "bool"
        case A.BoolOp():
            for side in e.operands:
                _need(side, "bool", columns, f"every side of {e.op} must be a condition, e.g. x > 1 {e.op} y = 'a'")
            return "bool"
        case A.Binary():
            if e.op in ("AND", "OR"):
                for side in (e.left, e.right):
                    _need(side, "bool", columns, f"both sides of {e.op} must be conditions, e.g. x > 1 {e.op} y = 'a'")
                return "bool"
            lt, rt = typeof(e.left, columns), typeof(e.right, columns)
            if e.op in ("+", "-", "*", "/", "%"):
                for side, t in ((e.left, lt), (e.right, rt)):
                    if not _alike(t, "number"):
                        raise _fail(f"{show(side)} is {t}, not a number, in {show(e)}", side,
                                    "arithmetic takes numbers (columns such as step, usd, reward('...'))")
                return "number"
            if not _alike(lt, rt):
                raise _fail(f"cannot compare {show(e.left)} ({lt}) with {show(e.right)} ({rt})", e,
                            f"compare {lt} with {lt}, e.g. {_example(lt)}")
            _time_text(e.left, lt, rt)
            _time_text(e.right, rt, lt)
            return "bool"
        case A.InList():
            t = typeof(e.operand, columns)
            for item in e.items:
                it = typeof(item, columns)
                if not _alike(t, it):
                    raise _fail(f"{show(item)} ({it}) cannot be in a list matched against {show(e.operand)} ({t})",
                                item, f"the list must hold {t} values")
                _time_text(item, it, t)
            return "bool"
        case A.Between():
            t = typeof(e.operand, columns)
            for bound in (e.low, e.high):
                bt = typeof(bound, columns)
                if not _alike(t, bt):
                    raise _fail(f"cannot compare {show(e.operand)} ({t}) with {show(bound)} ({bt})", bound,
                                f"BETWEEN bounds must be {t}s too")
                _time_text(bound, bt, t)
            return "bool"
        case A.Call():
            if e.name == "attr":  # its type is the attribute's, which the statement's column types know
                return columns(show(e)) or "any"
            types = [typeof(a, columns) for a in e.args]
            want = _ARGS.get(e.name)
            if want == "same":
                known = [t for t in types if t not in (NULL, "any")]
                for a, t in zip(e.args, types, strict=True):
                    if known and not _alike(t, known[0]):
                        raise _fail(f"{e.name}() mixes {known[0]} and {t} ({show(a)})", a,
                                    "give it arguments of one type")
            elif want is not None:
                for a, t in zip(e.args, types, strict=True):
                    if not _alike(t, want):
                        raise _fail(f"{e.name}() takes {want} arguments; {show(a)} is {t}", a,
                                    f"pass a {want} column or value")
            result = _RESULT.get(e.name, "any")
            if result == "arg":
                return next((t for t in types if t not in (NULL, "any")), "any")
            return result
        case A.AggCall():
            if e.arg is None:
                return "number"
            if e.func in ("sum", "avg"):
                t = typeof(e.arg, columns)
                if not _alike(t, "number") and t != "bool":
                    raise _fail(f"{e.func}() takes numbers (or a condition: it then counts or averages where it "
                                f"holds); {show(e.arg)} is {t}", e.arg,
                                "pass a number column or value, e.g. "
                                f"{e.func}(usd), or count(DISTINCT {show(e.arg)}) to count its values")
                return "number"
            t = typeof(e.arg, columns)
            return "number" if e.func == "count" else t
        case _:
            assert_never(e)


def _need(e: A.Expr, want: str, columns: ColumnTypes, hint: str) -> None:
    t = typeof(e, columns)
    if not _alike(t, want):
        raise _fail(f"{show(e)} is {t}, not {'a condition' if want == 'bool' else 'a ' + want}", e, hint)


def _example(t: str) -> str:
    return {"number": "step > 3", "text": "status = 'pending'", "time": "created_at > '2026-01-01'",
            "bool": "(step > 3) = true"}.get(t, "a value of the same type")


def check(e: A.Expr, columns: ColumnTypes) -> str:
    """Type-check expression ``e``; returns its type."""
    return typeof(e, columns)


def check_condition(e: A.Expr, columns: ColumnTypes, clause: str) -> None:
    """``e`` must be a condition (bool), as in WHERE or EXPANDED WHEN."""
    t = typeof(e, columns)
    if not _alike(t, "bool"):
        raise _fail(f"{clause} needs a condition, but {show(e)} is {t}", e,
                    f"compare it, e.g. {clause} {show(e)} > 0.5" if t == "number" else f"e.g. {clause} {_example(t)}")
