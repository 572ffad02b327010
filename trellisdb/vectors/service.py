"""The vectors service: embedding spaces, their embedders, index upkeep, and the searches
retrieval runs, behind one object per open database.

It writes through the ``Committer`` (``add_vectors``, ``embed``), reads through a
``Snapshot`` (``search``, ``keywords``, ``describe``), and keeps the indexes: a commit that
wrote vectors pokes the ``IndexMaintainer`` (``after_commit``), which builds on its own
thread. Indexes are created by writers and by the maintainer only, never inside a read:
a store made before the full-text indexes existed gets them when a writable handle opens it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from trellisdb.batch import Batch
from trellisdb.errors import (
    EmbedderError,
    EmbeddingDimensionError,
    QueryError,
    UnknownNodeError,
    UnknownSpaceError,
    ValidationError,
)
from trellisdb.names import check_name
from trellisdb.progress import Progress, counted
from trellisdb.schema import table_schema
from trellisdb.storage.spaces import BUILTIN, TARGETS, TEXT_COLUMN, Space, as_matrix, check_space_name, space_schema
from trellisdb.vectors.index import IndexMaintainer, IndexState
from trellisdb.vectors.search import (
    SearchStats,
    keyword_search,
    merge_exact,
    nprobes_for,
    search,
    text_index,
    vector_index,
    visibility,
)

if TYPE_CHECKING:
    from trellisdb.committer import Committer
    from trellisdb.embed import Embedder
    from trellisdb.snapshot import Reads, Snapshot
    from trellisdb.store import Store


class Vectors:
    """Spaces, embedders, search and index upkeep of one open store."""

    def __init__(self, store: Store, reads: Reads, committer: Committer, *, auto_index: bool = True) -> None:
        self._store = store
        self._reads = reads
        self._committer = committer
        self.auto_index = auto_index
        self._embedders: dict[tuple[str, str], Embedder] = {}
        self.indexer = IndexMaintainer(lambda t: store.tables.dataset(t), dict(TEXT_COLUMN), store.lock.held)
        if not store.read_only:
            self._text_indexes()

    def _text_indexes(self) -> None:
        """Give the full-text columns their (inverted) index if the store was made without one."""
        tables = self._store.tables
        missing = [t for t, col in TEXT_COLUMN.items() if text_index(tables.dataset(t), col) is None]
        if not missing:
            return
        with self._store.lock.held():
            for t in missing:
                ds = tables.dataset(t)
                if text_index(ds, TEXT_COLUMN[t]) is None:
                    ds.create_scalar_index(TEXT_COLUMN[t], index_type="INVERTED")

    # ------------------------------------------------------------ commit hooks
    def indexing(self) -> set[str]:
        """Tables an index build is running on (their compaction waits)."""
        return self.indexer.building()

    def after_commit(self, data: Mapping[str, pa.Table]) -> None:
        """Start index upkeep for the spaces a commit added vectors to."""
        if not self.auto_index:
            return
        for sp in self._store.spaces.all():
            t = data.get(sp.table)
            if t is None or not t.num_rows:
                continue
            if sp.builtin and t.column(sp.column).null_count == t.num_rows:
                continue
            self.indexer.poke(sp)

    # ------------------------------------------------------------------ spaces
    def create_space(
        self,
        name: str,
        *,
        target: str = "nodes",
        dim: int | None = None,
        embedder: Embedder | None = None,
        model: str | None = None,
        text: str | None = None,
    ) -> dict[str, Any]:
        """Create embedding space ``name`` (see :meth:`Database.create_space`)."""
        self._store.writable("create_space")
        check_space_name(name)
        if target not in TARGETS:
            raise UnknownSpaceError(f"target {target!r} has no embedding spaces; use 'nodes' or 'tasks'")
        if name == BUILTIN:
            raise ValidationError(f"{BUILTIN!r} is the built-in space (the embedding column); choose another name")
        if embedder is not None:
            dim = dim or int(embedder.dim)
            model = model or str(embedder.name)
            if dim != embedder.dim:
                raise ValidationError(f"dim={dim} disagrees with embedder {embedder.name!r} (dim {embedder.dim})")
        if isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= 65_536:
            raise ValidationError(f"space {name!r} needs dim= (a whole number 1..65536) or an embedder=, got {dim!r}")
        columns = [f.name for f in table_schema(target, 1) if f.name != "embedding"]
        if text is not None and text not in columns:
            raise ValidationError(f"text={text!r} is not a column of {target}; columns: {columns}")
        sp = Space(name, target, dim, model, text)
        with self._store.lock.held():
            old = self._store.spaces.get(target, name)
            if old is not None:
                if (old.dim, old.model) != (sp.dim, sp.model or old.model):
                    raise ValidationError(
                        f"space {name!r} of {target} exists with dim {old.dim} and model {old.model!r}; "
                        "a new model or dimension needs a new space name"
                    )
                sp = old
            else:
                import lance

                sch = space_schema(dim)
                uri = self._store.tables.uri(sp.table)  # a table left by an interrupted create_space is replaced
                lance.write_dataset(sch.empty_table(), uri, schema=sch, mode="overwrite" if os.path.exists(uri) else "create")
                self._store.spaces.add(sp)
        if embedder is not None:
            self._embedders[(target, name)] = embedder
        return sp.describe()

    def spaces(self) -> list[dict[str, Any]]:
        return [s.describe() for s in self._store.spaces.all()]

    def set_embedder(self, space: str, embedder: Embedder, *, target: str = "nodes") -> None:
        sp = self._reads.space(space, target)
        if embedder.dim != sp.dim:
            raise EmbeddingDimensionError(f"embedder {embedder.name!r} has dim {embedder.dim}; space {space!r} has {sp.dim}")
        self._embedders[(target, space)] = embedder

    def embedder(self, sp: Space) -> Embedder:
        """The embedder of ``sp`` in this process (MiniLM spaces get one on first use)."""
        emb = self._embedders.get((sp.target, sp.name))
        if emb is None:
            from trellisdb.embed import MiniLM

            if sp.model != MiniLM.name:
                raise EmbedderError(
                    f"space {sp.name!r} ({sp.model or 'vectors supplied by the caller'}) has no embedder in this "
                    f"process: pass a vector ($v) instead of a text, or call db.set_embedder({sp.name!r}, ...)"
                )
            emb = self._embedders[(sp.target, sp.name)] = MiniLM()
        return emb

    # ------------------------------------------------------------------ writes
    def add_vectors(self, space: str, ids: Sequence[str], vectors: Any, *, target: str = "nodes") -> None:
        """Stage vectors for existing ids (see :meth:`Database.add_vectors`)."""
        self._store.writable("add_vectors")
        sp = self._reads.space(space, target)
        if sp.builtin:
            raise ValidationError("the built-in space 'embedding' is written with add_node(embedding=...)")
        if isinstance(ids, str):
            raise ValidationError(f"ids must be a list of ids, got the string {ids!r}")
        ids = [check_name(i, "id") or "" for i in ids]
        mat = as_matrix(vectors, sp.dim, f"vectors for space {space!r}")
        if mat.shape[0] != len(ids):
            raise ValidationError(f"{len(ids)} ids but {mat.shape[0]} vectors for space {space!r}")
        if len(set(ids)) != len(ids):
            raise ValidationError(f"ids repeat in one add_vectors call to space {space!r}")
        c = self._committer
        if target == "nodes":
            missing = c.missing_nodes(ids)
        else:
            tasks = self._reads.names("tasks", "id")
            missing = [i for i in ids if i not in tasks and not c.pending_task(i)]
        if missing:
            raise (UnknownNodeError if target == "nodes" else ValidationError)(
                f"{target[:-1]} {missing[0]!r} does not exist ({len(missing)} of {len(ids)} ids are unknown); "
                f"add the {target[:-1]} before its vector"
            )
        with c.sink() as b:
            b.vectors.setdefault(sp.table, []).append((ids, mat))

    def embed(self, space: str, *, target: str = "nodes", batch_size: int = 256, progress: Progress = None) -> int:
        """Compute the missing vectors of ``space`` (see :meth:`Database.embed`): ``batch_size``
        texts per commit, a bar over the texts (``progress`` as :mod:`trellisdb.progress` reads
        it), or ``progress(done, total)`` called after each commit."""
        self._store.writable("embed")
        sp = self._reads.space(space, target)
        if sp.builtin:
            raise ValidationError("the built-in space holds supplied vectors; create a space with an embedder to embed")
        emb = self.embedder(sp)
        c = self._committer
        c.flush()
        c.checkpoint()  # the space's table is read from Lance below
        from trellisdb.embed import check_vectors

        have = self._store.tables.dataset(sp.table).to_table(columns=["id"])
        col = sp.text or TEXT_COLUMN[target]
        todo = self._reads.at().execute(
            f'SELECT id, "{col}" AS t FROM {target} WHERE "{col}" IS NOT NULL AND id NOT IN (SELECT id FROM __have) '
            "ORDER BY id", relations={"__have": have}, tables=(target,))
        ids, texts = todo["id"].to_pylist(), todo["t"].to_pylist()
        report, done = counted(f"embed {space}", progress, " texts", len(ids))
        try:
            for lo in range(0, len(ids), batch_size):
                chunk = texts[lo : lo + batch_size]
                vecs = check_vectors(emb, chunk, emb.embed(chunk))
                b = Batch()
                b.vectors[sp.table] = [(ids[lo : lo + batch_size], vecs)]
                c.commit(b, message=f"embed {target} into space {space}")
                if report is not None:
                    report(min(lo + batch_size, len(ids)), len(ids))
        finally:
            done()
        return len(ids)

    # ------------------------------------------------------------------ search
    def query_vector(self, sp: Space, text: str) -> np.ndarray:
        """The vector of a query text, by the space's embedder."""
        vec: np.ndarray = np.asarray(self.embedder(sp).embed([text]), np.float32)[0]
        return vec

    def search(self, snap: Snapshot, sp: Space, query: np.ndarray, k: int, candidates: pa.Array | None,
               stats: SearchStats) -> pa.Table:
        """The ``k`` nearest visible vectors of ``sp`` to ``query`` as of ``snap`` (among ``candidates``):
        Lance's rows (through the index), and the rows still in the WAL searched exactly next to
        them, so a search right after a commit costs no checkpoint."""
        ds = snap.dataset(sp.table, settle=False)
        wal = snap.wal_rows(sp.table, ds.schema)
        hits = search(ds, sp, query, k, self.visibility(snap), candidates, stats)
        hits = merge_exact(hits, wal, sp.column, query, k, candidates)
        if hits.num_rows == 0 and candidates is None:
            self._check_not_empty(snap, sp)
        return hits
    def keywords(self, snap: Snapshot, entity: str, text: str, k: int, candidates: pa.Array | None,
                 stats: SearchStats) -> pa.Table:
        """The ``k`` best BM25 matches of ``text`` in ``entity``'s text column as of ``snap``."""
        col = TEXT_COLUMN[entity]
        ds = snap.dataset(entity)
        if text_index(ds, col) is None:
            raise QueryError(
                f"{entity}.{col} has no full-text index (a store made before they existed); open the database "
                "once without read_only to create it"
            )
        return keyword_search(ds, col, text, k, self.visibility(snap), candidates, stats)

    def visibility(self, snap: Snapshot) -> str | None:
        """The Lance filter that hides rows not visible in ``snap``. Called after the dataset is
        opened: the log read now names every commit begun before (writers log ``begin`` before
        they append), so no row the dataset holds escapes the filter. Rows of commits still in the
        WAL are read from it, not from Lance (a checkpoint may be half-way)."""
        return visibility(min(snap.commit, snap.lance_upto), snap.aborted(), self._reads.state().max_id)

    def _check_not_empty(self, snap: Snapshot, sp: Space) -> None:
        ds = snap.dataset(sp.table, settle=False)
        flt = " AND ".join(f"({p})" for p in (self.visibility(snap), f"{sp.column} IS NOT NULL") if p)
        wal = snap.wal_rows(sp.table, ds.schema)
        if ds.count_rows(filter=flt) == 0 and wal.column(sp.column).null_count == wal.num_rows:
            from trellisdb.errors import EmptySpaceError

            how = ("add_node(embedding=...)" if sp.builtin else
                   f"db.add_vectors({sp.name!r}, ...) or db.embed({sp.name!r})")
            raise EmptySpaceError(
                f"space {sp.name!r} of {sp.target} holds no vectors as of commit {snap.commit}; add some first ({how})"
            )

    def describe(self, snap: Snapshot, sp: Space) -> str:
        """How ``sp`` is searched now: exact, or its index and the exact scan of the rest."""
        idx = vector_index(snap.dataset(sp.table, settle=False), sp.column)
        how = "exact flat scan (no index yet)"
        if idx is not None:
            st = self.indexer.observe(sp)
            how = (f"index {idx.get('type')} over {st.indexed_rows} of {st.rows} rows (nprobes "
                   f"{nprobes_for(st.partitions or 1)}) + exact scan of the rest")
        return (f"space {sp.name!r} of {sp.target}: {sp.dim}-d, model {sp.model or 'caller-supplied'}, "
                f"table {sp.table}.{sp.column}, cosine distance; {how}")

    # ------------------------------------------------------------------ indexes
    def index_status(self) -> list[dict[str, Any]]:
        return [self.indexer.observe(sp).as_dict() for sp in self._store.spaces.all()]

    def build_index(self, space: str = "embedding", *, target: str = "nodes", wait: bool = True) -> dict[str, Any]:
        self._store.writable("build_index")
        sp = self._reads.space(space, target)
        self._committer.flush()
        self._committer.checkpoint()  # the index is built over Lance's rows
        self.indexer.poke(sp, force="create")
        if wait:
            self.indexer.wait()
        state: IndexState = self.indexer.observe(sp)
        return state.as_dict()

    def close(self) -> None:
        self.indexer.closed = True  # a build in progress finishes (or is abandoned at exit: Lance commits atomically)
