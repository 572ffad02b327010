"""Explicit node ids (issue 24): ``add_node(id=...)`` learns whether the id exists from
the fingerprints of the committed ids, with no query for a new one; a retry still matches
its original, and ids other handles and processes committed are found."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest

import trellisdb
from trellisdb.committer import Committer
from trellisdb.membership import fingerprint, id_hash

ODD_IDS = ["héllo", "节点-ß-😀", "ünï/côdé 1", "ф" * 60]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    p = tmp_path / "db"
    trellisdb.connect(p, embedding_dim=4).close()
    return p


@pytest.fixture
def db(path: Path) -> Iterator[trellisdb.Database]:
    d = trellisdb.connect(path)
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts of the by-id node queries (``nodes_full_history``) run from now on."""
    seen: list[str] = []
    real = Committer.lookup

    def counting(self: Committer, text: str, params: list[Any]) -> list[dict[str, Any]]:
        if "nodes_full_history" in text:
            seen.append(text)
        return real(self, text, params)

    monkeypatch.setattr(Committer, "lookup", counting)
    return seen


def count(db: trellisdb.Database, node_id: str) -> int:
    return int(db.sql("SELECT count(*) AS n FROM nodes_history WHERE id = $1", params=[node_id])
               .to_pylist()[0]["n"])


# ------------------------------------------------------------ retries


@pytest.mark.parametrize("flushed", [False, True])
def test_retry_with_same_content_is_idempotent(db: trellisdb.Database, flushed: bool) -> None:
    s = db.session(task="t", agent="a")
    s.add_node(id="root", summary="root")
    assert s.add_node(id="a", parents=["root"], summary="x", step=3) == "a"
    if flushed:
        db.flush()
    assert s.add_node(id="a", parents=["root"], summary="x", step=3) == "a"
    db.flush()
    assert count(db, "a") == 1


@pytest.mark.parametrize("flushed", [False, True])
def test_retry_with_other_content_is_refused(db: trellisdb.Database, flushed: bool) -> None:
    s = db.session(task="t", agent="a")
    s.add_node(id="root", summary="root")
    s.add_node(id="a", parents=["root"], summary="x")
    if flushed:
        db.flush()
    with pytest.raises(trellisdb.DuplicateIdError, match=r"'a'.*summary"):
        s.add_node(id="a", parents=["root"], summary="y")
    with pytest.raises(trellisdb.DuplicateIdError, match="'a'"):
        s.add_node(id="a", summary="x")  # the parents differ
    db.flush()
    assert count(db, "a") == 1


def test_retry_in_a_transaction(db: trellisdb.Database) -> None:
    s = db.session(task="t", agent="a")
    with db.transaction():
        s.add_node(id="a", summary="x")
        assert s.add_node(id="a", summary="x") == "a"
        with pytest.raises(trellisdb.DuplicateIdError):
            s.add_node(id="a", summary="y")
    with db.transaction():
        assert s.add_node(id="a", summary="x") == "a"  # committed by the first transaction
        with pytest.raises(trellisdb.DuplicateIdError):
            s.add_node(id="a", summary="y")
    assert count(db, "a") == 1


def test_ids_of_ingest_and_generated_ids_are_known(db: trellisdb.Database) -> None:
    s = db.session(task="t", agent="a")
    gen = s.add_node(summary="generated")
    s.add_node(id="first", summary="loads the fingerprints")
    db.flush()
    s2 = db.session(task="t", agent="b", id="s2")
    db.flush()
    db.ingest({"nodes": pa.table({"id": ["bulk"], "session_id": ["s2"], "task_id": ["t"]})})
    for node_id in (gen, "bulk"):
        with pytest.raises(trellisdb.DuplicateIdError, match=repr(node_id)):
            s2.add_node(id=node_id, summary="something else")


# ------------------------------------------------------------ no lookup for new ids


def test_new_ids_run_no_lookup(db: trellisdb.Database, lookups: list[str]) -> None:
    s = db.session(task="t", agent="a")
    s.add_node(id="n0", summary="0")
    for i in range(1, 60):
        s.add_node(id=f"n{i}", parents=[f"n{i - 1}"], summary=str(i))
        if i % 3 == 0:
            db.flush()  # commits in between: the fingerprints catch up with them
    with db.transaction():
        for i in range(60, 70):
            s.add_node(id=f"n{i}", parents=[f"n{i - 1}"], summary=str(i))
    for node_id in ODD_IDS:
        s.add_node(id=node_id)
    assert lookups == []
    # a retry of a committed id is confirmed by the query
    assert s.add_node(id="n5", parents=["n4"], summary="5") == "n5"
    assert len(lookups) >= 1
    db.flush()
    assert db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist() == [{"n": 70 + len(ODD_IDS)}]


def test_a_fingerprint_match_falls_back_to_the_query(db: trellisdb.Database, lookups: list[str]) -> None:
    s = db.session(task="t", agent="a")
    s.add_node(id="a")
    db.flush()
    c: Committer = db._committer
    c._node_fps.add_hashes([id_hash("fresh")])  # as if "fresh" shared a fingerprint with a stored id
    assert s.add_node(id="fresh", summary="new") == "fresh"
    assert len(lookups) == 1
    db.flush()
    assert count(db, "fresh") == 1


# ------------------------------------------------------------ other writers


def test_ids_another_handle_commits_are_found(path: Path, lookups: list[str]) -> None:
    a, b = trellisdb.connect(path), trellisdb.connect(path)
    try:
        sa, sb = a.session(task="t", agent="a", id="sa"), b.session(task="t", agent="b", id="sb")
        sb.add_node(id="b0")  # loads b's fingerprints
        b.flush()
        sa.add_node(id="x", summary="from a")
        a.flush()  # a small commit: b catches up from the WAL's frames
        with pytest.raises(trellisdb.DuplicateIdError, match="'x'"):
            sb.add_node(id="x", summary="from b")
        sa.add_node(id="y", summary="from a")
        a.flush()
        a.ingest({"nodes": pa.table({"id": ["z"], "session_id": ["sa"], "task_id": ["t"]})})  # a WAL frame's table
        big = [f"big{i}" for i in range(5000)]  # more rows than the WAL takes: a commit to Lance
        a.ingest({"nodes": pa.table({"id": big, "session_id": ["sa"] * len(big), "task_id": ["t"] * len(big)})})
        for node_id in ("y", "z", "big4321"):
            with pytest.raises(trellisdb.DuplicateIdError, match=repr(node_id)):
                sb.add_node(id=node_id, summary="from b")
        sa.add_node(id="w", summary="from a")
        a.close()  # checkpoints: "w" is read from Lance, not the WAL
        with pytest.raises(trellisdb.DuplicateIdError, match="'w'"):
            sb.add_node(id="w", summary="from b")
        assert b.resume("sa").add_node(id="w", summary="from a") == "w"  # a's write again: a retry
        assert sb.add_node(id="b1") == "b1"
        b.flush()
    finally:
        a.close()
        b.close()
    with trellisdb.connect(path) as d:
        assert {r["id"] for r in d.sql("SELECT id FROM nodes_history").to_pylist()} == {
            "b0", "x", "y", "z", "w", "b1", *big}


WRITE_IN_A_PROCESS = """
import sys, trellisdb
db = trellisdb.connect(sys.argv[1])
s = db.session(task="t", agent="child", id="child")
for node_id in sys.argv[2:]:
    s.add_node(id=node_id, summary="child")
db.flush()
print("ok")
"""


def test_ids_another_process_commits_are_found(db: trellisdb.Database, path: Path) -> None:
    s = db.session(task="t", agent="a")
    s.add_node(id="mine")
    db.flush()
    out = subprocess.run([sys.executable, "-c", WRITE_IN_A_PROCESS, str(path), "p1", *ODD_IDS],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
    child = db.resume("child")
    for node_id in ("p1", *ODD_IDS):
        with pytest.raises(trellisdb.DuplicateIdError, match="summary"):
            child.add_node(id=node_id, summary="parent")
        with pytest.raises(trellisdb.DuplicateIdError, match="session_id"):
            s.add_node(id=node_id, summary="child")
        assert child.add_node(id=node_id, summary="child") == node_id  # the child's write again: a retry
    assert s.add_node(id="mine") == "mine"


# ------------------------------------------------------------ non-ASCII ids


def test_id_fingerprint_matches_duckdb() -> None:
    ids = ["a", "node-1", *ODD_IDS, "x" * 500, "\U0010fffd"]
    got = duckdb.connect().execute("SELECT id, TRY_CAST('0x' || md5(id)[1:16] AS UBIGINT) AS f FROM "
                                   "(SELECT unnest($ids::VARCHAR[]) AS id)", {"ids": ids}).fetchall()
    assert {i: f for i, f in got} == {i: fingerprint(id_hash(i)) for i in ids}


def test_non_ascii_ids(path: Path, lookups: list[str]) -> None:
    with trellisdb.connect(path) as d:
        s = d.session(task="t", agent="a", id="s")
        for node_id in ODD_IDS:
            s.add_node(id=node_id, summary=node_id)
    assert lookups == []
    with trellisdb.connect(path) as d:  # fingerprints loaded from the store
        s = d.resume("s")
        for node_id in ODD_IDS:
            assert s.add_node(id=node_id, summary=node_id) == node_id
            with pytest.raises(trellisdb.DuplicateIdError, match="summary"):
                s.add_node(id=node_id, summary="other")
    with trellisdb.connect(path) as d:
        assert sorted(r["id"] for r in d.sql("SELECT id FROM nodes_history").to_pylist()) == sorted(ODD_IDS)


# ------------------------------------------------------------ threads


def test_threads_writing_explicit_ids(db: trellisdb.Database) -> None:
    errors: list[BaseException] = []
    written = threading.Barrier(4)

    def write(k: int) -> None:
        try:
            s = db.session(task="t", agent=f"a{k}", id=f"s{k}")
            for i in range(40):
                s.add_node(id=f"t{k}-{i}", summary="x")
                if i % 10 == 0:
                    db.flush()
            written.wait(timeout=60)
            for j in range(4):  # every thread's ids (pending or committed): only its own write again is a retry
                for i in range(0, 40, 7):
                    if j == k:
                        assert s.add_node(id=f"t{j}-{i}", summary="x") == f"t{j}-{i}"
                    with pytest.raises(trellisdb.DuplicateIdError):
                        s.add_node(id=f"t{j}-{i}", summary="y")
        except BaseException as e:
            errors.append(e)
            written.abort()

    first = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in first:
        t.start()
    for t in first:
        t.join()
    assert errors == []
    db.flush()
    assert db.sql("SELECT count(*) AS n, count(DISTINCT id) AS d FROM nodes_history").to_pylist() == [
        {"n": 160, "d": 160}]
