"""TQL abstract syntax: frozen dataclasses, each carrying its source span.

:class:`ToAst` turns a lark parse tree into these nodes; it has one handler
per grammar rule (``tests/test_tql_parse.py`` checks that none is missing).

>>> from trellisdb.tql.parser import parse
>>> q = parse("NODES WHERE step > 2 LIMIT 5")
>>> type(q.statement).__name__, q.statement.limit
('Select', Literal(value=5, span=Span(start=27, end=28, line=1, column=28)))
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass
from typing import Any

from lark import Token, Transformer, v_args

from trellisdb.errors import QueryError, QuerySyntaxError
from trellisdb.errors import Span as Span  # re-exported: every node carries one

NO_SPAN = Span(0, 0, 0, 0)


def place(span: Span) -> Span | None:
    """``span`` for an error to carry, None for :data:`NO_SPAN` (a node the query text did not write)."""
    return span if span.line else None


# ------------------------------------------------------------------ expressions
@dataclass(frozen=True)
class Literal:
    value: str | int | float | bool | dt.datetime | dt.date | None
    span: Span = NO_SPAN


@dataclass(frozen=True)
class Param:
    name: str
    span: Span = NO_SPAN


@dataclass(frozen=True)
class Column:
    name: str
    span: Span = NO_SPAN


@dataclass(frozen=True)
class Call:
    name: str
    args: tuple[Expr, ...]
    span: Span = NO_SPAN


#: The aggregate functions: count(*), count(x), sum(x), avg(x), min(x), max(x), each also with DISTINCT.
AGGREGATES = ("count", "sum", "avg", "min", "max")


@dataclass(frozen=True)
class AggCall:
    """An aggregate over the rows of a group: ``count(*)`` (``arg`` None), ``count(x)``,
    ``sum(x)``, ``avg(x)``, ``min(x)``, ``max(x)``; ``distinct``: over the distinct values of ``x``.

    ``arg_type`` is filled by the resolver, for the compiler: ``int`` (a whole-number
    argument: sum and avg are exact), ``bool`` (a condition: sum counts where it holds, avg is
    the share of rows where it holds), or empty (fractions: compensated summation)."""

    func: str
    arg: Expr | None
    distinct: bool = False
    span: Span = NO_SPAN
    arg_type: str = ""


@dataclass(frozen=True)
class Neg:
    operand: Expr
    span: Span = NO_SPAN


@dataclass(frozen=True)
class Binary:
    """Arithmetic (``+ - * / %``) or comparison (``= != < <= > >=``). The parser builds
    :class:`BoolOp` for AND / OR; a two-sided ``Binary("AND", ...)`` is still understood."""

    op: str
    left: Expr
    right: Expr
    span: Span = NO_SPAN


@dataclass(frozen=True)
class BoolOp:
    """``a AND b AND c`` (or OR): one node over all the operands of a flat chain.

    A chain of thousands of terms is as shallow as one of two, so no stage
    recurses along it; parentheses the query writes are kept as nested nodes.

    >>> from trellisdb.tql.show import show
    >>> show(BoolOp("AND", (Column("a"), Column("b"), Column("c"))))
    '(a AND b AND c)'
    >>> BoolOp("AND", (Column("a"),))
    Traceback (most recent call last):
    ...
    trellisdb.errors.QueryError: BoolOp AND needs at least two operands, got 1; use the operand itself
    """

    op: str  # "AND" | "OR"
    operands: tuple[Expr, ...]
    span: Span = NO_SPAN

    def __post_init__(self) -> None:
        if self.op not in ("AND", "OR"):
            raise QueryError(f"BoolOp joins with AND or OR, not {self.op!r}; use Binary for other operators")
        if not isinstance(self.operands, tuple) or len(self.operands) < 2:
            n = len(self.operands) if isinstance(self.operands, tuple) else type(self.operands).__name__
            raise QueryError(f"BoolOp {self.op} needs at least two operands, got {n}; use the operand itself")


@dataclass(frozen=True)
class Not:
    operand: Expr
    span: Span = NO_SPAN


@dataclass(frozen=True)
class IsNull:
    operand: Expr
    negated: bool
    span: Span = NO_SPAN


@dataclass(frozen=True)
class InList:
    operand: Expr
    items: tuple[Expr, ...]
    negated: bool
    span: Span = NO_SPAN


@dataclass(frozen=True)
class Between:
    operand: Expr
    low: Expr
    high: Expr
    span: Span = NO_SPAN


#: Every kind of expression: a closed union, so that a ``match`` over it ending in
#: ``case _: assert_never(e)`` is checked for a missing kind by ``mypy --strict``.
Expr = Literal | Param | Column | Call | AggCall | Neg | Binary | BoolOp | Not | IsNull | InList | Between
Value = Literal | Param


# ------------------------------------------------------------------ clauses
@dataclass(frozen=True)
class OrderItem:
    expr: Expr
    descending: bool


@dataclass(frozen=True)
class Proj:
    expr: Expr
    alias: str | None


@dataclass(frozen=True)
class Scope:
    kind: str  # "session" | "task"
    value: Value
    span: Span = NO_SPAN


@dataclass(frozen=True)
class Diversity:
    """``PER <expression> k``: at most ``k`` rows per distinct value of ``per`` (nulls form one
    group). ``PER PARENT k`` is ``PER parent k``, ``PER SESSION k`` is ``PER session_id k``."""

    per: Expr
    k: Value


@dataclass(frozen=True)
class AsOf:
    kind: str  # "commit" | "tag" | "timestamp" | "step"
    value: Value
    session: Value | None = None
    span: Span = NO_SPAN


# ------------------------------------------------------------------ statements
@dataclass(frozen=True)
class Select:
    entity: str  # "nodes" | "sessions" | "tasks" | "rewards"
    scope: Scope | None = None
    where: Expr | None = None
    order: tuple[OrderItem, ...] = ()
    limit: Value | None = None
    returning: tuple[Proj, ...] = ()
    span: Span = NO_SPAN
    group_by: tuple[Expr, ...] = ()
    having: Expr | None = None
    diversity: Diversity | None = None

    @property
    def grouped(self) -> bool:
        """Whether the rows are grouped: a GROUP BY, a HAVING, or an aggregate in RETURN or ORDER BY."""
        return bool(self.group_by) or self.having is not None or any(
            has_aggregate(e) for e in (*(p.expr for p in self.returning), *(o.expr for o in self.order)))


@dataclass(frozen=True)
class Frontier:
    """``include_quarantined``: ``INCLUDE QUARANTINED`` (else quarantined nodes are left out)."""

    scope: Scope | None = None
    where: Expr | None = None
    expanded: Expr | None = None
    rank: tuple[OrderItem, ...] = ()
    diversity: Diversity | None = None
    limit: Value | None = None
    returning: tuple[Proj, ...] = ()
    span: Span = NO_SPAN
    include_quarantined: bool = False


@dataclass(frozen=True)
class Lineage:
    """Ancestors or descendants of a node (``SUBTREE`` is descendants plus the node)."""

    node: Value
    direction: str  # "ancestors" | "descendants"
    depth: Value | None = None
    via: tuple[str, ...] = ()
    where: Expr | None = None
    returning: tuple[Proj, ...] = ()
    span: Span = NO_SPAN


@dataclass(frozen=True)
class Siblings:
    node: Value
    via: tuple[str, ...] = ()
    where: Expr | None = None
    returning: tuple[Proj, ...] = ()
    span: Span = NO_SPAN


@dataclass(frozen=True)
class PathQuery:
    src: Value
    dst: Value
    via: tuple[str, ...] = ()
    returning: tuple[Proj, ...] = ()
    span: Span = NO_SPAN


@dataclass(frozen=True)
class ExpandItem:
    direction: str  # "ancestors" | "descendants" | "siblings" | "lineage"
    hops: Value | None = None


@dataclass(frozen=True)
class Retrieve:
    """Seeds by vector similarity and/or keywords, then their lineage (``include_quarantined``:
    ``INCLUDE QUARANTINED``, else quarantined nodes are neither seeds nor reached)."""

    k: Value
    similar: Value | None = None  # a text, or a $param holding a vector
    space: str | None = None
    matching: Value | None = None
    entity: str = "nodes"  # "nodes" | "tasks"
    where: Expr | None = None
    expand: tuple[ExpandItem, ...] = ()
    via: tuple[str, ...] = ()
    rank: tuple[OrderItem, ...] = ()
    limit: Value | None = None
    returning: tuple[Proj, ...] = ()
    span: Span = NO_SPAN
    include_quarantined: bool = False


@dataclass(frozen=True)
class ViewCommand:
    """CREATE VIEW / MATERIALIZE / REFRESH / EXPORT / DROP VIEW / SHOW VIEWS (``trellisdb/training/``).
    ``options`` hold literal values, names as text, lists, and -- for ``reward`` -- the
    expression's TQL text; ``where`` is the condition's text."""

    action: str  # create | materialize | refresh | export | drop | show
    name: str | None = None
    kind: str | None = None
    where: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    replace: bool = False
    path: Value | None = None
    format: str | None = None
    as_of: AsOf | None = None
    span: Span = NO_SPAN


#: Every kind of query statement (closed, like :data:`Expr`); ``Command`` adds the view statements.
Statement = Select | Frontier | Lineage | Siblings | PathQuery | Retrieve
Command = Statement | ViewCommand


@dataclass(frozen=True)
class Query:
    statement: Command
    as_of: AsOf | None
    explain: bool
    text: str


# ------------------------------------------------------------------ tree -> AST
def _span(meta: Any) -> Span:
    if getattr(meta, "empty", True):
        return NO_SPAN
    return Span(meta.start_pos, meta.end_pos, meta.line, meta.column)


def _tok_span(t: Token) -> Span:
    return Span(t.start_pos or 0, t.end_pos or 0, t.line or 0, t.column or 0)


def _kw(items: list[Any]) -> list[Any]:
    """Children without keyword tokens (upper-case terminals other than values)."""
    return [i for i in items if not (isinstance(i, Token) and i.type.isupper() and i.type not in _VALUE_TOKENS)]


_VALUE_TOKENS = {"COMP_OP", "ADD_OP", "MUL_OP"}


def _clauses(items: list[Any]) -> dict[str, Any]:
    """Optional clauses of a statement, by the tag each clause handler returns."""
    out: dict[str, Any] = {}
    for i in items:
        if isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) and i[0].startswith("@"):
            out[i[0][1:]] = i[1]
    return out


def _has_param(e: Any) -> bool:
    if isinstance(e, Param):
        return True
    if dataclasses.is_dataclass(e):
        return any(_has_param(getattr(e, f.name)) for f in dataclasses.fields(e))
    if isinstance(e, tuple | list):
        return any(_has_param(x) for x in e)
    return False


def _option_value(v: Any, text: str) -> Any:
    """A view option's value: a literal's value, a bare name as text, a list of those."""
    if isinstance(v, tuple) and v and v[0] == "@list":
        return list(v[1])
    if isinstance(v, Literal):
        return v.value
    if isinstance(v, Column):
        return v.name
    if isinstance(v, Param):
        raise QuerySyntaxError(f"a view is stored, so its options cannot be parameters (${v.name}); write the value",
                               span=place(v.span), query=text)
    span = getattr(v, "span", NO_SPAN)
    raise QuerySyntaxError(f"view option value {text[span.start:span.end]!r} must be a number, text, true/false, "
                           "a name or a [list]", span=place(span), query=text)


@v_args(meta=True)
class ToAst(Transformer[Token, Any]):
    """One method per grammar rule or alias."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    # -- statements
    def start(self, meta: Any, items: list[Any]) -> Query:
        explain = any(i == "@explain" for i in items)
        stmt = next(i for i in items if isinstance(i, Command))
        as_of = next((i for i in items if isinstance(i, AsOf)), None)
        return Query(stmt, as_of, explain, self.text)

    def explain(self, meta: Any, items: list[Any]) -> str:
        return "@explain"

    # -- training-data views
    def _source(self, e: Any) -> str:
        """The TQL text of an expression as written (a view keeps its definition as text)."""
        if _has_param(e):
            raise QuerySyntaxError(
                f"a view is stored, so it cannot use parameters ({self.text[e.span.start:e.span.end]!r}); "
                "write the value into the definition", span=place(e.span), query=self.text
            )
        return self.text[e.span.start:e.span.end]

    def create_view(self, meta: Any, items: list[Any]) -> ViewCommand:
        c = _clauses(items)
        names = [i for i in _kw(items) if isinstance(i, str) and not i.startswith("@")]
        opts = tuple(c.get("with", ()))
        return ViewCommand("create", names[0], names[1].lower(), self._source(c["where"]) if "where" in c else None,
                           opts, "replace" in c, span=_span(meta))

    def or_replace(self, meta: Any, items: list[Any]) -> tuple[str, bool]:
        return ("@replace", True)

    def view_with(self, meta: Any, items: list[Any]) -> tuple[str, list[tuple[str, Any]]]:
        return ("@with", list(_kw(items)))

    def view_opt(self, meta: Any, items: list[Any]) -> tuple[str, Any]:
        name, op, value = items[0], items[1], items[2]
        if str(op) != "=":
            raise QuerySyntaxError(f"a view option is NAME = VALUE, not {name} {op} ...",
                                   span=place(_tok_span(op)) if isinstance(op, Token) else None, query=self.text)
        if name == "reward":
            return (name, self._source(value))
        return (name, _option_value(value, self.text))

    def view_list(self, meta: Any, items: list[Any]) -> tuple[str, list[Any]]:
        return ("@list", [_option_value(i, self.text) for i in items if i is not None])

    def export_format(self, meta: Any, items: list[Any]) -> tuple[str, str]:
        return ("@format", str(_kw(items)[0]).lower())

    def materialize_view(self, meta: Any, items: list[Any]) -> ViewCommand:
        as_of = next((i for i in items if isinstance(i, AsOf)), None)
        return ViewCommand("materialize", _kw(items)[0], as_of=as_of, span=_span(meta))

    def refresh_view(self, meta: Any, items: list[Any]) -> ViewCommand:
        return ViewCommand("refresh", _kw(items)[0], span=_span(meta))

    def export_view(self, meta: Any, items: list[Any]) -> ViewCommand:
        c = _clauses(items)
        kw = _kw(items)
        return ViewCommand("export", kw[0], path=kw[1], format=c.get("format"), options=tuple(c.get("with", ())),
                           span=_span(meta))

    def drop_view(self, meta: Any, items: list[Any]) -> ViewCommand:
        return ViewCommand("drop", _kw(items)[0], span=_span(meta))

    def show_views(self, meta: Any, items: list[Any]) -> ViewCommand:
        return ViewCommand("show", span=_span(meta))

    def select(self, meta: Any, items: list[Any]) -> Select:
        c = _clauses(items)
        return Select(items[0], c.get("scope"), c.get("where"), c.get("order", ()), c.get("limit"),
                      c.get("returning", ()), _span(meta), group_by=c.get("group_by", ()), having=c.get("having"),
                      diversity=c.get("diversity"))

    def entity(self, meta: Any, items: list[Any]) -> str:
        return str(items[0]).lower()

    def scope_session(self, meta: Any, items: list[Any]) -> tuple[str, Scope]:
        return ("@scope", Scope("session", _kw(items)[0], _span(meta)))

    def scope_task(self, meta: Any, items: list[Any]) -> tuple[str, Scope]:
        return ("@scope", Scope("task", _kw(items)[0], _span(meta)))

    def where(self, meta: Any, items: list[Any]) -> tuple[str, Expr]:
        return ("@where", _kw(items)[0])

    def group_by(self, meta: Any, items: list[Any]) -> tuple[str, tuple[Expr, ...]]:
        return ("@group_by", tuple(_kw(items)))

    def having(self, meta: Any, items: list[Any]) -> tuple[str, Expr]:
        return ("@having", _kw(items)[0])

    def order(self, meta: Any, items: list[Any]) -> tuple[str, tuple[OrderItem, ...]]:
        return ("@order", tuple(_kw(items)))

    def order_item(self, meta: Any, items: list[Any]) -> OrderItem:
        return OrderItem(items[0], len(items) > 1 and items[1] == "desc")

    def direction(self, meta: Any, items: list[Any]) -> str:
        return str(items[0]).lower()

    def limit(self, meta: Any, items: list[Any]) -> tuple[str, Value]:
        return ("@limit", _kw(items)[0])

    def returning(self, meta: Any, items: list[Any]) -> tuple[str, tuple[Proj, ...]]:
        return ("@returning", tuple(_kw(items)))

    def proj(self, meta: Any, items: list[Any]) -> Proj:
        rest = _kw(items)
        return Proj(rest[0], rest[1] if len(rest) > 1 else None)

    def frontier(self, meta: Any, items: list[Any]) -> Frontier:
        c = _clauses(items)
        return Frontier(c.get("scope"), c.get("where"), c.get("expanded"), c.get("rank", ()), c.get("diversity"),
                        c.get("limit"), c.get("returning", ()), _span(meta),
                        include_quarantined=c.get("include_quarantined", False))

    def include_quarantined(self, meta: Any, items: list[Any]) -> tuple[str, bool]:
        return ("@include_quarantined", True)

    def expanded(self, meta: Any, items: list[Any]) -> tuple[str, Expr]:
        return ("@expanded", _kw(items)[0])

    def rank(self, meta: Any, items: list[Any]) -> tuple[str, tuple[OrderItem, ...]]:
        return ("@rank", tuple(_kw(items)))

    def per_parent(self, meta: Any, items: list[Any]) -> tuple[str, Diversity]:
        return ("@diversity", Diversity(Column("parent", _tok_span(items[1])), _kw(items)[0]))

    def per_session(self, meta: Any, items: list[Any]) -> tuple[str, Diversity]:
        return ("@diversity", Diversity(Column("session_id", _tok_span(items[1])), _kw(items)[0]))

    def per_expr(self, meta: Any, items: list[Any]) -> tuple[str, Diversity]:
        per, k = _kw(items)
        return ("@diversity", Diversity(per, k))

    def lineage(self, meta: Any, items: list[Any]) -> Lineage:
        rest = _kw(items)
        node, direction = rest[0], rest[1]
        depth = rest[2] if len(rest) > 2 and isinstance(rest[2], Literal | Param) else None
        c = _clauses(items)
        return Lineage(node, direction, depth, c.get("via", ()), c.get("where"), c.get("returning", ()), _span(meta))

    def lineage_dir(self, meta: Any, items: list[Any]) -> str:
        return str(items[0]).lower()

    def siblings(self, meta: Any, items: list[Any]) -> Siblings:
        c = _clauses(items)
        return Siblings(_kw(items)[0], c.get("via", ()), c.get("where"), c.get("returning", ()), _span(meta))

    def subtree(self, meta: Any, items: list[Any]) -> Lineage:
        rest = _kw(items)
        depth = rest[1] if len(rest) > 1 and isinstance(rest[1], Literal | Param) else None
        c = _clauses(items)
        return Lineage(rest[0], "subtree", depth, c.get("via", ()), c.get("where"), c.get("returning", ()),
                       _span(meta))

    def path(self, meta: Any, items: list[Any]) -> PathQuery:
        rest = _kw(items)
        c = _clauses(items)
        return PathQuery(rest[0], rest[1], c.get("via", ()), c.get("returning", ()), _span(meta))

    def retrieve(self, meta: Any, items: list[Any]) -> Retrieve:
        c = _clauses(items)
        k = _kw(items)[0]
        similar = [i for i in items if isinstance(i, tuple) and i[0] == "@similar"]
        matching = [i for i in items if isinstance(i, tuple) and i[0] == "@matching"]
        if len(similar) > 1 or len(matching) > 1:
            raise QuerySyntaxError("RETRIEVE takes at most one SIMILAR TO and one MATCHING", meta.line, meta.column,
                                   span=place(_span(meta)), query=self.text)
        sim, space = similar[0][1] if similar else (None, None)
        expand, via = c.get("expand", ((), ()))
        return Retrieve(k, sim, space, matching[0][1] if matching else None, c.get("from", "nodes"), c.get("where"),
                        expand, via, c.get("rank", ()), c.get("limit"), c.get("returning", ()), _span(meta),
                        include_quarantined=c.get("include_quarantined", False))

    def similar(self, meta: Any, items: list[Any]) -> tuple[str, tuple[Value, str | None]]:
        rest = _kw(items)
        return ("@similar", (rest[0], rest[1] if len(rest) > 1 else None))

    def matching(self, meta: Any, items: list[Any]) -> tuple[str, Value]:
        return ("@matching", _kw(items)[0])

    def retrieve_from(self, meta: Any, items: list[Any]) -> tuple[str, str]:
        return ("@from", str(items[1]).lower())

    def expand(self, meta: Any, items: list[Any]) -> tuple[str, tuple[tuple[ExpandItem, ...], tuple[str, ...]]]:
        c = _clauses(items)
        return ("@expand", (tuple(i for i in items if isinstance(i, ExpandItem)), c.get("via", ())))

    def expand_ancestors(self, meta: Any, items: list[Any]) -> ExpandItem:
        rest = _kw(items)
        return ExpandItem("ancestors", rest[0] if rest else None)

    def expand_descendants(self, meta: Any, items: list[Any]) -> ExpandItem:
        rest = _kw(items)
        return ExpandItem("descendants", rest[0] if rest else None)

    def expand_siblings(self, meta: Any, items: list[Any]) -> ExpandItem:
        return ExpandItem("siblings", None)

    def expand_lineage(self, meta: Any, items: list[Any]) -> ExpandItem:
        rest = _kw(items)
        return ExpandItem("lineage", rest[0] if rest else None)

    def via(self, meta: Any, items: list[Any]) -> tuple[str, tuple[str, ...]]:
        return ("@via", tuple(_kw(items)))

    def as_of_commit(self, meta: Any, items: list[Any]) -> AsOf:
        return AsOf("commit", _kw(items)[0], None, _span(meta))

    def as_of_tag(self, meta: Any, items: list[Any]) -> AsOf:
        return AsOf("tag", _kw(items)[0], None, _span(meta))

    def as_of_timestamp(self, meta: Any, items: list[Any]) -> AsOf:
        return AsOf("timestamp", _kw(items)[0], None, _span(meta))

    def as_of_step(self, meta: Any, items: list[Any]) -> AsOf:
        rest = _kw(items)
        return AsOf("step", rest[0], rest[1], _span(meta))

    # -- expressions
    def or_(self, meta: Any, items: list[Any]) -> BoolOp:
        return BoolOp("OR", tuple(_kw(items)), _span(meta))

    def and_(self, meta: Any, items: list[Any]) -> BoolOp:
        return BoolOp("AND", tuple(_kw(items)), _span(meta))

    def not_(self, meta: Any, items: list[Any]) -> Not:
        return Not(_kw(items)[0], _span(meta))

    def compare(self, meta: Any, items: list[Any]) -> Binary:
        a, op, b = items
        return Binary("!=" if str(op) == "<>" else str(op), a, b, _span(meta))

    def arith(self, meta: Any, items: list[Any]) -> Binary:
        a, op, b = items
        return Binary(str(op), a, b, _span(meta))

    def is_null(self, meta: Any, items: list[Any]) -> IsNull:
        return IsNull(_kw(items)[0], False, _span(meta))

    def is_not_null(self, meta: Any, items: list[Any]) -> IsNull:
        return IsNull(_kw(items)[0], True, _span(meta))

    def in_list(self, meta: Any, items: list[Any]) -> InList:
        rest = _kw(items)
        return InList(rest[0], tuple(rest[1:]), False, _span(meta))

    def not_in_list(self, meta: Any, items: list[Any]) -> InList:
        rest = _kw(items)
        return InList(rest[0], tuple(rest[1:]), True, _span(meta))

    def between(self, meta: Any, items: list[Any]) -> Between:
        a, lo, hi = _kw(items)
        return Between(a, lo, hi, _span(meta))

    def neg(self, meta: Any, items: list[Any]) -> Expr:
        x = items[0]
        if isinstance(x, Literal) and isinstance(x.value, int | float) and not isinstance(x.value, bool):
            return Literal(-x.value, _span(meta))
        return Neg(x, _span(meta))

    def true(self, meta: Any, items: list[Any]) -> Literal:
        return Literal(True, _span(meta))

    def false(self, meta: Any, items: list[Any]) -> Literal:
        return Literal(False, _span(meta))

    def null(self, meta: Any, items: list[Any]) -> Literal:
        return Literal(None, _span(meta))

    def call(self, meta: Any, items: list[Any]) -> Call | AggCall:
        name, *args = items
        args = [a for a in args if a is not None]
        if name.lower() in AGGREGATES:
            return self._aggregate(meta, name, args, distinct=False)
        return Call(name.lower(), tuple(args), _span(meta))

    def call_star(self, meta: Any, items: list[Any]) -> AggCall:
        name = items[0]
        if name.lower() != "count":
            raise self._error(meta, f"{name}(*) is not a function: only count(*) takes '*' (it counts rows); "
                                    f"{name}() takes a value, e.g. {name.lower()}(step)")
        return AggCall("count", None, False, _span(meta))

    def call_distinct(self, meta: Any, items: list[Any]) -> AggCall:
        name, arg = _kw(items)
        if name.lower() not in AGGREGATES:
            raise self._error(meta, f"DISTINCT goes inside an aggregate, as in count(DISTINCT session_id); "
                                    f"{name}() is not one (aggregates: {', '.join(AGGREGATES)})")
        return self._aggregate(meta, name, [arg], distinct=True)

    def _aggregate(self, meta: Any, name: str, args: list[Any], *, distinct: bool) -> AggCall:
        func = name.lower()
        if len(args) != 1:
            hint = {"count": "count(*) counts rows, count(x) the rows where x is not null",
                    "min": "the smaller of two values is least(a, b)",
                    "max": "the larger of two values is greatest(a, b)"}.get(func, f"e.g. {func}(usd)")
            raise self._error(meta, f"{func}() is an aggregate and takes one argument, got {len(args)}; {hint}")
        return AggCall(func, args[0], distinct, _span(meta))

    def _error(self, meta: Any, what: str) -> QuerySyntaxError:
        span = _span(meta)
        return QuerySyntaxError(f"line {span.line}, column {span.column}: {what}", span.line, span.column,
                                span=place(span), query=self.text)

    def column(self, meta: Any, items: list[Any]) -> Column:
        return Column(items[0], _span(meta))

    def name(self, meta: Any, items: list[Any]) -> str:
        return str(items[0])

    def string(self, meta: Any, items: list[Any]) -> Literal:
        t = items[0]
        return Literal(str(t)[1:-1].replace("''", "'"), _tok_span(t))

    def number(self, meta: Any, items: list[Any]) -> Literal:
        t = items[0]
        s = str(t)
        v: int | float = float(s) if any(c in s for c in ".eE") else int(s)
        return Literal(v, _tok_span(t))

    def param(self, meta: Any, items: list[Any]) -> Param:
        t = items[0]
        return Param(str(t)[1:], _tok_span(t))


def has_aggregate(e: Any) -> bool:
    """Whether expression ``e`` holds an aggregate (count, sum, avg, min, max) anywhere."""
    if isinstance(e, AggCall):
        return True
    if isinstance(e, tuple):
        return any(has_aggregate(x) for x in e)
    if dataclasses.is_dataclass(e) and not isinstance(e, type):
        return any(has_aggregate(getattr(e, f.name)) for f in dataclasses.fields(e) if f.name != "span")
    return False


def handler_names() -> set[str]:
    """Names of ToAst's rule handlers (for the test that every rule has one)."""
    return {n for n, v in vars(ToAst).items() if not n.startswith("_") and callable(v)}
