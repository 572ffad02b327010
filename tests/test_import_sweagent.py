"""``trellis import swe-agent``: every real trajectory round-trips (steps, actions, states,
observations, info), an SFT export of each reproduces its ``history`` message for message,
states are retrievable, and imports are idempotent, one commit per file, stopped by a bad file
with its name and line. Reads the 20 files of ``../shared/data/swe-agent-trajectories``."""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

import trellisdb
from trellisdb.errors import ImportFormatError
from trellisdb.importers import import_run
from trellisdb.importers.sweagent import _split_history

from .shared import shared_data

DATA = shared_data("swe-agent-trajectories")
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"the SWE-agent trajectories are not at {DATA}")

FILES = sorted(DATA.rglob("*.traj")) if DATA.is_dir() else []


def rel(f: Path) -> str:
    return f.relative_to(DATA).as_posix()


def unit(f: Path) -> str:
    """The unit (and session) name of a trajectory: its stem and the start of its bytes' sha256."""
    return f"{f.stem}@{hashlib.sha256(f.read_bytes()).hexdigest()[:16]}"


def sid_of(f: Path) -> str:
    return f"swe-agent:{unit(f)}"


def load(f: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(f.read_text())
    return doc


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[trellisdb.Database, Any]]:
    db = trellisdb.connect(tmp_path_factory.mktemp("swe") / "db")
    report = import_run(db, "swe-agent", DATA, progress=False)
    yield db, report
    db.close()


def artifacts(db: trellisdb.Database, session: str) -> dict[tuple[str, str], str]:
    rows = db.sql("SELECT na.node_id, na.name, a.content FROM node_artifacts na JOIN artifacts_full a ON a.hash = na.hash "
                  "WHERE na.node_id IN (SELECT id FROM nodes WHERE session_id = $s)", params={"s": session}).to_pylist()
    return {(r["node_id"], r["name"]): r["content"].decode() for r in rows}


def session_attrs(db: trellisdb.Database, session: str) -> dict[str, Any]:
    rows = db.sql("SELECT key, value FROM attributes WHERE scope = 'session' AND entity = $s",
                  params={"s": session}).to_pylist()
    return {r["key"]: json.loads(r["value"]) for r in rows}


def test_one_commit_per_file(imported: tuple[trellisdb.Database, Any]) -> None:
    db, report = imported
    assert len(FILES) == 20
    assert report.imported == [unit(f) for f in FILES] and len(report.commits) == 20
    assert report.nodes == sum(len(load(f).get("trajectory", [])) for f in FILES)
    units = db.sql("SELECT json_extract_string(meta, '$.import.unit') AS u FROM commits "
                   "WHERE json_extract_string(meta, '$.import.format') = 'swe-agent' ORDER BY id").to_pylist()
    assert [u["u"] for u in units] == [unit(f) for f in FILES]


@pytest.mark.parametrize("f", FILES, ids=rel)
def test_every_file_round_trips(imported: tuple[trellisdb.Database, Any], f: Path) -> None:
    db, _ = imported
    doc = load(f)
    sid = sid_of(f)
    steps = doc.get("trajectory", [])
    info = doc.get("info", {})
    rc = doc.get("replay_config")
    sess = db.sql("SELECT * FROM sessions WHERE id = $s", params={"s": sid}).to_pylist()
    assert len(sess) == 1
    s = sess[0]
    assert s["agent"] == "swe-agent"
    assert s["model"] == (rc["agent"]["model"]["name"] if rc else None)
    assert s["task_id"] == (rc["problem_statement"]["id"] if rc else f.stem)
    config = json.loads(s["config"]) if s["config"] else {}
    assert config.get("environment") == doc.get("environment") and config.get("replay_config") == rc
    nodes = db.sql("SELECT * FROM nodes WHERE session_id = $s ORDER BY seq", params={"s": sid}).to_pylist()
    assert [n["step"] for n in nodes] == list(range(1, len(steps) + 1))  # insertion order is step order
    assert all(n["kind"] == "step" and n["task_id"] == s["task_id"] for n in nodes)
    arts = artifacts(db, sid)
    for n, step in zip(nodes, steps, strict=True):
        assert n["id"] == f"{sid}#{n['step']}"
        assert n["action"] == step["action"]
        state = step["state"]
        if isinstance(state, str):
            assert n["state"] == state  # the file's text, as is
        else:
            assert json.loads(n["state"]) == state
        for key in ("thought", "observation", "response"):
            assert arts[(n["id"], key)] == step[key]
        first = next((ln.strip() for ln in step["thought"].splitlines() if ln.strip()), None)
        assert n["summary"] == (first[:200] if first else None)
        assert n["seconds"] == step.get("execution_time")
    edges = db.sql("SELECT src, dst, kind FROM edges WHERE session_id = $s", params={"s": sid}).to_pylist()
    ids = [n["id"] for n in nodes]
    assert sorted((e["src"], e["dst"]) for e in edges) == sorted(itertools.pairwise(ids))
    assert {e["kind"] for e in edges} <= {"derived_from"}
    attrs = session_attrs(db, sid)
    stats = info.get("model_stats", {})
    assert {k: attrs[k] for k in stats} == stats
    assert attrs.get("exit_status") == info.get("exit_status")
    rewards = db.sql("SELECT node_id, channel, value FROM rewards WHERE node_id IN (SELECT id FROM nodes "
                     "WHERE session_id = $s)", params={"s": sid}).to_pylist()
    if steps and "exit_status" in info:
        assert rewards == [{"node_id": ids[-1], "channel": "submitted",
                            "value": 1.0 if info["exit_status"].startswith("submitted") else 0.0}]
        assert arts[(ids[-1], "submission")] == info["submission"]
        for key in ("edited_files30", "edited_files50", "edited_files70"):
            if key in info:
                assert arts[(ids[-1], key)] == info[key]
    else:
        assert rewards == []


def test_the_empty_trajectory_is_an_empty_session(imported: tuple[trellisdb.Database, Any]) -> None:
    db, _ = imported
    f = DATA / "demonstrations" / "function_calling_simple.traj"
    doc = load(f)
    sid = sid_of(f)
    assert doc.get("trajectory", []) == [] and doc["history"]
    assert db.sql("SELECT count(*) AS n FROM sessions WHERE id = $s", params={"s": sid}).to_pylist() == [{"n": 1}]
    assert db.sql("SELECT count(*) AS n FROM nodes WHERE session_id = $s", params={"s": sid}).to_pylist() == [{"n": 0}]
    # no step to hold the history: the session keeps it whole
    assert session_attrs(db, sid)["history"] == doc["history"]


def chat(history: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": m["role"], "content": m["content"]} for m in history]


@pytest.mark.parametrize("fmt", ["openai", "trl"])
def test_sft_export_reproduces_the_history(imported: tuple[trellisdb.Database, Any], tmp_path: Path, fmt: str) -> None:
    db, _ = imported
    name = f"history_{fmt}"
    db.create_view(name, "sft", messages="messages", path=True, replace=True)
    db.materialize(name)
    db.export(name, tmp_path / name, fmt)
    lines = [json.loads(x)["messages"] for x in (tmp_path / name / "train.jsonl").read_text().splitlines()]
    prov = pq.read_table(tmp_path / name / "provenance.parquet").to_pylist()
    by_leaf = {p["node_ids"][-1]: lines[p["row"]] for p in prov}
    checked = 0
    roles: set[str] = set()
    for f in FILES:
        doc = load(f)
        steps, history = doc.get("trajectory", []), doc.get("history", [])
        sid = sid_of(f)
        if not history or not steps:
            assert not any(k.startswith(sid + "#") for k in by_leaf)
            continue
        want = chat(history)
        # the last step's row is the whole conversation, message for message
        assert by_leaf[f"{sid}#{len(steps)}"] == want, rel(f)
        # every step's row is exactly the conversation up to that step's reply (what the model
        # saw, and its reply): up to and including its own assistant message; a step the
        # history does not show has no row
        replies = [i for i, m in enumerate(history) if m["role"] == "assistant" and not m.get("is_demo")]
        ends: dict[int, int] = {}  # step -> the end of its row in the history
        nxt = 0
        for k, step in enumerate(steps, 1):  # its reply: the first after the previous step's that repeats it
            j = next((j for j in range(nxt, len(replies)) if history[replies[j]].get("action") == step["action"]
                      or history[replies[j]]["content"] == step["response"]), None)
            if j is not None:
                ends[k], nxt = replies[j] + 1, j + 1
        ends[len(steps)] = len(history)
        for k in range(1, len(steps) + 1):
            if k in ends:
                assert by_leaf[f"{sid}#{k}"] == want[:ends[k]], (rel(f), k)
            else:
                assert f"{sid}#{k}" not in by_leaf, (rel(f), k)
        assert len(ends) >= len(steps) - 1, rel(f)  # at most one step (a hand-retried edit) has no row
        roles |= {m["role"] for m in want}
        checked += 1
    assert checked == 19 and roles == {"system", "user", "assistant", "tool"}


def test_sft_without_a_path_exports_each_steps_own_turns(imported: tuple[trellisdb.Database, Any],
                                                        tmp_path: Path) -> None:
    db, _ = imported
    f = DATA / "demonstrations" / "ctf" / "forensics" / "flash.traj"
    sid = sid_of(f)
    db.create_view("turns", "sft", messages="messages", where=f"session_id = '{sid}'", replace=True)
    assert db.materialize("turns")["rows"] == 4
    db.export("turns", tmp_path / "turns", "trl")
    lines = [json.loads(x)["messages"] for x in (tmp_path / "turns" / "train.jsonl").read_text().splitlines()]
    assert [m for line in lines for m in line] == chat(load(f)["history"])  # rows in node-id order = step order
    with pytest.raises(trellisdb.ValidationError, match="sft option"):
        db.create_view("bad", "kto", reward="reward('submitted')", threshold=1.0, messages="messages")


def test_split_history_is_the_history_in_step_order() -> None:
    for f in FILES:
        doc = load(f)
        steps, history = doc.get("trajectory", []), doc.get("history", [])
        if steps:
            parts = _split_history(history, steps)
            assert [m for p in parts for m in p] == history
            for part, step in zip(parts, steps, strict=True):  # a step's assistant message is its own
                mine = [m for m in part if m["role"] == "assistant" and not m.get("is_demo")]
                assert all(m.get("action") == step["action"] or m["content"] == step["response"] for m in mine)


class HashEmbedder:
    """A deterministic fake: each text's sha256 as 4 numbers (equal texts, equal vectors)."""

    name = "sha256-4"
    dim = 4

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = [np.frombuffer(hashlib.sha256(t.encode()).digest()[:16], np.uint32) / 2**32 - 0.5 for t in texts]
        return np.array(out, np.float32).reshape(len(texts), 4)


def test_steps_are_retrievable_by_state(imported: tuple[trellisdb.Database, Any]) -> None:
    db, _ = imported
    db.create_space("state", embedder=HashEmbedder(), text="state")
    assert db.embed("state") == 200
    state = '{"open_file": "/testbed/reproduce.py", "working_dir": "/testbed"}'
    want = {r["id"] for r in db.sql("SELECT id FROM nodes WHERE state = $s", params={"s": state}).to_pylist()}
    assert len(want) >= 4
    got = db.query(f"RETRIEVE {len(want)} SIMILAR TO $q IN state", q=state).to_pylist()
    assert {r["id"] for r in got if r["relation"] == "seed"} == want
    # vectors you compute yourself: add_vectors, and a vector query
    db.create_space("state4", dim=4, text="state")
    rows = db.sql("SELECT id, state FROM nodes ORDER BY id").to_pylist()
    db.add_vectors("state4", [r["id"] for r in rows], HashEmbedder().embed([r["state"] for r in rows]))
    db.flush()
    got = db.query(f"RETRIEVE {len(want)} SIMILAR TO $v IN state4", v=HashEmbedder().embed([state])[0].tolist())
    assert {r["id"] for r in got.to_pylist() if r["relation"] == "seed"} == want


def test_import_again_adds_nothing(imported: tuple[trellisdb.Database, Any]) -> None:
    db, _ = imported
    before = (len(db.log()), db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist())
    again = import_run(db, "swe-agent", DATA, progress=False)
    assert again.imported == [] and len(again.skipped) == 20 and again.commits == []
    assert (len(db.log()), db.sql("SELECT count(*) AS n FROM nodes_history").to_pylist()) == before


def test_a_bad_file_stops_the_import_naming_its_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    good = DATA / "demonstrations" / "ctf" / "forensics" / "flash.traj"
    shutil.copy(good, run / "a.traj")
    shutil.copy(DATA / "demonstrations" / "ctf" / "misc" / "networking_1.traj", run / "c.traj")
    doc = load(good)
    doc["trajectory"][2]["action"] = 42
    text = json.dumps(doc, indent=1)
    (run / "b.traj").write_text(text)
    line = text.splitlines().index(' "trajectory": [') + 1
    step_line = next(i + 1 for i, ln in enumerate(text.splitlines()) if ln == "  {" and i > line
                     and text.splitlines()[i + 1].startswith('   "action": 42'))
    db = trellisdb.connect(tmp_path / "db")
    with pytest.raises(ImportFormatError, match=rf"b\.traj:{step_line}: trajectory\[2\]\.action: is a number"):
        import_run(db, "swe-agent", run, progress=False)
    # a.traj is in; nothing of b.traj (nor of c.traj, after it)
    sessions = {r["id"] for r in db.sql("SELECT id FROM sessions").to_pylist()}
    assert sessions == {sid_of(run / "a.traj")}
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 4}]
    # fixed, the import goes on where it stopped
    shutil.copy(good, run / "b.traj")
    report = import_run(db, "swe-agent", run, progress=False)
    assert report.skipped == [unit(run / "a.traj")] and report.imported == [unit(run / "b.traj"), unit(run / "c.traj")]
    # not JSON at all: the line and column
    (run / "d.traj").write_text('{"trajectory": [\n  {"action": "ls",}\n]}')
    with pytest.raises(ImportFormatError, match=r"d\.traj:2:\d+: not valid JSON"):
        import_run(db, "swe-agent", run, progress=False)
    (run / "d.traj").write_text('{"trajectory": [], "history": [{"content": "no role"}]}')
    with pytest.raises(ImportFormatError, match=r"d\.traj:1: history\[0\]: is not a chat message"):
        import_run(db, "swe-agent", run, progress=False)
    assert db.sql("SELECT count(*) AS n FROM sessions WHERE id LIKE 'swe-agent:d@%'").to_pylist() == [{"n": 0}]


def test_one_file_and_options(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db")
    f = DATA / "demonstrations" / "ctf" / "pwn" / "warmup.traj"
    report = import_run(db, "swe-agent", f, task="warmup-task", progress=False)
    assert report.imported == [unit(f)] and report.nodes == 7
    assert db.sql("SELECT id, task_id FROM sessions").to_pylist() == [{"id": sid_of(f),
                                                                      "task_id": "warmup-task"}]
    with pytest.raises(trellisdb.ValidationError, match="unknown swe-agent import option 'tsk'; did you mean 'task'"):
        import_run(db, "swe-agent", f, tsk="x", progress=False)
    with pytest.raises(ImportFormatError, match=r"no \.traj files"):
        import_run(db, "swe-agent", tmp_path, progress=False)


def test_the_same_trajectory_through_any_path_is_one_unit(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db")
    demos = sorted((DATA / "demonstrations").rglob("*.traj"))
    first = import_run(db, "swe-agent", DATA / "demonstrations", progress=False)
    assert first.source == "trajectories" and first.imported == [unit(f) for f in demos]
    # the parent folder: only the files not imported yet
    again = import_run(db, "swe-agent", DATA, progress=False)
    assert sorted(again.skipped) == sorted(unit(f) for f in demos)
    assert again.imported == [unit(f) for f in FILES if f not in demos]
    assert db.sql("SELECT count(*) AS n FROM sessions").to_pylist() == [{"n": 20}]
    # one file, then a copy of it elsewhere: the same unit
    f = DATA / "demonstrations" / "ctf" / "rev" / "rock.traj"
    assert import_run(db, "swe-agent", f, progress=False).skipped == [unit(f)]
    copy = tmp_path / "elsewhere" / "renamed.traj"
    copy.parent.mkdir()
    shutil.copy(f, copy)
    shutil.copy(f, tmp_path / "elsewhere" / "rock.traj")  # twice in one folder: imported once
    report = import_run(db, "swe-agent", copy.parent, progress=False)
    assert report.imported == [unit(copy)] and report.skipped == [unit(f)]
    before = db.sql("SELECT count(*) AS n FROM nodes").to_pylist()
    assert import_run(db, "swe-agent", copy.parent, progress=False).imported == []
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == before
    assert db.sql("SELECT count(*) AS n FROM sessions").to_pylist() == [{"n": 21}]  # the renamed copy: its own stem


def test_demonstration_messages_go_with_the_first_step() -> None:
    real = load(DATA / "test_data" / "gpt4__swe-bench-dev-easy_first_only__default__t-0.00__p-0.95__c-3.00__install-1"
                / "pydicom__pydicom-1458.traj")
    demo = load(next(f for f in FILES if "replay__marshmallow-code__marshmallow-1867__default_sys-env_window100" in str(f)))
    # put_demos_in_history: the demonstration's messages (assistant ones too) after the system prompt
    demos = [dict(m, is_demo=True) for m in demo["history"] if m["role"] != "system"]
    history = real["history"][:1] + demos + real["history"][1:]
    steps = real["trajectory"]
    parts = _split_history(history, steps)
    assert [m for p in parts for m in p] == history
    plain = _split_history(real["history"], steps)
    assert [len(p) for p in parts] == [len(plain[0]) + len(demos), *map(len, plain[1:])]
    assert parts[0][1:1 + len(demos)] == demos
    for part, step in zip(parts, steps, strict=True):
        mine = [m for m in part if m["role"] == "assistant" and not m.get("is_demo")]
        assert len(mine) == 1 and mine[0]["action"] == step["action"]


def test_info_fields_named_like_the_imports_own_get_info_before_them(tmp_path: Path) -> None:
    doc = load(DATA / "demonstrations" / "ctf" / "forensics" / "flash.traj")
    doc["info"].update({"thought": "a thought of the info", "tokens_sent": 5, "model_stats": {"tokens_sent": 7},
                        "other": "kept as it is", "submission": "the patch"})
    f = tmp_path / "run" / "flash.traj"
    f.parent.mkdir()
    f.write_text(json.dumps(doc))
    db = trellisdb.connect(tmp_path / "db")
    import_run(db, "swe-agent", f, progress=False)
    sid = sid_of(f)
    n = len(doc["trajectory"])
    arts = artifacts(db, sid)
    assert arts[(f"{sid}#{n}", "thought")] == doc["trajectory"][-1]["thought"]
    assert arts[(f"{sid}#{n}", "info_thought")] == "a thought of the info"
    assert arts[(f"{sid}#{n}", "other")] == "kept as it is"
    assert arts[(f"{sid}#{n}", "submission")] == "the patch"
    attrs = session_attrs(db, sid)
    assert attrs["tokens_sent"] == 7 and attrs["info_tokens_sent"] == 5


def _messy(tmp_path: Path, name: str, text: str) -> tuple[trellisdb.Database, Path]:
    run = tmp_path / name
    run.mkdir()
    shutil.copy(DATA / "demonstrations" / "ctf" / "pwn" / "warmup.traj", run / "a.traj")
    (run / "b.traj").write_text(text)
    return trellisdb.connect(tmp_path / f"{name}.db"), run


@pytest.mark.parametrize(("case", "pattern"), [
    ("big_int", r"b\.traj: JSON this reader cannot take \(Exceeds the limit"),
    ("deep", r"b\.traj: JSON this reader cannot take \(values nested too deeply\)"),
    ("surrogate", r"b\.traj:\d+: trajectory\[0\]\.observation: is not valid UTF-8 text \(a lone surrogate"),
    ("surrogate_key", r"b\.traj:\d+: info\.\\udc00: is not valid UTF-8 text"),
    ("seconds", r"b\.traj:\d+: trajectory\[0\]\.execution_time: is '1000.*not a number of seconds"),
    ("spec", r"b\.traj:\d+: replay_config\.problem_statement\.text: is a number, not text"),
    ("stat", r"b\.traj:\d+: info\.model_stats\.tokens_sent: is a number beyond the range of a double"),
])
def test_messy_values_are_refused_naming_file_line_and_field(tmp_path: Path, case: str, pattern: str) -> None:
    doc = {"trajectory": [{"thought": "t", "action": "ls", "observation": "o", "response": "r", "state": "{}"}],
           "history": [], "info": {"exit_status": "submitted"}}
    if case == "big_int":
        text = json.dumps(doc).replace('"submitted"', "1" + "0" * 5000)
    elif case == "deep":
        text = json.dumps(doc).replace('"submitted"', "[" * 100_000 + "]" * 100_000)
    elif case == "surrogate":  # binary output an observation holds, escaped by a lenient writer
        text = json.dumps(doc).replace('"o"', '"ELF\\udc00\\udc01"')
    elif case == "surrogate_key":
        text = json.dumps(doc).replace('"exit_status"', '"\\udc00": 1, "exit_status"')
    elif case == "seconds":
        doc["trajectory"][0]["execution_time"] = 10**400
        text = json.dumps(doc)
    elif case == "spec":
        doc["replay_config"] = {"problem_statement": {"id": "p", "text": 5}}
        text = json.dumps(doc)
    else:
        doc["info"]["model_stats"] = {"tokens_sent": 10**400}
        text = json.dumps(doc)
    db, run = _messy(tmp_path, case, text)
    with pytest.raises(ImportFormatError, match=pattern):
        import_run(db, "swe-agent", run, progress=False)
    # the file before it is in, nothing of the bad one
    assert db.sql("SELECT id FROM sessions").to_pylist() == [{"id": sid_of(run / "a.traj")}]
    # an emoji, escaped as a surrogate pair (as json.dumps writes it), is text
    doc["trajectory"][0]["observation"] = "done \U0001f600"
    doc.pop("replay_config", None)
    doc["info"] = {"exit_status": "submitted"}
    doc["trajectory"][0].pop("execution_time", None)
    (run / "b.traj").write_text(json.dumps(doc))
    assert import_run(db, "swe-agent", run, progress=False).imported == [unit(run / "b.traj")]
    assert artifacts(db, sid_of(run / "b.traj"))[(f"{sid_of(run / 'b.traj')}#1", "observation")] == "done \U0001f600"


def test_a_file_linking_outside_the_folder_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(DATA / "demonstrations" / "ctf" / "pwn" / "warmup.traj", run / "a.traj")
    (run / "b.traj").symlink_to(DATA / "demonstrations" / "ctf" / "rev" / "rock.traj")
    (run / "sub").mkdir()
    (run / "sub" / "a.traj").symlink_to(run / "a.traj")  # inside: read (the same unit as a.traj: once)
    db = trellisdb.connect(tmp_path / "db")
    with pytest.raises(ImportFormatError, match=r"b\.traj: a symbolic link to .*rock\.traj, outside the folder given"):
        import_run(db, "swe-agent", run, progress=False)
    assert db.sql("SELECT count(*) AS n FROM sessions").to_pylist() == [{"n": 0}]
    (run / "b.traj").unlink()
    report = import_run(db, "swe-agent", run, progress=False)
    assert report.imported == [unit(run / "a.traj")] and report.skipped == [unit(run / "a.traj")]
    # a link given itself is read
    (tmp_path / "link.traj").symlink_to(DATA / "demonstrations" / "ctf" / "rev" / "rock.traj")
    assert import_run(db, "swe-agent", tmp_path / "link.traj", progress=False).imported == [
        unit(DATA / "demonstrations" / "ctf" / "rev" / "rock.traj").replace("rock@", "link@")]
