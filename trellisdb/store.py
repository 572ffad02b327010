"""An open store folder: the pieces every layer above shares, and nothing else.

``Store`` opens (or creates) the folder, checks its format, and holds the commit log, the
Lance tables, the log guard, the writer lock, the registry of embedding spaces and the SQL
engine. It has no behaviour of its own beyond opening and the read-only check: reading is
``trellisdb/snapshot.py``, writing ``trellisdb/committer.py``, vectors ``trellisdb/vectors/``,
views ``trellisdb/training/``; the facade (``trellisdb/database.py``) wires them together.

>>> import tempfile
>>> s = Store(tempfile.mkdtemp() + "/db", embedding_dim=4, create=True)
>>> s.embedding_dim, s.all_tables()[:2]
(4, ['tasks', 'sessions'])
"""

from __future__ import annotations

import json
import logging
import os
import shutil

from trellisdb.errors import CorruptionError, FormatVersionError, NotADatabaseError, ReadOnlyError, ValidationError
from trellisdb.reader import QUERY_TIMEOUT, SqlEngine, check_timeout
from trellisdb.schema import DATA_TABLES, FORMAT_VERSION
from trellisdb.storage import log as commit_log
from trellisdb.storage import recovery
from trellisdb.storage.lock import WriterLock
from trellisdb.storage.spaces import TEXT_COLUMN, SpaceRegistry
from trellisdb.storage.tables import LanceTables
from trellisdb.storage.upgrade import upgrade_tables

_logger = logging.getLogger("trellisdb")

MARKER = "trellis.json"
SPACES_FILE = "spaces.json"
DEFAULT_EMBEDDING_DIM = 384
#: Format versions this release upgrades in place when a writable handle opens them.
UPGRADABLE = (1, 2)

#: What an interrupted ``init`` may have left in a folder (it is started again there).
_OUR_FILES = {"tables", "commits.log", "LOCK", MARKER + ".tmp", SPACES_FILE}


def init_folder(path: str, dim: int) -> None:
    """Create a database; the marker file is written last, atomically."""
    tables = LanceTables(os.path.join(path, "tables"))
    tables.create_all(dim)
    for table, col in TEXT_COLUMN.items():  # full-text indexes start empty; Lance searches new rows next to them
        tables.dataset(table).create_scalar_index(col, index_type="INVERTED")
    log_path = os.path.join(path, "commits.log")
    if not os.path.exists(log_path):
        commit_log.create(log_path)
    write_marker(path, dim)


def write_marker(path: str, dim: int) -> None:
    """Write the marker file (format and version) atomically: a temporary file, then a rename."""
    tmp = os.path.join(path, MARKER + ".tmp")
    with open(tmp, "w") as fh:
        json.dump({"format": "trellisdb", "format_version": FORMAT_VERSION, "embedding_dim": dim}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(path, MARKER))


class Store:
    """The open folder ``path``: log, tables, guard, lock, spaces and the SQL engine."""

    def __init__(
        self,
        path: str,
        *,
        embedding_dim: int | None = None,
        create: bool = True,
        read_only: bool = False,
        mirror: bool = True,
        keep_memory: int | None = None,
        memory_limit: int | None = None,
        query_timeout: float | None = QUERY_TIMEOUT,
    ) -> None:
        if not isinstance(read_only, bool):
            raise ValidationError(f"read_only must be True or False, not {read_only!r}")
        self.read_only = read_only
        if read_only:
            create = False  # a read-only handle changes nothing in the folder, creating it least of all
        if keep_memory is not None and (isinstance(keep_memory, bool) or not isinstance(keep_memory, int)
                                        or keep_memory < 0):
            raise ValidationError(f"keep_memory must be a number of bytes >= 0 (or None), not {keep_memory!r}")
        if memory_limit is not None and (isinstance(memory_limit, bool) or not isinstance(memory_limit, int)):
            raise ValidationError(f"memory_limit must be a number of bytes (or None), not {memory_limit!r}")
        check_timeout(query_timeout)
        self.path = path
        marker = os.path.join(path, MARKER)
        #: the writer lock (``flock`` on ``LOCK``), re-entrant per thread
        self.lock = WriterLock(os.path.join(path, "LOCK"))
        if not os.path.exists(marker):
            self._create(marker, embedding_dim, create)
        try:
            with open(marker) as fh:
                meta = json.load(fh)
        except (OSError, ValueError) as e:
            raise CorruptionError(f"{marker} is unreadable ({e}); the database cannot be opened") from e
        if not isinstance(meta, dict) or meta.get("format") != "trellisdb":
            raise NotADatabaseError(f"{marker} does not describe a trellisdb database")
        if meta.get("format_version") in UPGRADABLE:
            self._upgrade(meta)
        elif meta.get("format_version") != FORMAT_VERSION:
            raise FormatVersionError(
                f"{path} has format version {meta.get('format_version')!r}; this trellisdb reads version "
                f"{FORMAT_VERSION}. Use the trellisdb release that wrote it, or export and re-import"
            )
        self.embedding_dim = int(meta["embedding_dim"])
        if embedding_dim is not None and embedding_dim != self.embedding_dim:
            raise ValidationError(
                f"{path} was created with embedding_dim={self.embedding_dim}, not {embedding_dim}; "
                "omit embedding_dim or pass the database's own"
            )
        self.log = commit_log.CommitLog(os.path.join(path, "commits.log"))
        self.tables = LanceTables(os.path.join(path, "tables"))
        self.spaces = SpaceRegistry(os.path.join(path, SPACES_FILE), self.embedding_dim)
        # reads the log; warns (TrellisWarning) when it lost acknowledged records
        self.guard = recovery.LogGuard(self.log, self.tables, self.all_tables)
        self.guard.open()
        # ids used beyond the log (a damaged one) count as begun: the mirror leaves their fragments unsettled
        self.engine = SqlEngine(self.tables, lambda: max(self.log.refresh().max_id, self.guard.ceiling),
                                mirror=mirror, keep_memory=keep_memory, memory_limit=memory_limit,
                                query_timeout=query_timeout)

    def _upgrade(self, meta: dict[str, object]) -> None:
        """Upgrade a store of an earlier format in place (``storage/upgrade.py``); a read-only
        handle cannot, and says how."""
        if self.read_only:
            raise FormatVersionError(
                f"{self.path} has format version {meta.get('format_version')}, which this trellisdb upgrades to "
                f"{FORMAT_VERSION} in place (columns added, no row rewritten) when a writable handle opens it; open "
                "it once without read_only (e.g. `trellis verify`), then read-only"
            )
        dim = meta.get("embedding_dim")
        if not isinstance(dim, int):
            raise CorruptionError(f"{os.path.join(self.path, MARKER)} has no embedding_dim; it cannot be upgraded")
        with self.lock.held():
            done = upgrade_tables(LanceTables(os.path.join(self.path, "tables")), dim)
            write_marker(self.path, dim)
        _logger.info("upgraded %s to format version %d: %s", self.path, FORMAT_VERSION, "; ".join(done) or "nothing")
        meta["format_version"] = FORMAT_VERSION

    def _create(self, marker: str, embedding_dim: int | None, create: bool) -> None:
        path = self.path
        if os.path.isfile(path):
            raise NotADatabaseError(f"{path} is a file, not a trellisdb database folder")
        entries = set(os.listdir(path)) if os.path.isdir(path) else set()
        if entries - _OUR_FILES:
            raise NotADatabaseError(
                f"{path} is not a trellisdb database (no {MARKER}) and is not empty; choose an empty or new folder"
            )
        if not create:
            raise NotADatabaseError(f"{path} is not a trellisdb database; run `trellis init --db {path}`")
        os.makedirs(path, exist_ok=True)
        with self.lock.held():
            if not os.path.exists(marker):
                if "tables" in entries:  # a half-finished init: start it again
                    shutil.rmtree(os.path.join(path, "tables"))
                init_folder(path, embedding_dim or DEFAULT_EMBEDDING_DIM)

    def writable(self, what: str) -> None:
        """Raise ``ReadOnlyError`` if this handle may not change the folder."""
        if self.read_only:
            raise ReadOnlyError(
                f"{what} changes the database, and this handle is read-only (opened with read_only=True, or "
                "trellis --read-only); open it without read_only to write"
            )

    def space_tables(self) -> list[str]:
        """The Lance tables of the named embedding spaces."""
        return [s.table for s in self.spaces.all() if not s.builtin]

    def all_tables(self) -> list[str]:
        """Every table a commit may write: the data tables and the named spaces' tables."""
        return [*DATA_TABLES, *self.space_tables()]
