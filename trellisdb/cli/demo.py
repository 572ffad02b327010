"""`trellis demo`: a small simulated mutate-and-score search written into the store.

Several sessions evolve programs on one task: each step picks a parent among the
best nodes so far (a query), writes a child with a code artifact, scores it on
several reward channels, and sometimes re-scores an older node late. Then it
prints what it wrote, answers a time-travel question, and seeds a new session
from the earlier ones by retrieval: the attempts most similar to its plan (MiniLM
embeddings, computed offline) with their lineage.
"""

from __future__ import annotations

import random

from trellisdb.cli.output import format_table
from trellisdb.database import Database, open_local

IDEAS = (
    "greedy placement of circles along the border",
    "hexagonal lattice packing with jitter",
    "optimize all radii with scipy minimize",
    "random restarts keeping the best layout",
    "shrink overlapping circles then grow them again",
    "place large circles in the corners first",
    "simulated annealing over circle centers",
    "grid of equal circles as a starting point",
)


def run_demo(path: str, *, sessions: int = 3, steps: int = 12, seed: int = 7) -> None:
    rng = random.Random(seed)
    db = open_local(path)
    task = "circle-packing-26"
    db.add_task(task, name="pack 26 circles in a unit square", spec="maximize the sum of radii")
    halfway_tag = None
    for si in range(sessions):
        with db.session(task=task, agent="demo-evolver", model="sim-1", config={"seed": seed + si}) as s:
            best = db.sql(
                "SELECT n.id, r.value FROM nodes n JOIN rewards r ON r.node_id = n.id "
                "WHERE r.channel = 'combined_score' AND n.task_id = $1 ORDER BY r.value DESC, n.id LIMIT 3",
                params=[task],
            ).to_pylist()
            parents = [b["id"] for b in best]
            root = s.add_node(
                parents=parents[:1],
                summary=f"session {si}: start" + (" from the best earlier program" if parents else ""),
                artifacts={"code": f"def pack():\n    return []  # session {si}\n"},
                cost={"tokens_in": 800, "tokens_out": 300, "seconds": 2.0},
            )
            pool = [(root, 0.2 + 0.1 * si)]
            s.add_reward(root, "combined_score", pool[0][1], verifier="sim-eval")
            for step in range(steps):
                parent, pscore = max(rng.sample(pool, k=min(2, len(pool))), key=lambda p: p[1])
                child = s.add_node(
                    parents=[parent],
                    summary=f"{rng.choice(IDEAS)} (mutation {step} of {parent[-6:]})",
                    artifacts={"code": f"def pack():\n    return {rng.random():.6f}\n"},
                    cost={"tokens_in": 900, "tokens_out": 400, "seconds": rng.uniform(1, 4)},
                )
                valid = rng.random() > 0.15
                score = max(0.0, pscore + rng.gauss(0.02, 0.05)) if valid else 0.0
                s.add_reward(child, "validity", 1.0 if valid else 0.0, verifier="sim-eval")
                s.add_reward(child, "combined_score", round(score, 4), verifier="sim-eval")
                s.add_reward(child, "eval_time", round(rng.uniform(0.5, 2.0), 3), verifier="sim-eval")
                s.set_status(child, "evaluated" if valid else "failed")
                s.set_status(parent, "expanded")
                pool.append((child, score))
                if step % 4 == 3:
                    db.flush()  # one commit per few steps, as an agent checkpoint would
            late = pool[len(pool) // 2][0]
            s.add_reward(late, "judge", rng.uniform(0, 1), verifier="late-judge")  # a late verifier result
        if si == 0:
            halfway_tag = "after-session-0"
            db.tag(halfway_tag)

    print(f"wrote {len(db.log())} commits into {path}\n")
    print(
        format_table(
            db.sql(
                "SELECT s.id AS session, count(n.id) AS nodes, max(r.value) AS best_score "
                "FROM sessions s JOIN nodes n ON n.session_id = s.id "
                "LEFT JOIN rewards r ON r.node_id = n.id AND r.channel = 'combined_score' "
                "GROUP BY s.id ORDER BY min(n.commit_id)"
            ).to_arrow(),
            "table",
        )
    )
    q = "NODES WHERE reward('combined_score') IS NOT NULL ORDER BY reward('combined_score') DESC LIMIT 3 " \
        "RETURN id, summary, reward('combined_score')"
    print(f"\nbest programs now:\n  trellis query \"{q}\"")
    print(format_table(db.query(q).to_arrow(), "table"))
    print(f"\nbest programs AS OF TAG {halfway_tag!r} (what the agent knew then):")
    print(format_table(db.query(f"{q} AS OF TAG $tag", tag=halfway_tag).to_arrow(), "table"))
    fq = "FRONTIER RANK BY ucb(reward('combined_score'), visits, 0.5) DESC PER SESSION 1 LIMIT 3 RETURN id, session_id"
    print(f"\nwhat to expand next, one per session:\n  trellis query \"{fq}\"")
    print(format_table(db.query(fq).to_arrow(), "table"))
    best = db.query(q).to_pylist()[0]["id"]
    print(f"\nwhere the best program came from:\n  trellis query \"LINEAGE OF '{best}' ANCESTORS RETURN id, hop, summary\"")
    print(format_table(db.query("LINEAGE OF $n ANCESTORS RETURN id, hop, summary", n=best).to_arrow(), "table"))
    seed_new_session(db, task)
    db.close()


def seed_new_session(db: Database, task: str) -> None:
    """Cross-session reuse: embed the attempts, retrieve the ones like a new plan, start from the best."""
    from trellisdb.embed import MiniLM, minilm_dir
    from trellisdb.errors import EmbedderError

    try:
        minilm_dir()
    except EmbedderError as e:
        print(f"\n(skipping retrieval: {e})")
        return
    db.create_space("minilm", embedder=MiniLM())
    n = db.embed("minilm")
    plan = "pack the circles on a hexagonal lattice"
    rq = ("RETRIEVE 3 SIMILAR TO $plan IN minilm WHERE reward('combined_score') > 0 EXPAND ANCESTORS 1 "
          "RETURN id, relation, seed_rank, hop, round(score, 3) AS similarity, reward('combined_score') AS score, "
          "summary")
    print(f"\nembedded {n} new attempts into space 'minilm' (all-MiniLM-L6-v2, offline). A new session plans "
          f"{plan!r};\nthe most similar scored attempts of every earlier session, with their parents:\n"
          f"  trellis query \"{rq.replace('$plan', repr(plan))}\"")
    found = db.query(rq, plan=plan)
    print(format_table(found.to_arrow(), "table"))
    seeds = [r for r in found.to_pylist() if r["relation"] == "seed"]
    start = max(seeds, key=lambda r: r["score"])
    with db.session(task=task, agent="demo-evolver", model="sim-1") as s:
        root = s.add_node(parents=[start["id"]], edge_kind="retrieved", summary=f"{plan}, starting from {start['id']}")
    print(f"\nnew session {s.id} starts at node {root}, linked to {start['id']} by a 'retrieved' edge")
