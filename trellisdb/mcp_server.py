"""trellisdb as an MCP server (issue 25): the tools an agent calls, over stdio (``trellis mcp
--db PATH``). Built on the official ``mcp`` SDK (the ``server`` extra).

Tools: ``query`` (any TQL), ``frontier``, ``lineage``, ``retrieve`` (vector-seeded, with lineage),
``record_step`` (a node with its artifacts and rewards in one call), ``add_reward``, ``compare``.
Resources: ``trellis://schema`` (the tables and columns) and ``trellis://tql`` (the TQL
reference). A ``TrellisError`` reaches the agent as a tool error with its message (a TQL
syntax error with its caret and hint), so the agent can correct itself.

>>> import tempfile, trellisdb
>>> server = build_server(trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4))
>>> sorted(t.name for t in server._tool_manager.list_tools())  # doctest: +SKIP
['add_reward', 'compare', 'frontier', 'lineage', 'query', 'record_step', 'retrieve']
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field  # the SDK reads the tools' annotations, so their names live at module level

from trellisdb.errors import TrellisError
from trellisdb.writer import reward_value

if TYPE_CHECKING:
    from trellisdb.database import Database
    from trellisdb.writer import SessionWriter

#: Rows a tool returns at most (an agent's context is small; the query says LIMIT for more).
MAX_ROWS = 200

_DOCS = Path(__file__).resolve().parents[1] / "docs"


def _rows(table: Any) -> dict[str, Any]:
    """A result as JSON-able rows (at most ``MAX_ROWS``), saying whether it was cut."""
    rows = table.to_pylist()
    out = json.loads(json.dumps(rows[:MAX_ROWS], default=str))
    return {"rows": out, "count": len(rows), "truncated": len(rows) > MAX_ROWS}


def build_server(db: Database) -> MCPServer:
    """The MCP server of the open database ``db``."""
    mcp = MCPServer("trellisdb", instructions=(
        "An experience-graph store: attempts (nodes) with lineage, artifacts and rewards. Use `frontier` to pick "
        "what to expand, `record_step` to record what you did, `retrieve` to find similar past attempts with "
        "their lineage, `query` for any TQL (read trellis://tql)."))
    writers: dict[str, SessionWriter] = {}
    lock = threading.Lock()

    def run(fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except TrellisError as e:  # its message reaches the agent (a plain exception's would not)
            raise ToolError(f"{type(e).__name__}: {e}") from e

    def writer(session: str, task: str | None) -> SessionWriter:
        with lock:
            w = writers.get(session)
            if w is None:
                existing = db.sql("SELECT task_id FROM sessions WHERE id = $1", params=[session]).to_pylist()
                if existing:
                    w = db.resume(session)
                elif task is None:
                    raise ToolError(f"session {session!r} is new: give its task")
                else:
                    w = db.session(task=task, id=session, agent="mcp")
                writers[session] = w
            return w

    @mcp.tool()
    def query(tql: Annotated[str, Field(description="a TQL statement, e.g. NODES WHERE ... RETURN ...")],
              params: Annotated[dict[str, Any] | None, Field(description="values of $names")] = None
              ) -> dict[str, Any]:
        """Run a TQL query (see resource trellis://tql); rows as JSON."""
        return _rows(run(db.query, tql, **(params or {})).to_arrow())

    @mcp.tool()
    def frontier(channel: Annotated[str, Field(description="reward channel to rank by")],
                 k: Annotated[int, Field(ge=1, le=MAX_ROWS)] = 10,
                 session: Annotated[str | None, Field(description="only this session's nodes")] = None,
                 per_parent: Annotated[int | None, Field(ge=1)] = None) -> dict[str, Any]:
        """The best nodes not yet expanded, by a reward channel: what to work on next."""
        scope = "FROM SESSION $s " if session else ""
        per = f" PER PARENT {int(per_parent)}" if per_parent else ""
        text = (f"FRONTIER {scope}RANK BY reward($ch) DESC{per} LIMIT {int(k)} "
                "RETURN id, summary, reward($ch) AS reward")
        return _rows(run(db.query, text, ch=channel, **({"s": session} if session else {})).to_arrow())

    @mcp.tool()
    def lineage(node: str, direction: Annotated[str, Field(pattern="^(ancestors|descendants)$")] = "ancestors",
                hops: Annotated[int, Field(ge=1, le=10_000)] = 10) -> dict[str, Any]:
        """Where a node came from (ancestors) or what came of it (descendants), with hops."""
        text = f"LINEAGE OF $n {direction.upper()} {int(hops)} RETURN id, hop, summary, status"
        return _rows(run(db.query, text, n=node).to_arrow())

    @mcp.tool()
    def retrieve(text: Annotated[str, Field(description="what to look for")],
                 k: Annotated[int, Field(ge=1, le=100)] = 5,
                 space: Annotated[str | None, Field(description="embedding space (a text space)")] = None,
                 expand_hops: Annotated[int, Field(ge=0, le=10)] = 2) -> dict[str, Any]:
        """Past attempts similar to ``text`` (vector search in ``space``, or keywords when there is
        none), with their lineage."""
        search = f"SIMILAR TO $t IN {space}" if space else "MATCHING $t"
        if space and not space.isidentifier():
            raise ToolError(f"space {space!r} is not a space name")
        expand = f" EXPAND LINEAGE {int(expand_hops)}" if expand_hops else ""
        q = f"RETRIEVE {int(k)} {search}{expand} RETURN id, relation, hop, summary"
        return _rows(run(db.query, q, t=text).to_arrow())

    @mcp.tool()
    def record_step(session: str, summary: str, task: str | None = None,
                    parents: list[str] | None = None, kind: str = "attempt",
                    artifacts: dict[str, str] | None = None, rewards: dict[str, float] | None = None,
                    attrs: dict[str, Any] | None = None, action: str | None = None, state: str | None = None,
                    id: Annotated[str | None, Field(description="your id for the step: a retry with it is "
                                                               "idempotent")] = None) -> dict[str, Any]:
        """Record one step (a node, its parent edges, artifacts, rewards and attributes); returns
        its id once it is durable."""
        def step() -> dict[str, Any]:
            for ch, v in (rewards or {}).items():  # all or nothing: a bad reward stages no node
                reward_value(id or "(new node)", ch, v)
            w = writer(session, task)
            node_id = w.add_node(id=id, parents=parents or [], kind=kind, summary=summary, artifacts=artifacts,
                                 attrs=attrs, action=action, state=state)
            for ch, v in (rewards or {}).items():
                w.add_reward(node_id, ch, v)
            return {"id": node_id, "commit": db.flush() or db.snapshot().commit}
        out: dict[str, Any] = run(step)
        return out

    @mcp.tool()
    def add_reward(session: str, node: str, channel: str, value: float) -> dict[str, Any]:
        """Score a node on a reward channel (a later score of the same channel supersedes it)."""
        def score() -> dict[str, Any]:
            writer(session, None).add_reward(node, channel, value)
            return {"commit": db.flush() or db.snapshot().commit}
        out: dict[str, Any] = run(score)
        return out

    @mcp.tool()
    def compare(session: str, a: str, b: str,
                preferred: Annotated[str | None, Field(description="a, b, or null for a tie")],
                margin: float | None = None) -> dict[str, Any]:
        """Record a judgment between two nodes (for preference training data)."""
        def judge() -> dict[str, Any]:
            cid = writer(session, None).add_comparison(a, b, preferred, margin=margin, judge="mcp")
            return {"id": cid, "commit": db.flush() or db.snapshot().commit}
        out: dict[str, Any] = run(judge)
        return out

    @mcp.resource("trellis://schema", mime_type="text/markdown")
    def schema() -> str:
        """The tables and their columns."""
        return (_DOCS / "data-model.md").read_text() if (_DOCS / "data-model.md").exists() else "see trellisdb.schema"

    @mcp.resource("trellis://tql", mime_type="text/markdown")
    def tql() -> str:
        """The TQL reference."""
        return (_DOCS / "tql.md").read_text() if (_DOCS / "tql.md").exists() else "see docs/tql.md"

    return mcp


def serve_stdio(path: str) -> None:
    """``trellis mcp --db PATH``: the MCP server of the store at ``path`` over stdio."""
    from trellisdb.database import connect

    with connect(path) as db:
        build_server(db).run()
