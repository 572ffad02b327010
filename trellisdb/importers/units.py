"""Committing an import: one commit per unit, idempotent, with a progress bar.

A format's reader yields :class:`Unit` s in order; :func:`commit_units` writes each with
``db.ingest`` (vectorized checks; one commit), its metadata extended by ``import``: the format,
the source and the unit's name; its nodes' ``provenance`` is ``importer:<format>`` (unless the
reader gives one). Before it starts, it reads which units of that source the
store already holds, and skips them, so an import interrupted anywhere is finished by running
it again, and one run twice adds nothing. A skipped unit whose tag is missing is tagged again
(a crash between the commit and its tag leaves it so; a tag removed with ``untag`` comes back
the same way); one whose tag names another commit is an error, as is a new unit whose tag
exists already (checked before anything of it is written). A value the store cannot hold that
a reader let through (a number out of range, text UTF-8 cannot hold) refuses its unit with an
``ImportFormatError`` naming it, as a reader refuses a bad file.
"""

from __future__ import annotations

import errno
import functools
import os
import queue
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb.errors import ImportFormatError, TrellisError
from trellisdb.names import utf8_problem
from trellisdb.schema import table_schema

if TYPE_CHECKING:
    from trellisdb.database import Database


@dataclass
class Unit:
    """The rows of one checkpoint, trajectory or trace: committed together or not at all."""

    name: str
    #: table -> rows (dicts of column values); tables the unit does not write are absent
    rows: dict[str, list[dict[str, Any]]]
    #: where the unit came from (a file), for messages
    where: str
    meta: dict[str, Any] | None = None
    tag: str | None = None
    message: str | None = None

    @property
    def nodes(self) -> int:
        return len(self.rows.get("nodes", ()))


@dataclass
class ImportReport:
    """What an import did."""

    format: str
    source: str
    imported: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    commits: list[int] = field(default_factory=list)
    nodes: int = 0
    rows: int = 0
    seconds: float = 0.0

    @property
    def nodes_per_second(self) -> float:
        return self.nodes / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        rate = f", {self.nodes_per_second:,.0f} nodes/s" if self.nodes else ""
        skipped = f"; {len(self.skipped)} already imported (skipped)" if self.skipped else ""
        return (f"imported {len(self.imported)} unit(s) of {self.format} run {self.source!r}: {self.nodes:,} nodes, "
                f"{self.rows:,} rows in {len(self.commits)} commit(s), {self.seconds:.2f} s{rate}{skipped}")


#: Errors a value the store cannot hold raises while a unit's rows become Arrow tables or are
#: committed (a number out of range, text UTF-8 cannot hold, a list of the wrong length): the
#: unit is refused with its place, as a reader refuses a bad file.
_VALUE_ERRORS = (pa.ArrowException, OverflowError, ValueError, TypeError, UnicodeError)

#: JSON text that may decode to a lone surrogate (``\\udc00``): only then is a document searched.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def lone_surrogate(value: Any, path: tuple[str | int, ...] = ()) -> tuple[tuple[str | int, ...], str] | None:
    """Where in ``value`` (parsed JSON: dicts, lists, scalars) a string or key UTF-8 cannot hold is
    (a lone surrogate, which JSON can escape: ``"\\udc00"``), and why; None if nowhere.

    >>> lone_surrogate({"a": [1, "ok", "x\\udc00"]})
    (('a', 2), 'a lone surrogate at position 1: U+DC00')
    >>> lone_surrogate({"\\ud800": 1})
    (('\\ud800',), 'the key: a lone surrogate at position 0: U+D800')
    """
    stack: list[tuple[tuple[str | int, ...], Any]] = [(path, value)]
    while stack:
        p, v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                problem = utf8_problem(v)
                if problem:
                    return p, problem
        elif isinstance(v, dict):
            items = list(v.items())
            for k, x in reversed(items):
                if isinstance(k, str) and not k.isascii():
                    problem = utf8_problem(k)
                    if problem:
                        return (*p, k), f"the key: {problem}"
                stack.append(((*p, k), x))
        elif isinstance(v, list | tuple):
            stack.extend(((*p, i), x) for i, x in reversed(list(enumerate(v))))
    return None


def json_path(path: tuple[str | int, ...]) -> str:
    """``a.b[3].c`` for ``("a", "b", 3, "c")`` (a key that is not plain is quoted)."""
    out = ""
    for k in path:
        if isinstance(k, int):
            out += f"[{k}]"
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.\-]*", k):
            out += f".{k}"
        else:
            out += f"[{k!a}]"
    return out.lstrip(".")


def inside(file: str, root: str) -> bool:
    """Whether ``file``, its symbolic links resolved, is inside the folder ``root`` (resolved).
    A file that is no link in a folder inside ``root`` is: one ``lstat``, not a ``realpath`` per
    file (a run's 20,000 files cost 1 s of ``realpath``)."""
    top = _real(root)
    if not os.path.islink(file):
        d = _real(os.path.dirname(os.path.abspath(file)))
        return d == top or d.startswith(top.rstrip(os.sep) + os.sep)
    real = os.path.realpath(file)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=1024)
def _real(folder: str) -> str:
    """A folder's path with its links resolved (folders of a run are few; files are many)."""
    return os.path.realpath(folder)


def unreadable(path: str, e: OSError) -> ImportFormatError:
    """The error for a file or folder of a run that cannot be read: a symbolic link loop, a
    link to nothing, or the system's reason (``e``), naming ``path``."""
    if e.errno == errno.ELOOP:
        return ImportFormatError(f"{path}: cannot be read: a symbolic link loop (following its links leads back "
                                 "to one of them); remove the link, or point it at the file or folder it stands for")
    if e.errno == errno.ENOENT and os.path.islink(path):
        return dangling_error(path)
    return ImportFormatError(f"{path}: cannot be read ({e.strerror or e})")


def dangling_error(path: str) -> ImportFormatError:
    """The error for a symbolic link of a run that points at nothing (or loops)."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return unreadable(path, e)
    try:
        to = os.readlink(path)
    except OSError:
        to = "?"
    return ImportFormatError(f"{path}: a symbolic link to {to}, which does not exist; remove the link or restore "
                             "what it points at")


def broken_link(path: str) -> ImportFormatError | None:
    """The error for ``path`` when it is a symbolic link that cannot be followed (a loop, or a
    link to nothing); None when it is not one (a file, a folder, or nothing at all)."""
    return dangling_error(path) if os.path.islink(path) and not os.path.exists(path) else None


def listed_file(path: str) -> bool:
    """Whether ``path``, a name a run's folder listing matched, is a file to read (False: a
    folder); a symbolic link that cannot be followed (a loop, or a link to nothing) raises
    ``ImportFormatError`` naming it rather than being passed over."""
    bad = broken_link(path)
    if bad is not None:
        raise bad
    return os.path.isfile(path)


def outside_error(file: str, root: str) -> ImportFormatError:
    """The error for a file of a folder being imported that links outside it."""
    return ImportFormatError(
        f"{file}: a symbolic link to {os.path.realpath(file)}, outside the folder given ({root}); an import "
        "reads only files inside the folder it is given. Import that file by its own path, or copy it in")


def imported_units(db: Database, fmt: str, source: str) -> dict[str, int]:
    """The units of ``source`` (imported as ``fmt``) the store holds: name -> commit id."""
    got = db.sql(
        "SELECT id, json_extract_string(meta, '$.import.unit') AS unit FROM commits "
        "WHERE json_extract_string(meta, '$.import.format') = $f AND json_extract_string(meta, '$.import.source') = $s",
        params={"f": fmt, "s": source},
    ).to_pylist()
    return {str(r["unit"]): int(r["id"]) for r in got}


def _tables(db: Database, rows: dict[str, list[dict[str, Any]]], tasks: set[str]) -> dict[str, pa.Table]:
    """Arrow tables of the unit's rows, typed by the tables' schemas (the columns given only);
    a task in ``tasks`` (declared already) is not declared again."""
    out = {}
    for name, rs in rows.items():
        if name == "tasks":
            rs = [r for r in rs if r["id"] not in tasks]
        if not rs:
            continue
        sch = table_schema(name, db.embedding_dim)
        given: set[str] = set().union(*rs)  # the keys of every row (a loop in C)
        unknown = sorted(given - set(sch.names))
        if unknown:
            raise TrellisError(f"internal: importer rows for {name!r} have unknown columns {unknown}")
        out[name] = pa.Table.from_pylist(rs, schema=pa.schema([f for f in sch if f.name in given]))
    return out


def _check_embeddings(db: Database, unit: Unit) -> None:
    """Refuse a node embedding of another length than the store's (a reader does not know it)."""
    for row in unit.rows.get("nodes", ()):
        emb = row.get("embedding")
        if emb is not None and len(emb) != db.embedding_dim:
            raise ImportFormatError(
                f"{unit.where}: node {row.get('id')!r} has an embedding of {len(emb)} numbers; this store's "
                f"embeddings have {db.embedding_dim} (nothing of {unit.name!r} was written; earlier units were)")


def prefetched(units: Iterable[Unit], depth: int = 1) -> Iterator[Unit]:
    """``units``, read ahead by one thread: the reader's Python work (files, JSON, mapping) runs
    while the previous unit's commit is in Lance, DuckDB and the fsync, which release the GIL.
    An error of the reader is raised here, at the unit it stopped at; one that is not a
    TrellisError (input the reader does not handle) as an ImportFormatError saying after which
    unit it stopped, the original as its ``__cause__``."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    last: list[str] = []  # the name of the last unit read

    def put(item: tuple[str, Any]) -> bool:
        """Hand ``item`` over; False once the consumer has stopped (it takes nothing more)."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for u in units:
                last[:] = [u.name]
                if not put(("unit", u)):
                    return
            put(("end", None))
        except BaseException as e:  # handed to the consumer, raised there
            put(("error", e))

    t = threading.Thread(target=read, name="trellisdb-import-reader", daemon=True)
    t.start()
    try:
        while True:
            kind, value = q.get()
            if kind == "end":
                return
            if kind == "error":
                if isinstance(value, Exception) and not isinstance(value, TrellisError):
                    after = f"after unit {last[0]!r} (the units up to it are written)" if last else \
                        "before its first unit (nothing was written)"
                    raise ImportFormatError(
                        f"the import stopped {after}: the next unit's input is something the reader does not "
                        f"handle ({type(value).__name__}: {str(value)[:300]}); please report it with the file"
                    ) from value
                raise value
            yield value
    finally:
        stop.set()
        t.join()


def commit_units(db: Database, fmt: str, source: str, units: Iterable[Unit], *,
                 progress: bool | None = None) -> ImportReport:
    """Write each unit as one commit (see the module notes); return the report."""
    from tqdm import tqdm

    report = ImportReport(fmt, source)
    done = imported_units(db, fmt, source)
    tags = db.tags()
    tasks = {r["id"] for r in db.sql("SELECT DISTINCT id FROM tasks_history").to_pylist()}
    show = sys.stderr.isatty() if progress is None else progress
    t0 = time.perf_counter()
    with tqdm(desc=f"import {fmt}", unit=" units", disable=not show, file=sys.stderr, leave=False) as bar:
        for unit in prefetched(units):  # a reader raises ImportFormatError naming the file before its unit is written
            if unit.name in done:
                if unit.tag:
                    if unit.tag not in tags:  # the commit landed, its tag did not (or the tag was removed)
                        tags[unit.tag] = db.tag(unit.tag, done[unit.name])
                    elif tags[unit.tag] != done[unit.name]:
                        raise TrellisError(
                            f"{unit.where}: {unit.name!r} was imported as commit {done[unit.name]}, but its tag "
                            f"{unit.tag!r} names commit {tags[unit.tag]} (moved, or another run's?); move it back "
                            f"with db.tag({unit.tag!r}, {done[unit.name]}, move=True), or import the other run "
                            "with another tag_prefix")
                report.skipped.append(unit.name)
                bar.update()
                continue
            if unit.tag and unit.tag in tags:
                raise TrellisError(
                    f"{unit.where}: tag {unit.tag!r} names commit {tags[unit.tag]} already (another run's?); "
                    f"nothing of {unit.name!r} was written. Import with tag_prefix='run2_' to tag it apart"
                )
            meta = {**(unit.meta or {}), "import": {"format": fmt, "source": source, "unit": unit.name}}
            nothing = f"nothing of {unit.name!r} was written; earlier units were"
            try:
                _check_embeddings(db, unit)
                tables = _tables(db, unit.rows, tasks)
                nodes = tables.get("nodes")
                if nodes is not None and "provenance" not in nodes.column_names:  # who wrote them: this importer
                    tables["nodes"] = nodes.append_column(
                        "provenance", pa.array([f"importer:{fmt}"] * nodes.num_rows, pa.string()))
                cid = db.ingest(tables, message=unit.message or f"import {fmt} {unit.name}", meta=meta)
            except ImportFormatError:
                raise
            except TrellisError as e:
                msg = f"{unit.where}: {e} ({nothing})"
                try:
                    err = type(e)(msg)
                except TypeError:  # an error class with another constructor
                    err = TrellisError(msg)
                raise err from e
            except _VALUE_ERRORS as e:  # a value a reader let through that the store cannot hold
                raise ImportFormatError(f"{unit.where}: a value cannot be stored ({type(e).__name__}: "
                                        f"{str(e)[:300]}) ({nothing})") from e
            done[unit.name] = cid  # the same unit again (a copy of a file) is skipped
            if unit.tag:
                tags[unit.tag] = db.tag(unit.tag, cid)
            tasks.update(r["id"] for r in unit.rows.get("tasks", ()))
            report.imported.append(unit.name)
            report.commits.append(cid)
            report.nodes += unit.nodes
            report.rows += sum(t.num_rows for t in tables.values())
            bar.update()
            bar.set_postfix(nodes=report.nodes)
    report.seconds = time.perf_counter() - t0
    return report
