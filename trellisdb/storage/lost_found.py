"""A purge's pass over ``lost+found/``: the purged sessions' rows out of every copy a repair keeps.

A repair (``recovery.py``) copies what it takes out or drops into ``lost+found/<UTC time>/``: the
commit log as it was, rows it could not prove (Parquet), WAL segments with damaged or stale
frames, its report. A purge (``trellisdb/purge.py``) reaches each file there by what it holds,
told by its content (and its name where the content does not say), not by today's names:

=============  ==================================================================================
kind           what the purge does
=============  ==================================================================================
Parquet        the rows the purge takes out of the table the file copies go (the table told by the
               name, ``<table>[.<anything>].parquet``, else by the columns); a file whose table
               cannot be told, or that cannot be read, is removed
WAL segment    each frame is rewritten without the purged rows (its commit record kept, its parts'
               lengths and checksum set anew; a frame whose rows failed their checksum keeps
               failing it); a frame with a part past decoding that names a purged session, node
               or artifact loses all its rows (which of the others were the same nodes' cannot be
               told), and the damaged bytes between frames go when they name one
commit log     its commit records stay, as the live log's do (ids, times, writers, session ids,
               messages and meta: ``purge.py``); a damaged line, which is no record any more, is
               dropped when it names a purged session, node or artifact
JSON           every object naming one (a value equal to its id) is taken out, and every such
               value of a list; free text (a message) stays, as commit messages do
anything else  removed: it cannot be filtered (a symbolic link, an unreadable file, an unknown kind)
=============  ==================================================================================

"Naming" is the bytes of an id, as UTF-8 or as JSON escapes it, anywhere in what cannot be
decoded: a short id may be found in unrelated bytes, and then those go too (a purge errs towards
taking out). A file changed is written aside and renamed over the old one; every file removed and
every run of bytes dropped is returned for the audit commit's meta.

    >>> import tempfile, os, pyarrow as pa, pyarrow.compute as pc, pyarrow.parquet as pq
    >>> d = tempfile.mkdtemp(); os.makedirs(f"{d}/t1")
    >>> pq.write_table(pa.table({"id": ["x", "y"], "session_id": ["s1", "s2"]}), f"{d}/t1/nodes.parquet")
    >>> rule = (["id", "session_id"], lambda r: pc.equal(r["session_id"], "s1"))
    >>> report = purge_copies(d, {"nodes": rule}.get, {"s1", "x"})
    >>> report["rows"], pq.read_table(f"{d}/t1/nodes.parquet")["id"].to_pylist()
    (1, ['y'])
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trellisdb.schema import DATA_TABLES, table_schema
from trellisdb.storage.lines import decode_line, sync_dir
from trellisdb.storage.purge import Drop, filter_parquet, mask
from trellisdb.storage.spaces import space_schema
from trellisdb.storage.wal import Piece, frame_bytes, ipc_part, json_part, json_rows, pieces

#: Which rows of a table a purge takes out: the columns read, and the rule (None: the table keeps
#: every row, as ``tasks`` does).
Rule = tuple[list[str], Drop]
RuleOf = Callable[[str], "Rule | None"]

#: The tables of named spaces: ``vec_<target>_<space>`` (``storage/spaces.py``).
_SPACE_TABLE = re.compile(r"vec_(nodes|tasks)_[a-z_][a-z0-9_]*")
#: A WAL segment's name, with whatever a repair put around its generation.
_SEGMENT_NAME = re.compile(r"wal-.*\.log")
#: The most file names and runs of bytes the report lists (the rest are counted).
REPORT_ITEMS = 100


def _columns() -> dict[str, frozenset[str]]:
    out = {name: frozenset(table_schema(name, 1).names) for name in DATA_TABLES}
    space = frozenset(space_schema(1).names)
    out["vec_nodes_*"] = out["vec_tasks_*"] = space
    return out


_COLUMNS = _columns()


def tables_of(name: str, columns: Iterable[str]) -> list[str]:
    """The tables a copy named ``name`` (a file name) with ``columns`` may hold the rows of: the one
    its name says (``nodes.parquet``, ``nodes.partial.parquet``, ``vec_nodes_sp.parquet``), else
    every table that has all those columns (``vec_nodes_*`` standing for a space's).

    >>> tables_of("nodes.7.parquet", ["id"]), tables_of("x.parquet", ["src", "dst", "kind"])
    (['nodes'], ['edges'])
    """
    stem = name.split(".", 1)[0]
    if stem in _COLUMNS or _SPACE_TABLE.fullmatch(stem):
        return [stem]
    cols = set(columns)
    return [t for t, have in _COLUMNS.items() if cols <= have]


def _rules_of(tables: list[str], rule_of: RuleOf) -> list[Rule]:
    return [r for r in (rule_of(t) for t in tables) if r is not None]


def _union(rules: list[Rule]) -> Drop:
    def drop(rows: pa.Table) -> Any:
        out = rules[0][1](rows)
        for _, d in rules[1:]:
            out = pc.or_kleene(out, d(rows))
        return out
    return drop


@dataclass
class _Report:
    root: str
    rows: int = 0
    rewritten: list[str] = field(default_factory=list)
    removed: list[dict[str, str]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)

    def rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def remove(self, path: str, why: str) -> None:
        os.remove(path)
        sync_dir(os.path.dirname(path))
        self.removed.append({"file": self.rel(path), "why": why})

    def as_dict(self) -> dict[str, Any]:
        def cut(items: list[Any]) -> list[Any]:
            return items[:REPORT_ITEMS] + ([f"... {len(items) - REPORT_ITEMS} more"] if len(items) > REPORT_ITEMS else [])
        return {"rows": self.rows, "rewritten": cut(self.rewritten), "removed": cut(self.removed),
                "dropped": cut(self.dropped)}


class _Names:
    """Whether bytes name a purged session, node or artifact: hold one's id, as UTF-8 or as JSON
    writes it (escaped to ASCII)."""

    def __init__(self, ids: Iterable[str]) -> None:
        forms: set[bytes] = set()
        for i in ids:
            forms.add(i.encode("utf-8", "surrogateescape"))
            forms.add(json.dumps(i)[1:-1].encode())
        self._forms = sorted(f for f in forms if f)

    def __call__(self, data: bytes) -> bool:
        return any(f in data for f in self._forms)


def _files(root: str) -> Iterator[str]:
    for folder, _, files in os.walk(root):
        for f in sorted(files):
            yield os.path.join(folder, f)


def _write(path: str, data: bytes) -> None:
    """Write ``data`` aside and rename it over ``path``, durably."""
    tmp = path + ".purge"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    sync_dir(os.path.dirname(path))


def _kind(path: str, data: bytes | None) -> str:
    """parquet | json | wal | log | unknown, from the content (and the name where it does not say)."""
    name = os.path.basename(path)
    if name.endswith(".parquet") or (data is not None and data[:4] == b"PAR1"):
        return "parquet"
    if data is None:
        return "unknown"
    if name.endswith(".json"):
        return "json"
    if _SEGMENT_NAME.fullmatch(name) or any(p.record is not None and p.intact and p.record.get("bytes")
                                            for p in pieces(data)):
        return "wal"
    if any(decode_line(line) is not None for line in data.splitlines(keepends=True)):
        return "log"
    return "unknown"


def _read(path: str) -> bytes | None:
    if path.endswith(".parquet"):
        return None  # read by pyarrow
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:
        return None


# ------------------------------------------------------------------ what the copies say


def copied_ids(root: str, sessions: Iterable[str]) -> tuple[set[str], set[tuple[str, str]]]:
    """What the copies under ``root`` say of whom rows belong to: the ids of nodes whose rows name
    one of ``sessions`` (a node a repair took out of the tables may be only here), and every
    (node id, artifact hash) link they hold. A purge adds them to what the tables say."""
    want = set(sessions)
    nodes: set[str] = set()
    links: set[tuple[str, str]] = set()

    def take(table: str, cols: list[dict[str, Any]] | pa.Table) -> None:
        rows = cols.to_pylist() if isinstance(cols, pa.Table) else cols
        if table == "nodes":
            nodes.update(str(r["id"]) for r in rows if r.get("session_id") in want and isinstance(r.get("id"), str))
        elif table == "node_artifacts":
            links.update((str(r["node_id"]), str(r["hash"])) for r in rows
                         if isinstance(r.get("node_id"), str) and isinstance(r.get("hash"), str))

    if not os.path.isdir(root):
        return nodes, links
    for path in _files(root):
        if os.path.islink(path):
            continue
        data = _read(path)
        kind = _kind(path, data)
        if kind == "parquet":
            try:
                schema = pq.read_schema(path)
                for t in tables_of(os.path.basename(path), schema.names):
                    need = {"nodes": ["id", "session_id"], "node_artifacts": ["node_id", "hash"]}.get(t)
                    if need and set(need) <= set(schema.names):
                        take(t, pq.read_table(path, columns=need))
            except (OSError, ValueError, pa.ArrowException):
                continue  # unreadable: the purge removes it
        elif kind == "wal" and data is not None:
            for p in pieces(data):
                for name, fmt, part in p.parts:
                    if name not in ("nodes", "node_artifacts"):
                        continue
                    if fmt == "json":
                        rows = json_rows(part)
                        if rows is not None:
                            take(name, rows)
                    else:
                        try:
                            take(name, pa.ipc.open_stream(pa.py_buffer(part)).read_all())
                        except (OSError, ValueError, KeyError, pa.ArrowException):
                            continue
    return nodes, links


# ------------------------------------------------------------------ the purge of the copies


def purge_copies(root: str, rule_of: RuleOf, ids: Iterable[str]) -> dict[str, Any]:
    """Take the purged rows out of every file under ``root`` (a store's ``lost+found``), by kind
    (see the module notes). ``rule_of(table)``: which rows of a table go; ``ids``: the purged
    sessions', nodes' and artifacts' ids (what "names them" means). Returns ``{"rows": taken out,
    "rewritten": [files], "removed": [{"file", "why"}], "dropped": [{"file", "bytes", "what"}]}``
    (paths relative to ``root``). Caller holds the writer lock."""
    report = _Report(root)
    if not os.path.isdir(root):
        return report.as_dict()
    names = _Names(ids)
    for path in _files(root):
        if os.path.islink(path):  # a repair writes none: what it points at is not the store's to filter
            report.remove(path, "a symbolic link")
            continue
        data = _read(path)
        kind = _kind(path, data)
        if kind == "parquet":
            _parquet(path, rule_of, report)
        elif data is None or kind == "unknown":
            report.remove(path, "cannot be read" if data is None else "not a kind a purge can filter (Parquet, a "
                          "WAL segment, a commit log, JSON)")
        elif kind == "wal":
            _segment(path, data, rule_of, names, report)
        elif kind == "log":
            _log(path, data, names, report)
        else:
            _json(path, data, set(ids), report)
    return report.as_dict()


def _parquet(path: str, rule_of: RuleOf, report: _Report) -> None:
    try:
        columns = pq.read_schema(path).names
    except (OSError, ValueError, pa.ArrowException) as e:
        report.remove(path, f"an unreadable Parquet file ({e})")
        return
    tables = tables_of(os.path.basename(path), columns)
    rules = _rules_of(tables, rule_of)
    if not tables or any(not set(cols) <= set(columns) for cols, _ in rules):
        report.remove(path, "a Parquet file of no table a purge knows the rows of (by its name or its columns "
                      f"{', '.join(columns[:8])}{', ...' if len(columns) > 8 else ''})")
        return
    if not rules:  # a table a purge keeps whole (tasks)
        return
    try:
        n = filter_parquet(path, _union(rules))
    except (OSError, ValueError, pa.ArrowException) as e:
        report.remove(path, f"an unreadable Parquet file ({e})")
        return
    report.rows += n
    if n:
        report.rewritten.append(report.rel(path))


def _rows_part(fmt: str, part: bytes, rule: Rule) -> tuple[bytes | None, int] | None:
    """The part without the rows ``rule`` takes (None: no row is left), and how many went; None
    when the part cannot be decoded."""
    cols, drop = rule
    if fmt == "json":
        rows = json_rows(part)
        if rows is None:
            return None
        try:
            table = pa.table({c: pa.array([r.get(c) for r in rows], pa.string()) for c in cols})
        except (pa.ArrowException, TypeError):
            return None
        gone = mask(drop, table)
        if not gone.any():
            return part, 0
        left = [r for r, g in zip(rows, gone, strict=True) if not g]
        return (json_part(left) if left else None), int(gone.sum())
    try:
        t = pa.ipc.open_stream(pa.py_buffer(part)).read_all()
        gone = mask(drop, t.select(cols))
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return None
    if not gone.any():
        return part, 0
    t = t.filter(pa.array(~gone))
    return (ipc_part(t) if t.num_rows else None), int(gone.sum())


def _segment(path: str, data: bytes, rule_of: RuleOf, names: _Names, report: _Report) -> None:
    out: list[bytes] = []
    rows = dropped = 0
    for p in pieces(data):
        if p.record is None:  # damage: no frame to rewrite
            if names(p.raw):
                dropped += len(p.raw)
            else:
                out.append(p.raw)
            continue
        parts, changed = _frame_parts(p, rule_of, names)
        rows += changed[0]
        dropped += changed[1]
        out.append(frame_bytes(p.record, parts, intact=p.intact) if changed != (0, 0) else p.raw)
    if dropped:
        report.dropped.append({"file": report.rel(path), "bytes": dropped,
                               "what": "damaged frames (or parts) naming the purged sessions"})
    if rows or dropped:
        report.rows += rows
        _write(path, b"".join(out))
        report.rewritten.append(report.rel(path))


def _frame_parts(p: Piece, rule_of: RuleOf, names: _Names) -> tuple[list[tuple[str, str, bytes]], tuple[int, int]]:
    """The frame's parts without the purged rows; (rows taken, bytes dropped). A part past decoding
    that names the purged sessions takes the whole frame's rows with it: which of the others are
    theirs (the rewards and artifacts of the nodes it held) cannot be told."""
    done: list[tuple[str, str, bytes, tuple[bytes | None, int] | None]] = []
    for name, fmt, part in p.parts:
        rule = rule_of(name)
        got = (part, 0) if rule is None else _rows_part(fmt, part, rule)
        if got is None and names(part):
            return [], (0, sum(len(x) for _, _, x in p.parts))
        done.append((name, fmt, part, got))
    parts: list[tuple[str, str, bytes]] = []
    rows = 0
    for name, fmt, part, got in done:
        if got is None:  # past decoding, naming none of them: kept as it is
            parts.append((name, fmt, part))
            continue
        kept, n = got
        rows += n
        if kept is not None:
            parts.append((name, fmt, kept))
    return parts, (rows, 0)


def _log(path: str, data: bytes, names: _Names, report: _Report) -> None:
    kept: list[bytes] = []
    dropped = 0
    for line in data.splitlines(keepends=True):
        if decode_line(line) is None and names(line):  # damage: no record any more
            dropped += len(line)
        else:
            kept.append(line)
    if dropped:
        _write(path, b"".join(kept))
        report.rewritten.append(report.rel(path))
        report.dropped.append({"file": report.rel(path), "bytes": dropped,
                               "what": "damaged lines naming the purged sessions"})


def _json(path: str, data: bytes, ids: set[str], report: _Report) -> None:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as e:
        report.remove(path, f"JSON that cannot be read ({e})")
        return
    cleaned, changed = _clean(value, ids)
    if changed:
        _write(path, json.dumps(cleaned, indent=1).encode())
        report.rewritten.append(report.rel(path))


def _names_directly(v: Any, ids: set[str]) -> bool:
    """Whether ``v`` is an id of ``ids``, or an object one of whose values is."""
    if isinstance(v, str):
        return v in ids
    return isinstance(v, dict) and any(isinstance(x, str) and x in ids for x in v.values())


def _clean(v: Any, ids: set[str]) -> tuple[Any, bool]:
    """``v`` without the objects (and list items) that name an id of ``ids``; whether any went."""
    if isinstance(v, list):
        out, changed = [], False
        for x in v:
            if _names_directly(x, ids):
                changed = True
                continue
            y, c = _clean(x, ids)
            out.append(y)
            changed |= c
        return out, changed
    if isinstance(v, dict):
        d, changed = {}, False
        for k, x in v.items():
            if k in ids or (isinstance(x, str) and x in ids) or (isinstance(x, dict) and _names_directly(x, ids)):
                changed = True
                continue
            y, c = _clean(x, ids)
            d[k] = y
            changed |= c
        return d, changed
    return v, False
