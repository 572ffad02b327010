"""Upgrading a store written by an earlier format version, in place.

Format 2 added columns to five tables (``schema.ADDED``: the insertion order and event time
of nodes, event time elsewhere, step records' action and state) and two tables
(``schema.NEW_TABLES``: attributes, labels); format 3 (``schema.FORMAT_VERSION``) added
``nodes.provenance`` (who wrote a node). The upgrade adds whichever of those columns a table
lacks as all-null columns (a Lance metadata-only change: no row is rewritten) and creates the
missing tables empty, so one pass takes a version-1 store to 3 as it takes a version-2 one.
Every step checks what is there first, so an upgrade interrupted half-way is finished by the
next one; the caller holds the writer lock and writes the new format version to the marker
file last, once every table is upgraded.

Rows from before format 3 read null in ``provenance``: who wrote them is unknown. Rows of a
version-2 store's write-ahead log lack the column too and read null the same way.

Rows from before format 2 read null in its columns: their insertion order is their
commit (``born`` null), ties within a commit break by id as before (``ordinal`` null), and
their event time is unknown (``event_time`` null). So a node whose row was rewritten before the
upgrade (a status change) orders by that rewrite's commit, as format 1 ordered it; rewrites after
the upgrade keep the node's place. (Recovering the first commit of such nodes would mean writing
a column computed from every node's history, the WAL's rows included, which the upgrade avoids.)
"""

from __future__ import annotations

import os
import shutil

import lance

from trellisdb.schema import ADDED, NEW_TABLES, table_schema
from trellisdb.storage.tables import LanceTables


def upgrade_tables(tables: LanceTables, dim: int) -> list[str]:
    """Bring every data table to the current format; return what was done (empty: nothing to do)."""
    done = []
    for name, fields in ADDED.items():
        ds = tables.dataset(name)
        missing = [f for f in fields if f.name not in ds.schema.names]
        if missing:
            ds.add_columns(missing)
            done.append(f"{name}: added {', '.join(f.name for f in missing)}")
    for name in NEW_TABLES:
        uri = tables.uri(name)
        if os.path.exists(uri):
            try:
                lance.dataset(uri)
                continue
            except (OSError, ValueError, RuntimeError):  # left half-created by an interrupted upgrade: the
                shutil.rmtree(uri)                        # marker still says format 1, so it holds no rows
        sch = table_schema(name, dim)
        lance.write_dataset(sch.empty_table(), uri, schema=sch, mode="create")
        done.append(f"{name}: created")
    return done
