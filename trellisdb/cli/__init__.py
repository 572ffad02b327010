"""The `trellis` command: a thin layer over the library.

trellis [--db PATH] [--read-only] [--export-root DIR] [--quiet] [--version] COMMAND ...
    init | log | sql TEXT | query TQL | explain TQL
    | tag NAME [--move] | untag NAME | compact | verify | repair
    | demo [--seed N] [--tasks N] [--steps N] [--target F] [--report DIR] [--reset] [--no-plots]
    | views | create-view NAME KIND -o K=V ... | materialize NAME | refresh NAME | export NAME PATH
    | embed SPACE [--target nodes|tasks] [--create]
    | purge (--session ID ... | --task T) --yes
    | import FORMAT PATH | serve [--host H] [--port P] [--token T] [--allowed-host NAME] [--verify MOD:FN]
          [--header-timeout S] [--keep-alive S] [--max-connections N]
          [--query-timeout S] [--memory-limit SIZE] [--token-reads N] [--tenant-reads N] [--max-reads N]
          [--read-wait S]
    | token create --tenant T --role R [--name N] [--expires WHEN] | token list [--tenant T] | token revoke NAME

Global options go before or after the command (`trellis --db X log`, `trellis log --db X`); given
twice, the one after the command wins. The database is `--db`, else `$TRELLIS_DB`, else
`./trellis.db`. `--quiet` (`--no-progress`) hides the progress bars, which show only when stderr
is a terminal. Commands that print rows take `--format table|json|csv` and `--width N`.

Errors print as one line, `error: ...`, exit status 1. The library's messages are written for
Python callers and name the call to make (`pass replace=True`, `run db.materialize('x')`); the
command rewords those phrases into the option or command that does the same (`use --replace`,
`run trellis materialize x`) where it prints them (`in_cli_words`, the table `CLI_WORDS`), so
each message stays right for its reader and the library keeps one text. `tests/test_cli_fixes.py`
drives the rewordings through the command (all but those of a damaged store, checked on their
text), so a library message that changes and slips out of its rule fails there.

`output` prints the rows (the demo prints through it too); `trellis demo` runs
`trellisdb.demo.run`, imported when that command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from trellisdb.cli.output import WIDTH, format_table
from trellisdb.errors import NotADatabaseError, TrellisError
from trellisdb.http_limits import HEADER_TIMEOUT, KEEP_ALIVE, MAX_CONNECTIONS
from trellisdb.reader import QUERY_TIMEOUT, size_bytes
from trellisdb.server import MAX_READS, READ_WAIT, TENANT_READS

__all__ = ["CLI_WORDS", "build_parser", "format_table", "in_cli_words", "main"]

#: Phrases of the library's messages that name a Python call, and the option or command that does
#: the same here: (the commands whose errors it applies to, None: all; pattern; replacement), in
#: order. The library's messages stay written for Python callers.
CLI_WORDS: tuple[tuple[frozenset[str] | None, str, str], ...] = (
    (frozenset({"create-view"}), r"pass replace=True to redefine it", "use --replace to redefine it"),
    (None, r"run db\.materialize\('([^']*)'\)", r"run `trellis materialize \1`"),
    (None, r"run db\.materialize\(name\)", "run `trellis materialize NAME`"),
    (None, r"\(create one with db\.create_view\)", "(create one with `trellis create-view NAME KIND -o ...`)"),
    (frozenset({"export"}), r"pass overwrite=True \(or --overwrite\)", "use --overwrite"),
    (frozenset({"export"}), r"pass skip_missing=True \(--skip-missing\)", "use --skip-missing"),
    (frozenset({"export"}), r"with db\.sql\('([^']*)'\)", r'with `trellis sql "\1"`'),
    (frozenset({"tag"}), r"pass move=True \(trellis tag --move\)", "use --move"),
    (None, r"db\.repair\(\) \(`trellis repair`\)", "`trellis repair`"),
    (None, r" \(opened with read_only=True, or trellis --read-only\); open it without read_only to write",
     " (--read-only); drop --read-only to write"),
    (None, r" \(read_only=True, trellis --read-only\)", " (--read-only)"),
    (None, r"\(connect\(export_root=\.\.\.\), trellis --export-root\)", "(--export-root)"),
    (frozenset({"embed"}), r"space '([^']*)' of nodes(.*) \(create one with db\.create_space\)",
     r"space '\1' of nodes\2 (create it, a MiniLM space, with `trellis embed \1 --create`)"),
    (frozenset({"embed"}), r"space '([^']*)' of tasks(.*) \(create one with db\.create_space\)",
     r"space '\1' of tasks\2 (create it, a MiniLM space, with `trellis embed \1 --target tasks --create`)"),
    (frozenset({"embed"}), r"create a space with an embedder to embed",
     "embed into a space of its own: `trellis embed NAME --create` (a MiniLM space)"),
    (None, r"\(create one with db\.create_space\)", "(create a MiniLM space with `trellis embed SPACE --create`)"),
    (frozenset({"sql"}), r"db\.sql runs one statement per call; this text has (\d+)",
     r"trellis sql runs one statement per call; this text has \1: run each with its own `trellis sql`"),
    (frozenset({"sql"}), r"\bdb\.sql\b", "trellis sql"),
    # create-view's options are -o NAME=VALUE, VALUE as JSON (true, not True)
    (frozenset({"create-view"}), r"\b(needs|e\.g\.) (\w+)=", r"\1 -o \2="),
    (frozenset({"create-view"}), r"\b(\w+)=True\b", r"-o \1=true"),
    (frozenset({"create-view"}), r"must be True or False", "must be true or false"),
)


def in_cli_words(message: str, command: str | None) -> str:
    """``message`` (a library error's) with the Python calls it names turned into the options and
    commands of ``trellis COMMAND`` (``CLI_WORDS``).

    >>> in_cli_words("view 'best' exists; pass replace=True to redefine it (its rows go)", "create-view")
    "view 'best' exists; use --replace to redefine it (its rows go)"
    """
    for commands, pattern, replacement in CLI_WORDS:
        if commands is None or command in commands:
            message = re.sub(pattern, replacement, message)
    return message


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trellisdb")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


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


def _seconds(text: str) -> float | None:
    """``--query-timeout``: seconds > 0, or 0 for no limit."""
    try:
        n = float(text)
    except ValueError:
        n = -1.0
    if not n >= 0 or n == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0 (0: no limit)")
    return n or None


def _size(text: str) -> int:
    """``--memory-limit``: bytes, or a size such as 4GiB or 512MB."""
    n = int(text) if text.isdigit() else size_bytes(text)
    if n is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write bytes or e.g. 4GiB, 512MB")
    return n


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return int(text)


def _width(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0 (0: texts are never cut)")
    return n


def _add_globals(p: argparse.ArgumentParser, top: bool) -> None:
    """The options every command takes, before or after its name. After it they default to
    nothing (``SUPPRESS``), so one given before stays unless the command's own overrides it."""
    unset = None if top else argparse.SUPPRESS
    flag = False if top else argparse.SUPPRESS
    g = p.add_argument_group("global options (before or after the command)")
    g.add_argument("--db", default=unset, metavar="PATH", help="database folder (default: $TRELLIS_DB or ./trellis.db)")
    g.add_argument("--read-only", action="store_true", default=flag,
                   help="open the database read-only: writes, tags, view changes and exports are refused")
    g.add_argument("--export-root", default=unset, metavar="DIR",
                   help="folder that export paths are relative to, and confined to (default: <db>/exports)")
    g.add_argument("--quiet", "--no-progress", dest="quiet", action="store_true", default=flag,
                   help="no progress bars (they show only when stderr is a terminal)")


def _add_output(p: argparse.ArgumentParser) -> None:
    """The options of a command that prints rows."""
    p.add_argument("--format", choices=["table", "json", "csv"], default="table")
    p.add_argument("--width", type=_width, default=WIDTH, metavar="N",
                   help=f"table: cut texts at N characters (default {WIDTH}; 0: never cut them)")


_KINDS_HELP = """\
kinds, one row per (docs/views.md has the rules):
  sft         node with reward >= threshold (every selected node without a threshold);
              -o path=true: its root-to-node path; -o messages=NAME: chat turns stored in an artifact
  preference  (chosen, rejected) pair of siblings or comparisons; -o margin=0.1 -o group_by=prompt
              -o pairs_from='["siblings"]'
  grpo        group of at least min_size members; -o min_size=4 -o drop_zero_variance=true
  kto         node, label = reward >= threshold; -o threshold=... required
  stepwise    trajectory, root first; -o threshold=... required
  replay      sampled node; -o size=N required, -o strategy=bucket -o seed=1 -o entropy=CHANNEL

every kind: -o reward="reward('score')" (a TQL expression) -o where="status = 'done'" (a TQL
condition) -o prompt=NAME -o response=NAME -o system=NAME (the artifacts holding the texts)
-o via='["derived_from"]' -o keep_texts=false -o include_quarantined=true
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trellis", description="trellisdb: experience-graph database")
    p.add_argument("--version", action="version", version=f"trellis (trellisdb) {_version()}")
    _add_globals(p, top=True)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(parent: Any, name: str, **kw: Any) -> argparse.ArgumentParser:
        c: argparse.ArgumentParser = parent.add_parser(name, **kw)
        _add_globals(c, top=False)
        return c

    init = command(sub, "init", help="create a database")
    init.add_argument("--embedding-dim", type=int, default=None, help="embedding dimension (default 384)")
    _add_output(command(sub, "log", help="list the commits"))
    sql = command(sub, "sql", help="run one DuckDB SQL query over the tables")
    sql.add_argument("text", help="one statement (SELECT, WITH, EXPLAIN); several are refused")
    sql.add_argument("--as-of", default=None, help="commit id, tag or ISO timestamp")
    _add_output(sql)
    for name, what in (("query", "run a TQL query"), ("explain", "show a TQL query's plan, SQL and DuckDB plan")):
        q = command(sub, name, help=what)
        q.add_argument("text")
        q.add_argument(
            "--param", "-p", action="append", default=[], metavar="NAME=VALUE",
            help="bind $NAME; VALUE is read as JSON when it parses (5, 0.5, true, null, \"07\"), else as text",
        )
        if name == "query":
            _add_output(q)
    tag = command(sub, "tag", help="name a commit")
    tag.add_argument("name")
    tag.add_argument("--commit", type=int, default=None)
    tag.add_argument("--move", action="store_true", help="point an existing tag at this commit")
    untag = command(sub, "untag", help="remove a tag")
    untag.add_argument("name")
    compact = command(sub, "compact", help="compact the tables now")
    compact.add_argument(
        "--prune-now", action="store_true", help="also delete old physical versions at once (no other reader running)"
    )
    command(sub, "verify", help="read every file; report damage")
    command(sub, "repair", help="recover acknowledged commits a damaged commit log lost (copies go to lost+found/)")
    pg = command(sub, "purge", help="delete sessions' data from every stored version, irreversibly (needs --yes)")
    who = pg.add_mutually_exclusive_group(required=True)
    who.add_argument("--session", action="append", metavar="ID", help="a session to purge (repeatable)")
    who.add_argument("--task", default=None, help="purge every session of this task")
    pg.add_argument("--yes", action="store_true", help="confirm: what is purged cannot be recovered")
    _add_output(command(sub, "views", help="list the training-data views"))
    cv = command(sub, "create-view", help="declare a training-data view (kinds and options: trellis create-view -h)",
                 epilog=_KINDS_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    cv.add_argument("name")
    cv.add_argument("kind", help="sft | preference | grpo | kto | stepwise | replay (below)")
    cv.add_argument("--opt", "-o", action="append", default=[], metavar="NAME=VALUE",
                    help="a view option, e.g. -o \"reward=reward('score')\" -o threshold=0.9 (VALUE read as JSON "
                         "when it parses)")
    cv.add_argument("--replace", action="store_true", help="redefine an existing view")
    mat = command(sub, "materialize", help="compute a view and store its rows pinned to a commit")
    mat.add_argument("name")
    mat.add_argument("--as-of", default=None, help="commit id, tag or ISO timestamp (default: latest)")
    ref = command(sub, "refresh", help="bring a materialized view to the latest commit")
    ref.add_argument("name")
    ex = command(sub, "export", help="write a materialized view as a dataset (JSONL / Parquet + manifest)")
    ex.add_argument("name")
    ex.add_argument("path", help="folder to write, relative to the export root (--export-root, default <db>/exports)")
    ex.add_argument("--format", choices=["trl", "openai", "parquet"], default="trl")
    ex.add_argument("--validation", type=float, default=0.0,
                    help="share of tasks split off for validation (by task: a task's rows stay on one side)")
    ex.add_argument("--overwrite", action="store_true", help="replace the folder if an earlier export wrote it")
    ex.add_argument("--skip-missing", action="store_true", help="leave out rows whose texts are missing")
    emb = command(sub, "embed", help="compute the missing vectors of an embedding space with its embedder")
    emb.add_argument("space")
    emb.add_argument("--target", choices=["nodes", "tasks"], default="nodes",
                     help="what the space holds vectors of (default nodes; their summary / spec text)")
    emb.add_argument("--create", action="store_true",
                     help="create the space first when it does not exist, with the offline MiniLM embedder "
                          "(all-MiniLM-L6-v2, 384 dimensions)")
    imp = command(sub, "import", help="import a recorded run (OpenEvolve, SWE-agent, JSONL, OpenTelemetry)")
    imp.add_argument("format", help="openevolve | swe-agent | jsonl | otel")
    imp.add_argument("path", help="the run's folder or file, as its tool wrote it")
    imp.add_argument("--task", default=None, help="task id for the run (openevolve, swe-agent, otel; default: from the run)")
    imp.add_argument("--tag-prefix", default=None,
                     help="prefix of the tags an import writes (openevolve, jsonl; the other formats write no tags)")
    imp.add_argument("--session", default=None, help="session id for the run (openevolve; default from the run folder)")
    srv = command(sub, "serve", help="serve the database over HTTP (needs the server extra)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=7437, help="port (default 7437)")
    srv.add_argument("--token", default=os.environ.get("TRELLIS_TOKEN"),
                     help="one shared token, the default tenant's admin: 'Authorization: Bearer TOKEN' "
                          "(default $TRELLIS_TOKEN; per-tenant tokens: trellis token create)")
    srv.add_argument("--body-timeout", type=float, default=30.0, metavar="SECONDS",
                     help="seconds a request body may take to arrive (slower clients get 408; default 30)")
    srv.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT, metavar="SECONDS",
                     help="seconds a client has to send a request's headers, from connecting or from its first "
                          f"byte (then the connection is closed; default {HEADER_TIMEOUT:g})")
    srv.add_argument("--keep-alive", type=int, default=KEEP_ALIVE, metavar="SECONDS",
                     help=f"seconds an idle connection is kept after a response (default {KEEP_ALIVE})")
    srv.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                     help=f"connections open at once; past it a new one gets 503 (default {MAX_CONNECTIONS})")
    srv.add_argument("--allowed-host", action="append", default=None, metavar="NAME",
                     help="a name clients reach the server by, for MCP's DNS-rebinding check (repeatable)")
    srv.add_argument("--verify", default=None, metavar="MODULE:FUNCTION",
                     help="a verify-before-insert hook: called with each node an agent writes, it answers "
                          "accept, hold (stored quarantined) or reject (docs/server.md)")
    srv.add_argument("--query-timeout", type=_seconds, default=QUERY_TIMEOUT, metavar="SECONDS",
                     help=f"how long a TQL or SQL query may run before it is stopped (default {QUERY_TIMEOUT:g}; "
                          "0: no limit)")
    srv.add_argument("--memory-limit", type=_size, default=None, metavar="SIZE",
                     help="the most memory each tenant's query engine may use, its mirror and running queries "
                          "together, e.g. 4GiB (default: half the memory there is)")
    srv.add_argument("--tenant-reads", type=_count, default=TENANT_READS, metavar="N",
                     help=f"TQL and SQL queries running at once per tenant (default {TENANT_READS})")
    srv.add_argument("--token-reads", type=_count, default=None, metavar="N",
                     help="TQL and SQL queries one agent's or analyst's token may run at once (default: half "
                          "--tenant-reads, at least 1)")
    srv.add_argument("--max-reads", type=_count, default=MAX_READS, metavar="N",
                     help=f"TQL and SQL queries running at once in all (default {MAX_READS})")
    srv.add_argument("--read-wait", type=float, default=READ_WAIT, metavar="SECONDS",
                     help=f"how long a query waits for its turn before it is refused with 429/503 (default "
                          f"{READ_WAIT:g})")
    tok = command(sub, "token", help="make, list and revoke the tokens of a served store (tenants and roles)")
    tsub = tok.add_subparsers(dest="action", required=True)
    tc = command(tsub, "create", help="make a token; it is printed once and never stored")
    tc.add_argument("--tenant", default="default", help="the tenant it belongs to (default: default)")
    tc.add_argument("--role", required=True, choices=["agent", "analyst", "admin"])
    tc.add_argument("--name", default=None, help="a name for it (default: made up)")
    tc.add_argument("--expires", default=None, metavar="WHEN",
                    help="when it stops working: a duration (90s, 30m, 12h, 30d, 2w) or an ISO time with its zone "
                         "(default: never)")
    tl = command(tsub, "list", help="the tokens (names, tenants, roles, expiries; never the tokens)")
    tl.add_argument("--tenant", default=None)
    _add_output(tl)
    tr = command(tsub, "revoke", help="remove a token")
    tr.add_argument("name")
    command(sub, "mcp", help="serve the database to an agent over MCP on stdio (needs the server extra)")
    demo = command(sub, "demo", help="a simulation of cross-session reuse: cold vs warm kernel-tuning sessions, "
                   "measured, into a new database (trellisdb/demo/)")
    demo.add_argument("--seed", type=int, default=0, help="the agent's choices (default 0): the same seed, the same numbers")
    demo.add_argument("--tasks", type=int, default=8, help="simulated accelerators, one cold and one warm session each "
                      "(default 8)")
    demo.add_argument("--steps", type=int, default=100, help="the most kernels a session evaluates (default 100)")
    demo.add_argument("--target", type=float, default=0.95,
                      help="a session ends within this fraction of the best possible speedup (default 0.95)")
    demo.add_argument("--report", default=None, metavar="DIR",
                      help="where the report goes (default: beside the database, <name>-report)")
    demo.add_argument("--reset", action="store_true", help="remove an earlier demo's database first (only a demo's)")
    demo.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    demo.add_argument("--width", type=_width, default=WIDTH, metavar="N",
                      help=f"cut texts in its tables at N characters (default {WIDTH}; 0: never cut them)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    path = args.db or _default_db()
    try:
        return _run(args, path)
    except TrellisError as e:
        print(f"error: {in_cli_words(str(e), args.command)}", file=sys.stderr)
        return 1


def _note(text: str) -> None:
    """A sentence about the outcome for the person at the terminal (stderr: the rows stay clean)."""
    print(text, file=sys.stderr)


def _token(args: argparse.Namespace, path: str) -> int:
    """``trellis token``: the registry is a file of the served folder (the server rereads it)."""
    from trellisdb.tenants import Tokens

    if not os.path.isdir(path):
        raise TrellisError(f"{path} is not a database folder; serve it once (`trellis --db {path} serve`) or "
                           f"`trellis --db {path} init` first")
    reg = Tokens(path)
    if args.action == "create":
        secret = reg.create(args.tenant, args.role, name=args.name, expires=args.expires)
        who = reg.lookup(secret)
        assert who is not None
        until = "" if who.expires is None else f", until {who.expires.isoformat(timespec='seconds')}"
        print(f"token {who.name!r}: {who.role} of tenant {who.tenant!r}{until} (shown once; keep it):",
              file=sys.stderr)
        print(secret)
    elif args.action == "list":
        rows = reg.list(args.tenant)
        print(format_table(pa.Table.from_pylist(rows) if rows else pa.table({"name": pa.array([], pa.string())}),
                           args.format, args.width))
    else:
        gone = reg.revoke(args.name)
        print(f"revoked {gone['name']!r} ({gone['role']} of tenant {gone['tenant']!r})")
    return 0


def _open(args: argparse.Namespace, path: str) -> Any:
    """The database the command reads: it must exist (``trellis init`` makes one)."""
    from trellisdb.database import open_local as connect

    try:
        # one question per process: scanning Lance beats building the reader's mirror first; asked by
        # whoever runs it, in a process of its own: no time limit
        return connect(path, create=False, mirror=False, read_only=args.read_only, export_root=args.export_root,
                       query_timeout=None)
    except NotADatabaseError as e:
        if "; run `trellis init" not in str(e):
            raise  # a file, or a folder of something else: its own message says what to do
        how = f"trellis init --db {shlex.quote(path)}" if args.db else "trellis init"
        other = "" if args.db else " (or name another database with --db PATH or $TRELLIS_DB)"
        raise NotADatabaseError(f"{path} is not a trellisdb database; create it with `{how}`{other}") from None


def _empty_view(db: Any, name: str) -> str:
    """Why view ``name`` has no rows, in its definition's terms."""
    from trellisdb.training import ViewCatalog

    return str(ViewCatalog(db.path).load().spec(name).why_empty())


def _say_empty_splits(db: Any, name: str, m: dict[str, Any], validation: float) -> None:
    """Say on stderr why an export wrote no rows, or a split none."""
    from trellisdb.training import ViewCatalog

    if m["rows"] == 0:
        skipped = int(m.get("skipped_missing_texts") or 0)
        if skipped:
            spec = ViewCatalog(db.path).load().spec(name)
            texts = f"a {spec.messages!r} artifact" if spec.messages else \
                f"{spec.prompt!r} and {spec.response!r} artifacts"
            _note(f"export wrote 0 rows: all {skipped} rows of view {name!r} lack texts the {m['format']} layout "
                  f"needs, and --skip-missing left them out (its nodes have no {texts}: data with only summaries "
                  "has none)")
        else:
            _note(f"export wrote 0 rows: view {name!r} is empty at commit {m['commit']} ({_empty_view(db, name)})")
        return
    if not validation:
        return
    tasks = m.get("split", {}).get("tasks", {})
    total = sum(tasks.values())
    for split, n in m["counts"].items():
        if n == 0:
            _note(f"split {split!r} has 0 rows: the view holds {total} task{'s' if total != 1 else ''} and splits "
                  f"are by task (a task's rows all go to one side; sha256 of its id below --validation "
                  f"{validation} goes to validation); more tasks, or another fraction, fill both sides")


def _embed(args: argparse.Namespace, db: Any, progress: bool | None) -> None:
    """``trellis embed SPACE``: the space's embedder fills its missing vectors (``--create``: a
    MiniLM space made first, when there is none of that name)."""
    if args.create and not any(sp["name"] == args.space and sp["target"] == args.target for sp in db.spaces()):
        from trellisdb.embed import MiniLM

        sp = db.create_space(args.space, target=args.target, embedder=MiniLM())
        _note(f"created space {args.space!r} of {args.target} ({sp.get('model')}, {sp.get('dim')} dimensions)")
    n = db.embed(args.space, target=args.target, progress=progress)
    what = args.target if n != 1 else args.target[:-1]
    print(f"embedded {n} {what} into space {args.space!r}" + ("" if n else " (every one with text has its vector)"))


def _run(args: argparse.Namespace, path: str) -> int:
    from trellisdb.database import open_local as connect

    progress = False if args.quiet else None  # None: a bar when stderr is a terminal
    if args.read_only and args.command in ("init", "demo", "import", "serve", "mcp", "token", "embed"):
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
              export_root=args.export_root, body_timeout=args.body_timeout, verify=verify,
              header_timeout=args.header_timeout, keep_alive=args.keep_alive, max_connections=args.max_connections,
              query_timeout=args.query_timeout, memory_limit=args.memory_limit, tenant_reads=args.tenant_reads,
              max_reads=args.max_reads, read_wait=args.read_wait, token_reads=args.token_reads)
        return 0
    if args.command == "token":
        return _token(args, path)
    if args.command == "import":
        from trellisdb.importers import import_run

        with connect(path, mirror=False) as db:
            opts = {k: v for k, v in (("task", args.task), ("tag_prefix", args.tag_prefix),
                                      ("session", args.session)) if v is not None}
            report = import_run(db, args.format, args.path, progress=progress, **opts)
        print(report.summary())
        return 0
    if args.command == "demo":
        from trellisdb.demo.run import run_demo

        run_demo(path, seed=args.seed, tasks=args.tasks, max_steps=args.steps, target=args.target,
                 report=args.report, reset=args.reset, plots=not args.no_plots,
                 show=lambda t: format_table(t, "table", args.width))
        return 0
    db = _open(args, path)
    if args.command == "log":
        rows = db.log()
        t = pa.Table.from_pylist(rows) if rows else pa.table({"id": pa.array([], pa.int64())})
        print(format_table(t, args.format, args.width))
    elif args.command == "sql":
        print(format_table(db.sql(args.text, as_of=args.as_of).to_arrow(), args.format, args.width))
    elif args.command in ("query", "explain"):
        params = dict(_param(p) for p in args.param)
        text = args.text if args.command == "query" else f"EXPLAIN {args.text}"
        res = db.query(text, **params)
        if args.command == "explain":
            print(res.to_pylist()[0]["explain"])
        else:
            print(format_table(res.to_arrow(), args.format, args.width))
    elif args.command == "tag":
        cid = db.tag(args.name, args.commit, move=args.move)
        print(f"tagged commit {cid} as {args.name!r}")
    elif args.command == "untag":
        cid = db.untag(args.name)
        print(f"removed tag {args.name!r} (it named commit {cid})")
    elif args.command == "compact":
        import datetime as dt

        out = db.compact(dt.timedelta(0), progress=progress) if args.prune_now else db.compact(progress=progress)
        for name, m in out.items():
            print(f"{name}: {m['fragments_removed']} fragments -> {m['fragments_added']}")
    elif args.command == "views":
        vs = db.views()
        t = pa.Table.from_pylist(vs) if vs else pa.table({"name": pa.array([], pa.string())})
        print(format_table(t, args.format, args.width))
    elif args.command == "create-view":
        opts = dict(_opt(o) for o in args.opt)
        e = db.create_view(args.name, args.kind, replace=args.replace, **opts)
        print(f"view {args.name!r}: {e['definition']}")
    elif args.command in ("materialize", "refresh"):
        e = (db.materialize(args.name, as_of=args.as_of, progress=progress) if args.command == "materialize"
             else db.refresh(args.name, progress=progress))
        print(f"view {args.name!r}: {e['rows']} rows at commit {e['commit']} ({e.get('how', 'built')})")
        if e["rows"] == 0:
            _note(f"view {args.name!r} is empty at commit {e['commit']}: {_empty_view(db, args.name)}")
    elif args.command == "export":
        target = db.export_target(args.path)
        m = db.export(args.name, target, args.format, validation=args.validation, overwrite=args.overwrite,
                      skip_missing=args.skip_missing, progress=progress)
        print(f"wrote {m['rows']} rows ({', '.join(f'{k} {v}' for k, v in m['counts'].items())}) of view "
              f"{args.name!r} at commit {m['commit']} to {target} ({m['layout']})")
        _say_empty_splits(db, args.name, m, args.validation)
    elif args.command == "embed":
        _embed(args, db, progress)
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
