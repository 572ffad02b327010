"""The artifact texts a materialized view's rows name, resolved once and kept beside the rows.

A view's rows name artifacts by hash (``prompt_hash``, ``response_hashes`` ...). When the view
is materialized, the contents of those artifacts are resolved in one streamed scan of the
artifacts (``resolve``) and stored beside the rows, in ``views/<name>.texts.lance``: ``hash`` and
``text`` (the artifact's bytes) once per distinct artifact. Each hash column of the rows gets a
code column ``__text_<column>`` (``int32``, or a list of them for a list of hashes): the
position of its text in that table, null where the artifact is absent. An export reads the
rows and the texts and hands them to the writers as dictionaries, with no join at export time
(``texts_of``); a refresh resolves only the texts of its new rows that the table lacks
(``extend``): the artifacts written since the view's commit in one filtered scan, older ones
where the last full scan in this process found them (``Addresses``), else by hash; it matches
them against the table's keys (``Known``), which materialize and refresh leave in memory for
the next refresh in the process. ``TextStore`` owns the text tables of one open database's
views and those two caches; the functions here read the artifacts through a ``Snapshot``.

The table only grows between materializations: the texts of rows a refresh replaced stay,
unreferenced, until the view is next materialized in full. Texts are checked to be UTF-8 only
when exported (a view may name binary artifacts; exporting such a row is the error).

>>> import tempfile, trellisdb
>>> db = trellisdb.connect(tempfile.mkdtemp() + "/db")
>>> with db.session(task="t", agent="a") as s:
...     n = s.add_node(artifacts={"prompt": "pack 26 circles", "response": "r = 0.1"})
...     s.add_reward(n, "score", 1.0)
>>> _ = db.create_view("good", "sft", reward="reward('score')")
>>> _ = db.materialize("good")
>>> from trellisdb.training.catalog import ViewCatalog
>>> store = TextStore(db.path)
>>> store.texts_of(ViewCatalog(db.path).load().entries["good"]).to_pylist()
['pack 26 circles', 'r = 0.1']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import ExportError, TrellisError
from trellisdb.reader import gathered
from trellisdb.storage.tables import take
from trellisdb.training.files import texts_file

if TYPE_CHECKING:
    from trellisdb.snapshot import Snapshot

#: The code column of hash column ``c`` is ``CODE_PREFIX + c``.
CODE_PREFIX: Final = "__text_"
#: Artifacts are read from Lance in batches of ``TEXT_SCAN_ROWS`` (at 2M artifacts 128k-row
#: batches scan in 0.2 s, 1M-row ones in 0.36-0.67 s) and matched about ``TEXT_BATCH_BYTES`` at
#: a time (what a resolve holds at once besides the texts it keeps).
TEXT_SCAN_ROWS = 1 << 17
TEXT_BATCH_BYTES = 256 << 20
#: The seed of the hash that checks each keyed match (the key's seed is 0).
_CHECK_SEED: Final = 0x5DEECE66D
#: The Lance file format of a view's texts (as its rows': read whole, so fast over small).
TEXTS_FORMAT: Final = "2.0"
#: A view's rows and texts are read whole in batches of this many rows, this many batches ahead
#: (more than Lance's default: 412k pairs in 0.07-0.10 s vs 0.10-0.15 s).
READ_BATCH_ROWS: Final = 1 << 14
READ_AHEAD: Final = 64
#: A refresh looks up at most this many older artifacts by a Lance ``hash IN (...)`` filter;
#: more in a full scan of the artifacts.
LISTED_HASHES = 4096
#: A full resolve keeps where each artifact is (``Addresses``) for tables up to this many rows
#: (16 bytes a row: 128 MB at most).
ADDRESS_ROWS: Final = 8_000_000


@dataclass
class Addresses:
    """Where the artifacts visible at ``upto`` are in Lance, as a full resolve found them: the
    64-bit key of each hash (``resolve``'s) and its row address. Kept per open database (its
    ``TextStore``), in memory, so that a refresh finds an older artifact by address rather than
    by a scan of every hash (at 2M artifacts: ~0.02 s vs 0.2 s). A hint only: rows a compaction has moved since are
    not used, and every row taken is checked against the hash asked for."""

    upto: int
    keys: pl.Series
    addrs: np.ndarray


def hash_columns(names: Iterable[str]) -> list[str]:
    """The columns of a view's rows that name artifacts."""
    return [c for c in names if c.endswith(("_hash", "_hashes")) and not c.startswith(CODE_PREFIX)]


def code_columns(names: Iterable[str]) -> list[str]:
    return [c for c in names if c.startswith(CODE_PREFIX)]


# ------------------------------------------------------------------ building
def _probe(rows: pa.Table) -> tuple[list[str], list[int], pl.Series]:
    """The hash columns of ``rows``, the number of hashes in each (a list's values) and every
    hash they name, in column order: a polars series over the columns' chunks, not a copy (a
    concatenated Arrow array cost 0.3-0.6 s for 1.6M hashes, this ~0.03 s)."""
    names = hash_columns(rows.column_names)
    parts = [pl.Series("hash", rows[c].combine_chunks().flatten() if pa.types.is_list(rows.schema.field(c).type)
                       else rows[c], pl.String) for c in names]
    probe = pl.concat(parts, rechunk=False) if parts else pl.Series("hash", [], pl.String)
    return names, [len(p) for p in parts], probe


def _attach(rows: pa.Table, names: list[str], sizes: list[int], codes: np.ndarray) -> pa.Table:
    """``rows`` with a code column per hash column; ``codes`` (-1: no text) runs over the
    hash columns' values in order (``sizes`` of them each)."""
    lo = 0
    for name, n in zip(names, sizes, strict=True):
        c = codes[lo:lo + n]
        lo += n
        arr: pa.Array = pa.array(c.astype(np.int32), pa.int32(), mask=c < 0)
        col = rows[name]
        if pa.types.is_list(col.type):
            arr = in_lists(col.combine_chunks(), arr)
        rows = rows.append_column(CODE_PREFIX + name, arr)
    return rows


def in_lists(col: pa.ListArray, values: pa.Array) -> pa.ListArray:
    """``values`` (one per value of ``col``'s lists, in order) in ``col``'s lists' shape."""
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False)
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return pa.ListArray.from_arrays(offsets, values, mask=col.is_null())


def encode(store: TextStore, rows: pa.Table, snap: Snapshot) -> tuple[pa.Table, pa.Table]:
    """``rows`` with their code columns, and the texts they name (``hash``, ``text``) in code
    order, as of the snapshot."""
    names, sizes, probe = _probe(rows)
    at, values = resolve(store, snap, probe)
    pos = pc.fill_null(at, -1).to_numpy(zero_copy_only=False).astype(np.int64)
    # only the texts in use (a hash stored twice comes back twice; one is used), in scan order
    seen = np.zeros(len(values), bool)
    seen[pos[pos >= 0]] = True
    new_code = np.cumsum(seen) - 1
    codes = np.full(len(pos), -1, np.int64)  # -1: no such artifact (every one, when none is found)
    codes[pos >= 0] = new_code[pos[pos >= 0]]
    owner = np.zeros(int(seen.sum()), np.int64)
    owner[codes[codes >= 0]] = np.flatnonzero(codes >= 0)  # a probe position naming each text
    hashes = probe.gather(owner).to_arrow().cast(pa.string())
    table = pa.table({"hash": hashes, "text": values.filter(pa.array(seen))})
    return _attach(rows, names, sizes, codes), table


@dataclass
class Known:
    """A view's text table as a refresh matches against it: per text, in code order, the
    64-bit key of its hash (``resolve``'s) and a second, independently seeded 64-bit hash of it
    (two hashes agree on both by chance about once in 2**128 pairs). 16 bytes a text."""

    keys: pl.Series
    checks: pl.Series

    @staticmethod
    def of(hashes: pa.Array | pa.ChunkedArray) -> Known:
        h = pl.Series("hash", hashes, pl.String)
        return Known(h.hash(seed=0), h.hash(seed=_CHECK_SEED))

    def extended(self, hashes: pa.Array | pa.ChunkedArray) -> Known:
        """These, then the texts of ``hashes`` appended after them."""
        more = Known.of(hashes)
        return Known(pl.concat([self.keys, more.keys]), pl.concat([self.checks, more.checks]))


#: Text tables of up to this many texts have their ``Known`` kept (16 bytes a text: 128 MB at most).
KNOWN_TEXTS: Final = 8_000_000


def _tag(entry: Mapping[str, Any]) -> tuple[Any, ...]:
    """What names one state of a view's text table (the version alone would not: a view dropped
    and made again starts its versions over)."""
    return entry.get("texts_version"), entry.get("texts"), entry.get("computed_at")


class TextStore:
    """The texts kept beside the views of the database in folder ``root``
    (``views/<name>.texts.lance``), and what this process keeps in memory about them: per view,
    its text table's ``Known`` (``known``), and where the artifacts are (``addresses``)."""

    def __init__(self, root: str) -> None:
        self.root = root
        #: Per view: its text table's ``Known``, tagged with the catalog entry it belongs to.
        #: Materialize and refresh leave it here, so a refresh in the same process does not read
        #: and hash the whole text table again (785k texts: 0.07-0.16 s, beside the refresh's SQL).
        self.known: dict[str, tuple[tuple[Any, ...], Known]] = {}
        #: Where the last full resolve (extended by refreshes) found the artifacts (``Addresses``).
        self.addresses: Addresses | None = None

    def path(self, name: str) -> str:
        """The text table of view ``name``."""
        return os.path.join(self.root, texts_file(name))

    def remember(self, name: str, entry: Mapping[str, Any] | None, have: Known | None) -> None:
        """Keep ``have`` as the ``Known`` of view ``name`` as ``entry`` stores it (None: forget it)."""
        if entry is None or have is None or entry.get("texts_version") is None or len(have.keys) > KNOWN_TEXTS:
            self.known.pop(name, None)
        else:
            self.known[name] = (_tag(entry), have)

    def cached(self, entry: Mapping[str, Any]) -> Known | None:
        """The ``Known`` kept for the text table ``entry`` names, if any."""
        kept = self.known.get(entry["spec"]["name"])
        return kept[1] if kept is not None and kept[0] == _tag(entry) else None

    def known_of(self, entry: Mapping[str, Any]) -> Known:
        """The ``Known`` of a view's text table: kept from this process's last materialize or
        refresh of it, or read and hashed now (and kept)."""
        have = self.cached(entry)
        if have is None:
            have = Known.of(self.hashes(entry))
            self.remember(entry["spec"]["name"], entry, have)
        else:
            self.open(entry)  # still there (the refresh appends to it): a clear error now if not
        return have

    def hashes(self, entry: Mapping[str, Any]) -> pa.Array:
        """A view's text table's hashes, in code order."""
        return self.open(entry).to_table(columns=["hash"])["hash"].combine_chunks()

    def open(self, entry: Mapping[str, Any]) -> Any:
        """The Lance dataset of the text table ``entry`` names, at its version."""
        import lance

        uri = self.path(entry["spec"]["name"])
        try:
            return lance.dataset(uri, version=entry["texts_version"])
        except (OSError, ValueError, RuntimeError) as e:
            raise TrellisError(f"the texts of view {entry['spec']['name']!r} ({uri}) are unreadable ({e}); "
                               "run db.materialize(name) to recompute them") from e

    def read(self, entry: Mapping[str, Any]) -> pa.Array:
        """A view's texts in code order, as stored (bytes)."""
        t = self.open(entry).to_table(columns=["text"], batch_size=READ_BATCH_ROWS, batch_readahead=READ_AHEAD)
        return t["text"].combine_chunks()

    def texts_of(self, entry: Mapping[str, Any], used: pa.Array | None = None,
                 stored: pa.Array | None = None) -> pa.Array:
        """A view's texts in code order (``stored``: as ``read`` gave them), as strings. Texts
        that are not UTF-8 raise an ``ExportError`` naming their artifacts if ``used`` (codes)
        names them (or it is None), and are null otherwise."""
        return utf8(self.read(entry) if stored is None else stored, lambda: self.hashes(entry), used)

    def note_addresses(self, upto: int, since: int | None, keys: list[pl.Series], addrs: list[np.ndarray]) -> None:
        """Record where a scan found the artifacts visible at ``upto``: all of them (``since`` None),
        or those written after ``since``, added to addresses that reach ``since``."""
        k = pl.concat(keys) if keys else pl.Series("hash", [], pl.UInt64)
        a = np.concatenate(addrs) if addrs else np.empty(0, np.uint64)
        old = self.addresses
        if since is not None:
            if old is None or old.upto < since or old.upto >= upto:
                return  # a gap between them, or nothing new
            k, a = pl.concat([old.keys, k]), np.concatenate([old.addrs, a])
        elif old is not None and old.upto > upto:
            return  # an older snapshot's: keep the newer
        if len(k) <= ADDRESS_ROWS:
            self.addresses = Addresses(upto, k, a)


def written_since(snap: Snapshot, since: int, limit: int = 64 << 20) -> list[pa.Table] | None:
    """The artifacts written in commits ``(since, snapshot]`` (``hash``, ``content``, ``_rowaddr``),
    read ahead of a refresh's lookups; None if they hold more than ``limit`` bytes (the lookup
    then scans for just the wanted ones)."""
    out: list[pa.Table] = []
    size = 0
    for w in _windows(snap.scan("artifacts", ("hash", "content"), batch_rows=TEXT_SCAN_ROWS,
                                where=f"commit_id > {int(since)}", with_row_address=True)):
        out.append(w)
        size += w.nbytes
        if size > limit:
            return None
    return out


def extend(
    store: TextStore, fresh: pa.Table, have: Known, since: int, snap: Snapshot, ahead: list[pa.Table] | None = None
) -> tuple[pa.Table, pa.Table]:
    """``fresh`` rows (a refresh's) with their code columns against a view's text table
    (``have``), and the texts to append to it (``hash``, ``text``, codes from its length on).
    Only the hashes the table lacks are looked up: those written after ``since`` in one
    filtered scan (or among ``ahead``, ``written_since``'s), older ones by address or hash."""
    names, sizes, strings = _probe(fresh)
    wanted = strings.drop_nulls().unique()
    # keys first (the table's: kept from the last materialize or refresh, or hashed beside the SQL), then checks
    probe = pl.DataFrame({"hash": wanted, "k": wanted.hash(seed=0), "c": wanted.hash(seed=_CHECK_SEED)})
    maybe = np.flatnonzero(have.keys.is_in(probe["k"].implode()).to_numpy())
    cand = pl.DataFrame({"k": have.keys.gather(maybe), "c": have.checks.gather(maybe), "code": maybe})
    # a text is the one wanted when both its hashes agree (as resolve checks its matches)
    index = probe.join(cand, on=["k", "c"], how="inner").group_by("hash").agg(pl.col("code").min())
    lacking = wanted.filter(~wanted.is_in(index["hash"].implode()))
    new = pa.table({"hash": pa.array([], pa.string()), "text": pa.array([], pa.binary())})
    if len(lacking):
        ask = lacking.to_arrow().cast(pa.string())
        # the artifacts written since: one scan of the rows of those commits (extending the addresses)
        at, values = resolve(store, snap, lacking, where=f"commit_id > {int(since)}", since=since, scanned=ahead)
        got = pc.is_valid(at)
        found = [pa.table({"hash": ask.filter(got), "text": values.take(at.filter(got))})]
        rest = ask.filter(pc.invert(got))
        if len(rest):  # older artifacts no row named before (a node that joined a pair or group)
            found.append(_by_address(store, snap, rest))
            rest = rest.filter(pc.invert(pc.is_in(rest, value_set=found[-1]["hash"].combine_chunks())))
        if len(rest):  # not where the addresses say (none kept, or moved by a compaction): by hash
            # a few by a Lance filter; many in a full scan, which records the addresses anew
            listed = ", ".join("'" + h.replace("'", "''") + "'" for h in rest.to_pylist()) \
                if len(rest) <= LISTED_HASHES else None
            at, values = resolve(store, snap, pl.Series("hash", rest), where=listed and f"hash IN ({listed})")
            got = pc.is_valid(at)
            found.append(pa.table({"hash": rest.filter(got), "text": values.take(at.filter(got))}))
        wide = pa.schema([("hash", pa.string()), ("text", pa.large_binary())])
        new = pa.concat_tables([f.cast(wide) for f in found])
        base = len(have.keys)
        index = pl.concat([index, pl.DataFrame({"hash": new["hash"].combine_chunks(),
                                                "code": np.arange(base, base + new.num_rows)})])
    joined = pl.DataFrame({"hash": strings}).join(index, on="hash", how="left", maintain_order="left")
    codes = joined["code"].fill_null(-1).to_numpy().astype(np.int64)
    text_type = pa.large_binary() if new["text"].nbytes >= (1 << 31) - 1 else pa.binary()
    return _attach(fresh, names, sizes, codes), new.cast(pa.schema([("hash", pa.string()), ("text", text_type)]))


def _by_address(store: TextStore, snap: Snapshot, hashes: pa.Array) -> pa.Table:
    """The artifacts of ``hashes`` (``hash``, ``text``) that ``Addresses`` places in fragments
    still there, each row checked to hold the hash asked for and to be visible in ``snap``."""
    out = pa.table({"hash": pa.array([], pa.string()), "text": pa.array([], pa.binary())})
    where = store.addresses
    if where is None:
        return out
    upto = snap.commit
    hit = where.keys.is_in(pl.Series("hash", hashes).hash(seed=0).implode()).to_numpy()
    addrs = where.addrs[hit]
    try:
        ds = snap.dataset("artifacts")
        alive = np.array([f.fragment_id for f in ds.get_fragments()], np.uint64)
        addrs = addrs[np.isin(addrs >> np.uint64(32), alive)]
        if not len(addrs):
            return out
        rows = take(ds, pa.array(addrs), ["hash", "content", "commit_id"])
    except Exception:  # an accelerator only (Lance's row-address take is marked unstable): scan instead
        return out
    aborted = snap.aborted()
    ok = pc.and_(pc.is_in(rows["hash"], value_set=hashes), pc.less_equal(rows["commit_id"], upto))
    if aborted:
        ok = pc.and_(ok, pc.invert(pc.is_in(rows["commit_id"], value_set=pa.array(aborted, pa.int64()))))
    rows = rows.filter(ok)
    first = pl.DataFrame({"h": rows["hash"].combine_chunks()}).with_row_index("i").unique("h", keep="first")["i"]
    rows = rows.take(first.to_arrow())
    content = rows["content"].combine_chunks()
    return pa.table({"hash": rows["hash"].combine_chunks().cast(pa.string()),
                     "text": content.cast(pa.binary()) if content.nbytes < (1 << 31) - 1 else content})


# ------------------------------------------------------------------ reading
def utf8(values: pa.Array, hashes: Callable[[], pa.Array], used: pa.Array | None = None) -> pa.Array:
    """``values`` (bytes) as strings; see ``texts_of`` (``hashes()``: theirs, for the error)."""
    string = pa.large_string() if pa.types.is_large_binary(values.type) else pa.string()
    try:
        return values.cast(string)  # checked, not copied
    except pa.ArrowInvalid:
        pass
    bad = np.array([not _is_utf8(v) for v in values.to_pylist()], bool)  # a loop, on this error path only
    if used is not None:
        codes = pc.drop_null(used).to_numpy(zero_copy_only=False)
        needed = np.zeros(len(values), bool)
        needed[codes] = True
    else:
        needed = np.ones(len(values), bool)
    if (bad & needed).any():
        names = hashes().filter(pa.array(bad & needed)).to_pylist()
        raise ExportError(
            f"{len(names)} artifact(s) the export needs as text are not UTF-8, e.g. {sorted(names)[:5]}; "
            f"export binary artifacts with db.sql('SELECT content FROM artifacts_full ...') instead"
        )
    return pc.if_else(pa.array(bad), pa.scalar(None, values.type), values).cast(string)


def _is_utf8(b: bytes | None) -> bool:
    try:
        (b or b"").decode()
    except UnicodeDecodeError:
        return False
    return True


# ------------------------------------------------------------------ resolving
def resolve(
    store: TextStore, snap: Snapshot, strings: pl.Series, where: str | None = None, exact: bool = False,
    since: int | None = None, scanned: list[pa.Table] | None = None,
) -> tuple[pa.Array, pa.Array]:
    """The contents (bytes) of the artifacts whose hashes ``strings`` holds (nulls allowed), as
    of the snapshot, and per value of ``strings`` the position of its content (null: no such
    artifact). ``where``: a Lance filter narrowing the artifacts scanned; without one (or with
    ``commit_id > since``, ``since`` given) the scan's rows are remembered in ``store``
    (``Addresses``).
    ``scanned``: that scan's windows, read already (with ``_rowaddr``).

    The artifacts are streamed from Lance and matched about ``TEXT_BATCH_BYTES`` at a time,
    only the wanted ones kept. The joins run on a 64-bit hash of the hash strings (polars), and
    every match is checked on a second, independently seeded 64-bit hash of both strings: two
    different hashes pass only if both 64-bit values collide (about 2**-128 a pair). Should a
    match fail the check, the lookup is redone on the strings themselves (``exact``). At 1M
    nodes (785k distinct texts of 2M artifacts) this takes 0.45-0.7 s, the scan ~0.2 s of it."""
    want = strings if exact else strings.hash(seed=0)
    wanted = want.filter(strings.is_not_null()).unique()
    among = wanted.implode()  # is_in: membership in the whole series
    keys: list[pl.Series] = []
    checks: list[pl.Series] = []
    texts: list[pa.Array] = []
    remember = not exact and (where is None or since is not None)
    seen: list[pl.Series] = []
    addrs: list[np.ndarray] = []
    if len(wanted):
        windows: Iterable[pa.Table] = scanned if scanned is not None else _windows(snap.scan(
            "artifacts", ("hash", "content"), batch_rows=TEXT_SCAN_ROWS, where=where, with_row_address=remember))
        for b in windows:
            h = pl.Series("hash", b.column("hash"))
            k = h if exact else h.hash(seed=0)
            if remember:
                seen.append(k)
                addrs.append(b.column("_rowaddr").to_numpy().astype(np.uint64))
            hit = k.is_in(among)
            keys.append(k.filter(hit))
            if not exact:
                checks.append(h.filter(hit).hash(seed=_CHECK_SEED))
            texts.extend(b.column("content").filter(hit.to_arrow()).chunks)
    found = pl.DataFrame({"k": pl.concat(keys) if keys else want.clear()})
    if not exact:
        found = found.with_columns(check=pl.concat(checks) if checks else pl.Series([], dtype=pl.UInt64))
    # a hash written twice (two sessions racing to store the same content) has one text: the first
    index = found.with_row_index("at").unique("k", keep="first", maintain_order=False)
    probes = pl.DataFrame({"k": want})
    if not exact:
        probes = probes.with_columns(check_probe=strings.hash(seed=_CHECK_SEED))
    joined = probes.join(index, on="k", how="left", maintain_order="left")
    if not exact and (joined["check"] != joined["check_probe"]).any():  # two hashes share a key
        return resolve(store, snap, strings, where, exact=True, since=since, scanned=scanned)
    if remember:
        store.note_addresses(snap.commit, since, seen, addrs)
    at = joined["at"].to_arrow()
    at = pc.if_else(strings.is_not_null().to_arrow(), at.cast(pa.int32()), pa.scalar(None, pa.int32()))
    big = sum(t.nbytes for t in texts) >= (1 << 31) - 1  # 32-bit offsets while they fit (the layouts' type)
    kind = pa.large_binary() if big else pa.binary()
    values = pa.concat_arrays([t.cast(kind) for t in texts]) if texts else pa.array([], pa.binary())
    return at, values


def _windows(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.Table]:
    """``batches`` gathered into tables of about ``TEXT_BATCH_BYTES`` (the last one smaller)."""
    return gathered(batches, TEXT_BATCH_BYTES, lambda b: b.nbytes)
