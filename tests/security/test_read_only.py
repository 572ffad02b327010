"""A read-only handle answers queries and changes nothing: no write, tag, view change or export."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import trellisdb
from trellisdb.cli import main


def _folder_digest(path: str) -> dict[str, str]:
    out = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture
def store(tmp_path: Path) -> str:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    with db.session(task="t", agent="a", id="s") as s:
        n = s.add_node(id="n1", summary="first", artifacts={"prompt": "p", "response": "r"})
        s.add_reward(n, "score", 1.0)
    db.tag("base")
    db.create_view("v", "sft", reward="reward('score')", threshold=0.5)
    db.materialize("v")
    db.close()
    return str(tmp_path / "db")


def test_every_change_is_refused(store: str, tmp_path: Path) -> None:
    before = _folder_digest(store)
    ro = trellisdb.connect(store, read_only=True)
    assert ro.query("NODES RETURN id").to_pylist() == [{"id": "n1"}]
    assert ro.sql("SELECT count(*) AS n FROM rewards", as_of="base").to_pylist() == [{"n": 1}]
    assert len(ro.view("v").to_pylist()) == 1 and [v["name"] for v in ro.views()] == ["v"]
    calls: list[Callable[[], Any]] = [
        lambda: ro.session(task="t", agent="a"),
        lambda: ro.resume("s"),
        lambda: ro.add_task("t2"),
        lambda: ro.tag("x"),
        lambda: ro.untag("base"),
        lambda: ro.ingest({"tasks": pa.table({"id": ["t3"]})}),
        lambda: ro.create_space("sp", dim=2),
        lambda: ro.add_vectors("sp", ["n1"], [[1.0, 0.0]]),
        lambda: ro.build_index(),
        lambda: ro.compact(),
        lambda: ro.create_view("w", "sft"),
        lambda: ro.materialize("v"),
        lambda: ro.refresh("v"),
        lambda: ro.drop_view("v"),
        lambda: ro.export("v", tmp_path / "out"),
        lambda: ro.query("CREATE VIEW w AS sft"),
        lambda: ro.query("MATERIALIZE v"),
        lambda: ro.query("REFRESH v"),
        lambda: ro.query("DROP VIEW v"),
        lambda: ro.query("EXPORT v TO 'x'"),
        lambda: ro.sql("DELETE FROM nodes"),
    ]
    for i, call in enumerate(calls):
        with pytest.raises(trellisdb.TrellisError) as e:
            call()
        assert isinstance(e.value, trellisdb.ReadOnlyError | trellisdb.QueryError), (i, e.value)
    with pytest.raises(trellisdb.ReadOnlyError, match="read-only"), ro.transaction():
        pass
    assert ro.query("SHOW VIEWS").to_pylist()[0]["name"] == "v"
    ro.close()
    assert not (tmp_path / "out").exists()
    assert _folder_digest(store) == before  # not a byte changed (no LOCK, no log record, no export)


def test_read_only_never_creates_a_store(tmp_path: Path) -> None:
    with pytest.raises(trellisdb.NotADatabaseError):
        trellisdb.connect(tmp_path / "new", read_only=True)
    assert not (tmp_path / "new").exists()


def test_writers_elsewhere_are_seen(store: str) -> None:
    ro = trellisdb.connect(store, read_only=True)
    rw = trellisdb.connect(store)
    with rw.session(task="t", agent="a") as s:
        s.add_node(id="n2")
    assert {r["id"] for r in ro.query("NODES RETURN id").to_pylist()} == {"n1", "n2"}
    rw.close()
    ro.close()


def test_cli_read_only(store: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = _folder_digest(store)
    db = ["--db", store, "--read-only"]
    assert main([*db, "query", "NODES RETURN id", "--format", "json"]) == 0
    assert '"n1"' in capsys.readouterr().out
    for argv in (["tag", "x"], ["materialize", "v"], ["refresh", "v"], ["export", "v", "out"],
                 ["query", "DROP VIEW v"], ["create-view", "w", "sft"], ["compact"], ["untag", "base"], ["demo"]):
        assert main([*db, *argv]) == 1, argv
        assert "read-only" in capsys.readouterr().err, argv
    assert _folder_digest(store) == before
