"""Training-data views: experience turned into SFT, preference, GRPO, unpaired, stepwise and replay rows.

A view is declared once (:class:`ViewSpec`, ``db.create_view``), computed by
DuckDB over a snapshot, and *materialized*: its rows stored beside the
database pinned to the commit they were computed at (``db.materialize``).
``db.refresh`` brings it to the latest commit by recomputing only the groups
and nodes the commits since touched; the result equals a full rebuild.
Rows hold artifact *hashes*; the texts they name are resolved when the view is
materialized and kept beside the rows (``texts.py``), so that ``db.export``
(``export.py``) only reads and writes them in the layouts trainers read.

Every view starts from the nodes a TQL condition selects (``where``), each
with a score (``reward``, any TQL expression, e.g. ``reward('correct')``),
and the node's prompt / response / system artifacts (by role name):

==============  ==============================================================
kind            one row per
==============  ==============================================================
``sft``         node with ``reward >= threshold`` (all selected if no threshold);
                with ``path=True`` its root-to-node path (first parents), a
                prompt and a response per step (a multi-turn conversation)
``preference``  (chosen, rejected): siblings (same parent, or same prompt) whose
                rewards differ by at least ``margin`` (ties never pair), and
                explicit ``comparisons`` (majority of votes; they override
                rewards for the pairs they judge); one row per pair
``grpo``        group (the children of a parent, or the nodes of one prompt)
                with ``min_size`` members or more: rewards and advantages
                ``(r - mean) / std`` (population std; 0 when the group has no
                variance, or the group is dropped with ``drop_zero_variance``)
``kto``         node, labelled desirable when ``reward >= threshold``
``stepwise``    trajectory: from each selected node without selected children
                back to its root along first parents (the smallest parent id),
                with a label per step (``reward >= threshold``)
``replay``      sampled node: ``size`` of them without replacement, priority
                ``|advantage|`` within the parent group (``strategy='advantage'``)
                or by the group's success-rate bucket (``strategy='bucket'``,
                ExGRPO-style: medium-difficulty groups first, lower
                ``entropy`` channel first); deterministic under ``seed``
==============  ==============================================================

>>> import tempfile, trellisdb
>>> db = trellisdb.connect(tempfile.mkdtemp() + "/db")
>>> with db.session(task="t", agent="a") as s:
...     root = s.add_node(summary="root", artifacts={"prompt": "pack 26 circles"})
...     for i, score in enumerate([0.2, 0.9, 0.5]):
...         n = s.add_node(parents=[root], artifacts={"prompt": "pack 26 circles", "response": f"try {i}"})
...         s.add_reward(n, "score", score)
>>> v = db.create_view("prefs", "preference", reward="reward('score')", margin=0.35)
>>> db.materialize("prefs")["rows"]
2
>>> sorted(round(r["margin"], 6) for r in db.view("prefs").to_pylist())
[0.4, 0.7]
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import math
import os
import shutil
import weakref
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb import texts
from trellisdb.errors import CorruptionError, QueryError, TrellisError, ValidationError

if TYPE_CHECKING:
    from trellisdb.database import Database

KINDS = ("sft", "preference", "grpo", "kto", "stepwise", "replay")
LINEAGE = ("derived_from", "repair_of", "crossover_of")
#: Steps a stepwise trajectory follows back at most (a guard against cycles in bad data).
MAX_DEPTH = 1000
VIEWS_DIR = "views"
CATALOG = "views.json"
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")

_S, _D, _I, _B = pa.string(), pa.float64(), pa.int64(), pa.bool_()
_HASHES = [("system_hash", _S), ("prompt_hash", _S)]
#: The columns of each kind's rows; ``node_ids`` is the provenance: the nodes behind the row.
SCHEMAS: dict[str, pa.Schema] = {
    "sft": pa.schema([("node_id", _S), ("task_id", _S), ("reward", _D), *_HASHES, ("response_hash", _S),
                      ("node_ids", pa.list_(_S))]),
    "preference": pa.schema([("chosen_id", _S), ("rejected_id", _S), ("task_id", _S), ("group_key", _S),
                             ("margin", _D), ("source", _S), *_HASHES, ("chosen_hash", _S),
                             ("rejected_hash", _S), ("node_ids", pa.list_(_S))]),
    "grpo": pa.schema([("group_key", _S), ("task_id", _S), ("size", _I), ("mean", _D), ("std", _D), *_HASHES,
                       ("node_ids", pa.list_(_S)), ("rewards", pa.list_(_D)), ("advantages", pa.list_(_D))]),
    "kto": pa.schema([("node_id", _S), ("task_id", _S), ("reward", _D), ("label", _B), *_HASHES,
                      ("response_hash", _S), ("node_ids", pa.list_(_S))]),
    # sft with path=True: the root-to-node path, a prompt and a response per step (multi-turn)
    "sft_path": pa.schema([("node_id", _S), ("task_id", _S), ("reward", _D), *_HASHES, ("response_hash", _S),
                           ("node_ids", pa.list_(_S)), ("prompt_hashes", pa.list_(_S)),
                           ("response_hashes", pa.list_(_S))]),
    "stepwise": pa.schema([("node_id", _S), ("task_id", _S), *_HASHES, ("node_ids", pa.list_(_S)),
                           ("response_hashes", pa.list_(_S)), ("rewards", pa.list_(_D)),
                           ("labels", pa.list_(_B))]),
    "replay": pa.schema([("node_id", _S), ("task_id", _S), ("reward", _D), ("group_key", _S),
                         ("advantage", _D), ("priority", _D), ("sample_rank", _I), *_HASHES,
                         ("response_hash", _S), ("node_ids", pa.list_(_S))]),
}
#: Columns that identify a row (the order rows are stored and compared in).
ROW_KEYS = {"sft": ("node_id",), "sft_path": ("node_id",), "preference": ("chosen_id", "rejected_id"), "grpo": ("group_key",),
            "kto": ("node_id",), "stepwise": ("node_id",), "replay": ("sample_rank",)}


@dataclass(frozen=True)
class ViewSpec:
    """A view's definition. ``where`` and ``reward`` are TQL expressions over nodes."""

    name: str
    kind: str
    reward: str | None = None
    where: str | None = None
    threshold: float | None = None
    group_by: str = "parent"  # parent | prompt
    margin: float = 0.0
    pairs_from: tuple[str, ...] = ("siblings", "comparisons")
    min_size: int = 2
    drop_zero_variance: bool = False
    size: int | None = None
    strategy: str = "advantage"  # replay: advantage | bucket
    seed: int = 0
    entropy: str | None = None  # replay, bucket: the reward channel holding a node's entropy
    prompt: str = "prompt"
    response: str = "response"
    system: str = "system_prompt"
    via: tuple[str, ...] = LINEAGE
    path: bool = False  # sft: the root-to-node path as a multi-turn conversation
    #: keep the texts the rows name beside them (``texts.py``): exports read them instead of
    #: resolving them from the artifacts each time, for a copy of the texts on disk
    keep_texts: bool = True

    @property
    def shape(self) -> str:
        """The rows' layout: the kind, or ``sft_path`` for an sft view of paths."""
        return "sft_path" if self.kind == "sft" and self.path else self.kind

    @property
    def paths(self) -> bool:
        """Whether a row follows a node back to its root (stepwise, sft paths): its rows read ancestors."""
        return self.kind == "stepwise" or (self.kind == "sft" and self.path)

    def __post_init__(self) -> None:
        for f in ("reward", "where", "entropy", "prompt", "response", "system"):
            v = getattr(self, f)
            if not (isinstance(v, str) or (v is None and f in ("reward", "where", "entropy"))):
                raise ValidationError(f"view option {f} must be a string, not {v!r}")
        for f in ("seed", "min_size", "size"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValidationError(f"view option {f} must be an integer, not {v!r}")
        for f in ("pairs_from", "via"):
            v = getattr(self, f)
            if not isinstance(v, tuple) or not all(isinstance(x, str) for x in v):
                raise ValidationError(f"view option {f} must be a list of names, not {v!r}")
        for f in ("drop_zero_variance", "path", "keep_texts"):
            if not isinstance(getattr(self, f), bool):
                raise ValidationError(f"{f} must be True or False, not {getattr(self, f)!r}")
        if self.path and self.kind != "sft":
            raise ValidationError(f"path=True is an sft option (the root-to-node path); a {self.kind} view has none")
        if not isinstance(self.name, str) or not self.name or set(self.name) - _NAME_CHARS or len(self.name) > 128:
            raise ValidationError(f"view name {self.name!r} must be 1 to 128 letters, digits, '_' or '-'")
        if self.kind not in KINDS:
            raise ValidationError(f"unknown view kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        if self.reward is None and self.kind != "sft":
            raise ValidationError(f"a {self.kind} view needs reward=..., e.g. reward=\"reward('score')\"")
        if self.group_by not in ("parent", "prompt"):
            raise ValidationError(f"group_by must be 'parent' or 'prompt', not {self.group_by!r}")
        if not (isinstance(self.margin, int | float) and math.isfinite(self.margin) and self.margin >= 0):
            raise ValidationError(f"margin must be a finite number >= 0, not {self.margin!r}")
        if self.threshold is not None and not (isinstance(self.threshold, int | float) and math.isfinite(self.threshold)):
            raise ValidationError(f"threshold must be a finite number, not {self.threshold!r}")
        if self.kind in ("kto", "stepwise") and self.threshold is None:
            raise ValidationError(f"a {self.kind} view needs threshold=... (reward >= threshold is desirable)")
        if set(self.pairs_from) - {"siblings", "comparisons"} or not self.pairs_from:
            raise ValidationError(f"pairs_from takes 'siblings' and/or 'comparisons', not {self.pairs_from!r}")
        if not isinstance(self.min_size, int) or self.min_size < 2:
            raise ValidationError(f"min_size must be an integer >= 2, not {self.min_size!r}")
        if self.kind == "replay":
            if not isinstance(self.size, int) or self.size < 1:
                raise ValidationError("a replay view needs size=n (how many rows to sample), n >= 1")
            if self.strategy not in ("advantage", "bucket"):
                raise ValidationError(f"replay strategy must be 'advantage' or 'bucket', not {self.strategy!r}")
            if self.strategy == "bucket" and self.threshold is None:
                raise ValidationError("a bucket replay needs threshold=... (reward >= threshold counts as a success)")
        bad = set(self.via) - set(LINEAGE) - {"inspired_by", "retrieved", "depends_on"}
        if bad:
            raise ValidationError(f"unknown edge kind(s) {sorted(bad)} in via")

    def definition(self) -> str:
        """The definition as text (kept in the catalog and in every export's manifest)."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if v != _DEFAULTS.get(k) and k not in ("name", "kind")}
        args = ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v!r}" for k, v in d.items())
        return f"{self.kind}({args})"

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ViewSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValidationError(f"unknown view option(s) {sorted(unknown)}; options are {sorted(known - {'name'})}")
        args: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**args)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ViewSpec) if f.default is not dataclasses.MISSING}


# ------------------------------------------------------------------ SQL
#: The scan the compiled base starts from, and the same scan restricted to a refresh's nodes.
_SCAN = "s0 AS (SELECT * FROM nodes)"
#: Materialized: inlined, DuckDB joined the members' rewards with every node before the
#: semi-join on ``__members`` (a 1M-row hash table; at 1M nodes 0.23 s vs 0.15 s for a preference refresh's compute).
_SCAN_MEMBERS = "s0 AS MATERIALIZED (SELECT * FROM nodes WHERE id IN (SELECT id FROM __members))"
_REWARDS = "(SELECT node_id, value FROM rewards WHERE channel = "


def _restricted(base: str) -> str:
    """``base`` reading only the nodes in ``__members`` (and their rewards), so a refresh
    costs what changed rather than a scan of every node and reward row."""
    if _SCAN not in base:  # a shape we do not know: correct, only slower
        return base
    out = base.replace(_SCAN, _SCAN_MEMBERS, 1)
    return out.replace(_REWARDS, "(SELECT node_id, value FROM rewards WHERE node_id IN (SELECT id FROM __members) "
                       "AND channel = ")


def _base(db: Database, spec: ViewSpec, snapshot: int) -> tuple[str, dict[str, Any], bool]:
    """SQL for the selected nodes ``(id, task_id, __reward)``, its parameters, and whether
    the condition reads other nodes (accessors such as ``children``: no incremental refresh)."""
    from trellisdb.tql import plan as P
    from trellisdb.tql.compile import compile_plan
    from trellisdb.tql.parser import parse
    from trellisdb.tql.resolve import resolve
    from trellisdb.tql.run import catalog

    reward = spec.reward or "NULL"
    where = f" WHERE {spec.where}" if spec.where else ""
    text = f"NODES{where} RETURN id, task_id, ({reward}) AS __reward AS OF COMMIT {snapshot}"
    try:
        bound = resolve(parse(text), catalog(db), {})
        plan = P.build(bound)
        if isinstance(plan, P.Project) and isinstance(plan.input, P.Sort):  # the view sorts its own rows
            plan = dataclasses.replace(plan, input=plan.input.input)
        compiled = compile_plan(plan)
    except QueryError as e:
        raise type(e)(f"view {spec.name!r}: {e}") from None
    return compiled.sql, dict(compiled.params), bool(bound.accessors)


def check(db: Database, spec: ViewSpec, snapshot: int) -> None:
    """Raise if the view's conditions do not compile or its reward is not a number."""
    base, params, _ = _base(db, spec, snapshot)
    sql = f"SELECT __reward FROM ({base}) LIMIT 0"
    typ = db._engine.run(db._log.refresh(), snapshot, sql, _used(sql, params)).schema.field("__reward").type
    if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_decimal(typ)
            or pa.types.is_null(typ)):
        raise ValidationError(f"view {spec.name!r}: reward must be a number, but {spec.reward!r} is {typ}; "
                              "e.g. reward=\"reward('score')\" (in TQL: WITH reward = reward('score'))")


def _common(spec: ViewSpec, base: str, restrict: bool, group_edges: bool = False) -> list[str]:
    """CTEs every kind starts from: ``a`` (selected nodes with their artifact hashes) and
    ``g`` (their group memberships: one row per (node, parent) or (node, prompt))."""
    kinds = ", ".join(f"'{k}'" for k in spec.via)  # validated names, not user text
    # sft paths keep unscored ancestors (the threshold applies to the path's last node)
    need_reward = spec.kind != "sft" or (spec.threshold is not None and not spec.path)
    members = ""
    if restrict and not spec.paths:
        restricted = _restricted(base)
        # a base of a shape _restricted does not know reads every node: keep only the members
        members = " AND id IN (SELECT id FROM __members)" if restricted == base else ""
        base = restricted
    # (node_id, name) is the current node_artifacts' key: one join per role, no pivot GROUP BY
    # (a 1M-node preference compute 2.43 -> 2.24 s, grpo 2.82 -> 2.55 s); only the roles the kind names
    roles = _ROLES.get(spec.kind, _ROLES[""])
    ctes = [f"b AS (SELECT * FROM ({base}) WHERE {'__reward IS NOT NULL' if need_reward else 'true'}{members})",
            "art AS (SELECT node_id, name, hash FROM node_artifacts "
            f"WHERE name IN ({', '.join(p for _, p in roles)}) AND node_id IN (SELECT id FROM b))",
            "a AS (SELECT b.id, b.task_id, b.__reward, " + ", ".join(f"{c}.hash AS {c}_hash" for c, _ in roles)
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


#: The artifact roles (hash column prefix, parameter) each kind's rows name; grpo names no response.
_ROLES: Final = {"": (("system", "$__sys"), ("prompt", "$__prompt"), ("response", "$__resp")),
                 "grpo": (("system", "$__sys"), ("prompt", "$__prompt"))}

#: Per group: mean, population std, size and success rate, summed in id order over a sorted
#: list, so a group's figures are the same to the last bit whichever query computes them
#: (a parallel avg() adds in arrival order: a refresh would differ from a rebuild in the last bit).
_GROUP_STATS = (
    "SELECT grp, list_avg(rs) AS m, list_aggregate(rs, 'stddev_pop') AS sd, len(rs) AS n, "
    "list_avg(list_transform(rs, lambda x: CASE WHEN x >= coalesce($__threshold, 0) THEN 1.0 ELSE 0.0 END)) "
    "AS success FROM (SELECT grp, list(__reward ORDER BY id) AS rs FROM g GROUP BY grp)"
)


def _sql(spec: ViewSpec, base: str, restrict: bool, group_edges: bool = False) -> str:
    """The rows of ``spec``. With ``restrict``, only the groups in ``__dirty_groups`` and
    the nodes in ``__dirty_nodes`` (``__dirty_leaves`` for stepwise) are computed (with
    ``group_edges``: the parent groups' edges are relation ``__group_edges``)."""
    ctes = _common(spec, base, restrict, group_edges)
    node_filter = " AND id IN (SELECT id FROM __dirty_nodes)" if restrict else ""
    kinds = ", ".join(f"'{k}'" for k in spec.via)
    thr = "$__threshold"
    head = "WITH "
    if spec.kind == "sft" and spec.path:
        cond = f"__reward >= {thr}" if spec.threshold is not None else "true"
        leaf_filter = " AND id IN (SELECT id FROM __dirty_leaves)" if restrict else ""
        ctes.append(f"par AS (SELECT dst AS id, min(src) AS parent FROM edges WHERE kind IN ({kinds}) "
                    "AND src IN (SELECT id FROM a) AND dst IN (SELECT id FROM a) GROUP BY dst)")
        ctes.append(f"sel AS (SELECT id FROM a WHERE {cond}{leaf_filter})")
        ctes.append("path AS (SELECT id AS leaf, id, 0 AS depth FROM sel UNION ALL "
                    "SELECT p.leaf, par.parent, p.depth + 1 FROM path p JOIN par ON par.id = p.id "
                    f"WHERE p.depth < {MAX_DEPTH})")
        head = "WITH RECURSIVE "
        body = ("SELECT pth.leaf AS node_id, any_value(l.task_id) AS task_id, any_value(l.__reward) AS reward, "
                "arg_max(s.system_hash, pth.depth) AS system_hash, arg_max(s.prompt_hash, pth.depth) AS prompt_hash, "
                "any_value(l.response_hash) AS response_hash, list(pth.id ORDER BY pth.depth DESC) AS node_ids, "
                "list(s.prompt_hash ORDER BY pth.depth DESC) AS prompt_hashes, "
                "list(s.response_hash ORDER BY pth.depth DESC) AS response_hashes "
                "FROM path pth JOIN a s ON s.id = pth.id JOIN a l ON l.id = pth.leaf GROUP BY pth.leaf")
    elif spec.kind == "sft":
        cond = f"__reward >= {thr}" if spec.threshold is not None else "true"
        body = (f"SELECT id AS node_id, task_id, __reward AS reward, system_hash, prompt_hash, response_hash, "
                f"[id] AS node_ids FROM a WHERE {cond}{node_filter}")
    elif spec.kind == "kto":
        body = (f"SELECT id AS node_id, task_id, __reward AS reward, __reward >= {thr} AS label, system_hash, "
                f"prompt_hash, response_hash, [id] AS node_ids FROM a WHERE true{node_filter}")
    elif spec.kind == "preference":
        parts = []
        if "siblings" in spec.pairs_from:
            ctes.append(
                "sib AS (SELECT c.id AS chosen_id, r.id AS rejected_id, min(c.grp) AS group_key, "
                "any_value(c.__reward - r.__reward) AS margin FROM g c JOIN g r ON c.grp = r.grp "
                "AND c.__reward > r.__reward AND c.__reward - r.__reward >= $__margin GROUP BY c.id, r.id)"
            )
            parts.append("SELECT chosen_id, rejected_id, group_key, margin, 'siblings' AS source FROM sib")
        if "comparisons" in spec.pairs_from:
            cfilter = (" AND (c.a IN (SELECT id FROM __dirty_nodes) OR c.b IN (SELECT id FROM __dirty_nodes))"
                       if restrict else "")
            ctes.append(
                "votes AS (SELECT c.preferred AS chosen_id, CASE WHEN c.preferred = c.a THEN c.b ELSE c.a END "
                "AS rejected_id, c.margin FROM comparisons c WHERE c.preferred IS NOT NULL "
                "AND c.preferred IN (c.a, c.b) AND c.a <> c.b AND c.a IN (SELECT id FROM a) "
                f"AND c.b IN (SELECT id FROM a){cfilter})"
            )
            ctes.append("tally AS (SELECT chosen_id, rejected_id, count(*) AS n, "
                        "list_avg(list(margin ORDER BY margin)) AS margin FROM votes GROUP BY ALL)")
            ctes.append("cmp AS (SELECT t.chosen_id, t.rejected_id, t.margin FROM tally t LEFT JOIN tally o "
                        "ON o.chosen_id = t.rejected_id AND o.rejected_id = t.chosen_id "
                        "WHERE t.n > coalesce(o.n, 0))")
            # ties included: a pair the comparisons judged (either way) is theirs to decide
            ctes.append("judged AS (SELECT a AS x, b AS y FROM comparisons UNION SELECT b, a FROM comparisons)")
            parts = [p + " WHERE (chosen_id, rejected_id) NOT IN (SELECT x, y FROM judged)" for p in parts]
            parts.append("SELECT chosen_id, rejected_id, NULL AS group_key, margin, 'comparison' AS source FROM cmp")
        ctes.append(f"pairs AS ({' UNION ALL '.join(parts)})")
        body = ("SELECT p.chosen_id, p.rejected_id, c.task_id, p.group_key, p.margin, p.source, c.system_hash, "
                "c.prompt_hash, c.response_hash AS chosen_hash, r.response_hash AS rejected_hash, "
                "[p.chosen_id, p.rejected_id] AS node_ids FROM pairs p JOIN a c ON c.id = p.chosen_id "
                "JOIN a r ON r.id = p.rejected_id")
    elif spec.kind == "grpo":
        # one GROUP BY gives each group its sorted lists, and the statistics come from those
        # lists (as _GROUP_STATS: the same bits whichever query computes them); a 1M-node
        # compute 2.66 -> 1.91 s against statistics aggregated apart and joined back per member
        drop = " AND sd > 0" if spec.drop_zero_variance else ""
        ctes.append("gl AS (SELECT grp, min(task_id) AS task_id, list(id ORDER BY id) AS node_ids, "
                    "list(__reward ORDER BY id) AS rewards FROM g GROUP BY grp HAVING count(*) >= $__min)")
        ctes.append(f"st AS (SELECT *, list_avg(rewards) AS m, list_aggregate(rewards, 'stddev_pop') AS sd "
                    f"FROM gl WHERE true{drop})")
        adv = ("list_transform(st.rewards, lambda x: CASE WHEN st.sd > 0 THEN (x - st.m) / st.sd ELSE 0.0 END) "
               "AS advantages")
        head_cols = "st.grp AS group_key, st.task_id, len(st.node_ids) AS size, st.m AS mean, st.sd AS std"
        if spec.group_by == "prompt":  # the group is its prompt
            ctes.append("gs AS (SELECT grp, min(system_hash) AS system_hash FROM g "
                        "WHERE grp IN (SELECT grp FROM st) GROUP BY grp)")
            body = (f"SELECT {head_cols}, gs.system_hash, st.grp AS prompt_hash, st.node_ids, st.rewards, {adv} "
                    "FROM st JOIN gs USING (grp)")
        else:
            # the group's prompt: the one most members share (ties: the smallest hash)
            ctes.append("pc AS (SELECT grp, prompt_hash, min(system_hash) AS system_hash, count(*) AS n FROM g "
                        "WHERE grp IN (SELECT grp FROM st) GROUP BY grp, prompt_hash)")
            ctes.append("gp AS (SELECT grp, arg_min(prompt_hash, (-n, prompt_hash)) AS prompt_hash, "
                        "arg_min(system_hash, (-n, prompt_hash)) AS system_hash FROM pc GROUP BY grp)")
            body = (f"SELECT {head_cols}, gp.system_hash, gp.prompt_hash, st.node_ids, st.rewards, {adv} "
                    "FROM st JOIN gp USING (grp)")
    elif spec.kind == "stepwise":
        # first parent = the smallest parent id among the selected nodes; leaves = no selected child
        ctes.append(f"par AS (SELECT dst AS id, min(src) AS parent FROM edges WHERE kind IN ({kinds}) "
                    "AND src IN (SELECT id FROM a) AND dst IN (SELECT id FROM a) GROUP BY dst)")
        leaf_filter = " AND id IN (SELECT id FROM __dirty_leaves)" if restrict else ""
        ctes.append(f"leaf AS (SELECT id FROM a WHERE id NOT IN (SELECT src FROM edges WHERE kind IN ({kinds}) "
                    f"AND dst IN (SELECT id FROM a)){leaf_filter})")
        ctes.append("path AS (SELECT id AS leaf, id, 0 AS depth FROM leaf UNION ALL "
                    "SELECT p.leaf, par.parent, p.depth + 1 FROM path p JOIN par ON par.id = p.id "
                    f"WHERE p.depth < {MAX_DEPTH})")
        head = "WITH RECURSIVE "
        body = ("SELECT pth.leaf AS node_id, any_value(l.task_id) AS task_id, "
                "arg_max(s.system_hash, pth.depth) AS system_hash, arg_max(s.prompt_hash, pth.depth) AS prompt_hash, "
                "list(pth.id ORDER BY pth.depth DESC) AS node_ids, "
                "list(s.response_hash ORDER BY pth.depth DESC) AS response_hashes, "
                "list(s.__reward ORDER BY pth.depth DESC) AS rewards, "
                f"list(s.__reward >= {thr} ORDER BY pth.depth DESC) AS labels "
                "FROM path pth JOIN a s ON s.id = pth.id JOIN a l ON l.id = pth.leaf GROUP BY pth.leaf")
    else:  # replay: the candidates, each once (its smallest group), with its group's statistics
        body = ("SELECT g.id AS node_id, g.task_id, g.__reward AS reward, g.grp AS group_key, "
                "CASE WHEN st.sd > 0 THEN (g.__reward - st.m) / st.sd ELSE 0.0 END AS advantage, "
                "st.success, g.system_hash, g.prompt_hash, g.response_hash "
                f"FROM g JOIN ({_GROUP_STATS}) st "
                "USING (grp) QUALIFY row_number() OVER (PARTITION BY g.id ORDER BY g.grp) = 1")
    return head + ", ".join(ctes) + " " + body


def _params(spec: ViewSpec) -> dict[str, Any]:
    return {"__sys": spec.system, "__prompt": spec.prompt, "__resp": spec.response, "__threshold": spec.threshold,
            "__margin": float(spec.margin), "__min": spec.min_size}


def _used(sql: str, params: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if f"${k}" in sql}


def compute(db: Database, spec: ViewSpec, snapshot: int, dirty: Mapping[str, pa.Table] | None = None) -> pa.Table:
    """The view's rows as of ``snapshot``, sorted by their key (``dirty``: only those groups / nodes)."""
    base, params, _ = _base(db, spec, snapshot)
    if spec.kind == "replay":
        return _replay(db, spec, snapshot, base, params)
    # sorted by DuckDB (in parallel, bytewise like Arrow): ~2x cheaper here than an Arrow sort_by of the result
    order = ", ".join(f"{k} ASC NULLS LAST" for k in ROW_KEYS[spec.shape])
    given = dirty is not None and "__group_edges" in dirty
    sql = f"SELECT * FROM ({_sql(spec, base, dirty is not None, given)}) ORDER BY {order}"
    params = {**params, **_params(spec)}
    st = db._log.refresh()
    rows = db._engine.run(st, snapshot, sql, _used(sql, params), relations=dict(dirty) if dirty else None)
    return _canonical(spec.shape, rows, sort=False)


def _canonical(kind: str, rows: pa.Table, sort: bool = True) -> pa.Table:
    """``rows`` in the kind's schema (and its text code columns, if it has them), sorted by key."""
    sch = SCHEMAS[kind]
    codes = texts.code_columns(rows.column_names)
    sch = pa.schema([*sch, *(rows.schema.field(c) for c in codes)])
    rows = pa.table({f.name: rows.column(f.name).cast(f.type) for f in sch}, schema=sch)
    return rows.sort_by([(k, "ascending") for k in ROW_KEYS[kind]]) if sort else rows


def build(db: Database, spec: ViewSpec, snapshot: int) -> tuple[pa.Table, pa.Table | None]:
    """The view's rows as of ``snapshot`` with their text codes, and the texts (``texts.py``;
    without ``keep_texts``: the rows alone, and None)."""
    rows = compute(db, spec, snapshot)
    return texts.encode(db, rows, snapshot) if spec.keep_texts else (rows, None)


# ------------------------------------------------------------------ replay
def _replay(db: Database, spec: ViewSpec, snapshot: int, base: str, params: dict[str, Any]) -> pa.Table:
    """A prioritized sample without replacement (Efraimidis-Spirakis keys ``u ** (1 / p)``
    from a generator seeded with ``seed``, over the candidates sorted by id)."""
    sql = _sql(spec, base, False)
    all_params = {**params, **_params(spec)}
    st = db._log.refresh()
    cand = db._engine.run(st, snapshot, sql, _used(sql, all_params)).sort_by("node_id")
    n = cand.num_rows
    if spec.strategy == "advantage":
        prio = np.abs(cand["advantage"].to_numpy(zero_copy_only=False)) + 1e-6
    else:
        success = cand["success"].to_numpy(zero_copy_only=False)
        prio = np.exp(-((success - 0.5) ** 2) / (2 * 0.2**2))  # medium difficulty first
        prio[(success <= 0) | (success >= 1)] *= 0.05  # all-fail / all-pass groups rarely
        if spec.entropy:
            ent = _channel(db, snapshot, spec.entropy, cand["node_id"])
            rank = np.argsort(np.argsort(np.nan_to_num(ent, nan=np.inf), kind="stable"), kind="stable")
            prio = prio * (1.0 - 0.5 * rank / max(1, n - 1))  # lower entropy first
    rng = np.random.default_rng(spec.seed)
    keys = rng.random(n) ** (1.0 / prio) if n else np.empty(0)
    take = np.argsort(-keys, kind="stable")[: spec.size]
    out = cand.take(pa.array(take, pa.int64()))
    out = out.append_column("priority", pa.array(prio[take], _D))
    out = out.append_column("sample_rank", pa.array(np.arange(1, len(take) + 1), _I))
    out = out.append_column("node_ids", pa.array([[i] for i in out["node_id"].to_pylist()], pa.list_(_S)))
    return _canonical("replay", out)


def _channel(db: Database, snapshot: int, channel: str, ids: pa.ChunkedArray) -> np.ndarray:
    st = db._log.refresh()
    t = db._engine.run(st, snapshot, "SELECT node_id, value FROM rewards WHERE channel = $c AND node_id IN "
                       "(SELECT id FROM __ids)", {"c": channel}, relations={"__ids": pa.table({"id": ids})})
    joined = pa.table({"node_id": ids}).join(t, "node_id", join_type="left outer")
    order = pc.index_in(ids, value_set=joined["node_id"].combine_chunks())
    return joined["value"].take(order).to_numpy(zero_copy_only=False).astype(np.float64)  # type: ignore[no-any-return]


# ------------------------------------------------------------------ catalog and storage
@dataclass
class ViewCatalog:
    """``<db>/views.json``: definitions and, per materialized view, its commit, row count and file."""

    root: str
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return os.path.join(self.root, CATALOG)

    def load(self) -> ViewCatalog:
        if not os.path.exists(self.path):
            self.entries = {}
            return self
        try:
            with open(self.path) as fh:
                self.entries = json.load(fh)["views"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TrellisError(f"{self.path} is unreadable ({e}); restore it from a backup or remove it "
                               "(the views' definitions are lost, the data is not)") from e
        return self

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"views": self.entries}, fh, indent=1, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def spec(self, name: str) -> ViewSpec:
        e = self.entries.get(name)
        if e is None:
            known = ", ".join(sorted(self.entries)) or "none yet"
            raise QueryError(f"unknown view {name!r}; views: {known} (create one with db.create_view)")
        return ViewSpec.from_dict(e["spec"])


ROW_ID = "__row"
#: The Lance file format of view rows: derived data that is read whole (exports) or by a few
#: columns (refresh), so fast over small. At 1M nodes (408k pairs) 2.0 reads 4x faster than the
#: default 2.2 (0.1 s vs 0.44 s; a refresh's columns 0.03 s vs 0.1 s) and writes 1.7x faster,
#: at 1.9x the size on disk (189 MB vs 100 MB).
VIEW_FORMAT: Final = "2.0"
#: A refreshed view's fragments are merged (those under ``VIEW_FRAGMENT_ROWS`` rows) past this many.
VIEW_FRAGMENTS = 16
VIEW_FRAGMENT_ROWS = 1 << 18
#: Old view versions are pruned after a merge and on every this-many-th version (listing them costs ~30 ms).
PRUNE_EVERY = 16


def _uri(db: Database, name: str) -> str:
    return os.path.join(db.path, VIEWS_DIR, f"{name}.lance")


def _open(db: Database, entry: Mapping[str, Any]) -> Any:
    import lance

    uri = os.path.join(db.path, entry["file"])
    try:
        return lance.dataset(uri, version=entry["version"])
    except (OSError, ValueError, RuntimeError) as e:
        raise TrellisError(f"the rows of view {entry['spec']['name']!r} ({uri}) are unreadable ({e}); "
                           "run db.materialize(name) to recompute them") from e


#: A view's provenance (``refresh_rows``' columns of its stored rows) is kept in memory for
#: views of up to this many provenance node ids (8M: some 400 MB of ids at most).
KEPT_NODE_IDS: Final = 8_000_000


@dataclass
class _Kept:
    """A view's stored provenance as one materialization or refresh left it: ``base`` (a table,
    or the ``_Kept`` it was refreshed from) less the row ids ``drop``, plus ``fresh``. Resolved
    on first use (by the next refresh, on its reading thread), then held as a table."""

    tag: tuple[Any, ...]
    base: pa.Table | _Kept
    drop: np.ndarray | None = None
    fresh: pa.Table | None = None
    ids: int = 0  # provenance node ids held

    def table(self) -> pa.Table:
        base = self.base.table() if isinstance(self.base, _Kept) else self.base
        if self.drop is not None and len(self.drop):
            base = base.filter(pc.invert(pc.is_in(base[ROW_ID], value_set=pa.array(self.drop, pa.int64()))))
        if self.fresh is not None and self.fresh.num_rows:
            base = pa.concat_tables([base, self.fresh.select(base.column_names).cast(base.schema)])
        self.base, self.drop, self.fresh = base, None, None
        return base


_KEPT: weakref.WeakKeyDictionary[Database, dict[str, _Kept]] = weakref.WeakKeyDictionary()


def _provenance(spec: ViewSpec) -> list[str]:
    """The columns of a view's rows a refresh reads to find the rows it replaces."""
    return ["node_ids", *(["group_key"] if "group_key" in SCHEMAS[spec.shape].names else []),
            *(["node_id"] if spec.paths else [])]


def _rows_tag(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """What names one state of a view's stored rows (as ``texts._tag`` for its texts)."""
    return entry.get("version"), entry.get("next_row"), entry.get("rows"), entry.get("computed_at")


def _keep(db: Database, name: str, entry: Mapping[str, Any] | None, kept: pa.Table | _Kept | None,
          drop: np.ndarray | None = None, fresh: pa.Table | None = None) -> None:
    """Keep the provenance of view ``name`` as ``entry`` stores it: ``kept`` (the stored rows'
    provenance, or the previous ``_Kept``) less ``drop``, plus ``fresh`` (None: forget it)."""
    views_kept = _KEPT.setdefault(db, {})
    views_kept.pop(name, None)
    if entry is None or kept is None:
        return
    ids = sum(_ids(t) for t in (kept, fresh) if isinstance(t, pa.Table))
    ids += kept.ids if isinstance(kept, _Kept) else 0
    if ids <= KEPT_NODE_IDS:
        views_kept[name] = _Kept(_rows_tag(entry), kept, drop, fresh, ids)


def _ids(t: pa.Table) -> int:
    return int(pc.sum(pc.list_value_length(t["node_ids"])).as_py() or 0)


def stored_provenance(db: Database, entry: Mapping[str, Any]) -> pa.Table:
    """``_provenance``'s columns of a view's stored rows and their row ids, unsorted: kept from
    this process's last materialize or refresh of the view, else read (and kept)."""
    name = entry["spec"]["name"]
    kept = _KEPT.get(db, {}).get(name)
    if kept is not None and kept.tag == _rows_tag(entry):
        _open(db, entry)  # still there (the refresh writes to it): a clear error now if not
        return kept.table()
    t = read_rows(db, entry, _provenance(ViewSpec.from_dict(entry["spec"])))
    _keep(db, name, entry, t)
    return t


def read_rows(db: Database, entry: Mapping[str, Any], columns: list[str] | None = None, codes: bool = False) -> pa.Table:
    """The stored rows of a materialized view, in key order (``codes``: with their text code
    columns; ``columns``: only those, unsorted, with the internal row id)."""
    ds = _open(db, entry)
    if columns is not None:
        return ds.to_table(columns=[*columns, ROW_ID])
    t = ds.to_table(batch_size=texts.READ_BATCH_ROWS, batch_readahead=texts.READ_AHEAD)
    t = t.drop_columns([ROW_ID, *([] if codes else texts.code_columns(t.column_names))])
    # a full materialization writes the rows in key order; after a refresh's delete + append they need a sort
    shape = ViewSpec.from_dict(entry["spec"]).shape
    return _canonical(shape, t, sort=not entry.get("sorted", False))


def _entry(spec: ViewSpec, commit: int, rows: int, version: int, next_row: int, how: str,
           texts_version: int | None, n_texts: int, sorted: bool = False) -> dict[str, Any]:
    return {"spec": spec.as_dict(), "definition": spec.definition(), "commit": commit, "rows": rows,
            "file": os.path.join(VIEWS_DIR, f"{spec.name}.lance"), "version": version, "next_row": next_row,
            "texts_version": texts_version, "texts": n_texts,
            "computed_at": dt.datetime.now(dt.UTC).isoformat(), "how": how, "sorted": sorted}


def store(
    db: Database, cat: ViewCatalog, spec: ViewSpec, rows: pa.Table, text: pa.Table | None, commit: int, how: str
) -> dict[str, Any]:
    """Record ``rows`` (with their text codes) and their texts (None: not kept) as the view's
    materialization at ``commit``: new versions of its Lance datasets first, then the catalog
    naming those versions (a crash before leaves the old ones)."""
    import lance

    os.makedirs(os.path.join(db.path, VIEWS_DIR), exist_ok=True)
    tds = None
    if text is not None:
        tds = lance.write_dataset(text, texts.path(db, spec.name), mode="overwrite",
                                  data_storage_version=texts.TEXTS_FORMAT)
    t = rows.append_column(ROW_ID, pa.array(np.arange(rows.num_rows, dtype=np.int64)))
    ds = lance.write_dataset(t, _uri(db, spec.name), mode="overwrite", data_storage_version=VIEW_FORMAT)
    entry = _entry(spec, commit, rows.num_rows, ds.version, rows.num_rows, how, None if tds is None else tds.version,
                   0 if text is None else text.num_rows, sorted=True)
    cat.entries[spec.name] = entry
    cat.save()
    # what the next refresh matches its rows' hashes against (~0.02 s now, 0.07-0.16 s then)
    texts.remember(db, spec.name, entry, None if text is None else texts.Known.of(text["hash"]))
    _keep(db, spec.name, entry, t.select([*_provenance(spec), ROW_ID]))
    _prune(ds)
    if tds is None:  # texts kept before, not now
        shutil.rmtree(texts.path(db, spec.name), ignore_errors=True)
    else:
        _prune(tds)
    return entry


def store_delta(
    db: Database, cat: ViewCatalog, spec: ViewSpec, old: Mapping[str, Any], drop: np.ndarray, fresh: pa.Table,
    new_texts: pa.Table | None, commit: int, how: str,
) -> dict[str, Any]:
    """Apply a refresh to the stored rows: append ``new_texts`` to the texts, delete the rows
    ``drop`` (row ids), append ``fresh``. Costs what changed, not the view's size. The caller
    holds the writer lock and has checked that the catalog still names ``old['version']``; a
    version either dataset has past the catalog's (a refresh that died before its catalog
    write) is undone first."""
    import lance

    tds = None
    n_texts = int(old["texts"])
    if old["texts_version"] is not None:
        assert new_texts is not None
        tds = _restored(texts.path(db, spec.name), int(old["texts_version"]))
        n_texts += new_texts.num_rows
        if new_texts.num_rows:
            tds = lance.write_dataset(new_texts.cast(tds.schema), texts.path(db, spec.name), mode="append")
        if len(tds.get_fragments()) > VIEW_FRAGMENTS:  # the codes are positions: rewrite in order, never compact
            tds = lance.write_dataset(tds.to_table(), texts.path(db, spec.name), mode="overwrite",
                                      data_storage_version=texts.TEXTS_FORMAT)
            _prune(tds)
    ds = _restored(_uri(db, spec.name), int(old["version"]))
    start = int(old["next_row"])
    t = fresh.append_column(ROW_ID, pa.array(np.arange(start, start + fresh.num_rows, dtype=np.int64)))
    ds = _replace_rows(ds, _uri(db, spec.name), drop, t.cast(ds.schema) if t.num_rows else ds.schema.empty_table())
    merged = len(ds.get_fragments()) > VIEW_FRAGMENTS
    if merged:  # each refresh appends a fragment: merge the small ones (and drop deleted rows) now and then
        ds.optimize.compact_files(target_rows_per_fragment=VIEW_FRAGMENT_ROWS, materialize_deletions=True)
        ds = lance.dataset(_uri(db, spec.name))
    entry = _entry(spec, commit, int(old["rows"]) - len(drop) + fresh.num_rows, ds.version,
                   start + fresh.num_rows, how, None if tds is None else tds.version,
                   n_texts)
    cat.entries[spec.name] = entry
    cat.save()
    have = texts.cached(db, old)  # the refresh's (``texts.known`` keeps what it reads)
    if have is not None and new_texts is not None and new_texts.num_rows:
        have = have.extended(new_texts["hash"])
    texts.remember(db, spec.name, entry, have)
    kept = _KEPT.get(db, {}).get(spec.name)
    _keep(db, spec.name, entry, kept if kept is not None and kept.tag == _rows_tag(old) else None,
          drop, t.select([*_provenance(spec), ROW_ID]))
    if merged or ds.version % PRUNE_EVERY == 0:  # not on every refresh
        _prune(ds)
    return entry


def _replace_rows(ds: Any, uri: str, drop: np.ndarray, add: pa.Table) -> Any:
    """Delete the rows of ``ds`` whose row id is in ``drop`` and append ``add``, in one
    commit. The rows are deleted by address, found in one read of the row id column (Lance's
    predicate delete evaluates an ``IN`` list over every row: 12-20 ms for 1.4k of 408k rows,
    vs ~5 ms). Lance marks its by-address delete internal: without it, a predicate delete
    and an append, as before."""
    import lance
    import lance.fragment as lf

    if not (hasattr(lf.LanceFragment, "delete_rows") and hasattr(lf, "write_fragments")):
        if len(drop):
            ds.delete(f"{ROW_ID} IN ({', '.join(str(int(r)) for r in drop)})")
        return lance.write_dataset(add, uri, mode="append") if add.num_rows else lance.dataset(uri)
    updated, removed = [], []
    if len(drop):
        ids = ds.to_table(columns=[ROW_ID], with_row_address=True)
        addrs = ids["_rowaddr"].to_numpy()[np.isin(ids[ROW_ID].to_numpy(), drop)]
        if len(addrs) != len(np.unique(drop)):  # before anything is written: the stored rows stay as they are
            raise CorruptionError(
                f"view rows {uri} hold {len(addrs)} of the {len(np.unique(drop))} rows a refresh replaces; "
                "run db.materialize(name) to recompute the view")
        frags, offsets = addrs >> np.uint64(32), addrs & np.uint64(0xFFFFFFFF)
        for fid in np.unique(frags):
            meta = ds.get_fragment(int(fid)).delete_rows(offsets[frags == fid].tolist())
            (removed.append(int(fid)) if meta is None else updated.append(meta))
    if not (updated or removed or add.num_rows):
        return ds
    # in the dataset's own file format (write_fragments would take Lance's default)
    new = lf.write_fragments(add, uri, schema=ds.schema, data_storage_version=ds.data_storage_version) \
        if add.num_rows else []
    op = lance.LanceOperation.Update(removed_fragment_ids=removed, updated_fragments=updated, new_fragments=new)
    return lance.LanceDataset.commit(uri, op, read_version=ds.version)


def _restored(uri: str, version: int) -> Any:
    """The Lance dataset at ``uri`` with ``version`` as its latest (restored if a later one exists)."""
    import lance

    ds = lance.dataset(uri)
    if ds.version != version:
        lance.dataset(uri, version=version).restore()  # type: ignore[no-untyped-call]
        ds = lance.dataset(uri)
    return ds


def _prune(ds: Any) -> None:
    """Old versions go after the tables' grace period (a reader may still hold one)."""
    from trellisdb.storage.tables import PRUNE_GRACE

    with contextlib.suppress(Exception):  # housekeeping only
        ds.cleanup_old_versions(older_than=PRUNE_GRACE)


def remove(db: Database, name: str) -> None:
    texts.remember(db, name, None, None)
    _keep(db, name, None, None)
    shutil.rmtree(_uri(db, name), ignore_errors=True)
    shutil.rmtree(texts.path(db, name), ignore_errors=True)


# ------------------------------------------------------------------ refresh
def changed_since(since: int, comparisons: bool = True) -> str:
    """SQL for the nodes the commits after ``since`` touched: written, rewarded, given
    artifacts, joined by an edge (either end) or compared (``comparisons``)."""
    return " UNION ".join(
        f"SELECT {col} AS id FROM {t}_history WHERE commit_id > {int(since)}"
        for t, col in (("nodes", "id"), ("rewards", "node_id"), ("node_artifacts", "node_id"), ("edges", "src"),
                       ("edges", "dst"), *((("comparisons", "a"), ("comparisons", "b")) if comparisons else ()))
    )


def _compares(spec: ViewSpec) -> bool:
    """Whether the view's rows read the comparisons (only preference pairs taken from them do)."""
    return spec.kind == "preference" and "comparisons" in spec.pairs_from


def _members_sql(spec: ViewSpec, nodes: str, groups: str, edges: str | None = None) -> str:
    """SQL for the nodes a restricted compute reads: the members of the groups in relation
    ``groups`` (column ``grp``; ``edges``: a relation of their edges ``(src, dst)``), the
    nodes in ``nodes`` (column ``id``) and, for a view that reads comparisons, the other side
    of theirs."""
    kinds = ", ".join(f"'{k}'" for k in spec.via)
    if edges is not None:
        grp_members = f"SELECT dst AS id FROM {edges}"
    elif spec.group_by == "parent":
        grp_members = f"SELECT dst AS id FROM edges WHERE kind IN ({kinds}) AND src IN (SELECT grp FROM {groups})"
    else:
        grp_members = f"SELECT node_id AS id FROM node_artifacts WHERE name = $p AND hash IN (SELECT grp FROM {groups})"
    partners = (f" UNION SELECT b FROM comparisons WHERE a IN (SELECT id FROM {nodes}) "
                f"UNION SELECT a FROM comparisons WHERE b IN (SELECT id FROM {nodes})") if _compares(spec) else ""
    return f"{grp_members} UNION SELECT id FROM {nodes}{partners}"


def _dirty(db: Database, spec: ViewSpec, since: int, upto: int) -> tuple[pa.Array, pa.Array, pa.Array, pa.Table | None]:
    """The nodes the commits in ``(since, upto]`` touched, then in one statement the groups
    they are in now (the old rows name the groups they were in), what a restricted compute
    of those groups reads (``_members_sql``) and, for parent groups, those groups' edges
    ``(src, dst)`` (else None), which the compute then joins rather than scan the edges again."""
    kinds = ", ".join(f"'{k}'" for k in spec.via)
    if spec.group_by == "parent":
        groups = (f"SELECT DISTINCT src AS grp FROM edges WHERE kind IN ({kinds}) "
                  "AND dst IN (SELECT id FROM __changed)")
    else:
        groups = ("SELECT DISTINCT hash AS grp FROM node_artifacts WHERE name = $p "
                  "AND node_id IN (SELECT id FROM __changed)")
    state = db._log.refresh()
    # the touched nodes first, on their own: as a CTE DuckDB guessed them at millions of rows and
    # built its hash tables on the edges (0.17 s at 1M nodes; 0.07 s in two statements)
    changed = db._engine.run(state, upto, changed_since(since, _compares(spec)))
    if spec.group_by == "parent":  # the groups' edges come back too (what = 3): the members are their ends
        edges = (f"__ge AS MATERIALIZED (SELECT DISTINCT src, dst FROM edges WHERE kind IN ({kinds}) "
                 "AND src IN (SELECT grp FROM __groups)), ")
        mem = _members_sql(spec, "__changed", "__groups", "__ge")
        tail = " UNION ALL SELECT 3, src, dst FROM __ge"
    else:
        edges, mem, tail = "", _members_sql(spec, "__changed", "__groups"), ""
    sql = (f"WITH __groups AS MATERIALIZED ({groups}), {edges}__mem AS ({mem}) "
           f"SELECT 1 AS what, grp AS id, NULL::VARCHAR AS dst FROM __groups UNION ALL SELECT 2, id, NULL FROM __mem{tail}")
    t = db._engine.run(state, upto, sql, {"p": spec.prompt} if "$p" in sql else None,
                       relations={"__changed": changed})
    what = pa.array(t["what"].combine_chunks().to_numpy())
    ids = t["id"].combine_chunks().cast(_S)
    groups_now, members = (ids.filter(pc.equal(what, k)) for k in (1, 2))
    group_edges = None
    if spec.group_by == "parent":
        on = pc.equal(what, 3)
        group_edges = pa.table({"src": ids.filter(on), "dst": t["dst"].combine_chunks().cast(_S).filter(on)})
    return changed["id"].combine_chunks().cast(_S), groups_now, members, group_edges


@dataclass
class Refresh:
    """What a refresh does to the stored rows: replace them all (``rows``, their texts
    ``texts``), or delete the row ids ``drop`` and append ``fresh`` (rows with their text codes)
    and the texts they add (``texts``)."""

    how: str
    texts: pa.Table | None
    rows: pa.Table | None = None
    drop: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    fresh: pa.Table | None = None


def refresh_rows(db: Database, spec: ViewSpec, entry: Mapping[str, Any], since: int, upto: int) -> Refresh:
    """The change that brings the view from its rows at ``since`` to ``upto``: rows behind the
    touched nodes and groups are recomputed, the rest kept. Views that cannot be refreshed by
    parts are rebuilt."""
    _, _, global_condition = _base(db, spec, upto)
    if spec.kind == "replay" or global_condition or "texts_version" not in entry:
        why = ("a replay samples the whole view" if spec.kind == "replay" else
               "its condition reads other nodes" if global_condition else "stored before views kept their texts")
        rows, text = build(db, spec, upto)
        return Refresh(f"rebuilt ({why})", text, rows=rows)
    # the old rows (kept, or a Lance read) load on a thread while DuckDB finds and recomputes the touched groups
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-refresh") as pool:
        reading = pool.submit(stored_provenance, db, entry)
        kept = entry["texts_version"] is not None
        known = pool.submit(texts.known, db, entry) if kept else None
        # the artifacts written since, read ahead (their texts are the new rows' likeliest to lack)
        ahead = pool.submit(texts.written_since, db, since, upto) if kept else None
        ids, groups, members, group_edges = _dirty(db, spec, since, upto)
        if len(ids) == 0:
            reading.cancel()
            for f in (known, ahead):
                if f is not None:
                    f.cancel()
            return Refresh("unchanged", pa.table({}) if kept else None, fresh=SCHEMAS[spec.shape].empty_table())
        touching = pool.submit(lambda: _touches(reading.result(), ids))
        st = db._log.refresh()
        kinds = ", ".join(f"'{k}'" for k in spec.via)
        rel = {"__changed": pa.table({"id": ids})}
        fresh: pa.Table | None = None
        if not spec.paths:  # recompute now; redone below if the old rows name more groups
            fresh = _recompute(db, spec, upto, ids, groups, members=members, edges=group_edges)
        old, touched = reading.result(), touching.result()
        have = None if known is None else known.result()
        new = None if ahead is None else ahead.result()
    dirty_leaves = None
    if "group_key" in old.column_names:
        before = pc.drop_null(old["group_key"].filter(touched)).combine_chunks().cast(_S)
        extra = pc.filter(before, pc.invert(pc.is_in(before, value_set=groups)))
        if len(extra):  # groups a touched node has left: they change too
            groups = pc.unique(pa.concat_arrays([groups, extra]))
            fresh = members = group_edges = None
        touched = pc.or_(touched, pc.fill_null(pc.is_in(old["group_key"], value_set=groups), False))
    if spec.paths:
        # trajectories through a touched node: their leaves, old and new (descendants of the touched)
        leaves = db._engine.run(
            st, upto,
            # from the touched nodes and their parents (a parent stops being a leaf when a child is selected)
            f"WITH RECURSIVE d AS (SELECT id, 0 AS h FROM __changed UNION SELECT src, 0 FROM edges "
            f"WHERE kind IN ({kinds}) AND dst IN (SELECT id FROM __changed) UNION SELECT e.dst, d.h + 1 FROM d "
            f"JOIN edges e ON e.src = d.id AND e.kind IN ({kinds}) WHERE d.h < {MAX_DEPTH}) SELECT DISTINCT id FROM d",
            relations=rel,
        )["id"].combine_chunks()
        old_leaves = old["node_id"].filter(touched).combine_chunks()
        dirty_leaves = pc.unique(pa.concat_arrays([leaves, old_leaves]))
        touched = pc.or_(touched, pc.is_in(old["node_id"], value_set=dirty_leaves))
    if fresh is None:
        fresh = _recompute(db, spec, upto, ids, groups, dirty_leaves, members, group_edges)
    drop = old[ROW_ID].filter(touched).to_numpy()
    text = None
    if have is not None:
        fresh, text = texts.extend(db, fresh, have, since, upto, new)
    return Refresh(f"refreshed ({len(ids)} touched nodes, {len(drop)} rows replaced by {fresh.num_rows})",
                   text, drop=drop, fresh=fresh)


def _recompute(db: Database, spec: ViewSpec, upto: int, ids: pa.Array, groups: pa.Array,
               leaves: pa.Array | None = None, members: pa.Array | None = None,
               edges: pa.Table | None = None) -> pa.Table:
    """The rows of the dirty groups and nodes (``leaves``: stepwise's dirty trajectories),
    computed over the nodes they can read (``members``, found here when not given): the
    touched, the members of the touched groups, and the other side of their comparisons
    (``edges``: the dirty parent groups' edges, as ``_dirty`` found them with ``members``)."""
    dirty: dict[str, pa.Table] = {"__dirty_nodes": pa.table({"id": ids}), "__dirty_groups": pa.table({"grp": groups})}
    if leaves is not None:
        dirty["__dirty_leaves"] = pa.table({"id": leaves})
    if edges is not None and members is not None:
        dirty["__group_edges"] = edges
    if members is None:
        sql = _members_sql(spec, "__dirty_nodes", "__dirty_groups")
        members = db._engine.run(db._log.refresh(), upto, sql, {"p": spec.prompt} if "$p" in sql else None,
                                 relations=dirty)["id"].combine_chunks()
    dirty["__members"] = pa.table({"id": members})
    return compute(db, spec, upto, dirty)


def _touches(rows: pa.Table, ids: pa.Array) -> pa.ChunkedArray:
    """Per row: whether any of its provenance nodes is in ``ids``."""
    col = rows["node_ids"].combine_chunks()
    flat = pc.is_in(col.flatten(), value_set=ids)
    parent = pc.list_parent_indices(col)
    hit = np.zeros(rows.num_rows, bool)
    hit[parent.to_numpy()[flat.to_numpy(zero_copy_only=False)]] = True
    return pa.chunked_array([pa.array(hit)])
