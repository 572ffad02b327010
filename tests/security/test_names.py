"""Every name that reaches disk is checked at the call; a store holding a bad one still opens."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

import trellisdb
from trellisdb.names import MAX_NAME_BYTES

from ..serving import free_port, start, stop

BAD = {
    "lone surrogate": "\ud800",
    "empty": "",
    "NUL": "a\x00b",
    "newline": "a\nb",
    "escape": "\x1b[31mred",
    "C1 control": "a\x85b",
    "line separator": "a\u2028b",
    "bidi override": "abc\u202edcba",
    "too long": "x" * (MAX_NAME_BYTES + 1),
}


@pytest.fixture
def db(tmp_path: Path) -> trellisdb.Database:
    d = trellisdb.connect(tmp_path / "db", embedding_dim=4, commit_delay=60)  # one commit, by the flush below
    s = d.session(task="t", agent="a", id="s")
    s.add_node(id="n1")
    s.add_node(id="n2")
    d.flush()
    return d


def _calls(db: trellisdb.Database, bad: str) -> dict[str, Callable[[], Any]]:
    s = db.resume("s")
    return {
        "tag": lambda: db.tag(bad),
        "session id": lambda: db.session(task="t", agent="a", id=bad),
        "task id": lambda: db.session(task=bad, agent="a"),
        "task id (add_task)": lambda: db.add_task(bad),
        "agent": lambda: db.session(task="t", agent=bad),
        "model": lambda: db.session(task="t", agent="a", model=bad),
        "node id": lambda: s.add_node(id=bad),
        "parent id": lambda: s.add_node(parents=[bad]),
        "kind": lambda: s.add_node(kind=bad),
        "status": lambda: s.add_node(status=bad),
        "status (set_status)": lambda: s.set_status("n1", bad),
        "channel": lambda: s.add_reward("n1", bad, 1.0),
        "verifier": lambda: s.add_reward("n1", "c", 1.0, verifier=bad),
        "verifier_version": lambda: s.add_reward("n1", "c", 1.0, verifier_version=bad),
        "role": lambda: s.add_artifact("n1", bad, "x"),
        "role (add_node)": lambda: s.add_node(artifacts={bad: "x"}),
        "media type": lambda: s.add_artifact("n1", "code", "x", media_type=bad),
        "judge": lambda: s.add_comparison("n1", "n2", "n1", judge=bad),
        "comparison id": lambda: s.add_comparison("n1", "n2", "n1", id=bad),
        "edge end": lambda: s.add_edge("n1", bad),
        "view": lambda: db.create_view(bad, "sft"),
        "space": lambda: db.create_space(bad, dim=2),
        "vector id": lambda: db.add_vectors("sp", [bad], [[1.0, 0.0]]),
        "task tag": lambda: db.add_task("t9", tags=[bad]),
        "session status": lambda: db.resume("s").close(bad),
    }


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_names_are_refused_at_the_call(db: trellisdb.Database, kind: str) -> None:
    db.create_space("sp", dim=2)
    bad = BAD[kind]
    before = db.sql("SELECT (SELECT count(*) FROM nodes_history) + (SELECT count(*) FROM rewards_history) AS n").to_pylist()
    for field, call in _calls(db, bad).items():
        with pytest.raises(trellisdb.ValidationError):
            call()
            pytest.fail(f"{field} accepted {kind}")
    db.flush()
    after = db.sql("SELECT (SELECT count(*) FROM nodes_history) + (SELECT count(*) FROM rewards_history) AS n").to_pylist()
    assert after == before
    assert db.tags() == {}
    assert db.verify() == []


def test_lone_surrogate_tag_no_longer_bricks_the_store(db: trellisdb.Database) -> None:
    """The reproduction: db.tag('\\ud800') was accepted, then every sql/query/log raised UnicodeEncodeError."""
    with pytest.raises(trellisdb.ValidationError, match="tag name"):
        db.tag("\ud800")
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 2}]
    assert len(db.log()) == 1


def _append_log(path: Path, record: dict[str, Any]) -> None:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True)  # ASCII: the surrogate travels as \\ud800
    with open(path, "ab") as fh:
        fh.write(f"{body}\t{zlib.crc32(body.encode()) & 0xFFFFFFFF:08x}\n".encode())


def test_a_store_already_holding_a_bad_name_opens_and_says_what_to_fix(db: trellisdb.Database) -> None:
    """A store written before names were checked: a tag named by a lone surrogate, a commit message with one."""
    cid = db.log()[-1]["id"]
    db.close()
    log = Path(db.path) / "commits.log"
    _append_log(log, {"op": "tag", "name": "\ud800", "id": cid})
    _append_log(log, {"op": "tag", "name": "ok", "id": cid})
    again = trellisdb.connect(db.path)
    assert again.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 2}]
    assert again.query("NODES RETURN id").to_arrow().num_rows == 2
    assert [c["tags"] for c in again.log()] == [["ok"]]
    problems = again.verify()
    assert len(problems) == 1 and "untag" in problems[0] and "\\ud800" in problems[0]
    with again.session(task="t", agent="a") as s:  # writes still work
        s.add_node(id="n3")
    assert again.untag("\ud800") == cid
    assert again.verify() == []
    again.close()
    assert trellisdb.connect(db.path).verify() == []


def test_a_bad_commit_message_in_the_log_reads_escaped(db: trellisdb.Database) -> None:
    db.close()
    log = Path(db.path) / "commits.log"
    lines = log.read_bytes().splitlines(keepends=True)
    after = []
    while json.loads(lines[-1].split(b"\t")[0])["op"] != "commit":  # the checkpoint's record at close
        after.insert(0, lines.pop())
    rec = json.loads(lines[-1].split(b"\t")[0])
    rec["message"] = "bad \ud800 message"
    rec["meta"] = {"best": "bad \ud800 id"}  # commit metadata a writer that did not check left
    log.write_bytes(b"".join(lines[:-1]))
    _append_log(log, rec)
    with open(log, "ab") as fh:  # the checkpoint's record kept after it (without it, the log lost records)
        fh.write(b"".join(after))
    again = trellisdb.connect(db.path)
    assert again.log()[-1]["message"] == "bad \\ud800 message"
    assert again.sql("SELECT message FROM commits").to_pylist() == [{"message": "bad \\ud800 message"}]
    assert again.sql("SELECT meta FROM commits").to_pylist() == [{"meta": '{"best": "bad \\ud800 id"}'}]
    again.close()


def test_names_in_bulk_ingest_are_checked_vectorized(db: trellisdb.Database) -> None:
    for bad in BAD.values():
        if bad == "\ud800":
            continue  # Arrow refuses to build such a string at all
        with pytest.raises(trellisdb.ValidationError):
            db.ingest({"nodes": pa.table({"id": ["ok1", bad], "session_id": ["s", "s"], "task_id": ["t", "t"]})})
        with pytest.raises(trellisdb.ValidationError):
            db.ingest({"rewards": pa.table({"node_id": ["n1"], "channel": [bad], "value": [1.0]})})
    invalid = pa.Array.from_buffers(pa.string(), 1, [None, pa.py_buffer(b"\x00\x00\x00\x00\x02\x00\x00\x00"),
                                                     pa.py_buffer(b"\xff\xfe")])
    with pytest.raises(trellisdb.ValidationError, match="UTF-8"):
        db.ingest({"tasks": pa.table({"id": invalid})})
    assert db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist() == [{"n": 2}]


SURROGATE = "\ud800"

#: Every door by which a caller's string reaches DuckDB or Arrow in a read (issue 35): TQL
#: literals, TQL parameters (the in-memory lineage walk too), db.sql parameters (nested ones too).
_READS: dict[str, tuple[str, dict[str, Any]]] = {
    "SUBTREE literal": (f"SUBTREE OF '{SURROGATE}'", {}),
    "LINEAGE $param": ("LINEAGE OF $x ANCESTORS", {"x": SURROGATE}),
    "PATH $param": ("PATH FROM 'n1' TO $x", {"x": SURROGATE}),
    "WHERE literal": (f"NODES WHERE summary = 'ab{SURROGATE}cd' RETURN id", {}),
    "WHERE $param": ("NODES WHERE id = $x RETURN id", {"x": "n" + SURROGATE}),
    "MATCHING literal": (f"RETRIEVE 3 MATCHING '{SURROGATE}' RETURN id", {}),
    "has_label literal": (f"NODES WHERE has_label('{SURROGATE}')", {}),
    "a name": (f"NODES WHERE {SURROGATE} = 1", {}),
    "a comment": (f"NODES -- {SURROGATE}\nRETURN id", {}),
}


def _encodable(e: BaseException) -> str:
    text = str(e)
    text.encode("utf-8")  # a message a server can send: the surrogate shown escaped, if at all
    return text


@pytest.mark.parametrize("door", list(_READS))
def test_a_lone_surrogate_in_a_query_is_a_clear_error_at_the_call(db: trellisdb.Database, door: str) -> None:
    text, params = _READS[door]
    for _ in range(2):  # the second time, with the lineage adjacency warm (its walk is in memory)
        with pytest.raises(trellisdb.QueryError) as e:
            db.query(text, **params)
        msg = _encodable(e.value)
        assert "not valid UTF-8" in msg and "DuckDB" not in msg, msg
        if params:  # a parameter: named, with its place in the text
            assert e.value.span is not None and msg.startswith("parameter $x (line 1, column"), msg
        else:  # in the text: a syntax error pointing at the surrogate, with a caret excerpt
            assert isinstance(e.value, trellisdb.QuerySyntaxError) and e.value.span is not None
            assert e.value.query is not None and e.value.query[e.value.span.start] == SURROGATE
            assert "\\ud800" in msg and "^" in msg
        db.query("LINEAGE OF 'n2' ANCESTORS")


@pytest.mark.parametrize("params", [{"x": SURROGATE}, [SURROGATE], [[SURROGATE]], {"x": {"k": SURROGATE}},
                                    {"x": {SURROGATE: 1}}])
def test_a_lone_surrogate_in_a_sql_parameter_is_a_clear_error(db: trellisdb.Database, params: Any) -> None:
    text = "SELECT $x AS v" if isinstance(params, dict) else "SELECT $1 AS v"
    with pytest.raises(trellisdb.QueryError, match=r"parameter \$(x|1) is not valid UTF-8 text") as e:
        db.sql(text, params=params)
    assert "DuckDB" not in _encodable(e.value) and "Conversion" not in str(e.value)
    with pytest.raises(trellisdb.QueryError, match="not valid UTF-8"):
        db.snapshot().sql(text, params)


def test_a_lone_surrogate_in_a_parameter_name_is_named_escaped(db: trellisdb.Database) -> None:
    with pytest.raises(trellisdb.QueryError, match=r"\$\\ud800 given but not used") as e:
        db.query("NODES", **{SURROGATE: 1})
    _encodable(e.value)


def test_a_lone_surrogate_over_http_is_a_400_naming_it(db: trellisdb.Database) -> None:
    """JSON escapes a lone surrogate (``"\\ud800"``): over the server, TQL text, TQL parameters and
    SQL parameters get HTTP 400 with the error, not a 500 from a message no response can encode."""
    db.close()
    port = free_port()
    proc = start(Path(db.path), port, "tok")
    try:
        url, h = f"http://127.0.0.1:{port}", {"authorization": "Bearer tok", "content-type": "application/json"}
        bodies = {
            "/v1/query": ['{"tql": "SUBTREE OF \'\\ud800\'"}', '{"tql": "LINEAGE OF $x ANCESTORS", "params": {"x": "\\ud800"}}'],
            "/v1/sql": ['{"sql": "SELECT $1 AS v", "params": ["\\ud800"]}'],
        }
        for route, texts in bodies.items():
            for body in texts:
                r = httpx.post(f"{url}{route}", content=body.encode(), headers=h)
                assert r.status_code == 400, (route, body, r.status_code, r.text[:300])
                assert r.json()["error"] in ("QueryError", "QuerySyntaxError") and "not valid UTF-8" in r.json()["message"]
        r = httpx.post(f"{url}/v1/query", json={"tql": "NODES RETURN id"}, headers=h)
        assert r.status_code == 200 and len(r.json()["rows"]) == 2
    finally:
        stop(proc)
