"""TQL on the real OpenEvolve circle-packing run, checked against the JSON files by hand."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import trellisdb

from . import openevolve

pytestmark = pytest.mark.skipif(not openevolve.available(), reason="../shared/data is not present")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[trellisdb.Database, dict[str, Any]]]:
    db = trellisdb.connect(tmp_path_factory.mktemp("oe") / "db", embedding_dim=4)
    progs = openevolve.load(db)
    yield db, progs
    db.close()


def test_frontier_by_combined_score_matches_the_json(loaded: tuple[trellisdb.Database, dict[str, Any]]) -> None:
    db, progs = loaded
    parents = {p["parent_id"] for _, p in progs.values() if p.get("parent_id")}
    leaves = [(it, p) for it, p in progs.values() if p["id"] not in parents]
    # rank: combined_score descending, ties by the commit (checkpoint) that wrote it, then id
    def key(x: tuple[int, dict[str, Any]]) -> tuple[bool, float, int, str]:
        score = x[1]["metrics"].get("combined_score")  # a failed program has none: it ranks last
        return (score is None, -(score or 0.0), x[0], x[1]["id"])

    want = [p["id"] for it, p in sorted(leaves, key=key)]
    got = db.query("FRONTIER RANK BY reward('combined_score') DESC LIMIT 10 RETURN id, reward('combined_score')")
    assert [r["id"] for r in got.to_pylist()] == want[:10]
    assert [r["combined_score"] for r in got.to_pylist()] == [
        progs[i][1]["metrics"].get("combined_score") for i in want[:10]]


def test_lineage_of_the_best_program_is_its_parent_chain(loaded: tuple[trellisdb.Database, dict[str, Any]]) -> None:
    db, progs = loaded
    best = max(progs.values(), key=lambda x: x[1]["metrics"].get("combined_score", -1.0))[1]["id"]
    chain = [best]
    while progs[chain[-1]][1].get("parent_id"):
        chain.append(progs[chain[-1]][1]["parent_id"])
    res = db.query("LINEAGE OF $id ANCESTORS RETURN id, hop", id=best).to_pylist()
    assert [r["id"] for r in res] == chain
    assert [r["hop"] for r in res] == list(range(len(chain)))
    g = db.query("LINEAGE OF $id ANCESTORS", id=best).to_networkx()
    assert sorted(g.edges()) == sorted(zip(chain[1:], chain[:-1], strict=True))


def test_as_of_an_early_checkpoint_hides_later_programs_and_rewards(
    loaded: tuple[trellisdb.Database, dict[str, Any]],
) -> None:
    db, progs = loaded
    first = min(it for it, _ in progs.values())
    early_ids = sorted(i for i, (it, _) in progs.items() if it == first)
    got = db.query(f"NODES RETURN id AS OF TAG 'checkpoint_{first}'").to_pylist()
    assert sorted(r["id"] for r in got) == early_ids
    n_rewards = db.query(f"REWARDS RETURN node_id AS OF TAG 'checkpoint_{first}'").to_pylist()
    assert len(n_rewards) == sum(len(openevolve.numeric_metrics(progs[i][1])) for i in early_ids)
    later = [i for i, (it, _) in progs.items() if it > first]
    assert later, "the run has programs after the first checkpoint"
    with pytest.raises(trellisdb.UnknownNodeError):
        db.query(f"LINEAGE OF $id ANCESTORS AS OF TAG 'checkpoint_{first}'", id=later[0])
    # the frontier as of then only ranks what existed then
    fr = db.query(f"FRONTIER RANK BY reward('combined_score') DESC RETURN id AS OF TAG 'checkpoint_{first}'")
    assert {r["id"] for r in fr.to_pylist()} <= set(early_ids)
