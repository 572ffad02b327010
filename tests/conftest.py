"""Shared fixtures, and how the test process ends."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import trellisdb

_STATUS: dict[str, int] = {}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _STATUS["exit"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """End the test process with pytest's status once every report is written, without the
    interpreter's teardown. Two fresh-clone CI runs (of many) aborted there (SIGABRT, no message,
    after every test had passed): one process that has opened hundreds of stores, servers,
    kernels and thread pools of native libraries (DuckDB, Lance, onnxruntime, uvloop) races their
    threads against module teardown. It never reproduced on demand (faulthandler on, 6 runs), so
    the culprit is unknown; the trellis processes CI runs after the tests (benchmarks, the demo)
    exit the normal way and would show it. Unreferenced handles are collected first, while
    everything they need still exists. ``TRELLIS_TEST_NORMAL_EXIT=1`` keeps the normal exit (to
    hunt the abort, with ``PYTHONFAULTHANDLER=1``)."""
    if "exit" not in _STATUS or os.environ.get("TRELLIS_TEST_NORMAL_EXIT"):
        return
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_STATUS["exit"])


@pytest.fixture
def db(tmp_path: Path) -> Iterator[trellisdb.Database]:
    """A fresh database with 4-dimensional embeddings, closed after the test."""
    database = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    try:
        yield database
    finally:
        database.close()


#   r ─┬─ a ─┬─ c (crossover of a and b)     scores: r .1  a .5  b .7  c .9  d .3
#      │     └─ d                                      e .95 (written after tag "early")
#      └─ b ─┬─ c
#            └─ e   (e also inspired_by-> r)


@pytest.fixture(scope="module")
def g(tmp_path_factory: pytest.TempPathFactory) -> Iterator[trellisdb.Database]:
    db = trellisdb.connect(tmp_path_factory.mktemp("tql") / "db", embedding_dim=4)
    s = db.session(task="t", agent="a", id="s1")
    s2 = db.session(task="t", agent="b", id="s2")
    with db.transaction():
        for nid, parents, score in (("r", [], 0.1), ("a", ["r"], 0.5), ("b", ["r"], 0.7), ("d", ["a"], 0.3)):
            s.add_node(id=nid, parents=parents, summary=f"node {nid}")
            s.add_reward(nid, "score", score)
        s.add_node(id="c", parents=["a", "b"], edge_kind="crossover_of", summary="node c")
        s.add_reward("c", "score", 0.9)
        s2.add_node(id="x", summary="other session")
        s2.add_reward("x", "score", 0.8)
    db.tag("early")
    with db.transaction():
        s.add_node(id="e", parents=["b"], summary="node e")
        s.add_reward("e", "score", 0.95)
        s.add_edge("e", "r", "inspired_by")
        s.add_reward("d", "score", 0.35)  # re-scored later
    yield db
    db.close()
