"""Every door of ``trellis serve`` holds the same rules (issue 35, items 3, 4, 5 and 8): the role
check of each TQL statement over MCP as over REST; what an agent may change of other agents'
nodes, by every method of every door; MCP servers keyed by the token itself; only ``Bearer``
headers; transactions that belong to the token that began them; tokens that expire.

A real server process; tokens made with ``trellis token``; MCP through the SDK's own client."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

import trellisdb
from trellisdb.client import RemoteDatabase

from ..serving import free_port, mcp_calls, start, stop

pytest.importorskip("mcp")


def _token(path: Path, tenant: str, role: str, name: str, *extra: str) -> str:
    out = subprocess.run([sys.executable, "-m", "trellisdb.cli", "--db", str(path), "token", "create", "--tenant",
                          tenant, "--role", role, "--name", name, *extra], capture_output=True, text=True, check=True)
    return out.stdout.strip()


class Served(NamedTuple):
    url: str
    path: Path
    tok: dict[str, str]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    path = tmp_path_factory.mktemp("doors") / "db"
    trellisdb.connect(path).close()  # type: ignore[union-attr]
    tok = {name: _token(path, "acme", role, name) for name, role in [
        ("admin", "admin"), ("agent-a", "agent"), ("agent-b", "agent"), ("analyst", "analyst")]}
    port = free_port()
    proc = start(path, port, None, probe=tok["admin"])
    try:
        url = f"http://127.0.0.1:{port}"
        with RemoteDatabase(url, token=tok["agent-a"]) as a, RemoteDatabase(url, token=tok["agent-b"]) as b:
            with a.session(task="pack", id="sa") as s:  # agent a's node, scored 0.5
                s.add_node(id="na", summary="a's", attrs={"island": 1}, labels=["pop"])
                s.add_reward("na", "score", 0.5)
            with b.session(task="pack", id="sb") as s:
                s.add_node(id="nb", summary="b's")
        yield Served(url, path, tok)
    finally:
        stop(proc)


def _text(result: Any) -> str:
    return str(result.content[0].text)


# ---------------------------------------------------------------- item 3: MCP's TQL and roles
def test_mcp_query_checks_each_statements_role_as_rest_does(served: Served) -> None:
    """Analysts and agents ran CREATE VIEW, MATERIALIZE, EXPORT (the file was written) and DROP
    VIEW through MCP's ``query`` tool, which REST refused with 403."""
    url, path, tok = served
    with RemoteDatabase(url, token=tok["admin"]) as ad:
        ad.create_view("kept", "sft", reward="reward('score')", threshold=0.0)
    statements = ["CREATE VIEW stolen AS sft WITH reward = reward('score')", "MATERIALIZE kept",
                  "EXPORT kept TO 'leak.jsonl' FORMAT trl", "REFRESH kept", "DROP VIEW kept"]
    for who in ("analyst", "agent-a"):
        _, out = mcp_calls(url, tok[who], [("query", {"tql": t}) for t in statements] +
                      [("query", {"tql": "SHOW VIEWS"})])
        for text, r in zip(statements, out, strict=False):
            assert r.is_error, (who, text)
            assert "AccessError" in _text(r) and "needs the admin right" in _text(r), _text(r)
        assert not out[-1].is_error  # a reading view statement is fine
        with RemoteDatabase(url, token=tok[who]) as db:  # REST: the same answer, from the same place
            for text in statements:
                with pytest.raises(trellisdb.AccessError, match="needs the admin right"):
                    db.query(text)
    with RemoteDatabase(url, token=tok["admin"]) as ad:
        assert [(v["name"], v["commit"]) for v in ad.views()] == [("kept", None)]  # never materialized
    assert not list(path.rglob("leak.jsonl"))  # no file written
    # an admin's MCP may (the same check lets it through)
    _, (made, dropped) = mcp_calls(url, tok["admin"], [("query", {"tql": "MATERIALIZE kept"}),
                                                  ("query", {"tql": "DROP VIEW kept"})])
    assert not made.is_error and not dropped.is_error, (_text(made), _text(dropped))


# ---------------------------------------------------------------- item 4: who may change what
def _state(db: RemoteDatabase, node: str) -> dict[str, Any]:
    """Everything an agent's write could change about ``node``."""
    def q(sql: str) -> list[dict[str, Any]]:
        return db.sql(sql, params=[node]).to_pylist()
    return {
        "node": q("SELECT status FROM nodes WHERE id = $1"),
        "rewards": q("SELECT channel, value FROM rewards WHERE node_id = $1 ORDER BY channel"),
        "labels": q("SELECT label FROM labels WHERE node_id = $1 ORDER BY label"),
        "attrs": q("SELECT key, value FROM attributes WHERE scope = 'node' AND entity = $1 ORDER BY key"),
        "artifacts": q("SELECT name FROM node_artifacts WHERE node_id = $1 ORDER BY name"),
        "parents": q("SELECT src, kind FROM edges WHERE dst = $1 ORDER BY src"),
    }


#: Each session method an agent may not aim at another agent's node ``na``, through its own session.
REFUSED: list[tuple[str, list[Any], dict[str, Any]]] = [
    ("add_reward", ["na", "score", 99.0], {}),
    ("set_status", ["na", "expanded"], {}),
    ("set_status", [["nb", "na"], "expanded"], {}),  # one of many: nothing changes
    ("label", ["na", "archive"], {}),
    ("label", [["nb", "na"], "archive"], {}),
    ("unlabel", ["na", "pop"], {}),
    ("set_attrs", ["na", {"island": 9}], {}),
    ("set_attrs", ["sa", {"owner": "b"}], {"scope": "session"}),
    ("add_artifact", ["na", "code", "print('mine now')"], {}),
    ("add_edge", ["nb", "na", "derived_from"], {}),  # makes b's node a parent of a's
]


@pytest.mark.parametrize(("method", "args", "kwargs"), REFUSED, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(REFUSED)])
def test_an_agent_changes_no_other_agents_node(served: Served, method: str, args: list[Any],
                                               kwargs: dict[str, Any]) -> None:
    """Through its own session, an agent scored (0.5 -> 99), re-stated, labelled, gave attributes
    and artifacts to, and re-parented another agent's node; each is refused, by REST session
    calls, inside a transaction too, and the node is as it was."""
    url, _, tok = served
    with RemoteDatabase(url, token=tok["agent-b"]) as b, RemoteDatabase(url, token=tok["admin"]) as ad:
        before = _state(ad, "na")
        with pytest.raises(trellisdb.AccessError, match=r"may (change only the nodes|set attributes only of the "
                                                        r"sessions) .*opened") as refused:
            b.call(method, *args, session="sb", **kwargs)
        assert "token:agent-a" in str(refused.value)  # names whose it is
        with pytest.raises(trellisdb.AccessError, match="opened"), b.transaction():
            b.call(method, *args, session="sb", **kwargs)
        ad.flush()
        assert _state(ad, "na") == before
        assert before["rewards"] == [{"channel": "score", "value": 0.5}]


def test_what_an_agent_may_do_with_other_agents_nodes(served: Served) -> None:
    """It builds on them (parents, an edge into its own node), compares them, scores and labels
    its own; a task's attributes and unknown nodes are refused; an admin may change anything."""
    url, _, tok = served
    with RemoteDatabase(url, token=tok["agent-b"]) as b, RemoteDatabase(url, token=tok["admin"]) as ad:
        s = b.resume("sb")
        s.add_node(id="nb2", parents=["na"], summary="built on a's")  # an edge na -> nb2: its own node's
        s.add_edge("na", "nb", "inspired_by")
        cid = s.add_comparison("na", "nb", "nb", margin=0.1)
        s.add_reward("nb", "score", 0.7)
        s.label("nb", "mine")
        s.set_attrs("nb", {"island": 2})
        s.set_attrs("sb", {"note": "ok"}, scope="session")
        with pytest.raises(trellisdb.AccessError, match="a task's attributes are an admin's"):
            s.set_attrs("pack", {"hard": True}, scope="task")
        with pytest.raises(trellisdb.UnknownNodeError, match="'ghost' does not exist"):
            s.add_reward("ghost", "score", 1.0)
        b.flush()
        assert {(r["src"], r["kind"]) for r in _state(ad, "nb2")["parents"]} == {("na", "derived_from")}
        assert ("na", "inspired_by") in {(r["src"], r["kind"]) for r in _state(ad, "nb")["parents"]}
        assert ad.sql("SELECT a, b, preferred FROM comparisons WHERE id = $1", params=[cid]).to_pylist() == [
            {"a": "na", "b": "nb", "preferred": "nb"}]
        # an admin changes any node, through any session
        ad.call("add_reward", "na", "judge", 0.25, session="sb")
        ad.call("label", "na", "reviewed", session="sb")
        ad.flush()
        assert {"channel": "judge", "value": 0.25} in _state(ad, "na")["rewards"]
        assert {"label": "reviewed"} in _state(ad, "na")["labels"]


def test_mcp_tools_hold_the_same_rules(served: Served) -> None:
    """MCP's ``add_reward`` scored another agent's node; it is refused as a session call is, and
    ``compare`` of any nodes stays open."""
    url, _, tok = served
    _, (score, own, judged) = mcp_calls(url, tok["agent-b"], [
        ("add_reward", {"session": "sb", "node": "na", "channel": "score", "value": 99.0}),
        ("add_reward", {"session": "sb", "node": "nb", "channel": "speed", "value": 2.0}),
        ("compare", {"session": "sb", "a": "na", "b": "nb", "preferred": "na"}),
    ])
    assert score.is_error and "AccessError" in _text(score) and "token:agent-a" in _text(score)
    assert not own.is_error and not judged.is_error, (_text(own), _text(judged))
    with RemoteDatabase(url, token=tok["admin"]) as ad:
        assert ad.sql("SELECT value FROM rewards WHERE node_id = 'na' AND channel = 'score'").to_pylist() == [
            {"value": 0.5}]


# ---------------------------------------------------------------- item 5: MCP keyed by the token
def test_a_token_made_again_under_a_revoked_ones_name_gets_its_own_rights_over_mcp(served: Served) -> None:
    """The MCP server was cached by (tenant, token name, read-only): a revoked admin token made
    again under its name as an agent kept the admin's rights over MCP."""
    url, path, tok = served
    first = _token(path, "acme", "admin", "shifty")
    names, (made,) = mcp_calls(url, first, [("query", {"tql": "CREATE VIEW shifty_v AS sft WITH reward = "
                                                          "reward('score')"})])
    assert not made.is_error and "record_step" in names  # an admin's MCP server, now cached
    with RemoteDatabase(url, token=tok["admin"]) as ad:
        ad.request("POST", "/v1/tokens/revoke", {"name": "shifty"})
        again = ad.request("POST", "/v1/tokens", {"role": "agent", "name": "shifty"})["token"]
    _, (refused, scored) = mcp_calls(url, again, [
        ("query", {"tql": "DROP VIEW shifty_v"}),
        ("add_reward", {"session": "sb", "node": "nb", "channel": "score", "value": 99.0}),  # b's session
    ])
    assert refused.is_error and "needs the admin right" in _text(refused)
    assert scored.is_error and "may write only the sessions it opened" in _text(scored)
    assert subprocess.run([sys.executable, "-m", "trellisdb.cli", "--db", str(path), "token", "revoke", "shifty"],
                          capture_output=True, check=True).returncode == 0  # revoked by the command, too
    reader = _token(path, "acme", "analyst", "shifty")
    names, _ = mcp_calls(url, reader, [])
    assert "record_step" not in names and "query" in names  # an analyst's: the reading tools only
    for old in (first, again):
        r = httpx.post(f"{url}/mcp", json={}, headers={"authorization": f"Bearer {old}"})
        assert r.status_code == 401


# ---------------------------------------------------------------- item 8: Bearer only
def test_only_a_bearer_header_is_accepted(served: Served) -> None:
    """A header holding the bare token (no ``Bearer``) was accepted."""
    url, _, tok = served
    secret = tok["analyst"]
    for header in (secret, f"Basic {secret}", f"Token {secret}", f"Bearer{secret}", "Bearer",
                   f"{secret} Bearer"):
        for method, route in (("GET", "/v1/health"), ("POST", "/mcp")):
            r = httpx.request(method, f"{url}{route}", headers={"authorization": header}, json={})
            assert r.status_code == 401, (header, route, r.text)
            assert r.json()["error"] == "Unauthorized"
    for header in (f"Bearer {secret}", f"bearer {secret}", f"BEARER  {secret}"):
        r = httpx.get(f"{url}/v1/health", headers={"authorization": header})
        assert r.status_code == 200 and r.json()["result"]["role"] == "analyst"


# ---------------------------------------------------------------- item 8: transactions are their token's
def test_a_transaction_belongs_to_the_token_that_began_it(served: Served) -> None:
    """Any agent of the tenant that knew a transaction's id could write into it, commit it or roll
    it back; now only the token that began it (an admin neither)."""
    url, _, tok = served
    with RemoteDatabase(url, token=tok["agent-a"]) as a, RemoteDatabase(url, token=tok["agent-b"]) as b, \
            RemoteDatabase(url, token=tok["admin"]) as ad:
        tx = a.request("POST", "/v1/tx/begin", {"message": "a's block"})["tx"]
        a.request("POST", "/v1/call", {"method": "add_node", "session": "sa", "kwargs": {"id": "tx-n1"}, "tx": tx})
        for other in (b, ad):
            for route, body in (("/v1/tx/commit", {"tx": tx}), ("/v1/tx/rollback", {"tx": tx}),
                                ("/v1/call", {"method": "add_task", "args": ["tx-task"], "tx": tx}),
                                ("/v1/sessions", {"kwargs": {"task": "pack", "id": "tx-s"}, "tx": tx})):
                with pytest.raises(trellisdb.AccessError, match="begun by another token"):
                    other.request("POST", route, body)
        out = a.request("POST", "/v1/tx/commit", {"tx": tx})
        assert isinstance(out["commit_id"], int)
        assert ad.sql("SELECT commit_id FROM nodes WHERE id = 'tx-n1'").to_pylist() == [{"commit_id": out["commit_id"]}]
        assert ad.sql("SELECT count(*) AS n FROM tasks WHERE id = 'tx-task'").to_pylist() == [{"n": 0}]
        assert [c["message"] for c in ad.log() if c["id"] == out["commit_id"]] == ["a's block"]


# ---------------------------------------------------------------- item 8: tokens expire
def test_tokens_expire(served: Served) -> None:
    """Tokens never expired; now one may (``--expires``, ``POST /v1/tokens`` ``expires``): kept in
    tokens.json, listed, refused with 401 naming the moment on every request once it passed."""
    url, path, tok = served
    brief = _token(path, "acme", "agent", "brief", "--expires", "8s")
    with RemoteDatabase(url, token=tok["admin"]) as ad:
        made = ad.request("POST", "/v1/tokens", {"role": "analyst", "name": "brief-http", "expires": "8s"})
        with pytest.raises(trellisdb.ValidationError, match=r"duration .* or an ISO time"):
            ad.request("POST", "/v1/tokens", {"role": "analyst", "name": "never", "expires": "soon"})
        with pytest.raises(trellisdb.ValidationError, match="has passed"):
            ad.request("POST", "/v1/tokens", {"role": "analyst", "name": "never", "expires": "2020-01-01T00:00Z"})
        listed = {t["name"]: t["expires"] for t in ad.request("GET", "/v1/tokens")}
    assert listed["brief-http"] == made["expires"] and listed["brief"] is not None and listed["admin"] is None
    stored = {e["name"]: e.get("expires") for e in json.loads((path / "tokens.json").read_text())["tokens"]}
    assert stored["brief"] == listed["brief"] and stored["brief-http"] == made["expires"]
    shown = subprocess.run([sys.executable, "-m", "trellisdb.cli", "--db", str(path), "token", "list", "--format",
                            "json"], capture_output=True, text=True, check=True).stdout
    assert listed["brief"] in shown
    with RemoteDatabase(url, token=brief) as db:
        db.record_step(session="brief-s", task="pack", summary="while it lasts")
        _, (ok,) = mcp_calls(url, brief, [("query", {"tql": "NODES RETURN count(*) AS n"})])
        assert not ok.is_error
        until = max(dt.datetime.fromisoformat(listed[n]) for n in ("brief", "brief-http"))
        time.sleep(max(0.0, (until - dt.datetime.now(dt.UTC)).total_seconds()) + 0.3)
        with pytest.raises(trellisdb.AccessError, match=r"token 'brief' of tenant 'acme' expired at "
                                                        + listed["brief"][:16]):
            db.health()
    for secret in (brief, made["token"]):
        for method, route in (("GET", "/v1/health"), ("POST", "/mcp")):
            r = httpx.request(method, f"{url}{route}", headers={"authorization": f"Bearer {secret}"}, json={})
            assert r.status_code == 401 and "expired at" in r.json()["message"], r.text


def test_an_admin_reopening_an_agents_session_leaves_it_the_agents(tmp_path: Path) -> None:
    """A server that had not seen a session yet (it restarted, or purged) cached the owner of a
    session an admin reopened as the admin: the agent that opened it was then refused its own
    session and its own nodes."""
    from trellisdb.database import open_local
    from trellisdb.service import Service
    from trellisdb.tenants import Principal

    agent, admin = Principal("w1", "default", "agent", key="k1"), Principal("boss", "default", "admin", key="k2")
    db = open_local(tmp_path / "db")
    try:
        first = Service(db)
        first.open_session({"kwargs": {"task": "t", "id": "s1"}}, agent)
        first.call({"method": "add_node", "session": "s1", "kwargs": {"id": "n1"}}, agent)
        first.durable()
        first.close()
        again = Service(db)  # the server started again: nothing cached
        try:
            again.open_session({"kwargs": {"task": "t", "id": "s1"}}, admin)  # an admin reopens it
            again.call({"method": "add_reward", "session": "s1", "args": ["n1", "score", 0.5]}, agent)
            again.call({"method": "add_node", "session": "s1", "kwargs": {"id": "n2", "parents": ["n1"]}}, agent)
            again.durable()
            assert again.owner("s1") == (True, "token:w1")
        finally:
            again.close()
        assert db.sql("SELECT value FROM rewards WHERE node_id = 'n1'").to_pylist() == [{"value": 0.5}]
    finally:
        db.close()
