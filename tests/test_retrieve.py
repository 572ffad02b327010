"""RETRIEVE: vector / keyword seeds, prefilters, AS OF, expansion, the ANN index, errors.

Every expectation is computed independently: exact cosine search in numpy
over the vectors the test wrote, lineage in networkx.
"""

from __future__ import annotations

from pathlib import Path

import networkx as nx
import numpy as np
import pyarrow as pa
import pytest

import trellisdb
from trellisdb.errors import EmbedderError, EmptySpaceError, UnknownSpaceError
from trellisdb.vectors import index as vector_index
from trellisdb.vectors import search as vector_search


def clustered(n: int, dim: int, clusters: int, seed: int = 0, noise: float = 0.35) -> np.ndarray:
    rng = np.random.default_rng(seed)
    cent = rng.standard_normal((clusters, dim)).astype(np.float32)
    x = cent[rng.integers(0, clusters, n)] + noise * rng.standard_normal((n, dim)).astype(np.float32)
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def exact_top(x: np.ndarray, ids: list[str], q: np.ndarray, k: int, allowed: np.ndarray | None = None) -> list[str]:
    sims = (x @ q) / (np.linalg.norm(x, axis=1) * np.linalg.norm(q))
    if allowed is not None:
        sims = np.where(allowed, sims, -np.inf)
    order = np.argsort(-sims, kind="stable")[:k]
    return [ids[i] for i in order if np.isfinite(sims[i])]


def ingest_nodes(db: trellisdb.Database, x: np.ndarray | None, n: int, sessions: int = 2, prefix: str = "n") -> list[str]:
    """n nodes round-robin over ``sessions`` sessions, a chain per session; vectors ``x`` in the built-in space."""
    sids = []
    for i in range(sessions):
        with db.session(task="t", agent="a", id=f"{prefix}s{i}"):
            pass
        sids.append(f"{prefix}s{i}")
    ids = [f"{prefix}{i}" for i in range(n)]
    cols: dict[str, pa.Array] = {
        "id": pa.array(ids),
        "session_id": pa.array([sids[i % sessions] for i in range(n)]),
        "task_id": pa.array(["t"] * n),
        "kind": pa.array(["attempt" if i % 3 else "step" for i in range(n)]),
        "summary": pa.array([f"attempt {i} {'greedy' if i % 7 == 0 else 'random'} placement" for i in range(n)]),
        "step": pa.array(np.arange(n, dtype=np.int64)),
    }
    if x is not None:
        cols["embedding"] = pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), x.shape[1])
    edges = pa.table({"src": pa.array(ids[:-sessions]), "dst": pa.array(ids[sessions:]),
                      "kind": pa.array(["derived_from"] * (n - sessions))})
    rewards = pa.table({"node_id": pa.array(ids), "channel": pa.array(["score"] * n),
                        "value": pa.array(np.linspace(0, 1, n))})
    db.ingest({"nodes": pa.table(cols), "edges": edges, "rewards": rewards})
    return ids


@pytest.fixture
def small(tmp_path: Path):  # type: ignore[no-untyped-def]
    x = clustered(1500, 16, 12)
    db = trellisdb.connect(tmp_path / "db", embedding_dim=16)
    ids = ingest_nodes(db, x, len(x))
    yield db, x, ids
    db.close()


def seeds(r: trellisdb.QueryResult) -> list[str]:
    return [row["id"] for row in r.to_pylist() if row["relation"] == "seed"]


def test_exact_below_the_index_threshold(small) -> None:  # type: ignore[no-untyped-def]
    db, x, ids = small
    rng = np.random.default_rng(1)
    for _ in range(10):
        q = x[rng.integers(len(x))] + 0.1 * rng.standard_normal(x.shape[1]).astype(np.float32)
        r = db.query("RETRIEVE 10 SIMILAR TO $q", q=q)
        assert seeds(r) == exact_top(x, ids, q, 10)
        rows = r.to_pylist()
        assert [row["seed_rank"] for row in rows] == list(range(1, 11))
        d = np.array([row["distance"] for row in rows])
        assert np.all(np.diff(d) >= -1e-6)
        assert "exact" in (r.search or "")
    assert db.index_status()[0]["state"] == "exact"


def test_prefilters_apply_before_top_k(small, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    db, x, ids = small
    q = x[3]
    session = np.array([i % 2 == 1 for i in range(len(ids))])  # session ns1
    score = np.linspace(0, 1, len(ids))
    kind_step = np.array([i % 3 == 0 for i in range(len(ids))])
    cases = [
        ("session_id != 'ns0'", session),
        ("reward('score') >= 0.8", score >= 0.8),
        ("kind = 'step' AND reward('score') < 0.5", kind_step & (score < 0.5)),
    ]
    for where, allowed in cases:
        want = exact_top(x, ids, q, 10, allowed)
        got = seeds(db.query(f"RETRIEVE 10 SIMILAR TO $q WHERE {where}", q=q))
        assert got == want, where
        # the other path: more candidates than are searched exactly -> search, then filter, fetching more
        monkeypatch.setattr(vector_search, "EXACT_CANDIDATES", 5)
        r = db.query(f"RETRIEVE 10 SIMILAR TO $q WHERE {where}", q=q)
        assert seeds(r) == want, where
        monkeypatch.setattr(vector_search, "EXACT_CANDIDATES", 10_000)
    r = db.query("RETRIEVE 10 SIMILAR TO $q WHERE reward('score') > 2", q=q)
    assert len(r) == 0


def test_as_of_hides_later_vectors(tmp_path: Path) -> None:
    x = clustered(600, 8, 5, seed=3)
    db = trellisdb.connect(tmp_path / "db", embedding_dim=8)
    ids = ingest_nodes(db, x[:300], 300, prefix="a")
    db.tag("before")
    ids2 = ingest_nodes(db, x[300:], 300, prefix="b")
    q = x[450]
    all_ids = ids + ids2
    early = exact_top(x[:300], ids, q, 10)
    assert seeds(db.query("RETRIEVE 10 SIMILAR TO $q AS OF TAG 'before'", q=q)) == early
    assert seeds(db.query("RETRIEVE 10 SIMILAR TO $q", q=q)) == exact_top(x, all_ids, q, 10)
    with pytest.raises(EmptySpaceError, match="no vectors as of commit 0"):
        db.query("RETRIEVE 10 SIMILAR TO $q AS OF COMMIT 0", q=q)
    db.close()


def test_index_recall_and_rows_added_after_the_build(tmp_path: Path) -> None:
    n, dim = 30_000, 32
    x = clustered(n, dim, 60, seed=5)
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    ids = ingest_nodes(db, None, n)
    db.create_space("emb", dim=dim)
    db.add_vectors("emb", ids, x)
    db.flush()
    st = db.build_index("emb")
    assert st["state"] == "indexed" and st["indexed_rows"] == n, st
    rng = np.random.default_rng(7)
    hits = 0
    for _ in range(40):
        q = x[rng.integers(n)] + 0.2 * rng.standard_normal(dim).astype(np.float32)
        r = db.query("RETRIEVE 10 SIMILAR TO $q IN emb", q=q)
        assert "IVF" in (r.search or "")
        hits += len(set(seeds(r)) & set(exact_top(x, ids, q, 10)))
    assert hits / 400 >= 0.95
    # the distances are exact cosine distances (an IVF_SQ index alone reports twice that)
    q = x[11] + 0.3 * rng.standard_normal(dim).astype(np.float32)
    want = np.sort(1 - x @ (q / np.linalg.norm(q)))[:5]
    got = [row["distance"] for row in db.query("RETRIEVE 5 SIMILAR TO $q IN emb", q=q).to_pylist()]
    assert got == pytest.approx(want.tolist(), abs=1e-4)
    # a row committed after the build is found at once (searched exactly next to the index)
    with db.session(task="t", agent="a") as s:
        new = s.add_node(summary="late")
    q = np.random.default_rng(99).standard_normal(dim).astype(np.float32)  # far from every cluster
    db.add_vectors("emb", [new], q[None, :])
    db.flush()
    assert db.index_status()[-1]["indexed_rows"] == n
    assert seeds(db.query("RETRIEVE 1 SIMILAR TO $q IN emb", q=q)) == [new]
    # indexed and unindexed rows rank on one scale
    q = x[3] + 0.3 * rng.standard_normal(dim).astype(np.float32)
    qn = q / np.linalg.norm(q)
    d = 1 - x @ qn / np.linalg.norm(x, axis=1)
    d1, d2 = np.sort(d)[:2]
    target = (d1 + d2) / 2  # between the nearest and the second nearest indexed row
    u = rng.standard_normal(dim).astype(np.float32)
    u -= (u @ qn) * qn
    u /= np.linalg.norm(u)
    late = (1 - target) * qn + np.sqrt(1 - (1 - target) ** 2) * u
    with db.session(task="t", agent="a") as s:
        new2 = s.add_node(summary="late, second nearest")
    db.add_vectors("emb", [new2], late[None, :].astype(np.float32))
    r = db.query("RETRIEVE 3 SIMILAR TO $q IN emb", q=q).to_pylist()
    assert [row["id"] for row in r][:2] == [ids[int(np.argmin(d))], new2]
    assert [row["distance"] for row in r][:2] == pytest.approx([d1, target], abs=1e-4)
    db.close()


def test_index_builds_in_the_background_once_a_space_is_big(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vector_index, "INDEX_MIN_ROWS", 1000)
    monkeypatch.setattr(vector_index, "UPDATE_MIN_ROWS", 200)
    x = clustered(1600, 8, 8, seed=2)
    db = trellisdb.connect(tmp_path / "db", embedding_dim=8)
    ingest_nodes(db, x[:900], 900, prefix="a")
    assert db.index_status()[0]["state"] == "exact"
    ingest_nodes(db, x[900:], 700, prefix="b")  # crosses the threshold: a build starts
    assert db._vectors.indexer.wait(60)
    st = db.index_status()[0]
    assert st["state"] == "indexed" and st["builds"] == 1 and st["indexed_rows"] == 1600, st
    db.close()


def test_a_retrain_commits_while_writers_keep_committing(tmp_path: Path) -> None:
    import threading
    import time

    x = clustered(1500, 8, 8, seed=3)
    db = trellisdb.connect(tmp_path / "db", embedding_dim=8, auto_index=False)
    ingest_nodes(db, x, 1500)
    stop = threading.Event()
    commits = []

    def write() -> None:  # one commit after another into the same table, as a busy agent does
        s = db.session(task="t", agent="w")
        while not stop.is_set():
            with db.transaction():
                s.add_node(summary="w", embedding=-x[len(commits) % 1500])
            commits.append(1)

    def commits_reach(n: int) -> None:  # the writer is busy before each build (a slow machine may lag)
        deadline = time.monotonic() + 60
        while len(commits) < n and time.monotonic() < deadline and th.is_alive():
            time.sleep(0.01)

    th = threading.Thread(target=write)
    th.start()
    try:
        for i in range(2):  # a create, then a retrain over the new rows
            commits_reach(3 * (i + 1))
            st = db.build_index()
            assert st["state"] == "indexed", st
    finally:
        stop.set()
        th.join()
    assert len(commits) > 5 and db.index_status()[0]["builds"] == 2
    assert seeds(db.query("RETRIEVE 3 SIMILAR TO $q", q=x[5]))[0] == "n5"
    db.close()


def test_expansion_on_a_multi_parent_graph(g: trellisdb.Database) -> None:
    # g (conftest): r -> a, b; a, b -> c (crossover); a -> d; b -> e; e inspired_by -> r; x alone
    db = g
    db.create_space("toy", dim=2)
    vec = {"r": [1, 0], "a": [0.9, 0.2], "b": [0, 1], "c": [0.6, 0.8], "d": [-1, 0], "e": [0.1, -1], "x": [0.7, 0.7]}
    db.add_vectors("toy", list(vec), np.array(list(vec.values())))
    db.flush()
    edges = db.sql("SELECT src, dst FROM edges WHERE kind IN ('derived_from', 'crossover_of')").to_pylist()
    G = nx.DiGraph([(e["src"], e["dst"]) for e in edges])
    r = db.query("RETRIEVE 1 SIMILAR TO $q IN toy EXPAND ANCESTORS 2", q=[0.6, 0.8])
    rows = {row["id"]: row for row in r.to_pylist()}
    assert rows["c"]["relation"] == "seed"
    want = nx.single_source_shortest_path_length(G.reverse(), "c", cutoff=2)
    assert {i: row["hop"] for i, row in rows.items()} == want  # both parents a, b at hop 1; r at hop 2
    assert all(row["seed"] == "c" for row in rows.values())
    # two seeds: every node is listed once, at its nearest seed
    r = db.query("RETRIEVE 2 SIMILAR TO $q IN toy WHERE session_id = 's1' EXPAND DESCENDANTS 3, SIBLINGS", q=[1, 0])
    rows = {row["id"]: row for row in r.to_pylist()}
    assert [i for i, row in rows.items() if row["relation"] == "seed"] == ["r", "a"]
    assert len(r) == len(rows)
    assert rows["b"]["relation"] == "descendant" and rows["b"]["seed"] == "r" and rows["b"]["hop"] == 1
    assert rows["d"]["seed"] == "a" and rows["d"]["hop"] == 1
    assert rows["c"]["hop"] == 1 and rows["c"]["seed"] == "a"  # a's child (rank 2) beats r's grandchild
    assert rows["e"]["hop"] == 2
    assert "x" not in rows
    graph = r.to_networkx()
    assert set(graph.nodes) == set(rows)
    assert set(graph.edges) == {(s, d) for s, d in G.edges if s in rows and d in rows}
    sub = r.subgraph()
    assert sub["nodes"].num_rows == len(rows)
    sub_edges = sub["edges"].to_pylist()
    assert {(e["src"], e["dst"]) for e in sub_edges if e["kind"] != "inspired_by"} == set(graph.edges)
    assert {"src": "e", "dst": "r", "kind": "inspired_by"} in sub_edges  # edges() keeps every kind
    # RANK BY reorders the subgraph; RETURN picks columns
    out = db.query("RETRIEVE 2 SIMILAR TO $q IN toy EXPAND LINEAGE 1 RANK BY reward('score') DESC "
                   "RETURN id, relation, reward('score') AS s", q=[1, 0]).to_pylist()
    assert [o["s"] for o in out] == sorted((o["s"] for o in out), reverse=True)


def test_keywords_and_hybrid_fusion(small) -> None:  # type: ignore[no-untyped-def]
    db, x, ids = small
    r = db.query("RETRIEVE 5 MATCHING 'greedy'").to_pylist()
    assert len(r) == 5 and all("greedy" in row["summary"] for row in r)
    assert all(row["distance"] is None for row in r)
    q = x[14]  # node n14 is a 'greedy' one (14 % 7 == 0)
    vec = exact_top(x, ids, q, 30)
    hyb = db.query("RETRIEVE 10 SIMILAR TO $q MATCHING 'greedy'", q=q)
    rows = hyb.to_pylist()
    assert rows[0]["id"] == "n14"  # first in both lists
    # the fused score is the sum of 1/(60 + rank) over the lists a node is in
    kw = [row["id"] for row in db.query("RETRIEVE 40 MATCHING 'greedy'").to_pylist()]
    for row in rows:
        expect = sum(1 / (60 + lst.index(row["id"]) + 1) for lst in (vec, kw) if row["id"] in lst)
        assert row["score"] == pytest.approx(expect, rel=1e-6)
    assert "fusion" in (hyb.search or "")


def test_tasks_space(db: trellisdb.Database) -> None:
    db.add_task("pack", spec="circle packing", embedding=[1, 0, 0, 0])
    db.add_task("sort", spec="sorting network", embedding=[0, 1, 0, 0])
    db.flush()
    out = db.query("RETRIEVE 1 SIMILAR TO $q FROM tasks", q=[0.9, 0.1, 0, 0]).to_pylist()
    assert [o["id"] for o in out] == ["pack"] and out[0]["spec"] == "circle packing"
    assert [o["id"] for o in db.query("RETRIEVE 1 MATCHING 'sorting' FROM tasks").to_pylist()] == ["sort"]


def test_explain_shows_the_vector_step_and_the_duckdb_plan(small) -> None:  # type: ignore[no-untyped-def]
    db, x, _ = small
    text = db.query("EXPLAIN RETRIEVE 3 SIMILAR TO $q WHERE kind = 'step' EXPAND ANCESTORS 2", q=x[0]).to_pylist()[0]
    e = text["explain"]
    assert "VectorSearch 3 nodes" in e and "-- vector step" in e and "prefilter (DuckDB, before top-k)" in e
    assert "FROM __found" in e and "ARROW_SCAN" in e.upper()  # seeds and walk are a relation in DuckDB's plan
    r = db.query("RETRIEVE 3 SIMILAR TO $q EXPAND ANCESTORS 2", q=x[0])
    assert "executed: vector: exact" in r.explain()


def test_errors(small) -> None:  # type: ignore[no-untyped-def]
    db, x, _ = small
    with pytest.raises(trellisdb.QueryNameError, match=r"unknown embedding space 'embeding'.*did you mean 'embedding'"):
        db.query("RETRIEVE 3 SIMILAR TO $q IN embeding", q=x[0])
    with pytest.raises(trellisdb.EmbeddingDimensionError, match="dimension 3, but space 'embedding' of nodes has dimension 16"):
        db.query("RETRIEVE 3 SIMILAR TO $q", q=[1, 2, 3])
    with pytest.raises(EmbedderError, match="no embedder in this process"):
        db.query("RETRIEVE 3 SIMILAR TO 'greedy placement'")
    with pytest.raises(trellisdb.QueryError, match="must be a whole number >= 1"):
        db.query("RETRIEVE 0 SIMILAR TO $q", q=x[0])
    with pytest.raises(trellisdb.QueryError, match="no lineage"):
        db.query("RETRIEVE 3 SIMILAR TO $q FROM tasks EXPAND ANCESTORS 1", q=[0.0] * 16)
    with pytest.raises(trellisdb.QueryNameError, match="unknown column 'distance'"):
        db.query("RETRIEVE 3 SIMILAR TO $q WHERE distance < 0.5", q=x[0])  # the prefilter sees node columns only
    with pytest.raises(trellisdb.QuerySyntaxError):
        db.query("RETRIEVE 3 SIMILAR TO $q SIMILAR TO $q", q=x[0])
    db.create_space("later", dim=4)
    with pytest.raises(EmptySpaceError, match="space 'later' of nodes holds no vectors"):
        db.query("RETRIEVE 3 SIMILAR TO $q IN later", q=[1, 0, 0, 0])
    with pytest.raises(UnknownSpaceError, match="unknown embedding space 'nope'"):
        db.add_vectors("nope", ["n1"], [[1, 0, 0, 0]])
    with pytest.raises(trellisdb.EmbeddingDimensionError):
        db.add_vectors("later", ["n1"], [[1, 0, 0]])
    with pytest.raises(trellisdb.ValidationError, match="NaN"):
        db.add_vectors("later", ["n1"], [[1, 0, float("nan"), 0]])
    with pytest.raises(trellisdb.UnknownNodeError, match="'ghost' does not exist"):
        db.add_vectors("later", ["n1", "ghost"], np.eye(4)[:2])
    with pytest.raises(trellisdb.ValidationError, match="exists with dim 4"):
        db.create_space("later", dim=8)
    assert db.create_space("later", dim=4)["dim"] == 4  # the same again: unchanged
    with pytest.raises(trellisdb.ValidationError, match="space name"):
        db.create_space("Bad-Name", dim=4)
    assert db.verify() == []


def test_text_queries_and_lazy_embedding_with_the_default_embedder(tmp_path: Path) -> None:
    from trellisdb.embed import MiniLM

    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    texts = {"p1": "pack circles greedily into the unit square", "p2": "sort the list with a merge sort",
             "p3": "tune the learning rate of the optimizer", "p4": "place circles on a hexagonal lattice"}
    with db.session(task="t", agent="a") as s:
        for i, t in texts.items():
            s.add_node(id=i, summary=t)
    db.create_space("minilm", embedder=MiniLM())
    done: list[tuple[int, int]] = []
    assert db.embed("minilm", batch_size=3, progress=lambda a, b: done.append((a, b))) == 4
    assert done == [(3, 4), (4, 4)]
    assert db.embed("minilm") == 0  # nothing missing any more
    out = [r["id"] for r in db.query("RETRIEVE 2 SIMILAR TO 'circle packing' IN minilm").to_pylist()]
    assert sorted(out) == ["p1", "p4"]
    db.close()
    db = trellisdb.connect(tmp_path / "db")  # a new process knows the space's model and finds the embedder itself
    assert db.query("RETRIEVE 1 SIMILAR TO 'sorting algorithms' IN minilm").to_pylist()[0]["id"] == "p2"
    db.close()


def test_deep_walks_and_walks_after_later_commits(small) -> None:  # type: ignore[no-untyped-def]
    db, x, ids = small  # two chains: n(i) -> n(i+2)
    q = x[100]
    seed = exact_top(x, ids, q, 1)[0]
    i = int(seed[1:])
    want = {f"n{i - 2 * h}": h for h in range(1, 13) if i - 2 * h >= 0} | {seed: 0}
    got = db.query("RETRIEVE 1 SIMILAR TO $q EXPAND ANCESTORS 12 RETURN id, hop", q=q).to_pylist()
    assert {r["id"]: r["hop"] for r in got} == want
    # the adjacency built by that walk is extended by later commits; the walk reads edges as
    # of the snapshot: an edge committed later is not followed AS OF before it
    before = db.log()[-1]["id"]
    with db.session(task="t", agent="a") as s:
        late = s.add_node(parents=[seed], summary="a later child")
        later = s.add_node(parents=[late], summary="and its child")
    db.flush()
    rq = "RETRIEVE 1 SIMILAR TO $q EXPAND DESCENDANTS 2 RETURN id, hop"
    now = {r["id"]: r["hop"] for r in db.query(rq, q=q).to_pylist()}
    assert now[late] == 1 and now[later] == 2
    assert not {late, later} & {r["id"] for r in db.query(f"{rq} AS OF COMMIT {before}", q=q).to_pylist()}


def test_the_adjacency_follows_commits_and_matches_a_fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trellisdb import graph

    monkeypatch.setattr(graph, "MERGE_MIN", 3)  # the delta is merged into the base every few commits
    monkeypatch.setattr(graph, "MERGE_SHARE", 1)
    x = clustered(200, 16, 4)
    db = trellisdb.connect(tmp_path / "db", embedding_dim=16)
    ids = ingest_nodes(db, x, len(x))
    rq = "RETRIEVE 5 SIMILAR TO $q EXPAND LINEAGE 3, SIBLINGS RETURN id, relation, seed, hop"
    q = x[7]
    db.query(rq, q=q)  # builds the adjacency
    rng = np.random.default_rng(2)
    with db.session(task="t", agent="a") as s:
        for i in range(12):  # a commit per new node, parents anywhere (multi-parent, crossover)
            parents = [ids[j] for j in rng.choice(len(ids), int(rng.integers(1, 3)), replace=False)]
            ids.append(s.add_node(parents=parents, summary=f"late {i}", embedding=x[7] + 0.01 * i))
            db.flush()
            got = db.query(rq, q=q).to_pylist()
    fresh = trellisdb.connect(tmp_path / "db")
    assert fresh.query(rq, q=q).to_pylist() == got
    assert any(not r["id"].startswith("n") for r in got)  # the late nodes are reached
    fresh.close()
    db.close()


def test_an_index_build_whose_files_a_compaction_removed_retries_on_a_fresh_version(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The build opens the dataset, then a compaction (another process's, or this one's
    between the build's open and its read) rewrites the fragments and removes the files that
    version names: the build starts again on the version there now, and nothing is logged as a
    failure. Made deterministic by compacting inside the build's first open."""
    import datetime as dt

    import lance

    x = clustered(600, 8, 6, seed=4)
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4, auto_index=False)
    ids = ingest_nodes(db, None, 600)
    db.create_space("emb", dim=8)
    for lo in range(0, 600, 100):  # six fragments: a compaction has something to merge
        db.add_vectors("emb", ids[lo:lo + 100], x[lo:lo + 100])
        db.flush()
        db._committer.checkpoint()
    uri = str(tmp_path / "db" / "tables" / "vec_nodes_emb.lance")
    assert len(lance.dataset(uri).get_fragments()) == 6
    real = vector_index.IndexMaintainer._open_fresh
    compacted = []

    def open_then_compact(self: vector_index.IndexMaintainer, table: str) -> object:
        ds = real(self, table)
        if table == "vec_nodes_emb" and not compacted:  # the build holds ds; its files go now
            other = lance.dataset(uri)
            other.optimize.compact_files(materialize_deletions=True)
            lance.dataset(uri).cleanup_old_versions(older_than=dt.timedelta(0), delete_unverified=True)
            compacted.append(ds.version)
        return ds

    monkeypatch.setattr(vector_index.IndexMaintainer, "_open_fresh", open_then_compact)
    with caplog.at_level("DEBUG", logger="trellisdb"):
        st = db.build_index("emb")
    assert compacted and len(lance.dataset(uri).get_fragments()) == 1
    assert st["state"] == "indexed" and st["error"] is None and st["indexed_rows"] == 600, st
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.records
    assert any("again" in r.getMessage() for r in caplog.records)  # the retry is logged, below warning
    assert seeds(db.query("RETRIEVE 3 SIMILAR TO $q IN emb", q=x[5]))[0] == ids[5]
    db.close()
