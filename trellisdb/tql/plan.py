"""Logical plans: frozen, self-validating operator trees, printable.

A plan reads bottom-up: a source (``Scan`` of an entity, or a graph walk),
then ``Derive`` (reward channels and per-node accessors), ``Filter``,
``TopPerGroup`` (diversity), ``Sort``, ``Limit`` and ``Project``.

>>> from trellisdb.tql.parser import parse
>>> from trellisdb.tql.resolve import Bound
>>> q = parse("NODES WHERE step > 1 ORDER BY step DESC LIMIT 3")
>>> print(build(Bound(q, q.statement, 7)).pretty())
Limit 3
  Sort step DESC, then commit_id, id
    Filter (step > 1)
      Scan nodes as of commit 7
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trellisdb.errors import QueryError
from trellisdb.tql import ast as A
from trellisdb.tql.parser import MAX_SORT_KEYS
from trellisdb.tql.resolve import CLOSED_STATUSES, ENTITY_COLUMNS, LINEAGE_KINDS, MAX_HOPS, Bound
from trellisdb.tql.show import show

#: Columns every ordering ends with, so ties break the same way every time:
#: the commit of the row, then the entity's key.
TIEBREAK = ("commit_id", "id")


def tiebreak(entity: str) -> tuple[str, ...]:
    from trellisdb.schema import KEYS

    return ("commit_id", *KEYS[entity])


class PlanError(QueryError):
    """A plan that breaks an operator's rule (a bug in the planner, reported clearly)."""


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
    entity: str
    snapshot: int
    scope: A.Scope | None = None

    def __post_init__(self) -> None:
        if self.entity not in ENTITY_COLUMNS:
            raise PlanError(f"Scan of unknown entity {self.entity!r}")
        if self.snapshot < 0:
            raise PlanError("Scan snapshot must be >= 0")

    def label(self) -> str:
        sc = f" in {self.scope.kind} {show(self.scope.value)}" if self.scope else ""
        return f"Scan {self.entity}{sc} as of commit {self.snapshot}"


@dataclass(frozen=True)
class Walk(Plan):
    """Nodes reachable from ``seed`` along ``kinds`` edges, with their hop count (seed: 0)."""

    seed: str
    direction: str  # "ancestors" | "descendants"
    kinds: tuple[str, ...]
    max_hops: int
    snapshot: int

    def __post_init__(self) -> None:
        if self.direction not in ("ancestors", "descendants"):
            raise PlanError(f"Walk direction {self.direction!r}")
        if not 0 <= self.max_hops <= MAX_HOPS:
            raise PlanError(f"Walk hops must be within 0..{MAX_HOPS}")
        if not self.kinds:
            raise PlanError("Walk needs at least one edge kind")

    def label(self) -> str:
        return (f"Walk {self.direction} of {self.seed!r} up to {self.max_hops} hops via {', '.join(self.kinds)}"
                f" as of commit {self.snapshot}")


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
    """The seeds of a RETRIEVE: run before the SQL (Lance ANN / full-text search); they and
    what an Expand reaches from them are read by the SQL as the relation ``__found``."""

    entity: str
    space: str
    k: int
    similar: str | None  # what the vector is: "text '...'" or "$v (vector)"
    matching: str | None
    prefilter: A.Expr | None
    snapshot: int

    def label(self) -> str:
        how = []
        if self.similar is not None:
            how.append(f"nearest (cosine) in space {self.space!r} to {self.similar}")
        if self.matching is not None:
            how.append(f"best keyword (BM25) matches of {self.matching}")
        fused = " fused by reciprocal rank" if len(how) == 2 else ""
        pre = f", prefilter {show(self.prefilter)}" if self.prefilter is not None else ""
        return (f"VectorSearch {self.k} {self.entity}: {' + '.join(how)}{fused}{pre} as of commit {self.snapshot}"
                "  -- Lance, before the SQL")


@dataclass(frozen=True)
class Expand(Plan):
    """The seeds plus nodes reached from them (relation, seed, seed_rank, hop); one row per node,
    kept at its nearest seed (fewest hops, then best seed rank). Walked before the SQL (the
    in-memory adjacency), then read by it as the relation ``__found``."""

    input: Plan
    items: tuple[tuple[str, int], ...]  # (ancestors | descendants | siblings | lineage, hops)
    kinds: tuple[str, ...]
    entity: str = "nodes"

    def label(self) -> str:
        steps = ", ".join(d if d == "siblings" else f"{d} {h}" for d, h in self.items) or "seeds only"
        return f"Expand {steps} via {', '.join(self.kinds)}"


@dataclass(frozen=True)
class Derive(Plan):
    """Adds reward channels and per-node accessors to node rows."""

    input: Plan
    channels: tuple[str, ...] = ()
    accessors: frozenset[str] = field(default_factory=frozenset)
    kinds: tuple[str, ...] = LINEAGE_KINDS

    def label(self) -> str:
        parts = [f"reward({c!r})" for c in self.channels] + sorted(self.accessors)
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
    """At most ``k`` rows per ``per`` value, the best by ``keys``."""

    input: Plan
    per: str
    k: int
    keys: tuple[A.OrderItem, ...]
    tiebreak: tuple[str, ...] = TIEBREAK

    def __post_init__(self) -> None:
        if self.k < 1:
            raise PlanError("TopPerGroup k must be >= 1")
        _check_keys(self.keys)

    def label(self) -> str:
        return f"TopPerGroup {self.k} per {self.per} by {_keys(self.keys, self.tiebreak)}"


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


def _check_keys(keys: tuple[A.OrderItem, ...]) -> None:
    if len(keys) > MAX_SORT_KEYS:  # the parser refuses such queries; this guards plans built by hand
        raise PlanError(f"a sort takes at most {MAX_SORT_KEYS} keys, got {len(keys)}; sort by fewer")


def _keys(keys: tuple[A.OrderItem, ...], tie: tuple[str, ...]) -> str:
    ks = [f"{show(k.expr)}{' DESC' if k.descending else ''}" for k in keys]
    return ", ".join(ks) + (", then " if ks else "") + ", ".join(tie)


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
    snap = b.snapshot
    node: Plan
    if isinstance(s, A.Select):
        node = Scan(s.entity, snap, s.scope)
        if b.channels or b.accessors:
            node = Derive(node, b.channels, b.accessors)
        if s.where is not None:
            node = Filter(node, s.where)
        node = Sort(node, s.order, tiebreak(s.entity))  # always: the same query, the same row order
        if s.limit is not None:
            node = Limit(node, _int(s.limit))
        if s.returning:
            node = Project(node, s.returning)
        return node
    if isinstance(s, A.Frontier):
        node = Derive(Scan("nodes", snap, s.scope), b.channels, b.accessors)
        expanded = s.expanded if s.expanded is not None else default_expanded()
        node = Filter(node, A.Not(expanded), "not yet expanded" if s.expanded is None else "EXPANDED WHEN")
        if s.where is not None:
            node = Filter(node, s.where)
        if s.diversity is not None:
            per = "parent" if s.diversity.per == "parent" else "session_id"
            node = TopPerGroup(node, per, _int(s.diversity.k), s.rank)
        node = Sort(node, s.rank)
        if s.limit is not None:
            node = Limit(node, _int(s.limit))
        if s.returning:
            node = Project(node, s.returning)
        return node
    if isinstance(s, A.Retrieve):
        desc = None
        if isinstance(s.similar, A.Param):
            desc = f"${s.similar.name} (a vector)"
        elif s.similar is not None:
            desc = f"text {show(s.similar)}"
        search = VectorSearch(s.entity, s.space or "embedding", _int(s.k), desc,
                              show(s.matching) if s.matching is not None else None, s.where, snap)
        items = tuple((e.direction, _int(e.hops)) for e in s.expand)
        node = Derive(Expand(search, items, s.via, s.entity), b.channels, b.accessors)
        node = Sort(node, s.rank, ("seed_rank", "hop", "id"))
        if s.limit is not None:
            node = Limit(node, _int(s.limit))
        if s.returning:
            node = Project(node, s.returning)
        return node
    if isinstance(s, A.Lineage):
        seed = _str(s.node)
        hops = _int(s.depth) if s.depth is not None else MAX_HOPS
        direction = "descendants" if s.direction == "subtree" else s.direction
        node = Walk(seed, direction, s.via, hops, snap)
    elif isinstance(s, A.Siblings):
        node = SiblingsOf(_str(s.node), s.via, snap)
    else:
        node = ShortestPath(_str(s.src), _str(s.dst), s.via, snap)
    node = Derive(node, b.channels, b.accessors)
    where = getattr(s, "where", None)
    if where is not None:
        node = Filter(node, where)
    order = "shared_parent" if isinstance(s, A.Siblings) else "hop"
    node = Sort(node, (A.OrderItem(A.Column(order), False),))
    if s.returning:
        node = Project(node, s.returning)
    return node
