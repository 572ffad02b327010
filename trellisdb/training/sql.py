"""The SQL every view kind shares: the selected nodes (a TQL condition and reward), their
artifacts by role, their groups, and the pieces of the path kinds.

A view's SQL is built in two layers. ``base`` compiles the view's ``where`` and ``reward``
with the TQL stages (``NODES WHERE <where> RETURN id, task_id, (<reward>) AS __reward AS OF
COMMIT c``), so names, types and parameters are checked as in a query; its scan leaves out the
nodes quarantined as of ``c`` unless the view has ``include_quarantined``. Around that SQL,
``common`` gives the CTEs every kind starts from: ``b`` (the selected nodes), ``a`` (with
their artifact hashes by role) and ``g`` (their group memberships); each kind
(``kinds/<kind>.py``) adds its own CTEs and the statement's body.

A refresh runs the same SQL restricted to the nodes and groups the commits touched: the
relations ``__members`` (the nodes it may read), ``__dirty_groups`` and ``__dirty_nodes``
(``__dirty_leaves`` for the path kinds), and for parent groups ``__group_edges``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from trellisdb.errors import QueryError
from trellisdb.tql import plan as P
from trellisdb.tql.compile import compile_plan
from trellisdb.tql.parser import parse
from trellisdb.tql.resolve import Catalog, resolve
from trellisdb.tql.run import catalog
from trellisdb.training.options import ViewOptions

if TYPE_CHECKING:
    from trellisdb.snapshot import Snapshot

#: Steps a path follows back at most (a guard against cycles in bad data).
MAX_DEPTH = 1000

#: The artifact roles (hash column prefix, parameter) a kind's rows name.
ALL_ROLES: Final = (("system", "$__sys"), ("prompt", "$__prompt"), ("response", "$__resp"))
PROMPT_ROLES: Final = (("system", "$__sys"), ("prompt", "$__prompt"))
#: sft with ``messages=``: a node's chat turns, one artifact (JSON)
MESSAGE_ROLES: Final = (("message", "$__msgs"),)

#: Per group: mean, population std, size and success rate, summed in insertion order over a sorted
#: list, so a group's figures are the same to the last bit whichever query computes them
#: (a parallel avg() adds in arrival order: a refresh would differ from a rebuild in the last bit).
GROUP_STATS = (
    "SELECT grp, list_avg(rs) AS m, list_aggregate(rs, 'stddev_pop') AS sd, len(rs) AS n, "
    "list_avg(list_transform(rs, lambda x: CASE WHEN x >= coalesce($__threshold, 0) THEN 1.0 ELSE 0.0 END)) "
    "AS success FROM (SELECT grp, list(__reward ORDER BY __seq, id) AS rs FROM g GROUP BY grp)"
)


@dataclass(frozen=True)
class Base:
    """The selected nodes ``(id, task_id, __reward)`` as SQL: ``full`` reads every node;
    ``members`` the same plan with its scan restricted to relation ``__members`` (a refresh:
    only those nodes and their rewards are read, the TQL compiler's ``Scan.restrict_to``).
    ``accessors``: the condition reads other nodes (e.g. ``children``: no incremental refresh)."""

    full: str
    members: str
    params: dict[str, Any]
    accessors: bool


def base(spec: ViewOptions, cat: Catalog, commit: int) -> Base:
    """The view's selected nodes as of ``commit`` (names resolved against ``cat``), compiled twice:
    whole, and restricted to a refresh's ``__members``."""
    reward = spec.reward or "NULL"
    where = f" WHERE {spec.where}" if spec.where else ""
    text = f"NODES{where} RETURN id, task_id, ({reward}) AS __reward, seq AS __seq AS OF COMMIT {commit}"
    try:
        bound = resolve(parse(text), cat, {})
        plan = P.build(bound)
        if isinstance(plan, P.Project) and isinstance(plan.input, P.Sort):  # the view sorts its own rows
            plan = dataclasses.replace(plan, input=plan.input.input)
        if not spec.include_quarantined:  # a quarantined node is not selected, as if the where left it out
            plan = _scan(plan, exclude_quarantined=True)
        compiled = compile_plan(plan)
        members = compile_plan(_scan(plan, restrict_to=MEMBERS))
    except QueryError as e:
        raise type(e)(f"view {spec.name!r}: {e}") from None
    assert members.params == compiled.params  # the restriction adds no values
    return Base(compiled.sql, members.sql, dict(compiled.params), bool(bound.accessors))


#: The relation of the nodes a refresh may read.
MEMBERS: Final = "__members"


def _scan(plan: P.Plan, **changes: Any) -> P.Plan:
    """``plan`` with its nodes scan changed: restricted to the ids in a relation (``restrict_to``),
    leaving out the quarantined nodes (``exclude_quarantined``)."""
    match plan:
        case P.Scan():
            return dataclasses.replace(plan, **changes)
        case P.Project() | P.Filter() | P.Derive() | P.Sort() | P.Limit() | P.TopPerGroup():
            return dataclasses.replace(plan, input=_scan(plan.input, **changes))
        case _:
            raise QueryError(f"a view's nodes come from a scan, not a {type(plan).__name__}")


def base_at(snap: Snapshot, spec: ViewOptions) -> Base:
    """``base`` as of the snapshot's commit, names resolved against its catalog."""
    return base(spec, catalog(snap), snap.commit)


def kinds_in(spec: ViewOptions) -> str:
    """The view's edge kinds as an SQL list (validated names, not user text)."""
    return ", ".join(f"'{k}'" for k in spec.via)


def common(
    spec: ViewOptions, base: Base, *, restrict: bool, group_edges: bool, roles: tuple[tuple[str, str], ...],
    scored: bool, paths: bool,
) -> list[str]:
    """CTEs every kind starts from: ``a`` (selected nodes with their artifact hashes: ``roles``)
    and ``g`` (their group memberships: one row per (node, parent) or (node, prompt)). ``scored``:
    only nodes with a reward are selected; ``paths``: the kind reads ancestors (its base is
    not restricted to the members)."""
    kinds = kinds_in(spec)
    # a refresh of a kind that is not a path reads only the members (and their rewards)
    nodes = base.members if restrict and not paths else base.full
    # (node_id, name) is the current node_artifacts' key: one join per role, no pivot GROUP BY
    # (a 1M-node preference compute 2.43 -> 2.24 s, grpo 2.82 -> 2.55 s); only the roles the kind names
    ctes = [f"b AS (SELECT * FROM ({nodes}) WHERE {'__reward IS NOT NULL' if scored else 'true'})",
            "art AS (SELECT node_id, name, hash FROM node_artifacts "
            f"WHERE name IN ({', '.join(p for _, p in roles)}) AND node_id IN (SELECT id FROM b))",
            "a AS (SELECT b.id, b.task_id, b.__reward, b.__seq, " + ", ".join(f"{c}.hash AS {c}_hash" for c, _ in roles)
            + " FROM b " + " ".join(f"LEFT JOIN art {c} ON {c}.node_id = b.id AND {c}.name = {p}" for c, p in roles)
            + ")"]
    if spec.group_by == "parent":
        # restricted: only the edges into members from dirty groups (the DISTINCT over every edge
        # is the largest cost of a small refresh otherwise); the joins below keep no others anyway
        only = " AND dst IN (SELECT id FROM __members) AND src IN (SELECT grp FROM __dirty_groups)" if restrict else ""
        edges = "__group_edges" if restrict and group_edges else f"edges WHERE kind IN ({kinds}){only}"
        ctes.append(f"g0 AS (SELECT a.*, e.src AS grp FROM a JOIN (SELECT DISTINCT src, dst FROM {edges}) e "
                    "ON e.dst = a.id)")
    else:
        ctes.append("g0 AS (SELECT a.*, a.prompt_hash AS grp FROM a WHERE a.prompt_hash IS NOT NULL)")
    # (restricted parent groups come from the dirty groups' edges already)
    group_filter = " WHERE grp IN (SELECT grp FROM __dirty_groups)" if restrict and spec.group_by != "parent" else ""
    ctes.append(f"g AS (SELECT * FROM g0{group_filter})")
    return ctes


def first_parents(spec: ViewOptions) -> str:
    """CTE ``par``: each selected node's first parent (the smallest parent id among the selected)."""
    return (f"par AS (SELECT dst AS id, min(src) AS parent FROM edges WHERE kind IN ({kinds_in(spec)}) "
            "AND src IN (SELECT id FROM a) AND dst IN (SELECT id FROM a) GROUP BY dst)")


def paths_from(leaves: str) -> str:
    """CTE ``path`` (recursive): from each node of CTE ``leaves`` back to its root along ``par``,
    one row per (leaf, node, depth); the leaf is depth 0."""
    return (f"path AS (SELECT id AS leaf, id, 0 AS depth FROM {leaves} UNION ALL "
            "SELECT p.leaf, par.parent, p.depth + 1 FROM path p JOIN par ON par.id = p.id "
            f"WHERE p.depth < {MAX_DEPTH})")


def option_params(spec: ViewOptions) -> dict[str, Any]:
    """The parameters the kinds' SQL reads (``$__sys``, ``$__threshold`` ...)."""
    return {"__sys": spec.system, "__prompt": spec.prompt, "__resp": spec.response, "__msgs": spec.messages,
            "__threshold": spec.threshold,
            "__margin": float(spec.margin), "__min": spec.min_size}


def used(sql: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters ``sql`` names."""
    return {k: v for k, v in params.items() if f"${k}" in sql}
