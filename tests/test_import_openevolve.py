"""``trellis import openevolve``: the shared circle-packing run checkpoint by checkpoint, and
messy folders written here (migrants, evictions, dangling ids, leftovers, incomplete and broken files)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trellisdb
from trellisdb.errors import ImportFormatError, ValidationError
from trellisdb.importers import import_run
from trellisdb.importers import openevolve as oe

from .shared import shared_data

RUN = shared_data("openevolve-circle-packing")
CKPTS = RUN / "checkpoints"
shared = pytest.mark.skipif(not CKPTS.is_dir(), reason=f"the shared OpenEvolve run is not at {RUN} (../shared/data)")


# ------------------------------------------------------------------ the files, read independently


def checkpoints(root: Path = CKPTS) -> list[int]:
    return sorted(int(d.name.split("_")[1]) for d in root.glob("checkpoint_*") if d.name.split("_")[1].isdigit())


def programs_of(k: int, root: Path = CKPTS) -> dict[str, dict[str, Any]]:
    return {f.stem: json.loads(f.read_text()) for f in sorted((root / f"checkpoint_{k}" / "programs").glob("*.json"))}


def metadata_of(k: int, root: Path = CKPTS) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((root / f"checkpoint_{k}" / "metadata.json").read_text())
    return meta


def all_programs(root: Path = CKPTS) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for k in checkpoints(root):
        for pid, p in programs_of(k, root).items():
            out.setdefault(pid, p)
    return out


def labelled(db: trellisdb.Database, label: str, k: int | str) -> set[str]:
    as_of = k if isinstance(k, str) else f"checkpoint_{k}"
    rows = db.sql("SELECT node_id FROM labels WHERE label = $l", as_of=as_of, params={"l": label}).to_pylist()
    return {r["node_id"] for r in rows}


def label_names(db: trellisdb.Database, k: int) -> set[str]:
    return {r["label"] for r in db.sql("SELECT DISTINCT label FROM labels", as_of=f"checkpoint_{k}").to_pylist()}


def unit_meta(db: trellisdb.Database, unit: str) -> dict[str, Any]:
    row = db.sql("SELECT meta FROM commits WHERE json_extract_string(meta, '$.import.unit') = $u",
                 params={"u": unit}).to_pylist()
    assert len(row) == 1, unit
    meta: dict[str, Any] = json.loads(row[0]["meta"])
    return meta


def attrs(db: trellisdb.Database, node: str, as_of: str | None = None) -> dict[str, Any]:
    rows = db.sql("SELECT key, value FROM attributes WHERE scope = 'node' AND entity = $e", as_of=as_of,
                  params={"e": node}).to_pylist()
    return {r["key"]: json.loads(r["value"]) for r in rows}


# ------------------------------------------------------------------ the shared run


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[trellisdb.Database, Any]]:
    if not CKPTS.is_dir():
        pytest.skip(f"the shared OpenEvolve run is not at {RUN}")
    db = trellisdb.connect(tmp_path_factory.mktemp("oe") / "db")
    report = import_run(db, "openevolve", RUN, progress=False)
    yield db, report
    db.close()


@shared
def test_one_unit_per_checkpoint_tagged_with_the_run_state_as_meta(imported: tuple[trellisdb.Database, Any]) -> None:
    db, report = imported
    ks = checkpoints()
    assert report.imported == [f"checkpoint_{k}" for k in ks]
    assert report.nodes == len(all_programs()) == 89
    tags = db.tags()
    assert [tags[f"checkpoint_{k}"] for k in ks] == report.commits
    for k in ks:
        meta, md = unit_meta(db, f"checkpoint_{k}"), metadata_of(k)
        assert meta["import"] == {"format": "openevolve", "source": str(RUN), "unit": f"checkpoint_{k}"}
        assert meta["checkpoint"] == k
        for key in ("best_program_id", "last_iteration", "current_island", "island_generations",
                    "last_migration_generation"):
            assert meta[key] == md[key], (k, key)
        assert meta["population_size"] == len(programs_of(k))
        assert meta["archive_size"] == len(md["archive"])
        assert meta["island_sizes"] == [len(i) for i in md["islands"]]
        assert "islands" not in meta and "archive" not in meta and "feature_map" not in meta
    session = db.sql("SELECT * FROM sessions").to_pylist()
    assert [(s["id"], s["task_id"], s["agent"]) for s in session] == [
        ("openevolve:openevolve-circle-packing", "openevolve:openevolve-circle-packing", "openevolve")]


@shared
def test_memberships_as_of_every_checkpoint_are_that_checkpoints_sets(
    imported: tuple[trellisdb.Database, Any],
) -> None:
    db, _ = imported
    for k in checkpoints():
        progs, md = programs_of(k), metadata_of(k)
        population = set(progs)
        named = set(md["archive"]) | {md["best_program_id"]} | set(md["feature_map"].values())
        named |= {i for isl in md["islands"] for i in isl}
        dangling = sorted(named - population)
        assert labelled(db, "population", k) == population, k
        assert labelled(db, "best", k) == {md["best_program_id"]}, k
        for i, isl in enumerate(md["islands"]):
            assert labelled(db, f"island_{i}", k) == set(isl) - set(dangling), (k, i)
        assert labelled(db, "archive", k) == set(md["archive"]) - set(dangling), k
        assert labelled(db, "feature_map", k) == set(md["feature_map"].values()) - set(dangling), k
        assert label_names(db, k) == {"population", "best", "archive", "feature_map",
                                      *(f"island_{i}" for i in range(len(md["islands"])))}
        assert unit_meta(db, f"checkpoint_{k}")["dangling"] == dangling, k
    # the run has dangling ids (islands name programs whose files are gone) and they are no nodes
    assert unit_meta(db, "checkpoint_100")["dangling"]
    gone = unit_meta(db, "checkpoint_100")["dangling"]
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE id IN (SELECT unnest($g))",
                  params={"g": gone}).to_pylist()[0]["n"] == 0
    # labels are changes: a checkpoint writes rows only for members that came or left
    k1, k2 = checkpoints()[-2:]
    c2 = db.tags()[f"checkpoint_{k2}"]
    rows = db.sql("SELECT node_id, present FROM labels_history WHERE label = 'population' AND commit_id = $c",
                  params={"c": c2}).to_pylist()
    came = set(programs_of(k2)) - set(programs_of(k1))
    left = set(programs_of(k1)) - set(programs_of(k2))
    assert {r["node_id"] for r in rows if r["present"]} == came
    assert {r["node_id"] for r in rows if not r["present"]} == left


@shared
def test_tql_answers_every_checkpoint_as_the_readme_shows(imported: tuple[trellisdb.Database, Any]) -> None:
    """Issue 24's acceptance in TQL (the README's queries): population, best, each island and the
    archive AS OF TAG 'checkpoint_k' are that checkpoint's sets; the best per island too."""
    db, _ = imported
    for k in checkpoints():
        progs, md = programs_of(k), metadata_of(k)
        at = f"AS OF TAG 'checkpoint_{k}'"

        def ids(q: str, at: str = at) -> set[str]:
            return {r["id"] for r in db.query(f"{q} {at}").to_pylist()}

        assert ids("NODES WHERE has_label('population') RETURN id") == set(progs), k
        assert ids("NODES WHERE has_label('best') RETURN id") == {md["best_program_id"]}, k
        for i, isl in enumerate(md["islands"]):
            assert ids(f"NODES WHERE has_label('island_{i}') RETURN id") == set(isl) & set(progs), (k, i)
        assert ids("NODES WHERE has_label('archive') RETURN id") == set(md["archive"]) & set(progs), k
        best = db.query("FRONTIER WHERE has_label('population') EXPANDED WHEN false "
                        f"RANK BY reward('combined_score') DESC PER attr('island') 1 RETURN id, attr('island') AS i {at}")
        want = db.sql("SELECT a.num AS i, max(r.value) AS best FROM labels l "
                      "LEFT JOIN attributes a ON a.scope = 'node' AND a.entity = l.node_id AND a.key = 'island' "
                      "JOIN rewards r ON r.node_id = l.node_id AND r.channel = 'combined_score' "
                      "WHERE l.label = 'population' GROUP BY ALL", as_of=f"checkpoint_{k}").to_pylist()
        got = best.to_pylist()
        assert sorted((r["i"], progs[r["id"]]["metrics"]["combined_score"]) for r in got) == sorted(
            (w["i"], w["best"]) for w in want), k


@shared
def test_lineage_of_the_best_as_of_every_checkpoint_is_its_parent_chain(
    imported: tuple[trellisdb.Database, Any],
) -> None:
    db, _ = imported
    progs = all_programs()
    for k in checkpoints():
        best = metadata_of(k)["best_program_id"]
        chain = [best]
        while progs[chain[-1]].get("parent_id"):
            chain.append(progs[chain[-1]]["parent_id"])
        got = db.query(f"LINEAGE OF $id ANCESTORS RETURN id, hop AS OF TAG 'checkpoint_{k}'", id=best).to_pylist()
        assert [r["id"] for r in got] == chain, k
        # the same through SQL: walk derived_from edges as of k
        walked, at = [best], best
        while True:
            up = db.sql("SELECT src FROM edges WHERE dst = $d AND kind = 'derived_from'", as_of=f"checkpoint_{k}",
                        params={"d": at}).to_pylist()
            if not up:
                break
            at = up[0]["src"]
            walked.append(at)
        assert walked == chain, k


@shared
def test_programs_map_to_nodes_rewards_artifacts_attributes(imported: tuple[trellisdb.Database, Any]) -> None:
    db, _ = imported
    progs = all_programs()
    nodes = {r["id"]: r for r in db.sql("SELECT * FROM nodes").to_pylist()}
    assert set(nodes) == set(progs)
    for pid, p in progs.items():
        n = nodes[pid]
        assert (n["kind"], n["status"], n["source"], n["step"]) == ("program", "evaluated", "openevolve",
                                                                    p["iteration_found"])
        assert n["session_id"] == n["task_id"] == "openevolve:openevolve-circle-packing"
        assert abs(n["event_time"].timestamp() - p["timestamp"]) < 1e-6, pid
        assert n["summary"] == (p["metadata"].get("changes") or None)
    edges = db.sql("SELECT src, dst, kind FROM edges").to_pylist()
    assert sorted((e["src"], e["dst"]) for e in edges) == sorted(
        (p["parent_id"], pid) for pid, p in progs.items() if p["parent_id"])
    assert len(edges) == 88 and {e["kind"] for e in edges} == {"derived_from"}
    rewards = {(r["node_id"], r["channel"]): r["value"] for r in db.sql("SELECT * FROM rewards").to_pylist()}
    want = {(pid, m): float(v) for pid, p in progs.items() for m, v in p["metrics"].items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
    assert rewards == want
    # a failed program: its error text and timeout flag are attributes, not rewards
    failed = [pid for pid, p in progs.items() if isinstance(p["metrics"].get("error"), str)]
    assert failed
    for pid in failed:
        a = attrs(db, pid)
        assert a["metric.error"] == progs[pid]["metrics"]["error"]
        assert (pid, "error") not in rewards
    some = next(iter(progs))
    a = attrs(db, some)
    p = progs[some]
    for key in ("generation", "iteration_found", "complexity", "diversity", "language"):
        assert a[key] == p[key]
    assert a["island"] == p["metadata"]["island"]
    code = db.sql("SELECT a.content, a.media_type FROM node_artifacts na JOIN artifacts_full a USING (hash) "
                  "WHERE na.node_id = $n AND na.name = 'code'", params={"n": some}).to_pylist()[0]
    assert code["content"].decode() == p["code"] and code["media_type"] == "text/x-python"
    names = {r["name"] for r in db.sql("SELECT name FROM node_artifacts WHERE node_id = $n",
                                       params={"n": some}).to_pylist()}
    template = next(iter(p["prompts"]))
    assert names == {"code", f"prompt/{template}/system", f"prompt/{template}/user", f"response/{template}/0"}
    # MAP-Elites cell of the programs of a feature map
    cell, pid = next(iter(metadata_of(10)["feature_map"].items()))
    assert attrs(db, pid, "checkpoint_10")["cell"] == cell


@shared
def test_parents_come_before_children_in_insertion_order(imported: tuple[trellisdb.Database, Any]) -> None:
    db, _ = imported
    seq = {r["id"]: r["seq"] for r in db.sql("SELECT id, seq FROM nodes ORDER BY seq").to_pylist()}
    for p in all_programs().values():
        if p["parent_id"]:
            assert seq[p["parent_id"]] < seq[p["id"]]
    # and each node is written by the first checkpoint that holds it
    tags = db.tags()
    born = {r["id"]: r["born"] for r in db.sql("SELECT id, coalesce(born, commit_id) AS born FROM nodes").to_pylist()}
    first: dict[str, int] = {}
    for k in checkpoints():
        for pid in programs_of(k):
            first.setdefault(pid, k)
    assert born == {pid: tags[f"checkpoint_{k}"] for pid, k in first.items()}


@shared
def test_importing_again_adds_nothing(imported: tuple[trellisdb.Database, Any]) -> None:
    db, report = imported
    commits = len(db.log())
    for path in (RUN, CKPTS):  # the run folder or its checkpoints folder: the same source
        again = import_run(db, "openevolve", path, progress=False)
        assert again.imported == [] and again.commits == []
        assert again.skipped == report.imported
        assert again.source == str(RUN)
    assert len(db.log()) == commits


@shared
def test_a_corrupted_program_stops_at_its_checkpoint_naming_file_and_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(RUN, run)
    ks = checkpoints()
    k = ks[4]
    earlier = set().union(*(programs_of(j) for j in ks[:4]))
    fresh = sorted(set(programs_of(k)) - earlier)
    assert fresh
    bad = run / "checkpoints" / f"checkpoint_{k}" / "programs" / f"{fresh[0]}.json"
    text = bad.read_text()
    assert text.startswith("{")
    bad.write_text("{\n  oops, " + text[1:])  # a stray word on line 2, column 3
    db = trellisdb.connect(tmp_path / "db")
    with pytest.raises(ImportFormatError) as e:
        import_run(db, "openevolve", run, progress=False)
    assert f"{bad}:2:3: not valid JSON" in str(e.value)
    tags = db.tags()
    assert all(f"checkpoint_{j}" in tags for j in ks[:4]) and f"checkpoint_{k}" not in tags
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE id IN (SELECT unnest($f))",
                  params={"f": fresh}).to_pylist()[0]["n"] == 0
    assert labelled(db, "population", ks[3]) == set(programs_of(ks[3]))
    # repaired, the import goes on from there
    bad.write_text(text)
    report = import_run(db, "openevolve", run, progress=False)
    assert report.skipped == [f"checkpoint_{j}" for j in ks[:4]]
    assert report.imported == [f"checkpoint_{j}" for j in ks[4:]]
    assert labelled(db, "population", ks[-1]) == set(programs_of(ks[-1]))
    db.close()


@shared
def test_the_cli_imports_and_prints_a_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trellisdb.cli import main

    path = tmp_path / "db"
    args = ["--db", str(path), "import", "openevolve", str(RUN), "--no-progress"]
    assert main([*args, "--tag-prefix", "cp_", "--task", "circle-packing"]) == 0
    out = capsys.readouterr().out
    assert "imported 10 unit(s) of openevolve run" in out and "89 nodes" in out
    assert main([*args, "--tag-prefix", "cp_", "--task", "circle-packing"]) == 0
    assert "10 already imported (skipped)" in capsys.readouterr().out
    with trellisdb.connect(path) as db:
        assert "cp_checkpoint_50" in db.tags()
        assert db.sql("SELECT DISTINCT task_id FROM nodes").to_pylist() == [{"task_id": "circle-packing"}]


def measure(run: Path, tmp: Path) -> dict[str, float]:
    """Throughput of importing ``run``: nodes/s counted as distinct programs and as program
    appearances over the checkpoints, and the time next to ``db.ingest`` of the same tables."""
    from trellisdb.importers.units import _tables

    appearances = sum(len(list((d / "programs").glob("*.json"))) for d in (run / "checkpoints").glob("checkpoint_*"))
    t0 = time.perf_counter()
    parsed = list(oe.units(str(run)))
    parse_s = time.perf_counter() - t0
    with trellisdb.connect(tmp / "a") as db:
        t0 = time.perf_counter()
        report = import_run(db, "openevolve", run, progress=False)
        import_s = time.perf_counter() - t0
    with trellisdb.connect(tmp / "b") as db:
        tables = [_tables(db, u.rows, set()) for u in parsed]  # the same prepared Arrow tables, one commit each
        t0 = time.perf_counter()
        for t, u in zip(tables, parsed, strict=True):
            db.ingest(t, meta=u.meta)
        ingest_s = time.perf_counter() - t0
    nodes = report.nodes
    return {"nodes": nodes, "appearances": appearances, "commits": len(report.commits), "parse_s": parse_s,
            "import_s": import_s, "ingest_s": ingest_s, "nodes_per_s": nodes / import_s,
            "appearances_per_s": appearances / import_s, "parse_nodes_per_s": nodes / parse_s,
            "parse_appearances_per_s": appearances / parse_s, "ingest_nodes_per_s": nodes / ingest_s,
            "import_over_ingest": import_s / ingest_s}


@shared
def test_throughput_figures(tmp_path: Path) -> None:
    """Not a timed assertion: prints the figures (``pytest -s``)."""
    m = measure(RUN, tmp_path)
    print("\nopenevolve import: " + ", ".join(f"{k}={v:,.3f}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in m.items()))
    assert m["nodes"] == 89 and m["commits"] == 10


# ------------------------------------------------------------------ messy folders written here


def prog(pid: str, parent: str | None, it: int, ts: float, *, metrics: Any = None, metadata: Any = None,
         **extra: Any) -> dict[str, Any]:
    return {"id": pid, "code": f"# {pid}\nprint({it})\n", "language": "python", "parent_id": parent,
            "generation": it, "timestamp": ts, "iteration_found": it,
            "metrics": {"combined_score": it / 10} if metrics is None else metrics,
            "complexity": 0.0, "diversity": 0.0,
            "metadata": {"island": 0, "changes": f"change {pid}"} if metadata is None else metadata,
            "prompts": {"diff_user": {"system": "sys", "user": f"improve {parent}", "responses": [f"resp {pid}"]}},
            "artifacts_json": None, "artifact_dir": None, **extra}


def write_checkpoint(root: Path, k: int, programs: list[dict[str, Any]], meta: dict[str, Any] | str | None,
                     raw: dict[str, str] | None = None) -> Path:
    d = root / "checkpoints" / f"checkpoint_{k}"
    (d / "programs").mkdir(parents=True)
    for p in programs:
        (d / "programs" / f"{p['id']}.json").write_text(json.dumps(p, indent=2))
    for name, text in (raw or {}).items():
        (d / "programs" / name).write_text(text)
    if meta is not None:
        (d / "metadata.json").write_text(meta if isinstance(meta, str) else json.dumps(meta, indent=2))
        (d / "best_program_info.json").write_text(json.dumps({"saved_at": 1_700_000_000.0 + k}))
    return d


def md(k: int, islands: Any, archive: Any, best: str | None, feature_map: Any = None, **extra: Any) -> dict[str, Any]:
    return {"islands": islands, "archive": archive, "best_program_id": best, "last_iteration": k,
            "current_island": 0, "island_generations": [k, k], "last_migration_generation": 0,
            "feature_map": feature_map or {}, **extra}


@pytest.fixture
def messy(tmp_path: Path) -> Path:
    """A run folder with what real ones hold: migrants (iteration 0, child of their original),
    an eviction and re-addition, a parent that comes later, one that is nowhere, ids without
    files, Python-repr metadata, NaN metrics, leftover files, an incomplete last checkpoint."""
    run = tmp_path / "openevolve_output"
    root = prog("root", None, 0, 100.0)
    a = prog("a", "root", 3, 130.0, metrics={"combined_score": 0.5, "score": float("nan"), "timeout": False,
                                             "error": "boom"})
    mig = prog("a_migrant_1", "a", 0, 131.0, metadata="{'island': 1, 'migrant': True, 'changes': 'migrated'}")
    orphan = prog("orphan", "lost", 4, 140.0)
    write_checkpoint(run, 10, [root, a, mig, orphan],
                     md(10, "[{'root', 'a', 'orphan'}, ['a_migrant_1']]", ["a", "ghost"], "a",
                        {"1-2": "a", "0-0": "root", "3-3": "ghost"}))
    b = prog("b", "a", 12, 200.0)
    c = prog("c", "d", 15, 230.0)  # its parent d is first saved in checkpoint_30
    write_checkpoint(run, 20, [root, mig, orphan, b, c],
                     md(20, [["root", "b", "c", "orphan"], ["a_migrant_1"]], ["b"], "b", {"1-2": "b", "0-0": "root"}),
                     raw={".DS_Store": "x", "b.json.tmp": "{", "._b.json": "\x00\x01", "notes.txt": "hi"})
    d = prog("d", "root", 14, 220.0)
    write_checkpoint(run, 30, [root, a, mig, b, c, d],  # a is back (same file); orphan left
                     md(30, [["root", "a", "b", "c", "d"], ["a_migrant_1"]], ["b", "d"], "d", {"1-2": "b"},
                        island_best_programs=["d", "a_migrant_1"]))
    # leftovers of other runs and tools: none of them is a checkpoint
    (run / "checkpoints" / "checkpoint_5.bak" / "programs").mkdir(parents=True)
    (run / "checkpoints" / "checkpoint_latest").mkdir()
    (run / "checkpoints" / "checkpoint_010").mkdir()
    (run / "checkpoints" / "README.txt").write_text("old run")
    (run / "best").mkdir()
    # the last checkpoint is being written: programs, no metadata.json yet
    write_checkpoint(run, 40, [root, a, mig, b, c, d, prog("e", "d", 33, 300.0)], None)
    return run


def import_messy(db: trellisdb.Database, run: Path, **options: Any) -> Any:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = import_run(db, "openevolve", run, progress=False, **options)
    return report, [w for w in caught if issubclass(w.category, oe.IncompleteCheckpointWarning)]


def test_messy_run_memberships_lineage_and_order(messy: Path, tmp_path: Path) -> None:
    with trellisdb.connect(tmp_path / "db") as db:
        report, warned = import_messy(db, messy)
        assert report.imported == ["checkpoint_10", "checkpoint_20", "checkpoint_30"]
        assert len(warned) == 1 and "checkpoint_40" in str(warned[0].message)
        # memberships per checkpoint: islands from repr strings (a set, a list), dangling ids left out
        assert labelled(db, "population", 10) == {"root", "a", "a_migrant_1", "orphan"}
        assert labelled(db, "island_0", 10) == {"root", "a", "orphan"}
        assert labelled(db, "island_1", 10) == {"a_migrant_1"}
        assert labelled(db, "archive", 10) == {"a"}
        assert labelled(db, "best", 10) == {"a"}
        assert labelled(db, "feature_map", 10) == {"a", "root"}
        assert unit_meta(db, "checkpoint_10")["dangling"] == ["ghost"]
        assert labelled(db, "population", 20) == {"root", "a_migrant_1", "orphan", "b", "c"}
        assert labelled(db, "archive", 20) == {"b"} and labelled(db, "best", 20) == {"b"}
        assert labelled(db, "population", 30) == {"root", "a", "a_migrant_1", "b", "c", "d"}
        assert labelled(db, "best", 30) == {"d"} and labelled(db, "archive", 30) == {"b", "d"}
        assert labelled(db, "feature_map", 30) == {"b"}
        m30 = unit_meta(db, "checkpoint_30")
        assert m30["island_best_programs"] == ["d", "a_migrant_1"] and m30["dangling"] == []
        assert m30["saved_at"] == 1_700_000_030.0
        # nodes written once, at first appearance; the migrant (iteration 0) after its original
        order = [r["id"] for r in db.sql("SELECT id FROM nodes ORDER BY seq").to_pylist()]
        assert order == ["root", "a", "a_migrant_1", "orphan", "b", "c", "d"]
        assert db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist()[0]["n"] == 7
        # a re-added program: only its labels changed
        c30 = db.tags()["checkpoint_30"]
        back = db.sql("SELECT 'n' AS t FROM nodes_history WHERE id = 'a' AND commit_id = $c UNION ALL "
                      "SELECT label FROM labels_history WHERE node_id = 'a' AND commit_id = $c", params={"c": c30})
        assert sorted(r["t"] for r in back.to_pylist()) == ["island_0", "population"]
        # edges: d -> c written when d came (checkpoint_30); lost parent recorded on the child
        edges = {(r["src"], r["dst"]): r["commit_id"] for r in db.sql("SELECT * FROM edges").to_pylist()}
        assert set(edges) == {("root", "a"), ("a", "a_migrant_1"), ("a", "b"), ("d", "c"), ("root", "d")}
        assert edges[("d", "c")] == c30
        assert attrs(db, "orphan")["parent_id_missing"] == "lost"
        assert db.query("LINEAGE OF 'c' ANCESTORS RETURN id AS OF TAG 'checkpoint_30'").to_pylist() == [
            {"id": "c"}, {"id": "d"}, {"id": "root"}]
        # metrics: numbers are rewards; NaN, flags and texts are attributes; repr metadata read
        rewards = {r["channel"]: r["value"] for r in db.sql("SELECT * FROM rewards WHERE node_id = 'a'").to_pylist()}
        assert rewards == {"combined_score": 0.5}
        a = attrs(db, "a")
        assert (a["metric.score"], a["metric.timeout"], a["metric.error"]) == ("NaN", False, "boom")
        assert a["cell"] == "1-2"
        mig = attrs(db, "a_migrant_1")
        assert (mig["migrant"], mig["island"], mig["changes"]) == (True, 1, "migrated")
        node = db.sql("SELECT * FROM nodes WHERE id = 'b'").to_pylist()[0]
        assert node["event_time"].timestamp() == 200.0 and node["summary"] == "change b" and node["step"] == 12
        assert db.sql("SELECT id FROM sessions").to_pylist() == [{"id": "openevolve:openevolve_output"}]
        assert db.sql("SELECT id FROM tasks").to_pylist() == [{"id": "openevolve:openevolve_output"}]

        # the last checkpoint completes: importing again writes it alone
        (messy / "checkpoints" / "checkpoint_40" / "metadata.json").write_text(
            json.dumps(md(40, [["root", "a", "b", "c", "d", "e"], []], ["e"], "e")))
        report, warned = import_messy(db, messy)
        assert report.imported == ["checkpoint_40"] and report.nodes == 1 and not warned
        assert labelled(db, "island_1", 40) == set() and labelled(db, "population", 40) == {
            "root", "a", "a_migrant_1", "b", "c", "d", "e"}
        assert labelled(db, "island_1", 30) == {"a_migrant_1"}
        again, _ = import_messy(db, messy)
        assert again.imported == [] and len(again.skipped) == 4


def test_units_are_deterministic(messy: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = [(u.name, u.tag, u.meta, u.rows) for u in oe.units(str(messy))]
        two = [(u.name, u.tag, u.meta, u.rows) for u in oe.units(str(messy / "checkpoints"))]
    assert one == two


def test_malformed_metadata_is_an_error_naming_file_line_and_column(messy: Path, tmp_path: Path) -> None:
    bad = messy / "checkpoints" / "checkpoint_20" / "metadata.json"
    bad.write_text('{\n  "islands": [["root"]],\n  "archive": [,]\n}')
    with trellisdb.connect(tmp_path / "db") as db:
        with pytest.raises(ImportFormatError, match=re.escape(f"{bad}:3:15: not valid JSON")):
            import_messy(db, messy)
        assert "checkpoint_10" in db.tags() and "checkpoint_20" not in db.tags()
        assert db.sql("SELECT count(*) AS n FROM nodes WHERE id IN ('b', 'c')").to_pylist()[0]["n"] == 0


def test_missing_metadata_before_the_last_checkpoint_is_an_error(messy: Path, tmp_path: Path) -> None:
    (messy / "checkpoints" / "checkpoint_20" / "metadata.json").unlink()
    with trellisdb.connect(tmp_path / "db") as db, pytest.raises(ImportFormatError, match=re.escape("checkpoint_20/metadata.json")):
        import_messy(db, messy)


def test_a_program_file_named_for_another_id_is_an_error(messy: Path, tmp_path: Path) -> None:
    d = messy / "checkpoints" / "checkpoint_10" / "programs"
    shutil.copy(d / "root.json", d / "root (copy).json")
    with trellisdb.connect(tmp_path / "db") as db, pytest.raises(ImportFormatError, match=re.escape("root (copy).json")):
        import_messy(db, messy)


def test_one_checkpoint_folder_imports_that_checkpoint(messy: Path, tmp_path: Path) -> None:
    folder = messy / "checkpoints" / "checkpoint_20"
    with trellisdb.connect(tmp_path / "db") as db:
        report, _ = import_messy(db, folder, tag_prefix="only_")
        assert report.imported == ["checkpoint_20"] and report.source == str(folder)
        assert labelled(db, "population", "only_checkpoint_20") == {"root", "a_migrant_1", "orphan", "b", "c"}
        # parents not in this checkpoint: recorded on the child
        assert attrs(db, "b")["parent_id_missing"] == "a" and attrs(db, "c")["parent_id_missing"] == "d"


def test_layout_and_option_errors(messy: Path, tmp_path: Path) -> None:
    with trellisdb.connect(tmp_path / "db") as db:
        with pytest.raises(ImportFormatError, match="no OpenEvolve checkpoints"):
            import_run(db, "openevolve", messy / "best", progress=False)
        with pytest.raises(ImportFormatError, match="is a folder"):
            import_run(db, "openevolve", messy / "checkpoints" / "README.txt", progress=False)
        with pytest.raises(ValidationError, match="no option 'tag_prefx'"):
            import_run(db, "openevolve", messy, progress=False, tag_prefx="x")
        with pytest.raises(ValidationError, match="tag"):
            import_messy(db, messy, tag_prefix="bad\tprefix")
        assert db.log() == []


def test_meta_of_a_pathological_checkpoint_stays_under_the_limit() -> None:
    from trellisdb.rules import commit_meta

    meta = {"checkpoint": 7, "best_program_id": "x", "feature_stats": {f"f{i}": list(range(50)) for i in range(100)},
            "dangling": [f"{i:036d}" for i in range(5000)]}
    fitted = oe._fit(meta)
    assert len(json.dumps(fitted).encode()) <= 64 * 1024
    assert fitted["omitted"] == ["feature_stats"] and fitted["dangling_count"] == 5000
    assert fitted["dangling"] == meta["dangling"][: len(fitted["dangling"])] and fitted["dangling"]
    assert commit_meta(fitted) == fitted


def test_a_parent_imported_later_retracts_parent_id_missing(messy: Path, tmp_path: Path) -> None:
    """Importing checkpoints 10-20 and then 30 leaves the state importing all three at once does."""
    with trellisdb.connect(tmp_path / "whole") as whole:
        import_messy(whole, messy)
        want = whole.sql("SELECT entity, key, value FROM attributes ORDER BY entity, key").to_pylist()
        want_edges = whole.sql("SELECT src, dst FROM edges ORDER BY src, dst").to_pylist()
    later = tmp_path / "later"
    later.mkdir()
    for k in (30, 40):
        shutil.move(messy / "checkpoints" / f"checkpoint_{k}", later / f"checkpoint_{k}")
    with trellisdb.connect(tmp_path / "parts") as db:
        assert import_messy(db, messy)[0].imported == ["checkpoint_10", "checkpoint_20"]
        assert attrs(db, "c")["parent_id_missing"] == "d"  # d is nowhere yet
        for k in (30, 40):
            shutil.move(later / f"checkpoint_{k}", messy / "checkpoints" / f"checkpoint_{k}")
        assert import_messy(db, messy)[0].imported == ["checkpoint_30"]
        assert "parent_id_missing" not in attrs(db, "c")
        assert attrs(db, "c", as_of="checkpoint_20")["parent_id_missing"] == "d"  # history keeps what was known
        assert db.sql("SELECT entity, key, value FROM attributes ORDER BY entity, key").to_pylist() == want
        assert db.sql("SELECT src, dst FROM edges ORDER BY src, dst").to_pylist() == want_edges


def test_the_incomplete_checkpoint_warning_points_at_the_caller(messy: Path, tmp_path: Path) -> None:
    with trellisdb.connect(tmp_path / "db") as db:
        _, warned = import_messy(db, messy)
    assert len(warned) == 1 and warned[0].filename == __file__
    assert str(messy / "checkpoints" / "checkpoint_40") in str(warned[0].message)


def _edit_program(messy: Path, pid: str, text: str) -> Path:
    f = messy / "checkpoints" / "checkpoint_10" / "programs" / f"{pid}.json"
    f.write_text(text)
    return f


MESSY_PROGRAMS = [
    ("big_int", lambda p: json.dumps(p).replace('"generation": 3', '"generation": 1' + "0" * 5000),
     r"a\.json: JSON this reader cannot take \(Exceeds the limit"),
    ("deep", lambda p: json.dumps(p).replace('"generation": 3', '"generation": ' + "[" * 100_000 + "]" * 100_000),
     r"a\.json: JSON this reader cannot take \(values nested too deeply\)"),
    ("iteration", lambda p: json.dumps({**p, "iteration_found": 10**30}),
     r"a\.json: iteration_found is 1000000000000000000000000000000, not an iteration number"),
    ("timestamp", lambda p: json.dumps({**p, "timestamp": 10**400}),
     r"a\.json: timestamp is 1000.*, not seconds since the epoch"),
    ("responses", lambda p: json.dumps({**p, "prompts": {"diff_user": {"responses": 5}}}),
     r"a\.json: prompts\.diff_user\.responses is a int, not a list of texts"),
    ("changes", lambda p: json.dumps({**p, "metadata": {"changes": "bin \udc00"}}),
     r"a\.json: metadata\.changes is not valid UTF-8 text \(a lone surrogate"),
    ("key", lambda p: json.dumps({**p, "metadata": {"\udc00": 1}}), r"a\.json: metadata\[.*\] is not valid UTF-8"),
    ("repr", lambda p: json.dumps({**p, "metadata": "{'changes': '\\udc00'}"}),
     r"a\.json: metadata\.changes is not valid UTF-8"),
]


@pytest.mark.parametrize(("case", "edit", "pattern"), MESSY_PROGRAMS, ids=[m[0] for m in MESSY_PROGRAMS])
def test_messy_program_values_are_refused_naming_the_file(messy: Path, tmp_path: Path, case: str, edit: Any,
                                                          pattern: str) -> None:
    p = json.loads((messy / "checkpoints" / "checkpoint_10" / "programs" / "a.json").read_text())
    _edit_program(messy, "a", edit(p))
    with trellisdb.connect(tmp_path / "db") as db:
        with pytest.raises(ImportFormatError, match=pattern):
            import_messy(db, messy)
        assert db.log() == []


def test_numbers_beyond_a_double_and_odd_shapes(messy: Path, tmp_path: Path) -> None:
    p = json.loads((messy / "checkpoints" / "checkpoint_10" / "programs" / "a.json").read_text())
    p["metrics"]["huge"] = 10**400
    p["prompts"]["diff_user"]["responses"] = "one response, not in a list"
    _edit_program(messy, "a", json.dumps(p))
    with trellisdb.connect(tmp_path / "db") as db:
        import_messy(db, messy)
        assert attrs(db, "a", as_of="checkpoint_10")["metric.huge"] == str(10**400)  # kept as text: no double holds it
        names = {r["name"] for r in db.sql("SELECT name FROM node_artifacts WHERE node_id = 'a'", as_of="checkpoint_10").to_pylist()}
        assert "response/diff_user/0" in names and "response/diff_user/1" not in names
    meta = messy / "checkpoints" / "checkpoint_20" / "metadata.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "island_feature_maps": 5}))
    with trellisdb.connect(tmp_path / "db2") as db:
        with pytest.raises(ImportFormatError, match=r"checkpoint_20/metadata\.json: island_feature_maps is a int, "
                                                    r"not a list"):
            import_messy(db, messy)
        assert list(db.tags()) == ["checkpoint_10"]


def test_a_file_linking_outside_the_run_is_refused(messy: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps(prog("x", None, 1, 1.0)))
    (messy / "checkpoints" / "checkpoint_20" / "programs" / "x.json").symlink_to(secret)
    with trellisdb.connect(tmp_path / "db") as db:
        with pytest.raises(ImportFormatError, match=r"x\.json: a symbolic link to .*secret\.json, outside the folder"):
            import_messy(db, messy)
        assert db.log() == []


_LOOP = r"cannot be read: a symbolic link loop"


@pytest.mark.parametrize(("where", "make"), [
    ("the run folder", lambda run: (run / "loop", (run / "loop").symlink_to(run / "loop"))[0]),
    ("checkpoints/", lambda run: (shutil.rmtree(run / "checkpoints"), (run / "checkpoints").symlink_to("checkpoints"),
                                  run)[2]),
    ("a checkpoint_<k> folder", lambda run: (
        (run / "checkpoints" / "checkpoint_50").symlink_to("checkpoint_50"), run)[1]),
    ("programs/", lambda run: (shutil.rmtree(run / "checkpoints" / "checkpoint_20" / "programs"),
                               (run / "checkpoints" / "checkpoint_20" / "programs").symlink_to("programs"), run)[2]),
    ("a program file", lambda run: (
        (run / "checkpoints" / "checkpoint_20" / "programs" / "x.json").symlink_to("y.json"),
        (run / "checkpoints" / "checkpoint_20" / "programs" / "y.json").symlink_to("x.json"), run)[2]),
    ("metadata.json", lambda run: ((run / "checkpoints" / "checkpoint_40" / "metadata.json").symlink_to(
        "metadata.json"), run)[1]),
    ("best_program_info.json", lambda run: (
        (run / "checkpoints" / "checkpoint_10" / "best_program_info.json").unlink(),
        (run / "checkpoints" / "checkpoint_10" / "best_program_info.json").symlink_to("best_program_info.json"),
        run)[2]),
])
def test_a_symbolic_link_loop_is_an_import_error_naming_it(messy: Path, tmp_path: Path, where: str, make: Any) -> None:
    """A link loop anywhere in the run (issue 35): an ImportFormatError naming the link, at the
    call, before anything is written; not a raw OSError, not "no checkpoints", not "incomplete"."""
    path = make(messy)
    with trellisdb.connect(tmp_path / "db") as db:
        with pytest.raises(ImportFormatError, match=_LOOP) as e:
            import_messy(db, path)
        assert db.log() == []
    named = str(e.value).split(": cannot be read")[0]
    assert os.path.islink(named) and not os.path.exists(named), (where, str(e.value))


def test_a_link_to_nothing_is_named_not_passed_over(messy: Path, tmp_path: Path) -> None:
    gone = messy / "checkpoints" / "checkpoint_20" / "programs" / "x.json"
    gone.symlink_to(tmp_path / "deleted.json")
    with trellisdb.connect(tmp_path / "db") as db, pytest.raises(
            ImportFormatError, match=r"x\.json: a symbolic link to .*deleted\.json, which does not exist"):
        import_messy(db, messy)


@pytest.mark.parametrize(("fmt", "suffix"), [("swe-agent", ".traj"), ("jsonl", ".jsonl"), ("otel", ".json")])
def test_other_importers_name_a_symbolic_link_loop(tmp_path: Path, fmt: str, suffix: str) -> None:
    """The other importers refuse a looping file of the folder too, rather than passing over it
    (swe-agent, jsonl) or saying only what the system said (otel); so does a looping path given."""
    run = tmp_path / "run"
    run.mkdir()
    (run / f"a{suffix}").symlink_to(f"b{suffix}")
    (run / f"b{suffix}").symlink_to(f"a{suffix}")
    with trellisdb.connect(tmp_path / "db") as db:
        for path in (run, run / f"a{suffix}"):
            with pytest.raises(ImportFormatError, match=rf"[ab]{re.escape(suffix)}: {_LOOP}"):
                import_run(db, fmt, path, progress=False)
        assert db.log() == []
