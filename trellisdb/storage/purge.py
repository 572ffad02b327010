"""The physical half of a purge: rows taken out of every stored version of a Lance table.

A Lance delete only writes a deletion vector: the rows stay in their data files, and every
older version still names those files (and its own copies of the rows). So a purge rewrites
each fragment that holds a purged row without it (and each fragment that has a deletion
vector at all: the rows it hides, an aborted commit's say, are still in its file), in one
Lance commit per table (an ``Update``: the old fragments out, the rewritten ones in), then
removes every version but the latest, with every file no version names (``prune``), at
once. Indexes are rebuilt by the caller before the prune (``trellisdb/vectors/index.py``).

Each step is atomic in Lance (a commit is one manifest write): a crash leaves a table as it
was or rewritten, plus files no version names (rewritten fragments of a commit that did not
happen: surviving rows only), which the next ``prune`` removes. Running the purge again
finishes it (``trellisdb/purge.py``).

    >>> import tempfile, lance, pyarrow as pa, pyarrow.compute as pc
    >>> from trellisdb.storage.tables import LanceTables
    >>> t = LanceTables(tempfile.mkdtemp())
    >>> _ = lance.write_dataset(pa.table({"id": ["a", "b"]}), t.uri("x"))
    >>> _ = lance.write_dataset(pa.table({"id": ["c"]}), t.uri("x"), mode="append")
    >>> remove_rows(t, "x", ["id"], lambda rows: pc.equal(rows["id"], "b"))
    (1, True)
    >>> prune(t.uri("x")); sorted(t.dataset("x").to_table()["id"].to_pylist())
    ['a', 'c']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence

import lance
import lance.fragment as lf
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trellisdb.errors import CorruptionError
from trellisdb.storage.lines import sync_dir
from trellisdb.storage.tables import LanceTables

#: Which rows go: a boolean mask over a table of the columns named with it (null: keep).
Drop = Callable[[pa.Table], "pa.Array | pa.ChunkedArray"]


def mask(drop: Drop, rows: pa.Table) -> np.ndarray:
    """Which rows ``drop`` marks, as a numpy bool array (a null: kept)."""
    m = drop(rows)
    return np.asarray(pc.fill_null(m, False).to_numpy(zero_copy_only=False), dtype=bool)


#: Rows per batch of the scans that find the purged rows (narrow columns: the ids only).
SCAN_ROWS = 1 << 20


def _scan(tables: LanceTables, name: str, columns: Sequence[str], keep: Drop,
          addresses: bool = False) -> Iterator[pa.Table]:
    """The rows of every live row of table ``name`` (``columns`` only) that ``keep`` marks, a
    batch at a time (``addresses``: with their Lance row address, ``_rowaddr``)."""
    ds = tables.dataset(name)
    try:
        for batch in ds.to_batches(columns=list(columns), with_row_address=addresses, batch_size=SCAN_ROWS):
            rows = pa.Table.from_batches([batch])
            m = mask(keep, rows)
            if m.any():
                yield rows.filter(pa.array(m))
    except (OSError, ValueError, RuntimeError) as e:
        raise CorruptionError(f"table {name!r} could not be read for the purge ({e}); run `trellis verify`") from e


def matching(tables: LanceTables, name: str, columns: Sequence[str], keep: Drop) -> pa.Table:
    """Every live row of table ``name`` (``columns`` only, all versions of every key, visible
    or not: what is stored) that ``keep`` marks."""
    parts = list(_scan(tables, name, columns, keep))
    if not parts:
        sch = tables.dataset(name).schema
        return pa.schema([sch.field(c) for c in columns]).empty_table()
    return pa.concat_tables(parts)


def remove_rows(tables: LanceTables, name: str, columns: Sequence[str], drop: Drop) -> tuple[int, bool]:
    """Take the rows of table ``name`` that ``drop`` (given ``columns``) marks out of its
    latest version, physically: every fragment holding one (or holding rows deleted before)
    is rewritten without them, in one commit. Returns how many rows went and whether the
    table was rewritten. Older versions still hold them until :func:`prune`. Caller holds the
    writer lock."""
    ds = tables.dataset(name)
    found = [t["_rowaddr"].to_numpy() for t in _scan(tables, name, columns, drop, addresses=True)]
    gone = np.concatenate(found).astype(np.uint64) if found else np.empty(0, np.uint64)
    frag_of = gone >> np.uint64(32)
    affected = {int(f) for f in np.unique(frag_of)}
    affected |= {f.fragment_id for f in ds.get_fragments() if f.metadata.deletion_file is not None}
    if not affected:
        return 0, False
    schema = ds.schema
    new: list[lf.FragmentMetadata] = []
    for fid in sorted(affected):
        drop_here = gone[frag_of == np.uint64(fid)]
        frag = ds.get_fragment(fid)
        if frag is None:
            raise CorruptionError(f"table {name!r} lost fragment {fid} during the purge; run `trellis verify`")
        rows = pa.RecordBatchReader.from_batches(schema, _kept(frag, schema, drop_here))
        new += lf.write_fragments(rows, tables.uri(name), schema=schema, data_storage_version=ds.data_storage_version)
    op = lance.LanceOperation.Update(removed_fragment_ids=sorted(affected), new_fragments=new)
    lance.LanceDataset.commit(tables.uri(name), op, read_version=ds.version)
    tables.dataset(name)  # this thread's handle moves to the new version
    return len(gone), True


def _kept(frag: lance.LanceFragment, schema: pa.Schema, drop: np.ndarray) -> Iterator[pa.RecordBatch]:
    """The live rows of ``frag`` but those at addresses ``drop``, a batch at a time."""
    for b in frag.to_batches(with_row_address=True):
        keep = ~np.isin(b.column("_rowaddr").to_numpy(), drop) if len(drop) else np.ones(b.num_rows, bool)
        if keep.any():
            b = b.filter(pa.array(keep))
            yield pa.RecordBatch.from_arrays([b.column(n) for n in schema.names], schema=schema)


def prune(uri: str) -> None:
    """Delete every version of the Lance dataset at ``uri`` but the latest, and every file that
    no version names (an interrupted write's), now: no grace period. A reader in another
    process scanning an older version loses its files (it gets an error, and must reopen)."""
    lance.dataset(uri).cleanup_old_versions(retain_versions=1, delete_unverified=True)


def filter_parquet(path: str, drop: Drop) -> int:
    """Take the rows ``drop`` marks out of Parquet file ``path`` (a repair's ``lost+found``
    copy of a table): the rest written aside and renamed over it, or the file removed when
    none is left. Returns how many rows went."""
    t = pq.read_table(path)
    m = mask(drop, t)
    if not m.any():
        return 0
    rest = t.filter(pa.array(~m))
    if rest.num_rows:
        tmp = path + ".purge"
        pq.write_table(rest, tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    else:
        os.remove(path)
    sync_dir(os.path.dirname(path))
    return int(m.sum())
