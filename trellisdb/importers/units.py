"""Committing an import: one commit per unit, idempotent, with a progress bar.

A format's reader yields :class:`Unit` s in order; :func:`commit_units` writes each with
``db.ingest`` (vectorized checks; one commit), its metadata extended by ``import``: the format,
the source and the unit's name. Before it starts, it reads which units of that source the
store already holds, and skips them (re-tagging one whose tag a crash left unwritten), so an
import interrupted anywhere is finished by running it again, and one run twice adds nothing.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb.errors import ImportFormatError, TrellisError
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


def prefetched(units: Iterable[Unit], depth: int = 1) -> Iterator[Unit]:
    """``units``, read ahead by one thread: the reader's Python work (files, JSON, mapping) runs
    while the previous unit's commit is in Lance, DuckDB and the fsync, which release the GIL.
    An error of the reader is raised here, at the unit it stopped at."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

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
                if unit.tag and unit.tag not in tags:  # the commit landed, its tag did not
                    db.tag(unit.tag, done[unit.name])
                report.skipped.append(unit.name)
                bar.update()
                continue
            meta = {**(unit.meta or {}), "import": {"format": fmt, "source": source, "unit": unit.name}}
            try:
                tables = _tables(db, unit.rows, tasks)
                cid = db.ingest(tables, message=unit.message or f"import {fmt} {unit.name}", meta=meta)
            except ImportFormatError:
                raise
            except TrellisError as e:
                msg = f"{unit.where}: {e} (nothing of {unit.name!r} was written; earlier units were)"
                try:
                    err = type(e)(msg)
                except TypeError:  # an error class with another constructor
                    err = TrellisError(msg)
                raise err from e
            if unit.tag:
                if unit.tag in tags and tags[unit.tag] != cid:
                    raise TrellisError(
                        f"{unit.where}: tag {unit.tag!r} names commit {tags[unit.tag]} already (another run's?); "
                        f"the unit is committed as {cid}. Import with tag_prefix='run2_' to tag it apart"
                    )
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
