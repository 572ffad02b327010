"""The `trellis` command, end to end through `main()` and as a real process."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trellisdb.cli import main


def test_init_demo_log_sql_tag_compact_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "db")
    assert main(["--db", db, "init", "--embedding-dim", "8"]) == 0
    assert "embedding dimension 8" in capsys.readouterr().out
    assert main(["--db", db, "demo", "--sessions", "2", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "best programs AS OF TAG 'after-session-0'" in out
    assert "what to expand next" in out and "where the best program came from" in out
    assert re.search(r"embedded \d+ new attempts into space .minilm.", out) and "by a 'retrieved' edge" in out
    # the two evolving sessions, and the one the demo seeds from them by retrieval
    assert main(["--db", db, "sql", "SELECT count(*) AS n FROM sessions", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"n": 3}
    assert main(["--db", db, "sql", "SELECT count(*) AS n FROM edges WHERE kind = 'retrieved'", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"n": 1}
    assert main(["--db", db, "sql", "SELECT count(*) AS n FROM sessions", "--as-of", "after-session-0",
                 "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["n", "1"]
    assert main(["--db", db, "tag", "final"]) == 0
    assert "tagged commit" in capsys.readouterr().out
    assert main(["--db", db, "log"]) == 0
    assert "final" in capsys.readouterr().out
    assert main(["--db", db, "compact", "--prune-now"]) == 0
    assert main(["--db", db, "verify"]) == 0
    assert "healthy" in capsys.readouterr().out


def test_errors_are_one_line_and_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--db", str(tmp_path / "nope"), "log"]) == 1
    assert "not a trellisdb database" in capsys.readouterr().err
    db = str(tmp_path / "db")
    main(["--db", db, "init"])
    assert main(["--db", db, "sql", "SELEC 1"]) == 1
    assert "SQL failed" in capsys.readouterr().err
    assert main(["--db", db, "sql", "SELECT 1", "--as-of", "no-such-tag"]) == 1
    assert "neither a tag nor" in capsys.readouterr().err


def test_python_dash_m_and_env_default(tmp_path: Path) -> None:
    env = {"TRELLIS_DB": str(tmp_path / "envdb"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run([sys.executable, "-m", "trellisdb", "init"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "envdb" / "trellis.json").exists()


def test_query_and_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "db")
    assert main(["--db", db, "demo", "--sessions", "2", "--steps", "4"]) == 0
    capsys.readouterr()
    q = "FRONTIER RANK BY reward($ch) DESC LIMIT $k RETURN id, reward($ch) AS s"
    assert main(["--db", db, "query", q, "--param", "ch=combined_score", "-p", "k=2", "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[0]["s"] >= rows[1]["s"]
    assert main(["--db", db, "explain", "LINEAGE OF $n ANCESTORS", "-p", f"n={rows[0]['id']}"]) == 0
    out = capsys.readouterr().out
    assert "-- logical plan" in out and "Walk ancestors" in out and "-- DuckDB plan" in out
    assert main(["--db", db, "query", "NODES WHERE"]) == 1
    assert "line 1, column 12" in capsys.readouterr().err
    assert main(["--db", db, "query", "NODES", "--param", "oops"]) == 1
    assert "NAME=VALUE" in capsys.readouterr().err
