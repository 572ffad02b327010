"""Run TQL: parse -> resolve -> plan -> compile -> DuckDB -> Arrow.

This is the stage that touches the database; the others are pure functions.
"""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import pyarrow as pa

from trellisdb.errors import QueryError, QueryNameError, ReadOnlyError, UnknownNodeError
from trellisdb.graph import EMPTY_FOUND
from trellisdb.reader import unbounded
from trellisdb.result import Result
from trellisdb.tql import ast as A
from trellisdb.tql import plan as P
from trellisdb.tql.compile import Compiled, compile_plan
from trellisdb.tql.parser import parse
from trellisdb.tql.plan import Plan, build
from trellisdb.tql.resolve import LINEAGE_KINDS, Bound, Catalog, Resolver, resolve
from trellisdb.tql.retrieve import describe_search, expand, vector_step

if TYPE_CHECKING:
    import networkx as nx

    from trellisdb.snapshot import Reads, Snapshot
    from trellisdb.vectors.service import Vectors


class ViewCommands(Protocol):
    """What the view statements (CREATE VIEW, MATERIALIZE, REFRESH, EXPORT, DROP VIEW, SHOW
    VIEWS) call: the database handle's view methods."""

    read_only: bool

    def views(self) -> list[dict[str, Any]]: ...

    def create_view(self, name: str, kind: str, *, replace: bool = False, **options: Any) -> dict[str, Any]: ...

    def materialize(self, name: str, as_of: int | str | None = None) -> dict[str, Any]: ...

    def refresh(self, name: str) -> dict[str, Any]: ...

    def export(self, name: str, path: str, format: str = "trl", *, validation: float = 0.0,
               overwrite: bool = False, skip_missing: bool = False) -> dict[str, Any]: ...

    def export_target(self, path: str) -> str: ...

    def drop_view(self, name: str) -> None: ...


class QueryResult(Result):
    """The answer to a TQL query: a table, plus its plan, SQL and graph view."""

    def __init__(self, table: pa.Table, snap: Snapshot, vectors: Vectors, bound: Bound, plan: Plan,
                 compiled: Compiled, search: str | None = None) -> None:
        super().__init__(table, sql=compiled.sql)
        self.params = compiled.params
        self.plan = plan
        self.snapshot = bound.snapshot
        #: RETRIEVE: what the vector / keyword step did (strategy, rounds, rows fetched)
        self.search = search
        self._snap = snap
        self._vectors = vectors
        self._bound = bound

    @classmethod
    def of_command(cls, table: pa.Table, snap: Snapshot) -> QueryResult:
        """The answer to a view statement (CREATE VIEW, MATERIALIZE, ...): a table, no plan."""
        self = cls.__new__(cls)
        Result.__init__(self, table, sql=None)
        self.params, self.plan, self.search = {}, None, None  # type: ignore[assignment]
        self.snapshot = snap.latest
        self._snap, self._vectors, self._bound = snap, None, None  # type: ignore[assignment]
        return self

    def explain(self) -> str:
        """The logical plan, the vector step (RETRIEVE), the SQL and DuckDB's physical plan."""
        if self._bound is None:
            raise QueryError("a view statement has no plan to explain")
        return explain_text(self._snap, self._vectors, self._bound, self.plan, Compiled(self.sql or "", self.params), self.search)

    def edges(self) -> pa.Table:
        """The edges (src, dst, kind) between the result's nodes, as of the query's snapshot."""
        if self._bound is None or "id" not in self.columns or getattr(self._bound.statement, "entity", "nodes") != "nodes":
            raise QueryError("edges() needs a result of nodes with an id column (e.g. RETRIEVE, LINEAGE, FRONTIER)")
        ids = pa.table({"id": self._table.column("id").cast(pa.string())})
        return self._snap.execute(
            "SELECT src, dst, kind FROM edges WHERE src IN (SELECT id FROM __ids) AND dst IN (SELECT id FROM __ids) "
            "ORDER BY src, dst, kind", relations={"__ids": ids}, tables=("edges",),
        )

    def subgraph(self) -> dict[str, pa.Table]:
        """The result as tables: ``{"nodes": <the rows>, "edges": <edges between them>}``."""
        return {"nodes": self._table, "edges": self.edges()}

    def to_networkx(self) -> nx.DiGraph:
        """The result's nodes (with their columns as attributes) and the edges between them.

        Edges run parent -> child (``src -> dst``) and carry their ``kind``;
        only edges committed as of the query's snapshot are included.
        """
        import networkx as nx

        edges = self.edges()
        g: nx.DiGraph = nx.DiGraph()
        for r in self.to_pylist():
            g.add_node(r["id"], **{k: v for k, v in r.items() if k != "id"})
        via = set(getattr(self._bound.statement, "via", ()) or ()) | set(LINEAGE_KINDS)
        for src, dst, kind in zip(*(edges.column(c).to_pylist() for c in ("src", "dst", "kind")), strict=True):
            if kind in via:
                g.add_edge(src, dst, kind=kind)
        return g

    # ------------------------------------------------------------ display (see trellisdb/result.py)
    def _about(self) -> list[str]:
        """The caption's metadata: the commit the rows are as of, its tags, the latest commit
        when that is a later one (time travel), and what a RETRIEVE's search did."""
        tags = sorted(t for t, c in self._snap.tags.items() if c == self.snapshot)
        notes = [f"tag{'s' if len(tags) > 1 else ''} {', '.join(map(repr, tags))}"] if tags else []
        if self._snap.latest != self.snapshot:
            notes.append(f"the latest is {self._snap.latest}")
        about = [f"as of commit {self.snapshot}" + (f" ({'; '.join(notes)})" if notes else "")]
        return about + ([self.search] if self.search else [])

    def _explained(self) -> str | None:
        """An EXPLAIN's text, which a display shows whole rather than as a cut cell."""
        if self._bound is None or not self._bound.query.explain or self._table.num_rows != 1:
            return None
        return str(self._table.column(0)[0].as_py())

    def __repr__(self) -> str:
        text = self._explained()
        return super().__repr__() if text is None else f"{self._caption()[0]}\n{text}"

    def _repr_html_(self) -> str:
        text = self._explained()
        if text is None:
            return super()._repr_html_()
        return f"<div>{html.escape(self._caption()[0])}</div>\n<pre>{html.escape(text)}</pre>"


def catalog(latest: Snapshot) -> Catalog:
    """The names a query may use, from the latest snapshot."""
    return Catalog(
        channels=lambda: latest.name_set("rewards", "channel"),
        sessions=lambda: latest.name_set("sessions", "id"),
        tasks=lambda: latest.name_set("tasks", "id"),
        tags=latest.state.tags,
        commits=latest.state.commits,
        last_commit=latest.commit,
        step_commit=latest.step_commit,
        session_steps=lambda sid: [int(r["step"]) for r in latest.rows(
            "SELECT DISTINCT step FROM nodes_history WHERE session_id = $1 AND step IS NOT NULL ORDER BY step", [sid])],
        spaces=lambda target: {sp.name: sp.dim for sp in latest.spaces() if sp.target == target},
        attr_types=lambda scope: attribute_types(latest, scope),
    )


def attribute_types(snap: Snapshot, scope: str) -> dict[str, str]:
    """The attribute keys of ``scope`` ever set (as of ``snap``) and the type of their values:
    number, text or bool when every value ever set was one, else json. From the history, so a
    key's type does not change with AS OF."""
    rows = snap.rows(
        "SELECT key, bool_and(num IS NOT NULL) AS n, bool_and(text IS NOT NULL) AS t, "
        "bool_and(value IN ('true', 'false')) AS b FROM attributes_history "
        "WHERE scope = $1 AND NOT retracted GROUP BY key", [scope])
    return {r["key"]: "number" if r["n"] else "text" if r["t"] else "bool" if r["b"] else "json" for r in rows}


def prepare(latest: Snapshot, text: str, params: Mapping[str, Any]) -> tuple[Bound, Plan, Compiled]:
    q = parse(text)  # within the size limits of tql/parser.py, the later stages stay shallow
    bound = resolve(q, catalog(latest), params)
    plan = build(bound)
    return bound, plan, compile_plan(plan)


def explain_text(snap: Snapshot, vectors: Vectors, bound: Bound, plan: Plan, compiled: Compiled,
                 search: str | None = None) -> str:
    rel = {"__found": EMPTY_FOUND} if isinstance(bound.statement, A.Retrieve) else None
    physical = snap.execute("EXPLAIN " + compiled.sql, compiled.params, relations=rel)
    duck = "\n".join(str(v) for v in physical.column(physical.num_columns - 1).to_pylist()) if physical.num_rows else ""
    params = ", ".join(f"${k} = {v!r}" for k, v in compiled.params.items()) or "none"
    step = ""
    if isinstance(bound.statement, A.Retrieve):
        step = ("-- vector step (Lance), then the EXPAND's walk (in-memory adjacency): the relation __found\n"
                f"{describe_search(snap, vectors, plan, search)}\n\n")
    return (
        f"-- logical plan\n{plan.pretty()}\n\n{step}-- SQL (DuckDB)\n{compiled.sql}\n-- parameters: {params}\n\n"
        f"-- DuckDB plan\n{duck}"
    )


def view_command(db: ViewCommands, reads: Reads, c: A.ViewCommand, params: Mapping[str, Any]) -> QueryResult:
    """CREATE VIEW / MATERIALIZE / REFRESH / EXPORT / DROP VIEW / SHOW VIEWS: the database's
    view methods (``trellisdb/training/``), answered with a one-row table (SHOW: one per view)."""
    assert c.name is not None or c.action == "show"
    name = c.name or ""
    if c.action == "show":
        vs = db.views()
        return QueryResult.of_command(
            pa.Table.from_pylist(vs) if vs else pa.table({"name": pa.array([], pa.string())}), reads.at())
    if c.action == "create":
        opts = dict(c.options)
        if c.where is not None:
            opts["where"] = c.where
        entry = db.create_view(name, c.kind or "", replace=c.replace, **opts)
    elif c.action == "materialize":
        commit = Resolver(catalog(reads.at()), params).as_of(c.as_of) if c.as_of is not None else None
        entry = db.materialize(name, as_of=commit)
    elif c.action == "refresh":
        entry = db.refresh(name)
    elif c.action == "export":
        path = _export_path(c.path, params)
        m = db.export(name, db.export_target(path), c.format or "trl", **_export_options(c.options))
        entry = {"name": name, "path": path, "format": m["format"], "commit": m["commit"], "rows": m["rows"],
                 "counts": json.dumps(m["counts"]), "layout": m["layout"]}
    else:
        db.drop_view(name)
        entry = {"name": name, "dropped": True}
    row = {k: v for k, v in entry.items() if k not in ("spec", "file")}
    row.setdefault("name", name)
    return QueryResult.of_command(pa.Table.from_pylist([row]), reads.at())


_STATEMENTS = {"create": "CREATE VIEW", "materialize": "MATERIALIZE", "refresh": "REFRESH", "export": "EXPORT",
               "drop": "DROP VIEW"}

#: The options of ``EXPORT ... WITH``: name -> (check, what it takes).
_EXPORT_OPTIONS: dict[str, tuple[Any, str]] = {
    "validation": (lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1,
                   "a fraction in [0, 1)"),
    "overwrite": (lambda v: isinstance(v, bool), "true or false"),
    "skip_missing": (lambda v: isinstance(v, bool), "true or false"),
}


def _export_options(options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in options:
        if key not in _EXPORT_OPTIONS:
            raise QueryError(f"EXPORT has no option {key!r}; its options are {', '.join(_EXPORT_OPTIONS)}")
        ok, what = _EXPORT_OPTIONS[key]
        if not ok(value):
            raise QueryError(f"EXPORT option {key} takes {what}, not {value!r}")
        out[key] = value
    return out


def _export_path(path: A.Value | None, params: Mapping[str, Any]) -> str:
    """The folder an EXPORT names, as written (a 'literal' or a $parameter): relative to the
    export root, which ``Database.export_target`` resolves and confines."""
    value: object = None
    if isinstance(path, A.Literal):
        value = path.value
    elif isinstance(path, A.Param):
        if path.name not in params:
            raise QueryNameError(f"EXPORT ... TO ${path.name}: no value was given for ${path.name}")
        value = params[path.name]
    if not isinstance(value, str):
        raise QueryError("EXPORT ... TO takes a folder path in quotes (or a $parameter holding one), relative to the "
                         "export root, e.g. EXPORT pairs TO 'pairs'")
    return value


def run(reads: Reads, vectors: Vectors, db: ViewCommands, text: str, params: Mapping[str, Any]) -> QueryResult:
    """Answer TQL ``text``: a query over a snapshot, or a view statement run by ``db``."""
    q = parse(text)
    if isinstance(q.statement, A.ViewCommand):
        if db.read_only and q.statement.action != "show":
            raise ReadOnlyError(
                f"{_STATEMENTS[q.statement.action]} changes the database, and this handle is read-only "
                "(read_only=True, trellis --read-only); queries and SHOW VIEWS are what it runs"
            )
        with unbounded():  # the database's own work (materialize, export): no query time limit
            return view_command(db, reads, q.statement, params)
    latest = reads.at()
    bound, plan, compiled = prepare(latest, text, params)
    snap = reads.at_commit(bound.snapshot, latest.state)
    if bound.query.explain:
        out = explain_text(snap, vectors, bound, plan, compiled)
        table = pa.table({"explain": [out]})
        return QueryResult(table, snap, vectors, bound, plan, compiled)
    relations = None
    search = None
    if isinstance(bound.statement, A.Retrieve):
        seeds, search = vector_step(snap, vectors, plan, bound)
        relations = {"__found": expand(snap, plan, seeds)}
    walked = _walk_in_memory(reads, snap, plan)
    if walked is not None:
        plan, rows = walked
        compiled = compile_plan(plan)
        relations = {**(relations or {}), "__walk": rows}
    try:
        table = snap.execute(compiled.sql, compiled.params, relations=relations)
    except QueryError as e:
        if type(e) is not QueryError:
            raise
        first = str(e).split("\n", 1)[0].removeprefix("SQL failed: ")
        raise QueryError(
            f"the query failed in DuckDB: {first}. Usually a type mismatch (text vs number); "
            "`trellis explain` shows the SQL it became"
        ) from e
    if table.num_rows == 0:
        _check_seeds(snap, bound)
    return QueryResult(table, snap, vectors, bound, plan, compiled, search)


def _walks(plan: Plan) -> list[P.Walk]:
    out = [plan] if isinstance(plan, P.Walk) else []
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if isinstance(v, Plan):
            out += _walks(v)
    return out


def _replace(plan: Plan, old: Plan, new: Plan) -> Plan:
    if plan is old:
        return new
    changes = {f.name: _replace(v, old, new) for f in dataclasses.fields(plan)
               if isinstance(v := getattr(plan, f.name), Plan)}
    return dataclasses.replace(plan, **changes) if changes else plan


def _walk_in_memory(reads: Reads, snap: Snapshot, plan: Plan) -> tuple[Plan, pa.Table] | None:
    """A graph walk (LINEAGE) answered over the in-memory adjacency (``graph.py``) instead of a
    recursive CTE: the plan reading its rows as ``__walk``, and the rows (id, hop; the seed at
    hop 0). Building the adjacency costs a scan of every edge, so a process's first walk runs
    as SQL (a one-shot CLI question); its later walks, or any once RETRIEVE built the
    adjacency, go to memory (~1-2 ms instead of ~10 ms per deep lineage at 100k nodes)."""
    walks = _walks(plan)
    if len(walks) != 1:
        return None
    reads.graph_walks += 1
    if reads.graph_walks < 2 and not snap.adjacency_built():
        return None
    w = walks[0]
    forward = [w.direction == "descendants"] * w.max_hops
    found = snap.adjacency().walk(pa.array([w.seed], pa.string()), [(w.direction, forward, [True] * w.max_hops)],
                                  w.kinds, w.snapshot)
    rows = pa.table({"id": pa.concat_arrays([pa.array([w.seed], pa.string()), found["id"].combine_chunks()]),
                     "hop": pa.concat_arrays([pa.array([0], pa.int64()), found["hop"].combine_chunks().cast(pa.int64())])})
    return _replace(plan, w, dataclasses.replace(w, walked=True)), rows


def _check_seeds(snap: Snapshot, bound: Bound) -> None:
    """An empty graph answer because a named node does not exist is an error, not an empty result."""
    s = bound.statement
    names: list[A.Value] = []
    if isinstance(s, A.Lineage | A.Siblings):
        names = [s.node]
    elif isinstance(s, A.PathQuery):
        names = [s.src, s.dst]
    for v in names:
        assert isinstance(v, A.Literal)
        if not snap.rows("SELECT 1 FROM nodes WHERE id = $1 LIMIT 1", [v.value]):
            raise UnknownNodeError(f"node {v.value!r} does not exist as of commit {bound.snapshot}")
