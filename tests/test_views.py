"""Training-data views: each kind against hand-computed rows, refresh == rebuild, exports, errors."""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pajson
import pyarrow.parquet as pq
import pytest

import trellisdb
from trellisdb.training import rows as view_rows
from trellisdb.training import texts
from trellisdb.training.catalog import ViewCatalog
from trellisdb.training.compute import build, compute
from trellisdb.training.spec import ViewSpec
from trellisdb.writer import content_hash

from . import openevolve

SCORES = {"A": 0.9, "B": 0.5, "C": 0.5, "D": 0.1, "E": 0.7, "F": 0.3, "G": 0.3, "X": 1.0, "Y": 0.0}


def arts(name: str, prompt: str = "pack circles") -> dict[str, str]:
    return {"prompt": prompt, "response": f"answer {name}", "system_prompt": "you are a solver"}


@pytest.fixture
def g(tmp_path: Path) -> trellisdb.Database:
    """t1: R -> A B C D; A, B -> E (crossover); D -> F G.  t2: Q -> X Y.  Comparisons: C over B, A ~ D (tie)."""
    db = trellisdb.connect(tmp_path / "db")
    with db.transaction():
        s = db.session(task="t1", agent="a", id="s1")
        s.add_node(id="R", artifacts={"prompt": "pack circles"})
        for n in "ABCD":
            s.add_node(id=n, parents=["R"], artifacts=arts(n))
        s.add_node(id="E", parents=["A", "B"], edge_kind="crossover_of", artifacts=arts("E"))
        for n in "FG":
            s.add_node(id=n, parents=["D"], artifacts=arts(n))
        s2 = db.session(task="t2", agent="a", id="s2")
        s2.add_node(id="Q", artifacts={"prompt": "sort"})
        for n in "XY":
            s2.add_node(id=n, parents=["Q"], artifacts=arts(n, "sort"))
        for n, v in SCORES.items():
            (s2 if n in "XY" else s).add_reward(n, "score", v)
        s.add_comparison("B", "C", preferred="C", margin=1.0, judge="human")
        s.add_comparison("A", "D", preferred=None, judge="human")
    return db


def rows(db: trellisdb.Database, name: str) -> list[dict[str, Any]]:
    return db.view(name).to_pylist()


def _decoded(t: pa.Table, values: list[Any]) -> dict[str, list[Any]]:
    """Per code column of ``t``, each row's texts (``values``: the texts in code order)."""
    def one(c: int | None) -> Any:
        v = None if c is None else values[c]
        return v.decode() if isinstance(v, bytes) else v
    return {c: [[one(x) for x in v] if isinstance(v, list) else one(v) for v in t[c].to_pylist()]
            for c in texts.code_columns(t.column_names)}


def stored_texts(db: trellisdb.Database, name: str) -> dict[str, list[Any]]:
    """The texts a materialized view keeps for its rows, per hash column, in row order."""
    entry = ViewCatalog(db.path).load().entries[name]
    return _decoded(db._views.stored.read(entry, codes=True), db._views.texts.texts_of(entry).to_pylist())


def rebuilt_texts(db: trellisdb.Database, name: str, commit: int) -> dict[str, list[Any]]:
    """The texts a rebuild of view ``name`` at ``commit`` resolves, per hash column, in row order."""
    spec = ViewCatalog(db.path).load().spec(name)
    t, text = build(db._views.texts, db.snapshot(commit), spec)
    return _decoded(t, text["text"].to_pylist())


def test_preference_pairs_siblings_and_comparisons(g: trellisdb.Database) -> None:
    g.create_view("p", "preference", reward="reward('score')")
    assert g.materialize("p")["rows"] == 6
    got = {(r["chosen_id"], r["rejected_id"]): (round(r["margin"], 9), r["source"], r["group_key"]) for r in rows(g, "p")}
    assert got == {
        ("A", "B"): (0.4, "siblings", "R"), ("A", "C"): (0.4, "siblings", "R"),
        ("B", "D"): (0.4, "siblings", "R"), ("C", "D"): (0.4, "siblings", "R"),
        ("X", "Y"): (1.0, "siblings", "Q"),
        ("C", "B"): (1.0, "comparison", None),  # the judge breaks the B/C reward tie; the A/D tie drops (A, D)
    }
    r = next(r for r in rows(g, "p") if r["chosen_id"] == "A" and r["rejected_id"] == "B")
    assert r["node_ids"] == ["A", "B"] and r["task_id"] == "t1" and r["chosen_hash"] != r["rejected_hash"]
    g.create_view("wide", "preference", reward="reward('score')", margin=0.5, pairs_from=["siblings"])
    g.materialize("wide")
    assert {(r["chosen_id"], r["rejected_id"]) for r in rows(g, "wide")} == {("A", "D"), ("X", "Y")}
    g.create_view("byprompt", "preference", reward="reward('score')", group_by="prompt", pairs_from=["siblings"],
                  where="session_id = 's2'")
    g.materialize("byprompt")
    assert [(r["chosen_id"], r["rejected_id"]) for r in rows(g, "byprompt")] == [("X", "Y")]


def test_grpo_groups_and_advantages(g: trellisdb.Database) -> None:
    g.create_view("gr", "grpo", reward="reward('score')")
    g.materialize("gr")
    got = {r["group_key"]: r for r in rows(g, "gr")}
    assert set(got) == {"R", "D", "Q"}  # A's and B's groups hold only E: below min_size 2
    r = got["R"]
    std = math.sqrt((0.4**2 + 0 + 0 + 0.4**2) / 4)
    assert r["node_ids"] == ["A", "B", "C", "D"] and r["size"] == 4
    assert r["mean"] == pytest.approx(0.5) and r["std"] == pytest.approx(std)
    assert r["advantages"] == pytest.approx([0.4 / std, 0.0, 0.0, -0.4 / std])
    assert got["Q"]["advantages"] == pytest.approx([1.0, -1.0])
    assert got["D"]["advantages"] == [0.0, 0.0] and got["D"]["std"] == 0.0  # no variance: kept, advantage 0
    g.create_view("gr2", "grpo", reward="reward('score')", drop_zero_variance=True, min_size=3)
    g.materialize("gr2")
    assert [r["group_key"] for r in rows(g, "gr2")] == ["R"]


def test_grpo_group_prompt_is_the_majority(tmp_path: Path) -> None:
    """A group's prompt is the one most members share (ties: the smallest hash), its system
    the smallest among the members with that prompt; members without a prompt do not vote."""
    db = trellisdb.connect(tmp_path / "db")
    h = {t: content_hash(t.encode()) for t in ("x", "y", "s1", "s2", "s3")}
    tie_lo = min(h["x"], h["y"])
    kids = {"M": [("x", "s2"), ("x", "s1"), ("y", "s3"), (None, "s3")],  # x by 2 to 1
            "T": [("x", "s1"), ("y", "s2")],  # a tie: the smaller hash
            "N": [(None, "s2"), (None, None)]}  # no prompt at all
    with db.transaction():
        s = db.session(task="t", agent="a")
        for parent, members in kids.items():
            s.add_node(id=parent)
            for i, (prompt, system) in enumerate(members):
                a = {k: v for k, v in (("prompt", prompt), ("system_prompt", system)) if v is not None}
                s.add_node(id=f"{parent}{i}", parents=[parent], artifacts=a)
                s.add_reward(f"{parent}{i}", "score", float(i))
    db.create_view("gr", "grpo", reward="reward('score')")
    db.materialize("gr")
    got = {r["group_key"]: (r["prompt_hash"], r["system_hash"], r["size"]) for r in rows(db, "gr")}
    tie_sys = h["s1"] if tie_lo == h["x"] else h["s2"]
    assert got == {"M": (h["x"], min(h["s1"], h["s2"]), 4), "T": (tie_lo, tie_sys, 2), "N": (None, h["s2"], 2)}
    db.create_view("gp", "grpo", reward="reward('score')", group_by="prompt")
    db.materialize("gp")
    got = {r["group_key"]: (r["prompt_hash"], r["system_hash"], r["node_ids"]) for r in rows(db, "gp")}
    assert got == {h["x"]: (h["x"], min(h["s1"], h["s2"]), ["M0", "M1", "T0"]),
                   h["y"]: (h["y"], min(h["s2"], h["s3"]), ["M2", "T1"])}


def test_sft_kto_stepwise(g: trellisdb.Database) -> None:
    g.create_view("s", "sft", reward="reward('score')", threshold=0.7)
    g.materialize("s")
    assert [r["node_id"] for r in rows(g, "s")] == ["A", "E", "X"]
    g.create_view("k", "kto", reward="reward('score')", threshold=0.5)
    g.materialize("k")
    assert {r["node_id"]: r["label"] for r in rows(g, "k")} == {n: v >= 0.5 for n, v in SCORES.items()}
    g.create_view("st", "stepwise", reward="reward('score')", threshold=0.5)
    g.materialize("st")
    got = {r["node_id"]: (r["node_ids"], r["labels"]) for r in rows(g, "st")}
    assert got == {"C": (["C"], [True]), "E": (["A", "E"], [True, True]), "F": (["D", "F"], [False, False]),
                   "G": (["D", "G"], [False, False]), "X": (["X"], [True]), "Y": (["Y"], [False])}


def test_sft_paths_are_multi_turn(g: trellisdb.Database, tmp_path: Path) -> None:
    g.create_view("sp", "sft", reward="reward('score')", threshold=0.7, path=True)
    g.materialize("sp")
    # unscored roots stay on the path; E follows its first parent (A, the smaller id)
    assert {r["node_id"]: r["node_ids"] for r in rows(g, "sp")} == {"A": ["R", "A"], "E": ["R", "A", "E"],
                                                                     "X": ["Q", "X"]}
    g.export("sp", tmp_path / "sp", "trl")
    got = {}
    for line in (tmp_path / "sp" / "train.jsonl").read_text().splitlines():
        m = json.loads(line)["messages"]
        got[m[-1]["content"]] = [(t["role"], t["content"]) for t in m]
    sys_, pc = ("system", "you are a solver"), ("user", "pack circles")
    # R has a prompt and no response: a user turn only
    assert got["answer E"] == [sys_, pc, pc, ("assistant", "answer A"), pc, ("assistant", "answer E")]
    assert got["answer X"] == [sys_, ("user", "sort"), ("user", "sort"), ("assistant", "answer X")]
    with pytest.raises(trellisdb.ValidationError, match="sft option"):
        g.create_view("bad", "preference", reward="reward('score')", path=True)


def test_replay_is_a_deterministic_prioritized_sample(g: trellisdb.Database) -> None:
    g.create_view("r", "replay", reward="reward('score')", size=4, seed=7)
    g.materialize("r")
    first = rows(g, "r")
    assert len(first) == 4 and [r["sample_rank"] for r in first] == [1, 2, 3, 4]
    g.materialize("r")
    assert rows(g, "r") == first  # same seed, same sample
    for r in first:
        assert r["priority"] == pytest.approx(abs(r["advantage"]) + 1e-6)
    # high |advantage| wins far more often than a zero one over many seeds
    counts: dict[str, int] = {}
    for seed in range(40):
        g.create_view("r", "replay", reward="reward('score')", size=2, seed=seed, replace=True)
        g.materialize("r")
        for r in rows(g, "r"):
            counts[r["node_id"]] = counts.get(r["node_id"], 0) + 1
    assert counts.get("A", 0) > counts.get("B", 0) + 5  # A: advantage 1.41; B, C and F, G: 0
    g.create_view("b", "replay", reward="reward('score')", size=3, strategy="bucket", threshold=0.5)
    g.materialize("b")
    assert len(rows(g, "b")) == 3


def grow(db: trellisdb.Database, rng: np.random.Generator, n: int) -> None:
    """Random later writes of every kind a view reads."""
    ids = [r["id"] for r in db.sql("SELECT id FROM nodes ORDER BY id").to_pylist()]
    with db.transaction():
        s = db.resume("s1")
        for _ in range(n):
            op = rng.integers(0, 6)
            if op == 0:  # a new child (sometimes a crossover)
                parents = list(rng.choice(ids, int(rng.integers(1, 3)), replace=False))
                nid = s.add_node(parents=parents, artifacts=arts(str(len(ids)), str(rng.choice(["pack circles", "p2"]))))
                s.add_reward(nid, "score", float(rng.choice([0.1, 0.5, 0.9])))
                ids.append(nid)
            elif op == 1:  # a re-score
                s.add_reward(str(rng.choice(ids)), "score", float(rng.random()))
            elif op == 2:
                a, b = rng.choice(ids, 2, replace=False)
                s.add_comparison(str(a), str(b), preferred=str(rng.choice([a, b])), margin=0.5)
            elif op == 3:
                s.set_status(str(rng.choice(ids)), "expanded")
            elif op == 4:  # a new edge between existing nodes
                a, b = rng.choice(ids, 2, replace=False)
                nid = s.add_node(parents=[str(a), str(b)], artifacts=arts("x"))
                ids.append(nid)
            else:  # a new prompt: the node leaves its prompt group for another
                s.add_artifact(str(rng.choice(ids)), "prompt", str(rng.choice(["pack circles", "p2", "p3"])))


@pytest.mark.parametrize("kind,opts", [
    ("preference", {}), ("preference", {"group_by": "prompt"}), ("grpo", {}), ("grpo", {"group_by": "prompt"}),
    ("sft", {"threshold": 0.5}), ("kto", {"threshold": 0.5}), ("stepwise", {"threshold": 0.5}),
    ("replay", {"size": 5}), ("sft", {"threshold": 0.5, "path": True}),
    ("sft", {"threshold": 0.5, "path": True, "where": "status IS NULL OR status <> 'expanded'"}),
    # status changes deselect nodes: groups shrink, parents become leaves
    ("stepwise", {"threshold": 0.5, "where": "status IS NULL OR status <> 'expanded'"}),
    ("preference", {"where": "status IS NULL OR status <> 'expanded'"}),
    # sibling pairs only (the benchmark's view)
    ("preference", {"pairs_from": ["siblings"]}), ("preference", {"pairs_from": ["siblings"], "group_by": "prompt"}),
])
def test_refresh_equals_rebuild(g: trellisdb.Database, kind: str, opts: dict[str, Any]) -> None:
    g.create_view("v", kind, reward="reward('score')", **opts)
    g.materialize("v")
    rng = np.random.default_rng(zlib.crc32(f"{kind}{opts}".encode()))
    for step in range(3):
        grow(g, rng, 12)
        e = g.refresh("v")
        assert e["commit"] == g.log()[-1]["id"]
        spec = ViewCatalog(g.path).load().spec("v")
        rebuilt = compute(g.snapshot(e["commit"]), spec)
        assert g.view("v").to_arrow().equals(rebuilt), f"refresh {step} ({e['how']}) differs from a rebuild"
        assert stored_texts(g, "v") == rebuilt_texts(g, "v", e["commit"]), f"refresh {step}: texts differ"
        if kind != "replay":
            assert e["how"].startswith("refreshed")


def test_refresh_keeps_the_text_keys_of_the_table_on_disk(g: trellisdb.Database) -> None:
    """Materialize and refresh leave the keys of a view's text table and its rows' provenance
    in memory for the next refresh; after each they are those of the tables as stored, a refresh
    in a process without them gives the same view, and a view made again under the same name
    starts afresh."""
    def kept_is_stored(name: str) -> None:
        entry = ViewCatalog(g.path).load().entries[name]
        kept = g._views.texts.cached(entry)
        assert kept is not None
        disk = texts.Known.of(g._views.texts.hashes(entry))
        assert kept.keys.equals(disk.keys) and kept.checks.equals(disk.checks)
        # and the rows' provenance a refresh reads
        prov = g._views.stored.kept[name]
        assert prov.tag == view_rows.rows_tag(entry)
        cols = view_rows.provenance_columns(ViewSpec.from_dict(entry["spec"]))
        on_disk = g._views.stored.read(entry, cols).sort_by(view_rows.ROW_ID)
        assert prov.table().sort_by(view_rows.ROW_ID).equals(on_disk) and on_disk.num_rows == entry["rows"]

    g.create_view("v", "preference", reward="reward('score')")
    g.materialize("v")
    rng = np.random.default_rng(5)
    for _ in range(3):
        kept_is_stored("v")
        grow(g, rng, 12)
        g.refresh("v")
    kept_is_stored("v")
    grow(g, rng, 12)
    g._views.texts.known.clear()  # as another process would: the keys and rows read from the tables
    g._views.stored.kept.clear()
    e = g.refresh("v")
    kept_is_stored("v")
    spec = ViewCatalog(g.path).load().spec("v")
    assert g.view("v").to_arrow().equals(compute(g.snapshot(e["commit"]), spec))
    assert stored_texts(g, "v") == rebuilt_texts(g, "v", e["commit"])
    g.drop_view("v")
    g.create_view("v", "sft", reward="reward('score')", threshold=0.5)
    g.materialize("v")
    kept_is_stored("v")


def test_a_view_past_the_kept_limit_is_refreshed_from_disk(
    g: trellisdb.Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A view whose provenance holds more node ids than KEPT_NODE_IDS is not kept in memory:
    each refresh reads the stored rows' provenance from Lance, and the view still equals a rebuild."""
    monkeypatch.setattr(view_rows, "KEPT_NODE_IDS", 3)
    g.create_view("v", "preference", reward="reward('score')")
    g.materialize("v")
    assert "v" not in g._views.stored.kept
    rng = np.random.default_rng(3)
    for _ in range(2):
        grow(g, rng, 12)
        e = g.refresh("v")
        assert e["how"].startswith("refreshed") and "v" not in g._views.stored.kept
        spec = ViewCatalog(g.path).load().spec("v")
        assert g.view("v").to_arrow().equals(compute(g.snapshot(e["commit"]), spec))


def test_a_refresh_that_would_replace_rows_not_stored_changes_nothing(g: trellisdb.Database) -> None:
    """Kept provenance that names a row the view does not store (it cannot happen unless
    something is badly wrong) stops the refresh before it writes: a clear error, the view as
    it was, and a materialize recomputes it."""
    g.create_view("v", "grpo", reward="reward('score')")
    g.materialize("v")
    before = g.view("v").to_arrow()
    entry = ViewCatalog(g.path).load().entries["v"]
    kept = g._views.stored.kept["v"]
    t = kept.table()
    ghost = pa.table({"node_ids": pa.array([["A"]], pa.list_(pa.string())), "group_key": ["R"],
                      view_rows.ROW_ID: pa.array([10_000], pa.int64())}).cast(t.schema)
    g._views.stored.kept["v"] = view_rows.Kept(kept.tag, pa.concat_tables([t, ghost]))
    with g.transaction():
        g.resume("s1").add_reward("A", "score", 0.2)
    with pytest.raises(trellisdb.CorruptionError, match=r"run db\.materialize"):
        g.refresh("v")
    assert ViewCatalog(g.path).load().entries["v"] == entry
    assert g.view("v").to_arrow().equals(before)
    g.materialize("v")
    spec = ViewCatalog(g.path).load().spec("v")
    assert g.view("v").to_arrow().equals(compute(g.snapshot(g.log()[-1]["id"]), spec))


def test_a_new_comparison_refreshes_only_views_that_read_comparisons(g: trellisdb.Database) -> None:
    g.create_view("gr", "grpo", reward="reward('score')")
    g.create_view("sib", "preference", reward="reward('score')", pairs_from=["siblings"])
    g.create_view("cmp", "preference", reward="reward('score')")
    for v in ("gr", "sib", "cmp"):
        g.materialize(v)
    with g.transaction():
        g.resume("s1").add_comparison("F", "G", preferred="G", margin=0.5, judge="human")
    assert ("G", "F") not in {(r["chosen_id"], r["rejected_id"]) for r in rows(g, "cmp")}
    for v, how in (("gr", "unchanged"), ("sib", "unchanged"), ("cmp", "refreshed")):
        e = g.refresh(v)
        assert e["how"].startswith(how), (v, e["how"])
        spec = ViewCatalog(g.path).load().spec(v)
        assert g.view(v).to_arrow().equals(compute(g.snapshot(e["commit"]), spec))
    assert ("G", "F") in {(r["chosen_id"], r["rejected_id"]) for r in rows(g, "cmp")}


@pytest.mark.parametrize("by_address", [True, False])
def test_refresh_replaces_rows_with_or_without_lances_delete_by_address(
    g: trellisdb.Database, monkeypatch: pytest.MonkeyPatch, by_address: bool
) -> None:
    """A refresh deletes the rows it replaces by address and appends the new ones in one
    commit; a Lance without the (internal) delete by address gets a predicate delete and an
    append. Either way the rows equal a rebuild, in as many versions as expected."""
    import lance
    import lance.fragment

    if not by_address:
        monkeypatch.delattr(lance.fragment.LanceFragment, "delete_rows")
    g.create_view("v", "preference", reward="reward('score')")
    g.materialize("v")
    rng = np.random.default_rng(11)
    for _ in range(2):
        before = ViewCatalog(g.path).load().entries["v"]["version"]
        grow(g, rng, 12)
        e = g.refresh("v")
        assert "rows replaced" in e["how"] and e["version"] == before + (1 if by_address else 2)
        spec = ViewCatalog(g.path).load().spec("v")
        assert g.view("v").to_arrow().equals(compute(g.snapshot(e["commit"]), spec))
        assert lance.dataset(g._views.stored.uri("v"), version=e["version"]).count_rows() == e["rows"]


def test_refresh_when_a_node_leaves_its_group(g: trellisdb.Database) -> None:
    """A re-set prompt moves A to a group no other changed node is in: the group A left is
    known only from the stored rows, and its row is recomputed without A."""
    g.create_view("v", "grpo", reward="reward('score')", group_by="prompt")
    g.materialize("v")
    old = {len(r["node_ids"]) for r in rows(g, "v") if "A" in r["node_ids"]}
    with g.transaction():
        g.resume("s1").add_artifact("A", "prompt", "a prompt nobody else has")
    e = g.refresh("v")
    assert e["how"].startswith("refreshed")
    spec = ViewCatalog(g.path).load().spec("v")
    assert g.view("v").to_arrow().equals(compute(g.snapshot(e["commit"]), spec))
    left = [r for r in rows(g, "v") if "B" in r["node_ids"]]
    assert old and len(left) == 1 and "A" not in left[0]["node_ids"] and len(left[0]["node_ids"]) == old.pop() - 1


def test_many_refreshes_keep_the_view_compact(g: trellisdb.Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each refresh appends a fragment; past VIEW_FRAGMENTS they are merged (deleted rows
    dropped), and the rows and their texts still equal a rebuild, pinned to a version that
    can be read."""
    import lance

    monkeypatch.setattr(view_rows, "VIEW_FRAGMENTS", 1)
    g.create_view("v", "preference", reward="reward('score')")
    g.materialize("v")
    rng = np.random.default_rng(7)
    for _ in range(6):
        grow(g, rng, 4)
        e = g.refresh("v")
        assert e["how"].startswith("refreshed")
        ds = lance.dataset(os.path.join(g.path, e["file"]), version=e["version"])
        assert len(ds.get_fragments()) == 1  # merged whenever a refresh took it past 1
        assert ds.count_rows() == e["rows"]
    spec = ViewCatalog(g.path).load().spec("v")
    assert g.view("v").to_arrow().equals(compute(g.snapshot(e["commit"]), spec))
    # the text table, rewritten in order whenever it passed 1 fragment, still matches the codes
    assert len(lance.dataset(g._views.texts.path("v"), version=e["texts_version"]).get_fragments()) == 1
    assert stored_texts(g, "v") == rebuilt_texts(g, "v", e["commit"])
    again = trellisdb.connect(g.path)
    assert again.view("v").to_arrow().num_rows == e["rows"]
    again.close()


def test_a_view_stored_in_the_older_file_format_refreshes_and_rebuilds(
    g: trellisdb.Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores made before views used Lance format 2.0 hold 2.2 files: a refresh appends in the
    dataset's own format, a materialization rewrites it in the current one."""
    import lance

    monkeypatch.setattr(view_rows, "VIEW_FORMAT", "2.2")
    g.create_view("v", "grpo", reward="reward('score')")
    g.materialize("v")
    monkeypatch.setattr(view_rows, "VIEW_FORMAT", "2.0")
    grow(g, np.random.default_rng(3), 6)
    e = g.refresh("v")
    spec = ViewCatalog(g.path).load().spec("v")
    assert g.view("v").to_arrow().equals(compute(g.snapshot(e["commit"]), spec))
    uri = os.path.join(g.path, e["file"])
    assert lance.dataset(uri).data_storage_version == "2.2"
    e = g.materialize("v")
    assert lance.dataset(uri).data_storage_version == "2.0"
    assert g.view("v").to_arrow().equals(compute(g.snapshot(e["commit"]), spec))


def test_views_are_listed_and_pinned(g: trellisdb.Database) -> None:
    g.create_view("p", "preference", reward="reward('score')", where="kind IS NULL OR kind <> 'x'")
    c = g.materialize("p")["commit"]
    with g.session(task="t1", agent="a") as s:
        s.add_node(id="Z", parents=["R"], artifacts=arts("Z"))
        s.add_reward("Z", "score", 0.95)
    (v,) = g.views()
    assert v["name"] == "p" and v["commit"] == c and v["rows"] == 6 and "where=" in v["definition"]
    assert g.refresh("p")["rows"] > 6
    old = g.materialize("p", as_of=c)
    assert old["commit"] == c and old["rows"] == 6  # pinned: the same commit gives the same rows
    again = trellisdb.connect(g.path)  # the catalog is on disk
    assert again.views()[0]["commit"] == c
    again.close()
    g.drop_view("p")
    assert g.views() == []


def test_view_errors(g: trellisdb.Database) -> None:
    with pytest.raises(trellisdb.ValidationError, match="unknown view kind"):
        g.create_view("x", "dpo", reward="reward('score')")
    with pytest.raises(trellisdb.ValidationError, match="needs reward"):
        g.create_view("x", "grpo")
    with pytest.raises(trellisdb.ValidationError, match="threshold"):
        g.create_view("x", "kto", reward="reward('score')")
    with pytest.raises(trellisdb.ValidationError, match="margin"):
        g.create_view("x", "preference", reward="reward('score')", margin=float("nan"))
    with pytest.raises(trellisdb.QueryError, match=r"view 'x'.*nope"):
        g.create_view("x", "sft", reward="reward('nope')")
    with pytest.raises(trellisdb.ValidationError, match="unknown view option"):
        g.create_view("x", "sft", rewrd="reward('score')")
    with pytest.raises(trellisdb.ValidationError, match="name"):
        g.create_view("../x", "sft")
    g.create_view("x", "sft")
    with pytest.raises(trellisdb.ValidationError, match="exists"):
        g.create_view("x", "sft")
    with pytest.raises(trellisdb.ValidationError, match="not materialized"):
        g.view("x")
    with pytest.raises(trellisdb.QueryError, match="unknown view 'y'"):
        g.materialize("y")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def is_messages(m: Any, roles: tuple[str, ...]) -> bool:
    return (isinstance(m, list) and [x["role"] for x in m] == list(roles)
            and all(isinstance(x["content"], str) and x["content"] for x in m))


def test_export_layouts(g: trellisdb.Database, tmp_path: Path) -> None:
    specs = {"sft": {"threshold": 0.5}, "preference": {}, "grpo": {}, "kto": {"threshold": 0.5},
             "stepwise": {"threshold": 0.5}, "replay": {"size": 3}}
    for kind, opts in specs.items():
        g.create_view(kind, kind, reward="reward('score')", **opts)
        g.materialize(kind)
    sys_user = ("system", "user")
    checks = {
        ("trl", "sft"): lambda r: set(r) == {"messages"} and is_messages(r["messages"], (*sys_user, "assistant")),
        ("openai", "sft"): lambda r: set(r) == {"messages"} and is_messages(r["messages"], (*sys_user, "assistant")),
        ("trl", "replay"): lambda r: is_messages(r["messages"], (*sys_user, "assistant")),
        ("trl", "preference"): lambda r: set(r) == {"prompt", "chosen", "rejected"}
        and is_messages(r["prompt"], sys_user) and is_messages(r["chosen"], ("assistant",))
        and is_messages(r["rejected"], ("assistant",)) and r["chosen"] != r["rejected"],
        ("openai", "preference"): lambda r: set(r) == {"input", "preferred_output", "non_preferred_output"}
        and is_messages(r["input"]["messages"], sys_user) and is_messages(r["preferred_output"], ("assistant",)),
        ("trl", "grpo"): lambda r: set(r) == {"prompt"} and is_messages(r["prompt"], sys_user),
        ("trl", "kto"): lambda r: set(r) == {"prompt", "completion", "label"} and isinstance(r["label"], bool)
        and isinstance(r["prompt"], str) and isinstance(r["completion"], str),
        ("trl", "stepwise"): lambda r: set(r) == {"prompt", "completions", "labels"}
        and len(r["completions"]) == len(r["labels"]) and all(isinstance(x, bool) for x in r["labels"]),
    }
    for (fmt, kind), check in checks.items():
        out = tmp_path / f"{fmt}-{kind}"
        m = g.export(kind, out, fmt)
        lines = read_jsonl(out / "train.jsonl")
        assert len(lines) == m["rows"] == m["counts"]["train"] == g.views()[[v["name"] for v in g.views()].index(kind)]["rows"]
        assert lines and all(check(r) for r in lines), (fmt, kind, lines[0])
        # round trips through polars and pyarrow
        assert pl.read_ndjson(out / "train.jsonl").height == len(lines)
        assert pajson.read_json(out / "train.jsonl").num_rows == len(lines)
        man = json.loads((out / "manifest.json").read_text())
        defn = next(v["definition"] for v in g.views() if v["name"] == kind)
        assert man["commit"] == g.log()[-1]["id"] and man["definition"] == defn and man["rows"] == len(lines)
        assert man["view"] == kind and man["format"] == fmt and man["files"]["provenance"] == "provenance.parquet"
        assert man["files"]["train"] == ["train.jsonl"]
        prov = pq.read_table(out / "provenance.parquet")
        assert prov.num_rows == len(lines) and all(prov["node_ids"].to_pylist())
        assert kind in (out / "README.md").read_text()
    pref = read_jsonl(tmp_path / "trl-preference" / "train.jsonl")
    assert {r["chosen"][0]["content"] for r in pref} >= {"answer A", "answer X"}
    # parquet: the stored rows plus the resolved texts
    m = g.export("preference", tmp_path / "pq", "parquet")
    t = pq.read_table(tmp_path / "pq" / "train.parquet")
    assert t.num_rows == m["rows"] and {"chosen", "rejected", "prompt", "margin", "node_ids"} <= set(t.column_names)
    assert pl.read_parquet(tmp_path / "pq" / "train.parquet").height == t.num_rows
    with pytest.raises(trellisdb.ValidationError, match="no layout for grpo"):
        g.export("grpo", tmp_path / "o", "openai")


def test_export_split_paths_missing_and_empty(g: trellisdb.Database, tmp_path: Path) -> None:
    g.create_view("k", "kto", reward="reward('score')", threshold=0.5)
    g.materialize("k")
    m = g.export("k", tmp_path / "split", "parquet", validation=0.5)
    t1, t2 = (pq.read_table(tmp_path / "split" / f"{s}.parquet") for s in ("train", "validation"))
    assert t1.num_rows + t2.num_rows == 9 and set(m["counts"]) == {"train", "validation"}
    assert not set(t1["task_id"].to_pylist()) & set(t2["task_id"].to_pylist())  # a task on one side only
    with pytest.raises(trellisdb.ExportError, match="exists"):
        g.export("k", tmp_path / "split", "parquet")
    g.export("k", tmp_path / "split", "trl", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "split").iterdir()) == [
        "README.md", "manifest.json", "provenance.parquet", "train.jsonl"]
    # missing texts: the roots have a prompt but no response
    g.create_view("all", "sft")
    g.materialize("all")
    with pytest.raises(trellisdb.ExportError, match=r"2 row\(s\) of view 'all' lack a 'prompt, response' artifact, e\.g\. \['Q', 'R'\]"):
        g.export("all", tmp_path / "miss", "trl")
    m = g.export("all", tmp_path / "miss", "trl", skip_missing=True)
    assert m["skipped_missing_texts"] == 2 and m["rows"] == 9
    # an empty view: an empty dataset with its manifest
    g.create_view("none", "sft", reward="reward('score')", threshold=2.0)
    assert g.materialize("none")["rows"] == 0
    seen: list[tuple[int, int]] = []
    m = g.export("none", tmp_path / "empty", "trl", progress=lambda d, n: seen.append((d, n)))
    assert m["rows"] == 0 and (tmp_path / "empty" / "train.jsonl").read_text() == ""
    assert json.loads((tmp_path / "empty" / "manifest.json").read_text())["counts"] == {"train": 0}


def test_export_parquet_in_shards(g: trellisdb.Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Parquet split over ``SHARD_BYTES`` is written as shards named the Hugging Face way;
    read in order they are the one-file export, and provenance counts rows through them."""
    from trellisdb.training import export

    g.create_view("p", "preference", reward="reward('score')", margin=0.0)
    g.materialize("p")
    seen: list[tuple[int, int]] = []
    for validation in (0.0, 0.5):
        one = g.export("p", tmp_path / f"one{validation}", "parquet", validation=validation)
        monkeypatch.setattr(export, "SHARD_BYTES", 1)  # a shard per row
        seen.clear()
        out = tmp_path / f"shards{validation}"
        m = g.export("p", out, "parquet", validation=validation, progress=lambda d, n: seen.append((d, n)))
        monkeypatch.undo()
        assert m["counts"] == one["counts"] and seen[-1] == (m["rows"], m["rows"]) and m["rows"] >= 4
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        prov = pq.read_table(out / "provenance.parquet")
        for split, n in m["counts"].items():
            assert one["files"][split] == [f"{split}.parquet"]
            names = m["files"][split]
            assert names == ([f"{split}.parquet"] if n == 1 else [f"{split}-{i:05d}-of-{n:05d}.parquet" for i in range(n)])
            parts = [pq.read_table(out / name) for name in names]
            assert all(t.num_rows == 1 for t in parts)
            whole = pq.read_table(tmp_path / f"one{validation}" / f"{split}.parquet")
            assert pa.concat_tables(parts).equals(whole)
            assert pl.read_parquet(out / f"{split}*.parquet").height == n
            mine = prov.filter(pc.equal(prov["split"], split))
            assert mine["row"].to_pylist() == list(range(n))
            assert mine["node_ids"].to_pylist() == whole["node_ids"].to_pylist()
            assert f"`{names[0]}`" in (out / "README.md").read_text()


def test_export_shard_failure_leaves_the_old_export(g: trellisdb.Database, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard that fails to write (a full disk, say) fails the export: the other writers
    finish, the temporary folder goes, and an export already at the path stays as it was."""
    from trellisdb.training import export

    g.create_view("p", "preference", reward="reward('score')", margin=0.0)
    g.materialize("p")
    out = tmp_path / "out"
    g.export("p", out, "parquet")
    before = sorted(p.name for p in out.iterdir())
    calls = 0
    real = export._plain

    def failing(t: Any, keep: bool = False) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise OSError("No space left on device")
        return real(t, keep)

    monkeypatch.setattr(export, "SHARD_BYTES", 1)
    monkeypatch.setattr(export, "_plain", failing)
    with pytest.raises(OSError, match="No space left"):
        g.export("p", out, "parquet", overwrite=True)
    assert calls > 3  # the other shards were written
    assert sorted(p.name for p in out.iterdir()) == before == ["README.md", "manifest.json", "provenance.parquet",
                                                               "train.parquet"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".trellis-export-")] == []


@pytest.mark.skipif(not openevolve.available(), reason="../shared/data is not present")
def test_openevolve_sibling_preferences(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db")
    progs = openevolve.load(db, prompts=True)
    score = {pid: openevolve.numeric_metrics(p).get("combined_score") for pid, (_, p) in progs.items()}
    parent = {pid: p.get("parent_id") for pid, (_, p) in progs.items()}
    want = set()
    for a in progs:
        for b in progs:
            pa_, pb = parent[a], parent[b]
            if pa_ and pa_ == pb and pa_ in progs and score[a] is not None and score[b] is not None and score[a] > score[b]:
                want.add((a, b))
    db.create_view("oe", "preference", reward="reward('combined_score')", pairs_from=["siblings"])
    assert db.materialize("oe")["rows"] == len(want) > 10
    assert {(r["chosen_id"], r["rejected_id"]) for r in db.view("oe").to_pylist()} == want
    m = db.export("oe", tmp_path / "oe", "trl", skip_missing=True)
    lines = read_jsonl(tmp_path / "oe" / "train.jsonl")
    assert len(lines) == m["rows"] and all(r["chosen"][0]["role"] == "assistant" for r in lines)
    # GRPO groups: the children of each parent with their combined scores, in the order they were written
    db.create_view("oeg", "grpo", reward="reward('combined_score')")
    db.materialize("oeg")
    written = {r["id"]: i for i, r in enumerate(db.sql("SELECT id FROM nodes ORDER BY seq").to_pylist())}
    for r in db.view("oeg").to_pylist():
        kids = sorted((c for c, p in parent.items() if p == r["group_key"] and score[c] is not None),
                      key=written.__getitem__)
        assert r["node_ids"] == kids
        assert r["rewards"] == pytest.approx([score[c] for c in kids])
    # SFT paths: the best programs with the chain of programs they were evolved from
    best = sorted(v for v in score.values() if v is not None)[-5]
    db.create_view("oep", "sft", reward="reward('combined_score')", threshold=best, path=True)
    db.materialize("oep")
    got = db.view("oep").to_pylist()
    assert {r["node_id"] for r in got} == {pid for pid, v in score.items() if v is not None and v >= best}
    for r in got:
        chain = [r["node_id"]]
        while parent[chain[-1]] in progs:
            chain.append(parent[chain[-1]])
        assert r["node_ids"] == chain[::-1] and len(r["response_hashes"]) == len(chain)
    assert max(len(r["node_ids"]) for r in got) > 2
    mp = db.export("oep", tmp_path / "oep", "openai", skip_missing=True)
    lines = read_jsonl(tmp_path / "oep" / "train.jsonl")
    assert len(lines) == mp["rows"] > 0
    prov = pq.read_table(tmp_path / "oep" / "provenance.parquet")["node_ids"].to_pylist()
    for line, path in zip(lines, prov, strict=True):  # a user / assistant turn per program with a prompt / response
        texts = [openevolve.prompt_artifacts(progs[pid][1]) for pid in path]
        want = [(role, t[name]) for t in texts for role, name in (("user", "prompt"), ("assistant", "response"))
                if name in t]
        assert [(m["role"], m["content"]) for m in line["messages"] if m["role"] != "system"] == want
    db.close()


def test_cli_views(g: trellisdb.Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trellisdb.cli import main

    db = ["--db", g.path, "--export-root", str(tmp_path)]
    g.close()
    assert main([*db, "create-view", "p", "preference", "-o", "reward=reward('score')", "-o", "margin=0.3",
                 "-o", 'pairs_from=["siblings"]']) == 0
    assert main([*db, "materialize", "p"]) == 0
    assert "6 rows at commit" in capsys.readouterr().out
    assert main([*db, "views"]) == 0
    assert "preference(" in capsys.readouterr().out
    assert main([*db, "export", "p", "out", "--format", "openai"]) == 0
    assert "wrote 6 rows (train 6)" in capsys.readouterr().out
    assert len(read_jsonl(tmp_path / "out" / "train.jsonl")) == 6
    assert main([*db, "export", "p", "out"]) == 1
    assert "exists; use --overwrite to replace it" in capsys.readouterr().err
    assert main([*db, "refresh", "p"]) == 0
    assert main([*db, "create-view", "q", "grpo", "-o", "oops"]) == 1


def test_view_statements_in_tql(g: trellisdb.Database, tmp_path: Path) -> None:
    r = g.query("CREATE VIEW p AS preference WHERE task_id = 't1' "
                "WITH reward = reward('score') * 2, margin = 0.5, pairs_from = ['siblings']").to_pylist()
    assert r[0]["name"] == "p" and "margin=0.5" in r[0]["definition"] and "where=\"task_id = 't1'\"" in r[0]["definition"]
    commit = g.log()[-1]["id"]
    assert g.query("MATERIALIZE p").to_pylist()[0]["rows"] == 5  # doubled rewards: .8, .8, 1.6, .8, .8 >= .5
    assert g.query(f"MATERIALIZE p AS OF COMMIT {commit}").to_pylist()[0]["commit"] == commit
    assert g.query("REFRESH p").to_pylist()[0]["rows"] == 5
    out = Path(g.path) / "exports" / "x"  # a TQL export path is relative to the export root (default <db>/exports)
    e = g.query("EXPORT p TO 'x' FORMAT openai WITH validation = 0.0, overwrite = true").to_pylist()[0]
    assert e["rows"] == 5 and len(read_jsonl(out / "train.jsonl")) == 5
    assert [v["name"] for v in g.query("SHOW VIEWS").to_pylist()] == ["p"]
    g.query("CREATE OR REPLACE VIEW p AS grpo WITH reward = reward('score'), group_by = prompt, min_size = 3")
    assert g.query("MATERIALIZE p").to_pylist()[0]["rows"] == 1  # 'pack circles' (7 scored nodes); 'sort' has 2 < 3
    g.query("DROP VIEW p")
    assert g.query("SHOW VIEWS").to_pylist() == []
    with pytest.raises(trellisdb.QuerySyntaxError, match="parameters"):
        g.query("CREATE VIEW q AS sft WITH reward = reward($c)", c="score")
    with pytest.raises(trellisdb.QuerySyntaxError, match="NAME = VALUE"):
        g.query("CREATE VIEW q AS sft WITH threshold > 1")
    with pytest.raises(trellisdb.ValidationError, match="unknown view kind 'dpo'"):
        g.query("CREATE VIEW q AS dpo WITH reward = reward('score')")
    with pytest.raises(trellisdb.ValidationError, match="reward must be a number"):
        g.query("CREATE VIEW q AS sft WITH reward = 'reward(''score'')', threshold = 0.5")


def test_export_texts_from_a_hash_stored_twice_and_binary_content(tmp_path: Path) -> None:
    """Two writers that store the same content at once leave two rows with its hash: the export
    still gives each row its text once. A text the layout needs that is not UTF-8 is an error
    naming the artifact, and nothing is written; the view's other rows export once it is left out."""
    import hashlib

    a, b = trellisdb.connect(tmp_path / "db"), trellisdb.connect(tmp_path / "db")
    ta, tb = a.transaction(), b.transaction()
    ta.__enter__(), tb.__enter__()  # both buffer before either commits: neither sees the other's row
    sa, sb = a.session(task="t", agent="x", id="sa"), b.session(task="t", agent="x", id="sb")
    sa.add_node(id="n1", artifacts={"prompt": "same text", "response": "first"})
    sa.add_reward("n1", "score", 1.0)
    sb.add_node(id="n2", artifacts={"prompt": "same text", "response": b"\xff\xfe not text"})
    sb.add_reward("n2", "score", 0.0)
    ta.__exit__(None, None, None)
    tb.__exit__(None, None, None)
    b.close()
    same = hashlib.sha256(b"same text").hexdigest()
    assert a.sql(f"SELECT count(*) AS n FROM artifacts_history WHERE hash = '{same}'").to_pylist() == [{"n": 2}]
    a.create_view("all", "sft")
    a.materialize("all")
    bad = hashlib.sha256(b"\xff\xfe not text").hexdigest()
    with pytest.raises(trellisdb.ExportError, match=rf"1 artifact\(s\) the export needs as text are not UTF-8, e\.g\. \['{bad}'\]"):
        a.export("all", tmp_path / "out", "trl")
    assert not (tmp_path / "out").exists()
    a.create_view("good", "sft", reward="reward('score')", threshold=0.5)
    a.materialize("good")
    a.export("good", tmp_path / "out", "parquet")
    t = pq.read_table(tmp_path / "out" / "train.parquet")
    assert t.select(["node_id", "prompt", "response"]).to_pylist() == [
        {"node_id": "n1", "prompt": "same text", "response": "first"}]


def test_export_texts_read_in_many_batches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The artifacts' contents stream from Lance in batches (a few hundred rows each here) when
    a view is materialized: every row still gets its own texts, and the rows keep the view's order."""
    from trellisdb.training import texts

    db = trellisdb.connect(tmp_path / "db")
    with db.transaction():
        s = db.session(task="t", agent="a", id="s")
        for i in range(700):
            s.add_node(id=f"n{i:03d}", artifacts={"prompt": f"question {i % 350}", "response": f"answer {i}"})
            s.add_reward(f"n{i:03d}", "score", 1.0)
    db.create_view("s", "sft", reward="reward('score')", threshold=0.5)
    monkeypatch.setattr(texts, "TEXT_SCAN_ROWS", 256)  # 1050 artifacts: 5 batches from Lance,
    monkeypatch.setattr(texts, "TEXT_BATCH_BYTES", 1)  # each matched on its own
    db.materialize("s")
    db.export("s", tmp_path / "out", "parquet")
    got = pq.read_table(tmp_path / "out" / "train.parquet").select(["node_id", "prompt", "response"]).to_pylist()
    assert got == [{"node_id": f"n{i:03d}", "prompt": f"question {i % 350}", "response": f"answer {i}"}
                   for i in range(700)]


def test_export_keeps_a_shared_text_as_a_dictionary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text column of few distinct values (a system prompt most rows share, absent on some)
    goes to Parquet as a dictionary straight from its codes; it reads back as plain strings,
    row for row, beside the plainly written columns."""
    from trellisdb.training import export

    db = trellisdb.connect(tmp_path / "db")
    systems = ["you are a solver", "you are a checker", None]
    with db.transaction():
        s = db.session(task="t", agent="a", id="s")
        for i in range(300):
            a = {"prompt": f"question {i}", "response": f"answer {i}"}
            if systems[i % 3] is not None:
                a["system_prompt"] = systems[i % 3]
            s.add_node(id=f"n{i:03d}", artifacts=a)
            s.add_reward(f"n{i:03d}", "score", 1.0)
    db.create_view("s", "sft", reward="reward('score')", threshold=0.5)
    db.materialize("s")
    kept: list[str] = []

    def spy(t: pa.Table) -> pa.Table:
        out = real(t)
        kept.extend(f.name for f in out.schema if f.metadata and export._KEEP in f.metadata)
        return out

    real = export._dictionaries
    monkeypatch.setattr(export, "_dictionaries", spy)
    db.export("s", tmp_path / "out", "parquet")
    assert kept == ["system"]  # the prompts and responses are all distinct: written plainly
    f = pq.ParquetFile(tmp_path / "out" / "train.parquet")
    t = f.read()
    assert t.schema.field("system").type == t.schema.field("prompt").type == pa.string()
    assert t.select(["node_id", "system", "prompt"]).to_pylist() == [
        {"node_id": f"n{i:03d}", "system": systems[i % 3], "prompt": f"question {i}"} for i in range(300)]
    names = [f.metadata.schema.column(i).name for i in range(f.metadata.num_columns)]
    encodings = {n: f.metadata.row_group(0).column(i).encodings for i, n in enumerate(names)}
    assert "RLE_DICTIONARY" in encodings["system"] and "system" in export._TEXT_NAMES
    # no min/max of texts in the footer; the other columns keep theirs
    stats = {n: f.metadata.row_group(0).column(i).statistics for i, n in enumerate(names)}
    assert stats["prompt"] is None and stats["node_id"] is not None and stats["node_id"].has_min_max
    # the JSONL layouts keep it compact too, and render it on every row that has it
    db.create_view("sp", "sft", reward="reward('score')", threshold=0.5, path=True)
    db.materialize("sp")
    for view in ("s", "sp"):
        db.export(view, tmp_path / f"{view}-trl", "trl")
        lines = read_jsonl(tmp_path / f"{view}-trl" / "train.jsonl")
        assert [[(m["role"], m["content"]) for m in r["messages"]] for r in lines] == [
            ([("system", systems[i % 3])] if systems[i % 3] else []) + [("user", f"question {i}"),
                                                                      ("assistant", f"answer {i}")]
            for i in range(300)]


def test_export_texts_when_hash_keys_collide(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolving a view's texts joins on 64-bit keys of the hash strings and checks every match
    on a second hash. With every key made the same (a collision everywhere) it still gives each
    row its own texts, and a binary artifact outside the view that now shares a key with wanted
    ones is no error."""
    import polars as pl

    from trellisdb.training import texts

    db = trellisdb.connect(tmp_path / "db")
    with db.transaction():
        s = db.session(task="t", agent="a", id="s")
        for i in range(5):
            s.add_node(id=f"n{i}", artifacts={"prompt": f"question {i % 2}", "response": f"answer {i}"})
            s.add_reward(f"n{i}", "score", 1.0 if i != 4 else 0.0)
        s.add_node(id="bin", artifacts={"response": b"\xff\xfe binary"})
    db.create_view("s", "sft", reward="reward('score')", threshold=0.5)
    calls = []
    real = texts.resolve

    def spy(*a: Any, **k: Any) -> Any:
        calls.append(k.get("exact", False))
        return real(*a, **k)

    real_hash = pl.Series.hash
    # every key the same; the check hash (another seed) stays real, so each match fails its check
    monkeypatch.setattr(pl.Series, "hash", lambda self, seed=0: pl.Series(self.name, [0] * len(self), pl.UInt64)
                        if seed == 0 else real_hash(self, seed))
    monkeypatch.setattr(texts, "resolve", spy)
    db.materialize("s")
    db.export("s", tmp_path / "out", "parquet")
    got = pq.read_table(tmp_path / "out" / "train.parquet").select(["node_id", "prompt", "response"]).to_pylist()
    assert got == [{"node_id": f"n{i}", "prompt": f"question {i % 2}", "response": f"answer {i}"} for i in range(4)]
    assert calls == [False, True]  # the keyed lookup, then the exact one


# ------------------------------------------------------------------ the texts kept beside a view
@pytest.mark.parametrize("addresses", ["kept", "forgotten", "wrong", "many"])
def test_a_view_keeps_its_texts_and_a_refresh_looks_up_only_those_it_lacks(
    g: trellisdb.Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, addresses: str
) -> None:
    """Materializing resolves every text the rows name, once each; the rows' code columns stay
    internal. A refresh looks up only the texts its new rows name that the view lacks: new
    artifacts by commit, older ones (F and G, a tie until F is re-scored) where the
    materialization's scan found them or, with that forgotten (or wrong: each row taken is
    checked), by hash: a few by a Lance filter, many in a full scan that records them anew."""
    import hashlib

    g.create_view("v", "preference", reward="reward('score')", pairs_from=["siblings"])
    e = g.materialize("v")
    assert "G" not in {r["chosen_id"] for r in rows(g, "v")} | {r["rejected_id"] for r in rows(g, "v")}
    assert not any(c.startswith(texts.CODE_PREFIX) for c in g.view("v").to_arrow().column_names)
    first = g._views.texts.texts_of(ViewCatalog(g.path).load().entries["v"]).to_pylist()
    assert sorted(first) == sorted({"pack circles", "sort", "you are a solver"} | {f"answer {n}" for n in "ABCDXY"})
    assert e["texts"] == len(first)
    calls: list[tuple[set[str], str | None]] = []
    real = texts.resolve

    def spy(db: Any, commit: int, probe: pl.Series, where: str | None = None, **k: Any) -> Any:
        calls.append((set(probe.drop_nulls().to_list()), where))
        return real(db, commit, probe, where, **k)

    monkeypatch.setattr(texts, "resolve", spy)
    if addresses in ("forgotten", "many"):
        g._views.texts.addresses = None
    if addresses == "many":  # F and G are more than this
        monkeypatch.setattr(texts, "LISTED_HASHES", 1)
    elif addresses == "wrong":  # every address one row off
        g._views.texts.addresses.addrs = np.roll(g._views.texts.addresses.addrs, 1)
    with g.transaction():
        s = g.resume("s1")
        s.add_node(id="N", parents=["R"], artifacts=arts("N"))
        s.add_reward("N", "score", 0.95)
        s.add_reward("F", "score", 0.9)
    e = g.refresh("v")
    assert e["how"].startswith("refreshed")
    h = {n: hashlib.sha256(f"answer {n}".encode()).hexdigest() for n in "NFG"}
    expected = {"kept": ["commit_id"], "forgotten": ["commit_id", "hash"], "wrong": ["commit_id", "hash"],
                "many": ["commit_id", None]}[addresses]
    assert [w.split(" ")[0] if w else None for _, w in calls] == expected
    assert calls[0][0] == {h["N"], h["F"], h["G"]}
    if addresses in ("forgotten", "many"):
        assert calls[1][0] == {h["F"], h["G"]}
    if addresses == "many":  # the full scan recorded every artifact's address again
        assert g._views.texts.addresses.upto == e["commit"] and len(g._views.texts.addresses.keys) == len(
            g.sql("SELECT hash FROM artifacts_history").to_pylist())
    elif addresses == "wrong":  # a row taken holding another hash asked for is still used
        assert calls[1][0] and calls[1][0] <= {h["F"], h["G"]}
    assert e["texts"] == len(first) + 3
    assert stored_texts(g, "v") == rebuilt_texts(g, "v", e["commit"])
    g.export("v", tmp_path / "refreshed", "parquet")
    g.materialize("v")
    g.export("v", tmp_path / "rebuilt", "parquet")
    a, b = (pq.read_table(tmp_path / d / "train.parquet") for d in ("refreshed", "rebuilt"))
    assert a.equals(b) and {"answer G", "answer N"} <= set(a["rejected"].to_pylist() + a["chosen"].to_pylist())


def test_a_refresh_that_died_before_its_catalog_write_is_undone(g: trellisdb.Database, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A refresh that wrote the view's texts and rows but died before naming them in the catalog
    leaves the catalog's versions in force: the next refresh undoes the orphan versions and
    equals a rebuild (it used to report the view as changing under it)."""
    g.create_view("v", "preference", reward="reward('score')")
    g.materialize("v")
    before = g.view("v").to_pylist()
    grow(g, np.random.default_rng(11), 10)

    def dies(self: ViewCatalog) -> None:
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(ViewCatalog, "save", dies)
        with pytest.raises(OSError, match="disk full"):
            g.refresh("v")
    assert g.view("v").to_pylist() == before  # what the catalog names: still the old rows
    e = g.refresh("v")
    assert e["how"].startswith("refreshed")
    spec = ViewCatalog(g.path).load().spec("v")
    assert g.view("v").to_arrow().equals(compute(g.snapshot(e["commit"]), spec))
    assert stored_texts(g, "v") == rebuilt_texts(g, "v", e["commit"])
    g.export("v", tmp_path / "out", "trl")


def test_a_view_stored_before_views_kept_texts(g: trellisdb.Database, tmp_path: Path) -> None:
    """A view materialized by an older trellisdb has rows without text codes and no texts: it
    exports (resolving its texts then), and a refresh rebuilds it with its texts."""
    import lance

    g.create_view("v", "sft", reward="reward('score')", threshold=0.5)
    g.materialize("v")
    g.export("v", tmp_path / "new", "parquet")
    cat = ViewCatalog(g.path).load()
    entry = cat.entries["v"]
    uri = os.path.join(g.path, entry["file"])
    old = lance.dataset(uri).to_table()
    ds = lance.write_dataset(old.drop_columns(texts.code_columns(old.column_names)), uri, mode="overwrite")
    entry["version"] = ds.version
    del entry["texts_version"], entry["texts"]
    cat.save()
    g.export("v", tmp_path / "old", "parquet")
    assert pq.read_table(tmp_path / "old" / "train.parquet").equals(pq.read_table(tmp_path / "new" / "train.parquet"))
    grow(g, np.random.default_rng(5), 6)
    e = g.refresh("v")
    assert e["how"] == "rebuilt (stored before views kept their texts)"
    assert stored_texts(g, "v") == rebuilt_texts(g, "v", e["commit"])


def test_a_binary_text_blocks_only_the_exports_of_rows_that_name_it(tmp_path: Path) -> None:
    """A view may name a binary artifact (materializing and refreshing it work); exporting the
    row is the error. Once a refresh has replaced the row, the text it kept is no obstacle."""
    import hashlib

    db = trellisdb.connect(tmp_path / "db")
    with db.transaction():
        s = db.session(task="t", agent="a", id="s")
        s.add_node(id="n1", artifacts={"prompt": "p", "response": "fine"})
        s.add_node(id="n2", artifacts={"prompt": "p", "response": b"\xff\xfe not text"})
        for n in ("n1", "n2"):
            s.add_reward(n, "score", 1.0)
    db.create_view("v", "sft", reward="reward('score')", threshold=0.5)
    db.materialize("v")
    bad = hashlib.sha256(b"\xff\xfe not text").hexdigest()
    with pytest.raises(trellisdb.ExportError, match=bad):
        db.export("v", tmp_path / "out", "trl")
    with db.transaction():
        db.resume("s").add_reward("n2", "score", 0.0)
    assert db.refresh("v")["how"].startswith("refreshed")
    db.export("v", tmp_path / "out", "trl")
    assert [r["messages"][-1]["content"] for r in read_jsonl(tmp_path / "out" / "train.jsonl")] == ["fine"]


def test_a_view_whose_texts_are_gone_says_to_materialize_it(g: trellisdb.Database, tmp_path: Path) -> None:
    """The texts beside a view's rows deleted (or unreadable): export and refresh name the file
    and say to materialize the view, which brings them back."""
    import shutil

    g.create_view("v", "sft", reward="reward('score')", threshold=0.5)
    g.materialize("v")
    shutil.rmtree(g._views.texts.path("v"))
    with pytest.raises(trellisdb.TrellisError, match=r"texts of view 'v' .* run db.materialize"):
        g.export("v", tmp_path / "out", "trl")
    grow(g, np.random.default_rng(2), 4)
    with pytest.raises(trellisdb.TrellisError, match=r"texts of view 'v' .* run db.materialize"):
        g.refresh("v")
    e = g.materialize("v")
    assert stored_texts(g, "v") == rebuilt_texts(g, "v", e["commit"])
    g.export("v", tmp_path / "out", "trl")
    assert len(read_jsonl(tmp_path / "out" / "train.jsonl")) == e["rows"]


def test_a_view_can_leave_its_texts_to_the_export(g: trellisdb.Database, tmp_path: Path) -> None:
    """keep_texts=False stores the rows alone (no copy of the texts): exports resolve the
    texts from the artifacts each time and equal a kept view's, and refreshes stay incremental."""
    for name, keep in (("kept", True), ("lean", False)):
        g.create_view(name, "preference", reward="reward('score')", keep_texts=keep)
        g.materialize(name)
    assert os.path.exists(g._views.texts.path("kept")) and not os.path.exists(g._views.texts.path("lean"))
    assert "keep_texts=False" in ViewCatalog(g.path).load().entries["lean"]["definition"]
    grow(g, np.random.default_rng(9), 10)
    for name in ("kept", "lean"):
        e = g.refresh(name)
        assert e["how"].startswith("refreshed") and (e["texts_version"] is None) == (name == "lean")
        g.export(name, tmp_path / name, "parquet")
    assert not os.path.exists(g._views.texts.path("lean"))
    a, b = (pq.read_table(tmp_path / n / "train.parquet") for n in ("kept", "lean"))
    assert a.equals(b) and a.num_rows > 0
    with pytest.raises(trellisdb.ValidationError, match="keep_texts must be True or False"):
        g.create_view("bad", "sft", keep_texts="no")


def test_parquet_dictionary_encodes_only_the_repeating_columns(tmp_path: Path) -> None:
    """Parquet export asks for a dictionary on the columns whose first values repeat (and the
    text dictionaries kept as they are), not on mostly distinct ones; the file reads back the same."""
    from trellisdb.training import export

    n = 10_000
    kept = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array(["the system prompt"]))
    t = pa.table({
        "task": pa.array(["t1", "t2"] * (n // 2)),
        "node_id": pa.array([f"n{i}" for i in range(n)]),
        "node_ids": pa.array([[f"n{i}", f"m{i}"] for i in range(n)]),
        "steps": pa.array([["a", "b", "a"]] * n),
        "margin": pa.array(np.linspace(0, 1, n)),
        "system": kept,
    })
    t = t.set_column(5, t.schema.field("system").with_metadata({export._KEEP: b"1"}), kept)
    assert export._repeating(t) == ["task", "steps.list.element", "system"]
    path = tmp_path / "x.parquet"
    pq.write_table(t, path, use_dictionary=export._repeating(t))
    md = pq.ParquetFile(path).metadata.row_group(0)
    dictionary = {md.column(i).path_in_schema for i in range(md.num_columns) if "RLE_DICTIONARY" in md.column(i).encodings}
    assert dictionary == {"task", "steps.list.element", "system"}
    assert pq.read_table(path).to_pylist() == t.to_pylist()
