"""Logical plans: frozen, self-validating operator trees, printable.

A plan reads bottom-up: a source (``Scan`` of an entity, a graph walk, or
RETRIEVE's ``Expand`` over its ``VectorSearch``), then ``Derive`` (reward
channels and per-node accessors), ``Filter``, ``TopPerGroup`` (diversity),
``Aggregate`` (GROUP BY and aggregates; a ``Filter`` over it is HAVING), ``Sort``,
``Limit`` and ``Project``. :data:`Operator` is the closed union of
the operator classes: code that dispatches on them matches over it and ends in
``case _: assert_never(p)``, so ``mypy --strict`` names any operator it misses.

>>> from trellisdb.tql.parser import parse
>>> from trellisdb.tql.resolve import Bound
>>> q = parse("NODES WHERE step > 1 ORDER BY step DESC LIMIT 3")
>>> print(build(Bound(q, q.statement, 7)).pretty())
Limit 3
  Sort step DESC, then seq, id
    Filter (step > 1)
      Scan nodes as of commit 7
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, assert_never, cast, get_args

from trellisdb.errors import PlanError as PlanError  # defined with the other errors; importable from here too
from trellisdb.names import QUARANTINED
from trellisdb.tql import ast as A
from trellisdb.tql.parser import MAX_SORT_KEYS
from trellisdb.tql.resolve import CLOSED_STATUSES, ENTITY_COLUMNS, LINEAGE_KINDS, MAX_HOPS, Bound
from trellisdb.tql.show import show

#: Columns every ordering of nodes ends with, so ties break the same way every time: the
#: insertion order (``seq``: first commit, then position in it; status changes never move it),
#: then the id.
TIEBREAK = ("seq", "id")


def excluding(snapshot: int) -> str:
    """What EXPLAIN says of an operator that leaves quarantined nodes out."""
    return (f"excluding quarantined nodes ({QUARANTINED} as of commit {snapshot}); INCLUDE QUARANTINED to "
            "include them")


def tiebreak(entity: str) -> tuple[str, ...]:
    """The tie-break of ``entity``'s rows: the insertion order for nodes; for the others the
    commit of the row, then the key."""
    from trellisdb.schema import KEYS

    return TIEBREAK if entity == "nodes" else ("commit_id", *KEYS[entity])


@dataclass(frozen=True)
class Plan:
    def children(self) -> tuple[Plan, ...]:
        return tuple(v for v in vars(self).values() if isinstance(v, Plan))

    def label(self) -> str:
        return type(self).__name__

    def pretty(self, indent: int = 0) -> str:
        lines = ["  " * indent + self.label()]
        lines += [c.pretty(indent + 1) for c in self.children()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.pretty()


@dataclass(frozen=True)
class Scan(Plan):
    """The rows of ``entity`` as of ``snapshot`` (``scope``: of one session or task).

    ``restrict_to`` names a relation of ids (``__members``, a view refresh's nodes): only
    those rows are read, and a ``Derive`` over the scan reads only their rewards. The scan
    is then a materialized CTE, so DuckDB narrows the nodes before it joins their rewards.

    ``exclude_quarantined`` leaves out the nodes quarantined as of ``snapshot`` (an anti-join
    with the current ``trellis:quarantined`` memberships): FRONTIER, RETRIEVE's prefilter and
    the training views read nodes so unless told to include them."""

    entity: str
    snapshot: int
    scope: A.Scope | None = None
    restrict_to: str | None = None
    exclude_quarantined: bool = False

    def __post_init__(self) -> None:
        if self.entity not in ENTITY_COLUMNS:
            raise PlanError(f"Scan of unknown entity {self.entity!r}")
        if self.snapshot < 0:
            raise PlanError("Scan snapshot must be >= 0")
        if self.restrict_to is not None and (self.entity != "nodes" or not _RELATION.fullmatch(self.restrict_to)):
            raise PlanError(f"Scan restricts nodes to an internal relation such as '__members', not "
                            f"{self.entity} to {self.restrict_to!r}")
        if self.exclude_quarantined and self.entity != "nodes":
            raise PlanError(f"a quarantine holds nodes; a Scan of {self.entity} excludes none")

    def label(self) -> str:
        sc = f" in {self.scope.kind} {show(self.scope.value)}" if self.scope else ""
        only = f" restricted to the ids in {self.restrict_to}" if self.restrict_to else ""
        trust = f", {excluding(self.snapshot)}" if self.exclude_quarantined else ""
        return f"Scan {self.entity}{sc} as of commit {self.snapshot}{only}{trust}"


#: The relations a Scan may be restricted to: internal names (``__members``), never user text.
_RELATION = re.compile(r"__[a-z_]+")


@dataclass(frozen=True)
class Walk(Plan):
    """Nodes reachable from ``seed`` along ``kinds`` edges, with their hop count (seed: 0)."""

    seed: str
    direction: str  # "ancestors" | "descendants"
    kinds: tuple[str, ...]
    max_hops: int
    snapshot: int
    #: walked before the SQL over the in-memory adjacency (``graph.py``) and read as the
    #: relation ``__walk`` (``tql/run.py`` decides), instead of a recursive CTE
    walked: bool = False

    def __post_init__(self) -> None:
        if self.direction not in ("ancestors", "descendants"):
            raise PlanError(f"Walk direction {self.direction!r}")
        if not 0 <= self.max_hops <= MAX_HOPS:
            raise PlanError(f"Walk hops must be within 0..{MAX_HOPS}")
        if not self.kinds:
            raise PlanError("Walk needs at least one edge kind")

    def label(self) -> str:
        how = " over the in-memory adjacency" if self.walked else ""
        return (f"Walk {self.direction} of {self.seed!r} up to {self.max_hops} hops via {', '.join(self.kinds)}"
                f" as of commit {self.snapshot}{how}")


@dataclass(frozen=True)
class SiblingsOf(Plan):
    node: str
    kinds: tuple[str, ...]
    snapshot: int

    def label(self) -> str:
        return f"Siblings of {self.node!r} via {', '.join(self.kinds)} as of commit {self.snapshot}"


@dataclass(frozen=True)
class ShortestPath(Plan):
    """Every node on a shortest directed path src -> dst; hop = distance from src."""

    src: str
    dst: str
    kinds: tuple[str, ...]
    snapshot: int

    def label(self) -> str:
        return f"ShortestPath {self.src!r} -> {self.dst!r} via {', '.join(self.kinds)} as of commit {self.snapshot}"


@dataclass(frozen=True)
class VectorSearch(Plan):
    """The seeds of a RETRIEVE: the ``k`` best rows of ``entity`` by vector similarity
    and / or keywords, as of ``snapshot``. Run before the SQL (the ``prefilter``'s ids in
    DuckDB, then Lance ANN / full-text search); they and what an :class:`Expand` reaches
    from them are read by the SQL as the relation ``__found``, so the compiled SQL does
    not contain this step: :func:`vector_search` finds it in a plan.

    At least one of ``similar_text``, ``vector_param`` (SIMILAR TO) and ``matching`` is
    set; at most one of the first two."""

    entity: str  # "nodes" | "tasks"
    space: str  # the embedding space SIMILAR TO searches ("embedding" unless IN names one)
    k: int  # how many seeds
    similar_text: str | None  # SIMILAR TO 'text': embed it with the space's embedder
    vector_param: str | None  # SIMILAR TO $name bound to a vector: its name (the vector is Bound.vector)
    matching: str | None  # MATCHING 'keywords' (BM25 over the entity's text column)
    #: WHERE: the ids it allows, as a plan to compile (Project id <- Filter <- [Derive] <- Scan); None: no WHERE
    prefilter: Plan | None
    snapshot: int
    #: no seed is a node quarantined as of ``snapshot`` (the prefilter's scan leaves them out too)
    exclude_quarantined: bool = False

    def __post_init__(self) -> None:
        if self.k < 1:
            raise PlanError("VectorSearch k must be >= 1")
        if self.similar_text is not None and self.vector_param is not None:
            raise PlanError("VectorSearch searches for a text or a vector, not both")
        if self.similar_text is None and self.vector_param is None and self.matching is None:
            raise PlanError("VectorSearch needs SIMILAR TO (a text or a vector) or MATCHING keywords")
        if self.exclude_quarantined and self.entity != "nodes":
            raise PlanError(f"a quarantine holds nodes; a VectorSearch of {self.entity} excludes none")

    def label(self) -> str:
        how = []
        if self.similar_text is not None:
            how.append(f"nearest (cosine) in space {self.space!r} to text {show(A.Literal(self.similar_text))}")
        elif self.vector_param is not None:
            how.append(f"nearest (cosine) in space {self.space!r} to ${self.vector_param} (a vector)")
        if self.matching is not None:
            how.append(f"best keyword (BM25) matches of {show(A.Literal(self.matching))}")
        fused = " fused by reciprocal rank" if len(how) == 2 else ""
        pre = ", among the ids the prefilter below allows" if self.prefilter is not None else ""
        trust = f", {excluding(self.snapshot)}" if self.exclude_quarantined else ""
        return (f"VectorSearch {self.k} {self.entity}: {' + '.join(how)}{fused} as of commit {self.snapshot}{pre}"
                f"{trust}  -- Lance, before the SQL")


@dataclass(frozen=True)
class Expand(Plan):
    """The seeds plus nodes reached from them (relation, seed, seed_rank, hop); one row per node,
    kept at its nearest seed (fewest hops, then best seed rank). Walked before the SQL (the
    in-memory adjacency), then read by it as the relation ``__found``. ``exclude_quarantined``:
    the SQL leaves out the quarantined nodes the walk reached (the walk goes through them)."""

    input: Plan
    items: tuple[tuple[str, int], ...]  # (ancestors | descendants | siblings | lineage, hops)
    kinds: tuple[str, ...]
    entity: str = "nodes"
    exclude_quarantined: bool = False

    def label(self) -> str:
        steps = ", ".join(d if d == "siblings" else f"{d} {h}" for d, h in self.items) or "seeds only"
        trust = ", leaving out the quarantined nodes it reaches" if self.exclude_quarantined else ""
        return f"Expand {steps} via {', '.join(self.kinds)}{trust}"


@dataclass(frozen=True)
class Derive(Plan):
    """Adds reward channels and per-node accessors to node rows."""

    input: Plan
    channels: tuple[str, ...] = ()
    accessors: frozenset[str] = field(default_factory=frozenset)
    kinds: tuple[str, ...] = LINEAGE_KINDS
    #: attributes (key, type of their values) and labels the statement reads
    attrs: tuple[tuple[str, str], ...] = ()
    labels: tuple[str, ...] = ()

    def label(self) -> str:
        parts = [f"reward({c!r})" for c in self.channels] + sorted(self.accessors)
        parts += [f"attr({k!r}) as {t}" for k, t in self.attrs] + [f"has_label({lab!r})" for lab in self.labels]
        return f"Derive {', '.join(parts)}"


@dataclass(frozen=True)
class Filter(Plan):
    input: Plan
    predicate: A.Expr
    note: str = ""

    def label(self) -> str:
        return f"Filter {show(self.predicate)}{f'  -- {self.note}' if self.note else ''}"


@dataclass(frozen=True)
class TopPerGroup(Plan):
    """At most ``k`` rows per value of the expression ``per`` (nulls form one group), the best by ``keys``."""

    input: Plan
    per: A.Expr
    k: int
    keys: tuple[A.OrderItem, ...]
    tiebreak: tuple[str, ...] = TIEBREAK

    def __post_init__(self) -> None:
        if self.k < 1:
            raise PlanError("TopPerGroup k must be >= 1")
        _check_keys(self.keys)

    def label(self) -> str:
        return f"TopPerGroup {self.k} per {show(self.per)} by {_keys(self.keys, self.tiebreak)}"


#: Where an Aggregate puts a group key / an aggregate: internal column names, never user text.
_OUTPUT = re.compile(r"__[ga][0-9]+")


@dataclass(frozen=True)
class Aggregate(Plan):
    """One row per distinct combination of the ``keys`` (one row in all when there are none), holding the
    keys and the ``aggregates``, each in the internal column it names (``__g1``..., ``__a1``...). The
    operators above read those columns: HAVING is a ``Filter``, then ``Sort``, ``Limit``, ``Project``."""

    input: Plan
    keys: tuple[tuple[A.Expr, str], ...]
    aggregates: tuple[tuple[A.AggCall, str], ...]

    def __post_init__(self) -> None:
        names = [n for _, n in self.keys] + [n for _, n in self.aggregates]
        if len(set(names)) != len(names) or not all(_OUTPUT.fullmatch(n) for n in names):
            raise PlanError("Aggregate outputs need distinct internal names such as __g1 (a key), __a1 (an aggregate)")
        if not names:
            raise PlanError("Aggregate needs a key or an aggregate")
        if not all(isinstance(a, A.AggCall) for a, _ in self.aggregates):
            raise PlanError("Aggregate computes aggregates (count, sum, avg, min, max)")

    def label(self) -> str:
        aggs = ", ".join(f"{show(a)} AS {n}" for a, n in self.aggregates)
        keys = ", ".join(f"{show(k)} AS {n}" for k, n in self.keys)
        if not keys:
            return f"Aggregate {aggs} over all rows (one row)"
        return f"Aggregate {aggs + ' ' if aggs else ''}by {keys}"


@dataclass(frozen=True)
class Sort(Plan):
    input: Plan
    keys: tuple[A.OrderItem, ...]
    tiebreak: tuple[str, ...] = TIEBREAK

    def __post_init__(self) -> None:
        _check_keys(self.keys)

    def label(self) -> str:
        return f"Sort {_keys(self.keys, self.tiebreak)}"


@dataclass(frozen=True)
class Limit(Plan):
    input: Plan
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise PlanError("Limit must be >= 0")

    def label(self) -> str:
        return f"Limit {self.n}"


@dataclass(frozen=True)
class Project(Plan):
    input: Plan
    columns: tuple[A.Proj, ...]

    def __post_init__(self) -> None:
        names = [p.alias for p in self.columns]
        if len(set(names)) != len(names) or not all(names):
            raise PlanError("Project columns need distinct names")

    def label(self) -> str:
        return "Project " + ", ".join(f"{show(p.expr)} AS {p.alias}" for p in self.columns)


#: Every plan operator: a closed union (see the module docs). A new operator class goes here,
#: and then mypy points at each dispatch that lacks a case for it.
Operator = (Scan | Walk | SiblingsOf | ShortestPath | VectorSearch | Expand | Derive | Filter | TopPerGroup
            | Aggregate | Sort | Limit | Project)

OPERATORS: tuple[type[Plan], ...] = get_args(Operator)


def as_operator(p: Plan) -> Operator:
    """``p`` as a member of :data:`Operator`, for a ``match`` over the operators; a
    :class:`Plan` subclass outside the union is a :class:`PlanError`."""
    if not isinstance(p, OPERATORS):
        raise PlanError(f"{type(p).__name__} is not a plan operator; operators: "
                        f"{', '.join(o.__name__ for o in OPERATORS)}")
    return cast(Operator, p)


def vector_search(plan: Plan) -> VectorSearch | None:
    """The vector step of ``plan`` (a RETRIEVE's, under its ``Expand``), or None if it has none.

    >>> from trellisdb.tql.parser import parse
    >>> from trellisdb.tql.resolve import Bound
    >>> q = parse("RETRIEVE 3 SIMILAR TO $v WHERE step > 1 LIMIT 2")
    >>> vs = vector_search(build(Bound(q, q.statement, 7)))
    >>> vs.k, vs.vector_param, vs.similar_text, vs.matching
    (3, 'v', None, None)
    >>> print(vs.prefilter.pretty())  # doctest: +NORMALIZE_WHITESPACE
    Project id AS id
      Filter (step > 1)
        Scan nodes as of commit 7, excluding quarantined nodes (trellis:quarantined as of commit 7); INCLUDE
        QUARANTINED to include them
    >>> vector_search(build(Bound(parse("NODES"), parse("NODES").statement, 7))) is None
    True
    """
    stack = [plan]
    while stack:
        p = stack.pop()
        if isinstance(p, VectorSearch):
            return p
        stack.extend(reversed(p.children()))
    return None


def _check_keys(keys: tuple[A.OrderItem, ...]) -> None:
    if len(keys) > MAX_SORT_KEYS:  # the parser refuses such queries; this guards plans built by hand
        raise PlanError(f"a sort takes at most {MAX_SORT_KEYS} keys, got {len(keys)}; sort by fewer")


def _keys(keys: tuple[A.OrderItem, ...], tie: tuple[str, ...]) -> str:
    ks = [f"{show(k.expr)}{' DESC' if k.descending else ''}" for k in keys]
    return ", ".join(ks) + (", then " if ks and tie else "") + ", ".join(tie)


def default_expanded() -> A.Expr:
    """The default EXPANDED WHEN: the node has a child (``has_children``, i.e.
    ``children > 0``), or a closed status."""
    return A.BoolOp(
        "OR",
        (A.Column("has_children"), A.InList(A.Column("status"), tuple(A.Literal(s) for s in CLOSED_STATUSES), False)),
    )


def _int(v: A.Value | None) -> int:
    """A count the resolver has checked (so a Literal holding an int)."""
    if not isinstance(v, A.Literal) or not isinstance(v.value, int):
        raise PlanError(f"expected a resolved whole number, got {v!r}")
    return v.value


def _str(v: A.Value) -> str:
    if not isinstance(v, A.Literal) or not isinstance(v.value, str):
        raise PlanError(f"expected a resolved string, got {v!r}")
    return v.value


def build(b: Bound) -> Plan:
    """The logical plan of a resolved statement."""
    s = b.statement
    match s:
        case A.Select():
            return _select(b, s)
        case A.Frontier():
            return _frontier(b, s)
        case A.Retrieve():
            return _retrieve(b, s)
        case A.Lineage():
            seed = _str(s.node)
            hops = _int(s.depth) if s.depth is not None else MAX_HOPS
            direction = "descendants" if s.direction == "subtree" else s.direction
            return _graph(b, Walk(seed, direction, s.via, hops, b.snapshot), s.where, "hop", s.returning)
        case A.Siblings():
            return _graph(b, SiblingsOf(_str(s.node), s.via, b.snapshot), s.where, "shared_parent", s.returning)
        case A.PathQuery():
            return _graph(b, ShortestPath(_str(s.src), _str(s.dst), s.via, b.snapshot), None, "hop", s.returning)
        case _:
            assert_never(s)


def _derive(node: Plan, b: Bound, *, always: bool = False) -> Plan:
    """``node`` with the statement's reward channels, accessors, attributes and labels added
    (a Derive; a plain scan needs one only if the statement reads any)."""
    if always or b.channels or b.accessors or b.attrs or b.labels:
        return Derive(node, b.channels, b.accessors, attrs=b.attrs, labels=b.labels)
    return node


def _select(b: Bound, s: A.Select) -> Plan:
    node: Plan = Scan(s.entity, b.snapshot, s.scope)
    node = _derive(node, b)
    if s.where is not None:
        node = Filter(node, s.where)
    if s.grouped:
        return _grouped(node, s)
    if s.diversity is not None:
        node = TopPerGroup(node, s.diversity.per, _int(s.diversity.k), s.order, tiebreak(s.entity))
    node = Sort(node, s.order, tiebreak(s.entity))  # always: the same query, the same row order
    if s.limit is not None:
        node = Limit(node, _int(s.limit))
    if s.returning:
        node = Project(node, s.returning)
    return node


def _grouped(node: Plan, s: A.Select) -> Plan:
    """A grouped selection over ``node`` (its rows after WHERE): Aggregate, then HAVING, ORDER BY (ties
    broken by the group keys, which differ between groups), LIMIT and RETURN, over the Aggregate's columns."""
    cols: dict[str, str] = {}  # show(key or aggregate) -> the Aggregate's column holding it
    keys: list[tuple[A.Expr, str]] = []
    for k in s.group_by:
        if show(k) not in cols:
            cols[show(k)] = f"__g{len(keys) + 1}"
            keys.append((k, cols[show(k)]))
    aggs: list[tuple[A.AggCall, str]] = []
    exprs = [p.expr for p in s.returning] + ([s.having] if s.having is not None else []) + [o.expr for o in s.order]
    for e in exprs:
        for a in _aggregates(e):
            if show(a) not in cols:
                cols[show(a)] = f"__a{len(aggs) + 1}"
                aggs.append((a, cols[show(a)]))
    node = Aggregate(node, tuple(keys), tuple(aggs))
    if s.having is not None:
        node = Filter(node, _over(s.having, cols), "HAVING")
    order = tuple(A.OrderItem(_over(o.expr, cols), o.descending) for o in s.order)
    ties = tuple(n for _, n in keys)
    if order or ties:
        node = Sort(node, order, ties)
    if s.limit is not None:
        node = Limit(node, _int(s.limit))
    return Project(node, tuple(A.Proj(_over(p.expr, cols), p.alias) for p in s.returning))


def _aggregates(e: A.Expr) -> list[A.AggCall]:
    """The aggregates in ``e``, left to right."""
    if isinstance(e, A.AggCall):
        return [e]
    out: list[A.AggCall] = []
    for f in dataclasses.fields(e):
        v = getattr(e, f.name)
        for x in v if isinstance(v, tuple) else (v,):
            if dataclasses.is_dataclass(x) and not isinstance(x, type | A.Span):
                out += _aggregates(cast(A.Expr, x))
    return out


def _over(e: A.Expr, cols: dict[str, str]) -> A.Expr:
    """``e`` over an Aggregate's columns: each key or aggregate in it becomes the column holding it."""
    name = cols.get(show(e))
    if name is not None:
        return A.Column(name, e.span)
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(e):
        v = getattr(e, f.name)
        if isinstance(v, A.Span) or not (dataclasses.is_dataclass(v) or isinstance(v, tuple)):
            continue
        if isinstance(v, tuple):
            changes[f.name] = tuple(_over(cast(A.Expr, x), cols) if dataclasses.is_dataclass(x) else x for x in v)
        else:
            changes[f.name] = _over(cast(A.Expr, v), cols)
    return dataclasses.replace(e, **changes) if changes else e


def _frontier(b: Bound, s: A.Frontier) -> Plan:
    scan = Scan("nodes", b.snapshot, s.scope, exclude_quarantined=not s.include_quarantined)
    node: Plan = _derive(scan, b, always=True)
    expanded = s.expanded if s.expanded is not None else default_expanded()
    node = Filter(node, A.Not(expanded), "not yet expanded" if s.expanded is None else "EXPANDED WHEN")
    if s.where is not None:
        node = Filter(node, s.where)
    if s.diversity is not None:
        node = TopPerGroup(node, s.diversity.per, _int(s.diversity.k), s.rank)
    node = Sort(node, s.rank)
    if s.limit is not None:
        node = Limit(node, _int(s.limit))
    if s.returning:
        node = Project(node, s.returning)
    return node


def _retrieve(b: Bound, s: A.Retrieve) -> Plan:
    exclude = s.entity == "nodes" and not s.include_quarantined
    search = VectorSearch(
        entity=s.entity,
        space=s.space or "embedding",
        k=_int(s.k),
        similar_text=_str(s.similar) if isinstance(s.similar, A.Literal) else None,
        vector_param=s.similar.name if isinstance(s.similar, A.Param) else None,
        matching=_str(s.matching) if s.matching is not None else None,
        prefilter=_prefilter(b, s, exclude),
        snapshot=b.snapshot,
        exclude_quarantined=exclude,
    )
    items = tuple((e.direction, _int(e.hops)) for e in s.expand)
    node: Plan = _derive(Expand(search, items, s.via, s.entity, exclude_quarantined=exclude), b, always=True)
    node = Sort(node, s.rank, ("seed_rank", "hop", "id"))
    if s.limit is not None:
        node = Limit(node, _int(s.limit))
    if s.returning:
        node = Project(node, s.returning)
    return node


def _prefilter(b: Bound, s: A.Retrieve, exclude: bool) -> Plan | None:
    """The ids RETRIEVE's WHERE allows (None: no WHERE). It sees the entity's columns and
    the statement's reward channels and accessors, not the RETRIEVE columns; ``exclude``:
    not the quarantined nodes."""
    if s.where is None:
        return None
    node = _derive(Scan(s.entity, b.snapshot, exclude_quarantined=exclude), b)
    return Project(Filter(node, s.where), (A.Proj(A.Column("id"), "id"),))


def _graph(b: Bound, source: Plan, where: A.Expr | None, order: str, returning: tuple[A.Proj, ...]) -> Plan:
    """A graph statement (LINEAGE, SUBTREE, SIBLINGS, PATH) over its ``source`` relation."""
    node: Plan = _derive(source, b, always=True)
    if where is not None:
        node = Filter(node, where)
    node = Sort(node, (A.OrderItem(A.Column(order), False),))
    if returning:
        node = Project(node, returning)
    return node
