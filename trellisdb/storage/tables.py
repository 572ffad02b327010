"""The Lance datasets: one per table under ``<db>/tables/<name>.lance``.

Appends are whole Arrow tables (one Lance ``append`` per table per commit,
never one per row). Compaction rewrites small fragments; cleanup of old
physical versions is safe because logical time travel is a predicate on the
``commit_id`` column, not a Lance version checkout.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from typing import Any

import lance
import pyarrow as pa

from trellisdb.errors import CorruptionError
from trellisdb.schema import DATA_TABLES, table_schema

#: Physical versions younger than this survive cleanup, so that concurrent
#: readers of an older version (queries up to this long) never lose their files.
PRUNE_GRACE = dt.timedelta(minutes=10)


class LanceTables:
    def __init__(self, root: str) -> None:
        self.root = root
        # Dataset objects are not safe to share between threads (a scan in one
        # and a checkout in another collide), so each thread keeps its own.
        self._local = threading.local()

    @property
    def _open(self) -> dict[str, lance.LanceDataset]:
        cache: dict[str, lance.LanceDataset] | None = getattr(self._local, "open", None)
        if cache is None:
            cache = self._local.open = {}
        return cache

    def uri(self, name: str) -> str:
        return os.path.join(self.root, f"{name}.lance")

    def create_all(self, dim: int) -> None:
        os.makedirs(self.root, exist_ok=True)
        for name in DATA_TABLES:
            sch = table_schema(name, dim)
            lance.write_dataset(sch.empty_table(), self.uri(name), schema=sch, mode="create")

    def dataset(self, name: str, refresh: bool = True) -> lance.LanceDataset:
        """The dataset at its latest physical version."""
        ds = self._open.get(name)
        if ds is not None:
            if refresh:
                ds.checkout_latest()  # type: ignore[no-untyped-call]
            return ds
        try:
            ds = lance.dataset(self.uri(name))
        except (OSError, ValueError, RuntimeError) as e:
            raise CorruptionError(
                f"table {name!r} at {self.uri(name)} cannot be opened ({e}); run `trellis verify`"
            ) from e
        self._open[name] = ds
        return ds

    def append(self, name: str, data: pa.Table) -> None:
        ds = lance.write_dataset(data, self.uri(name), mode="append")
        self._open[name] = ds

    def delete(self, name: str, predicate: str) -> None:
        self.dataset(name).delete(predicate)

    def fragment_count(self, name: str) -> int:
        return len(self.dataset(name).get_fragments())

    def compact(self, name: str, prune_older_than: dt.timedelta = PRUNE_GRACE) -> dict[str, Any]:
        ds = self.dataset(name)
        m = ds.optimize.compact_files(materialize_deletions=True)
        ds.checkout_latest()  # type: ignore[no-untyped-call]
        # Old physical versions are not needed for logical time travel, but a
        # reader in another process may still be scanning one: keep a grace period.
        ds.cleanup_old_versions(older_than=prune_older_than, delete_unverified=False)
        return {"fragments_removed": m.fragments_removed, "fragments_added": m.fragments_added}

    def verify(self, name: str) -> list[str]:
        """Read every data file of a table; return problems, each naming a file."""
        problems: list[str] = []
        try:
            ds = lance.dataset(self.uri(name))
        except Exception as e:  # any failure to open is a finding, not a crash
            return [f"{self.uri(name)}: cannot open dataset: {e}"]
        for frag in ds.get_fragments():
            files = [os.path.join(self.uri(name), "data", f.path) for f in frag.data_files()]
            try:
                for _ in frag.to_batches():
                    pass
            except Exception as e:
                problems.append(f"{', '.join(files)}: unreadable ({e})")
                continue
            for f in files:
                if not os.path.exists(f):
                    problems.append(f"{f}: missing")
        return problems
