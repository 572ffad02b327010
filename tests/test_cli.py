"""The `trellis` command, end to end through `main()` and as a real process."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trellisdb.cli import main


def test_init_demo_log_sql_tag_compact_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = str(tmp_path / "db")
    assert main(["--db", db, "init", "--embedding-dim", "8"]) == 0
    assert "embedding dimension 8" in capsys.readouterr().out
    assert main(["demo", "--db", db, "--tasks", "2", "--steps", "10", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "SIMULATION" in out and "what did the agent know at step" in out and "where the best kernel of" in out
    # every command the demo tells the reader to try runs as printed (with its --db)
    tries = [shlex.split(line.strip()) for line in out.splitlines() if line.strip().startswith("trellis --db")]
    assert len(tries) == 2
    for argv in tries:
        assert argv[:3] == ["trellis", "--db", db]
        assert main(argv[1:]) == 0, capsys.readouterr().err
        assert re.search(r"\(\d+ rows?", capsys.readouterr().out)
    commits = int(re.search(r"wrote (\d+) commits", out).group(1))  # type: ignore[union-attr]
    assert main(["--db", db, "sql", "SELECT count(*) AS n FROM commits", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"n": commits}  # the demo's commits, all of them
    # a cold and a warm session per task; each warm one starts from a retrieved champion
    assert main(["--db", db, "sql", "SELECT count(*) AS n FROM sessions", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"n": 4}
    assert main(["--db", db, "sql", "SELECT count(DISTINCT dst) AS n FROM edges WHERE kind = 'retrieved'",
                 "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["n"] >= 1
    assert main(["--db", db, "sql", "SELECT count(*) AS n FROM sessions", "--as-of", "1", "--format", "csv"]) == 0
    assert capsys.readouterr().out.splitlines() == ["n", "0"]
    assert main(["--db", db, "tag", "final"]) == 0
    assert "tagged commit" in capsys.readouterr().out
    assert main(["--db", db, "log"]) == 0
    assert "final" in capsys.readouterr().out
    assert main(["--db", db, "compact", "--prune-now"]) == 0
    assert main(["--db", db, "verify"]) == 0
    assert "healthy" in capsys.readouterr().out


def test_demo_sizes_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for args, said in ((["--tasks", "1"], "at least 2"), (["--tasks", "0"], "at least 2"),
                       (["--steps", "0"], "at least 1"), (["--target", "1.5"], "fraction")):
        assert main(["demo", "--db", str(tmp_path / "d.db"), *args]) == 1
        assert said in capsys.readouterr().err
    assert not (tmp_path / "d.db").exists()  # nothing written


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
    assert main(["--db", db, "demo", "--tasks", "2", "--steps", "8", "--no-plots"]) == 0
    capsys.readouterr()
    q = "FRONTIER RANK BY reward($ch) DESC LIMIT $k RETURN id, reward($ch) AS s"
    assert main(["--db", db, "query", q, "--param", "ch=speedup", "-p", "k=2", "--format", "json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and rows[0]["s"] >= rows[1]["s"]
    assert main(["--db", db, "explain", "LINEAGE OF $n ANCESTORS", "-p", f"n={rows[0]['id']}"]) == 0
    out = capsys.readouterr().out
    assert "-- logical plan" in out and "Walk ancestors" in out and "-- DuckDB plan" in out
    assert main(["--db", db, "query", "NODES WHERE"]) == 1
    assert "line 1, column 12" in capsys.readouterr().err
    assert main(["--db", db, "query", "NODES", "--param", "oops"]) == 1
    assert "NAME=VALUE" in capsys.readouterr().err
