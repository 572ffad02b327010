"""Resolve a TQL AST against the catalog: names, functions, parameters, AS OF.

The result, :class:`Bound`, is the AST with every name checked (unknown
columns, functions, reward channels, sessions, tasks, tags and parameters are
:class:`~trellisdb.errors.QueryNameError` with a "did you mean"), every
``$param`` replaced by its value, and ``AS OF`` turned into a commit id.
Values stay values: they become SQL parameters later, never SQL text.

An error about a place in the text carries it as data (``span`` and ``query``,
see :class:`~trellisdb.errors.QueryError`); so do the type errors of
``types.py`` raised while resolving.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, assert_never

import pyarrow as pa

from trellisdb import asof
from trellisdb.errors import QueryError, QueryNameError, QueryTypeError
from trellisdb.names import QUARANTINED, did_you_mean, known, printable, utf8_problem
from trellisdb.schema import EDGE_KINDS, table_schema
from trellisdb.tql import ast as A
from trellisdb.tql.show import show
from trellisdb.tql.types import arrow_type, check, check_condition, typeof

#: Edge kinds a lineage walk, child count or sibling test follows unless VIA says otherwise.
LINEAGE_KINDS = ("derived_from", "repair_of", "crossover_of")

#: Statuses that make a node "expanded" (not on the frontier) even without children.
CLOSED_STATUSES = ("expanded", "closed", "failed", "pruned")

#: Derived per-node values usable by name in any node statement.
NODE_ACCESSORS = {
    "children": "number of child nodes (edges of the lineage kinds leaving the node)",
    "visits": "children + 1: how often the node has been tried from, itself included",
    "parent": "the node's primary parent id (smallest id among its lineage parents), null for a root",
    "depth": "hops from the root along lineage edges (computed only when used)",
    "age": "steps its session has taken since this node (max step in the session - step)",
}

#: Plain SQL functions TQL passes through: name -> (min args, max args).
SQL_FUNCTIONS: dict[str, tuple[int, int]] = {
    "abs": (1, 1), "ln": (1, 1), "log10": (1, 1), "sqrt": (1, 1), "exp": (1, 1), "power": (2, 2),
    "round": (1, 2), "floor": (1, 1), "ceil": (1, 1), "least": (1, 16), "greatest": (1, 16),
    "coalesce": (1, 16), "lower": (1, 1), "upper": (1, 1), "length": (1, 1), "contains": (2, 2),
    "starts_with": (2, 2),
}

#: Functions TQL defines: name -> (min args, max args).
TQL_FUNCTIONS: dict[str, tuple[int, int]] = {"reward": (1, 1), "ucb": (3, 3), "attr": (1, 1), "has_label": (1, 1),
                                             "quarantined": (0, 0)}

#: The comparison operators (``attr('k')`` is read as the type of what it is compared with).
_COMPARISONS = frozenset({"=", "!=", "<>", "<", "<=", ">", ">="})
#: ``attr('k')`` as written, and as read in a comparison with a number, a text, a boolean.
ATTR_CALLS = ("attr", "attr_number", "attr_text", "attr_bool")

#: The attribute scope (``attributes.scope``) of each entity a query ranges over.
ATTR_SCOPES = {"nodes": "node", "sessions": "session", "tasks": "task"}

MAX_HOPS = 10_000


def _columns(entity: str) -> list[str]:
    cols = [f.name for f in table_schema(entity, 1) if f.name != "embedding"]
    return [*cols, "seq"] if entity == "nodes" else cols  # the insertion order (schema.SEQ_SQL)


ENTITY_COLUMNS: dict[str, list[str]] = {e: _columns(e) for e in ("nodes", "sessions", "tasks", "rewards")}

#: The type (see ``types.py``) of every name an expression can use, per entity.
_DERIVED_TYPES = {"children": "number", "visits": "number", "depth": "number", "age": "number", "parent": "text",
                  "has_children": "bool", "hop": "number", "shared_parent": "text"}
#: The columns RETRIEVE adds to each row (usable in RANK BY and RETURN).
RETRIEVE_COLUMNS = {"relation": "text", "seed": "text", "seed_rank": "number", "hop": "number", "distance": "number",
                    "score": "number"}
#: Hops an EXPAND step takes when it names no number.
DEFAULT_EXPAND_HOPS = 2
#: The most seeds one RETRIEVE may ask for.
MAX_RETRIEVE = 10_000
COLUMN_TYPES: dict[str, dict[str, str]] = {
    e: {f.name: arrow_type(f.type) for f in table_schema(e, 1)} | _DERIVED_TYPES | RETRIEVE_COLUMNS
    | ({"seq": "number"} if e == "nodes" else {})
    for e in ENTITY_COLUMNS
}
#: The names holding whole numbers, per entity: sum() and avg() of them are exact (see :func:`_integral`).
INTEGER_COLUMNS: dict[str, frozenset[str]] = {
    e: frozenset({f.name for f in table_schema(e, 1) if pa.types.is_integer(f.type)}
                 | {"children", "visits", "depth", "age", "hop", "seed_rank"})
    for e in ENTITY_COLUMNS
}

#: Why an aggregate cannot be where it is (the clause, or the statement).
_NO_AGGREGATE_IN = {
    "WHERE": "aggregates cannot be in WHERE, which picks rows before they are grouped; to keep only some groups "
             "put the condition in HAVING (after GROUP BY, before ORDER BY), e.g. "
             "NODES GROUP BY session_id HAVING count(*) > 3 RETURN session_id",
    "GROUP BY": "GROUP BY takes values of each row (the groups), not an aggregate; aggregates go in RETURN, "
                "HAVING and ORDER BY",
    "PER": "PER takes a value of each row, not an aggregate, e.g. PER step 2",
}


@dataclass
class Catalog:
    """What names exist: channels, sessions, tasks (fetched lazily, cached) and tags."""

    channels: Callable[[], AbstractSet[str]]
    sessions: Callable[[], AbstractSet[str]]
    tasks: Callable[[], AbstractSet[str]]
    tags: Mapping[str, int]
    commits: Mapping[int, Mapping[str, Any]]
    last_commit: int
    step_commit: Callable[[str, int], int | None]
    #: embedding spaces of a target (nodes | tasks): name -> dimension
    spaces: Callable[[str], dict[str, int]] = lambda target: {"embedding": 0}
    #: the distinct steps of a session's nodes, ascending (for the error of AS OF STEP k
    #: naming a step the session does not have)
    session_steps: Callable[[str], list[int]] = lambda session_id: []
    #: the attribute keys of a scope (node | session | task) and the type of their values:
    #: number, text, bool, or json (mixed, lists, mappings: compared as JSON text)
    attr_types: Callable[[str], dict[str, str]] = lambda scope: {}


@dataclass(frozen=True)
class Bound:
    """A resolved query: the statement with values in place of parameters."""

    query: A.Query
    statement: A.Statement
    snapshot: int
    #: reward channels the statement reads
    channels: tuple[str, ...] = ()
    #: derived node values the statement uses (children, visits, parent, depth, age)
    accessors: frozenset[str] = field(default_factory=frozenset)
    #: attributes the statement reads: (key, type of its values)
    attrs: tuple[tuple[str, str], ...] = ()
    #: labels the statement tests (has_label)
    labels: tuple[str, ...] = ()
    #: RETRIEVE ... SIMILAR TO $v: the query vector (float32)
    vector: Any = None


def _where(span: A.Span) -> str:
    return f" (line {span.line}, column {span.column})" if span.line else ""


class Resolver:
    def __init__(self, catalog: Catalog, params: Mapping[str, Any]) -> None:
        self.cat = catalog
        self.params = dict(params)
        self.used_params: set[str] = set()
        self.channels: list[str] = []
        self.accessors: set[str] = set()
        self.attrs: dict[str, str] = {}
        self.labels: list[str] = []
        self.entity = "nodes"
        self.extra_columns: set[str] = set()
        #: why an aggregate may not appear where the resolver is now (None: it may)
        self.no_aggregates: str | None = None
        self.in_aggregate = False

    @contextmanager
    def refusing_aggregates(self, why: str | None) -> Iterator[None]:
        """Resolve the expressions of a clause where aggregates are refused for the reason ``why``."""
        before, self.no_aggregates = self.no_aggregates, why or self.no_aggregates
        try:
            yield
        finally:
            self.no_aggregates = before

    # -- values
    def value(self, v: A.Value | None) -> A.Literal | None:
        if v is None:
            return None
        if isinstance(v, A.Literal):
            return v
        if v.name not in self.params:
            bound = ", ".join(f"${printable(k)}" for k in sorted(self.params)) or "none"
            raise QueryNameError(
                f"parameter ${v.name}{_where(v.span)} has no value; pass {v.name}=... "
                f"(bound: {bound}){did_you_mean(v.name, self.params)}", span=A.place(v.span)
            )
        self.used_params.add(v.name)
        x = self.params[v.name]
        if isinstance(x, float) and not math.isfinite(x):
            raise QueryError(f"parameter ${v.name} is {x!r}; TQL values must be finite", span=A.place(v.span))
        if x is not None and not isinstance(x, str | int | float | bool | dt.datetime | dt.date):
            raise QueryError(
                f"parameter ${v.name} is a {type(x).__name__}; TQL parameters are str, int, float, bool, "
                "datetime or None", span=A.place(v.span)
            )
        if isinstance(x, str) and (problem := utf8_problem(x)):  # DuckDB and Arrow take UTF-8 only
            raise QueryError(f"parameter ${v.name}{_where(v.span)} is not valid UTF-8 text ({problem}); "
                             "pass text UTF-8 can hold", span=A.place(v.span))
        return A.Literal(x, v.span)

    def text(self, v: A.Value, what: str) -> str:
        lit = self.value(v)
        assert lit is not None
        if not isinstance(lit.value, str):
            raise QueryError(f"{what}{_where(v.span)} must be a string, got {lit.value!r}", span=A.place(v.span))
        return lit.value

    def count(self, v: A.Value | None, what: str, *, minimum: int = 0, maximum: int | None = None) -> int | None:
        lit = self.value(v)
        if lit is None:
            return None
        x = lit.value
        if isinstance(x, bool) or not isinstance(x, int) or x < minimum or (maximum is not None and x > maximum):
            bound = f" and at most {maximum}" if maximum is not None else ""
            raise QueryError(f"{what}{_where(lit.span)} must be a whole number >= {minimum}{bound}, got {x!r}",
                             span=A.place(lit.span))
        return x

    # -- names
    def session(self, v: A.Value) -> A.Literal:
        sid = self.text(v, "a session id")
        if sid not in self.cat.sessions():
            raise QueryNameError(
                f"unknown session {sid!r}{did_you_mean(sid, self.cat.sessions())}{known('sessions', self.cat.sessions())}",
                span=A.place(v.span),
            )
        return A.Literal(sid, v.span)

    def task(self, v: A.Value) -> A.Literal:
        tid = self.text(v, "a task id")
        if tid not in self.cat.tasks():
            raise QueryNameError(f"unknown task {tid!r}{did_you_mean(tid, self.cat.tasks())}{known('tasks', self.cat.tasks())}",
                                 span=A.place(v.span))
        return A.Literal(tid, v.span)

    def via(self, kinds: tuple[str, ...]) -> tuple[str, ...]:
        for k in kinds:
            if k not in EDGE_KINDS:
                raise QueryNameError(f"unknown edge kind {k!r}{did_you_mean(k, EDGE_KINDS)}; kinds: {', '.join(EDGE_KINDS)}")
        return tuple(dict.fromkeys(kinds)) or LINEAGE_KINDS

    def scope(self, s: A.Scope | None) -> A.Scope | None:
        if s is None:
            return None
        if s.kind == "session":
            if self.entity == "sessions":
                raise QueryError("SESSIONS FROM SESSION is not a scope; use SESSIONS WHERE id = '...'",
                                 span=A.place(s.span))
            return A.Scope("session", self.session(s.value), s.span)
        if self.entity == "tasks":
            raise QueryError("TASKS FROM TASK is not a scope; use TASKS WHERE id = '...'", span=A.place(s.span))
        return A.Scope("task", self.task(s.value), s.span)

    # -- expressions
    def expr(self, e: A.Expr, *, ranking: bool = False) -> A.Expr:
        r = self.expr
        match e:
            case A.Literal():
                return e
            case A.Param():
                lit = self.value(e)
                assert lit is not None
                return lit
            case A.Column():
                return self.column(e)
            case A.Call():
                return self.call(e, ranking)
            case A.AggCall():
                return self.aggregate(e)
            case A.Neg():
                return A.Neg(r(e.operand, ranking=ranking), e.span)
            case A.Binary():
                left, right = r(e.left, ranking=ranking), r(e.right, ranking=ranking)
                if e.op in _COMPARISONS:  # attr('k') = 3 reads the number, attr('k') = 'x' the text
                    left, right = self.attr_view(left, right), self.attr_view(right, left)
                return A.Binary(e.op, left, right, e.span)
            case A.BoolOp():
                return A.BoolOp(e.op, tuple(r(o, ranking=ranking) for o in e.operands), e.span)
            case A.Not():
                return A.Not(r(e.operand, ranking=ranking), e.span)
            case A.IsNull():
                return A.IsNull(r(e.operand, ranking=ranking), e.negated, e.span)
            case A.InList():
                items = tuple(r(i, ranking=ranking) for i in e.items)
                operand = r(e.operand, ranking=ranking)
                if items:
                    operand = self.attr_view(operand, items[0])
                return A.InList(operand, items, e.negated, e.span)
            case A.Between():
                low, high = r(e.low, ranking=ranking), r(e.high, ranking=ranking)
                return A.Between(self.attr_view(r(e.operand, ranking=ranking), low), low, high, e.span)
            case _:
                assert_never(e)

    def aggregate(self, e: A.AggCall) -> A.AggCall:
        if self.no_aggregates is not None:
            raise QueryError(f"{show(e)}{_where(e.span)} is an aggregate: {self.no_aggregates}", span=A.place(e.span))
        if self.in_aggregate:
            raise QueryError(f"aggregates cannot nest: {show(e)}{_where(e.span)} is inside another aggregate; "
                             "aggregate a value of each row, e.g. max(step), or group first (GROUP BY)",
                             span=A.place(e.span))
        if e.arg is None:
            return e
        self.in_aggregate = True
        try:
            arg = self.expr(e.arg)
        finally:
            self.in_aggregate = False
        types = self.types
        kind = "bool" if typeof(arg, types) == "bool" else "int" if _integral(arg, INTEGER_COLUMNS[self.entity]) else ""
        return A.AggCall(e.func, arg, e.distinct, e.span, kind)

    def attr_view(self, e: A.Expr, partner: A.Expr) -> A.Expr:
        """``attr('k')`` compared with ``partner``: read as the partner's type (``attr_number``,
        ``attr_text``, ``attr_bool``), whatever other types the key's values have had, so one
        value of another type never breaks the comparisons of a key; other uses keep ``attr``."""
        if not (isinstance(e, A.Call) and e.name == "attr"):
            return e
        want = typeof(partner, self.types)
        if want in ("number", "text", "bool"):
            return A.Call(f"attr_{want}", e.args, e.span)
        return e

    def types(self, name: str) -> str | None:
        """The type of a column of the statement's rows, or of an ``attr('key')`` it reads."""
        t = COLUMN_TYPES[self.entity].get(name)
        if t is None and name.startswith("attr("):
            key = name[6:-2].replace("''", "'")
            a = self.attrs.get(key)
            return "text" if a == "json" else a
        return t

    def is_column(self, name: str) -> bool:
        """Whether ``name`` (lower case) names a column of the rows the statement reads."""
        return (name in ENTITY_COLUMNS[self.entity] or name in self.extra_columns
                or (self.entity == "nodes" and name in NODE_ACCESSORS))

    def column(self, c: A.Column) -> A.Column:
        name = c.name.lower()
        cols = ENTITY_COLUMNS[self.entity]
        if name in cols or name in self.extra_columns:
            return A.Column(name, c.span)
        if self.entity == "nodes" and name in NODE_ACCESSORS:
            self.accessors.add(name)
            if name == "visits":
                self.accessors.add("children")
            return A.Column(name, c.span)
        options = cols + sorted(self.extra_columns) + (list(NODE_ACCESSORS) if self.entity == "nodes" else [])
        raise QueryNameError(
            f"unknown column {c.name!r}{_where(c.span)} for {self.entity}{did_you_mean(name, options)}; "
            f"columns: {', '.join(options)}", span=A.place(c.span)
        )

    def call(self, c: A.Call, ranking: bool) -> A.Expr:
        arity = TQL_FUNCTIONS.get(c.name) or SQL_FUNCTIONS.get(c.name)
        if arity is None:
            raise QueryNameError(
                f"unknown function {c.name!r}{_where(c.span)}"
                f"{did_you_mean(c.name, list(TQL_FUNCTIONS) + list(SQL_FUNCTIONS))}; functions: "
                f"{', '.join(sorted(TQL_FUNCTIONS) + sorted(SQL_FUNCTIONS))}", span=A.place(c.span)
            )
        lo, hi = arity
        if not lo <= len(c.args) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise QueryError(f"{c.name}() takes {want} argument(s), got {len(c.args)}{_where(c.span)}",
                             span=A.place(c.span))
        if c.name == "reward":
            if self.entity != "nodes":
                raise QueryError(f"reward() reads a node's rewards; it is not available on {self.entity}",
                                 span=A.place(c.span))
            arg = c.args[0]
            if not isinstance(arg, A.Literal | A.Param):
                raise QueryError(f"reward() takes a channel name, e.g. reward('score'){_where(c.span)}",
                                 span=A.place(c.span))
            ch = self.text(arg, "a reward channel")
            if ch not in self.cat.channels():
                raise QueryNameError(
                    f"unknown reward channel {ch!r}{did_you_mean(ch, self.cat.channels())}"
                    f"{known('channels', self.cat.channels())}", span=A.place(arg.span)
                )
            if ch not in self.channels:
                self.channels.append(ch)
            return A.Call("reward", (A.Literal(ch, arg.span),), c.span)
        if c.name == "attr":
            scope = ATTR_SCOPES.get(self.entity)
            arg = c.args[0]
            if scope is None or not isinstance(arg, A.Literal | A.Param):
                raise QueryError(f"attr() reads an attribute of a node, session or task by its key, e.g. "
                                 f"attr('island'){_where(c.span)}", span=A.place(c.span))
            key = self.text(arg, "an attribute key")
            known_keys = self.cat.attr_types(scope)
            if key not in known_keys:
                raise QueryNameError(
                    f"no {scope} has an attribute {key!r}{did_you_mean(key, known_keys)}"
                    f"{known(scope + ' attributes', set(known_keys))}", span=A.place(arg.span))
            self.attrs[key] = known_keys[key]
            return A.Call("attr", (A.Literal(key, arg.span),), c.span)
        if c.name == "has_label":
            arg = c.args[0]
            if self.entity != "nodes" or not isinstance(arg, A.Literal | A.Param):
                raise QueryError(f"has_label() tests a node's membership by name, e.g. has_label('archive')"
                                 f"{_where(c.span)}", span=A.place(c.span))
            label = self.text(arg, "a label")
            if label not in self.labels:
                self.labels.append(label)
            return A.Call("has_label", (A.Literal(label, arg.span),), c.span)
        if c.name == "quarantined":  # has_label('trellis:quarantined'), named for what it means
            if self.entity != "nodes":
                raise QueryError(f"quarantined() tests whether a node is quarantined; {self.entity} are not"
                                 f"{_where(c.span)}", span=A.place(c.span))
            if QUARANTINED not in self.labels:
                self.labels.append(QUARANTINED)
            return A.Call("quarantined", (), c.span)
        if c.name == "ucb" and not ranking:
            raise QueryError(f"ucb() ranks the frontier; use it in RANK BY or ORDER BY{_where(c.span)}",
                             span=A.place(c.span))
        return A.Call(c.name, tuple(self.expr(a, ranking=False) for a in c.args), c.span)

    def order(self, items: tuple[A.OrderItem, ...]) -> tuple[A.OrderItem, ...]:
        out = tuple(A.OrderItem(self.expr(i.expr, ranking=True), i.descending) for i in items)
        for i in out:
            check(i.expr, self.types)
        return out

    def condition(self, e: A.Expr | None, clause: str) -> A.Expr | None:
        """Resolve ``e`` and check that it is a condition (for WHERE, EXPANDED WHEN)."""
        if e is None:
            return None
        out = self.expr(e)
        check_condition(out, self.types, clause)
        return out

    def returning(self, items: tuple[A.Proj, ...]) -> tuple[A.Proj, ...]:
        out = []
        for p in items:
            e = self.expr(p.expr)
            check(e, self.types)
            out.append(A.Proj(e, p.alias))
        return _named(tuple(out))

    def diversity(self, d: A.Diversity | None) -> A.Diversity | None:
        """``PER <expression> k``: the expression is resolved and typed like any other."""
        if d is None:
            return None
        with self.refusing_aggregates(_NO_AGGREGATE_IN["PER"]):
            per = self.expr(d.per)
        check(per, self.types)
        return A.Diversity(per, A.Literal(self.count(d.k, "PER ... k", minimum=1)))

    # -- selections: GROUP BY, HAVING, aggregates
    def select(self, s: A.Select) -> A.Select:
        self.entity = s.entity
        scope = self.scope(s.scope)
        with self.refusing_aggregates(_NO_AGGREGATE_IN["WHERE"]):
            where = self.condition(s.where, "WHERE")
        outputs = {p.alias.lower(): p.expr for p in s.returning if p.alias}  # the names RETURN gives with AS
        with self.refusing_aggregates(_NO_AGGREGATE_IN["GROUP BY"]):
            group_by = tuple(self.group_key(e, outputs) for e in s.group_by)
        having = self.condition(_aliased(s.having, outputs), "HAVING") if s.having is not None else None
        order = self.order(tuple(A.OrderItem(_aliased(i.expr, outputs), i.descending) for i in s.order))
        out = replace(s, scope=scope, where=where, group_by=group_by, having=having, order=order,
                      diversity=self.diversity(s.diversity), limit=_lit(self.count(s.limit, "LIMIT")),
                      returning=self.returning(s.returning))
        return self.grouped(out) if out.grouped else out

    def group_key(self, e: A.Expr, outputs: Mapping[str, A.Expr]) -> A.Expr:
        """A GROUP BY key; a name that is no column but a RETURN column's means that column's expression."""
        if isinstance(e, A.Column) and not self.is_column(e.name.lower()) and e.name.lower() in outputs:
            named = outputs[e.name.lower()]
            if A.has_aggregate(named):
                raise QueryError(f"GROUP BY {e.name}{_where(e.span)} names the RETURN column {e.name}, which is an "
                                 f"aggregate ({show(named)}); group by values of each row, e.g. GROUP BY session_id, "
                                 "and keep only some groups with HAVING", span=A.place(e.span))
            e = named
        out = self.expr(e)
        check(out, self.types)
        return out

    def grouped(self, s: A.Select) -> A.Select:
        """Check a grouped selection: every RETURN, HAVING and ORDER BY expression is made of GROUP BY
        keys, aggregates and constants. Without RETURN it returns its keys."""
        if s.diversity is not None:
            raise QueryError("PER keeps at most k rows per value, and a grouped query's rows are groups; drop PER, "
                             "or drop the GROUP BY / aggregates and use PER on the rows", span=A.place(s.span))
        keys = {show(k) for k in s.group_by}
        checks = [("RETURN", p.expr) for p in s.returning] + [("ORDER BY", o.expr) for o in s.order]
        checks += [("HAVING", s.having)] if s.having is not None else []
        for clause, e in checks:
            loose = _loose(e, keys)
            if loose is None:
                continue
            name = loose.name
            if s.group_by:
                grouped = ", ".join(show(k) for k in s.group_by)
                raise QueryTypeError(
                    f"{clause} uses {name}{_where(loose.span)}, which is neither a GROUP BY key nor inside an "
                    f"aggregate; a grouped query returns one row per group, so add it to the keys "
                    f"(GROUP BY {grouped}, {name}) or aggregate it, e.g. max({name}) or count(DISTINCT {name})",
                    span=A.place(loose.span))
            raise QueryTypeError(
                f"{clause} uses {name}{_where(loose.span)} outside an aggregate, but a query with an aggregate "
                f"and no GROUP BY returns one row for all the rows; aggregate it, e.g. max({name}), or group by "
                f"it: GROUP BY {name}", span=A.place(loose.span))
        if not s.returning:
            if not s.group_by:
                raise QueryError("an aggregate query without GROUP BY needs a RETURN saying what to compute, e.g. "
                                 "RETURN count(*) AS n", span=A.place(s.span))
            return replace(s, returning=_named(tuple(A.Proj(k, None) for k in s.group_by)))
        return s

    # -- AS OF
    def as_of(self, a: A.AsOf | None) -> int:
        cat = self.cat
        if a is None:
            return cat.last_commit
        if a.kind == "commit":
            n = self.count(a.value, "AS OF COMMIT", minimum=0)
            assert n is not None
            return asof.commit(cat.commits, cat.last_commit, n)
        if a.kind == "tag":
            return asof.tag(cat.tags, self.text(a.value, "AS OF TAG"))
        if a.kind == "timestamp":
            lit = self.value(a.value)
            assert lit is not None
            ts: object = lit.value
            if isinstance(ts, str):
                parsed = asof.parse_time(ts)
                if parsed is None:
                    raise QueryError(f"AS OF TIMESTAMP {ts!r} is not an ISO time such as '2026-12-01T10:00:00'",
                                     span=A.place(a.value.span))
                ts = parsed
            if not isinstance(ts, dt.datetime):
                raise QueryError(f"AS OF TIMESTAMP needs a time, got {ts!r}", span=A.place(a.value.span))
            return asof.time(cat.commits, ts)
        step = self.count(a.value, "AS OF STEP", minimum=0)
        assert step is not None and a.session is not None
        sid = self.session(a.session).value
        assert isinstance(sid, str)
        cid = cat.step_commit(sid, step)
        if cid is None:
            raise QueryError(f"session {sid!r} has no step {step}; {_steps_of(cat.session_steps(sid), step)}",
                             span=A.place(a.span))
        return cid


def _steps_of(steps: list[int], step: int) -> str:
    """What to say of a session's steps when AS OF STEP names one it does not have."""
    if not steps:
        return "it has no node with a step yet"
    lo, hi = steps[0], steps[-1]
    if lo == hi:
        return f"its only step is {lo}"
    if len(steps) == hi - lo + 1:
        return f"its steps are {lo}..{hi}"
    near = [x for x in (max((x for x in steps if x < step), default=None),
                        min((x for x in steps if x > step), default=None)) if x is not None]
    return f"its steps run {lo}..{hi} with gaps; the nearest are {' and '.join(map(str, near))}"


def _named(items: tuple[A.Proj, ...]) -> tuple[A.Proj, ...]:
    """RETURN columns with their names: the alias, else one from the expression; two alike are an error."""
    seen: set[str] = set()
    out = []
    for p in items:
        name = p.alias or _default_name(p.expr)
        if name in seen:
            raise QueryError(f"two RETURN columns are named {name!r}; give one an alias with AS",
                             span=A.place(p.expr.span))
        seen.add(name)
        out.append(A.Proj(p.expr, name))
    return tuple(out)


def _children(e: A.Expr) -> list[A.Expr]:
    """The expressions directly inside ``e``."""
    out: list[A.Expr] = []
    for f in dataclasses.fields(e):
        v = getattr(e, f.name)
        for x in v if isinstance(v, tuple) else (v,):
            if isinstance(x, _EXPRS):
                out.append(x)
    return out


def _rebuild(e: A.Expr, f: Callable[[A.Expr], A.Expr]) -> A.Expr:
    """``e`` with ``f`` applied to each expression directly inside it."""
    changes: dict[str, Any] = {}
    for fl in dataclasses.fields(e):
        v = getattr(e, fl.name)
        if isinstance(v, _EXPRS):
            changes[fl.name] = f(v)
        elif isinstance(v, tuple) and any(isinstance(x, _EXPRS) for x in v):
            changes[fl.name] = tuple(f(x) if isinstance(x, _EXPRS) else x for x in v)
    return replace(e, **changes) if changes else e


_EXPRS = (A.Literal, A.Param, A.Column, A.Call, A.AggCall, A.Neg, A.Binary, A.BoolOp, A.Not, A.IsNull, A.InList,
          A.Between)


def _aliased(e: A.Expr | None, outputs: Mapping[str, A.Expr]) -> A.Expr:
    """``e`` (ORDER BY, HAVING) with each name RETURN gives (``AS name``) replaced by that column's
    expression (as in SQL, the RETURN name wins over a column of the same name); names inside
    an aggregate are columns of the rows."""
    assert e is not None

    def sub(x: A.Expr) -> A.Expr:
        if isinstance(x, A.Column):
            out = outputs.get(x.name.lower())
            if out is None or (isinstance(out, A.Column) and out.name.lower() == x.name.lower()):
                return x
            return out
        if isinstance(x, A.AggCall):
            return x
        return _rebuild(x, sub)

    return sub(e)


def _loose(e: A.Expr, keys: set[str]) -> A.Column | None:
    """The first column of ``e`` outside every aggregate and GROUP BY key (None: ``e`` is grouped)."""
    if isinstance(e, A.AggCall) or show(e) in keys:
        return None
    if isinstance(e, A.Column):
        return e
    for c in _children(e):
        found = _loose(c, keys)
        if found is not None:
            return found
    return None


def _integral(e: A.Expr, ints: frozenset[str]) -> bool:
    """Whether resolved ``e`` is a whole number (its sum is exact): a whole-number column or literal,
    or + - * % abs least greatest coalesce count min max sum of those."""
    match e:
        case A.Literal():
            return isinstance(e.value, int) and not isinstance(e.value, bool)
        case A.Column():
            return e.name in ints
        case A.Neg():
            return _integral(e.operand, ints)
        case A.Binary():
            return e.op in ("+", "-", "*", "%") and _integral(e.left, ints) and _integral(e.right, ints)
        case A.Call():
            return e.name in ("abs", "least", "greatest", "coalesce") and all(_integral(a, ints) for a in e.args)
        case A.AggCall():
            return e.func == "count" or (e.func in ("min", "max", "sum") and e.arg is not None
                                         and _integral(e.arg, ints))
        case _:
            return False


def _default_name(e: A.Expr) -> str:
    match e:
        case A.Column():
            return e.name
        case A.Call():
            if e.name in ("reward", *ATTR_CALLS, "has_label") and e.args and isinstance(e.args[0], A.Literal):
                return str(e.args[0].value)
            return e.name
        case A.AggCall():
            return e.func
        case A.Literal() | A.Param() | A.Neg() | A.Binary() | A.BoolOp() | A.Not() | A.IsNull() | A.InList() \
                | A.Between():
            return "value"
        case _:
            assert_never(e)


def resolve(q: A.Query, catalog: Catalog, params: Mapping[str, Any] | None = None) -> Bound:
    """Check ``q`` against ``catalog`` and bind ``params``; see the module docs.

    A :class:`~trellisdb.errors.QueryError` raised on the way gets ``q``'s text as its
    ``query`` (the raising code sets the ``span``: it has the node, not the text)."""
    try:
        return _resolve(q, Resolver(catalog, params or {}))
    except QueryError as e:
        if e.query is None:
            e.query = q.text
        raise


def _resolve(q: A.Query, r: Resolver) -> Bound:
    s = q.statement
    if isinstance(s, A.ViewCommand):
        raise QueryError(f"{s.action.upper()} is a view statement: run it with db.query, it has no plan")
    snapshot = r.as_of(q.as_of)
    if not isinstance(s, A.Select):
        r.no_aggregates = _no_aggregates(s)
    stmt: A.Statement
    match s:
        case A.Select():
            stmt = r.select(s)
        case A.Frontier():
            if s.expanded is None:
                r.accessors.add("has_children")  # the default EXPANDED rule: a mark join, not a count
            stmt = replace(
                s,
                scope=r.scope(s.scope),
                where=r.condition(s.where, "WHERE"),
                expanded=r.condition(s.expanded, "EXPANDED WHEN"),
                rank=r.order(s.rank),
                diversity=r.diversity(s.diversity),
                limit=_lit(r.count(s.limit, "LIMIT")),
                returning=r.returning(s.returning),
            )
        case A.Lineage():
            r.extra_columns = {"hop"}
            node = A.Literal(r.text(s.node, "a node id"), s.node.span)
            stmt = replace(
                s,
                node=node,
                depth=_lit(r.count(s.depth, "the number of hops", minimum=0, maximum=MAX_HOPS)),
                via=r.via(s.via),
                where=r.condition(s.where, "WHERE"),
                returning=r.returning(s.returning),
            )
        case A.Siblings():
            r.extra_columns = {"shared_parent"}
            stmt = replace(
                s,
                node=A.Literal(r.text(s.node, "a node id"), s.node.span),
                via=r.via(s.via),
                where=r.condition(s.where, "WHERE"),
                returning=r.returning(s.returning),
            )
        case A.Retrieve():
            stmt, vector = _retrieve(r, s)
            return _bound(r, q, stmt, snapshot, vector)
        case A.PathQuery():
            r.extra_columns = {"hop"}
            stmt = replace(
                s,
                src=A.Literal(r.text(s.src, "a node id"), s.src.span),
                dst=A.Literal(r.text(s.dst, "a node id"), s.dst.span),
                via=r.via(s.via),
                returning=r.returning(s.returning),
            )
        case _:
            assert_never(s)
    return _bound(r, q, stmt, snapshot, None)


def _no_aggregates(s: A.Statement) -> str:
    """Why statement ``s`` (not a selection) takes no aggregate."""
    name = {A.Frontier: "FRONTIER", A.Siblings: "SIBLINGS", A.PathQuery: "PATH", A.Retrieve: "RETRIEVE"}.get(
        type(s), "SUBTREE" if getattr(s, "direction", "") == "subtree" else "LINEAGE")
    return (f"{name} returns rows, and does not aggregate them; count(), sum(), avg(), min() and max() work in "
            "NODES, SESSIONS, TASKS and REWARDS selections, e.g. NODES WHERE ... GROUP BY session_id RETURN "
            f"session_id, count(*) AS n (the {name} result's rows are len(result))")


def _bound(r: Resolver, q: A.Query, stmt: A.Statement, snapshot: int, vector: Any) -> Bound:
    unused = set(r.params) - r.used_params
    if unused:
        raise QueryNameError(
            f"parameter(s) {', '.join('$' + printable(u) for u in sorted(unused))} given but not used in the query"
        )
    return Bound(q, stmt, snapshot, tuple(r.channels), frozenset(r.accessors), attrs=tuple(r.attrs.items()),
                 labels=tuple(r.labels), vector=vector)


def _retrieve(r: Resolver, s: A.Retrieve) -> tuple[A.Retrieve, Any]:
    import numpy as np

    from trellisdb.errors import EmbeddingDimensionError

    r.entity = s.entity
    k = r.count(s.k, "RETRIEVE k", minimum=1, maximum=MAX_RETRIEVE)
    spaces = r.cat.spaces(s.entity)
    space = s.space or "embedding"
    if space not in spaces:
        raise QueryNameError(
            f"unknown embedding space {space!r} of {s.entity}{did_you_mean(space, spaces)}{known('spaces', spaces)}"
        )
    if s.space is not None and s.similar is None:
        raise QueryError(f"IN {space} names the space of SIMILAR TO; MATCHING searches text, not a space")
    vector = None
    similar: A.Value | None = None
    if isinstance(s.similar, A.Param) and s.similar.name in r.params and not isinstance(
            r.params[s.similar.name], str):
        raw = r.params[s.similar.name]
        r.used_params.add(s.similar.name)
        try:
            vector = np.asarray(raw, dtype=np.float32)
        except (TypeError, ValueError):
            raise QueryError(f"${s.similar.name} must be a text or a vector of numbers, got {type(raw).__name__}",
                             span=A.place(s.similar.span)) from None
        if vector.ndim != 1 or vector.shape[0] != spaces[space]:
            got = vector.shape[-1] if vector.ndim else 0
            raise EmbeddingDimensionError(
                f"${s.similar.name} has dimension {got}, but space {space!r} of {s.entity} has dimension {spaces[space]}"
            )
        if not np.isfinite(vector).all():
            raise QueryError(f"${s.similar.name} contains NaN or infinite values", span=A.place(s.similar.span))
        similar = s.similar
    elif s.similar is not None:
        similar = A.Literal(r.text(s.similar, "SIMILAR TO (a text, or a $param holding a vector)"), s.similar.span)
    matching = A.Literal(r.text(s.matching, "MATCHING"), s.matching.span) if s.matching is not None else None
    if s.expand and s.entity != "nodes":
        raise QueryError("EXPAND follows lineage edges between nodes; RETRIEVE ... FROM tasks has no lineage")
    if s.include_quarantined and s.entity != "nodes":
        raise QueryError("INCLUDE QUARANTINED concerns nodes (a quarantine holds nodes); RETRIEVE ... FROM tasks "
                         "never leaves a task out")
    expand = tuple(
        A.ExpandItem(e.direction, _lit(r.count(e.hops, f"EXPAND {e.direction.upper()} hops", minimum=0,
                                               maximum=MAX_HOPS) if e.hops is not None else DEFAULT_EXPAND_HOPS))
        for e in s.expand
    )
    where = r.condition(s.where, "WHERE")  # a prefilter: node columns only, not the RETRIEVE columns
    r.extra_columns = set(RETRIEVE_COLUMNS)
    stmt = replace(
        s, k=A.Literal(k), similar=similar, space=space, matching=matching, where=where, expand=expand,
        via=r.via(s.via), rank=r.order(s.rank), limit=_lit(r.count(s.limit, "LIMIT")),
        returning=r.returning(s.returning),
    )
    return stmt, vector


def _lit(v: int | None) -> A.Literal | None:
    return None if v is None else A.Literal(v)
