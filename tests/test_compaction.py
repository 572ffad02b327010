"""Automatic and manual compaction keep scans fast and never change answers."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import lance

import trellisdb


def _fragments(path: Path, table: str) -> int:
    return len(lance.dataset(str(path / "tables" / f"{table}.lance")).get_fragments())


def test_many_small_commits_stay_compacted_and_time_travel_survives_cleanup(tmp_path: Path) -> None:
    p = tmp_path / "db"
    db = trellisdb.connect(p, embedding_dim=4, compact_fragments=16)
    s = db.session(task="t", agent="a")
    db.flush()
    q = "SELECT count(*) AS n, sum(value) AS total FROM rewards"
    answers = {}
    prev = None
    for i in range(120):
        with db.transaction() as tx:
            prev = s.add_node(id=f"n{i}", parents=[prev] if prev else [], summary=f"{i}")
            s.add_reward(prev, "score", float(i))
            if i > 0:
                s.add_reward(f"n{i - 1}", "score", float(i) + 0.5)  # re-score the previous node
        assert tx.commit_id is not None
        if i % 20 == 0:
            answers[tx.commit_id] = db.sql(q).to_pylist()
    # automatic compaction kept the fragment count bounded: every row is in
    # the smallest size tier, which never holds 16 fragments after a commit
    assert _fragments(p, "rewards") < 16
    assert _fragments(p, "nodes") < 16
    for cid, want in answers.items():
        assert db.sql(q, as_of=cid).to_pylist() == want
    # manual compaction with immediate cleanup of old physical versions
    db.compact(prune_older_than=dt.timedelta(0))
    assert _fragments(p, "rewards") == 1
    for cid, want in answers.items():
        assert db.sql(q, as_of=cid).to_pylist() == want
    versions = lance.dataset(str(p / "tables" / "rewards.lance")).versions()
    assert len(versions) <= 2
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 120}]


def test_auto_compact_off_leaves_fragments(tmp_path: Path) -> None:
    p = tmp_path / "db"
    db = trellisdb.connect(p, embedding_dim=4, auto_compact=False)
    db._committer.wal_max_rows = 0  # each commit appends to Lance (as big ones do)
    s = db.session(task="t", agent="a")
    for i in range(20):
        s.add_node(summary=str(i))
        db.flush()
    assert _fragments(p, "nodes") >= 20
    db.compact()
    assert _fragments(p, "nodes") == 1


def test_auto_compaction_leaves_large_fragments_alone(tmp_path: Path) -> None:
    """Size tiers: small commits merge with each other, never with a big fragment."""
    import random

    import pyarrow as pa

    p = tmp_path / "db"
    db = trellisdb.connect(p, embedding_dim=4, compact_fragments=4)
    s = db.session(task="t", agent="a")
    root = s.add_node(id="root")
    db.flush()
    n = 20_000
    rng = random.Random(0)
    db.ingest(
        {
            "rewards": pa.table(
                {
                    "node_id": ["root"] * n,
                    "channel": [f"c{i}" for i in range(n)],
                    "value": [float(i) for i in range(n)],
                    # incompressible text, so the fragment is big on disk (> the 1 MiB smallest tier)
                    "verifier": [f"{rng.getrandbits(128):032x}" * 4 for _ in range(n)],
                }
            )
        }
    )
    big = [f.fragment_id for f in lance.dataset(str(p / "tables" / "rewards.lance")).get_fragments()]
    assert len(big) == 1
    for i in range(12):
        s.add_reward(root, "late", float(i))
        db.flush()
    frags = lance.dataset(str(p / "tables" / "rewards.lance")).get_fragments()
    assert big[0] in [f.fragment_id for f in frags]  # never rewritten
    assert len(frags) <= 1 + 3  # the big one plus fewer than fanout small ones
    got = db.sql("SELECT count(*) AS n, max(value) AS v FROM rewards WHERE channel = 'late'").to_pylist()
    assert got == [{"n": 1, "v": 11.0}]
    assert db.sql("SELECT count(*) AS n FROM rewards_history").to_pylist() == [{"n": n + 12}]
