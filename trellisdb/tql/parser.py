"""TQL text -> parse tree -> AST, with errors that point at the mistake.

The grammar is ``grammar/trellis.lark``, shipped inside the wheel as
``trellisdb/grammar/trellis.lark`` and loaded from there (from the source
tree in a development checkout). The LALR parser is built once per process.

>>> parse("FRONTIER RANK BY reward('score') DESC LIMIT 3").statement.limit.value
3
>>> parse("NODES WHERE")
Traceback (most recent call last):
...
trellisdb.errors.QuerySyntaxError: line 1, column 12: the query ends too early; expected an expression
  NODES WHERE
             ^

A syntax error also carries its place as data: ``span`` (offsets into the text,
line, column) and ``query`` (the text), see :class:`~trellisdb.errors.QueryError`.
"""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Iterable
from importlib import resources

import lark
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from trellisdb.errors import QuerySyntaxError
from trellisdb.names import printable, surrogate_at
from trellisdb.tql.ast import Query, Span, ToAst

# ------------------------------------------------------------------ size limits
# A query is data from an agent or a user: these bound the work one text can ask
# of the parser, the later (recursive) stages and DuckDB, far above what real
# queries use. The text limit is checked first; the others on the parse tree,
# before it becomes an AST, each error pointing at the first item over its limit.
# Within them every stage is linear in the text: a query at the text limit
# prepares (parse, resolve, plan, compile) in about a second, most of it lark's
# parse; typical queries and the largest keys, lists and nesting in milliseconds
# to a few tenths of a second.

#: Characters in a query text. 100,000 leaves room for an IN list of ~2,500
#: quoted UUIDs; a longer text is data that belongs in a $parameter or a table.
MAX_QUERY_CHARS = 100_000
#: Operations nested inside one another in an expression: NOT, a minus sign, a
#: function call, a comparison, IN, BETWEEN, IS NULL, a parenthesized AND / OR
#: group, and each + - * / % of a chain (``a + b + c`` is ``(a + b) + c``). A flat
#: ``a AND b AND c ...`` counts one however long. The stages after the parser
#: walk expressions recursively: at 64 levels they use about 420 of Python's
#: 1,000 frames, leaving the rest to the caller; DuckDB allows 1,000 levels.
MAX_NESTING = 64
#: Keys of one ORDER BY or RANK BY (ties always break by commit and id after them).
MAX_SORT_KEYS = 32
#: Keys of one GROUP BY.
MAX_GROUP_KEYS = 32
#: Columns of one RETURN (a node has about 20; the rest are computed ones).
MAX_RETURN_COLUMNS = 128
#: Values in one IN (...) or NOT IN (...) list.
MAX_IN_ITEMS = 10_000
#: Arguments of one function call (the widest function, coalesce, takes 16).
MAX_FUNCTION_ARGS = 32
#: Steps of one EXPAND (there are four kinds of step).
MAX_EXPAND_STEPS = 16
#: Edge kinds one VIA names (there are six).
MAX_VIA_KINDS = 16
#: Options of one view's WITH, and items of one [list] among them.
MAX_VIEW_OPTIONS = 32
MAX_VIEW_LIST_ITEMS = 64

#: The longest text whose AST is cached (agents repeat short queries). Longer texts
#: are parsed each time: an AST takes ~90 bytes per character, so caching distinct
#: texts at the limit would let 1,024 of them hold gigabytes.
CACHED_QUERY_CHARS = 2_048

#: Parse-tree rules that are one level of expression nesting (see MAX_NESTING).
_NESTING = frozenset({"or_", "and_", "not_", "compare", "is_null", "is_not_null", "in_list", "not_in_list",
                      "between", "arith", "neg", "call", "call_star", "call_distinct"})

#: Rules that repeat: rule -> (limit, what has the items, what they are, what to do instead).
_REPEATS: dict[str, tuple[int, str, str, str]] = {
    "order": (MAX_SORT_KEYS, "ORDER BY", "keys", "sort by fewer keys (ties already break by commit and id)"),
    "rank": (MAX_SORT_KEYS, "RANK BY", "keys", "rank by fewer keys, or combine them into one expression"),
    "group_by": (MAX_GROUP_KEYS, "GROUP BY", "keys", "group by fewer keys, or combine them into one expression"),
    "returning": (MAX_RETURN_COLUMNS, "RETURN", "columns",
                  "return fewer columns (a query without RETURN returns every column)"),
    "in_list": (MAX_IN_ITEMS, "the IN list", "values",
                "split it (x IN (...) OR x IN (...)) or across queries, or select by a column the values share"),
    "not_in_list": (MAX_IN_ITEMS, "the NOT IN list", "values", "split it: x NOT IN (...) AND x NOT IN (...)"),
    "call": (MAX_FUNCTION_ARGS, "the function call", "arguments", "pass fewer arguments"),
    "expand": (MAX_EXPAND_STEPS, "EXPAND", "steps", "name each kind of step once"),
    "via": (MAX_VIA_KINDS, "VIA", "edge kinds", "name each edge kind once"),
    "view_with": (MAX_VIEW_OPTIONS, "WITH", "options", "set each option once"),
    "view_list": (MAX_VIEW_LIST_ITEMS, "the [list]", "items", "list fewer items"),
}


def grammar_text() -> str:
    packaged = resources.files("trellisdb").joinpath("grammar", "trellis.lark")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(here, "grammar", "trellis.lark"), encoding="utf-8") as fh:
        return fh.read()


@functools.cache
def parser() -> lark.Lark:
    return lark.Lark(grammar_text(), parser="lalr", propagate_positions=True, maybe_placeholders=True)


#: Mistakes people make, each with example texts that trigger it (lark ``match_examples``).
_HINTS: dict[str, list[str]] = {
    "string literals take single quotes: 'text' (double quotes are not used in TQL)": [
        'NODES WHERE status = "done"',
        'LINEAGE OF "n1" ANCESTORS',
    ],
    "TQL uses RETURN for the projection and starts with the entity: NODES WHERE ... RETURN id": [
        "SELECT id FROM nodes",
        "SELECT * FROM nodes",
    ],
    "LINEAGE needs a direction: LINEAGE OF 'id' ANCESTORS [n] or DESCENDANTS [n]": [
        "LINEAGE OF 'n1'",
        "LINEAGE OF 'n1' LIMIT 3",
    ],
    "rank the frontier with RANK BY expr (ORDER BY is for NODES/SESSIONS/TASKS/REWARDS)": [
        "FRONTIER ORDER BY reward('s')",
    ],
    "AS OF takes COMMIT n, TAG 'name', TIMESTAMP 'iso time' or STEP k OF SESSION 'id'": [
        "NODES AS OF 3",
        "NODES AS OF 'before'",
    ],
    "compare with a single '=' (not '=='), and join conditions with AND / OR": [
        "NODES WHERE step == 3",
        "NODES WHERE step = 3 && status = 'x'",
    ],
}

_NAMES = {
    "STRING": "a 'string'",
    "NUMBER": "a number",
    "PARAM": "a $parameter",
    "NAME": "a name",
    "LPAR": "'('",
    "RPAR": "')'",
    "COMMA": "','",
    "COMP_OP": "a comparison (= != < <= > >=)",
    "ADD_OP": "+ or -",
    "MUL_OP": "* / or %",
    "MINUS": "'-'",
    "AS_OF": "AS OF",
    "$END": "the end of the query",
}

_EXPR_START = {"STRING", "NUMBER", "PARAM", "NAME", "LPAR", "MINUS", "NOT", "TRUE", "FALSE", "NULL"}


_OPERATORS = {"COMP_OP": "= < > ...", "ADD_OP": "+ -", "MUL_OP": "* / %", "AND": "AND", "OR": "OR",
              "NOT": "NOT", "IN": "IN", "IS": "IS", "BETWEEN": "BETWEEN"}


def _expected(terms: set[str]) -> str:
    terms = {t for t in terms if not t.startswith("__")}
    names: list[str] = []
    if terms >= _EXPR_START or {"NAME", "NUMBER", "STRING"} <= terms:
        names.append("an expression")
        terms -= _EXPR_START
    ops = [label for t, label in _OPERATORS.items() if t in terms]
    if len(ops) >= 3:  # after an operand: one entry for the operators, not nine
        names.append(f"an operator ({', '.join(ops)})")
        terms -= set(_OPERATORS)
    names += sorted(_NAMES.get(t, t) for t in terms)
    if len(names) > 10:
        names = [*names[:10], "..."]
    return ", ".join(names) if names else "nothing more"


def _caret(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    line = text[start : end if end >= 0 else len(text)]
    col = len(printable(line[: pos - start]))  # a message holds only text: a lone surrogate shows escaped
    line = printable(line)
    if len(line) > 100:  # keep long lines readable: a window around the caret
        lo = max(0, col - 60)
        line, col = ("..." if lo else "") + line[lo : lo + 100], col - lo + (3 if lo else 0)
    return f"  {line}\n  {' ' * col}^"


def _position(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    col = pos - (text.rfind("\n", 0, pos) + 1) + 1
    return line, col


def parse(text: str) -> Query:
    """Parse a TQL query into its AST; raise :class:`QuerySyntaxError` on any mistake.

    ASTs are immutable, so the texts parsed last are cached (an agent asks the
    same question many times with different parameters).
    """
    if not isinstance(text, str):
        raise QuerySyntaxError(f"a TQL query must be a string, got {type(text).__name__}")
    if len(text) > MAX_QUERY_CHARS:
        raise QuerySyntaxError(
            f"the query is {len(text)} characters long, over the limit of {MAX_QUERY_CHARS}; pass long values "
            "as $parameters, or split it into several queries", query=text
        )
    at = surrogate_at(text)
    if at is not None:  # DuckDB, Arrow and every file take UTF-8 only: say so here, at its place
        line, col = _position(text, at)
        raise QuerySyntaxError(
            f"line {line}, column {col}: the query is not valid UTF-8 text: a lone surrogate U+{ord(text[at]):04X} "
            "(half of a UTF-16 surrogate pair), which no text can hold; write the character the pair stands for, "
            f"or leave it out\n{_caret(text, at)}", line, col, span=Span(at, at + 1, line, col), query=text)
    if len(text) > CACHED_QUERY_CHARS:
        return _parse.__wrapped__(text)
    return _parse(text)


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> Query:
    if not text.strip():
        raise QuerySyntaxError("the query is empty; try: NODES LIMIT 10", query=text)
    p = parser()
    try:
        tree = p.parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(text, e) from None
    except RecursionError:
        raise QuerySyntaxError("the query nests too deeply", query=text) from None
    check_limits(text, tree)
    try:
        q: Query = ToAst(text).transform(tree)
    except RecursionError:  # pragma: no cover - check_limits bounds the depth first
        raise QuerySyntaxError("the query nests too deeply", query=text) from None
    except lark.exceptions.VisitError as e:
        if isinstance(e.orig_exc, QuerySyntaxError):
            if e.orig_exc.query is None:
                e.orig_exc.query = text
            raise e.orig_exc from None
        if isinstance(e.orig_exc, RecursionError):  # pragma: no cover - as above
            raise QuerySyntaxError("the query nests too deeply", query=text) from None
        raise QuerySyntaxError(f"the query cannot be read: {e.orig_exc}", query=text) from None
    return q


def _limit_error(text: str, at: lark.Tree[lark.Token], what: str) -> QuerySyntaxError:
    pos = int(getattr(at.meta, "start_pos", 0) or 0)
    end = max(pos, int(getattr(at.meta, "end_pos", pos) or pos))
    line, col = _position(text, pos)
    return QuerySyntaxError(f"line {line}, column {col}: {what}\n{_caret(text, pos)}", line, col,
                            span=Span(pos, end, line, col), query=text)


def _items(tree: lark.Tree[lark.Token]) -> list[lark.Tree[lark.Token]]:
    """The repeated items of a rule in ``_REPEATS`` (not its operand, name or VIA)."""
    kids = [c for c in tree.children if isinstance(c, lark.Tree)]
    if tree.data in ("in_list", "not_in_list", "call"):
        return kids[1:]
    if tree.data == "expand":
        return [c for c in kids if c.data != "via"]
    return kids


def check_limits(text: str, tree: lark.Tree[lark.Token]) -> None:
    """Raise :class:`QuerySyntaxError` at the first place ``tree`` goes over a size limit.

    One walk with an explicit stack (no recursion, whatever the depth), left to right.

    >>> text = "NODES ORDER BY " + ", ".join(["step"] * 40)
    >>> try:
    ...     check_limits(text, parser().parse(text))
    ... except QuerySyntaxError as e:
    ...     print(str(e).splitlines()[0])
    line 1, column 208: ORDER BY has 40 keys, over the limit of 32; sort by fewer keys (ties already break by commit and id)
    """
    stack: list[tuple[lark.Tree[lark.Token], int]] = [(tree, 0)]
    while stack:
        node, level = stack.pop()
        rule = str(node.data)
        if rule in _NESTING:
            level += 1
            if level > MAX_NESTING:
                raise _limit_error(text, node, (
                    f"the query nests too deeply: more than {MAX_NESTING} operations inside one another here "
                    "(each NOT, minus sign, function call, comparison, parenthesized group, and each + - * / % "
                    "of a chain counts one; a flat a AND b AND c counts one). Write it flatter: a AND b AND c "
                    "needs no parentheses, NOT NOT x is x"))
        limit = _REPEATS.get(rule)
        if limit is not None:
            items = _items(node)
            most, owner, unit, instead = limit
            if len(items) > most:
                if rule == "call":
                    owner = f"{node.children[0].children[0]}()"  # type: ignore[union-attr]
                raise _limit_error(text, items[most], (
                    f"{owner} has {len(items)} {unit}, over the limit of {most}; {instead}"))
        stack.extend((c, level) for c in reversed(node.children) if isinstance(c, lark.Tree))


def _accepts(text: str, pos: int, fallback: Iterable[str]) -> set[str]:
    """The terminals that can really follow ``text[:pos]``.

    The sets lark puts on its exceptions are too broad: the contextual
    lexer's allowed set is the whole LALR state's, ')' and ',' included where
    no parenthesis is open. Re-parsing the prefix interactively and asking
    which terminals the parser accepts (after any reductions) is exact; it
    runs only on the error path."""
    try:
        ip = parser().parse_interactive(text[:pos])
        ip.exhaust_lexer()
        got = set(ip.accepts())  # type: ignore[no-untyped-call]
    except (UnexpectedInput, RecursionError):
        got = set()
    return got or set(fallback)


def _syntax_error(text: str, e: UnexpectedInput) -> QuerySyntaxError:
    # the span: the unexpected token or character; at the end of the text (empty) when it ends too early
    accepted: set[str] = set()
    if isinstance(e, UnexpectedEOF):
        pos = end = len(text.rstrip())
        what = f"the query ends too early; expected {_expected(_accepts(text, len(text), e.expected))}"
    elif isinstance(e, UnexpectedToken):
        pos = int(e.token.start_pos) if e.token.start_pos is not None else len(text)
        if e.token.type == "$END":
            pos = end = len(text.rstrip())
            what = f"the query ends too early; expected {_expected(_accepts(text, len(text), e.expected))}"
        else:
            end = int(e.token.end_pos) if e.token.end_pos is not None else pos + len(str(e.token))
            accepted = _accepts(text, pos, e.expected)
            what = f"unexpected {str(e.token)!r}; expected {_expected(accepted)}"
    elif isinstance(e, UnexpectedCharacters):
        pos = int(e.pos_in_stream or 0)
        end = min(pos + 1, len(text))
        ch = text[pos] if pos < len(text) else ""
        what = f"unexpected character {ch!r}"
        accepted = _accepts(text, pos, e.allowed or ())
        if accepted:
            what += f"; expected {_expected(accepted)}"
    else:  # pragma: no cover - lark has no other kind
        pos, end, what = 0, 0, str(e)
    line, col = _position(text, pos)
    msg = f"line {line}, column {col}: {what}\n{_caret(text, pos)}"
    hint = _did_you_mean(text, pos, accepted) or _hint(text, e)
    if hint:
        msg += f"\n  hint: {hint}"
    return QuerySyntaxError(msg, line, col, span=Span(pos, max(pos, end), line, col), query=text)


@functools.cache
def keywords() -> dict[str, str]:
    """The grammar's keywords: terminal name -> the word as written (``AS_OF`` -> ``AS OF``).

    >>> keywords()["FRONTIER"], keywords()["AS_OF"]
    ('FRONTIER', 'AS OF')
    """
    out: dict[str, str] = {}
    for t in parser().terminals:
        m = re.fullmatch(r"([a-z]+(?:\\s\+[a-z]+)*)\\b", t.pattern.value)
        if m and t.name.isupper():
            out[t.name] = re.sub(r"\\s\+", " ", m.group(1)).upper()
    return out


#: How alike a word and a keyword must be (``difflib``'s ratio) for "did you mean": FRONTEIR and
#: FRONTIER are 0.875, LIMT and LIMIT 0.89; SELECT and SESSION 0.62 are not.
_CLOSE = 0.75


def _did_you_mean(text: str, pos: int, accepted: set[str]) -> str | None:
    """``did you mean KEYWORD?`` when the word at ``pos`` is a misspelling of a keyword that
    may stand there (one of ``accepted``, the terminals the parser takes at ``pos``), with the
    query as it would then read."""
    m = re.compile(r"[A-Za-z_]+").match(text, pos)
    if m is None:
        return None
    word = m.group(0).upper()
    words = keywords()
    if word in words.values():
        return None  # a keyword in the wrong place, not a misspelt one
    candidates = sorted({words[t] for t in accepted if t in words and " " not in words[t]})
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=_CLOSE)
    if not close:
        return None
    fixed = f"{text[:m.start()]}{close[0]}{text[m.end():]}".strip()
    return f"did you mean {close[0]}?" + (f" as in: {fixed}" if len(fixed) <= 120 and "\n" not in fixed else "")


_CLAUSES = {"RETURN", "WHERE", "ORDER", "LIMIT", "RANK", "PER", "EXPANDED", "VIA", "FROM", "GROUP", "HAVING"}


def _hint(text: str, e: UnexpectedInput) -> str | None:
    """The hint whose example fails the same way: same error kind, parser
    state and offending token kind (lark's ``match_examples``, stricter)."""
    if isinstance(e, UnexpectedToken) and e.token.type in _CLAUSES and "$END" in e.expected:
        at = e.token.start_pos or 0
        found = list(re.finditer(r"\bas\s+of\b", text[:at], re.IGNORECASE))
        if found:
            m = found[-1]  # the last AS OF before the clause
            fixed = f"{text[: m.start()].rstrip()} {text[at:].strip()} {text[m.start() : at].strip()}"
            return f"AS OF comes last: put {e.token.type} ... before AS OF, as in: {fixed}"
        returns = list(re.finditer(r"\breturn\b", text[:at], re.IGNORECASE))
        if returns and e.token.type != "RETURN":
            r = returns[-1].start()  # the RETURN before the clause: it goes after the clauses, before any AS OF
            rest = text[at:]
            tail = list(re.finditer(r"\bas\s+of\b", rest, re.IGNORECASE))
            clauses, as_of = (rest[: tail[-1].start()], rest[tail[-1].start():]) if tail else (rest, "")
            fixed = " ".join(p for p in (text[:r].strip(), clauses.strip(), text[r:at].strip(), as_of.strip()) if p)
            return f"RETURN comes after the other clauses: put {e.token.type} ... before RETURN, as in: {fixed}"
    for label, examples in _HINTS.items():
        for ex in examples:
            try:
                parser().parse(ex)
            except UnexpectedInput as ue:
                if type(ue) is not type(e) or ue.state != e.state:
                    continue
                if isinstance(e, UnexpectedToken) and isinstance(ue, UnexpectedToken) and ue.token.type != e.token.type:
                    continue
                if isinstance(e, UnexpectedCharacters) and isinstance(ue, UnexpectedCharacters) and ue.char != e.char:
                    continue
                return label
    return None
