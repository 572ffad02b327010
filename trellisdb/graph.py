"""The lineage graph in memory, for RETRIEVE's EXPAND: edges as compressed adjacency arrays.

A walk of a few hops from a few seeds touches a few hundred edges, yet in
SQL each hop is a statement (~1-5 ms here, whatever its size) and a join
over the whole edge table. :class:`Adjacency` keeps the committed edges as
numpy arrays instead -- node ids replaced by integer codes, and per
direction the edges sorted by their near end (a CSR keyed by the codes
that have edges) -- so a hop is a few vectorized gathers: microseconds.

It is built once, on the first walk, from the engine's ``edges_history``
view (every visible version; an edge's key is ``(src, dst, kind)``, so a
re-written edge adds nothing to reachability), and then extended by the
rows of the commits since: those go to a small *delta* CSR, merged into the
base when it holds an eighth of the base's edges. Each edge keeps its
``commit_id``, so one adjacency serves every ``AS OF`` snapshot it covers.
Rows of aborted commits are never visible, so never enter it.

Memory: about 100 bytes per edge plus the sorted node ids (their bytes and
an offset); built lazily, so a store that never expands pays nothing.

    >>> import pyarrow as pa
    >>> e = pa.table({"src": ["a", "a", "b"], "dst": ["b", "c", "d"],
    ...               "kind": ["derived_from"] * 3, "commit_id": [1, 1, 2]})
    >>> adj = Adjacency.build(e, upto=2)
    >>> w = adj.walk(pa.array(["d"]), [("ancestor", [False, False], [True, True])], ("derived_from",), snapshot=2)
    >>> sorted(zip(w["id"].to_pylist(), w["hop"].to_pylist()))
    [('a', 2), ('b', 1)]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from trellisdb.errors import CorruptionError
from trellisdb.schema import EDGE_KINDS

WALK_SCHEMA = pa.schema([("id", pa.string()), ("seed", pa.string()), ("hop", pa.int64()), ("relation", pa.string())])
EMPTY_WALK = WALK_SCHEMA.empty_table()
FOUND_SCHEMA = pa.schema(
    [("id", pa.string()), ("relation", pa.string()), ("seed", pa.string()), ("seed_rank", pa.int64()),
     ("hop", pa.int64()), ("distance", pa.float64()), ("score", pa.float64())]
)
EMPTY_FOUND = FOUND_SCHEMA.empty_table()
#: The delta is merged into the base once it holds this share of the base's edges (and at least MERGE_MIN).
MERGE_SHARE = 8
MERGE_MIN = 4096
_KINDS = pa.array(EDGE_KINDS)

#: One direction of a walk: (relation name, per level: forward? (src -> dst), per level: emit its rows?)
WalkSpec = tuple[str, list[bool], list[bool]]


@dataclass(frozen=True)
class _Csr:
    """Edges sorted by their near end: ``far[ptr[i]:ptr[i + 1]]`` are the neighbours of code ``keys[i]``."""

    keys: np.ndarray
    ptr: np.ndarray
    far: np.ndarray
    kind: np.ndarray
    commit: np.ndarray

    @classmethod
    def build(cls, near: np.ndarray, far: np.ndarray, kind: np.ndarray, commit: np.ndarray) -> _Csr:
        order = np.argsort(near, kind="stable")
        near = near[order]
        keys, starts = np.unique(near, return_index=True)
        ptr = np.append(starts, len(near)).astype(np.int64)
        return cls(keys, ptr, far[order], kind[order], commit[order])

    def step(self, nodes: np.ndarray, kinds: np.ndarray, snapshot: int) -> tuple[np.ndarray, np.ndarray]:
        """For the frontier ``nodes``: (index into ``nodes``, neighbour code) of every edge
        of an allowed kind (``kinds``: a mask over kind codes) committed at or before ``snapshot``."""
        if not len(self.keys) or not len(nodes):
            return np.empty(0, np.int64), np.empty(0, np.int64)
        pos = np.searchsorted(self.keys, nodes)
        pos = np.minimum(pos, len(self.keys) - 1)
        hit = np.nonzero(self.keys[pos] == nodes)[0]
        starts = self.ptr[pos[hit]]
        counts = self.ptr[pos[hit] + 1] - starts
        total = int(counts.sum())
        if not total:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        first = np.cumsum(counts) - counts
        edge = np.repeat(starts - first, counts) + np.arange(total)
        ok = kinds[self.kind[edge]] & (self.commit[edge] <= snapshot)
        return np.repeat(hit, counts)[ok], self.far[edge[ok]]


@dataclass(frozen=True)
class _Edges:
    """Edge arrays in code space (unsorted), and their two CSRs."""

    src: np.ndarray
    dst: np.ndarray
    kind: np.ndarray
    commit: np.ndarray
    fwd: _Csr
    rev: _Csr

    @classmethod
    def of(cls, src: np.ndarray, dst: np.ndarray, kind: np.ndarray, commit: np.ndarray) -> _Edges:
        return cls(src, dst, kind, commit, _Csr.build(src, dst, kind, commit), _Csr.build(dst, src, kind, commit))

    @classmethod
    def empty(cls) -> _Edges:
        z = np.empty(0, np.int64)
        return cls.of(z, z, np.empty(0, np.int8), z)

    def __len__(self) -> int:
        return len(self.src)

    def plus(self, other: _Edges) -> _Edges:
        return _Edges.of(*(np.concatenate([getattr(self, c), getattr(other, c)]) for c in ("src", "dst", "kind", "commit")))


class Adjacency:
    """The committed edges up to commit ``upto``, for breadth-first walks. Immutable:
    :meth:`extended` returns a new one (readers keep walking the one they hold).

    Node codes: the base's node ids sorted (code = position, found by binary
    search in a polars Series, no per-id Python objects), then ids first seen
    in the delta, numbered on from there (a small dict). A merge re-numbers
    both into one sorted run, by insertion positions (vectorized)."""

    def __init__(
        self, ids: pl.Series, fresh: dict[str, int], base: _Edges, delta: _Edges, upto: int,
        names: pa.Array | None = None,
    ) -> None:
        self._sorted = ids  # base node ids, sorted: code -> id for codes below len(ids)
        self._fresh = fresh  # ids new since the base -> their codes (len(ids), len(ids) + 1, ...)
        self._base = base
        self._delta = delta
        self.upto = upto
        #: the sorted ids as Arrow (made once per base, handed on by ``extended``) and the fresh ones
        self._names = ids.to_arrow().cast(pa.string()) if names is None else names
        self._fresh_names = pa.array(list(fresh), pa.string())

    def _id_of(self, codes: np.ndarray) -> pa.Array:
        """The node id of each code."""
        nb = len(self._names)
        if not len(codes) or codes.max() < nb:
            return self._names.take(pa.array(codes, pa.int64()))
        old = codes < nb
        both = pa.concat_arrays([self._names.take(pa.array(codes[old])), self._fresh_names.take(pa.array(codes[~old] - nb))])
        place = np.empty(len(codes), np.int64)
        place[np.nonzero(old)[0]] = np.arange(int(old.sum()))
        place[np.nonzero(~old)[0]] = np.arange(int(old.sum()), len(codes))
        return both.take(pa.array(place))

    @classmethod
    def build(cls, edges: pa.Table, upto: int) -> Adjacency:
        """From rows ``(src, dst, kind, commit_id)``."""
        n = edges.num_rows
        enc = pa.concat_arrays([_arr(edges, "src").cast(pa.string()), _arr(edges, "dst").cast(pa.string())])
        enc = enc.dictionary_encode()
        names = pl.Series(enc.dictionary)
        perm = names.arg_sort().to_numpy().astype(np.int64)  # sorted position -> dictionary index
        rank = np.empty_like(perm)
        rank[perm] = np.arange(len(perm))
        idx = rank[enc.indices.to_numpy(zero_copy_only=False).astype(np.int64)] if n else np.empty(0, np.int64)
        base = _Edges.of(idx[:n], idx[n:], _kind_codes(edges), _commits(edges))
        return cls(names.gather(perm), {}, base, _Edges.empty(), upto)

    def _codes(self, ids: pa.Array) -> np.ndarray:
        """The code of each id (-1: not in the adjacency)."""
        q = pl.Series(ids.cast(pa.string()))
        n = len(self._sorted)
        if n and len(q):
            pos = np.minimum(self._sorted.search_sorted(q).to_numpy().astype(np.int64), n - 1)
            hit = (self._sorted.gather(pos) == q).to_numpy()
            out = np.where(hit, pos, -1)
        else:
            out = np.full(len(q), -1, np.int64)
        if self._fresh:  # a loop over the ids the base lacks, not over the table
            miss = np.nonzero(out < 0)[0]
            for i, s in zip(miss, ids.take(pa.array(miss)).to_pylist(), strict=True):
                out[i] = self._fresh.get(s, -1)
        return out

    def extended(self, edges: pa.Table, upto: int) -> Adjacency:
        """With the rows ``edges`` (those of commits after :attr:`upto`) added, covering ``upto``."""
        if edges.num_rows == 0:
            return Adjacency(self._sorted, self._fresh, self._base, self._delta, upto, self._names)
        n = edges.num_rows
        both = pa.concat_arrays([_arr(edges, "src").cast(pa.string()), _arr(edges, "dst").cast(pa.string())])
        uniq = pc.unique(both)
        codes = self._codes(uniq)
        fresh = dict(self._fresh)  # a copy: the adjacency readers hold does not change
        new = np.nonzero(codes < 0)[0]
        start = len(self._sorted) + len(fresh)
        fresh.update(zip(uniq.take(pa.array(new)).to_pylist(), range(start, start + len(new)), strict=True))
        codes[new] = np.arange(start, start + len(new))
        at = codes[pc.index_in(both, value_set=uniq).to_numpy(zero_copy_only=False).astype(np.int64)]
        delta = self._delta.plus(_Edges.of(at[:n], at[n:], _kind_codes(edges), _commits(edges)))
        if len(delta) < max(MERGE_MIN, len(self._base) // MERGE_SHARE):
            return Adjacency(self._sorted, fresh, self._base, delta, upto, self._names)
        return Adjacency._merged(self._sorted, fresh, self._base.plus(delta), upto)

    @staticmethod
    def _merged(ids: pl.Series, fresh: dict[str, int], edges: _Edges, upto: int) -> Adjacency:
        """One sorted run of codes: each fresh id goes to its insertion position among the
        sorted ``ids``; a base id moves up by the number of fresh ids inserted at or before it."""
        nb, m = len(ids), len(fresh)
        f = pl.Series(list(fresh), dtype=pl.String)  # in code order
        order = f.arg_sort().to_numpy().astype(np.int64)
        fs = f.gather(order)
        at = ids.search_sorted(fs).to_numpy().astype(np.int64) if nb else np.zeros(m, np.int64)
        remap = np.empty(nb + m, np.int64)
        remap[:nb] = np.arange(nb) + np.cumsum(np.bincount(at, minlength=nb + 1))[:nb]
        remap[nb + order] = at + np.arange(m)
        # the merged run: the old base and the sorted fresh ids, placed at their new codes
        place = np.empty(nb + m, np.int64)
        place[np.concatenate([remap[:nb], at + np.arange(m)])] = np.arange(nb + m)
        merged = pl.concat([ids, fs]).gather(place)
        base = _Edges.of(remap[edges.src], remap[edges.dst], edges.kind, edges.commit)
        return Adjacency(merged, {}, base, _Edges.empty(), upto)

    @property
    def edges(self) -> int:
        return len(self._base) + len(self._delta)

    def walk(self, seeds: pa.Array, walks: list[WalkSpec], kinds: tuple[str, ...], snapshot: int) -> pa.Table:
        """Breadth-first from each seed along each walk: ``(id, seed, hop, relation)``, each
        (id, seed) at the fewest hops of that walk. A walk is (relation, per level whether it
        steps forward (src -> dst) or back, per level whether it emits the nodes it reaches);
        a ``sibling`` walk emits at hop 1 and never a seed itself. Only edges of ``kinds``
        committed at or before ``snapshot`` are followed."""
        node, seed, hop, w = self._walk(seeds, walks, kinds, snapshot)
        return pa.table(
            {
                "id": self._id_of(node),
                "seed": seeds.cast(pa.string()).take(pa.array(seed)),
                "hop": pa.array(hop),
                "relation": pa.array([x[0] for x in walks], pa.string()).take(pa.array(w)),
            },
            schema=WALK_SCHEMA,
        )

    def expand(self, seeds: pa.Table, walks: list[WalkSpec], kinds: tuple[str, ...], snapshot: int) -> pa.Table:
        """RETRIEVE's rows before the node columns: the ``seeds`` (``id, rank, distance,
        score``, in rank order) and every node the walks reach, one row per node at its
        nearest seed -- fewest hops, then best seed rank, then relation name -- as
        ``(id, relation, seed, seed_rank, hop, distance, score)``."""
        ids = seeds["id"].combine_chunks().cast(pa.string())
        node, seed, hop, w = self._walk(ids, walks, kinds, snapshot)
        seed_codes = self._codes(ids)
        keep = ~np.isin(node, seed_codes)  # a seed is always its own, at hop 0
        node, seed, hop, w = node[keep], seed[keep], hop[keep], w[keep]
        names = [x[0] for x in walks]
        by_name = np.argsort(np.argsort(names, kind="stable"), kind="stable")  # walk -> rank of its name
        order = np.lexsort((by_name[w], seed, hop, node))
        first = order[np.unique(node[order], return_index=True)[1]]
        node, seed, hop, w = node[first], seed[first], hop[first], w[first]
        return found_rows(seeds, self._id_of(node),
                          pa.array(names, pa.string()).take(pa.array(w)), seed, hop)

    def _walk(
        self, seeds: pa.Array, walks: list[WalkSpec], kinds: tuple[str, ...], snapshot: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(node code, seed index, hop, walk index) of every (node, seed) each walk reaches."""
        k = len(seeds)
        codes = self._codes(seeds)
        seed_of = np.nonzero(codes >= 0)[0].astype(np.int64)  # the seeds that have edges
        start = codes[seed_of]
        out_node, out_seed, out_hop, out_walk = [], [], [], []
        mask = np.isin(np.arange(len(EDGE_KINDS)), [EDGE_KINDS.index(x) for x in kinds])
        for w, (rel, forward, emit) in enumerate(walks if len(start) else []):
            nodes, seed = start, seed_of
            seen = nodes * k + seed
            for level, fwd in enumerate(forward):
                parts = [(e.fwd if fwd else e.rev).step(nodes, mask, snapshot) for e in (self._base, self._delta)]
                at = np.concatenate([p[0] for p in parts])
                key = np.unique(np.concatenate([p[1] for p in parts]) * k + seed[at])
                if rel == "sibling" and emit[level]:
                    key = key[key // k != start[np.searchsorted(seed_of, key % k)]]
                key = key[~np.isin(key, seen)]
                if not len(key):
                    break
                seen = np.concatenate([seen, key])
                nodes, seed = key // k, key % k
                if emit[level]:
                    out_node.append(nodes)
                    out_seed.append(seed)
                    out_hop.append(np.full(len(key), 1 if rel == "sibling" else level + 1, np.int64))
                    out_walk.append(np.full(len(key), w, np.int64))
        if not out_node:
            z = np.empty(0, np.int64)
            return z, z, z, z
        return tuple(np.concatenate(x) for x in (out_node, out_seed, out_hop, out_walk))  # type: ignore[return-value]


def found_rows(seeds: pa.Table, node: pa.Array, relation: pa.Array, seed: np.ndarray, hop: np.ndarray) -> pa.Table:
    """The seeds (``id, rank, distance, score``, in rank order) followed by the reached nodes
    (``node``, ``relation``, index of their ``seed``, ``hop``), as rows of FOUND_SCHEMA."""
    ids = _arr(seeds, "id").cast(pa.string())
    n, m = seeds.num_rows, len(node)
    return pa.table(
        {
            "id": pa.concat_arrays([ids, node.cast(pa.string())]),
            "relation": pa.concat_arrays([pa.array(["seed"] * n, pa.string()), relation.cast(pa.string())]),
            "seed": pa.concat_arrays([ids, ids.take(pa.array(seed, pa.int64()))]),
            "seed_rank": pa.array(np.concatenate([np.arange(1, n + 1), seed + 1]).astype(np.int64)),
            "hop": pa.array(np.concatenate([np.zeros(n, np.int64), hop]).astype(np.int64)),
            "distance": pa.concat_arrays([_arr(seeds, "distance").cast(pa.float64()), pa.nulls(m, pa.float64())]),
            "score": pa.concat_arrays([_arr(seeds, "score").cast(pa.float64()), pa.nulls(m, pa.float64())]),
        },
        schema=FOUND_SCHEMA,
    )


def _arr(t: pa.Table, col: str) -> pa.Array:
    return t.column(col).combine_chunks()


def _commits(edges: pa.Table) -> np.ndarray:
    out: np.ndarray = _arr(edges, "commit_id").to_numpy().astype(np.int64)
    return out


def _kind_codes(edges: pa.Table) -> np.ndarray:
    codes = pc.index_in(_arr(edges, "kind"), value_set=_KINDS)
    if codes.null_count:  # writes validate kinds: only a damaged table holds others
        raise CorruptionError(f"the edges table holds kinds outside {EDGE_KINDS}; run `trellis verify`")
    out: np.ndarray = codes.to_numpy(zero_copy_only=False).astype(np.int8)
    return out
