"""Every validation error: its type (a TrellisError subclass) and a message naming the offending value."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import trellisdb

TABLES = ("tasks", "sessions", "nodes", "edges", "artifacts", "node_artifacts", "rewards", "comparisons")


@pytest.fixture
def writer(db: trellisdb.Database) -> trellisdb.SessionWriter:
    s = db.session(task="t", agent="a", id="s1")
    s.add_node(id="root", summary="root")
    s.add_node(id="other", summary="other")
    db.flush()
    return s


def snapshot(db: trellisdb.Database) -> dict[str, Any]:
    out: dict[str, Any] = {t: db.sql(f"SELECT * FROM {t}_history ORDER BY ALL").to_pylist() for t in TABLES}
    out["log"] = db.log()
    return out


def named(value: str) -> str:
    return re.escape(value)


def expect(exc: type[Exception], needle: str, call: Any, case: object) -> Exception:
    """Run ``call``; it must raise ``exc`` with a message containing ``needle`` (``case`` labels failures)."""
    try:
        call()
    except exc as e:
        assert needle in str(e), f"{case}: message {str(e)!r} does not name {needle!r}"
        return e
    except Exception as e:
        pytest.fail(f"{case}: raised {type(e).__name__}({e}) instead of {exc.__name__}")
    pytest.fail(f"{case}: did not raise {exc.__name__}")


def test_error_classes_are_trellis_errors() -> None:
    for cls in (trellisdb.UnknownParentError, trellisdb.UnknownNodeError, trellisdb.UnknownSessionError,
                trellisdb.InvalidRewardError, trellisdb.EmbeddingDimensionError, trellisdb.DuplicateIdError):
        assert issubclass(cls, trellisdb.ValidationError)
    for cls in (trellisdb.ValidationError, trellisdb.NotADatabaseError, trellisdb.FormatVersionError,
                trellisdb.UnknownTagError, trellisdb.UnknownCommitError, trellisdb.TransactionError):
        assert issubclass(cls, trellisdb.TrellisError)


# --------------------------------------------------------------- unknown ids


def test_unknown_parent(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.UnknownParentError, match=named("'ghost'")):
        writer.add_node(id="kid", parents=["ghost"])
    with pytest.raises(trellisdb.UnknownParentError, match=named("'ghost2'")) as ei:
        writer.add_node(id="kid", parents=["root", "ghost2"])  # one known, one unknown parent
    assert "'root'" not in str(ei.value).split("of node")[0]
    db.flush()
    assert db.sql("SELECT count(*) AS n FROM nodes_history WHERE id = 'kid'").to_pylist() == [{"n": 0}]
    assert db.sql("SELECT count(*) AS n FROM edges_history WHERE dst = 'kid'").to_pylist() == [{"n": 0}]


def test_unknown_node(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    before = snapshot(db)
    calls = {
        "reward": lambda: writer.add_reward("ghost", "score", 1.0),
        "edge src": lambda: writer.add_edge("ghost", "root"),
        "edge dst": lambda: writer.add_edge("root", "ghost"),
        "artifact": lambda: writer.add_artifact("ghost", "code", "x"),
        "set_status": lambda: writer.set_status("ghost", "closed"),
        "comparison a": lambda: writer.add_comparison("ghost", "root", "root"),
        "comparison b": lambda: writer.add_comparison("root", "ghost", None),
    }
    for case, call in calls.items():
        expect(trellisdb.UnknownNodeError, "'ghost'", call, case)
    assert db.flush() is None  # nothing was queued
    assert snapshot(db) == before


# ------------------------------------------------------------------- rewards


def test_invalid_reward(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    cases: list[tuple[object, str]] = [
        (math.nan, "nan"), (math.inf, "inf"), (-math.inf, "-inf"), ("0.5", "'0.5'"), (None, "None"),
        (True, "True"), ([1.0], "[1.0]"),
    ]
    for value, needle in cases:
        e = expect(trellisdb.InvalidRewardError, needle, lambda v=value: writer.add_reward("root", "score", v), value)
        assert "'score'" in str(e) and "'root'" in str(e), value
    assert db.flush() is None
    assert db.sql("SELECT count(*) AS n FROM rewards_history").to_pylist() == [{"n": 0}]


def test_valid_rewards_of_other_number_types(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    import numpy as np

    writer.add_reward("root", "int", 3)
    writer.add_reward("root", "np", np.float32(0.5))
    writer.add_reward("root", "neg", -1e300)
    db.flush()
    got = db.sql("SELECT channel, value FROM rewards ORDER BY channel").to_pylist()
    assert got == [{"channel": "int", "value": 3.0}, {"channel": "neg", "value": -1e300},
                   {"channel": "np", "value": 0.5}]


def test_invalid_reward_in_ingest(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    for v, needle in ((math.nan, "nan"), (math.inf, "inf")):
        t = pa.table({"node_id": ["root", "other"], "channel": ["ok", "bad"], "value": [1.0, v]})
        with pytest.raises(trellisdb.InvalidRewardError, match=named(needle)) as ei:
            db.ingest({"rewards": t})
        assert "'bad'" in str(ei.value) and "'other'" in str(ei.value)
    with pytest.raises(trellisdb.ValidationError, match=r"rewards\.value"):
        db.ingest({"rewards": pa.table({"node_id": ["root"], "channel": ["c"], "value": ["high"]})})
    assert db.sql("SELECT count(*) AS n FROM rewards_history").to_pylist() == [{"n": 0}]


# ----------------------------------------------------------------- embeddings


def test_wrong_embedding_dimension_add_node(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    for dim in (3, 5, 0):
        e = expect(trellisdb.EmbeddingDimensionError, f"dimension {dim}, but",
                   lambda d=dim: writer.add_node(id="e", embedding=[1.0] * d), dim)
        assert "'e'" in str(e) and "dimension 4" in str(e)
    assert db.flush() is None


def test_wrong_embedding_dimension_add_task(db: trellisdb.Database) -> None:
    with pytest.raises(trellisdb.EmbeddingDimensionError, match=r"dimension 2\b") as ei:
        db.add_task("tk", embedding=[1.0, 2.0])
    assert "'tk'" in str(ei.value)


def test_nonfinite_or_nonnumeric_embedding(writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.ValidationError, match="NaN or infinite"):
        writer.add_node(embedding=[1.0, math.nan, 0.0, 0.0])
    with pytest.raises(trellisdb.ValidationError, match="sequence of numbers"):
        writer.add_node(embedding=["a", "b", "c", "d"])  # type: ignore[list-item]


def test_wrong_embedding_dimension_ingest(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    cases = [
        (pa.array([[1.0] * 4, [1.0] * 5], pa.list_(pa.float64())), 5),   # variable-size lists, one too long
        (pa.array([[1.0] * 3, [1.0] * 3], pa.list_(pa.float32(), 3)), 3),  # fixed-size, wrong size
    ]
    for vectors, bad in cases:
        t = pa.table({"id": ["e1", "e2"], "session_id": ["s1", "s1"], "task_id": ["t", "t"], "embedding": vectors})
        e = expect(trellisdb.EmbeddingDimensionError, f"dimension {bad};", lambda t=t: db.ingest({"nodes": t}), bad)
        assert "dimension is 4" in str(e)
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE id LIKE 'e%'").to_pylist() == [{"n": 0}]


def test_nonfinite_embedding_in_ingest(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    t = pa.table({"id": ["e1"], "session_id": ["s1"], "task_id": ["t"], "embedding": [[1.0, math.nan, 0.0, 0.0]]})
    with pytest.raises(trellisdb.ValidationError, match="NaN"):
        db.ingest({"nodes": t})


# ---------------------------------------------------------------- wrong types


WRONG_TYPES: list[tuple[dict[str, Any], str]] = [
    ({"step": "3"}, "'3'"),
    ({"step": 2.5}, "2.5"),
    ({"step": True}, "True"),
    ({"summary": 5}, "5"),
    ({"parents": "abc"}, "'abc'"),
    ({"parents": ["root", 7]}, "7"),
    ({"id": 12}, "12"),
    ({"kind": None}, "None"),
    ({"status": 3}, "3"),
    ({"source": b"x"}, "b'x'"),
    ({"edge_kind": "cousin_of"}, "'cousin_of'"),
    ({"cost": {"tokens": 3}}, "tokens"),
    ({"cost": {"tokens_in": "many"}}, "'many'"),
    ({"cost": {"seconds": math.nan}}, "nan"),
    ({"cost": {"usd": "1"}}, "'1'"),
    ({"artifacts": {"code": 123}}, "'code'"),
]


def test_wrong_types_add_node(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    for kwargs, needle in WRONG_TYPES:
        expect(trellisdb.ValidationError, needle, lambda kw=kwargs: writer.add_node(**kw), kwargs)


def test_bad_artifact_content_writes_nothing(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.ValidationError, match="'code'"):
        writer.add_node(id="half", parents=["root"], artifacts={"code": 123})  # type: ignore[dict-item]
    db.flush()
    assert db.sql("SELECT count(*) AS n FROM nodes_history WHERE id = 'half'").to_pylist() == [{"n": 0}]
    assert db.sql("SELECT count(*) AS n FROM edges_history WHERE dst = 'half'").to_pylist() == [{"n": 0}]


def test_bad_artifact_name_is_rejected_and_loses_nothing(db: trellisdb.Database,
                                                         writer: trellisdb.SessionWriter) -> None:
    writer.add_reward("root", "score", 1.0)  # a valid pending write
    try:
        with pytest.raises(trellisdb.ValidationError, match="5"):
            writer.add_node(id="bad", artifacts={5: "x"})  # type: ignore[dict-item]
    finally:
        flushed = None
        try:
            db.flush()
        except Exception as e:  # keep the fixture's close() working
            flushed = e
    assert flushed is None
    assert db.sql("SELECT value FROM rewards").to_pylist() == [{"value": 1.0}]


def test_task_tags_as_string_rejected(db: trellisdb.Database) -> None:
    with pytest.raises(trellisdb.ValidationError, match="'geometry'"):
        db.add_task("tk", tags="geometry")  # type: ignore[arg-type]


def test_wrong_types_other_calls(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    cases: list[tuple[Any, str]] = [
        (lambda: db.session(task=5), "5"),
        (lambda: db.session(task="t", agent=["x"]), "['x']"),
        (lambda: db.add_task(3), "3"),
        (lambda: db.add_task("tk", spec=1.5), "1.5"),
        (lambda: writer.add_reward("root", 5, 1.0), "5"),
        (lambda: writer.add_reward("root", "c", 1.0, verifier=9), "9"),
        (lambda: writer.add_edge("root", "other", "cousin_of"), "'cousin_of'"),
        (lambda: writer.add_edge("root", 5), "5"),
        (lambda: writer.add_edge("root", "root"), "'root'"),
        (lambda: writer.add_artifact("root", 5, "x"), "5"),
        (lambda: writer.add_artifact("root", "code", 5), "'code'"),
        (lambda: writer.add_comparison("root", "other", "third"), "'third'"),
        (lambda: writer.add_comparison("root", "other", None, margin=math.inf), "inf"),
        (lambda: writer.add_comparison("root", "other", None, judge=1), "1"),
        (lambda: writer.set_status("root", None), "None"),
        (lambda: db.tag(""), "''"),
        (lambda: db.tag("42"), "'42'"),
        (lambda: db.tag(7), "7"),
    ]
    before = snapshot(db)
    for i, (call, needle) in enumerate(cases):
        expect(trellisdb.ValidationError, needle, call, f"case {i}")
    assert db.flush() is None  # none of them queued anything
    assert snapshot(db) == before


# --------------------------------------------------------------- duplicate ids


def test_duplicate_node_id(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    other = db.session(task="t", agent="b", id="s2")
    for call, needle in [
        (lambda: writer.add_node(id="root", summary="something else"), "'root'"),
        (lambda: writer.add_node(id="root", summary="root", kind="step"), "'root'"),
        (lambda: writer.add_node(id="root", summary="root", source="elsewhere"), "'root'"),
        (lambda: other.add_node(id="root", summary="root"), "'root'"),
    ]:
        with pytest.raises(trellisdb.DuplicateIdError, match=named(needle)):
            call()
    # also while the first write is still pending
    writer.add_node(id="fresh", summary="v1")
    with pytest.raises(trellisdb.DuplicateIdError, match=named("'fresh'")):
        writer.add_node(id="fresh", summary="v2")
    db.flush()
    assert db.sql("SELECT id, summary FROM nodes_history WHERE id IN ('root', 'fresh') ORDER BY id").to_pylist() == [
        {"id": "fresh", "summary": "v1"}, {"id": "root", "summary": "root"}]


def test_duplicate_node_id_same_content_is_noop(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    before = snapshot(db)
    assert writer.add_node(id="root", summary="root") == "root"  # committed: idempotent retry
    assert db.flush() is None  # nothing queued
    assert snapshot(db) == before
    writer.add_node(id="p", summary="pending")
    assert writer.add_node(id="p", summary="pending") == "p"  # still pending: idempotent retry
    db.flush()
    assert db.sql("SELECT count(*) AS n FROM nodes_history WHERE id = 'p'").to_pylist() == [{"n": 1}]


def test_idempotent_retry_does_not_advance_step(db: trellisdb.Database) -> None:
    s = db.session(task="t", agent="a")
    s.add_node(id="x", summary="x")
    s.add_node(id="x", summary="x")  # retry
    y = s.add_node(summary="y")
    db.flush()
    assert db.sql("SELECT id, step FROM nodes ORDER BY step").to_pylist() == [
        {"id": "x", "step": 1}, {"id": y, "step": 2}]


@pytest.mark.parametrize("flush_first", [True, False], ids=["committed", "pending"])
def test_duplicate_node_id_other_content_fields(
    db: trellisdb.Database, writer: trellisdb.SessionWriter, flush_first: bool
) -> None:
    writer.add_node(id="p", summary="p")
    writer.add_node(id="d", parents=["p"], summary="d", embedding=[1.0, 2.0, 3.0, 4.0], cost={"usd": 1.0}, step=7)
    if flush_first:
        db.flush()
    same: dict[str, Any] = {"parents": ["p"], "summary": "d", "embedding": [1.0, 2.0, 3.0, 4.0], "cost": {"usd": 1.0}}
    changes: list[dict[str, Any]] = [
        {"embedding": [4.0, 3.0, 2.0, 1.0]},
        {"embedding": None},
        {"cost": {"usd": 2.0}},
        {"cost": {}},
        {"parents": ["other"]},
        {"parents": []},
        {"kind": "tool_call"},
        {"step": 8},
    ]
    for change in changes:
        kw = {**same, **change}
        expect(trellisdb.DuplicateIdError, "'d'", lambda kw=kw: writer.add_node(id="d", **kw), change)
    # the same write again (a retry), also after a status change, is accepted and writes nothing
    writer.set_status("d", "done")
    assert writer.add_node(id="d", **same) == "d"
    assert writer.add_node(id="d", step=7, **same) == "d"
    db.flush()
    assert db.sql("SELECT status, step FROM nodes WHERE id = 'd'").to_pylist() == [{"status": "done", "step": 7}]
    assert db.sql("SELECT count(*) AS n FROM edges WHERE dst = 'd'").to_pylist() == [{"n": 1}]


def test_duplicate_node_id_ingest(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.DuplicateIdError, match=named("'root'")):
        db.ingest({"nodes": pa.table({"id": ["new", "root"], "session_id": ["s1"] * 2, "task_id": ["t"] * 2})})
    with pytest.raises(trellisdb.DuplicateIdError, match=named("'x'")):
        db.ingest({"nodes": pa.table({"id": ["x", "y", "x"], "session_id": ["s1"] * 3, "task_id": ["t"] * 3})})
    assert db.sql("SELECT count(*) AS n FROM nodes_history WHERE id IN ('new', 'x', 'y')").to_pylist() == [{"n": 0}]


# --------------------------------------------------------------------- ingest


def test_ingest_unknown_session(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.UnknownSessionError, match=named("'nosuch'")):
        db.ingest({"nodes": pa.table({"id": ["q"], "session_id": ["nosuch"], "task_id": ["t"]})})
    # a session in the same ingest is fine
    db.ingest({"sessions": pa.table({"id": ["new"], "task_id": ["t"]}),
               "nodes": pa.table({"id": ["q"], "session_id": ["new"], "task_id": ["t"]})})
    assert db.sql("SELECT session_id FROM nodes WHERE id = 'q'").to_pylist() == [{"session_id": "new"}]


def test_ingest_unknown_parent_and_shape_errors(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    with pytest.raises(trellisdb.UnknownParentError, match=named("'ghost'")):
        db.ingest({"edges": pa.table({"src": ["ghost"], "dst": ["root"], "kind": ["derived_from"]})})
    with pytest.raises(trellisdb.ValidationError, match=named("'ghost'")):
        db.ingest({"edges": pa.table({"src": ["root"], "dst": ["ghost"], "kind": ["derived_from"]})})
    with pytest.raises(trellisdb.ValidationError, match=named("'ghost'")):
        db.ingest({"node_artifacts": pa.table({"node_id": ["ghost"], "name": ["n"], "hash": ["h"]})})
    with pytest.raises(trellisdb.ValidationError, match="bogus"):
        db.ingest({"nodes": pa.table({"id": ["q"], "session_id": ["s1"], "task_id": ["t"], "bogus": [1]})})
    with pytest.raises(trellisdb.ValidationError, match="'nodez'"):
        db.ingest({"nodez": pa.table({"id": ["q"]})})
    with pytest.raises(trellisdb.ValidationError, match="'task_id'"):
        db.ingest({"nodes": pa.table({"id": ["q"], "session_id": ["s1"]})})
    with pytest.raises(trellisdb.ValidationError, match=r"nodes\.id has 1 null"):
        db.ingest({"nodes": pa.table({"id": pa.array([None], pa.string()), "session_id": ["s1"], "task_id": ["t"]})})


def test_ingest_unknown_node_error_type(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    cases = {
        "rewards": {"rewards": pa.table({"node_id": ["root", "ghost"], "channel": ["c", "c"], "value": [1.0, 2.0]})},
        "edges.dst": {"edges": pa.table({"src": ["root"], "dst": ["ghost"], "kind": ["derived_from"]})},
        "node_artifacts": {"node_artifacts": pa.table({"node_id": ["ghost"], "name": ["n"], "hash": ["h"]})},
    }
    for case, tables in cases.items():
        expect(trellisdb.UnknownNodeError, "'ghost'", lambda t=tables: db.ingest(t), case)
    assert db.sql("SELECT count(*) AS n FROM rewards_history").to_pylist() == [{"n": 0}]


# --------------------------------------------------------- opening databases


def test_non_empty_non_database_folder(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    with pytest.raises(trellisdb.NotADatabaseError, match=named(str(other))):
        trellisdb.connect(other)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]  # nothing was created in it
    with pytest.raises(trellisdb.NotADatabaseError, match=named(str(other / "notes.txt"))):
        trellisdb.connect(other / "notes.txt")
    with pytest.raises(trellisdb.NotADatabaseError, match=named(str(tmp_path / "missing"))):
        trellisdb.connect(tmp_path / "missing", create=False)
    assert not (tmp_path / "missing").exists()


def test_empty_folder_becomes_a_database(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    db = trellisdb.connect(tmp_path / "empty", embedding_dim=4)
    try:
        assert db.embedding_dim == 4
        assert json.loads((tmp_path / "empty" / "trellis.json").read_text())["embedding_dim"] == 4
    finally:
        db.close()


def test_format_version_999(tmp_path: Path) -> None:
    trellisdb.connect(tmp_path / "db", embedding_dim=4).close()
    marker = tmp_path / "db" / "trellis.json"
    meta = json.loads(marker.read_text())
    assert meta["format_version"] == 3
    meta["format_version"] = 999
    marker.write_text(json.dumps(meta))
    with pytest.raises(trellisdb.FormatVersionError, match="999"):
        trellisdb.connect(tmp_path / "db")


def test_marker_of_something_else(tmp_path: Path) -> None:
    trellisdb.connect(tmp_path / "db", embedding_dim=4).close()
    (tmp_path / "db" / "trellis.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(trellisdb.NotADatabaseError, match=r"trellis\.json"):
        trellisdb.connect(tmp_path / "db")


def test_different_embedding_dim(db: trellisdb.Database, tmp_path: Path) -> None:
    with pytest.raises(trellisdb.ValidationError, match=r"embedding_dim=4, not 8"):
        trellisdb.connect(tmp_path / "db", embedding_dim=8)
    again = trellisdb.connect(tmp_path / "db")  # omitted: the database's own
    try:
        assert again.embedding_dim == 4
    finally:
        again.close()


# ------------------------------------------------- errors lose nothing committed


def test_errors_lose_nothing_committed(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    writer.add_reward("root", "score", 0.25)
    writer.add_artifact("root", "code", "x = 1")
    db.flush()
    before = snapshot(db)
    bad_calls = [
        lambda: writer.add_node(parents=["ghost"]),
        lambda: writer.add_reward("root", "score", math.nan),
        lambda: writer.add_reward("ghost", "score", 1.0),
        lambda: writer.add_node(embedding=[1.0]),
        lambda: writer.add_node(id="root", summary="changed"),
        lambda: writer.add_edge("root", "ghost"),
        lambda: db.ingest({"nodes": pa.table({"id": ["z"], "session_id": ["nosuch"], "task_id": ["t"]})}),
        lambda: db.ingest({"rewards": pa.table({"node_id": ["root"], "channel": ["score"], "value": [math.inf]})}),
        lambda: trellisdb.connect(db.path, embedding_dim=8),
    ]
    for call in bad_calls:
        with pytest.raises(trellisdb.TrellisError):
            call()

    def failing_transaction() -> None:
        with db.transaction():
            writer.add_reward("root", "score", 0.99)
            writer.add_node(id="tx-node", parents=["root"])
            writer.add_node(parents=["ghost"])

    with pytest.raises(trellisdb.UnknownParentError):
        failing_transaction()
    assert db.flush() is None
    assert snapshot(db) == before
    # the database still takes writes, and they land on top of what was there
    writer.add_reward("root", "score", 0.5)
    db.flush()
    assert db.sql("SELECT value FROM rewards").to_pylist() == [{"value": 0.5}]
    assert db.sql("SELECT value FROM rewards_history ORDER BY commit_id").to_pylist() == [
        {"value": 0.25}, {"value": 0.5}]
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 2}]


def test_ingest_artifacts_are_content_addressed(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    import hashlib

    c = [b"abc", b"def", b"abc"]
    h = [hashlib.sha256(x).hexdigest() for x in c]
    db.ingest({"artifacts": pa.table({"hash": h, "content": c}),
               "node_artifacts": pa.table({"node_id": ["root", "other"], "name": ["code", "code"], "hash": h[:2]})})
    # duplicates in the batch are stored once; size is filled in
    assert db.sql("SELECT hash, size FROM artifacts_history ORDER BY hash").to_pylist() == sorted(
        [{"hash": h[0], "size": 3}, {"hash": h[1], "size": 3}], key=lambda r: r["hash"])
    # bytes the store already holds are not stored again
    db.ingest({"artifacts": pa.table({"hash": h[:1], "content": c[:1]})})
    assert db.sql("SELECT count(*) AS n FROM artifacts_history").to_pylist() == [{"n": 2}]
    before = snapshot(db)
    cases: list[tuple[dict[str, pa.Table], str]] = [
        ({"artifacts": pa.table({"hash": ["0" * 64], "content": [b"x"]})}, "'" + "0" * 64 + "'"),
        ({"artifacts": pa.table({"hash": h[:1], "content": c[:1], "size": [5]})}, "size 5"),
        ({"artifacts": pa.table({"hash": h[:1], "content": pa.array([None], pa.binary())})}, "no content"),
        ({"node_artifacts": pa.table({"node_id": ["root"], "name": ["z"], "hash": ["f" * 64]})}, "'" + "f" * 64 + "'"),
    ]
    for tables, needle in cases:
        expect(trellisdb.ValidationError, needle, lambda t=tables: db.ingest(t), needle)
    assert snapshot(db) == before


def test_ingest_edges_tasks_and_comparisons(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    before = snapshot(db)
    cases: list[tuple[type[Exception], dict[str, pa.Table], str]] = [
        (trellisdb.ValidationError, {"edges": pa.table({"src": ["root"], "dst": ["root"], "kind": ["derived_from"]})},
         "self-loop"),
        (trellisdb.ValidationError, {"edges": pa.table({"src": ["root"], "dst": ["other"], "kind": ["child_of"]})},
         "'child_of'"),
        (trellisdb.ValidationError, {"nodes": pa.table({"id": ["q"], "session_id": ["s1"], "task_id": ["nosuch"]})},
         "'nosuch'"),
        (trellisdb.ValidationError, {"sessions": pa.table({"id": ["s9"], "task_id": ["nosuch2"]})}, "'nosuch2'"),
        (trellisdb.UnknownNodeError, {"comparisons": pa.table({"id": ["c"], "a": ["root"], "b": ["zz"]})}, "'zz'"),
        (trellisdb.ValidationError,
         {"comparisons": pa.table({"id": ["c"], "a": ["root"], "b": ["other"], "preferred": ["q"]})}, "'q'"),
    ]
    for exc, tables, needle in cases:
        expect(exc, needle, lambda t=tables: db.ingest(t), needle)
    assert snapshot(db) == before
    # the valid forms are accepted
    db.ingest({"tasks": pa.table({"id": ["t2"]}), "sessions": pa.table({"id": ["s2"], "task_id": ["t2"]}),
               "edges": pa.table({"src": ["root"], "dst": ["other"], "kind": ["inspired_by"]}),
               "comparisons": pa.table({"id": ["c1", "c2"], "a": ["root"] * 2, "b": ["other"] * 2,
                                        "preferred": ["other", None]})})
    assert db.sql("SELECT count(*) AS n FROM comparisons").to_pylist() == [{"n": 2}]


def test_ingest_duplicate_keys_in_one_batch_keep_the_last(db: trellisdb.Database, writer: trellisdb.SessionWriter) -> None:
    db.ingest({"rewards": pa.table({"node_id": ["root", "other", "root"], "channel": ["s", "s", "s"],
                                    "value": [1.0, 2.0, 3.0]})})
    assert db.sql("SELECT node_id, value FROM rewards_history WHERE channel = 's' ORDER BY node_id").to_pylist() == [
        {"node_id": "other", "value": 2.0}, {"node_id": "root", "value": 3.0}]
