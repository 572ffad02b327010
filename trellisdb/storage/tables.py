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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("LANCE_LOG", "error")  # Lance's k-means and dataset-creation warnings: not the user's business
os.environ.setdefault("LANCE_INCLUDE_VECTOR_CENTROIDS", "false")  # index statistics without the centroids

import lance  # reads the variables above when it loads
import pyarrow as pa

from trellisdb.errors import CorruptionError
from trellisdb.schema import DATA_TABLES, table_schema

#: Physical versions younger than this survive cleanup, so that concurrent
#: readers of an older version (queries up to this long) never lose their files.
PRUNE_GRACE = dt.timedelta(minutes=5)

#: Byte sizes of the tiers of automatic compaction: a fragment belongs to the
#: first tier whose bound exceeds its size on disk. Fragments of the last bound
#: or more are never rewritten automatically (``db.compact()`` still merges them).
TIER_BYTES = (1 << 20, 8 << 20)

#: Lance's ceiling on rows per fragment.
MAX_ROWS_PER_FRAGMENT = 1 << 20


def tier_target(frags: list[tuple[int, int]], fanout: int) -> int | None:
    """The compaction target (rows per fragment) that size-tiered compaction
    needs now, or None when no tier holds ``fanout`` fragments.

    ``frags`` are (rows, bytes) per fragment. Fragments below a tier's byte
    bound are merged into fragments of about that many bytes (the target in
    rows is the bound over the table's average row size), so a compaction at
    tier ``i`` rewrites about ``fanout * TIER_BYTES[i]`` bytes, each byte is
    rewritten once per tier (a few times, never on every compaction), and big
    fragments are left alone. The highest full tier wins, since merging it
    merges the smaller tiers too.

    >>> MiB = 1 << 20
    >>> tier_target([(100_000, 200 * MiB)] + [(3, 300)] * 7, fanout=8) is None
    True
    >>> tier_target([(100_000, 200 * MiB)] + [(3, 300)] * 8, fanout=8)  # 1 MiB of 2 KiB rows
    500
    >>> tier_target([(5000, 2 * MiB)] * 8 + [(3, 300)], fanout=8)  # tier 1 full: 8 MiB of 419 B rows
    20001
    >>> tier_target([(10_000, 16 * MiB)] * 20, fanout=8) is None  # big fragments stay as they are
    True
    """
    rows = sum(r for r, _ in frags)
    size = sum(b for _, b in frags)
    if not rows or not size:
        return None
    lower = 0
    target = None
    for bound in TIER_BYTES:
        if sum(1 for _, b in frags if lower <= b < bound) >= fanout:
            target = bound
        lower = bound
    if target is None:
        return None
    return max(1, min(MAX_ROWS_PER_FRAGMENT, target * rows // size))


def take(ds: lance.LanceDataset, addresses: pa.Array, columns: list[str]) -> pa.Table:
    """The rows of ``ds`` at Lance row ``addresses`` (fragment id << 32 | offset), ``columns``
    only. Lance marks its take by row address unstable (``_take_rows``, "internal use only"):
    this is the one place trellisdb calls it, and callers treat a failure as a miss and read
    another way."""
    return ds._take_rows(addresses, columns=columns)


def _fragment_size(meta: Any) -> tuple[int, int]:
    rows = int(meta.physical_rows or 0)
    size = sum(int(f.file_size_bytes or 0) for f in meta.files)
    return rows, size or rows * 100  # files written without a recorded size: assume small rows


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

    @contextmanager
    def watched(self, step: Callable[[str, str], None]) -> Iterator[None]:
        """Meanwhile, ``step(what, table)`` after each ``compact`` and ``cleanup`` this thread
        runs (``what``: ``compact`` or ``cleanup``): a progress bar's. Other threads' (the
        background compaction's) are not reported."""
        self._local.watch = step
        try:
            yield
        finally:
            self._local.watch = None

    def _done(self, what: str, name: str) -> None:
        step: Callable[[str, str], None] | None = getattr(self._local, "watch", None)
        if step is not None:
            step(what, name)

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

    def delete_if_any(self, name: str, predicate: str) -> int:
        """Delete the rows matching ``predicate`` when there are any (a delete that matches nothing
        still writes a version); returns how many there were. A count reads only the filter's columns."""
        ds = self.dataset(name)
        n = ds.count_rows(predicate)
        if n:
            ds.delete(predicate)
        return n

    def fragment_count(self, name: str) -> int:
        return len(self.dataset(name).get_fragments())

    def compact(self, name: str, target_rows: int = MAX_ROWS_PER_FRAGMENT) -> dict[str, Any]:
        """Merge fragments smaller than ``target_rows`` (default: all of them)."""
        ds = self.dataset(name)
        m = ds.optimize.compact_files(target_rows_per_fragment=target_rows, materialize_deletions=True)
        ds.checkout_latest()  # type: ignore[no-untyped-call]
        self._done("compact", name)
        return {"fragments_removed": m.fragments_removed, "fragments_added": m.fragments_added}

    def compact_tiered(self, name: str, fanout: int) -> dict[str, Any] | None:
        """Size-tiered compaction step: merge the highest tier holding ``fanout``
        fragments (see :func:`tier_target`); None when nothing needs merging."""
        frags = self.dataset(name, refresh=False).get_fragments()
        target = tier_target([_fragment_size(f.metadata) for f in frags], fanout)
        if target is None:
            return None
        return self.compact(name, target)

    def cleanup(self, name: str, older_than: dt.timedelta = PRUNE_GRACE) -> None:
        """Delete files only physical versions older than ``older_than`` use.

        Old physical versions are not needed for logical time travel, but a
        reader in another process may still be scanning one: keep a grace
        period. The cost grows with the number of versions, so callers run it
        now and then, not per commit.
        """
        ds = lance.dataset(self.uri(name))  # own handle: may run on a background thread
        ds.cleanup_old_versions(older_than=older_than, delete_unverified=False)
        self._done("cleanup", name)

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
