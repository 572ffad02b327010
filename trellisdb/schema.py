"""Arrow schemas of the experience-graph tables.

Every row is an immutable fact stamped with the ``commit_id`` of the commit that
wrote it. "Current" state is the latest row per key (``KEYS``) among the rows
visible at a commit. Field-by-field documentation lives in ``ARCHITECTURE.md``
and in the ``doc`` metadata of each field::

    >>> from trellisdb.schema import table_schema
    >>> table_schema("nodes", 4).field("embedding").type
    FixedSizeListType(fixed_size_list<item: float>[4])
"""

from __future__ import annotations

import functools

import pyarrow as pa

#: Version of the on-disk format. 2 added the insertion order, event time and step-record columns
#: of ``ADDED`` and the tables ``attributes`` and ``labels``; 3 added ``nodes.provenance`` (who
#: wrote a node). A store of version 1 or 2 is upgraded in place when a writable handle opens it
#: (``upgrade.py``: metadata-only, no row is rewritten).
FORMAT_VERSION = 3

TS = pa.timestamp("us", tz="UTC")


#: Lance field metadata compressing a column's pages with zstd (level 1: the text of code,
#: prompts and responses shrinks ~3x, for ~35% more write time of that column than raw bytes).
#: A store's tables keep the schema they were created with: stores made before this stay raw.
COMPRESSED = {"lance-encoding:compression": "zstd", "lance-encoding:compression-level": "1"}


def _f(name: str, typ: pa.DataType, doc: str, nullable: bool = True) -> pa.Field:
    return pa.field(name, typ, nullable=nullable, metadata={"doc": doc})


def _embedding(dim: int) -> pa.DataType:
    return pa.list_(pa.float32(), dim)


COMMIT_ID = _f("commit_id", pa.int64(), "id of the commit that wrote this row", nullable=False)


@functools.lru_cache(maxsize=256)
def table_schema(name: str, dim: int) -> pa.Schema:
    """The Arrow schema of table ``name`` for embedding dimension ``dim``."""
    fields = _FIELDS[name](dim)
    return pa.schema([*fields, COMMIT_ID, *ADDED.get(name, ())])


def _tasks(dim: int) -> list[pa.Field]:
    return [
        _f("id", pa.string(), "task id (caller-supplied or generated)", False),
        _f("name", pa.string(), "human-readable task name"),
        _f("spec", pa.string(), "task specification text"),
        _f("tags", pa.list_(pa.string()), "free-form labels"),
        _f("embedding", _embedding(dim), "optional embedding of the spec"),
        _f("created_at", TS, "wall-clock time the row was written"),
    ]


def _sessions(dim: int) -> list[pa.Field]:
    return [
        _f("id", pa.string(), "session id", False),
        _f("task_id", pa.string(), "task this session works on", False),
        _f("agent", pa.string(), "agent name (e.g. openevolve)"),
        _f("model", pa.string(), "model the agent used"),
        _f("config", pa.string(), "agent configuration, JSON text"),
        _f("status", pa.string(), "running | completed | failed | ..."),
        _f("created_at", TS, "wall-clock time the row was written"),
    ]


def _nodes(dim: int) -> list[pa.Field]:
    return [
        _f("id", pa.string(), "node id (e.g. an OpenEvolve program id)", False),
        _f("session_id", pa.string(), "session that produced the node", False),
        _f("task_id", pa.string(), "task of that session", False),
        _f("kind", pa.string(), "attempt | step | tool_call | observation | ..."),
        _f("step", pa.int64(), "step number within the session"),
        _f("status", pa.string(), "pending | evaluated | failed | expanded | closed | ..."),
        _f("summary", pa.string(), "short text describing the node"),
        _f("tokens_in", pa.int64(), "cost: prompt tokens"),
        _f("tokens_out", pa.int64(), "cost: completion tokens"),
        _f("seconds", pa.float64(), "cost: wall-clock seconds"),
        _f("usd", pa.float64(), "cost: money"),
        _f("source", pa.string(), "provenance (importer, tool, ...)"),
        _f("embedding", _embedding(dim), "optional embedding of the node"),
        _f("created_at", TS, "wall-clock time the row was written"),
    ]


def _edges(dim: int) -> list[pa.Field]:
    return [
        _f("src", pa.string(), "parent / source node id", False),
        _f("dst", pa.string(), "child / derived node id", False),
        _f(
            "kind", pa.string(), "derived_from | repair_of | crossover_of | inspired_by | retrieved | depends_on", False
        ),
        _f("session_id", pa.string(), "session that recorded the edge"),
    ]


def _artifacts(dim: int) -> list[pa.Field]:
    return [
        _f("hash", pa.string(), "sha256 of content, hex; the key", False),
        _f("media_type", pa.string(), "e.g. text/x-python, text/plain"),
        _f("size", pa.int64(), "content length in bytes"),
        pa.field("content", pa.large_binary(), metadata={"doc": "the bytes, stored once per hash", **COMPRESSED}),
    ]


def _node_artifacts(dim: int) -> list[pa.Field]:
    return [
        _f("node_id", pa.string(), "node the artifact belongs to", False),
        _f("name", pa.string(), "role of the artifact for the node (code, prompt, ...)", False),
        _f("hash", pa.string(), "artifact hash", False),
    ]


def _rewards(dim: int) -> list[pa.Field]:
    return [
        _f("node_id", pa.string(), "rewarded node", False),
        _f("channel", pa.string(), "signal name (correct, speedup, combined_score, ...)", False),
        _f("value", pa.float64(), "finite value", False),
        _f("verifier", pa.string(), "who produced it"),
        _f("verifier_version", pa.string(), "version of the verifier"),
        _f("created_at", TS, "wall-clock time the row was written"),
    ]


def _comparisons(dim: int) -> list[pa.Field]:
    return [
        _f("id", pa.string(), "comparison id", False),
        _f("a", pa.string(), "first node", False),
        _f("b", pa.string(), "second node", False),
        _f("preferred", pa.string(), "a's or b's id; null for a tie"),
        _f("margin", pa.float64(), "strength of the preference"),
        _f("judge", pa.string(), "who judged"),
    ]


def _attributes(dim: int) -> list[pa.Field]:
    return [
        _f("scope", pa.string(), "what the attribute describes: node | session | task", False),
        _f("entity", pa.string(), "id of that node, session or task", False),
        _f("key", pa.string(), "attribute name", False),
        _f("value", pa.string(), "the value as JSON text (null once retracted)"),
        _f("num", pa.float64(), "the value if it is a number (not a boolean), else null"),
        _f("text", pa.string(), "the value if it is a string, else null"),
        _f("retracted", pa.bool_(), "true: this row removes the attribute", False),
        _f("session_id", pa.string(), "session that wrote the row, if one"),
        _f("event_time", TS, "event time: when it became true in the agent's world (null: not given)"),
    ]


def _labels(dim: int) -> list[pa.Field]:
    return [
        _f("node_id", pa.string(), "labelled node", False),
        _f("label", pa.string(), "membership name (population, island_2, archive, ...)", False),
        _f("present", pa.bool_(), "true: the node has the label from this commit on; false: removed", False),
        _f("session_id", pa.string(), "session that wrote the row, if one"),
        _f("event_time", TS, "event time: when it became true in the agent's world (null: not given)"),
    ]


_FIELDS = {
    "tasks": _tasks,
    "sessions": _sessions,
    "nodes": _nodes,
    "edges": _edges,
    "artifacts": _artifacts,
    "node_artifacts": _node_artifacts,
    "rewards": _rewards,
    "comparisons": _comparisons,
    "attributes": _attributes,
    "labels": _labels,
}

_AT = _f("event_time", TS, "event time: when it happened in the agent's world (null: not given); commit time is the commit's")

#: Columns added after format version 1, in the order they were added (version 2: all but
#: ``nodes.provenance``, which version 3 added). They follow ``commit_id`` so that a table upgraded
#: in place (Lance appends added columns) and a new one have the same order; a new column goes last.
ADDED: dict[str, tuple[pa.Field, ...]] = {
    "sessions": (_AT,),
    "nodes": (
        _f("born", pa.int64(), "commit that first wrote the node (null: this row's commit); rewrites keep it"),
        _f("ordinal", pa.int64(), "position of the node among the nodes first written by that commit"),
        _AT,
        _f("action", pa.string(), "step records: the action taken (a command, a tool call)"),
        _f("state", pa.string(), "step records: the state it was taken from (e.g. JSON of open file, cwd)"),
        _f("provenance", pa.string(), "who wrote the node (set by the writer: 'api', 'token:<name>', "
           "'importer:<format>'; null: written before format 3); rewrites keep it"),
    ),
    "edges": (_AT,),
    "rewards": (_AT,),
    "comparisons": (_AT,),
}

#: Tables format version 1 did not have.
NEW_TABLES: tuple[str, ...] = ("attributes", "labels")

#: Tables stored as Lance datasets, in commit order.
DATA_TABLES: tuple[str, ...] = tuple(_FIELDS)

#: The key of each table: current state is the latest row per key.
KEYS: dict[str, tuple[str, ...]] = {
    "tasks": ("id",),
    "sessions": ("id",),
    "nodes": ("id",),
    "edges": ("src", "dst", "kind"),
    "artifacts": ("hash",),
    "node_artifacts": ("node_id", "name"),
    "rewards": ("node_id", "channel"),
    "comparisons": ("id",),
    "attributes": ("scope", "entity", "key"),
    "labels": ("node_id", "label"),
}

#: Rows of the latest version of a key that the current-state view hides: a retracted
#: attribute, a removed label (the history views keep them).
HIDDEN: dict[str, str] = {"attributes": "retracted", "labels": "NOT present"}

#: The insertion order of nodes (``seq`` in the views): first commit, then order within it.
#: Status, attribute and label changes never move it.
SEQ_SQL = "(coalesce(born, commit_id) * 4294967296 + coalesce(ordinal, 0))"

COMMITS_SCHEMA = pa.schema(
    [
        _f("id", pa.int64(), "commit id, strictly increasing", False),
        _f("time", TS, "wall-clock time of the commit"),
        _f("writer", pa.string(), "host:pid of the committing process"),
        _f("session_id", pa.string(), "session of the writes, if one"),
        _f("message", pa.string(), "commit message"),
        _f("rows", pa.int64(), "rows written"),
        _f("tags", pa.list_(pa.string()), "tag names pointing at this commit"),
        _f("meta", pa.string(), "the commit's metadata (run-level state) as JSON text, keys sorted"),
    ]
)

EDGE_KINDS = ("derived_from", "repair_of", "crossover_of", "inspired_by", "retrieved", "depends_on")
