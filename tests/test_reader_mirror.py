"""The reader's mirror (DuckDB copies of the narrow columns) always equals the Lance rows it copies."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import pytest

import trellisdb
from trellisdb.reader import WIDE
from trellisdb.schema import DATA_TABLES


def _both(db: trellisdb.Database, name: str, view: str, at: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of ``view`` (over the mirror) and of the same rows read from Lance, as of ``at``."""
    wide = WIDE.get(name)
    suffix = view[len(name):]
    lance_view = f"{name}_full{suffix}" if wide else view
    cols = f"* EXCLUDE ({', '.join(wide)})" if wide else "*"
    order = "ORDER BY ALL"
    mirror = db.sql(f"SELECT * FROM {view} {order}", as_of=at).to_pylist()
    lance = db.sql(f"SELECT {cols} FROM {lance_view} {order}", as_of=at).to_pylist()
    return mirror, lance


def test_mirror_equals_lance_at_every_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    plain = trellisdb.connect(tmp_path / "db", mirror=False)  # every view over Lance scans
    w = db.session(id="s", task="t")
    w.add_node(id="a", summary="root", embedding=[1, 0, 0, 0])
    db.flush()
    db.query("NODES")  # the mirror is built at this commit; what follows extends it
    w.add_node(id="b", parents=["a"], summary="kid", artifacts={"code": "x = 1"})
    w.add_reward("b", "score", 0.5)
    db.flush()
    # a commit that fails after writing part of its rows: its id stays open (aborted)
    real_append = db._store.tables.append
    calls = {"n": 0}

    def failing(name: str, data: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError("disk full")
        real_append(name, data)

    monkeypatch.setattr(db._store.tables, "append", failing)
    db._committer.wal_max_rows = 0  # a commit written to Lance directly, as big ones are
    with pytest.raises(trellisdb.CommitError, match="disk full"), db.transaction():
        w.add_node(id="ghost", parents=["a"])
        w.add_reward("ghost", "score", 9.0)
    monkeypatch.setattr(db._store.tables, "append", real_append)
    db._committer.wal_max_rows = 4096
    w.set_status("a", "expanded")
    w.add_reward("b", "score", 0.75)  # supersedes the earlier value
    w.close()
    commits = [c["id"] for c in db.log()]
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE id = 'ghost'").to_pylist() == [{"n": 0}]
    for at in commits:
        for name in DATA_TABLES:
            for view in (name, f"{name}_history"):
                mirror, lance = _both(db, name, view, at)
                assert mirror == lance, (at, view)
                assert plain.sql(f"SELECT * FROM {view} ORDER BY ALL", as_of=at).to_pylist() == mirror, (at, view)
    assert [r["value"] for r in db.sql("SELECT value FROM rewards").to_pylist()] == [0.75]
    # every table was served from the mirror (a failed refresh falls back to Lance scans silently)
    assert db._store.engine._broken == set() and set(db._store.engine._upto) == set(DATA_TABLES)
    frontier = "FRONTIER RANK BY reward('score') DESC RETURN id, reward('score') AS s"
    assert db.query(frontier).to_pylist() == plain.query(frontier).to_pylist() == [{"id": "b", "s": 0.75}]
    plain.close()
    db.close()


def test_threads_share_one_mirror_and_each_sees_a_consistent_snapshot(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    errors: list[BaseException] = []
    stop = threading.Event()

    def read() -> None:
        try:
            while not stop.is_set():
                row = db.sql("SELECT (SELECT count(*) FROM nodes) AS n, (SELECT count(*) FROM rewards) AS r").to_pylist()
                assert row[0]["n"] == row[0]["r"], row
        except BaseException as e:  # reported below
            errors.append(e)

    w = db.session(id="s", task="t")
    db.flush()
    readers = [threading.Thread(target=read) for _ in range(3)]
    for t in readers:
        t.start()
    try:
        for i in range(30):
            with db.transaction():
                w.add_node(id=f"n{i}")
                w.add_reward(f"n{i}", "score", float(i))
    finally:
        stop.set()
        for t in readers:
            t.join()
    assert not errors, errors[0]
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 30}]
    assert db.query("NODES ORDER BY reward('score') DESC LIMIT 1 RETURN id").to_pylist() == [{"id": "n29"}]
    db.close()


def test_rows_a_reader_saw_in_flight_are_mirrored_once_committed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader refreshing while a commit is half-written sees Lance fragments
    holding rows of a commit above its snapshot; it must neither show them
    nor skip those fragments after the commit lands."""
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    db._committer.wal_max_rows = 0  # commits written to Lance directly, as big ones are
    reader = trellisdb.connect(tmp_path / "db")
    w = db.session(id="s", task="t")
    w.add_node(id="a")
    db.flush()
    assert reader.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 1}]
    w.add_node(id="a2")  # a commit the reader has not mirrored yet: its next query refreshes
    db.flush()
    real_append = db._store.tables.append
    seen: list[Any] = []

    def append_then_read(name: str, data: Any) -> None:
        real_append(name, data)
        if name == "nodes":  # rows on disk, commit record not yet written
            seen.append(reader.sql("SELECT id FROM nodes ORDER BY id").to_pylist())

    monkeypatch.setattr(db._store.tables, "append", append_then_read)
    w.add_node(id="b", parents=["a"])
    w.add_reward("b", "score", 1.0)
    db.flush()
    monkeypatch.setattr(db._store.tables, "append", real_append)
    assert seen == [[{"id": "a"}, {"id": "a2"}]]
    assert reader.sql("SELECT id FROM nodes ORDER BY id").to_pylist() == [{"id": "a"}, {"id": "a2"}, {"id": "b"}]
    assert reader.sql("SELECT node_id, value FROM rewards").to_pylist() == [{"node_id": "b", "value": 1.0}]
    w.add_node(id="c", parents=["b"])
    db.flush()
    assert reader.query("LINEAGE OF 'c' ANCESTORS RETURN id").to_pylist() == [{"id": "c"}, {"id": "b"}, {"id": "a"}]
    assert reader._store.engine._broken == set() and set(reader._store.engine._upto) == {"nodes", "edges", "rewards"}
    reader.close()
    db.close()


def test_a_reader_copies_only_the_tables_its_queries_name(tmp_path: Path) -> None:
    """The mirror copies a table when a query first names it (a frontier reads three of the
    eight); until then nothing of it is held, and a table read later is complete."""
    db = trellisdb.connect(tmp_path / "db")
    w = db.session(id="s", task="t")
    for i in range(5):
        w.add_node(id=f"n{i}", artifacts={"code": f"print({i})"})
        w.add_reward(f"n{i}", "score", float(i))
    db.flush()
    fresh = trellisdb.connect(tmp_path / "db")
    assert fresh.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 5}]
    engine = fresh._store.engine
    assert set(engine._upto) == {"nodes"}
    held = {r[0] for r in engine._db.execute("SELECT table_name FROM duckdb_tables()").fetchall()}
    assert "__mir_node_artifacts" not in held and "__mir_nodes" in held
    w.add_node(id="n5", artifacts={"code": "print(5)"})
    db.flush()
    assert fresh.sql("SELECT count(*) AS n FROM node_artifacts").to_pylist() == [{"n": 6}]
    assert fresh.query("NODES ORDER BY reward('score') DESC LIMIT 1 RETURN id").to_pylist() == [{"id": "n4"}]
    assert set(engine._upto) == {"nodes", "node_artifacts", "rewards"}
    fresh.close()
    db.close()


def test_the_rewards_mirror_is_copied_in_channel_order(tmp_path: Path) -> None:
    """A commit's rewards, channels interleaved, enter the mirror grouped by channel (so each
    row group's min/max lets a channel filter skip the rest), and read back the same; the
    first copy gets its lookup indexes."""
    import pyarrow as pa

    db = trellisdb.connect(tmp_path / "db")
    w = db.session(id="s", task="t")
    ids = [w.add_node(id=f"n{i}") for i in range(30)]
    db.flush()
    channels = ["zeta", "alpha", "mid"]
    db.ingest({"rewards": pa.table({"node_id": [n for n in ids for _ in channels],
                                    "channel": channels * len(ids),
                                    "value": [float(i) for i in range(len(ids) * len(channels))]})})
    fresh = trellisdb.connect(tmp_path / "db")  # its first query copies every row
    con = fresh._store.engine.prepare(fresh._store.log.refresh(), fresh.log()[-1]["id"])
    stored = [r[0] for r in con.execute("SELECT channel FROM __mir_rewards ORDER BY rowid").fetchall()]
    assert stored == sorted(stored) and len(stored) == 90
    got = fresh.sql("SELECT node_id, channel, value FROM rewards ORDER BY value").to_pylist()
    assert [(r["node_id"], r["channel"]) for r in got] == [(n, c) for n in ids for c in channels]
    # the lookup indexes are built once the first copy is committed (in bulk), one per lookup column
    indexes = {r[0] for r in con.execute("SELECT index_name FROM duckdb_indexes()").fetchall()}
    assert {"__ix_nodes_id", "__ix_edges_dst", "__ix_sup_nodes", "__ix_sup_edges"} <= indexes
    fresh.close()
    db.close()


def test_a_large_rewards_copy_is_sorted_a_part_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy streamed from Lance (a first copy past SMALL_FRAGMENTS rows) is sorted by channel in
    parts of CLUSTER_ROWS: each part's channels contiguous, no row lost or doubled."""
    import pyarrow as pa

    from trellisdb import reader

    monkeypatch.setattr(reader, "SMALL_FRAGMENTS", 0)  # every copy streams
    monkeypatch.setattr(reader, "CLUSTER_ROWS", 90)
    db = trellisdb.connect(tmp_path / "db")
    w = db.session(id="s", task="t")
    ids = [w.add_node(id=f"n{i}") for i in range(30)]
    db.flush()
    channels = ["zeta", "alpha", "mid"]
    for k in range(3):  # three commits, three fragments of interleaved channels
        db.ingest({"rewards": pa.table({"node_id": [n for n in ids for _ in channels],
                                        "channel": channels * len(ids),
                                        "value": [k + i / 1000 for i in range(len(ids) * len(channels))]})})
    fresh = trellisdb.connect(tmp_path / "db")
    con = fresh._store.engine.prepare(fresh._store.log.refresh(), fresh.log()[-1]["id"])
    stored = [r[0] for r in con.execute("SELECT channel FROM __mir_rewards ORDER BY rowid").fetchall()]
    runs = 1 + sum(a != b for a, b in itertools.pairwise(stored))
    assert len(stored) == 270 and runs <= 9  # interleaved as written: 270 runs
    both = "SELECT node_id, channel, value, commit_id FROM rewards_history ORDER BY ALL"
    plain = trellisdb.connect(tmp_path / "db", mirror=False)  # the same rows read from Lance
    assert fresh.sql(both).to_pylist() == plain.sql(both).to_pylist()
    plain.close()
    fresh.close()
    db.close()


def test_a_stream_is_gathered_into_tables_of_about_n_rows() -> None:
    import pyarrow as pa

    from trellisdb.reader import gathered

    batches = [pa.record_batch({"x": list(range(i * 10, i * 10 + 10))}) for i in range(5)]
    parts = list(gathered(pa.RecordBatchReader.from_batches(batches[0].schema, batches), 25))
    assert [p.num_rows for p in parts] == [30, 20]
    assert pa.concat_tables(parts)["x"].to_pylist() == list(range(50))
    by_bytes = list(gathered(iter(batches), 2 * batches[0].nbytes, lambda b: b.nbytes))
    assert [p.num_rows for p in by_bytes] == [20, 20, 10]


def _setting(db: trellisdb.Database, name: str) -> int:
    from trellisdb.reader import size_bytes

    value = db.sql(f"SELECT current_setting('{name}') AS v").to_pylist()[0]["v"]
    got = size_bytes(str(value))
    assert got is not None, value
    return got


def test_keep_memory_sets_what_duckdb_keeps_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trellisdb import reader
    from trellisdb.reader import KEEP_MEMORY_SHARE

    monkeypatch.setattr(reader, "_strict_overcommit", lambda: False)  # whatever this machine's accounting
    db = trellisdb.connect(tmp_path / "db")
    # default: a share of DuckDB's memory limit (its printed values are rounded to 0.1 of a unit)
    limit, kept = _setting(db, "memory_limit"), _setting(db, "block_allocator_memory")
    assert db._store.engine.kept_memory > 0
    assert kept == pytest.approx(limit * KEEP_MEMORY_SHARE, rel=0.02)
    assert kept == pytest.approx(db._store.engine.kept_memory, rel=0.02)
    db.close()
    db = trellisdb.connect(tmp_path / "db", keep_memory=0)
    assert db._store.engine.kept_memory == 0 and _setting(db, "block_allocator_memory") == 0
    db.close()
    db = trellisdb.connect(tmp_path / "db", keep_memory=1 << 30)
    assert db._store.engine.kept_memory == 1 << 30 and _setting(db, "block_allocator_memory") == 1 << 30
    db.close()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4GB", 1 << 62])
def test_keep_memory_rejects_what_is_not_a_byte_count_it_can_keep(tmp_path: Path, bad: Any) -> None:
    trellisdb.connect(tmp_path / "db").close()
    with pytest.raises(trellisdb.ValidationError, match="keep_memory"):
        trellisdb.connect(tmp_path / "db", keep_memory=bad)


def test_size_bytes_reads_duckdbs_sizes() -> None:
    from trellisdb.reader import size_bytes

    assert size_bytes("18.8 GiB") == int(18.8 * 2**30)
    assert size_bytes("0 bytes") == 0
    assert size_bytes("134217728B") == 134217728
    assert size_bytes("97.6 KiB") == int(97.6 * 1024)
    assert size_bytes("2 GB") == 2 * 10**9
    assert size_bytes("lots") is None


def test_keep_memory_defaults_to_none_under_strict_overcommit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # DuckDB reserves the bound up front, which strict accounting would charge to the process
    from trellisdb import reader

    monkeypatch.setattr(reader, "_strict_overcommit", lambda: True)
    db = trellisdb.connect(tmp_path / "db")
    assert db._store.engine.kept_memory == 0 and _setting(db, "block_allocator_memory") == 0
    db.close()
    db = trellisdb.connect(tmp_path / "db", keep_memory=1 << 28)  # asked for: kept all the same
    assert db._store.engine.kept_memory == 1 << 28
    db.close()
