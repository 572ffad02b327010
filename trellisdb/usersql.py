"""What raw SQL from a caller (``db.sql``, ``trellis sql``) may be: one read-only query over
the store's public relations.

The text is parsed by DuckDB's own parser, not matched with patterns:

- exactly one statement, a ``SELECT`` (``WITH``, ``FROM``-first, ``VALUES``,
  ``DESCRIBE``/``SUMMARIZE`` of a public relation) or an ``EXPLAIN [ANALYZE]`` of one;
- every relation it reads (found in DuckDB's serialized parse tree, at any depth:
  subqueries, CTEs, joins, set operations) is a public view (``nodes``,
  ``nodes_history``, ``nodes_full``, ..., ``commits``) or a CTE of the query
  itself in scope there, named without a catalog or schema; internal relations
  (``__mir_*``, ``__sup_*``, ``__lance_*``, ...) and system catalogs are out of reach;
- the only table functions are ``range``, ``generate_series`` and ``unnest``.

Behind this check the engine's DuckDB runs with external access disabled and its
configuration locked (``reader.DUCKDB_CONFIG``, ``SqlEngine``): no file, extension
or setting is reachable from SQL even if a form slipped past the parse.

    >>> check("SELECT count(*) FROM nodes WHERE step > $1", frozenset({"nodes"}))
    >>> check("DROP VIEW nodes", frozenset({"nodes"}))
    Traceback (most recent call last):
    ...
    trellisdb.errors.QueryError: db.sql runs one read-only query (SELECT, WITH ..., EXPLAIN); DROP statements are refused. Writes go through the write API (sessions, ingest)
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import duckdb

from trellisdb.errors import QueryError
from trellisdb.names import printable, utf8_problem, value_problem

#: The longest SQL text accepted (no hand-written query needs more).
MAX_SQL_CHARS = 1_000_000

#: Table functions a query may call: they make rows, they read nothing.
TABLE_FUNCTIONS = frozenset({"range", "generate_series", "unnest"})

_ALLOWED = {duckdb.StatementType.SELECT, duckdb.StatementType.EXPLAIN}

# The parser's connection: json_serialize_sql reads nothing but its argument.
_parser = duckdb.connect(config={"enable_external_access": False, "autoinstall_known_extensions": False,
                                 "autoload_known_extensions": False})
_parser_lock = threading.Lock()


#: Texts accepted lately (with their public set): an agent repeats its queries, and the parse
#: costs ~0.5 ms. Only short texts are kept.
_ACCEPTED: dict[tuple[str, frozenset[str]], None] = {}
_ACCEPTED_MAX, _ACCEPTED_CHARS = 1024, 4096


def check(text: object, public: frozenset[str]) -> None:
    """Raise ``QueryError`` unless ``text`` is one read-only query over ``public`` relations."""
    if isinstance(text, str) and (text, public) in _ACCEPTED:
        return
    _check(text, public)
    if isinstance(text, str) and len(text) <= _ACCEPTED_CHARS:
        with _parser_lock:
            if len(_ACCEPTED) >= _ACCEPTED_MAX:
                _ACCEPTED.pop(next(iter(_ACCEPTED)), None)  # the oldest
            _ACCEPTED[(text, public)] = None


def check_params(params: object) -> None:
    """Raise ``QueryError`` for a parameter value DuckDB cannot take: text that is not valid UTF-8
    (a lone surrogate, anywhere in a list or struct value), naming the parameter."""
    if isinstance(params, Mapping):
        items: list[tuple[str, object]] = [(f"${k}", v) for k, v in params.items()]
    elif isinstance(params, Sequence) and not isinstance(params, str | bytes | bytearray):
        items = [(f"${i}", v) for i, v in enumerate(params, 1)]
    else:
        return  # not parameters at all: DuckDB says so
    for name, v in items:
        problem = value_problem(v)
        if problem:
            raise QueryError(f"parameter {printable(name)} is not valid UTF-8 text ({problem}); pass text UTF-8 can hold")


def _check(text: object, public: frozenset[str]) -> None:
    if not isinstance(text, str):
        raise QueryError(f"SQL must be a string, got {type(text).__name__}")
    if len(text) > MAX_SQL_CHARS:
        raise QueryError(f"the SQL text is {len(text)} characters long; the limit is {MAX_SQL_CHARS}")
    problem = utf8_problem(text)
    if problem:
        raise QueryError(f"the SQL text is not valid UTF-8 ({problem})")
    try:
        statements = duckdb.extract_statements(text)
    except duckdb.Error as e:
        raise QueryError(f"SQL failed: {e}") from None
    if len(statements) != 1:
        raise QueryError(f"db.sql runs one statement per call; this text has {len(statements)}")
    st = statements[0]
    if st.type not in _ALLOWED:
        raise QueryError(
            f"db.sql runs one read-only query (SELECT, WITH ..., EXPLAIN); {st.type.name} statements are refused. "
            "Writes go through the write API (sessions, ingest)"
        )
    query = st.query
    if st.type == duckdb.StatementType.EXPLAIN:
        query = _explained(query)
    tree = _parse_tree(query)
    for name in _relations(tree, frozenset()):
        if name.lower() not in public:
            raise QueryError(
                f"relation {name!r} is not one of the store's tables; read {', '.join(sorted(_shown(public)))} "
                "(and <table>_history, nodes_full, tasks_full, artifacts_full)"
            )


def _shown(public: frozenset[str]) -> list[str]:
    return [p for p in public if not p.endswith(("_history", "_full"))]


def _explained(query: str) -> str:
    """The statement an ``EXPLAIN [ANALYZE]`` explains, which must itself be a query."""
    tokens = [pos for pos, _ in duckdb.tokenize(query)] + [len(query)]

    def word(i: int) -> str:
        return query[tokens[i]:tokens[i + 1]].strip().lower() if i + 1 < len(tokens) else ""

    skip = 2 if word(1) == "analyze" else 1
    inner = query[tokens[skip]:] if word(0) == "explain" and skip < len(tokens) else ""
    statements = duckdb.extract_statements(inner) if inner.strip() else []
    if len(statements) != 1 or statements[0].type != duckdb.StatementType.SELECT:
        raise QueryError("EXPLAIN explains one read-only query (EXPLAIN [ANALYZE] SELECT ...); options are not taken")
    return inner


def _parse_tree(query: str) -> Any:
    with _parser_lock:
        row = _parser.execute("SELECT json_serialize_sql($1)", [query]).fetchone()
    tree = json.loads(row[0]) if row else {"error": True, "error_message": "no parse"}
    if tree.get("error"):
        raise QueryError(f"SQL failed: {tree.get('error_message', 'it does not parse')}")
    return tree


def _relations(node: Any, scope: frozenset[str]) -> Iterator[str]:
    """The names of the relations ``node`` reads (raising for forms that read anything else),
    CTE references in scope left out."""
    if isinstance(node, list):
        for item in node:
            yield from _relations(item, scope)
        return
    if not isinstance(node, dict):
        return
    kind = node.get("type")
    ctes = (node.get("cte_map") or {}).get("map") or []
    if ctes:
        names = [str(c["key"]).lower() for c in ctes]
        for i, c in enumerate(ctes):
            body = c.get("value", {})
            own = {names[i]} if (body.get("query_node") or {}).get("type") == "RECURSIVE_CTE_NODE" else set()
            yield from _relations(body, scope | set(names[:i]) | own)
        scope = scope | set(names)
        node = {k: v for k, v in node.items() if k != "cte_map"}
    if kind == "BASE_TABLE":
        name = str(node.get("table_name", ""))
        if node.get("catalog_name") or node.get("schema_name"):
            raise QueryError(f"name tables without a catalog or schema: write {name!r} alone")
        if name.startswith("__") or name.lower() not in scope:
            yield name
        return
    if kind == "TABLE_FUNCTION":
        fn = str((node.get("function") or {}).get("function_name", ""))
        if fn.lower() not in TABLE_FUNCTIONS:
            raise QueryError(
                f"table function {fn}() is not available to db.sql (it may read files or internal state); "
                f"available: {', '.join(sorted(TABLE_FUNCTIONS))}"
            )
    if kind == "SHOW_REF":
        name = str(node.get("table_name") or "")
        if not name and not node.get("query"):
            raise QueryError("SHOW lists internal relations; the tables are nodes, edges, rewards, ... (see db.sql)")
        if name:
            yield name
    for value in node.values():
        if isinstance(value, dict | list):
            yield from _relations(value, scope)
