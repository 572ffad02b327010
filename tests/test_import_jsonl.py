"""``trellis import jsonl`` (schema ``trellis-jsonl/1``): every record type round-trips, a unit
is one commit, imports are idempotent, every bad line is named by file and line, and the JSON
Schema is valid, versioned, in step with the reader, and accepts the examples of the docs."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import pytest

import trellisdb
from trellisdb.errors import ImportFormatError, TrellisError
from trellisdb.importers import import_run, jsonl
from trellisdb.writer import content_hash

DOC = Path(__file__).resolve().parents[1] / "docs" / "import-jsonl.md"
UTC = dt.UTC


def lines(*records: dict[str, Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


FULL = [
    {"type": "header", "schema": "trellis-jsonl/1"},
    {"type": "session", "id": "s1", "task": "t1", "agent": "ag", "model": "m", "config": {"b": 1, "a": [2]},
     "status": "running", "task_spec": "sort things", "at": "2026-01-05T10:00:00Z", "attrs": {"budget": 3}},
    {"type": "node", "id": "n1", "kind": "step", "step": 5, "status": "done", "summary": "first",
     "cost": {"tokens_in": 10, "tokens_out": 2, "seconds": 0.5, "usd": 0.01}, "source": "agent-x",
     "action": "ls", "state": {"cwd": "/w"}, "embedding": [1, 0, 0, 0], "attrs": {"island": 2},
     "labels": ["population"], "at": 1767607200,
     "artifacts": {"prompt": "list files", "img": {"base64": base64.b64encode(b"\x00\x01\xff").decode(),
                                                   "media_type": "image/png"},
                   "code": {"text": "print(1)", "media_type": "text/x-python"}},
     "rewards": {"score": 0.25}},
    {"type": "node", "id": "n2", "parents": ["n1"], "state": "raw state text"},
    {"type": "node", "id": "n3", "parents": ["n1", "n2"], "edge_kind": "crossover_of", "at": "2026-01-05T11:00:00+01:00"},
    {"type": "commit", "message": "three nodes", "tag": "c1", "meta": {"iteration": 1}},
    {"type": "edge", "src": "n2", "dst": "n3", "kind": "repair_of", "session": "s1", "at": 1767607300},
    {"type": "reward", "node": "n2", "channel": "score", "value": 1, "verifier": "v", "verifier_version": "1.0"},
    {"type": "artifact", "node": "n2", "name": "diff", "text": "+x", "media_type": "text/x-diff"},
    {"type": "artifact", "node": "n3", "name": "blob", "base64": base64.b64encode(b"\xfe").decode()},
    {"type": "attr", "entity": "n1", "attrs": {"island": None, "note": "moved"}},
    {"type": "attr", "scope": "task", "entity": "t1", "attrs": {"difficulty": "easy"}},
    {"type": "attr", "scope": "session", "entity": "s1", "attrs": {"exit": "ok"}, "session": "s1"},
    {"type": "label", "nodes": ["n2", "n3"], "labels": ["archive"]},
    {"type": "unlabel", "nodes": "n1", "labels": ["population"]},
    {"type": "comparison", "a": "n2", "b": "n3", "preferred": "n3", "margin": 0.5, "judge": "human", "id": "c-1"},
    {"type": "comparison", "a": "n1", "b": "n2", "preferred": None},
    {"type": "session", "id": "s1", "task": "t1", "status": "completed"},
    {"type": "commit", "message": "judged", "tag": "c2"},
    {"type": "node", "id": "n4", "parents": ["n3"]},
]


def q(db: trellisdb.Database, text: str, as_of: str | None = None) -> list[dict[str, Any]]:
    return db.sql(text, as_of=as_of).to_pylist()


@pytest.fixture
def full(tmp_path: Path) -> tuple[trellisdb.Database, Path, Any]:
    f = tmp_path / "run.jsonl"
    f.write_text(lines(*FULL))
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    report = import_run(db, "jsonl", f, progress=False)
    return db, f, report


def test_every_record_type_round_trips(full: tuple[trellisdb.Database, Path, Any]) -> None:
    db, _, report = full
    assert report.imported == ["run.jsonl:2-6", "run.jsonl:7-19", "run.jsonl:20-20"] and report.nodes == 4
    t = lambda s: dt.datetime.fromisoformat(s)  # noqa: E731
    assert q(db, "SELECT id, name, spec FROM tasks") == [{"id": "t1", "name": "t1", "spec": "sort things"}]
    assert q(db, "SELECT id, task_id, agent, model, config, status, event_time FROM sessions") == [
        {"id": "s1", "task_id": "t1", "agent": None, "model": None, "config": None, "status": "completed",
         "event_time": None}]
    first = q(db, "SELECT agent, model, config, status, event_time FROM sessions", as_of="c1")
    assert first == [{"agent": "ag", "model": "m", "config": '{"a": [2], "b": 1}', "status": "running",
                      "event_time": t("2026-01-05T10:00:00+00:00")}]
    nodes = {r["id"]: r for r in q(db, "SELECT * FROM nodes_full ORDER BY seq")}
    assert list(nodes) == ["n1", "n2", "n3", "n4"]
    n1 = nodes["n1"]
    assert (n1["kind"], n1["step"], n1["status"], n1["summary"], n1["source"], n1["action"], n1["state"]) == (
        "step", 5, "done", "first", "agent-x", "ls", '{"cwd": "/w"}')
    assert (n1["tokens_in"], n1["tokens_out"], n1["seconds"], n1["usd"]) == (10, 2, 0.5, 0.01)
    assert list(n1["embedding"]) == [1.0, 0.0, 0.0, 0.0] and n1["event_time"] == t("2026-01-05T10:00:00+00:00")
    # defaults of add_node: kind attempt, status pending, step one more than the session's last
    assert [(nodes[n]["kind"], nodes[n]["status"], nodes[n]["step"]) for n in ("n2", "n3", "n4")] == [
        ("attempt", "pending", 6), ("attempt", "pending", 7), ("attempt", "pending", 8)]
    assert nodes["n2"]["state"] == "raw state text" and nodes["n3"]["event_time"] == t("2026-01-05T10:00:00+00:00")
    assert {(e["src"], e["dst"], e["kind"]): e["event_time"] for e in q(db, "SELECT * FROM edges")} == {
        ("n1", "n2", "derived_from"): None, ("n1", "n3", "crossover_of"): t("2026-01-05T10:00:00+00:00"),
        ("n2", "n3", "crossover_of"): t("2026-01-05T10:00:00+00:00"),
        ("n2", "n3", "repair_of"): t("2026-01-05T10:01:40+00:00"), ("n3", "n4", "derived_from"): None}
    arts = {(r["node_id"], r["name"]): (r["content"], r["media_type"]) for r in q(
        db, "SELECT na.node_id, na.name, a.content, a.media_type FROM node_artifacts na "
            "JOIN artifacts_full a ON a.hash = na.hash")}
    assert arts == {("n1", "prompt"): (b"list files", "text/plain"), ("n1", "img"): (b"\x00\x01\xff", "image/png"),
                    ("n1", "code"): (b"print(1)", "text/x-python"), ("n2", "diff"): (b"+x", "text/x-diff"),
                    ("n3", "blob"): (b"\xfe", None)}
    assert q(db, "SELECT hash FROM node_artifacts WHERE name = 'code'") == [{"hash": content_hash(b"print(1)")}]
    assert {(r["node_id"], r["channel"]): (r["value"], r["verifier"], r["verifier_version"])
            for r in q(db, "SELECT * FROM rewards")} == {("n1", "score"): (0.25, None, None),
                                                         ("n2", "score"): (1.0, "v", "1.0")}
    attrs = {(r["scope"], r["entity"], r["key"]): json.loads(r["value"]) for r in q(db, "SELECT * FROM attributes")}
    assert attrs == {("session", "s1", "budget"): 3, ("node", "n1", "note"): "moved",
                     ("task", "t1", "difficulty"): "easy", ("session", "s1", "exit"): "ok"}  # island retracted
    assert q(db, "SELECT value FROM attributes WHERE key = 'island'", as_of="c1") == [{"value": "2"}]
    assert sorted((r["node_id"], r["label"]) for r in q(db, "SELECT * FROM labels")) == [
        ("n2", "archive"), ("n3", "archive")]
    assert q(db, "SELECT node_id, label FROM labels", as_of="c1") == [{"node_id": "n1", "label": "population"}]
    comps = {r["id"]: (r["a"], r["b"], r["preferred"], r["margin"], r["judge"]) for r in q(db, "SELECT * FROM comparisons")}
    assert comps.pop("c-1") == ("n2", "n3", "n3", 0.5, "human")
    [(cid, c)] = comps.items()
    assert re.fullmatch(r"cmp-[0-9a-f]{20}", cid) and c == ("n1", "n2", None, None, None)
    log = db.log()
    assert [(c["message"], c["tags"]) for c in log] == [("three nodes", ["c1"]), ("judged", ["c2"]),
                                                        ("import jsonl run.jsonl:20-20", [])]
    assert json.loads(log[0]["meta"])["iteration"] == 1


def test_import_again_adds_nothing(full: tuple[trellisdb.Database, Path, Any]) -> None:
    db, f, _ = full
    before = len(db.log())
    again = import_run(db, "jsonl", f, progress=False)
    assert again.imported == [] and len(again.skipped) == 3 and len(db.log()) == before
    # the file grows after its last unit: only the new lines are imported
    with f.open("a") as fh:
        fh.write(lines({"type": "node", "id": "n5", "parents": ["n4"]}))
    # the same file through its folder is another source: its tag (checked before anything is
    # written) and ids clash (an error), nothing is duplicated
    with pytest.raises(TrellisError, match=r"run\.jsonl:2-6: tag 'c1' names commit 1 already .*nothing of"):
        import_run(db, "jsonl", f.parent, progress=False)
    assert len(db.log()) == before
    with pytest.raises(TrellisError, match=r"run\.jsonl:20-21: .*n4"):
        import_run(db, "jsonl", f, progress=False)  # lines 20-21 now a unit: n4 exists already


def test_a_bad_line_stops_its_unit_and_keeps_the_ones_before(tmp_path: Path) -> None:
    f = tmp_path / "run.jsonl"
    good = [{"type": "session", "id": "s", "task": "t"}, {"type": "node", "id": "a"}, {"type": "commit"}]
    f.write_text(lines(*good, {"type": "node", "id": "b"}, {"type": "node", "id": "c", "step": -1},
                       {"type": "commit"}))
    db = trellisdb.connect(tmp_path / "db")
    with pytest.raises(ImportFormatError, match=rf"{re.escape(str(f))}:5: node\.step is -1"):
        import_run(db, "jsonl", f, progress=False)
    assert q(db, "SELECT id FROM nodes") == [{"id": "a"}] and len(db.log()) == 1
    # a reference only the store can check: the unit's lines, nothing of it written
    f.write_text(lines(*good, {"type": "node", "id": "b", "parents": ["ghost"]}, {"type": "commit"}))
    with pytest.raises(TrellisError, match=r"run\.jsonl:4-5: .*'ghost'.*nothing of 'run\.jsonl:4-5' was written"):
        import_run(db, "jsonl", f, progress=False)
    assert q(db, "SELECT id FROM nodes") == [{"id": "a"}] and len(db.log()) == 1


SESSION = '{"type": "session", "id": "s", "task": "t"}'
#: (line 3 of a file whose lines 1-2 are a header and a session, a pattern of the error)
BAD = [
    ('{"type": "node", "id": "n1",}', r"not valid JSON \(.*column 29\); each line is one JSON object"),
    ('[1, 2]', r"the line is \[1, 2\] \(a list\); each line is one JSON object"),
    ('{"id": "n1"}', r"the record has no \"type\"; give one of session, node"),
    ('{"type": "nod", "id": "n1"}', r"unknown record type \"nod\" \(a string\); did you mean 'node'\?"),
    ('{"type": "node", "id": "n1", "parent": ["n0"]}', r"a node record has no field 'parent'; did you mean 'parents'"),
    ('{"type": "node"}', r"a node record needs 'id'; e\.g\. \{\"type\": \"node\""),
    ('{"type": "node", "id": 7}', r"node\.id is 7 \(a number\); write a string"),
    ('{"type": "node", "id": "n1", "step": "3"}', r"node\.step is \"3\" \(a string\); write a whole number"),
    ('{"type": "node", "id": "n1", "step": 1.5}', r"node\.step is 1\.5 \(a number\); write a whole number"),
    ('{"type": "node", "id": "n1", "at": "2026-01-05T10:00:00"}', r"node\.at .* has no timezone.*epoch seconds"),
    ('{"type": "node", "id": "n1", "at": "yesterday"}', r"not an ISO-8601 time"),
    ('{"type": "node", "id": "n1", "cost": {"tokens": 3}}', r"node\.cost has 'tokens'.*tokens_in, tokens_out"),
    ('{"type": "node", "id": "n1", "cost": {"usd": -1}}', r"node\.cost\.usd is -1 .*write a finite number >= 0"),
    ('{"type": "node", "id": "n1", "rewards": {"score": "high"}}', r"node\.rewards\.score is \"high\".*finite number"),
    ('{"type": "node", "id": "n1", "rewards": {"score": NaN}}', r"node\.rewards\.score is NaN.*finite number"),
    ('{"type": "node", "id": "n1", "parents": "n0"}', r"node\.parents is \"n0\" \(a string\); write a list"),
    ('{"type": "node", "id": "n1", "parents": ["n1"]}', r"names itself as a parent"),
    ('{"type": "node", "id": "n1", "edge_kind": "child_of"}', r"node\.edge_kind: .*child_of"),
    ('{"type": "node", "id": "n1", "artifacts": {"code": 3}}', r"node\.artifacts\.code is 3.*base64"),
    ('{"type": "node", "id": "n1", "artifacts": {"bin": {"base64": "%%%"}}}', r"not valid base64"),
    ('{"type": "node", "id": "n1", "artifacts": {"x": {"text": "a", "base64": "YQ=="}}}', r"exactly one of 'text'"),
    ('{"type": "node", "id": "n1", "attrs": [1]}', r"node\.attrs is \[1\] \(a list\); write a JSON object"),
    ('{"type": "node", "id": "n1", "labels": ["a\\u0001"]}', r"control character"),
    ('{"type": "node", "id": "n1", "session": "other"}', r"node\.session 'other' has no session record above it"),
    ('{"type": "node", "id": "n0"}', r"node 'n0' is written at line 2 already"),
    ('{"type": "edge", "src": "a", "dst": "a"}', r"self-loop"),
    ('{"type": "edge", "src": "a", "dst": "b", "kind": "derived"}', r"edge\.kind 'derived' is not an edge kind; did you mean"),
    ('{"type": "reward", "node": "n1", "channel": "score"}', r"a reward record needs 'value'"),
    ('{"type": "reward", "node": "n1", "channel": "score", "value": true}', r"reward\.value is true \(a boolean\)"),
    ('{"type": "artifact", "node": "n1", "name": "x"}', r"exactly one of 'text'"),
    ('{"type": "attr", "entity": "n1", "scope": "graph", "attrs": {}}', r"attr\.scope is \"graph\".*node, session, task"),
    ('{"type": "label", "nodes": ["n1"], "labels": "archive"}', r"label\.labels is \"archive\".*write a list"),
    ('{"type": "comparison", "a": "n1", "b": "n1"}', r"with itself"),
    ('{"type": "comparison", "a": "n1", "b": "n2", "preferred": "n3"}', r"write a's id \('n1'\), b's id"),
    ('{"type": "commit", "meta": {"import": 1}}', r"key 'import' is the import's own"),
    ('{"type": "commit", "meta": [1]}', r"commit\.meta is \[1\].*JSON object"),
    ('{"type": "commit", "tag": ""}', r"commit\.tag must not be empty"),
    ('{"type": "header", "schema": "trellis-jsonl/1"}', r"a header may only be the first line"),
    ('{"type": "session", "id": "s", "task": "other"}', r"session 's' was declared with task 't' above"),
    ('{"type": "session", "id": "s2", "task": "t", "config": "{not json"}', r"session\.config: .*must be JSON"),
]


@pytest.mark.parametrize(("line", "pattern"), BAD, ids=[b[0][:48] for b in BAD])
def test_every_line_error_names_file_and_line(tmp_path: Path, line: str, pattern: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"type": "header", "schema": "trellis-jsonl/1"}\n' + SESSION + "\n" + line + "\n")
    if "written at line 2" in pattern:
        f.write_text(SESSION + "\n" + '{"type": "node", "id": "n0"}\n' + line + "\n")
    db = trellisdb.connect(tmp_path / "db")
    with pytest.raises(ImportFormatError, match=rf"^{re.escape(str(f))}:3: (.*?){pattern}"):
        import_run(db, "jsonl", f, progress=False)
    assert len(db.log()) == 0


def test_versions_and_files(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db")
    f = tmp_path / "v2.jsonl"
    f.write_text('{"type": "header", "schema": "trellis-jsonl/2"}\n' + SESSION + "\n")
    with pytest.raises(ImportFormatError, match=r"v2\.jsonl:1: schema \"trellis-jsonl/2\" .* it reads 'trellis-jsonl/1'"):
        import_run(db, "jsonl", f, progress=False)
    f.write_bytes(SESSION.encode() + b"\n\xff\xfe\n")
    with pytest.raises(ImportFormatError, match=r"v2\.jsonl:2: not UTF-8"):
        import_run(db, "jsonl", f, progress=False)
    f.unlink()
    # a folder: its .jsonl files, sorted; blank lines are skipped; no header is version 1
    (tmp_path / "runs" / "b").mkdir(parents=True)
    (tmp_path / "runs" / "b" / "x.jsonl").write_text(SESSION + "\n\n" + lines({"type": "node", "id": "bx"}))
    (tmp_path / "runs" / "a.jsonl").write_text(lines({"type": "session", "id": "s2", "task": "t"},
                                                     {"type": "commit", "tag": "one"}))
    report = import_run(db, "jsonl", tmp_path / "runs", tag_prefix="r1_", progress=False)
    assert report.imported == ["a.jsonl:1-2", "b/x.jsonl:1-3"] and db.tags() == {"r1_one": 1}
    with pytest.raises(trellisdb.ValidationError, match="unknown jsonl import option 'task'"):
        import_run(db, "jsonl", tmp_path / "runs", task="t", progress=False)


# ------------------------------------------------------------------ the JSON Schema


class Invalid(Exception):
    pass


def validate(value: Any, schema: dict[str, Any], root: dict[str, Any]) -> None:
    """A JSON Schema (2020-12) check of the keywords the schema file uses (jsonschema is not a
    dependency): $ref, type, const, enum, oneOf, required, properties, additionalProperties,
    propertyNames, items, minimum, minLength, maxLength, pattern."""
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        validate(value, target, root)
    types = {"object": dict, "array": list, "string": str, "null": type(None), "boolean": bool}
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any((isinstance(value, types[n]) if n in types else
                  (n == "integer" and isinstance(value, int) and not isinstance(value, bool)) or
                  (n == "number" and isinstance(value, int | float) and not isinstance(value, bool))) for n in names)
        if not ok:
            raise Invalid(f"{value!r} is not of type {names}")
    if "const" in schema and value != schema["const"]:
        raise Invalid(f"{value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise Invalid(f"{value!r} not in {schema['enum']}")
    if "oneOf" in schema:
        passed = 0
        for sub in schema["oneOf"]:
            try:
                validate(value, sub, root)
                passed += 1
            except Invalid:
                pass
        if passed != 1:
            raise Invalid(f"{value!r} matches {passed} of oneOf")
    if isinstance(value, dict):
        for k in schema.get("required", []):
            if k not in value:
                raise Invalid(f"missing {k!r}")
        props = schema.get("properties", {})
        for k, v in value.items():
            if "propertyNames" in schema:
                validate(k, schema["propertyNames"], root)
            if k in props:
                validate(v, props[k], root)
            elif schema.get("additionalProperties") is False:
                raise Invalid(f"unexpected {k!r}")
            elif isinstance(schema.get("additionalProperties"), dict):
                validate(v, schema["additionalProperties"], root)
    if isinstance(value, list) and "items" in schema:
        for v in value:
            validate(v, schema["items"], root)
    if isinstance(value, int | float) and not isinstance(value, bool) and "minimum" in schema \
            and value < schema["minimum"]:
        raise Invalid(f"{value} < {schema['minimum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", len(value)):
            raise Invalid(f"length of {value!r}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise Invalid(f"{value!r} does not match {schema['pattern']}")


def doc_examples() -> list[str]:
    return re.findall(r"```jsonl\n(.*?)```", DOC.read_text(), re.S)


def test_the_schema_is_versioned_and_matches_the_reader() -> None:
    path = Path(jsonl.__file__).with_name(jsonl.SCHEMA_FILE)
    schema = json.loads(path.read_text())  # valid JSON
    assert schema == jsonl.schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] == schema["x-trellis-schema"] == jsonl.SCHEMA_VERSION == "trellis-jsonl/1"
    assert schema["$defs"]["header"]["properties"]["schema"] == {"const": "trellis-jsonl/1"}
    # one definition per record type, with the reader's fields and required fields
    assert [r["$ref"].rsplit("/", 1)[1] for r in schema["oneOf"]] == list(jsonl.FIELDS)
    for kind, fields in jsonl.FIELDS.items():
        d = schema["$defs"][kind]
        assert d["additionalProperties"] is False and d["properties"]["type"] == {"const": kind}
        assert set(d["properties"]) - {"type"} == set(fields), kind
        assert set(d["required"]) - {"type"} == {k for k, req in fields.items() if req}, kind


def test_the_docs_examples_validate_and_import(tmp_path: Path) -> None:
    schema = jsonl.schema()
    blocks = doc_examples()
    assert len(blocks) == 2 and blocks[0] == jsonl.EXAMPLE
    for block in blocks:
        for ln in block.splitlines():
            validate(json.loads(ln), schema, schema)
    for bad in ('{"type": "node"}', '{"type": "node", "id": "n", "parent": []}', '{"type": "nod", "id": "n"}',
                '{"type": "header", "schema": "trellis-jsonl/2"}', '{"type": "artifact", "node": "n", "name": "x"}',
                '{"type": "node", "id": "n", "step": -1}', '{"type": "node", "id": "n", "at": "2026-01-05T10:00:00"}'):
        with pytest.raises(Invalid):
            validate(json.loads(bad), schema, schema)
    f = tmp_path / "doc.jsonl"
    f.write_text("".join(blocks))
    db = trellisdb.connect(tmp_path / "db")
    report = import_run(db, "jsonl", f, progress=False)
    assert len(report.imported) == 2 and report.nodes == 2
    assert sorted((r["node_id"], r["label"]) for r in q(db, "SELECT node_id, label FROM labels")) == [
        ("n2", "archive"), ("n2", "final")]
    assert q(db, "SELECT count(*) AS n FROM labels", as_of="run-1-steps") == [{"n": 1}]
    assert q(db, "SELECT status FROM sessions") == [{"status": "completed"}]


def test_null_is_an_absent_optional_field(tmp_path: Path) -> None:
    nulls = [
        {"type": "session", "id": "s", "task": "t", "agent": None, "model": None, "config": None, "status": None,
         "task_spec": None, "at": None, "attrs": None},
        {"type": "node", "id": "n1", "session": None, "parents": None, "edge_kind": None, "kind": None, "step": None,
         "status": None, "summary": None, "cost": {"tokens_in": None, "usd": None}, "source": None, "action": None,
         "state": None, "embedding": None, "attrs": None, "labels": None, "at": None,
         "artifacts": {"a": {"text": "x", "base64": None, "media_type": None}}, "rewards": None},
        {"type": "node", "id": "n2", "parents": ["n1"], "edge_kind": None},
        {"type": "edge", "src": "n1", "dst": "n2", "kind": None, "session": None, "at": None},
        {"type": "reward", "node": "n1", "channel": "c", "value": 1, "verifier": None, "verifier_version": None,
         "at": None},
        {"type": "artifact", "node": "n1", "name": "b", "text": None, "base64": "YQ==", "media_type": None},
        {"type": "attr", "entity": "n1", "attrs": {"k": 1}, "scope": None, "session": None, "at": None},
        {"type": "label", "nodes": "n1", "labels": ["l"], "session": None, "at": None},
        {"type": "comparison", "a": "n1", "b": "n2", "preferred": None, "margin": None, "judge": None, "id": None,
         "at": None},
        {"type": "commit", "message": None, "meta": None, "tag": None},
    ]
    schema = jsonl.schema()
    for rec in nulls:
        validate(rec, schema, schema)  # the schema allows null for every optional field
    f = tmp_path / "nulls.jsonl"
    f.write_text(lines(*nulls))
    db = trellisdb.connect(tmp_path / "db")
    assert import_run(db, "jsonl", f, progress=False).nodes == 2
    assert q(db, "SELECT id, kind, status, step, tokens_in FROM nodes ORDER BY id") == [
        {"id": "n1", "kind": "attempt", "status": "pending", "step": 1, "tokens_in": None},
        {"id": "n2", "kind": "attempt", "status": "pending", "step": 2, "tokens_in": None}]
    assert q(db, "SELECT src, dst, kind FROM edges") == [{"src": "n1", "dst": "n2", "kind": "derived_from"}]
    assert q(db, "SELECT scope, key FROM attributes") == [{"scope": "node", "key": "k"}]
    assert sorted(r["name"] for r in q(db, "SELECT name FROM node_artifacts")) == ["a", "b"]
    # the byte limit of a name, which JSON Schema cannot state, is in the schema's description
    assert "512 bytes" in schema["$defs"]["name"]["description"] and "characters" in schema["$defs"]["name"]["description"]
    long = "é" * 300  # 300 characters: the schema's maxLength passes it; 600 bytes: the reader refuses it
    validate({"type": "node", "id": long}, schema, schema)
    f.write_text(lines({"type": "session", "id": "s", "task": "t"}, {"type": "node", "id": long}))
    with pytest.raises(ImportFormatError, match=r"nulls\.jsonl:2: node\.id is 600 bytes long"):
        import_run(trellisdb.connect(tmp_path / "db2"), "jsonl", f, progress=False)


MESSY = [
    ('{"type": "reward", "node": "n1", "channel": "c", "value": 1' + "0" * 5000 + "}",
     r"JSON this reader cannot take \(Exceeds the limit"),
    ('{"type": "reward", "node": "n1", "channel": "c", "value": ' + "[" * 100_000 + "]" * 100_000 + "}",
     r"JSON this reader cannot take \(nested too deep\)"),
    ('{"type": "reward", "node": "n1", "channel": "c", "value": 1' + "0" * 400 + "}",
     r"reward\.value is 1000.*write a finite number"),
    ('{"type": "node", "id": "n1", "cost": {"usd": 1' + "0" * 400 + "}}", r"node\.cost\.usd is 1000.*>= 0"),
    ('{"type": "node", "id": "n1", "at": 1' + "0" * 400 + "}", r"node\.at is 1000.*outside the years 1-9999"),
    ('{"type": "node", "id": "n1", "attrs": {"k": 1' + "0" * 400 + "}}", r"node\.attrs\.k is a number beyond"),
    ('{"type": "node", "id": "n1", "step": 9223372036854775808}', r"node\.step is 9223372036854775808"),
    ('{"type": "node", "id": "n1", "summary": "bin \\udc00"}', r"node\.summary is not valid UTF-8 text"),
    ('{"type": "node", "id": "n1", "artifacts": {"out": "\\udc00"}}', r"node\.artifacts\.out is not valid UTF-8"),
    ('{"type": "node", "id": "n1", "state": {"k": "\\udc00"}}', r"node\.state is not valid UTF-8"),
    ('{"type": "attr", "entity": "n1", "attrs": {"\\udc00": 1}}', r"attr\.attrs: attribute key '\\udc00'"),
]


@pytest.mark.parametrize(("line", "pattern"), MESSY, ids=[f"messy{i}" for i in range(len(MESSY))])
def test_messy_values_are_refused_naming_file_and_line(tmp_path: Path, line: str, pattern: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(SESSION + "\n" + lines({"type": "commit"}) + line + "\n")
    db = trellisdb.connect(tmp_path / "db")
    with pytest.raises(ImportFormatError, match=rf"^{re.escape(str(f))}:3: (.*?){pattern}"):
        import_run(db, "jsonl", f, progress=False)
    assert len(db.log()) == 1  # the unit before it


def test_values_only_the_store_can_check_are_refused_naming_the_unit(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    f = tmp_path / "run.jsonl"
    f.write_text(lines({"type": "session", "id": "s", "task": "t"}, {"type": "commit"},
                       {"type": "node", "id": "n1", "embedding": [1, 2]}))
    with pytest.raises(ImportFormatError, match=r"run\.jsonl:3-3: node 'n1' has an embedding of 2 numbers; this "
                                                r"store's embeddings have 4 \(nothing of 'run\.jsonl:3-3' was written"):
        import_run(db, "jsonl", f, progress=False)
    # the largest step there is, then a node without one: its default step would overflow
    f.write_text(lines({"type": "session", "id": "s", "task": "t"}, {"type": "commit"},
                       {"type": "node", "id": "n1", "step": 2**63 - 1}, {"type": "node", "id": "n2"}))
    with pytest.raises(ImportFormatError, match=r"run\.jsonl:4: node\.step is not given and the session's last "
                                                r"step is 9223372036854775807"):
        import_run(db, "jsonl", f, progress=False)
    assert len(db.log()) == 1


def test_a_byte_order_mark_may_start_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bom.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + jsonl.EXAMPLE.encode())
    db = trellisdb.connect(tmp_path / "db")
    assert import_run(db, "jsonl", f, progress=False).nodes == 2
    f.write_bytes(SESSION.encode() + b"\n\xef\xbb\xbf" + b'{"type": "node", "id": "n"}\n')  # only on line 1
    with pytest.raises(ImportFormatError, match=r"bom\.jsonl:2: not valid JSON"):
        import_run(trellisdb.connect(tmp_path / "db2"), "jsonl", f, progress=False)


def test_a_file_linking_outside_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "secret.jsonl").write_text(SESSION + "\n")
    (tmp_path / "runs" / "a.jsonl").write_text(SESSION + "\n")
    (tmp_path / "runs" / "b.jsonl").symlink_to(tmp_path / "secret.jsonl")
    db = trellisdb.connect(tmp_path / "db")
    with pytest.raises(ImportFormatError, match=r"b\.jsonl: a symbolic link to .*secret\.jsonl, outside the folder"):
        import_run(db, "jsonl", tmp_path / "runs", progress=False)
    assert len(db.log()) == 0
    assert import_run(db, "jsonl", tmp_path / "runs" / "b.jsonl", progress=False).imported == ["b.jsonl:1-1"]
