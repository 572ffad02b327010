"""trellisdb's MCP server (issue 25) through the SDK's own client, in-process and over stdio."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

import trellisdb

pytest.importorskip("mcp")

from mcp import Client, StdioServerParameters

from trellisdb.mcp_server import build_server


def _call(server: Any, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    async def go() -> list[Any]:
        async with Client(server) as c:
            return [await c.call_tool(name, args) for name, args in calls]
    return anyio.run(go)


def test_an_agent_records_steps_and_queries_in_process(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    try:
        server = build_server(db)
        r = _call(server, [
            ("record_step", {"session": "s1", "task": "pack", "summary": "root", "id": "r",
                             "rewards": {"score": 0.1}}),
            ("record_step", {"session": "s1", "summary": "greedy", "id": "a", "parents": ["r"],
                             "artifacts": {"code": "def f(): ..."}, "rewards": {"score": 0.7}}),
            ("record_step", {"session": "s1", "summary": "hexagonal", "id": "b", "parents": ["r"],
                             "rewards": {"score": 0.9}, "attrs": {"island": 1}}),
            ("frontier", {"channel": "score", "k": 5}),
            ("lineage", {"node": "b"}),
            ("query", {"tql": "NODES WHERE attr('island') = $i RETURN id", "params": {"i": 1}}),
            ("compare", {"session": "s1", "a": "a", "b": "b", "preferred": "b"}),
            ("add_reward", {"session": "s1", "node": "a", "channel": "score", "value": 0.95}),
            ("frontier", {"channel": "score", "k": 1}),
            ("retrieve", {"text": "hexagonal", "k": 1}),
        ])
        assert [x.is_error for x in r] == [False] * 10, [x.content for x in r if x.is_error]
        assert r[0].structured_content["id"] == "r" and isinstance(r[0].structured_content["commit"], int)
        assert [row["id"] for row in r[3].structured_content["rows"]] == ["b", "a"]
        assert [(row["id"], row["hop"]) for row in r[4].structured_content["rows"]] == [("b", 0), ("r", 1)]
        assert r[5].structured_content["rows"] == [{"id": "b"}]
        assert [row["id"] for row in r[8].structured_content["rows"]] == ["a"]  # re-scored
        assert r[9].structured_content["rows"][0]["id"] == "b"
        assert db.sql("SELECT preferred FROM comparisons").to_pylist() == [{"preferred": "b"}]
        assert db.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 3}]
    finally:
        db.close()


def test_errors_reach_the_agent_with_their_message(tmp_path: Path) -> None:
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    try:
        r = _call(build_server(db), [
            ("query", {"tql": "FRONTEIR LIMIT 3"}),
            ("record_step", {"session": "new", "summary": "x"}),
            ("record_step", {"session": "s", "task": "t", "summary": "x", "parents": ["ghost"]}),
            ("frontier", {"channel": "score", "k": 100000}),
            ("record_step", {"session": "s", "task": "t", "id": "half", "summary": "x", "rewards": {"": 1.0}}),
            ("retrieve", {"text": "x", "space": "minilm; DROP TABLE nodes"}),
        ])
        assert all(x.is_error for x in r)
        assert "reward channel must not be empty" in r[4].content[0].text
        db.flush()  # nothing of the refused step was staged either
        assert db.sql("SELECT count(*) AS n FROM nodes_history WHERE id = 'half'").to_pylist() == [{"n": 0}]
        text = [x.content[0].text for x in r]
        assert "QuerySyntaxError" in text[0] and "FRONTEIR" in text[0]
        assert "give its task" in text[1]
        assert "UnknownParentError" in text[2] and "ghost" in text[2]
        assert "validation error" in text[3]
    finally:
        db.close()


def test_resources_and_stdio(tmp_path: Path) -> None:
    path = tmp_path / "db"
    trellisdb.connect(path, embedding_dim=4).close()
    params = StdioServerParameters(command=sys.executable, args=["-m", "trellisdb.cli", "--db", str(path), "mcp"])

    async def go() -> tuple[list[str], str, Any]:
        async with Client(params) as c:
            uris = [str(x.uri) for x in (await c.list_resources()).resources]
            tql = (await c.read_resource("trellis://tql")).contents[0].text  # type: ignore[union-attr]
            step = await c.call_tool("record_step", {"session": "s", "task": "t", "summary": "over stdio"})
            return uris, tql, step

    uris, tql, step = anyio.run(go)
    assert sorted(uris) == ["trellis://schema", "trellis://tql"]
    assert "FRONTIER" in tql
    assert not step.is_error
    db = trellisdb.connect(path, read_only=True)
    try:
        assert db.sql("SELECT summary FROM nodes").to_pylist() == [{"summary": "over stdio"}]
    finally:
        db.close()
    assert json.dumps(step.structured_content)
