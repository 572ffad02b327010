"""For ANY input, the only exception that escapes TQL is a TrellisError; values never change the query."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trellisdb
import trellisdb.schema

VALID = [
    "NODES FROM SESSION 's1' WHERE reward('score') > 0.5 ORDER BY reward('score') DESC LIMIT 3 RETURN id, step",
    "FRONTIER RANK BY ucb(reward('score'), visits, 1.4) DESC PER PARENT 1 LIMIT 5",
    "FRONTIER EXPANDED WHEN children > 1 RANK BY depth, age DESC",
    "LINEAGE OF 'c' ANCESTORS 2 VIA derived_from, crossover_of WHERE step > 0 RETURN id, hop",
    "SUBTREE OF 'r' 3 RETURN id, hop AS OF COMMIT 1",
    "SIBLINGS OF 'a' AS OF TAG 'early'",
    "PATH FROM 'r' TO 'c' AS OF STEP 2 OF SESSION 's1'",
    "EXPLAIN SESSIONS FROM TASK 't' WHERE agent IS NOT NULL",
    "REWARDS WHERE channel IN ('score', 'x') AND value BETWEEN -1 AND 1e3 AS OF TIMESTAMP '2026-01-01'",
    "TASKS WHERE lower(name) = 'x' OR NOT id != 't'",
    # statements that change state: views and exports (exports land under the export root)
    "CREATE OR REPLACE VIEW fz AS preference WHERE status = 'pending' WITH reward = reward('score'), margin = 0.1, "
    "pairs_from = ['siblings']",
    "CREATE VIEW fz2 AS sft WITH reward = reward('score'), threshold = 0.0",
    "MATERIALIZE fz AS OF TAG 'early'",
    "REFRESH fz",
    "EXPORT fz TO 'out/fz' FORMAT parquet WITH validation = 0.1, overwrite = true, skip_missing = true",
    "EXPORT fz TO 'out/fz2' FORMAT trl",
    "DROP VIEW fz2",
    "SHOW VIEWS",
]
PIECES = ["'", '"', ";", "(", ")", ",", "$", "$x", "--", "AS OF", "WHERE", "1", "-", "*", "NULL", " ", "\n",
          "reward(", "'); DROP TABLE nodes; --", "\\", "\x00", "é", "1e999", "9" * 30, "/", "..", "../", "/tmp/",
          "\ud800", "WITH x = 0.1", ", bogus = 1", "overwrite = true", "TO $p", "FORMAT openai", "['a', 1]"]


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[trellisdb.Database]:
    d = trellisdb.connect(Path(tmp_path_factory.mktemp("fuzz")) / "db", embedding_dim=4)
    s = d.session(task="t", agent="a", id="s1")
    s.add_node(id="r")
    s.add_reward("r", "score", 0.1)
    s.add_node(id="a", parents=["r"])
    s.add_node(id="c", parents=["a"])
    d.flush()
    d.tag("early")
    yield d
    d.close()


def run(db: trellisdb.Database, text: str, **params: object) -> None:
    with contextlib.suppress(trellisdb.TrellisError):  # the one allowed failure; anything else fails the test
        db.query(text, **params)
    # whatever the statement did, the store is whole and nothing was written outside it
    files = set(os.listdir(db.path))
    files = {f for f in files if not re.fullmatch(r"wal-\d{8}\.log", f)}  # WAL segments
    assert {"trellis.json", "commits.log", "tables"} <= files <= _STORE_FILES, files
    assert {f"{t}.lance" for t in trellisdb.schema.DATA_TABLES} <= set(os.listdir(os.path.join(db.path, "tables")))
    assert os.listdir(os.path.dirname(db.path)) == ["db"]


_STORE_FILES = {"trellis.json", "commits.log", "commits.hwm", "LOCK", "tables", "views.json", "views", "exports",
                "spaces.json"}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=80))
def test_random_text(db: trellisdb.Database, text: str) -> None:
    run(db, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.sampled_from(VALID),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3), st.sampled_from(PIECES)), max_size=4),
)
def test_mutated_valid_queries(db: trellisdb.Database, base: str, edits: list[tuple[int, int, str]]) -> None:
    text = base
    for pos, cut, piece in edits:
        pos = pos % (len(text) + 1)
        text = text[:pos] + piece + text[pos + cut:]
    run(db, text)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(max_size=40), st.integers(), st.floats(), st.booleans(), st.none(),
                 st.lists(st.integers(), max_size=3), st.binary(max_size=8)))
def test_any_parameter_value(db: trellisdb.Database, value: object) -> None:
    run(db, "NODES WHERE id = $v OR summary = $v", v=value)
    run(db, "LINEAGE OF $v ANCESTORS $v", v=value)
    run(db, "NODES LIMIT $v", v=value)
    run(db, "NODES AS OF COMMIT $v", v=value)
    run(db, "EXPORT fz TO $v WITH overwrite = true", v=value)


INJECTIONS = [
    "'; DROP TABLE nodes; --",
    "x' OR '1'='1",
    "r' UNION SELECT * FROM commits --",
    "\"; SELECT 1; --",
    "$v1",
    "r'); DELETE FROM nodes_history; --",
]


@pytest.mark.parametrize("evil", INJECTIONS)
def test_injection_in_parameters_cannot_change_the_query(db: trellisdb.Database, evil: str) -> None:
    before = db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist()
    assert db.query("NODES WHERE id = $v", v=evil).to_pylist() == []
    assert db.query("NODES WHERE summary = $v OR id = 'r' RETURN id", v=evil).to_pylist() == [{"id": "r"}]
    with pytest.raises(trellisdb.UnknownNodeError):
        db.query("LINEAGE OF $v ANCESTORS", v=evil)
    res = db.query("NODES WHERE id = $v", v=evil)
    assert list(res.params.values()) == [evil]  # travels as a DuckDB parameter
    assert res.sql is not None and (evil not in res.sql or evil == "$v1")
    assert db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist() == before


@pytest.mark.parametrize("evil", INJECTIONS)
def test_injection_in_string_literals_cannot_change_the_query(db: trellisdb.Database, evil: str) -> None:
    lit = "'" + evil.replace("'", "''") + "'"
    res = db.query(f"NODES WHERE id = {lit} OR id = 'r' RETURN id")
    assert res.to_pylist() == [{"id": "r"}]
    assert evil in res.params.values()
    assert res.sql is not None and (evil not in res.sql or evil == "$v1")
    with pytest.raises(trellisdb.QueryNameError):
        db.query(f"NODES WHERE reward({lit}) > 0")  # an unknown channel, not SQL
    with pytest.raises(trellisdb.QueryNameError):
        db.query(f"NODES FROM SESSION {lit}")
