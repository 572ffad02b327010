"""Training-data view benchmarks, each figure a ratio against a baseline measured in the same run.

    .venv/bin/python benchmarks/bench_views.py --smoke              # tiny, CI
    .venv/bin/python benchmarks/bench_views.py --nodes 1000000      # by hand (issue 5's size)

1. materializing preference pairs and GRPO groups (``db.materialize``: the
   SQL over the snapshot, the texts the rows name resolved, rows and texts
   written to Lance) vs hand-written DuckDB SQL computing the same rows from
   the tables in Parquet, its result written to Parquet too (target <= 1.3x):
   with the texts joined from a Parquet copy of the artifacts (the same rows,
   texts included), and without them (hashes only, as views stored before
   they kept their texts); the rows are checked equal;
2. export throughput: ``db.export(..., "parquet")`` vs pyarrow writing the
   same table (target >= 0.8x), and the TRL JSONL export vs polars writing
   the same layout (reported); 2b. end to end, materialize + export Parquet
   vs the hand SQL with the texts joined from a Parquet copy of the artifacts,
   written by pyarrow (reported);
3. refresh after 1% new data (new sessions, plus re-scores of 0.1% of the old
   nodes) vs a full rebuild at the same commit (target <= 0.1x).

The store comes from the calibrated generator (benchmarks/generator.py) with
small ``prompt`` / ``response`` artifacts and 8-d embeddings (neither matters
to the views). Writes ``benchmarks/out/views_<n>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import duckdb  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from generator import ExperienceGraph, GeneratorConfig  # noqa: E402

import trellisdb  # noqa: E402
from trellisdb.training import export as export_mod  # noqa: E402
from trellisdb.training.kinds import ROW_KEYS  # noqa: E402

CH = "combined_score"
#: The texts each view's rows name (joined to the hand SQL's rows by their ``<col>_hash``).
TEXT_COLUMNS = {"preference": ("system", "prompt", "chosen", "rejected"), "grpo": ("prompt",)}
LINEAGE = "('derived_from', 'repair_of', 'crossover_of')"

#: The same rows as the views, written by hand over Parquet copies of the current tables
#: (each node's artifact hashes by one join per name, as the views' SQL does since run Z).
HAND = {
    "preference": f"""
        WITH a AS (
          SELECT n.id, n.task_id, r.value AS reward, s.hash AS system_hash, q.hash AS prompt_hash,
                 x.hash AS response_hash
          FROM nodes n JOIN rewards r ON r.node_id = n.id AND r.channel = '{CH}'
          LEFT JOIN node_artifacts s ON s.node_id = n.id AND s.name = 'system_prompt'
          LEFT JOIN node_artifacts q ON q.node_id = n.id AND q.name = 'prompt'
          LEFT JOIN node_artifacts x ON x.node_id = n.id AND x.name = 'response'),
        g AS (SELECT a.*, e.src AS grp FROM a JOIN (SELECT DISTINCT src, dst FROM edges
              WHERE kind IN {LINEAGE}) e ON e.dst = a.id),
        p AS (SELECT c.id AS chosen_id, r.id AS rejected_id, min(c.grp) AS group_key,
                     any_value(c.reward - r.reward) AS margin
              FROM g c JOIN g r ON c.grp = r.grp AND c.reward > r.reward AND c.reward - r.reward >= 0.05
              GROUP BY c.id, r.id)
        SELECT p.*, c.task_id, c.system_hash, c.prompt_hash, c.response_hash AS chosen_hash,
               x.response_hash AS rejected_hash, [p.chosen_id, p.rejected_id] AS node_ids
        FROM p JOIN a c ON c.id = p.chosen_id JOIN a x ON x.id = p.rejected_id""",
    "grpo": f"""
        WITH a AS (
          SELECT n.id, n.task_id, r.value AS reward, q.hash AS prompt_hash
          FROM nodes n JOIN rewards r ON r.node_id = n.id AND r.channel = '{CH}'
          LEFT JOIN node_artifacts q ON q.node_id = n.id AND q.name = 'prompt'),
        g AS (SELECT a.*, e.src AS grp FROM a JOIN (SELECT DISTINCT src, dst FROM edges
              WHERE kind IN {LINEAGE}) e ON e.dst = a.id),
        st AS (SELECT grp, avg(reward) AS m, stddev_pop(reward) AS sd, count(*) AS n FROM g GROUP BY grp),
        gg AS (SELECT g.*, m, sd, CASE WHEN sd > 0 THEN (reward - m) / sd ELSE 0.0 END AS adv
               FROM g JOIN st USING (grp) WHERE n >= 2),
        pc AS (SELECT grp, prompt_hash, count(*) AS n FROM gg GROUP BY grp, prompt_hash),
        gp AS (SELECT grp, arg_min(prompt_hash, (-n, prompt_hash)) AS prompt_hash FROM pc GROUP BY grp)
        SELECT gg.grp AS group_key, min(task_id) AS task_id, count(*) AS size, any_value(m) AS mean,
               any_value(sd) AS std, any_value(gp.prompt_hash) AS prompt_hash, list(id ORDER BY id) AS node_ids,
               list(reward ORDER BY id) AS rewards, list(adv ORDER BY id) AS advantages
        FROM gg JOIN gp USING (grp) GROUP BY gg.grp""",
}


def with_texts(kind: str) -> str:
    """The hand SQL of ``kind`` with the texts its rows name joined from the artifacts."""
    cols = TEXT_COLUMNS[kind]
    return (f"WITH p AS ({HAND[kind]}) SELECT p.*, " + ", ".join(f"{c}.text AS {c}" for c in cols) + " FROM p "
            + " ".join(f"LEFT JOIN artifacts {c} ON {c}.hash = p.{c}_hash" for c in cols))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def alternating(reps: int, *fns: Callable[[], Any]) -> list[tuple[float, Any]]:
    """For each of ``fns``, the median time of ``reps`` runs and its last result; the runs take
    turns, so a slow spell of this shared machine slows every side of a ratio, not one."""
    ts: list[list[float]] = [[] for _ in fns]
    outs: list[Any] = [None] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            outs[i] = fn()
            ts[i].append(time.perf_counter() - t0)
    return [(statistics.median(t), o) for t, o in zip(ts, outs, strict=True)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--work", default="/tmp/trellis-bench-views")
    args = ap.parse_args(argv)
    nodes, reps = (3000, 2) if args.smoke else (args.nodes, args.reps)
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    extra = max(100, nodes // 100)  # the 1% that arrives after the first materialization
    cfg = GeneratorConfig.for_nodes(nodes + extra, embedding_dim=8, artifact_names=("prompt", "response"),
                                    artifact_bytes=64, tasks=10)
    g = ExperienceGraph(cfg)
    first = (nodes // cfg.nodes_per_session) * cfg.nodes_per_session
    db = trellisdb.connect(os.path.join(args.work, "v.db"), embedding_dim=8, auto_index=False)
    log(f"ingesting {first} nodes (+{g.n_nodes - first} later)")
    for a in range(0, first, 50_000):
        db.ingest(g.chunk(a, min(a + 50_000, first)), message=f"nodes {a}..")
    pdir = os.path.join(args.work, "parquet")
    os.makedirs(pdir)
    for t in ("nodes", "edges", "rewards", "node_artifacts"):
        pq.write_table(db.sql(f"SELECT * FROM {t}").to_arrow(), os.path.join(pdir, f"{t}.parquet"))
    # the hand SQL on a stock DuckDB; and on one that keeps its memory as the store's does
    # (connect(keep_memory=...)): the same engine with the same allocator setting (reported)
    con = duckdb.connect()
    kept_con = duckdb.connect(config={"block_allocator_memory": f"{db._store.engine.kept_memory} bytes"})
    # the artifacts' texts, for the end-to-end baseline (figure 2b)
    pq.write_table(db.sql("SELECT hash, decode(content) AS text FROM artifacts_full").to_arrow(),
                   os.path.join(pdir, "artifacts.parquet"))
    for t in ("nodes", "edges", "rewards", "node_artifacts", "artifacts"):
        for c in (con, kept_con):
            c.execute(f"CREATE VIEW {t} AS SELECT * FROM read_parquet('{os.path.join(pdir, t)}.parquet')")
    res: dict[str, Any] = {"nodes": first, "later": g.n_nodes - first}
    rows: list[dict[str, Any]] = []

    db.create_view("pairs", "preference", reward=f"reward('{CH}')", margin=0.05, pairs_from=["siblings"])
    db.create_view("groups", "grpo", reward=f"reward('{CH}')")
    for name, kind in (("pairs", "preference"), ("groups", "grpo")):
        log(f"1. materialize {kind}")
        target = os.path.join(args.work, f"hand_{kind}.parquet")

        def hand(q: str, out: str = target, c: duckdb.DuckDBPyConnection = con) -> pa.Table:
            t = c.sql(q).to_arrow_table()
            pq.write_table(t, out)
            return t

        (ours, entry), (base, t), (full, tt), (kept_full, _) = alternating(
            reps, lambda n=name: db.materialize(n), lambda k=kind: hand(HAND[k]), lambda k=kind: hand(with_texts(k)),
            lambda k=kind: hand(with_texts(k), c=kept_con))
        mine = db.view(name).to_arrow()
        keys = ROW_KEYS[kind]
        same = t.num_rows == mine.num_rows and t.select(list(keys)).sort_by([(k, "ascending") for k in keys]).equals(
            mine.select(list(keys)))
        assert same, f"{kind}: hand SQL gives {t.num_rows} rows, the view {mine.num_rows}"
        assert tt.num_rows == mine.num_rows
        rows.append({"measure": f"materialize {kind} ({entry['rows']} rows, {entry['texts']} texts) vs hand SQL "
                     "+ texts joined (the same rows)", "mine_s": ours, "base_s": full, "ratio": ours / full,
                     "target": "<= 1.3"})
        rows.append({"measure": f"materialize {kind} vs hand SQL, hashes only (no texts)",
                     "mine_s": ours, "base_s": base, "ratio": ours / base, "target": "(reported)"})
        rows.append({"measure": f"materialize {kind} vs hand SQL + texts on a DuckDB keeping its memory likewise",
                     "mine_s": ours, "base_s": kept_full, "ratio": ours / kept_full, "target": "(reported)"})

    log("2. export")
    out = os.path.join(args.work, "export")
    man = db.export("pairs", out, "parquet", overwrite=True)
    # the exported rows as one table (a large split comes in shards, written in parallel)
    table = pa.concat_tables([pq.read_table(os.path.join(out, f)) for f in man["files"]["train"]])
    (ours, man), (base, _) = alternating(reps, lambda: db.export("pairs", out, "parquet", overwrite=True),
                                         lambda: pq.write_table(table, os.path.join(args.work, "same.parquet")))
    rows.append({"measure": f"export parquet ({man['rows']} rows, {len(man['files']['train'])} file(s), rows/s) "
                 "vs pyarrow write_table", "mine_s": ours,
                 "base_s": base, "ratio": base / ours, "target": ">= 0.8 (throughput)"})
    layout = export_mod._layout("trl", "preference", table)
    (ours, man), (base, _) = alternating(reps, lambda: db.export("pairs", out, "trl", overwrite=True),
                                         lambda: layout.write_ndjson(os.path.join(args.work, "same.jsonl")))
    rows.append({"measure": f"export trl jsonl ({man['rows']} rows) vs polars write_ndjson of the layout",
                 "mine_s": ours, "base_s": base, "ratio": base / ours, "target": "(reported, throughput)"})

    log("2b. end to end: materialize + export parquet")
    def hand_e2e() -> pa.Table:
        t = con.sql(with_texts("preference")).to_arrow_table()
        pq.write_table(t, os.path.join(args.work, "same_e2e.parquet"))
        return t

    def ours_e2e() -> dict[str, Any]:
        db.materialize("pairs")
        return db.export("pairs", out, "parquet", overwrite=True)

    (ours, man), (base, t) = alternating(reps, ours_e2e, hand_e2e)
    mine = pa.concat_tables([pq.read_table(os.path.join(out, f)) for f in man["files"]["train"]])
    key = ["chosen_id", "rejected_id", "system", "prompt", "chosen", "rejected"]
    assert t.select(key).sort_by([(k, "ascending") for k in key[:2]]).equals(mine.select(key)), "end to end differs"
    rows.append({"measure": "end to end: materialize + export parquet vs hand SQL + texts joined + write_table",
                 "mine_s": ours, "base_s": base, "ratio": ours / base, "target": "(reported)"})

    log("3. refresh after 1% new data")
    before = db.log()[-1]["id"]
    db.ingest(g.chunk(first, g.n_nodes), message="the later 1%")
    old = db.sql(f"SELECT node_id FROM rewards WHERE channel = '{CH}' ORDER BY node_id").to_arrow()["node_id"]
    rng = np.random.default_rng(0)
    pick = rng.choice(len(old), max(1, first // 1000), replace=False)
    db.ingest({"rewards": pa.table({"node_id": old.take(pa.array(pick)), "channel": [CH] * len(pick),
                                    "value": rng.random(len(pick))})}, message="re-scores")
    for name in ("pairs", "groups"):
        entry = None

        def again(n: str = name) -> dict[str, Any]:
            db.materialize(n, as_of=before)  # back to the old state, untimed below
            t0 = time.perf_counter()
            e = db.refresh(n)
            e["_s"] = time.perf_counter() - t0
            return e

        ts, fulls = [], []
        for _ in range(reps):  # taking turns, as alternating() does
            entry = again()
            ts.append(entry["_s"])
            refreshed = db.view(name).to_arrow()
            t0 = time.perf_counter()
            db.materialize(name)
            fulls.append(time.perf_counter() - t0)
            assert db.view(name).to_arrow().equals(refreshed), f"{name}: refresh differs from the rebuild"
        ours, full = statistics.median(ts), statistics.median(fulls)
        assert entry is not None
        rows.append({"measure": f"refresh {name} after 1% new data vs full rebuild ({entry['how']})",
                     "mine_s": ours, "base_s": full, "ratio": ours / full, "target": "<= 0.1"})

    log("4. kept memory: a refresh right after a materialization, keep_memory default vs 0")
    # a second handle on the same store whose DuckDB hands its memory back after each query
    # (DuckDB's default); each side materializes (untimed) and then refreshes, taking turns
    bare = trellisdb.connect(os.path.join(args.work, "v.db"), keep_memory=0)

    def after_materialize(handle: trellisdb.Database) -> Callable[[], dict[str, Any]]:
        def go() -> dict[str, Any]:
            handle.materialize("groups", as_of=before)
            t0 = time.perf_counter()
            e = handle.refresh("groups")
            e["_s"] = time.perf_counter() - t0
            return e
        return go

    kept_ts, bare_ts = [], []
    for _ in range(reps):
        kept_ts.append(after_materialize(db)()["_s"])
        bare_ts.append(after_materialize(bare)()["_s"])
    bare.close()
    ours, base = statistics.median(kept_ts), statistics.median(bare_ts)
    rows.append({"measure": f"refresh groups after a materialize, keep_memory={db._store.engine.kept_memory >> 20} MiB "
                 "vs keep_memory=0", "mine_s": ours, "base_s": base, "ratio": ours / base, "target": "(reported)"})
    res["rows"] = rows
    os.makedirs(os.path.join(HERE, "out"), exist_ok=True)
    name = "views_smoke.json" if args.smoke else f"views_{first}.json"
    with open(os.path.join(HERE, "out", name), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(f"\ntrellisdb view benchmark: {first} nodes (+{g.n_nodes - first}){' (smoke)' if args.smoke else ''}")
    print(f"{'measure':90} {'trellisdb s':>11} {'baseline s':>11} {'ratio':>6}  target")
    for r in rows:
        print(f"{r['measure'][:90]:90} {r['mine_s']:11.3f} {r['base_s']:11.3f} {r['ratio']:6.2f}  {r['target']}")
    db.close()
    shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
