"""Logical plan -> sqlglot expressions -> DuckDB SQL (``dialect="duckdb"``).

Each operator becomes one CTE reading the previous one; the statement ends
with ``SELECT ... FROM <last> ORDER BY ...``. Values from the query (strings,
times, parameters) become DuckDB parameters (``$v1``...), never SQL text;
only numbers the grammar parsed and names the resolver checked are inlined.

>>> from trellisdb.tql.parser import parse
>>> from trellisdb.tql.resolve import Bound
>>> from trellisdb.tql.plan import build
>>> q = parse("NODES WHERE status = 'x''; DROP TABLE nodes' LIMIT 2")
>>> c = compile_plan(build(Bound(q, q.statement, 1)))
>>> c.params
{'v1': "x'; DROP TABLE nodes"}
>>> "DROP" in c.sql
False
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from dataclasses import dataclass, field
from typing import Any, assert_never

import sqlglot
from sqlglot import exp

from trellisdb.errors import PlanError, QueryError
from trellisdb.graph import FOUND_SCHEMA
from trellisdb.names import QUARANTINED
from trellisdb.tql import ast as A
from trellisdb.tql import plan as P
from trellisdb.tql.resolve import ATTR_CALLS, ATTR_SCOPES, ENTITY_COLUMNS, LINEAGE_KINDS, MAX_HOPS, RETRIEVE_COLUMNS

DIALECT = "duckdb"

_BINARY: dict[str, type[exp.Expr]] = {
    "+": exp.Add, "-": exp.Sub, "*": exp.Mul, "/": exp.Div, "%": exp.Mod,
    "=": exp.EQ, "!=": exp.NEQ, "<": exp.LT, "<=": exp.LTE, ">": exp.GT, ">=": exp.GTE,
    "AND": exp.And, "OR": exp.Or,
}

#: The nodes quarantined as of the snapshot (the current ``trellis:quarantined`` memberships), for the
#: anti-join that leaves them out: empty unless some node is, so the join costs a probe per row.
#: The label is trellisdb's constant (no user text), so it is written into the SQL.
QUARANTINED_IDS = f"(SELECT node_id FROM labels WHERE label = '{QUARANTINED}') AS __q"

_UCB = sqlglot.parse_one("__v + __c * sqrt(ln(greatest(sum(__n) OVER (), 1)) / greatest(__n, 1))", dialect=DIALECT)


#: What ``attr('key')`` reads of the key's hidden columns (``{c}``: their prefix), by the type it
#: is read as: its partner's in a comparison, else the type of the key's values (json: mixed).
_ATTR_VALUE = {"number": '"{c}_num"', "text": '"{c}_text"', "bool": '("{c}_value" = \'true\')',
               "json": '"{c}_value"'}


@dataclass
class Compiled:
    """SQL text, its parameter values, and the output columns it promises."""

    sql: str
    params: dict[str, Any]
    #: output column -> reward channel, for columns that hold a reward
    reward_columns: dict[str, str] = field(default_factory=dict)


@functools.lru_cache(maxsize=512)
def _parsed(sql: str, kind: str) -> exp.Expr:
    if kind == "column":  # a projection item
        item: exp.Expr = sqlglot.parse_one(f"SELECT {sql}", dialect=DIALECT).expressions[0]
        return item
    if kind == "table":  # a FROM / JOIN item
        table: exp.Expr = sqlglot.parse_one(f"SELECT 1 FROM {sql}", dialect=DIALECT).args["from_"].this
        return table
    return sqlglot.parse_one(sql, dialect=DIALECT)


def _paren(e: exp.Expr) -> exp.Paren:
    """``(e)`` around a freshly compiled ``e`` (no copy: sqlglot's default copies the subtree,
    so every level of a nested expression would copy all of the levels below it)."""
    return exp.paren(e, copy=False)


def _template(sql: str, kind: str = "statement") -> Any:
    """A fixed SQL fragment (names we generate, no user values), parsed once and copied per use."""
    return _parsed(sql, kind).copy()


def reward_column_names(channels: tuple[str, ...], entity_cols: list[str]) -> dict[str, str]:
    """channel -> output column name: the channel itself unless a column has that name."""
    out: dict[str, str] = {}
    for ch in channels:
        name = ch if ch not in entity_cols and ch not in out.values() else f"reward_{ch}"
        out[ch] = name
    return out


class Compiler:
    def __init__(self) -> None:
        self.params: dict[str, Any] = {}
        self.ctes: list[tuple[str, exp.Expr, bool]] = []
        self.rewards: dict[str, str] = {}
        #: attribute key -> (prefix of its hidden columns, type of its values); label -> its
        #: hidden column (set by the Derive)
        self.attr_cols: dict[str, tuple[str, str]] = {}
        self.label_cols: dict[str, str] = {}
        self.order: list[exp.Ordered] = []
        self.hidden: list[str] = []
        self.projection: list[exp.Expr] | None = None
        self.materialized: set[str] = set()
        self.keys_done: tuple[tuple[A.OrderItem, ...], list[str]] | None = None
        self._n = 0

    # -- helpers
    def value(self, v: Any) -> exp.Expr:
        if v is None:
            return exp.Null()
        if isinstance(v, bool):
            return exp.Boolean(this=v)
        if isinstance(v, int):
            return exp.Literal.number(str(v)) if v >= 0 else exp.Neg(this=exp.Literal.number(str(-v)))
        if isinstance(v, float):
            return exp.Literal.number(repr(v)) if v >= 0 else exp.Neg(this=exp.Literal.number(repr(-v)))
        if isinstance(v, Slot | str | dt.datetime | dt.date):
            self._n += 1
            name = f"v{self._n}"
            self.params[name] = v
            return exp.Placeholder(this=name)
        raise QueryError(f"cannot use {type(v).__name__} {v!r} as a value")

    def cte(self, body: exp.Expr, *, recursive: bool = False, materialized: bool = False) -> str:
        name = f"s{len(self.ctes)}"
        self.ctes.append((name, body, recursive))
        if materialized:
            self.materialized.add(name)
        return name

    def kinds_in(self, col: str, kinds: tuple[str, ...]) -> exp.Expr:
        return exp.In(this=exp.column(col), expressions=[exp.Literal.string(k) for k in kinds])

    # -- expressions
    def expr(self, e: A.Expr) -> exp.Expr:
        x = self.expr
        match e:
            case A.Literal():
                return self.value(e.value)
            case A.Param():  # pragma: no cover - the resolver binds every parameter
                raise QueryError(f"cannot compile {type(e).__name__}")
            case A.Column():
                return exp.column(e.name, quoted=True)
            case A.Call():
                if e.name == "reward":
                    ch = e.args[0]
                    assert isinstance(ch, A.Literal)
                    return exp.column(self.rewards[str(ch.value)], quoted=True)
                if e.name in ATTR_CALLS:
                    key = e.args[0]
                    assert isinstance(key, A.Literal)
                    base, typ = self.attr_cols[str(key.value)]
                    view = e.name.removeprefix("attr_") if e.name != "attr" else typ
                    read: exp.Expr = _template(_ATTR_VALUE[view].format(c=base), "column")
                    return read
                if e.name == "has_label":
                    key = e.args[0]
                    assert isinstance(key, A.Literal)
                    return exp.column(self.label_cols[str(key.value)], quoted=True)
                if e.name == "quarantined":
                    return exp.column(self.label_cols[QUARANTINED], quoted=True)
                if e.name == "ucb":
                    v, n, c = (x(a) for a in e.args)
                    subs = {"__v": _paren(v), "__n": _paren(n), "__c": _paren(c)}
                    return _paren(_UCB.copy().transform(
                        lambda node: subs[node.name].copy() if isinstance(node, exp.Column) and node.name in subs
                        else node,
                        copy=False,
                    ))
                return exp.Anonymous(this=e.name, expressions=[x(a) for a in e.args])
            case A.AggCall():
                return self.aggregate(e)
            case A.Neg():
                return exp.Neg(this=_paren(x(e.operand)))
            case A.Binary():
                return _paren(_BINARY[e.op](this=x(e.left), expression=x(e.right)))
            case A.BoolOp():
                # one parenthesized flat chain, (a AND b AND c): sqlglot prints a left-deep And/Or
                # chain with a loop, not recursion, and every operand is already parenthesized
                join = _BINARY[e.op]
                out = x(e.operands[0])
                for o in e.operands[1:]:
                    out = join(this=out, expression=x(o))
                return _paren(out)
            case A.Not():
                return exp.Not(this=_paren(x(e.operand)))
            case A.IsNull():
                isnull = exp.Is(this=x(e.operand), expression=exp.Null())
                return exp.Not(this=isnull) if e.negated else isnull
            case A.InList():
                inl = exp.In(this=x(e.operand), expressions=[x(i) for i in e.items])
                return exp.Not(this=inl) if e.negated else inl
            case A.Between():
                return exp.Between(this=x(e.operand), low=x(e.low), high=x(e.high))
            case _:
                assert_never(e)

    def aggregate(self, e: A.AggCall) -> exp.Expr:
        """An aggregate. Sums are exact over whole numbers (BIGINT, not DuckDB's HUGEINT) and compensated
        (Kahan) over fractions, so that a parallel sum gives the same figure run after run."""
        if e.arg is None:
            return exp.Count(this=exp.Star())
        arg = self.expr(e.arg)
        if e.func == "avg" and e.arg_type == "bool":
            arg = exp.Cast(this=arg, to=exp.DataType.build("INTEGER"))
        if e.distinct:
            arg = exp.Distinct(expressions=[arg])
        match e.func:
            case "count":
                return exp.Count(this=arg)
            case "min":
                return exp.Min(this=arg)
            case "max":
                return exp.Max(this=arg)
            case "sum" if e.arg_type in ("int", "bool"):
                return exp.Cast(this=exp.Sum(this=arg), to=exp.DataType.build("BIGINT"))
            case "avg" if e.arg_type in ("int", "bool"):
                return exp.Avg(this=arg)
            case "sum" | "avg":
                return exp.Anonymous(this="f" + e.func, expressions=[arg])
        raise QueryError(f"{e.func}() is not an aggregate; aggregates: {', '.join(A.AGGREGATES)}")

    def ordered(self, keys: tuple[A.OrderItem, ...], names: list[str], tie: tuple[str, ...]) -> list[exp.Ordered]:
        out = [
            exp.Ordered(this=exp.column(n, quoted=True), desc=k.descending, nulls_first=False)
            for k, n in zip(keys, names, strict=True)
        ]
        out += [exp.Ordered(this=exp.column(c), desc=False, nulls_first=False) for c in tie]
        return out

    def keyed(self, src: str, keys: tuple[A.OrderItem, ...]) -> tuple[str, list[str]]:
        """A CTE adding one column per ordering key (keys may hold window functions)."""
        names = []
        sel = exp.select(exp.Star()).from_(src, copy=False)
        for k in keys:
            self._n += 1
            name = f"__k{self._n}"
            names.append(name)
            sel = sel.select(exp.alias_(self.expr(k.expr), name, quoted=True), copy=False)
        self.hidden += names
        return (self.cte(sel) if names else src), names

    # -- operators
    def compile(self, p: P.Plan) -> str:
        """The CTE holding ``p``'s rows (Sort and Project add to the final SELECT instead)."""
        op = P.as_operator(p)
        match op:
            case P.Scan():
                return self.op_Scan(op)
            case P.Walk():
                return self.op_Walk(op)
            case P.SiblingsOf():
                return self.op_SiblingsOf(op)
            case P.ShortestPath():
                return self.op_ShortestPath(op)
            case P.VectorSearch():
                return self.op_VectorSearch(op)
            case P.Expand():
                return self.op_Expand(op)
            case P.Derive():
                return self.op_Derive(op)
            case P.Filter():
                return self.op_Filter(op)
            case P.TopPerGroup():
                return self.op_TopPerGroup(op)
            case P.Aggregate():
                return self.op_Aggregate(op)
            case P.Sort():
                return self.op_Sort(op)
            case P.Limit():
                return self.op_Limit(op)
            case P.Project():
                return self.op_Project(op)
            case _:
                assert_never(op)

    def op_Scan(self, p: P.Scan) -> str:
        if p.exclude_quarantined:  # an anti-join: the nodes with no current trellis:quarantined membership
            sel = _template(f"SELECT * FROM {p.entity} ANTI JOIN {QUARANTINED_IDS} ON __q.node_id = {p.entity}.id")
        else:
            sel = _template(f"SELECT * FROM {p.entity}")
        if p.scope is not None:
            v = self.value(p.scope.value.value)  # type: ignore[union-attr]
            col = "session_id" if p.scope.kind == "session" else "task_id"
            if p.entity == "rewards":
                sub = exp.select("id").from_("nodes", copy=False).where(exp.EQ(this=exp.column(col), expression=v), copy=False)
                sel = sel.where(exp.column("node_id").isin(query=sub), copy=False)
            else:
                sel = sel.where(exp.EQ(this=exp.column(col), expression=v), copy=False)
        if p.restrict_to is not None:
            sel = sel.where(exp.column("id").isin(query=_template(f"SELECT id FROM {p.restrict_to}")), copy=False)
        return self.cte(sel, materialized=p.restrict_to is not None)

    def _edges(self, kinds: tuple[str, ...]) -> str:
        sel = exp.select("src", "dst").from_("edges", copy=False).where(self.kinds_in("kind", kinds), copy=False)
        return self.cte(sel, materialized=True)

    def _walk(self, edges: str, seed: exp.Expr, direction: str, max_hops: int) -> str:
        """Recursive CTE of (id, hop); UNION (not ALL) and the hop bound make cycles terminate."""
        near, far = ("dst", "src") if direction == "ancestors" else ("src", "dst")
        name = f"s{len(self.ctes)}"
        body = _template(
            f"SELECT CAST(__seed AS VARCHAR) AS id, 0 AS hop "
            f"UNION SELECT e.{far}, w.hop + 1 FROM {name} AS w JOIN {edges} AS e ON e.{near} = w.id "
            f"WHERE w.hop < {int(max_hops)}"
        )
        body = body.transform(lambda n: seed.copy() if isinstance(n, exp.Column) and n.name == "__seed" else n,
                              copy=False)
        self.cte(body, recursive=True)
        return self.cte(_template(f"SELECT id, min(hop) AS hop FROM {name} GROUP BY id"))

    def op_Walk(self, p: P.Walk) -> str:
        if p.walked:  # computed before the SQL (tql/run.py), one row per node at its fewest hops
            return self.cte(_template("SELECT id, hop FROM __walk"))
        return self._walk(self._edges(p.kinds), self.value(p.seed), p.direction, p.max_hops)

    def op_SiblingsOf(self, p: P.SiblingsOf) -> str:
        e = self._edges(p.kinds)
        node = self.value(p.node)
        body = _template(
            f"SELECT s.dst AS id, min(s.src) AS shared_parent FROM {e} AS p JOIN {e} AS s ON s.src = p.src "
            f"WHERE p.dst = __node AND s.dst <> __node GROUP BY s.dst"
        )
        return self.cte(body.transform(
            lambda n: node.copy() if isinstance(n, exp.Column) and n.name == "__node" else n, copy=False))

    def op_ShortestPath(self, p: P.ShortestPath) -> str:
        e = self._edges(p.kinds)
        fwd = self._walk(e, self.value(p.src), "descendants", MAX_HOPS)
        bwd = self._walk(e, self.value(p.dst), "ancestors", MAX_HOPS)
        return self.cte(_template(
            f"SELECT f.id, f.hop FROM {fwd} AS f JOIN {bwd} AS b ON b.id = f.id "
            f"WHERE f.hop + b.hop = (SELECT min(f2.hop + b2.hop) FROM {fwd} AS f2 JOIN {bwd} AS b2 ON b2.id = f2.id)"
        ))

    def op_VectorSearch(self, p: P.VectorSearch) -> str:  # pragma: no cover - read through op_Expand
        raise QueryError("a vector search is compiled as part of its Expand")

    def op_Expand(self, p: P.Expand) -> str:
        """Seeds plus their neighbourhood, one row per node at its nearest seed: computed before
        the SQL (the vector step, then the walk over the in-memory adjacency, see
        ``tql/retrieve.py``) and read as the relation ``__found``."""
        cols = ", ".join(FOUND_SCHEMA.names)
        if p.exclude_quarantined:  # the walk went through them; the answer leaves them out
            return self.cte(_template(f"SELECT {cols} FROM __found ANTI JOIN {QUARANTINED_IDS} "
                                      "ON __q.node_id = __found.id"))
        return self.cte(_template(f"SELECT {cols} FROM __found"))

    def _attach(self, relation: P.Plan, extras: list[str], entity: str) -> tuple[exp.Select, list[str], str]:
        """A graph relation (id, hop | shared_parent | RETRIEVE's columns) with its node rows attached:
        the SELECT, its columns, and the filter restricting an aggregate to the nodes the walk reached."""
        rel = self.compile(relation)
        sel = _template(
            f"SELECT b.*, {', '.join('r.' + x for x in extras)} FROM {rel} AS r JOIN {entity} AS b ON b.id = r.id"
        )
        return sel, ENTITY_COLUMNS[entity] + extras, f" AND {{col}} IN (SELECT id FROM {rel})"

    def op_Derive(self, p: P.Derive) -> str:
        src = P.as_operator(p.input)
        match src:
            case P.Scan():
                rel = self.compile(src)
                sel = exp.select("b.*", copy=False).from_(exp.alias_(exp.to_table(rel), "b"), copy=False)
                entity_cols = ENTITY_COLUMNS[src.entity]
                # a scoped scan: aggregate only the edges of its nodes, not of the whole graph
                ids = f" AND {{col}} IN (SELECT id FROM {rel})" if src.scope is not None else ""
                only = src.restrict_to
            case P.Expand():
                sel, entity_cols, ids = self._attach(src, list(RETRIEVE_COLUMNS), src.entity)
                only = None
            case P.SiblingsOf():
                sel, entity_cols, ids = self._attach(src, ["shared_parent"], "nodes")
                only = None
            case P.Walk() | P.ShortestPath():
                sel, entity_cols, ids = self._attach(src, ["hop"], "nodes")
                only = None
            case (P.VectorSearch() | P.Derive() | P.Filter() | P.TopPerGroup() | P.Aggregate() | P.Sort() | P.Limit()
                  | P.Project()):
                raise PlanError(f"Derive reads a Scan, a graph walk or an Expand, not a {type(src).__name__}")
            case _:
                assert_never(src)
        entity = src.entity if isinstance(src, P.Scan | P.Expand) else "nodes"
        # a statement leaving quarantined nodes out does not count them as children either: a node
        # whose only children are quarantined is on the frontier again, and visits ignore them
        trusted = isinstance(src, P.Scan | P.Expand) and src.exclude_quarantined
        child_edges = f"edges ANTI JOIN {QUARANTINED_IDS} ON __q.node_id = edges.dst" if trusted else "edges"
        self.rewards = reward_column_names(p.channels, entity_cols)
        for i, ch in enumerate(p.channels):
            alias = f"r{i}"
            sub = _template("SELECT node_id, value FROM rewards")
            if only is not None:  # a restricted scan: only its nodes' rewards
                sub = sub.where(exp.column("node_id").isin(query=_template(f"SELECT id FROM {only}")), copy=False)
            sub = sub.where(exp.EQ(this=exp.column("channel"), expression=self.value(ch)), copy=False)
            sel = sel.join(exp.alias_(exp.paren(sub), alias), on=f"{alias}.node_id = b.id", join_type="left",
                           copy=False)
            sel = sel.select(exp.alias_(exp.column("value", table=alias), self.rewards[ch], quoted=True), copy=False)
        scope = ATTR_SCOPES.get(entity)
        for i, (key, typ) in enumerate(p.attrs):
            alias, name = f"at{i}", f"__attr{i}"
            sub = exp.select("entity", "num", "text", "value", copy=False).from_("attributes", copy=False).where(
                exp.and_(exp.EQ(this=exp.column("scope"), expression=exp.Literal.string(scope or "")),
                         exp.EQ(this=exp.column("key"), expression=self.value(key))), copy=False)
            sel = sel.join(exp.alias_(exp.paren(sub), alias), on=f"{alias}.entity = b.id", join_type="left",
                           copy=False)
            for col in ("num", "text", "value"):
                sel = sel.select(exp.alias_(exp.column(col, table=alias), f"{name}_{col}", quoted=True), copy=False)
                self.hidden.append(f"{name}_{col}")
            self.attr_cols[key] = (name, typ)
        for i, label in enumerate(p.labels):
            name = f"__label{i}"
            sub = exp.select("node_id").from_("labels", copy=False).where(
                exp.EQ(this=exp.column("label"), expression=self.value(label)), copy=False)
            sel = sel.select(exp.alias_(exp.column("id", table="b").isin(query=sub), name, quoted=True), copy=False)
            self.label_cols[label] = name
            self.hidden.append(name)
        acc = p.accessors
        kinds = ", ".join(f"'{k}'" for k in (p.kinds or LINEAGE_KINDS))
        joins: list[tuple[str, str, str]] = []  # (subquery AS alias, ON, select expression)
        if "has_children" in acc:
            joins.append(("", "", f"b.id IN (SELECT src FROM {child_edges} WHERE kind IN ({kinds})"
                                  f"{ids.format(col='src')}) AS has_children"))
        if "children" in acc:
            joins.append((f"(SELECT src, count(*) AS n FROM {child_edges} WHERE kind IN ({kinds}){ids.format(col='src')} "
                          "GROUP BY src) AS ch",
                          "ch.src = b.id", "coalesce(ch.n, 0) AS children"))
            if "visits" in acc:
                joins.append(("", "", "coalesce(ch.n, 0) + 1 AS visits"))
        if "parent" in acc:
            joins.append((f"(SELECT dst, min(src) AS parent FROM edges WHERE kind IN ({kinds}){ids.format(col='dst')} "
                          "GROUP BY dst) AS pa",
                          "pa.dst = b.id", "pa.parent AS parent"))
        if "age" in acc:
            joins.append(("(SELECT session_id, max(step) AS m FROM nodes GROUP BY session_id) AS ag",
                          "ag.session_id = b.session_id", "ag.m - b.step AS age"))
        if "depth" in acc:
            e = self._edges(p.kinds or LINEAGE_KINDS)
            name = f"s{len(self.ctes)}"
            roots = _template(
                f"SELECT id, 0 AS depth FROM nodes WHERE id NOT IN (SELECT dst FROM {e}) "
                f"UNION SELECT e.dst, d.depth + 1 FROM {name} AS d JOIN {e} AS e ON e.src = d.id "
                f"WHERE d.depth < {MAX_HOPS}"
            )
            self.cte(roots, recursive=True)
            dep = self.cte(_template(f"SELECT id, min(depth) AS depth FROM {name} GROUP BY id"))
            joins.append((f"{dep} AS dp", "dp.id = b.id", "dp.depth AS depth"))
        for table, on, col in joins:
            if table:
                sel = sel.join(_template(table, "table"), on=on, join_type="left", copy=False)
            sel = sel.select(_template(col, "column"), copy=False)
        return self.cte(sel)

    def op_Filter(self, p: P.Filter) -> str:
        src = self.compile(p.input)
        return self.cte(exp.select(exp.Star()).from_(src, copy=False).where(self.expr(p.predicate), copy=False))

    def op_TopPerGroup(self, p: P.TopPerGroup) -> str:
        src, names = self.keyed(self.compile(p.input), p.keys)
        win = exp.Window(
            this=exp.RowNumber(),
            partition_by=[self.expr(p.per)],
            order=exp.Order(expressions=self.ordered(p.keys, names, p.tiebreak)),
        )
        sel = exp.select(exp.Star()).from_(src, copy=False).qualify(exp.LTE(this=win, expression=exp.Literal.number(p.k)), copy=False)
        self.keys_done = (p.keys, names)
        return self.cte(sel)

    def op_Aggregate(self, p: P.Aggregate) -> str:
        """One row per group: its keys and aggregates, in the columns the plan names (GROUP BY the key
        positions, so a key is written once)."""
        src = self.compile(p.input)
        items = [exp.alias_(self.expr(e), name, quoted=True) for e, name in (*p.keys, *p.aggregates)]
        sel = exp.select(*items).from_(src, copy=False)
        if p.keys:
            sel = sel.group_by(*[exp.Literal.number(i + 1) for i in range(len(p.keys))], copy=False)
        self.keys_done = None
        return self.cte(sel)

    def op_Sort(self, p: P.Sort) -> str:
        src = self.compile(p.input)
        done = self.keys_done
        if done is not None and done[0] == p.keys:
            names = done[1]
        else:
            src, names = self.keyed(src, p.keys)
        self.order = self.ordered(p.keys, names, p.tiebreak)
        return src

    def op_Limit(self, p: P.Limit) -> str:
        src = self.compile(p.input)
        sel = exp.select(exp.Star()).from_(src, copy=False).order_by(*[o.copy() for o in self.order], copy=False).limit(p.n, copy=False)
        return self.cte(sel)

    def op_Project(self, p: P.Project) -> str:
        """The projection is the final SELECT's list (so its ORDER BY can still see the sort keys)."""
        src = self.compile(p.input)
        self.projection = [exp.alias_(self.expr(c.expr), str(c.alias), quoted=True) for c in p.columns]
        return src

    def finish(self, last: str) -> exp.Select:
        if self.projection is not None:
            sel = exp.select(*self.projection).from_(last, copy=False)
        else:
            star = exp.Star(**({"except_": [exp.column(h, quoted=True) for h in self.hidden]} if self.hidden else {}))
            sel = exp.select(star).from_(last, copy=False)
        if self.order:
            sel = sel.order_by(*[o.copy() for o in self.order], copy=False)
        recursive = any(r for _, _, r in self.ctes)
        for name, body, _ in self.ctes:
            sel = sel.with_(name, as_=body, recursive=recursive, materialized=True if name in self.materialized else None, copy=False)
        return sel


@dataclass(frozen=True)
class Slot:
    """Stands for the k-th text value of a plan while its shape compiles."""

    k: int


#: The most nodes (plan operators, expressions, values) a plan may have to be
#: cached by shape: typical queries have a few dozen to a few hundred. A larger
#: one (thousands of terms) compiles each time rather than keeping megabytes.
CACHED_SHAPE_NODES = 1_000


def _abstract(obj: Any, values: list[Any], nodes: list[int] | None = None) -> Any:
    """``obj`` with every text/time value replaced by a Slot (values collected in order).

    Two plans with the same shape (same operators, names and numbers, other
    strings) compile to the same SQL; only the parameter values differ.
    Reward channels, attribute keys and labels stay: they name columns. ``nodes[0]`` counts what it visits.
    """
    if nodes is not None:
        nodes[0] += 1
    if isinstance(obj, A.Literal):
        if isinstance(obj.value, str | dt.datetime | dt.date):
            values.append(obj.value)
            return A.Literal(Slot(len(values) - 1), obj.span)  # type: ignore[arg-type]
        return obj
    if isinstance(obj, A.Span | A.Column) or (isinstance(obj, A.Call) and obj.name in ("reward", *ATTR_CALLS,
                                                                                      "has_label", "quarantined")):
        return obj  # nothing inside to abstract
    if isinstance(obj, tuple):
        return tuple(_abstract(x, values, nodes) for x in obj)
    if isinstance(obj, P.Derive):
        return dataclasses.replace(obj, input=_abstract(obj.input, values, nodes))
    if isinstance(obj, P.Walk | P.SiblingsOf | P.ShortestPath):
        changes: dict[str, Any] = {}
        for f in ("seed", "node", "src", "dst"):
            if hasattr(obj, f):
                values.append(getattr(obj, f))
                changes[f] = Slot(len(values) - 1)
        return dataclasses.replace(obj, **changes)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _abstract(getattr(obj, f.name), values, nodes) for f in dataclasses.fields(obj)}
        if all(v is getattr(obj, k) for k, v in changes.items()):
            return obj  # no text inside: keep the node (a long AND of numbers is not rebuilt)
        return dataclasses.replace(obj, **changes)
    return obj


@functools.lru_cache(maxsize=256)
def _compile_shape(shape: P.Plan) -> tuple[str, dict[str, Any], dict[str, str]]:
    c = Compiler()
    last = c.compile(shape)
    sql = c.finish(last).sql(dialect=DIALECT, copy=False)  # a fresh tree, used once: no defensive copy
    return sql, c.params, {v: k for k, v in c.rewards.items()}


def compile_plan(plan: P.Plan) -> Compiled:
    """SQL and parameters for a plan; plans of one shape share one compilation (cached)."""
    values: list[Any] = []
    nodes = [0]
    shape = _abstract(plan, values, nodes)
    compile_shape = _compile_shape if nodes[0] <= CACHED_SHAPE_NODES else _compile_shape.__wrapped__
    sql, slots, rewards = compile_shape(shape)
    params = {name: values[v.k] if isinstance(v, Slot) else v for name, v in slots.items()}
    return Compiled(sql, params, rewards)
