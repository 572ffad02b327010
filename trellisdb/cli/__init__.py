"""The `trellis` command: a thin layer over the library.

trellis [--db PATH] [--read-only] [--export-root DIR] init | log | sql TEXT | query TQL | explain TQL
    | tag NAME [--move] | untag NAME | compact | verify | repair | demo
    | views | create-view NAME KIND -o K=V ... | materialize NAME | refresh NAME | export NAME PATH
    | purge (--session ID ... | --task T) --yes
    | import FORMAT PATH | serve [--host H] [--port P] [--token T] [--allowed-host NAME] [--verify MOD:FN]
    | token create --tenant T --role R [--name N] | token list [--tenant T] | token revoke NAME

`output` prints the rows (the demo prints through it too); `demo` is `trellis demo`, imported
when that command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from trellisdb.cli.output import format_table
from trellisdb.errors import TrellisError

__all__ = ["build_parser", "format_table", "main"]


def _default_db() -> str:
    return os.environ.get("TRELLIS_DB", "./trellis.db")


def _param(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise TrellisError(f"--param {text!r} must look like NAME=VALUE, e.g. --param session=s1")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    if isinstance(value, list | dict):
        value = raw
    return name, value


def _opt(text: str) -> tuple[str, Any]:
    """A view option NAME=VALUE: VALUE as JSON when it parses (lists too: pairs_from=["siblings"]), else text."""
    name, sep, raw = text.partition("=")
    if not sep or not name.isidentifier():
        raise TrellisError(f"--opt {text!r} must look like NAME=VALUE, e.g. -o threshold=0.9")
    try:
        return name, json.loads(raw)
    except ValueError:
        return name, raw


def _hook(spec: str) -> Any:
    """The callable ``module:function`` names (``serve --verify``), imported now: a typo is an
    error at start, not at the first write."""
    import importlib

    module, _, name = spec.partition(":")
    if not module or not name:
        raise TrellisError(f"--verify {spec!r}: name a function as module:function (e.g. mychecks:verify)")
    sys.path.insert(0, os.getcwd())  # as `python -m` would: a module next to where the server starts
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise TrellisError(f"--verify {spec!r}: {e}") from None
    if not callable(fn):
        raise TrellisError(f"--verify {spec!r} is not a function")
    return fn


def _server_extra(command: str) -> None:
    """Refuse ``trellis <command>`` clearly when the server extra is not installed."""
    import importlib.util

    missing = [m for m in ("starlette", "uvicorn", "mcp") if importlib.util.find_spec(m) is None]
    if missing:
        raise TrellisError(f"`trellis {command}` needs the server extra ({', '.join(missing)} not installed): "
                           "pip install 'trellisdb[server]'")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trellis", description="trellisdb: experience-graph database")
    p.add_argument("--db", default=None, help="database folder (default: $TRELLIS_DB or ./trellis.db)")
    p.add_argument("--read-only", action="store_true",
                   help="open the database read-only: writes, tags, view changes and exports are refused")
    p.add_argument("--export-root", default=None,
                   help="folder that export paths are relative to, and confined to (default: <db>/exports)")
    sub = p.add_subparsers(dest="command", required=True)
    init = sub.add_parser("init", help="create a database")
    init.add_argument("--embedding-dim", type=int, default=None, help="embedding dimension (default 384)")
    sub.add_parser("log", help="list the commits")
    sql = sub.add_parser("sql", help="run DuckDB SQL over the tables")
    sql.add_argument("text")
    sql.add_argument("--as-of", default=None, help="commit id, tag or ISO timestamp")
    sql.add_argument("--format", choices=["table", "json", "csv"], default="table")
    for name, what in (("query", "run a TQL query"), ("explain", "show a TQL query's plan, SQL and DuckDB plan")):
        q = sub.add_parser(name, help=what)
        q.add_argument("text")
        q.add_argument(
            "--param", "-p", action="append", default=[], metavar="NAME=VALUE",
            help="bind $NAME; VALUE is read as JSON when it parses (5, 0.5, true, null, \"07\"), else as text",
        )
        if name == "query":
            q.add_argument("--format", choices=["table", "json", "csv"], default="table")
    tag = sub.add_parser("tag", help="name a commit")
    tag.add_argument("name")
    tag.add_argument("--commit", type=int, default=None)
    tag.add_argument("--move", action="store_true", help="point an existing tag at this commit")
    untag = sub.add_parser("untag", help="remove a tag")
    untag.add_argument("name")
    compact = sub.add_parser("compact", help="compact the tables now")
    compact.add_argument(
        "--prune-now", action="store_true", help="also delete old physical versions at once (no other reader running)"
    )
    sub.add_parser("verify", help="read every file; report damage")
    sub.add_parser("repair", help="recover acknowledged commits a damaged commit log lost (copies go to lost+found/)")
    pg = sub.add_parser("purge", help="delete sessions' data from every stored version, irreversibly (needs --yes)")
    who = pg.add_mutually_exclusive_group(required=True)
    who.add_argument("--session", action="append", metavar="ID", help="a session to purge (repeatable)")
    who.add_argument("--task", default=None, help="purge every session of this task")
    pg.add_argument("--yes", action="store_true", help="confirm: what is purged cannot be recovered")
    sub.add_parser("views", help="list the training-data views")
    cv = sub.add_parser("create-view", help="declare a training-data view (kinds and options: trellisdb/training/kinds/)")
    cv.add_argument("name")
    cv.add_argument("kind", help="sft | preference | grpo | kto | stepwise | replay")
    cv.add_argument("--opt", "-o", action="append", default=[], metavar="NAME=VALUE",
                    help="a view option, e.g. -o \"reward=reward('score')\" -o threshold=0.9 (VALUE read as JSON "
                         "when it parses)")
    cv.add_argument("--replace", action="store_true", help="redefine an existing view")
    mat = sub.add_parser("materialize", help="compute a view and store its rows pinned to a commit")
    mat.add_argument("name")
    mat.add_argument("--as-of", default=None, help="commit id, tag or ISO timestamp (default: latest)")
    ref = sub.add_parser("refresh", help="bring a materialized view to the latest commit")
    ref.add_argument("name")
    ex = sub.add_parser("export", help="write a materialized view as a dataset (JSONL / Parquet + manifest)")
    ex.add_argument("name")
    ex.add_argument("path", help="folder to write, relative to the export root (--export-root, default <db>/exports)")
    ex.add_argument("--format", choices=["trl", "openai", "parquet"], default="trl")
    ex.add_argument("--validation", type=float, default=0.0, help="share of tasks split off for validation")
    ex.add_argument("--overwrite", action="store_true", help="replace the folder if an earlier export wrote it")
    ex.add_argument("--skip-missing", action="store_true", help="leave out rows whose texts are missing")
    imp = sub.add_parser("import", help="import a recorded run (OpenEvolve, SWE-agent, JSONL, OpenTelemetry)")
    imp.add_argument("format", help="openevolve | swe-agent | jsonl | otel")
    imp.add_argument("path", help="the run's folder or file, as its tool wrote it")
    imp.add_argument("--task", default=None, help="task id for the run (openevolve, swe-agent, otel; default: from the run)")
    imp.add_argument("--tag-prefix", default=None,
                     help="prefix of the tags an import writes (openevolve, jsonl; the other formats write no tags)")
    imp.add_argument("--session", default=None, help="session id for the run (openevolve; default from the run folder)")
    imp.add_argument("--no-progress", action="store_true", help="no progress bar")
    srv = sub.add_parser("serve", help="serve the database over HTTP (needs the server extra)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=7437, help="port (default 7437)")
    srv.add_argument("--token", default=os.environ.get("TRELLIS_TOKEN"),
                     help="one shared token, the default tenant's admin: 'Authorization: Bearer TOKEN' "
                          "(default $TRELLIS_TOKEN; per-tenant tokens: trellis token create)")
    srv.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="seconds a request body may take to arrive (slower clients get 408; default 30)")
    srv.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                     help="a name clients reach the server by, for MCP's DNS-rebinding check (repeatable)")
    srv.add_argument("--verify", default=None, metavar="MODULE:FUNCTION",
                     help="a verify-before-insert hook: called with each node an agent writes, it answers "
                          "accept, hold (stored quarantined) or reject (docs/server.md)")
    tok = sub.add_parser("token", help="make, list and revoke the tokens of a served store (tenants and roles)")
    tsub = tok.add_subparsers(dest="action", required=True)
    tc = tsub.add_parser("create", help="make a token; it is printed once and never stored")
    tc.add_argument("--tenant", default="default", help="the tenant it belongs to (default: default)")
    tc.add_argument("--role", required=True, choices=["agent", "analyst", "admin"])
    tc.add_argument("--name", default=None, help="a name for it (default: made up)")
    tl = tsub.add_parser("list", help="the tokens (names, tenants, roles; never the tokens)")
    tl.add_argument("--tenant", default=None)
    tr = tsub.add_parser("revoke", help="remove a token")
    tr.add_argument("name")
    sub.add_parser("mcp", help="serve the database to an agent over MCP on stdio (needs the server extra)")
    demo = sub.add_parser("demo", help="run a small simulated search into the database")
    demo.add_argument("--sessions", type=int, default=3)
    demo.add_argument("--steps", type=int, default=12)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = args.db or _default_db()
    try:
        return _run(args, path)
    except TrellisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _token(args: argparse.Namespace, path: str) -> int:
    """``trellis token``: the registry is a file of the served folder (the server rereads it)."""
    from trellisdb.tenants import Tokens

    if not os.path.isdir(path):
        raise TrellisError(f"{path} is not a database folder; serve it once (`trellis --db {path} serve`) or "
                           f"`trellis --db {path} init` first")
    reg = Tokens(path)
    if args.action == "create":
        secret = reg.create(args.tenant, args.role, name=args.name)
        who = reg.lookup(secret)
        assert who is not None
        print(f"token {who.name!r}: {who.role} of tenant {who.tenant!r} (shown once; keep it):", file=sys.stderr)
        print(secret)
    elif args.action == "list":
        rows = reg.list(args.tenant)
        print(format_table(pa.Table.from_pylist(rows) if rows else pa.table({"name": pa.array([], pa.string())}),
                           "table"))
    else:
        gone = reg.revoke(args.name)
        print(f"revoked {gone['name']!r} ({gone['role']} of tenant {gone['tenant']!r})")
    return 0


def _run(args: argparse.Namespace, path: str) -> int:
    from trellisdb.database import open_local as connect

    if args.read_only and args.command in ("init", "demo", "import", "serve", "mcp", "token"):
        raise TrellisError(f"`trellis {args.command}` writes the database; drop --read-only")
    if args.command == "init":
        db = connect(path, embedding_dim=args.embedding_dim)
        print(f"initialized {path} (embedding dimension {db.embedding_dim})")
        return 0
    if args.command == "mcp":
        _server_extra("mcp")
        from trellisdb.mcp_server import serve_stdio

        serve_stdio(path)
        return 0
    if args.command == "serve":
        _server_extra("serve")
        from trellisdb.server import serve

        print(f"serving {path} on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        verify = _hook(args.verify) if args.verify else None
        serve(path, host=args.host, port=args.port, token=args.token, allowed_hosts=args.allowed_host,
              export_root=args.export_root, body_timeout=args.body_timeout, verify=verify)
        return 0
    if args.command == "token":
        return _token(args, path)
    if args.command == "import":
        from trellisdb.importers import import_run

        with connect(path, mirror=False) as db:
            opts = {k: v for k, v in (("task", args.task), ("tag_prefix", args.tag_prefix),
                                      ("session", args.session)) if v is not None}
            report = import_run(db, args.format, args.path, progress=False if args.no_progress else None, **opts)
        print(report.summary())
        return 0
    if args.command == "demo":
        from trellisdb.cli.demo import run_demo

        run_demo(path, sessions=args.sessions, steps=args.steps)
        return 0
    # one question per process: scanning Lance beats building the reader's mirror first
    db = connect(path, create=False, mirror=False, read_only=args.read_only, export_root=args.export_root)
    if args.command == "log":
        t = pa.Table.from_pylist(db.log()) if db.log() else pa.table({"id": pa.array([], pa.int64())})
        print(format_table(t, "table"))
    elif args.command == "sql":
        print(format_table(db.sql(args.text, as_of=args.as_of).to_arrow(), args.format))
    elif args.command in ("query", "explain"):
        params = dict(_param(p) for p in args.param)
        text = args.text if args.command == "query" else f"EXPLAIN {args.text}"
        res = db.query(text, **params)
        if args.command == "explain":
            print(res.to_pylist()[0]["explain"])
        else:
            print(format_table(res.to_arrow(), args.format))
    elif args.command == "tag":
        cid = db.tag(args.name, args.commit, move=args.move)
        print(f"tagged commit {cid} as {args.name!r}")
    elif args.command == "untag":
        cid = db.untag(args.name)
        print(f"removed tag {args.name!r} (it named commit {cid})")
    elif args.command == "compact":
        import datetime as dt

        out = db.compact(dt.timedelta(0)) if args.prune_now else db.compact()
        for name, m in out.items():
            print(f"{name}: {m['fragments_removed']} fragments -> {m['fragments_added']}")
    elif args.command == "views":
        vs = db.views()
        print(format_table(pa.Table.from_pylist(vs) if vs else pa.table({"name": pa.array([], pa.string())}), "table"))
    elif args.command == "create-view":
        opts = dict(_opt(o) for o in args.opt)
        e = db.create_view(args.name, args.kind, replace=args.replace, **opts)
        print(f"view {args.name!r}: {e['definition']}")
    elif args.command in ("materialize", "refresh"):
        e = db.materialize(args.name, as_of=args.as_of) if args.command == "materialize" else db.refresh(args.name)
        print(f"view {args.name!r}: {e['rows']} rows at commit {e['commit']} ({e.get('how', 'built')})")
    elif args.command == "export":
        def progress(done: int, total: int) -> None:
            if total >= 100_000:
                print(f"\r{done}/{total} rows", end="" if done < total else "\n", file=sys.stderr, flush=True)

        target = db.export_target(args.path)
        m = db.export(args.name, target, args.format, validation=args.validation, overwrite=args.overwrite,
                      skip_missing=args.skip_missing, progress=progress)
        print(f"wrote {m['rows']} rows ({', '.join(f'{k} {v}' for k, v in m['counts'].items())}) of view "
              f"{args.name!r} at commit {m['commit']} to {target} ({m['layout']})")
    elif args.command == "purge":
        if not args.yes:
            raise TrellisError("`trellis purge` deletes the sessions' data from every stored version, for good "
                               "(time travel included); add --yes to confirm")
        r = db.purge(task=args.task) if args.task is not None else db.purge(args.session)
        rows = ", ".join(f"{t} {n}" for t, n in r["rows"].items() if n) or "no rows"
        print(f"purged session(s) {', '.join(r['sessions'])} (audit commit {r['commit']}): {rows}; "
              f"{r['shared_artifacts']} shared artifact(s) kept; views computed again: "
              f"{', '.join(r['views_rebuilt']) or 'none'}; exports removed: {len(r['exports_removed'])}")
    elif args.command == "repair":
        from trellisdb.storage.recovery import describe

        print("\n".join(describe(db.repair())))
    elif args.command == "verify":
        problems = db.verify()
        for pr in problems:
            print(f"DAMAGED {pr}")
        if problems:
            return 1
        print(f"ok: {path} is healthy ({len(db.log())} commits)")
    db.close()
    return 0
