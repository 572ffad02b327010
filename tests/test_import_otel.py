"""``trellis import otel``: OpenTelemetry GenAI traces (OTLP JSON) as sessions of span nodes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trellisdb
from trellisdb.errors import ImportFormatError, ValidationError
from trellisdb.importers import import_run

FIXTURES = Path(__file__).parent / "fixtures" / "otel"
AGENT = FIXTURES / "agent_traces.json"  # 2 traces: TravelPlanner (agent, 2 chats, 2 tools) and Summarizer
COLLECTOR = FIXTURES / "collector.jsonl"  # JSON Lines: a trace split over lines, children first; log events

TRAVEL = "otel:4bf92f3577b34da6a3ce929d0e0e4736"
SUMMARY = "otel:0af7651916cd43dd8448eb211c80319c"
AGENT_SPAN, CHAT1, WEATHER, MUSEUM, CHAT2 = (
    "otel:00f067aa0ba902b7", "otel:b7ad6b7169203331", "otel:a7c3e1f2b4d60819", "otel:d1a2b3c4e5f60718",
    "otel:c3d4e5f60718293a",
)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[trellisdb.Database]:
    database = trellisdb.connect(tmp_path / "db")
    try:
        yield database
    finally:
        database.close()


def _nodes(db: trellisdb.Database, session: str) -> dict[str, dict[str, Any]]:
    rows = db.sql("SELECT * FROM nodes WHERE session_id = $s ORDER BY step", params={"s": session}).to_pylist()
    return {r["id"]: r for r in rows}


def _attrs(db: trellisdb.Database, entity: str) -> dict[str, Any]:
    rows = db.sql("SELECT key, value FROM attributes WHERE entity = $e", params={"e": entity}).to_pylist()
    return {r["key"]: json.loads(r["value"]) for r in rows}


def _artifacts(db: trellisdb.Database, node: str) -> dict[str, tuple[str, bytes]]:
    rows = db.sql("SELECT na.name, a.media_type, a.content FROM node_artifacts na JOIN artifacts_full a USING (hash) "
                  "WHERE na.node_id = $n", params={"n": node}).to_pylist()
    return {r["name"]: (r["media_type"], r["content"]) for r in rows}


def test_agent_trace_becomes_a_session_of_span_nodes(db: trellisdb.Database) -> None:
    report = import_run(db, "otel", AGENT, progress=False)
    assert report.imported == ["4bf92f3577b34da6a3ce929d0e0e4736", "0af7651916cd43dd8448eb211c80319c"]
    assert report.nodes == 8 and len(report.commits) == 2

    nodes = _nodes(db, TRAVEL)
    # parents before children (the file lists the agent span last); then by start time
    assert list(nodes) == [AGENT_SPAN, CHAT1, WEATHER, MUSEUM, CHAT2]
    assert [n["step"] for n in nodes.values()] == [1, 2, 3, 4, 5]
    assert [n["kind"] for n in nodes.values()] == ["agent", "llm_call", "tool_call", "tool_call", "llm_call"]
    assert [n["status"] for n in nodes.values()] == ["ok", "unset", "ok", "error", "ok"]
    chat = nodes[CHAT1]
    assert chat["summary"] == "chat gpt-4o" and chat["source"] == "otel"
    assert (chat["tokens_in"], chat["tokens_out"]) == (412, 58)
    assert chat["seconds"] == pytest.approx(1.2)
    assert chat["event_time"].isoformat() == "2025-01-01T10:00:00.100000+00:00"
    assert json.loads(nodes[WEATHER]["action"]) == {"tool": "get_weather", "arguments": {"location": "Paris", "days": 2}}
    assert json.loads(nodes[MUSEUM]["action"]) == {"tool": "museum_hours",
                                                   "arguments": {"museum": "Louvre", "date": "2025-01-02"}}

    edges = db.sql("SELECT src, dst, kind, session_id FROM edges WHERE session_id = $s ORDER BY dst",
                   params={"s": TRAVEL}).to_pylist()
    assert {(e["src"], e["dst"], e["kind"]) for e in edges} == {
        (AGENT_SPAN, n, "derived_from") for n in (CHAT1, WEATHER, MUSEUM, CHAT2)}

    sessions = {s["id"]: s for s in db.sql("SELECT * FROM sessions").to_pylist()}
    travel = sessions[TRAVEL]
    assert (travel["agent"], travel["task_id"], travel["status"]) == ("TravelPlanner", "conv_paris_42", "completed")
    assert travel["model"] == "gpt-4o-2024-08-06"  # the one response model
    summary = sessions[SUMMARY]  # no conversation id: the service name is the task
    assert (summary["agent"], summary["task_id"], summary["model"]) == ("Summarizer", "summarizer", "claude-sonnet-4")
    assert {t["id"] for t in db.sql("SELECT id FROM tasks").to_pylist()} == {"conv_paris_42", "summarizer"}


def test_costs_and_attributes(db: trellisdb.Database) -> None:
    import_run(db, "otel", AGENT, progress=False)
    # the agent span sums its model calls' usage: the session counts each token once
    s = _attrs(db, TRAVEL)
    assert (s["tokens_in"], s["tokens_out"]) == (412 + 655, 58 + 103)
    assert (s["spans"], s["llm_calls"], s["tool_calls"], s["errors"]) == (5, 2, 2, 1)
    assert s["seconds"] == pytest.approx(6.4)
    assert s["service.name"] == "travel-agent" and s["telemetry.sdk.language"] == "python"
    assert s["models"] == ["gpt-4o", "gpt-4o-2024-08-06"]
    # deprecated usage names still count
    assert (_attrs(db, SUMMARY)["tokens_in"], _attrs(db, SUMMARY)["tokens_out"]) == (230, 41)

    chat = _attrs(db, CHAT1)
    assert chat["gen_ai.request.model"] == "gpt-4o" and chat["gen_ai.usage.input_tokens"] == 412
    assert chat["gen_ai.response.finish_reasons"] == ["tool_calls"] and chat["server.port"] == 443
    assert chat["otel.span_kind"] == "client"
    assert chat["otel.scope.name"] == "opentelemetry.instrumentation.openai_agents"
    assert "gen_ai.input.messages" not in chat and "service.name" not in chat  # contents: artifacts; resource: session
    museum = _attrs(db, MUSEUM)
    assert museum["error.type"] == "TimeoutError"
    assert museum["otel.status_description"] == "museum API timed out after 2s"
    assert museum["gen_ai.tool.call.arguments"] == {"museum": "Louvre", "date": "2025-01-02"}  # JSON text parsed
    [exc] = museum["otel.events"]
    assert exc["name"] == "exception" and exc["attributes"]["exception.type"] == "TimeoutError"
    assert exc["time"] == "2025-01-01T10:00:03.390000Z"
    orphan = _attrs(db, "otel:9a1b2c3d4e5f6071")  # its parent span is not in the trace: a root
    assert orphan["parent_span_missing"] == "f0e1d2c3b4a59687"
    assert db.sql("SELECT count(*) AS n FROM edges WHERE dst = 'otel:9a1b2c3d4e5f6071'").to_pylist()[0]["n"] == 0

    # TQL reads the OpenTelemetry attributes by their names
    rows = db.query("NODES FROM SESSION $s WHERE kind = 'tool_call' ORDER BY step "
                    "RETURN id, status, attr('gen_ai.tool.name') AS tool", s=TRAVEL).to_pylist()
    assert rows == [{"id": WEATHER, "status": "ok", "tool": "get_weather"},
                    {"id": MUSEUM, "status": "error", "tool": "museum_hours"}]


def test_message_contents_become_artifacts(db: trellisdb.Database) -> None:
    import_run(db, "otel", AGENT, progress=False)
    first = _artifacts(db, CHAT1)  # user text in, tool calls out: a prompt, no response
    assert first["prompt"] == ("text/plain", b"What is the weather in Paris, and is the Louvre open tomorrow?")
    assert first["system_prompt"] == ("text/plain", b"You are a travel assistant. Use the tools.")
    assert "response" not in first
    media, content = first["output_messages"]
    assert media == "application/json"
    assert [p["name"] for p in json.loads(content)[0]["parts"]] == ["get_weather", "museum_hours"]
    assert json.loads(first["system_instructions"][1])[0]["type"] == "text"

    second = _artifacts(db, CHAT2)  # tool results in (structured attribute value), text out: a response
    assert "prompt" not in second
    assert second["response"][1].startswith(b"Paris: 7.5 C and light rain.")
    assert [m["role"] for m in json.loads(second["input_messages"][1])] == ["user", "tool"]

    # tool results: recorded on the span, or (an error) as the model was told it
    assert _artifacts(db, WEATHER)["observation"] == (
        "application/json", b'{"temperature_c": 7.5, "conditions": "light rain"}')
    assert _artifacts(db, MUSEUM)["observation"] == ("text/plain", b"error: museum API timed out after 2s")

    legacy = _artifacts(db, "otel:e457b5a2e4d86bd1")  # event-based content (conventions <= v1.36)
    assert legacy["system_prompt"][1] == b"You write one-sentence summaries."
    assert legacy["prompt"][1] == b"Summarize: The Louvre is the world's most-visited museum."
    assert legacy["response"][1] == b"The Louvre draws more visitors than any other museum."
    assert json.loads(legacy["output_messages"][1])[0]["finish_reason"] == "end_turn"


def test_training_views_read_the_chat_texts(db: trellisdb.Database) -> None:
    import_run(db, "otel", AGENT, progress=False)
    db.create_view("chats", "sft", where="kind = 'llm_call'")
    assert db.materialize("chats")["rows"] == 3
    rows = {r["node_id"]: r for r in db.view("chats").to_pylist()}
    legacy = rows["otel:e457b5a2e4d86bd1"]
    assert None not in (legacy["prompt_hash"], legacy["response_hash"], legacy["system_hash"])
    assert rows[CHAT1]["response_hash"] is None and rows[CHAT2]["prompt_hash"] is None  # tool calls: no plain text


def test_lineage_follows_the_span_tree(db: trellisdb.Database) -> None:
    import_run(db, "otel", AGENT, progress=False)
    up = db.query("LINEAGE OF $n ANCESTORS", n=MUSEUM).to_pylist()
    assert {(r["id"], r["hop"]) for r in up} == {(MUSEUM, 0), (AGENT_SPAN, 1)}
    down = db.query("LINEAGE OF $n DESCENDANTS RETURN id, kind", n=AGENT_SPAN).to_pylist()
    assert {r["id"] for r in down} == {AGENT_SPAN, CHAT1, WEATHER, MUSEUM, CHAT2}


def test_reimport_adds_nothing(db: trellisdb.Database, tmp_path: Path) -> None:
    first = import_run(db, "otel", AGENT, progress=False)
    counts = {t: db.sql(f"SELECT count(*) AS n FROM {t}_history").to_pylist()[0]["n"]
              for t in ("nodes", "edges", "attributes", "artifacts", "sessions")}
    log = len(db.log())
    again = import_run(db, "otel", AGENT, progress=False)
    assert again.imported == [] and again.skipped == first.imported and again.commits == []
    # the same traces from another file (a folder holding a copy) are the same units
    (tmp_path / "copy").mkdir()
    shutil.copy(AGENT, tmp_path / "copy" / "traces.json")
    assert import_run(db, "otel", tmp_path / "copy", progress=False).imported == []
    assert len(db.log()) == log
    assert counts == {t: db.sql(f"SELECT count(*) AS n FROM {t}_history").to_pylist()[0]["n"] for t in counts}
    meta = json.loads(db.log()[-1]["meta"])
    assert meta["import"] == {"format": "otel", "source": "traces", "unit": "0af7651916cd43dd8448eb211c80319c"}
    assert meta["otel"]["spans"] == 3


def test_json_lines_of_the_collector_file_exporter(db: trellisdb.Database) -> None:
    report = import_run(db, "otel", COLLECTOR, progress=False)
    assert report.imported == ["5b8efff798038103d269b633813fc60c", "6e0c63257de34c926f9efcd03899ad0b"]
    nodes = _nodes(db, "otel:5b8efff798038103d269b633813fc60c")  # children came a line before their parent
    assert [(n["id"], n["kind"], n["step"]) for n in nodes.values()] == [
        ("otel:eee19b7ec3c1b173", "agent", 1), ("otel:eee19b7ec3c1b174", "llm_call", 2),
        ("otel:eee19b7ec3c1b175", "tool_call", 3)]
    session = db.sql("SELECT agent, model, task_id FROM sessions WHERE id = 'otel:5b8efff798038103d269b633813fc60c'")
    assert session.to_pylist() == [{"agent": "WeatherBot", "model": "gpt-4o-mini-2024-07-18", "task_id": "weather-bot"}]
    # content from log records (events of conventions v1.28-v1.36) lands on the span they name
    chat = _artifacts(db, "otel:eee19b7ec3c1b174")
    assert (chat["prompt"][1], chat["response"][1]) == (b"Which country is Lyon in?", b"Lyon is in France.")
    assert _artifacts(db, "otel:eee19b7ec3c1b175")["observation"] == ("text/plain", b"Lyon, FR (45.76, 4.84)")
    single = _artifacts(db, "otel:53995c3f42cd8ad8")
    assert (single["prompt"][1], single["response"][1]) == (b"Say hi", b"Hi!")


def test_a_malformed_line_stops_the_import_after_the_earlier_files(db: trellisdb.Database, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(AGENT, run / "a.json")
    shutil.copy(FIXTURES / "truncated.jsonl", run / "b.jsonl")  # line 2 was cut off mid-write
    with pytest.raises(ImportFormatError, match=r"b\.jsonl:2:\d+: is not valid JSON"):
        import_run(db, "otel", run, progress=False)
    sessions = {r["id"] for r in db.sql("SELECT id FROM sessions").to_pylist()}
    assert sessions == {TRAVEL, SUMMARY}  # the earlier file's traces stay; nothing of b.jsonl's trace
    assert db.sql("SELECT count(*) AS n FROM nodes_history WHERE id = 'otel:1f2e3d4c5b6a7980'").to_pylist()[0]["n"] == 0
    # the file repaired, importing again adds only what was missing
    (run / "b.jsonl").write_text((FIXTURES / "truncated.jsonl").read_text().split("\n")[0] + "\n")
    report = import_run(db, "otel", run, progress=False)
    assert report.imported == ["0c1d2e3f405162738495a6b7c8d9eaf0"] and len(report.skipped) == 2


def _request(spans: list[dict[str, Any]]) -> dict[str, Any]:
    return {"resourceSpans": [{"resource": {}, "scopeSpans": [{"scope": {"name": "t"}, "spans": spans}]}]}


def _span(span_id: str, parent: str = "", trace: str = "11111111111111111111111111111111", **kw: Any) -> dict[str, Any]:
    return {"traceId": trace, "spanId": span_id, "parentSpanId": parent, "name": f"s{span_id[-1]}",
            "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000001000000000", **kw}


@pytest.mark.parametrize(("span_id", "message"), [
    ("xyz", r"'xyz' is not an id of 16 hex digits"),
    ("AAECAwQFBgc=", r"not an id of 16 hex digits \(it looks base64-encoded"),
    ("0000000000000000", "all zeros"),
])
def test_ids_that_are_not_hex_are_refused(db: trellisdb.Database, tmp_path: Path, span_id: str, message: str) -> None:
    f = tmp_path / "t.jsonl"
    good = _request([_span("00000000000000a1")])
    f.write_text(json.dumps(good) + "\n" + json.dumps(_request([_span(span_id)])) + "\n")
    with pytest.raises(ImportFormatError, match=r"t\.jsonl:2: resourceSpans\[0\]\.scopeSpans\[0\]\.spans\[0\]\.spanId: .*" + message):
        import_run(db, "otel", f, progress=False)
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist()[0]["n"] == 0


def test_other_malformed_input(db: trellisdb.Database, tmp_path: Path) -> None:
    f = tmp_path / "t.json"
    f.write_text('{\n  "resourceSpans": [\n    {"scopeSpans": [}\n  ]\n}\n')
    with pytest.raises(ImportFormatError, match=r"t\.json:3:\d+: is not valid JSON"):
        import_run(db, "otel", f, progress=False)
    f.write_text(json.dumps(_request([_span("00000000000000a1", trace="abc")])))
    with pytest.raises(ImportFormatError, match=r"t\.json: .*traceId: 'abc' is not an id of 32 hex digits"):
        import_run(db, "otel", f, progress=False)
    f.write_text(json.dumps({"resource_spans": []}))
    with pytest.raises(ImportFormatError, match="lowerCamelCase"):
        import_run(db, "otel", f, progress=False)
    cycle = [_span("00000000000000a1", parent="00000000000000a2"), _span("00000000000000a2", parent="00000000000000a1")]
    f.write_text(json.dumps(_request(cycle)))
    with pytest.raises(ImportFormatError, match="form a cycle"):
        import_run(db, "otel", f, progress=False)
    bad_tokens = _span("00000000000000a1", attributes=[
        {"key": "gen_ai.usage.input_tokens", "value": {"intValue": "-3"}}])
    f.write_text(json.dumps(_request([bad_tokens])))
    with pytest.raises(ImportFormatError, match=r"gen_ai\.usage\.input_tokens must be a whole number >= 0"):
        import_run(db, "otel", f, progress=False)
    with pytest.raises(ValidationError, match="option 'task' only"):
        import_run(db, "otel", f, progress=False, tag_prefix="x")
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist()[0]["n"] == 0


def test_duplicate_spans_are_read_once_and_the_task_option_wins(db: trellisdb.Database, tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    batch = json.dumps(_request([_span("00000000000000a1"), _span("00000000000000b2", parent="00000000000000a1")]))
    f.write_text(batch + "\n" + batch + "\n")  # OTLP allows a batch to arrive twice
    report = import_run(db, "otel", f, progress=False, task="my-task")
    assert report.nodes == 2
    assert db.sql("SELECT task_id, agent FROM sessions").to_pylist() == [{"task_id": "my-task", "agent": None}]
    assert db.sql("SELECT kind FROM nodes").to_pylist() == [{"kind": "span"}, {"kind": "span"}]


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trellisdb.cli import main

    p = tmp_path / "db"
    assert main(["--db", str(p), "import", "otel", str(COLLECTOR), "--no-progress"]) == 0
    assert "imported 2 unit(s) of otel run 'traces': 4 nodes" in capsys.readouterr().out
    assert main(["--db", str(p), "import", "otel", str(COLLECTOR), "--no-progress"]) == 0
    assert "2 already imported (skipped)" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text((FIXTURES / "truncated.jsonl").read_text())
    assert main(["--db", str(p), "import", "otel", str(bad), "--no-progress"]) == 1
    assert "bad.jsonl:2:" in capsys.readouterr().err


def _attr(key: str, value: dict[str, Any]) -> dict[str, Any]:
    return {"key": key, "value": value}


MESSY = [
    ("big_int", lambda: json.dumps(_request([_span("00000000000000a1")])).replace('"s1"', '"s1", "x": 1' + "0" * 5000),
     r"t\.json: is JSON this reader cannot take \(Exceeds the limit"),
    ("deep", lambda: json.dumps(_request([_span("00000000000000a1")])).replace('"s1"', '"s1", "x": ' + "[" * 100_000
                                                                             + "]" * 100_000),
     r"t\.json: is JSON this reader cannot take \(values nested too deeply\)"),
    ("name", lambda: json.dumps(_request([_span("00000000000000a1", name="bin \udc00")])),
     r"t\.json: resourceSpans\[0\]\.scopeSpans\[0\]\.spans\[0\]\.name: is not valid UTF-8 text \(a lone surrogate"),
    ("attr", lambda: json.dumps(_request([_span("00000000000000a1", attributes=[
        _attr("gen_ai.tool.call.result", {"stringValue": "\udc00"})])])),
     r"t\.json: resourceSpans.*attributes\[0\]\.value\.stringValue: is not valid UTF-8"),
    ("double", lambda: json.dumps(_request([_span("00000000000000a1", attributes=[
        _attr("x", {"doubleValue": 10**400})])])), r"attributes\[0\]\.value\.doubleValue: 1000.*out of the range"),
    ("int", lambda: json.dumps(_request([_span("00000000000000a1", attributes=[
        _attr("x", {"intValue": str(10**30)})])])), r"attributes\[0\]\.value\.intValue: 1000.*64-bit integer"),
    ("time", lambda: json.dumps(_request([_span("00000000000000a1", startTimeUnixNano=str(2**64))])),
     r"startTimeUnixNano: 18446744073709551616 is out of the range of a 64-bit integer"),
    ("tokens_digit", lambda: json.dumps(_request([_span("00000000000000a1", attributes=[
        _attr("gen_ai.usage.input_tokens", {"stringValue": "\u00b2"})])])),
     r"gen_ai\.usage\.input_tokens must be a whole number >= 0"),
    ("tokens_big", lambda: json.dumps(_request([_span("00000000000000a1", attributes=[
        _attr("gen_ai.usage.input_tokens", {"doubleValue": 1e30})])])),
     r"gen_ai\.usage\.input_tokens must be a whole number >= 0 \(below 2\*\*63\)"),
]


@pytest.mark.parametrize(("case", "text", "pattern"), MESSY, ids=[m[0] for m in MESSY])
def test_messy_values_are_refused_naming_file_and_field(db: trellisdb.Database, tmp_path: Path, case: str,
                                                        text: Any, pattern: str) -> None:
    f = tmp_path / "t.json"
    f.write_text(text())
    with pytest.raises(ImportFormatError, match=pattern):
        import_run(db, "otel", f, progress=False)
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist()[0]["n"] == 0


def test_odd_shapes_of_content_are_kept(db: trellisdb.Database, tmp_path: Path) -> None:
    choice = {"name": "gen_ai.choice", "timeUnixNano": "1700000000500000000", "attributes": [
        _attr("index", {"intValue": "0"}), _attr("finish_reason", {"stringValue": "stop"}),
        _attr("message", {"kvlistValue": {"values": [_attr("content", {"stringValue": "hi"}),
                                                     _attr("tool_calls", {"intValue": "5"})]}})]}
    escaped = json.dumps([{"role": "user", "parts": [{"type": "text", "content": "x\udc00"}]}])  # JSON text of JSON
    span = _span("00000000000000a1", events=[choice], attributes=[
        _attr("gen_ai.operation.name", {"stringValue": "chat"}),
        _attr("gen_ai.input.messages", {"stringValue": escaped})])
    f = tmp_path / "t.json"
    f.write_text(json.dumps(_request([span])))
    assert import_run(db, "otel", f, progress=False).nodes == 1
    arts = _artifacts(db, "otel:00000000000000a1")
    assert json.loads(arts["output_messages"][1]) == [
        {"role": "assistant", "parts": [{"type": "text", "content": "hi"}], "finish_reason": "stop"}]
    assert arts["input_messages"][1] == escaped.encode()  # JSON text whose strings UTF-8 cannot hold: kept as text


def test_a_file_linking_outside_the_folder_is_refused(db: trellisdb.Database, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(AGENT, run / "a.json")
    (run / "b.json").symlink_to(COLLECTOR)
    with pytest.raises(ImportFormatError, match=r"b\.json: a symbolic link to .*collector\.jsonl, outside the folder"):
        import_run(db, "otel", run, progress=False)
    assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist()[0]["n"] == 0
