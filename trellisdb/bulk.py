"""Vectorized validation for bulk ingest (``Database.ingest``): no Python row loops."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import (
    DuplicateIdError,
    UnknownNodeError,
    UnknownParentError,
    UnknownSessionError,
    ValidationError,
)
from trellisdb.names import bad_names, reserved_names, utf8_problem
from trellisdb.rules import (
    EDGE_KINDS,
    EMBEDDING_DIMENSION,
    EMBEDDING_NOT_FINITE,
    FINITE,
    NAME_COLUMNS,
    NEGATIVE,
    NOT_FINITE,
    NOT_NEGATIVE,
    NOT_PREFERRED,
    REWARD_NOT_FINITE,
    SAME_NODES,
    SELF_LOOP,
    UNKNOWN_EDGE_KIND,
    config_text,
)
from trellisdb.schema import DATA_TABLES, KEYS, table_schema

if TYPE_CHECKING:
    from trellisdb.snapshot import Snapshot


def conform(name: str, t: pa.Table, dim: int) -> pa.Table:
    """Reorder/cast ``t`` to the table's schema, filling absent nullable columns."""
    sch = table_schema(name, dim)
    extra = set(t.column_names) - set(sch.names)
    if extra:
        raise ValidationError(f"table {name!r} has no column(s) {sorted(extra)}; its columns are {sch.names}")
    cols = []
    for f in sch:
        if f.name in t.column_names:
            col = t.column(f.name)
            if f.name == "event_time" and not (pa.types.is_timestamp(col.type) and col.type.tz):
                raise ValidationError(
                    f"{name}.event_time is {col.type}; give timezone-aware timestamps, e.g. "
                    "pa.array(times, pa.timestamp('us', tz='UTC')) (a time without a zone means different instants "
                    "on different machines; numbers would be read as microseconds, not seconds)"
                )
            if pa.types.is_fixed_size_list(f.type) and (
                not pa.types.is_fixed_size_list(col.type) or col.type.list_size != dim
            ):
                sizes = pc.list_value_length(col).drop_null()
                bad = [s for s in pc.unique(sizes).to_pylist() if s != dim] if len(sizes) else []
                if bad:
                    raise EMBEDDING_DIMENSION.table(table=name, column=f.name, got=bad[0], dim=dim)
            if pa.types.is_fixed_size_list(f.type):
                flat = pc.list_flatten(col)
                if len(flat) and not pc.all(pc.is_finite(flat.cast(pa.float64()))).as_py():
                    raise EMBEDDING_NOT_FINITE.table(table=name, column=f.name)
            try:
                col = col.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise ValidationError(f"{name}.{f.name} cannot be read as {f.type}: {e}") from e
        elif f.name == "commit_id":
            col = pa.nulls(t.num_rows, pa.int64()).fill_null(0)
        elif not f.nullable:
            raise ValidationError(f"table {name!r} needs column {f.name!r}")
        else:
            col = pa.nulls(t.num_rows, f.type)
        if not f.nullable and col.null_count:
            raise ValidationError(f"{name}.{f.name} has {col.null_count} null(s); it is required")
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=sch)


def check_values(name: str, t: pa.Table) -> None:
    """The value rules of the write API (``rules.py``), over whole columns: valid UTF-8 text, names,
    counts and measures, finite floats, comparisons of two nodes, JSON configs."""
    try:
        t.validate(full=True)  # every string column's UTF-8 among the rest
    except pa.ArrowInvalid as e:
        raise ValidationError(f"table {name!r} holds a value that is not valid (UTF-8 text): {e}") from None
    for col in NAME_COLUMNS[name]:
        bad_names(t.column(col), f"{name}.{col}")
    for col in NOT_NEGATIVE.get(name, ()):
        c = t.column(col)
        bad = pc.less(c, 0)
        if pa.types.is_floating(c.type):
            bad = pc.or_kleene(bad, pc.invert(pc.is_finite(c)))
        if pc.any(bad).as_py():
            raise NEGATIVE.table(table=name, column=col, value=pc.filter(c, bad)[0].as_py())
    for col in FINITE.get(name, ()):
        if pc.any(pc.invert(pc.is_finite(t.column(col)))).as_py():
            raise NOT_FINITE.table(table=name, column=col)
    if name == "comparisons":
        same = _first(t, pc.equal(t.column("a"), t.column("b")))
        if same is not None:
            raise SAME_NODES.table(**same)
    if name == "sessions":
        for config in t.column("config").drop_null().to_pylist():  # a few per ingest: one per session
            config_text(config)


#: What a writer's memory says of committed values: (table, column, values) -> (present, absent).
Known = Callable[[str, str, Sequence[str]], tuple[set[str], set[str]]]
#: Questions with more values than this go to the store whole (a vectorized join beats a
#: Python loop over them); smaller ones ask memory first.
MEMORY_CHECK_MAX = 20_000


class _Lookups:
    """The store lookups one ingest needs (values present in, or missing from, a column), asked
    first and answered by one query: a query costs a snapshot's preparation (~10 ms after a
    commit), which an importer committing small units would otherwise pay six times per unit."""

    def __init__(self) -> None:
        self._asks: list[tuple[str, str, pa.Array, bool, int | None]] = []
        self._answers: list[pa.Array] = []

    def ask(self, table: str, col: str, values: pa.Array | pa.ChunkedArray, *, present: bool,
            limit: int | None = None) -> int:
        """Ask for the distinct ``values`` that ``table.col`` holds (``present``) or lacks (up to
        ``limit``); returns the question's number."""
        v = pc.unique(values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values)
        self._asks.append((table, col, v, present, limit))
        return len(self._asks) - 1

    def dangling(self, out: dict[str, pa.Table], ref: tuple[str, str], target: tuple[str, str]) -> int:
        """Ask for values of ``ref`` (table, column) found neither in the batch's ``target`` table
        nor in the store (up to 5, for the message)."""
        want = pc.unique(out[ref[0]].column(ref[1]))
        if target[0] in out:
            want = pc.filter(want, pc.invert(pc.is_in(want, out[target[0]].column(target[1]))))
        return self.ask(target[0], target[1], want, present=False, limit=5)

    def run(self, snap: Snapshot, known: Known | None = None) -> None:
        """Answer the questions: from ``known`` (what the writer's memory says, see
        ``Committer.known``) where it can, the rest in one query."""
        parts, relations = [], {}
        settled: dict[int, list[str]] = {}
        for i, (table, col, values, present, limit) in enumerate(self._asks):
            if known is not None and 0 < len(values) <= MEMORY_CHECK_MAX:
                vals = values.to_pylist()
                yes, no = known(table, col, vals)
                settled[i] = sorted(yes if present else no)
                values = pa.array([v for v in vals if v not in yes and v not in no], pa.string())
            if not len(values):
                continue
            join = "SEMI" if present else "ANTI"
            cap = f" LIMIT {int(limit)}" if limit else ""
            parts.append(f"SELECT * FROM (SELECT {i} AS q, w.v FROM __want{i} w {join} JOIN {table}_history h "
                         f"ON h.{col} = w.v ORDER BY w.v{cap})")
            relations[f"__want{i}"] = pa.table({"v": values})
        got = snap.execute(" UNION ALL ".join(parts), relations=relations).to_pylist() if parts else []
        found: dict[int, list[str]] = {}
        for r in got:
            found.setdefault(int(r["q"]), []).append(r["v"])
        answers = []
        for i, ask in enumerate(self._asks):
            vals = sorted([*settled.get(i, ()), *found.get(i, ())])
            answers.append(pa.array(vals[: ask[4]] if ask[4] else vals, pa.string()))
        self._answers = answers

    def __getitem__(self, i: int) -> list[str]:
        out: list[str] = self._answers[i].to_pylist()
        return out

    def array(self, i: int) -> pa.Array:
        return self._answers[i]


def prepare_bulk(snap: Snapshot, dim: int, tables: Mapping[str, pa.Table],
                 known: Known | None = None, provenance: str | None = None) -> dict[str, pa.Table]:
    """``tables`` conformed and checked for an ingest (see ``Database.ingest``); ``known``
    answers the store questions it can from the writer's memory. Nodes without a ``provenance``
    column get ``provenance`` (the writer's)."""
    unknown = set(tables) - set(DATA_TABLES)
    if unknown:
        raise ValidationError(f"unknown table(s) {sorted(unknown)}; tables are {list(DATA_TABLES)}")
    out = {n: conform(n, _defaults(n, t, provenance), dim) for n, t in tables.items()}
    for n, t in out.items():
        check_values(n, t)
    # trellisdb's own labels and attribute keys (trellis:quarantined ...) are written by quarantine / release
    if "labels" in out:
        reserved_names(out["labels"].column("label"), "labels.label")
    if "attributes" in out:
        reserved_names(out["attributes"].column("key"), "attributes.key")
    if "nodes" in out:
        bad_names(out["nodes"].column("provenance"), "nodes.provenance")
    if "attributes" in out:
        out["attributes"] = _attribute_columns(out["attributes"])
    empty = pa.array([], pa.string())
    nodes = out.get("nodes")
    node_ids = nodes.column("id").combine_chunks() if nodes is not None else empty
    if nodes is not None and pc.count_distinct(node_ids).as_py() != len(node_ids):
        vc = pc.value_counts(node_ids)
        dup = pc.filter(vc.field("values"), pc.greater(vc.field("counts"), 1))[0].as_py()
        raise DuplicateIdError(f"node id {dup!r} appears more than once in the batch")
    if "edges" in out:
        _check_edges(out["edges"])
    if "comparisons" in out:
        _check_comparisons(out["comparisons"])
    if "artifacts" in out:
        out["artifacts"] = _check_artifacts(out["artifacts"])
    if "rewards" in out:
        first = _first(out["rewards"], pc.invert(pc.is_finite(out["rewards"].column("value"))))
        if first is not None:
            raise REWARD_NOT_FINITE.table(**first)

    # what the store must (not) hold: asked together, one query
    look = _Lookups()
    clash = look.ask("nodes", "id", node_ids, present=True, limit=1)
    sessions = look.dangling(out, ("nodes", "session_id"), ("sessions", "id")) if nodes is not None else None
    # every node a row refers to exists in the batch or the store
    refs = [(n, c) for n, c in (("edges", "src"), ("edges", "dst"), ("rewards", "node_id"), ("labels", "node_id"),
                                ("node_artifacts", "node_id"), ("comparisons", "a"), ("comparisons", "b")) if n in out]
    want = pc.unique(pa.concat_arrays([out[n].column(c).combine_chunks() for n, c in refs])) if refs else empty
    referred = look.ask("nodes", "id", pc.filter(want, pc.invert(pc.is_in(want, node_ids))), present=False, limit=5)
    entities = _ask_attribute_entities(look, out) if "attributes" in out else {}
    tasks = {name: look.dangling(out, (name, "task_id"), ("tasks", "id")) for name in ("sessions", "nodes")
             if name in out}
    stored = look.ask("artifacts", "hash", out["artifacts"].column("hash"), present=True) if "artifacts" in out else None
    links = look.dangling(out, ("node_artifacts", "hash"), ("artifacts", "hash")) if "node_artifacts" in out else None
    look.run(snap, known)

    if look[clash]:
        raise DuplicateIdError(f"node id {look[clash][0]!r} already exists; bulk ingest writes new nodes only")
    if sessions is not None and look[sessions]:
        raise UnknownSessionError(f"node(s) name session {look[sessions][0]!r}, which does not exist")
    miss = look[referred]
    if miss:
        name, col = next((n, c) for n, c in refs if pc.any(pc.is_in(out[n].column(c), pa.array(miss[:1]))).as_py())
        err = UnknownParentError if col == "src" else UnknownNodeError
        raise err(f"{name}.{col} names node {miss[0]!r}, which does not exist")
    for scope, q in entities.items():
        if look[q]:
            cls: type[ValidationError] = {"node": UnknownNodeError, "session": UnknownSessionError}.get(
                scope, ValidationError)
            raise cls(f"attributes name {scope} {look[q][0]!r}, which does not exist")
    for name, q in tasks.items():
        if look[q]:
            raise ValidationError(
                f"{name}.task_id names task {look[q][0]!r}, which does not exist; add it with db.add_task "
                "or in the tasks table of this ingest"
            )
    if stored is not None and len(look.array(stored)):  # the same bytes are stored once
        arts = out["artifacts"]
        out["artifacts"] = arts.filter(pc.invert(pc.is_in(arts.column("hash"), look.array(stored))))
    if links is not None and look[links]:
        raise ValidationError(
            f"node_artifacts.hash names artifact {look[links][0]!r}, which does not exist; "
            "ingest its content in the artifacts table"
        )
    for name in list(out):
        if name != "nodes":  # duplicate node ids are an error (above)
            out[name] = last_per_key(out[name], KEYS[name])
    return out


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: Python's decoder refusing NaN and Infinity, which are not JSON (json.loads accepts them).
_STRICT_JSON = json.JSONDecoder(parse_constant=_refuse_constant)

#: Columns trellisdb sets itself: an ingest may not give them.
_SYSTEM_COLUMNS = {"nodes": ("born", "ordinal")}
#: Required columns an ingest may leave out, and the value they get.
_DEFAULTS = {"attributes": ("retracted", False), "labels": ("present", True)}


def _defaults(name: str, t: pa.Table, provenance: str | None = None) -> pa.Table:
    """``t`` with the columns trellisdb sets itself: a node's insertion order is its row's
    position (``ordinal``; ``born`` is the commit), its ``provenance`` the writer's unless the
    table gives one; a defaultable required column filled in."""
    given = [c for c in _SYSTEM_COLUMNS.get(name, ()) if c in t.column_names]
    if given:
        raise ValidationError(
            f"{name}.{given[0]} is set by trellisdb (the insertion order: the commit, then the row's position in "
            "the ingest); leave it out"
        )
    if name == "nodes":
        t = t.append_column("ordinal", pa.array(range(t.num_rows), pa.int64()))
        if "provenance" not in t.column_names:
            t = t.append_column("provenance", pa.array([provenance] * t.num_rows, pa.string()))
    if name in _DEFAULTS and _DEFAULTS[name][0] not in t.column_names:
        col, value = _DEFAULTS[name]
        t = t.append_column(col, pa.array([value] * t.num_rows, pa.bool_()))
    return t


def _attribute_columns(t: pa.Table) -> pa.Table:
    """Attributes arriving as a table: ``value`` must be JSON text (null for a retraction);
    ``num`` and ``text`` are derived from it (given ones are replaced)."""
    from trellisdb.rules import ATTR_MAX_BYTES, ATTRIBUTE_SCOPES

    bad_scope = _first(t, pc.invert(pc.is_in(t.column("scope"), pa.array(ATTRIBUTE_SCOPES))))
    if bad_scope is not None:
        raise ValidationError(f"attributes.scope {bad_scope['scope']!r} is not one of {', '.join(ATTRIBUTE_SCOPES)}")
    # JSON null retracts, as set_attrs(None) does; a retraction keeps no value
    retracted = pc.or_(t.column("retracted").combine_chunks(),
                       pc.fill_null(pc.equal(t.column("value").combine_chunks(), "null"), False))
    t = t.set_column(t.schema.get_field_index("retracted"), t.schema.field("retracted"), retracted)
    t = t.set_column(t.schema.get_field_index("value"), t.schema.field("value"),
                     pc.if_else(retracted, pa.scalar(None, pa.string()), t.column("value").combine_chunks()))
    unset = _first(t, pc.and_(pc.is_null(t.column("value")), pc.invert(t.column("retracted"))))
    if unset is not None:
        raise ValidationError(
            f"attribute {unset['key']!r} of {unset['entity']!r} has no value; give JSON text, or retracted=true"
        )
    value = t.column("value").combine_chunks()
    big = _first(t, pc.fill_null(pc.greater(pc.binary_length(value), ATTR_MAX_BYTES), False))
    if big is not None:
        raise ValidationError(
            f"attribute {big['key']!r} of {big['entity']!r} is {len(str(big['value']).encode()):,} bytes as JSON; at "
            f"most {ATTR_MAX_BYTES:,} are kept per attribute. Store bulky values as an artifact of the node"
        )
    # the common values in Arrow: numbers in JSON's own grammar, strings with nothing escaped,
    # true / false / null; anything else (escapes, lists, mappings) is decoded row by row
    number = pc.fill_null(pc.match_substring_regex(value, _JSON_NUMBER), False)
    plain = pc.fill_null(pc.match_substring_regex(value, _JSON_PLAIN_STRING), False)
    simple = pc.or_(pc.or_(number, plain), pc.fill_null(pc.is_in(value, pa.array(["true", "false", "null"])), False))
    nums = pc.if_else(number, pc.cast(pc.if_else(number, value, "0"), pa.float64()), None)
    texts = pc.if_else(plain, pc.utf8_slice_codeunits(value, 1, -1), None)
    if not pc.all(pc.fill_null(pc.is_finite(nums), True)).as_py():
        i = pc.index(pc.fill_null(pc.invert(pc.is_finite(nums)), False), True).as_py()
        raise ValidationError(f"attributes.value of row {i} is not a finite number: {str(value[i])[:80]!r}")
    rest = pc.indices_nonzero(pc.and_(pc.is_valid(value), pc.invert(simple))).to_pylist()
    if rest:
        num_list, text_list = nums.to_pylist(), texts.to_pylist()
        decode = _STRICT_JSON.decode
        for i in rest:  # one strict decode per such attribute (~1 µs)
            v = value[i].as_py()
            try:
                x: Any = decode(v)
            except ValueError:
                raise ValidationError(f"attributes.value of row {i} is not JSON text (finite numbers only): "
                                      f"{str(v)[:80]!r}") from None
            kind = type(x)
            if kind is float and not math.isfinite(x):
                raise ValidationError(f"attributes.value of row {i} is not a finite number: {str(v)[:80]!r}")
            if kind is str and utf8_problem(x):
                raise ValidationError(f"attributes.value of row {i} is not valid UTF-8 text ({utf8_problem(x)})")
            if kind is int and not -(2**63) <= x < 2**63:
                x = float(x)  # as its number column holds it (a double)
            num_list[i] = float(x) if kind is int or kind is float else None
            text_list[i] = x if kind is str else None
        nums, texts = pa.array(num_list, pa.float64()), pa.array(text_list, pa.string())
    t = t.set_column(t.schema.get_field_index("num"), t.schema.field("num"), nums)
    return t.set_column(t.schema.get_field_index("text"), t.schema.field("text"), texts)


#: A JSON number (RFC 8259's grammar: no leading zeros, no bare dot, no NaN / Infinity).
_JSON_NUMBER = r"^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$"
#: A JSON string with no escape and no control character: its text is what lies between the quotes.
_JSON_PLAIN_STRING = r'^"[^"\\\x00-\x1f]*"$'


def last_per_key(t: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """The table with one row per key, the last one written (as a commit of single writes does).

    Two rows with one key in one commit would share a commit id, and the
    current state would have no defined winner.

    >>> last_per_key(pa.table({"k": ["a", "b", "a"], "v": [1, 2, 3]}), ("k",)).to_pylist()
    [{'k': 'b', 'v': 2}, {'k': 'a', 'v': 3}]
    """
    if t.num_rows < 2:
        return t
    idx = t.select(list(keys)).append_column("__i", pa.array(range(t.num_rows), pa.int64()))
    last = idx.group_by(list(keys), use_threads=False).aggregate([("__i", "max")]).column("__i_max")
    if len(last) == t.num_rows:
        return t
    return t.take(pc.take(last, pc.sort_indices(last)))


def _first(t: pa.Table, mask: pa.ChunkedArray | pa.Array) -> dict[str, object] | None:
    """The first row of ``t`` where ``mask`` is true, or None."""
    if not pc.any(mask).as_py():
        return None
    row: dict[str, object] = pc.filter(t, mask).slice(0, 1).to_pylist()[0]
    return row


def _ask_attribute_entities(look: _Lookups, out: dict[str, pa.Table]) -> dict[str, int]:
    """Ask whether every attribute's node, session or task exists (in the batch or the store)."""
    attrs = out["attributes"]
    asks = {}
    for scope, table in (("node", "nodes"), ("session", "sessions"), ("task", "tasks")):
        want = pc.unique(pc.filter(attrs.column("entity"), pc.equal(attrs.column("scope"), scope)))
        if table in out:
            want = pc.filter(want, pc.invert(pc.is_in(want, out[table].column("id"))))
        asks[scope] = look.ask(table, "id", want, present=False, limit=5)
    return asks


def _check_edges(edges: pa.Table) -> None:
    bad = _first(edges, pc.invert(pc.is_in(edges.column("kind"), pa.array(EDGE_KINDS))))
    if bad is not None:
        raise UNKNOWN_EDGE_KIND.table(**bad)
    loop = _first(edges, pc.equal(edges.column("src"), edges.column("dst")))
    if loop is not None:
        raise SELF_LOOP.table(**loop)


def _check_comparisons(comps: pa.Table) -> None:
    pref = comps.column("preferred")
    ok = pc.or_kleene(pc.is_null(pref), pc.or_(pc.equal(pref, comps.column("a")), pc.equal(pref, comps.column("b"))))
    bad = _first(comps, pc.invert(ok))
    if bad is not None:
        raise NOT_PREFERRED.table(**bad)


def _sha256_hex(col: pa.ChunkedArray) -> list[str | None]:
    """sha256 of every value, reading the Arrow buffers in place (no copies).

    hashlib has no vectorized form; the loop costs ~1 µs per value next to
    hashing the bytes themselves (threads do not help: the loop holds the GIL).
    """
    out: list[str | None] = []
    for chunk in col.chunks:
        arr = chunk if pa.types.is_large_binary(chunk.type) else chunk.cast(pa.large_binary())
        offsets = memoryview(arr.buffers()[1]).cast("q")[arr.offset : arr.offset + len(arr) + 1]
        data = memoryview(arr.buffers()[2] or b"")
        valid = arr.is_valid().to_numpy(zero_copy_only=False)
        sha = hashlib.sha256
        out.extend(sha(data[offsets[i] : offsets[i + 1]]).hexdigest() if valid[i] else None for i in range(len(arr)))
    return out


def _check_artifacts(arts: pa.Table) -> pa.Table:
    """Check content addressing; fill in sizes."""
    content = arts.column("content")
    if content.null_count:
        bad = _first(arts, pc.is_null(content))
        raise ValidationError(f"artifact {bad and bad['hash']!r} has no content; artifacts store their bytes")
    hashes = arts.column("hash")
    actual = pa.array(_sha256_hex(content), pa.string())
    wrong = pc.not_equal(hashes, actual)
    if pc.any(wrong).as_py():
        i = pc.index(wrong, True).as_py()
        raise ValidationError(
            f"artifact hash {hashes[i].as_py()!r} is not the sha256 of its content ({actual[i].as_py()!r}); "
            "artifacts are content-addressed: hash = sha256(content).hexdigest()"
        )
    length = pc.binary_length(content).cast(pa.int64())
    size = arts.column("size")
    bad_size = pc.and_(pc.is_valid(size), pc.not_equal(size, length))
    if pc.any(bad_size).as_py():
        i = pc.index(bad_size, True).as_py()
        raise ValidationError(
            f"artifact {hashes[i].as_py()!r} says size {size[i].as_py()} but its content is {length[i].as_py()} bytes"
        )
    # stored ones are dropped by prepare_bulk; within the batch, one row per key (last_per_key)
    return arts.set_column(arts.schema.get_field_index("size"), arts.schema.field("size"), pc.coalesce(size, length))
