"""Importers: runs that agents already recorded, brought in faithfully (``trellis import``).

Each format module reads its files into :class:`~trellisdb.importers.units.Unit` s (one per
checkpoint, trajectory or trace, in order) and :func:`~trellisdb.importers.units.commit_units`
writes each unit as one commit: a bad file stops the import with an error naming the file (and
line), and nothing of that unit is visible; units imported before stay. An import is
idempotent: a unit already in the store (its commit's metadata names the format, the source and
the unit) is skipped, so importing again adds nothing.

>>> sorted(FORMATS)
['jsonl', 'openevolve', 'otel', 'swe-agent']
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

from trellisdb.errors import ValidationError
from trellisdb.importers.units import ImportReport, broken_link
from trellisdb.names import did_you_mean

if TYPE_CHECKING:
    from trellisdb.database import Database

#: format name -> the module that reads it (each has ``units(path, **options)``).
FORMATS: dict[str, str] = {
    "openevolve": "trellisdb.importers.openevolve",
    "swe-agent": "trellisdb.importers.sweagent",
    "jsonl": "trellisdb.importers.jsonl",
    "otel": "trellisdb.importers.otel",
}

__all__ = ["FORMATS", "ImportReport", "import_run"]


def import_run(db: Database, format: str, path: str | os.PathLike[str], *, progress: bool | None = None,
               **options: Any) -> ImportReport:
    """Import the run at ``path`` written in ``format`` (see :data:`FORMATS`); return what was
    done. ``progress``: show a progress bar (default: when stderr is a terminal). ``options``
    go to the format (e.g. ``task=`` for OpenEvolve)."""
    if format not in FORMATS:
        raise ValidationError(f"unknown import format {format!r}{did_you_mean(format, FORMATS)}; "
                              f"formats are {', '.join(sorted(FORMATS))}")
    from trellisdb.importers.units import commit_units

    reader = importlib.import_module(FORMATS[format])
    source = os.fspath(path)
    if not os.path.exists(source):
        bad = broken_link(source)  # a link loop, or a link to nothing
        if bad is not None:
            raise bad
        raise ValidationError(f"{source} does not exist; give the folder or file the run was written to")
    return commit_units(db, format, reader.source_name(source, **options), reader.units(source, **options),
                        progress=progress)
