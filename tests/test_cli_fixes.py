"""Issue 26: the command line on a first run, each fix through the real command.

Views over data without texts, `--db` on either side of the command, CSV line ends, empty
results said out loud, messages in the command's words, keyword suggestions, `--version`,
`--format` / `--width`, `trellis embed`, and progress bars that only a terminal sees.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pytest

import trellisdb
from trellisdb.cli import CLI_WORDS, in_cli_words, main
from trellisdb.cli.output import format_table
from trellisdb.database import open_local
from trellisdb.training import ViewOptions

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    """``trellis ARGS`` through ``main``: (exit status, stdout, stderr)."""

    def go(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    return go


def summaries_only(path: Path, tasks: int = 1) -> str:
    """A store whose nodes have summaries and rewards, no artifacts (an OpenEvolve import without
    code, a hand-written agent): no row of any view names a text."""
    db = trellisdb.connect(path, embedding_dim=4)
    for t in range(tasks):
        with db.session(task=f"t{t}", agent="a") as s:
            a = s.add_node(summary=f"root {t}")
            s.add_reward(a, "combined_score", 0.5)
            b = s.add_node(summary=f"child {t}", parents=[a])
            s.add_reward(b, "combined_score", 0.2)
    db.close()
    return str(path)


def with_texts(path: Path) -> str:
    """One task, three scored attempts with prompt and response artifacts."""
    db = trellisdb.connect(path, embedding_dim=4)
    with db.session(task="only", agent="a") as s:
        for i, score in enumerate((0.2, 0.6, 0.9)):
            n = s.add_node(summary=f"try {i}", artifacts={"prompt": "pack circles", "response": f"r = {i}"})
            s.add_reward(n, "combined_score", score)
    db.close()
    return str(path)


def add_summaries(path: str) -> None:
    db = trellisdb.connect(path)
    with db.session(task="t9", agent="a") as s:
        n = s.add_node(summary="later")
        s.add_reward(n, "combined_score", 0.9)
    db.close()


# ------------------------------------------------------------- 1. views without texts
@pytest.mark.parametrize("keep_texts", ["true", "false"])
def test_views_of_nodes_without_texts_materialize_refresh_and_export(tmp_path: Path, run: Run, keep_texts: str) -> None:
    db = summaries_only(tmp_path / "db")
    code, out, err = run("--db", db, "create-view", "best", "sft", "-o", "reward=reward('combined_score')",
                         "-o", "threshold=0.3", "-o", f"keep_texts={keep_texts}")
    assert code == 0, err
    code, out, err = run("--db", db, "materialize", "best")
    assert code == 0, err  # was an IndexError in training/texts.py: no text to code
    assert "1 rows at commit 1" in out
    add_summaries(db)
    code, out, err = run("--db", db, "refresh", "best")
    assert code == 0 and "2 rows at commit 2" in out, err
    # the rows are there, their text columns empty
    with trellisdb.connect(db) as d:
        rows = d.view("best").to_pylist()
    assert len(rows) == 2 and all(r["prompt_hash"] is None and r["response_hash"] is None for r in rows)
    # an export needs texts: a clear error saying what to do, in the command's words
    code, out, err = run("--db", db, "export", "best", "out")
    assert code == 1 and "lack a 'prompt, response' artifact" in err and "use --skip-missing" in err, err
    assert "skip_missing=True" not in err
    code, out, err = run("--db", db, "export", "best", "out", "--skip-missing")
    assert code == 0 and "wrote 0 rows" in out, err
    assert "export wrote 0 rows: all 2 rows of view 'best' lack texts" in err
    assert json.loads((Path(db) / "exports" / "out" / "manifest.json").read_text())["skipped_missing_texts"] == 2
    code, out, err = run("--db", db, "export", "best", "pq", "--skip-missing", "--format", "parquet")
    assert code == 0, err


def test_a_view_mixing_nodes_with_and_without_texts(tmp_path: Path) -> None:
    db = open_local(tmp_path / "db", embedding_dim=4)
    with db.session(task="t", agent="a") as s:
        a = s.add_node(summary="no texts")
        s.add_reward(a, "score", 1.0)
        b = s.add_node(summary="texts", artifacts={"prompt": "p", "response": "r"})
        s.add_reward(b, "score", 1.0)
    db.create_view("all", "sft", reward="reward('score')")
    assert db.materialize("all", progress=False)["rows"] == 2
    m = db.export("all", tmp_path / "out", skip_missing=True, progress=False)
    assert (m["rows"], m["skipped_missing_texts"]) == (1, 1)
    line = json.loads((tmp_path / "out" / "train.jsonl").read_text())
    assert [t["content"] for t in line["messages"]] == ["p", "r"]
    db.close()


# ------------------------------------------------------------- 2. --db on either side
def test_global_options_go_before_or_after_the_command(tmp_path: Path, run: Run) -> None:
    a, b = summaries_only(tmp_path / "a"), str(tmp_path / "b")
    assert run("init", "--db", b)[0] == 0
    assert run("--db", a, "tag", "only-a")[0] == 0
    code, out, _ = run("log", "--db", a, "--format", "json")
    assert code == 0 and "only-a" in out
    # after the command wins over before it
    code, out, _ = run("--db", a, "log", "--db", b, "--format", "json")
    assert code == 0 and "only-a" not in out
    code, out, _ = run("--db", b, "log", "--db", a, "--format", "json")
    assert code == 0 and "only-a" in out
    # --read-only and --export-root after the command too
    code, _, err = run("tag", "x", "--db", a, "--read-only")
    assert code == 1 and "read-only" in err
    code, _, err = run("export", "v", "p", "--db", a, "--export-root", str(tmp_path / "elsewhere"))
    assert code == 1 and "unknown view 'v'" in err


def test_precedence_of_db_env_and_default(tmp_path: Path) -> None:
    env = {**os.environ, "TRELLIS_DB": str(tmp_path / "env")}

    def trellis(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trellisdb", *args], env=env, capture_output=True, text=True,
                              cwd=tmp_path)

    assert trellis("init").returncode == 0  # $TRELLIS_DB
    assert (tmp_path / "env" / "trellis.json").exists()
    assert trellis("--db", str(tmp_path / "before"), "init").returncode == 0  # --db beats $TRELLIS_DB
    assert (tmp_path / "before" / "trellis.json").exists()
    r = trellis("--db", str(tmp_path / "before"), "init", "--db", str(tmp_path / "after"))
    assert r.returncode == 0 and (tmp_path / "after" / "trellis.json").exists()
    del env["TRELLIS_DB"]
    r = trellis("log")  # the default, ./trellis.db
    assert r.returncode == 1 and "./trellis.db is not a trellisdb database" in r.stderr
    assert "`trellis init`" in r.stderr


@pytest.mark.parametrize("name", ["plain", "with space"])
def test_the_not_a_database_error_suggests_a_command_that_works(tmp_path: Path, run: Run, name: str) -> None:
    path = str(tmp_path / name)
    code, _, err = run("--db", path, "log")
    assert code == 1 and "is not a trellisdb database" in err
    suggested = re.search(r"`(trellis [^`]+)`", err)
    assert suggested, err
    argv = shlex.split(suggested.group(1))[1:]
    assert run(*argv)[0] == 0  # the suggestion runs as written
    assert run("--db", path, "log")[0] == 0


# ------------------------------------------------------------- 3. CSV line ends
def test_csv_lines_end_in_lf(tmp_path: Path) -> None:
    db = with_texts(tmp_path / "db")
    r = subprocess.run([sys.executable, "-m", "trellisdb", "--db", db, "sql", "--format", "csv",
                        "SELECT id, summary, 'a,b' AS c FROM nodes ORDER BY summary"], capture_output=True)
    assert r.returncode == 0, r.stderr
    assert b"\r" not in r.stdout
    lines = r.stdout.decode().split("\n")
    assert lines[0] == "id,summary,c" and len(lines) == 5 and lines[-1] == ""
    assert lines[1].endswith(',try 0,"a,b"')
    t = pa.table({"a": ["x", "y"], "b": [1, 2]})
    assert format_table(t, "csv") == "a,b\nx,1\ny,2"


# ------------------------------------------------------------- 4. empty results
def test_an_empty_export_says_why(tmp_path: Path, run: Run) -> None:
    db = with_texts(tmp_path / "db")
    run("--db", db, "create-view", "best", "sft", "-o", "reward=reward('combined_score')", "-o", "threshold=0.95")
    code, out, err = run("--db", db, "materialize", "best")
    assert code == 0 and "0 rows" in out
    assert "view 'best' is empty at commit 1: no node passes threshold 0.95" in err
    code, out, err = run("--db", db, "export", "best", "out")
    assert code == 0 and "wrote 0 rows" in out
    assert "export wrote 0 rows: view 'best' is empty at commit 1 (no node passes threshold 0.95" in err
    assert "reward('combined_score') >= 0.95" in err


def test_an_empty_split_says_splits_are_by_task(tmp_path: Path, run: Run) -> None:
    db = with_texts(tmp_path / "db")
    run("--db", db, "create-view", "best", "sft", "-o", "reward=reward('combined_score')", "-o", "threshold=0.5")
    run("--db", db, "materialize", "best")
    # sha256('only') as a fraction is ~0.97: below that, every row goes to train
    code, out, err = run("--db", db, "export", "best", "out", "--validation", "0.5")
    assert code == 0 and "train 2, validation 0" in out, err
    assert "split 'validation' has 0 rows: the view holds 1 task and splits are by task" in err
    manifest = json.loads((Path(db) / "exports" / "out" / "manifest.json").read_text())
    assert manifest["split"]["tasks"] == {"train": 1, "validation": 0}
    code, out, err = run("--db", db, "export", "best", "none", "--validation", "0")
    assert code == 0 and err == ""  # a full export, nothing to say


# ------------------------------------------------------------- 5. the command's words
def test_cli_errors_name_options_and_commands_not_python_calls(tmp_path: Path, run: Run) -> None:
    db = with_texts(tmp_path / "db")
    reward = "reward=reward('combined_score')"
    assert run("--db", db, "create-view", "best", "sft", "-o", reward)[0] == 0
    cases = [
        (("create-view", "best", "sft", "-o", reward), "use --replace to redefine it"),
        (("materialize", "nope"), "(create one with `trellis create-view NAME KIND -o ...`)"),
        (("export", "best", "out"), "run `trellis materialize best`"),
        (("create-view", "k", "kto", "-o", reward), "needs -o threshold=..."),
        (("create-view", "k", "sft", "-o", "path=1"), "path must be true or false"),
        (("sql", "SELECT 1; SELECT 2"), "trellis sql runs one statement per call; this text has 2"),
        (("--read-only", "materialize", "best"), "(--read-only); drop --read-only to write"),
        (("export", "best", "/abs/path"), "the root is set by whoever opens the database (--export-root)"),
        (("embed", "nope"), "create it, a MiniLM space, with `trellis embed nope --create`"),
        (("embed", "nope", "--target", "tasks"), "`trellis embed nope --target tasks --create`"),
        (("embed", "embedding"), "`trellis embed NAME --create`"),
    ]

    def check(cases: list[tuple[tuple[str, ...], str]]) -> None:
        for argv, wanted in cases:
            code, _, err = run("--db", db, *argv)
            assert code == 1, (argv, err)
            assert wanted in err, (argv, err)
            assert not re.search(r"\w=True|db\.\w+\(|pass \w+=|read_only|connect\(", err), (argv, err)

    check(cases)
    run("--db", db, "tag", "t1")
    run("--db", db, "materialize", "best")
    run("--db", db, "export", "best", "done")
    with trellisdb.connect(db) as d, d.session(task="only", agent="a") as s:
        s.add_node(summary="one more")
    check([
        (("export", "best", "done"), "exists; use --overwrite to replace it"),
        (("tag", "t1"), "use --move to point it at"),
    ])
    # the Python API keeps its own words
    with trellisdb.connect(db) as d:
        with pytest.raises(trellisdb.TrellisError, match=r"pass replace=True"):
            d.create_view("best", "sft", reward="reward('combined_score')")
        with pytest.raises(trellisdb.TrellisError, match=r"create one with db\.create_view"):
            d.materialize("nope")


def test_rewording_rules_are_scoped_to_their_commands() -> None:
    # TQL's CREATE VIEW is redefined with OR REPLACE, not --replace: that rule is create-view's only
    assert in_cli_words("x; pass replace=True to redefine it", "query") == "x; pass replace=True to redefine it"
    assert in_cli_words("run db.materialize('v') first", "query") == "run `trellis materialize v` first"
    # the messages of a damaged store (tests/security/test_commit_log.py makes them), on their text
    assert in_cli_words("the commit log is damaged (x); writes are refused until db.repair() (`trellis repair`) "
                        "mends it", "log").endswith("writes are refused until `trellis repair` mends it")
    assert in_cli_words("the texts of view 'v' (p) are unreadable (e); run db.materialize(name) to recompute them",
                        "export").endswith("run `trellis materialize NAME` to recompute them")
    for commands, pattern, _ in CLI_WORDS:
        re.compile(pattern)
        assert commands is None or commands, pattern


def test_create_view_help_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["create-view", "-h"])
    out = capsys.readouterr().out
    assert "trellisdb/training" not in out and "views.py" not in out
    with pytest.raises(SystemExit):
        main(["-h"])
    assert "trellisdb/training" not in capsys.readouterr().out
    for kind in ("sft", "preference", "grpo", "kto", "stepwise", "replay"):
        assert f"\n  {kind} " in out
    assert "-o threshold=... required" in out
    for f in dataclasses.fields(ViewOptions):  # every option is named (a new one must be added there)
        assert f.name in ("name", "kind") or f"-o {f.name}=" in out, f.name


# ------------------------------------------------------------- 6. keyword suggestions
@pytest.mark.parametrize(("text", "keyword"), [
    ("FRONTEIR LIMIT 3", "FRONTIER"),
    ("fronteir limit 3", "FRONTIER"),
    ("NODES WHERE step > 1 LIMT 3", "LIMIT"),
    ("NODES ORDR BY step", "ORDER"),
    ("NODES RETRUN id", "RETURN"),
    ("LINEAGE OF 'x' ANCESTOR", "ANCESTORS"),
])
def test_a_misspelt_keyword_gets_did_you_mean(text: str, keyword: str) -> None:
    with pytest.raises(trellisdb.QuerySyntaxError) as ei:
        trellisdb.tql.parser.parse(text)
    hint = [ln for ln in str(ei.value).splitlines() if ln.strip().startswith("hint:")]
    assert hint and f"did you mean {keyword}?" in hint[0], str(ei.value)


@pytest.mark.parametrize(("text", "hint"), [
    ("SELECT id FROM nodes", "starts with the entity"),  # not a misspelling: the old hint stays
    ("NODES RANK BY id", None),  # a keyword in the wrong place: no suggestion
])
def test_no_did_you_mean_for_words_that_are_not_misspellings(text: str, hint: str | None) -> None:
    with pytest.raises(trellisdb.QuerySyntaxError) as ei:
        trellisdb.tql.parser.parse(text)
    msg = str(ei.value)
    assert "did you mean" not in msg
    if hint:
        assert hint in msg


def test_did_you_mean_on_the_command_line(tmp_path: Path, run: Run) -> None:
    db = summaries_only(tmp_path / "db")
    code, _, err = run("--db", db, "query", "FRONTEIR LIMIT 3")
    assert code == 1 and "hint: did you mean FRONTIER? as in: FRONTIER LIMIT 3" in err
    assert "RETURN for the projection" not in err


# ------------------------------------------------------------- 7. version, sql, formats, width
def test_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "trellisdb", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"trellis (trellisdb) {version('trellisdb')}"


def test_sql_refuses_several_statements(tmp_path: Path, run: Run) -> None:
    db = summaries_only(tmp_path / "db")
    code, out, err = run("--db", db, "sql", "SELECT 1 AS a; SELECT 2 AS b")
    assert code == 1 and out == "" and "runs one statement per call; this text has 2" in err
    code, out, _ = run("--db", db, "sql", "SELECT 1 AS a;", "--format", "json")
    assert code == 0 and json.loads(out) == {"a": 1}


def test_log_and_views_take_format(tmp_path: Path, run: Run) -> None:
    db = summaries_only(tmp_path / "db")
    run("--db", db, "create-view", "best", "sft", "-o", "reward=reward('combined_score')")
    code, out, _ = run("--db", db, "log", "--format", "json")
    assert code == 0 and [json.loads(x)["id"] for x in out.splitlines()] == [1]
    code, out, _ = run("--db", db, "log", "--format", "csv")
    assert out.splitlines()[0].startswith("id,time,")
    code, out, _ = run("--db", db, "views", "--format", "json")
    assert json.loads(out)["name"] == "best"
    code, out, _ = run("--db", db, "views", "--format", "csv")
    assert out.splitlines()[1].startswith("best,sft,")


def test_width_widens_or_removes_the_cut_and_the_cut_is_said(tmp_path: Path, run: Run) -> None:
    db = summaries_only(tmp_path / "db")
    long = "x" * 100
    q = f"SELECT '{long}' AS t"
    def table(*argv: str) -> str:
        code, out, err = run("--db", db, *argv)
        assert code == 0, err
        return out

    out = table("sql", q)
    assert long not in out and "x" * 60 + "..." in out
    assert "texts longer than 60 characters are cut: --width N to widen, --width 0 for whole texts" in out
    for width in ("0", "120"):
        out = table("sql", q, "--width", width)
        assert long in out and "cut" not in out
    out = table("query", "NODES RETURN summary", "--width", "3")
    assert "chi..." in out and "longer than 3 characters" in out
    assert table("sql", "SELECT 'short' AS t").strip().endswith("(1 row)")
    with pytest.raises(SystemExit):
        main(["--db", db, "sql", q, "--width", "-1"])


# ------------------------------------------------------------- 8. trellis embed
def test_embed_needs_a_space_and_creates_a_minilm_one(tmp_path: Path, run: Run) -> None:
    from trellisdb.embed import minilm_dir
    from trellisdb.errors import EmbedderError

    db = summaries_only(tmp_path / "db", tasks=2)
    code, _, err = run("--db", db, "embed", "mini")
    assert code == 1 and "unknown embedding space 'mini' of nodes" in err
    try:
        minilm_dir()
    except EmbedderError:
        pytest.skip("MiniLM's weights are not installed")
    code, out, err = run("--db", db, "embed", "mini", "--create")
    assert code == 0, err
    assert out.strip() == "embedded 4 nodes into space 'mini'"
    assert "created space 'mini' of nodes (all-MiniLM-L6-v2, 384 dimensions)" in err
    code, out, err = run("--db", db, "embed", "mini", "--create", "--quiet")  # exists: embeds what is missing
    assert code == 0 and out.startswith("embedded 0 nodes") and "created" not in err
    code, out, _ = run("--db", db, "query", "RETRIEVE 1 SIMILAR TO 'root 1' IN mini RETURN summary",
                       "--format", "json")
    assert code == 0 and json.loads(out)["summary"] == "root 1"


# ------------------------------------------------------------- 9. progress bars
def _bar_drawn(err: str) -> bool:
    return bool(re.search(r"\d+/\d+|\d+ rows", err)) and "\r" in err


def test_no_bar_unless_stderr_is_a_terminal(tmp_path: Path, run: Run) -> None:
    db = with_texts(tmp_path / "db")
    run("--db", db, "create-view", "best", "sft", "-o", "reward=reward('combined_score')")
    for argv in (("materialize", "best"), ("refresh", "best"), ("export", "best", "o"), ("compact",)):
        code, _, err = run("--db", db, *argv)
        assert code == 0 and err == "", (argv, err)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bars_on_a_terminal_and_quiet_hides_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = with_texts(tmp_path / "db")
    assert main(["--db", db, "create-view", "best", "sft", "-o", "reward=reward('combined_score')"]) == 0

    def stderr_of(*argv: str) -> str:
        term = _Terminal()
        monkeypatch.setattr(sys, "stderr", term)
        assert main(["--db", db, *argv]) == 0
        monkeypatch.undo()
        return term.getvalue()

    for argv, quiet, desc in ((("materialize", "best"), ("--quiet", "materialize", "best"), "materialize best"),
                              (("export", "best", "o"), ("export", "best", "o2", "--quiet"), "export best"),
                              (("compact",), ("compact", "--no-progress"), "compact")):
        err = stderr_of(*argv)
        assert desc in err and _bar_drawn(err), (argv, err)
        assert stderr_of(*quiet) == "", quiet
    with trellisdb.connect(db) as d, d.session(task="only", agent="a") as s:
        s.add_node(summary="more")
    err = stderr_of("refresh", "best", "--no-progress")
    assert err == ""


def test_library_progress_parameters(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = open_local(with_texts(tmp_path / "db"))
    db.create_view("best", "sft", reward="reward('combined_score')")
    capsys.readouterr()
    db.materialize("best")  # None: stderr is not a terminal here
    assert capsys.readouterr().err == ""
    db.materialize("best", progress=True)
    assert "materialize best" in capsys.readouterr().err
    seen: list[tuple[int, int]] = []
    db.export("best", tmp_path / "a", progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (3, 3) and capsys.readouterr().err == ""
    db.export("best", tmp_path / "b", progress=True)
    assert "export best" in capsys.readouterr().err
    db.compact(progress=True)
    assert "compact" in capsys.readouterr().err
    db.compact(progress=False)
    assert capsys.readouterr().err == ""
    db.close()
