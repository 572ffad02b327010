"""Exports of materialized views in the layouts trainers read, with a manifest and a dataset card.

``db.export(name, path, format=...)`` writes a folder::

    path/
      train.jsonl | train.parquet          rows whose task hashes to the train side (Parquet over 500 MB:
                                           train-00000-of-0000N.parquet ..., written in parallel)
      validation.jsonl | ...               the others (absent when the fraction is 0)
      provenance.parquet                   split, row, node_ids: the nodes behind every row
      manifest.json                        view, definition, commit, format, counts, split rule, files
      README.md                            a short dataset card

Formats and layouts (``trl`` follows the Hugging Face TRL dataset formats,
conversational where the kind has messages; each kind's file in ``kinds/`` lays its rows out):

=============  ===========================================  ==============================================
view kind      ``trl``                                      ``openai`` (fine-tuning JSONL)
=============  ===========================================  ==============================================
sft            ``messages`` [system?, user, assistant]      ``messages`` (same)
sft path=True  ``messages`` [system?, (user?, assistant?)    ``messages`` (same)
               per step, root first]
sft messages=  ``messages``: the stored turns (role,        ``messages`` (same)
               content), the path's root first
preference     ``prompt`` [system?, user], ``chosen`` /     ``input.messages``, ``preferred_output`` /
               ``rejected`` [assistant]                     ``non_preferred_output`` [assistant]
kto            ``prompt``, ``completion``, ``label``        (none: use trl or parquet)
stepwise       ``prompt``, ``completions``, ``labels``      (none)
grpo           ``prompt`` [system?, user] (prompt-only)     (none)
replay         ``messages`` (as sft)                        ``messages``
=============  ===========================================  ==============================================

``parquet`` writes the view's rows as stored (hashes, rewards, provenance)
plus the resolved texts. The split is by task: a task's rows all land on one
side (``sha256(task_id)`` as a number in [0, 1) below ``validation`` goes to
validation), so the same task never trains and validates.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from queue import SimpleQueue
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from trellisdb.errors import ExportError, ValidationError
from trellisdb.names import utf8_problem
from trellisdb.paths import check_length, check_target, path_error, replaceable
from trellisdb.training import texts
from trellisdb.training.catalog import ViewCatalog
from trellisdb.training.kinds import KINDS, ROW_KEYS, SHAPES
from trellisdb.training.layout import KEEP as _KEEP
from trellisdb.training.layout import plain as _plain
from trellisdb.training.layout import plain_schema as _plain_schema
from trellisdb.training.rows import RowStore
from trellisdb.training.spec import ViewSpec

if TYPE_CHECKING:
    from trellisdb.snapshot import Reads

FORMATS = ("trl", "openai", "parquet")
#: Decoded text per chunk (a Parquet row group, one JSONL write; the progress callback is called
#: after each): the rows per chunk are this over the rows' average text size, within CHUNK_ROWS.
#: Parquet row groups under ~100k rows cost more to write (50k rows: 1.07 s vs 0.83 s at 408k pairs).
CHUNK_BYTES = 256 << 20
CHUNK_ROWS = (4096, 1 << 17)
#: A text column with at most this share of distinct values (and a dictionary up to Parquet's
#: dictionary page size) is written to Parquet as a dictionary straight from its codes: no
#: decoded copy (a shared system prompt in every row of 408k pairs is 393 MB decoded).
DICTIONARY_SHARE = 0.25
DICTIONARY_BYTES = 1 << 20
#: Any other column is dictionary-encoded in Parquet if at most this share of its first
#: ``DICTIONARY_SAMPLE`` values are distinct (``_repeating``).
DICTIONARY_SAMPLE = 8192
DICTIONARY_SAMPLE_SHARE = 0.5
#: A Parquet split over this many bytes (its rows with their texts decoded) is written as
#: shards of equal row counts, on up to one thread per core; 500 MB is the shard size Hugging
#: Face's ``push_to_hub`` uses by default.
SHARD_BYTES = 500_000_000
MAX_SHARDS = 99_999  # the five digits of the naming
#: Shards written at once, at most (each writer holds a decoded chunk of ``CHUNK_BYTES``).
MAX_WRITERS = 4

def export(
    stored: RowStore,
    reads: Reads,
    name: str,
    path: str | os.PathLike[str],
    format: str = "trl",
    *,
    validation: float = 0.0,
    overwrite: bool = False,
    skip_missing: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write materialized view ``name`` of the database whose views ``stored`` holds to folder
    ``path``; returns the manifest (``reads``: the database's snapshots, for texts resolved now)."""
    if format not in FORMATS:
        raise ValidationError(f"unknown export format {format!r}; formats are {', '.join(FORMATS)}")
    if isinstance(validation, bool) or not (isinstance(validation, int | float) and 0.0 <= validation < 1.0):
        raise ValidationError(f"validation must be a fraction in [0, 1), not {validation!r}")
    root = stored.root
    cat = ViewCatalog(root).load()
    spec = cat.spec(name)
    entry = cat.entries[name]
    if entry.get("version") is None:
        raise ValidationError(f"view {name!r} is not materialized yet; run db.materialize({name!r}) first")
    kind, shape = spec.kind, spec.shape
    if format != "parquet" and format not in KINDS[kind].layouts:
        raise ValidationError(f"format {format!r} has no layout for {kind} views; use 'trl' or 'parquet'")
    try:
        out = os.path.abspath(os.fspath(path))
    except (TypeError, ValueError) as e:
        raise ExportError(f"export path {path!r} is not a usable path ({e})") from None
    if "\x00" in out or utf8_problem(out):
        raise ExportError(f"export path {path!r} contains a NUL character or is not valid UTF-8")
    if not isinstance(overwrite, bool) or not isinstance(skip_missing, bool):
        raise ValidationError(f"overwrite and skip_missing are True or False, not {overwrite!r}, {skip_missing!r}")
    check_length(os.fspath(path) if isinstance(path, str | os.PathLike) else out, out)
    check_target(root, out)
    if os.path.lexists(out):
        if not overwrite:
            raise ExportError(f"{out} exists; pass overwrite=True (or --overwrite) to replace it")
        replaceable(out)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-export") as pool:
        # the view's texts load beside its rows
        reading = pool.submit(stored.texts.read, entry) if entry.get("texts_version") is not None else None
        rows = stored.read(entry, codes=True)
        values = None if reading is None else reading.result()
    rows, skipped = _with_texts(stored.texts, reads, entry, rows, shape, spec, skip_missing, values)
    side = _split(rows, validation) if validation else None  # no split asked: every row is train
    parent = os.path.dirname(os.path.abspath(out)) or "."
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".trellis-export-", dir=parent)
    except OSError as e:  # a name the file system refuses, a file where a folder must be: the caller's path
        raise (path_error(out, e) or e) from None
    try:
        files, counts = _write(tmp, format, shape, rows, side, validation, progress)
        tasks = {split: _tasks(rows, side, split) for split in counts}
        manifest = {
            "trellisdb_export": 1,
            "view": name,
            "kind": kind,
            "definition": entry["definition"],
            "commit": entry["commit"],
            "database": os.path.abspath(root),
            "format": format,
            "layout": KINDS[kind].layouts.get(format, "the view's rows with resolved texts"),
            "created_at": dt.datetime.now(dt.UTC).isoformat(),
            "rows": sum(counts.values()),
            "counts": counts,
            "skipped_missing_texts": skipped,
            "split": {"by": "task_id", "rule": "sha256(task_id) as a number in [0, 1) < validation -> validation",
                      "validation": validation, "tasks": tasks},
            "files": {**files, "provenance": "provenance.parquet", "card": "README.md"},
            "provenance": "provenance.parquet: (split, row, node_ids) -- the nodes behind every row; row counts "
                          "through the split's files in order",
        }
        with open(os.path.join(tmp, "manifest.json"), "w") as fh:
            json.dump(manifest, fh, indent=1)
        with open(os.path.join(tmp, "README.md"), "w") as fh:
            fh.write(_card(manifest))
        if os.path.exists(out):
            old = tmp + ".old"  # beside it, a short name: the export's own may be as long as a name can be
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)
        else:
            os.replace(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and (refused := path_error(out, e)) is not None:
            raise refused from None
        raise
    return manifest


def _write(
    tmp: str, format: str, shape: str, rows: pa.Table, side: pa.Array | None, validation: float,
    progress: Callable[[int, int], None] | None,
) -> tuple[dict[str, list[str]], dict[str, int]]:
    """The split files and ``provenance.parquet`` in folder ``tmp``; returns each split's files
    and row count. Progress is reported from this thread as each chunk lands."""
    files: dict[str, list[str]] = {}
    counts: dict[str, int] = {}
    parts: list[tuple[str, pa.Table]] = []
    prov = []
    for split in ("train", "validation"):
        if split == "validation" and validation == 0.0:
            continue
        # no split asked: every row is train, no filtered copy of the table
        part = rows if side is None else rows.filter(pc.equal(side, split))
        counts[split] = part.num_rows
        # a shared text stays one value: a Parquet dictionary, a polars Categorical in the layouts
        parts.append((split, _dictionaries(part)))
        prov.append(pa.table({"split": pa.array([split] * part.num_rows, pa.string()),
                              "row": pa.array(np.arange(part.num_rows)), "node_ids": part["node_ids"]}))

    def provenance() -> None:  # written while the splits' last chunks are
        t = pa.concat_tables(prov) if prov else pa.table({"split": pa.array([], pa.string())})
        _parquet(t, os.path.join(tmp, "provenance.parquet"))

    if format == "parquet":
        _write_parquet(tmp, parts, files, provenance, rows.num_rows, progress)
    else:
        _write_jsonl(tmp, format, shape, parts, files, provenance, rows.num_rows, progress)
    if progress and not rows.num_rows:
        progress(0, 0)
    return files, counts


def _write_jsonl(
    tmp: str, format: str, shape: str, parts: list[tuple[str, pa.Table]], files: dict[str, list[str]],
    provenance: Callable[[], None], total: int, progress: Callable[[int, int], None] | None,
) -> None:
    """One JSONL file per split: one writer thread writes while this one lays out the next
    chunk (both mostly outside the GIL)."""
    done = 0
    queue: list[tuple[Future[Any], int]] = []
    handles = []

    def settle(keep: int) -> None:
        nonlocal done
        while len(queue) > keep:
            fut, n = queue.pop(0)
            fut.result()
            done += n
            if progress and n:
                progress(done, total)

    # the files close after the pool has shut down: no write is in flight on them then
    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="trellis-export") as pool:
            for split, part in parts:
                fname = f"{split}.jsonl"
                files[split] = [fname]
                fh = open(os.path.join(tmp, fname), "wb")  # noqa: SIM115 (closed below, once its writes are done)
                handles.append(fh)
                step = _chunk_rows(part)
                for lo in range(0, part.num_rows, step):
                    chunk = _plain(part.slice(lo, step), keep=True)  # while the writer writes the one before
                    queue.append((pool.submit(_layout(format, shape, chunk).write_ndjson, fh), chunk.num_rows))
                    settle(1)
            provenance()
            settle(0)
    finally:
        for fh in handles:
            fh.close()


def _write_parquet(
    tmp: str, parts: list[tuple[str, pa.Table]], files: dict[str, list[str]], provenance: Callable[[], None],
    total: int, progress: Callable[[int, int], None] | None,
) -> None:
    """Each split as one Parquet file, or over ``SHARD_BYTES`` of decoded rows as shards of
    equal row counts (``train-00000-of-00002.parquet``: Hugging Face's naming), written on up
    to one thread per core (``MAX_WRITERS``): a Parquet file is encoded and compressed on one thread, so shards
    are what lets a large export use the machine (2 shards on 2 cores: 0.60 s vs 1.06 s)."""
    jobs: list[tuple[str, pa.Table]] = []
    for split, part in parts:
        n = max(1, min(MAX_SHARDS, part.num_rows, -(-int(_row_bytes(part) * part.num_rows) // SHARD_BYTES)))
        names = [f"{split}.parquet"] if n == 1 else [f"{split}-{i:05d}-of-{n:05d}.parquet" for i in range(n)]
        files[split] = names
        per = -(-part.num_rows // n)
        jobs += [(name, part.slice(i * per, per)) for i, name in enumerate(names)]
    landed: SimpleQueue[int | None] = SimpleQueue()  # rows written, or None: a file is finished

    def write(target: str, part: pa.Table) -> None:
        try:
            # no min/max of long texts in the footer; the file's types are the plain ones
            stats = [f.name for f in part.schema if f.name not in _TEXT_NAMES]
            with open(target, "wb") as fh, pq.ParquetWriter(
                fh, _plain_schema(part.schema, keep=True), write_statistics=stats, store_schema=False,
                use_dictionary=_repeating(part),
            ) as writer:
                step = _chunk_rows(part)
                for lo in range(0, part.num_rows, step):
                    chunk = _plain(part.slice(lo, step), keep=True)
                    writer.write_table(chunk)
                    landed.put(chunk.num_rows)
        finally:
            landed.put(None)

    workers = max(1, min(len(jobs), os.cpu_count() or 1, MAX_WRITERS))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="trellis-export") as pool:
        futures = [pool.submit(write, os.path.join(tmp, name), part) for name, part in jobs]
        provenance()
        done, open_files = 0, len(futures)
        while open_files:
            n = landed.get()
            if n is None:
                open_files -= 1
            elif n:
                done += n
                if progress:
                    progress(done, total)
        for fut in futures:
            fut.result()


#: The text columns ``_with_texts`` adds (named after their hash columns).
_TEXT_NAMES = frozenset({"system", "prompt", "response", "chosen", "rejected", "prompts", "responses", "message",
                         "messages"})


def _dictionaries(t: pa.Table) -> pa.Table:
    """``t`` with the text columns of few distinct values (``DICTIONARY_SHARE``) over compact
    dictionaries of just the texts they use, marked to be written as they are."""
    for i, f in enumerate(t.schema):
        if not pa.types.is_dictionary(f.type) or t.num_rows == 0:
            continue
        col = t.column(i).combine_chunks()
        valid = pc.is_valid(col.indices).to_numpy(zero_copy_only=False)
        # nulls filled first: an integer array with nulls would come out as floats
        codes = pc.fill_null(col.indices, 0).to_numpy(zero_copy_only=False)
        seen = np.zeros(len(col.dictionary), bool)
        seen[codes[valid]] = True  # the texts in use, in one pass (no sort)
        used = np.flatnonzero(seen)
        if len(used) > DICTIONARY_SHARE * t.num_rows:
            continue
        values = col.dictionary.take(pa.array(used))
        if values.nbytes > DICTIONARY_BYTES:
            continue
        new_code = (np.cumsum(seen) - 1).astype(np.int32)
        compact = pa.DictionaryArray.from_arrays(pa.array(new_code[codes], mask=~valid), values)
        t = t.set_column(i, f.with_type(compact.type).with_metadata({_KEEP: b"1"}), compact)
    return t


def _repeating(t: pa.Table) -> list[str]:
    """The Parquet columns of ``t`` to dictionary-encode: those ``_dictionaries`` kept, and
    those whose first ``DICTIONARY_SAMPLE`` values are at most ``DICTIONARY_SAMPLE_SHARE``
    distinct. pyarrow would otherwise build a dictionary for every column and, for the many of
    mostly distinct ids, hashes and texts, drop it at 1 MB (~5% of an export's writing)."""
    head = t.slice(0, DICTIONARY_SAMPLE)
    out = []
    for f in t.schema:
        path = f"{f.name}.list.element" if pa.types.is_list(f.type) else f.name
        if f.metadata and _KEEP in f.metadata:
            out.append(path)
            continue
        col = head[f.name].combine_chunks()
        if isinstance(col, pa.ListArray):
            col = col.flatten()
        if isinstance(col, pa.DictionaryArray):
            col = col.indices
        if len(col) and pc.count_distinct(col).as_py() <= DICTIONARY_SAMPLE_SHARE * len(col):
            out.append(path)
    return out


def _row_bytes(t: pa.Table, decoded_only: bool = False) -> float:
    """About the bytes of a row of ``t`` with its texts decoded (a dictionary's values counted
    at their average size); ``decoded_only``: of the text columns a chunk decodes (not those
    ``_dictionaries`` keeps as they are)."""
    per_row = 1.0
    for f in t.schema:
        if pa.types.is_dictionary(f.type):
            if decoded_only and f.metadata and _KEEP in f.metadata:
                continue
            values = t[f.name].chunk(0).dictionary if t[f.name].num_chunks else None
            if values is not None and len(values):
                per_row += values.nbytes / len(values)
        elif (f.name in _TEXT_NAMES or not decoded_only) and t.num_rows:
            per_row += t[f.name].nbytes / t.num_rows
    return per_row


def _chunk_rows(t: pa.Table) -> int:
    """Rows per chunk: about ``CHUNK_BYTES`` of the texts a chunk decodes."""
    lo, hi = CHUNK_ROWS
    return int(min(hi, max(lo, CHUNK_BYTES // _row_bytes(t, decoded_only=True))))


def _parquet(t: pa.Table, target: str) -> None:
    """``provenance.parquet``: a dictionary for ``split`` only, no statistics on ``node_ids``
    (unique ids: a dictionary is built and dropped; 0.09 s vs 0.055 s at 412k rows)."""
    with open(target, "wb") as fh:  # a file handle: pyarrow's own filesystem layer is slower here
        pq.write_table(t, fh, use_dictionary=["split"], write_statistics=["split", "row"])


def _with_texts(
    store: texts.TextStore, reads: Reads, entry: dict[str, Any], rows: pa.Table, shape: str, spec: ViewSpec,
    skip: bool, stored: pa.Array | None,
) -> tuple[pa.Table, int]:
    """``rows`` (with their text codes) with a text column per hash column instead (``system``,
    ``prompt``, ``response`` ...): dictionaries over the view's ``stored`` texts (``texts.py``),
    no copy. Rows missing a text the layout needs raise, or are dropped (and counted) with ``skip``."""
    legacy = None
    if stored is None:  # a view that does not keep its texts (or stored before views did): resolved now
        rows, legacy = texts.encode(store, rows, reads.at_commit(int(entry["commit"])))
    need = KINDS[spec.kind].texts_needed(spec)
    missing = np.zeros(rows.num_rows, bool)
    for col in need:
        c = rows[texts.CODE_PREFIX + col].combine_chunks()
        missing |= pc.is_null(c).to_numpy(zero_copy_only=False)
        if pa.types.is_list(c.type):  # a trajectory missing one step's text
            holes = pc.is_null(c.flatten()).to_numpy(zero_copy_only=False)
            missing[pc.list_parent_indices(c).to_numpy()[holes]] = True
    mask = pa.array(missing)
    n_missing = int(missing.sum())
    if n_missing and not skip:
        key = "node_id" if "node_id" in rows.column_names else ROW_KEYS[shape][0]
        ids = rows[key].filter(mask).to_pylist()
        names = {"prompt_hash": spec.prompt, "response_hash": spec.response, "chosen_hash": spec.response,
                 "rejected_hash": spec.response, "response_hashes": spec.response, "prompt_hashes": spec.prompt,
                 "message_hash": spec.messages or "messages"}
        roles = ", ".join(sorted({names[c] for c in need}))
        raise ExportError(
            f"{n_missing} row(s) of view {spec.name!r} lack a {roles!r} artifact, e.g. {ids[:10]}; add the "
            f"artifacts, or pass skip_missing=True (--skip-missing) to leave those rows out"
        )
    if n_missing:
        rows = rows.filter(pc.invert(mask))
    codes = texts.code_columns(rows.column_names)
    arrays = [rows[c].combine_chunks() for c in codes]
    flat = [c.flatten() if pa.types.is_list(c.type) else c for c in arrays]
    used = pa.concat_arrays(flat) if flat else pa.array([], pa.int32())
    if legacy is None:
        values = store.texts_of(entry, used, stored)
    else:
        values = texts.utf8(legacy["text"].combine_chunks(), legacy["hash"].combine_chunks, used)
    rows = rows.drop_columns(codes)
    for c, col, f in zip(codes, arrays, flat, strict=True):
        base = c.removeprefix(texts.CODE_PREFIX)
        name = base.removesuffix("_hash").removesuffix("_hashes") + ("s" if base.endswith("_hashes") else "")
        # a dictionary over the texts (no copy); _plain decodes it a chunk at a time
        text: pa.Array = pa.DictionaryArray.from_arrays(f, values)
        if pa.types.is_list(col.type):  # the steps' texts, in the lists' shape (decoded here)
            text = texts.in_lists(col, text.dictionary_decode())
        rows = rows.append_column(name, text)
    return rows, int(n_missing)


def _split(rows: pa.Table, validation: float) -> pa.Array:
    """Per row, 'train' or 'validation', by the task's hash (a loop over the distinct tasks)."""
    tasks = rows["task_id"].combine_chunks() if rows.num_rows else pa.array([], pa.string())
    uniq = pc.unique(tasks)
    side = ["validation" if _unit(t) < validation else "train" for t in uniq.to_pylist()]
    return pa.array(side, pa.string()).take(pc.index_in(tasks, value_set=uniq))


def _tasks(rows: pa.Table, side: pa.Array | None, split: str) -> int:
    """How many tasks the rows of ``split`` hold (``side``: each row's split; None: all train)."""
    col = rows["task_id"] if side is None else rows["task_id"].filter(pc.equal(side, split))
    return int(pc.count_distinct(col, mode="all").as_py()) if len(col) else 0


def _unit(task: str | None) -> float:
    h = hashlib.sha256((task or "").encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def _layout(format: str, shape: str, t: pa.Table) -> pl.DataFrame:
    """A chunk of rows of ``shape`` with their texts in ``format``'s layout (the kind's)."""
    return SHAPES[shape].layout(format, shape, t)


def _card(m: dict[str, Any]) -> str:
    counts = ", ".join(f"{k}: {v}" for k, v in m["counts"].items()) or "none"
    files = "; ".join(f"{k}: {', '.join(f'`{f}`' for f in v)}" for k, v in m["files"].items() if isinstance(v, list))
    return (
        f"# {m['view']} ({m['kind']})\n\n"
        f"Exported by trellisdb from `{m['database']}` at commit {m['commit']} on {m['created_at'][:10]}.\n\n"
        f"- definition: `{m['definition']}`\n"
        f"- format: {m['format']} -- {m['layout']}\n"
        f"- rows: {m['rows']} ({counts}); rows skipped for missing texts: {m['skipped_missing_texts']}\n"
        f"- split: by task, {m['split']['rule']} (validation = {m['split']['validation']})\n"
        f"- files: {files}\n"
        f"- provenance: `provenance.parquet` names the nodes behind every row; `manifest.json` has the rest.\n\n"
        "Recreate it: materialize the view at the same commit (`db.materialize(name, as_of=commit)`) and export "
        "again; the rows are the same.\n"
    )
