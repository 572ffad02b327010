"""Raw SQL (``db.sql``, ``trellis sql``) is one read-only query over the store's public relations."""

from __future__ import annotations

from pathlib import Path

import pytest

import trellisdb
from trellisdb.cli import main


@pytest.fixture
def db(tmp_path: Path) -> trellisdb.Database:
    d = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    with d.session(task="t", agent="a", id="s") as s:
        n = s.add_node(id="n1", summary="first")
        s.add_reward(n, "score", 0.5)
    return d


def _answers(db: trellisdb.Database) -> list[object]:
    return [
        db.sql("SELECT id, step, status FROM nodes ORDER BY id").to_pylist(),
        db.query("NODES RETURN id, reward('score') AS s").to_pylist(),
        db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist(),
    ]


READS_FILES = [
    "SELECT * FROM read_csv('/etc/passwd')",
    "SELECT * FROM read_csv_auto('/etc/passwd')",
    "SELECT * FROM read_text('/etc/passwd')",
    "SELECT * FROM read_blob('/etc/hostname')",
    "SELECT * FROM glob('/etc/*')",
    "SELECT * FROM '/etc/passwd'",
    "SELECT * FROM read_parquet('x.parquet')",
    "SELECT * FROM parquet_scan('x.parquet')",
    "SELECT * FROM read_json('/etc/x.json')",
    "SELECT content FROM read_text('/etc/passwd') UNION ALL SELECT summary FROM nodes",
    "SELECT (SELECT count(*) FROM read_text('/etc/passwd'))",
    "WITH x AS (SELECT * FROM read_text('/etc/passwd')) SELECT * FROM x",
]
WRITES_FILES = [
    "COPY (SELECT 1) TO '{out}'",
    "COPY nodes TO '{out}'",
    "EXPORT DATABASE '{out}'",
    "ATTACH '{out}' AS evil",
    "ATTACH '{out}' AS evil; CREATE TABLE evil.t AS SELECT 1",
    "INSTALL httpfs",
    "LOAD httpfs",
]
MUTATES = [
    "UPDATE __mir_nodes SET step = 99",
    "DELETE FROM __mir_nodes",
    "DELETE FROM __mir_rewards",
    "INSERT INTO __mir_nodes SELECT * FROM __mir_nodes",
    "DROP VIEW nodes",
    "DROP TABLE __mir_nodes",
    "CREATE OR REPLACE TEMP VIEW nodes AS SELECT 1 AS id",
    "CREATE TABLE x AS SELECT 1",
    "CREATE MACRO f(a) AS a",
    "ALTER TABLE __mir_nodes RENAME TO y",
    "SET enable_external_access = true",
    "SET threads = 1",
    "PRAGMA threads = 1",
    "RESET ALL",
    "SET VARIABLE trellis_snapshot = 0",
    "CALL pragma_version()",
    "CHECKPOINT",
    "BEGIN",
    "SELECT 1; DROP VIEW nodes",
    "EXPLAIN ANALYZE DELETE FROM __mir_nodes",
    "EXPLAIN DROP VIEW nodes",
]
INTERNAL = [
    "SELECT * FROM __mir_nodes",
    "SELECT * FROM __sup_nodes",
    "SELECT * FROM __lance_nodes",
    "SELECT * FROM __commits",
    "SELECT * FROM memory.main.__mir_nodes",
    "SELECT * FROM temp.main.nodes",
    "SELECT * FROM query_table('__mir_nodes')",
    "SELECT * FROM query('SELECT * FROM __mir_nodes')",
    "SELECT * FROM duckdb_tables()",
    "SELECT * FROM duckdb_settings()",
    "SELECT * FROM pg_class",
    "SELECT * FROM information_schema.tables",
    "SHOW TABLES",
    "DESCRIBE __mir_nodes",
    "SELECT * FROM (DESCRIBE __lance_nodes)",
    "WITH __mir_nodes AS (SELECT 1) SELECT * FROM __mir_nodes",
    "SELECT * FROM (WITH x AS (SELECT 1) SELECT 1), __mir_nodes",
    "WITH x AS (SELECT * FROM __mir_nodes) SELECT * FROM x",
    "SELECT * FROM nodes WHERE id IN (SELECT id FROM __mir_nodes)",
    "SELECT * FROM nodes n, LATERAL (SELECT * FROM __lance_nodes) l",
]


@pytest.mark.parametrize("sql", READS_FILES)
def test_sql_reads_no_file(db: trellisdb.Database, sql: str) -> None:
    with pytest.raises(trellisdb.QueryError):
        db.sql(sql)


@pytest.mark.parametrize("sql", WRITES_FILES)
def test_sql_writes_no_file(db: trellisdb.Database, sql: str, tmp_path: Path) -> None:
    out = tmp_path / "leak"
    with pytest.raises(trellisdb.QueryError):
        db.sql(sql.format(out=out))
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["db"]


@pytest.mark.parametrize("sql", MUTATES)
def test_sql_changes_nothing(db: trellisdb.Database, sql: str) -> None:
    before = _answers(db)
    with pytest.raises(trellisdb.QueryError):
        db.sql(sql)
    assert _answers(db) == before


@pytest.mark.parametrize("sql", INTERNAL)
def test_internal_relations_are_out_of_reach(db: trellisdb.Database, sql: str) -> None:
    with pytest.raises(trellisdb.QueryError):
        db.sql(sql)


@pytest.mark.parametrize("sql", [*MUTATES, *INTERNAL, *READS_FILES])
def test_a_snapshot_checks_sql_as_db_sql_does(db: trellisdb.Database, sql: str) -> None:
    """``db.snapshot().sql`` is a caller's way in too: the same check, nothing changes."""
    before = _answers(db)
    snap = db.snapshot()
    with pytest.raises(trellisdb.QueryError):
        snap.sql(sql)
    assert _answers(db) == before
    assert snap.sql("SELECT count(*) AS n FROM nodes").to_pylist() == db.sql("SELECT count(*) AS n FROM nodes").to_pylist()


def test_the_public_relations_stay_readable(db: trellisdb.Database) -> None:
    ok = [
        "SELECT count(*) AS n FROM nodes",
        "WITH r AS (SELECT * FROM rewards) SELECT count(*) AS n FROM r",
        "FROM nodes_full_history SELECT count(*) AS n",
        "SELECT count(*) AS n FROM commits",
        "WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < 3) SELECT count(*) AS n FROM c",
        "SELECT count(*) AS n FROM range(3)",
        "SELECT count(*) AS n FROM (SELECT unnest([1, 2]))",
        "SELECT count(*) AS n FROM NODES n JOIN Rewards r ON r.node_id = n.id",
        "SELECT count(*) AS n FROM (DESCRIBE nodes)",
        "SELECT count(*) AS n FROM nodes; ",
    ]
    for sql in ok:
        assert db.sql(sql).to_pylist()[0]["n"] >= 1, sql
    assert db.sql("SELECT id FROM nodes WHERE id = $1", params=["n1"]).to_pylist() == [{"id": "n1"}]
    assert db.sql("EXPLAIN SELECT * FROM nodes").to_arrow().num_rows >= 1
    assert db.sql("EXPLAIN ANALYZE SELECT * FROM nodes").to_arrow().num_rows >= 1


def test_failed_install_is_not_called_corruption(db: trellisdb.Database) -> None:
    with pytest.raises(trellisdb.QueryError) as e:
        db.sql("INSTALL httpfs")
    assert not isinstance(e.value, trellisdb.CorruptionError) and "verify" not in str(e.value)


def test_bad_sql_text(db: trellisdb.Database) -> None:
    for bad in ("", "   ", "SELEC 1", "\ud800", "SELECT '\ud800'", 5, None, "SELECT 1 " * 200_000):
        with pytest.raises(trellisdb.QueryError):
            db.sql(bad)  # type: ignore[arg-type]


def test_cli_sql_is_read_only(db: trellisdb.Database, capsys: pytest.CaptureFixture[str]) -> None:
    db.close()
    assert main(["--db", db.path, "sql", "DROP VIEW nodes"]) == 1
    assert "read-only query" in capsys.readouterr().err
    assert main(["--db", db.path, "sql", "SELECT * FROM read_text('/etc/passwd')"]) == 1
    assert main(["--db", db.path, "sql", "SELECT count(*) AS n FROM nodes", "--format", "json"]) == 0
    assert '"n": 1' in capsys.readouterr().out
