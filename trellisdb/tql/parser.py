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
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterable
from importlib import resources

import lark
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from trellisdb.errors import QuerySyntaxError
from trellisdb.tql.ast import Query, ToAst

#: Texts longer than this are refused before parsing (no query needs more).
MAX_QUERY_CHARS = 100_000


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
    col = pos - start
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
        raise QuerySyntaxError(f"the query is {len(text)} characters long; the limit is {MAX_QUERY_CHARS}")
    return _parse(text)


@functools.lru_cache(maxsize=1024)
def _parse(text: str) -> Query:
    if not text.strip():
        raise QuerySyntaxError("the query is empty; try: NODES LIMIT 10")
    p = parser()
    try:
        tree = p.parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(text, e) from None
    except RecursionError:
        raise QuerySyntaxError("the query nests too deeply") from None
    try:
        q: Query = ToAst(text).transform(tree)
    except RecursionError:
        raise QuerySyntaxError("the query nests too deeply") from None
    except lark.exceptions.VisitError as e:
        raise QuerySyntaxError(f"the query cannot be read: {e.orig_exc}") from None
    return q


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
    if isinstance(e, UnexpectedEOF):
        pos = len(text.rstrip())
        what = f"the query ends too early; expected {_expected(_accepts(text, len(text), e.expected))}"
    elif isinstance(e, UnexpectedToken):
        pos = int(e.token.start_pos) if e.token.start_pos is not None else len(text)
        if e.token.type == "$END":
            pos = len(text.rstrip())
            what = f"the query ends too early; expected {_expected(_accepts(text, len(text), e.expected))}"
        else:
            what = f"unexpected {str(e.token)!r}; expected {_expected(_accepts(text, pos, e.expected))}"
    elif isinstance(e, UnexpectedCharacters):
        pos = int(e.pos_in_stream or 0)
        ch = text[pos] if pos < len(text) else ""
        what = f"unexpected character {ch!r}"
        allowed = _accepts(text, pos, e.allowed or ())
        if allowed:
            what += f"; expected {_expected(allowed)}"
    else:  # pragma: no cover - lark has no other kind
        pos, what = 0, str(e)
    line, col = _position(text, pos)
    msg = f"line {line}, column {col}: {what}\n{_caret(text, pos)}"
    hint = _hint(text, e)
    if hint:
        msg += f"\n  hint: {hint}"
    return QuerySyntaxError(msg, line, col)


_CLAUSES = {"RETURN", "WHERE", "ORDER", "LIMIT", "RANK", "PER", "EXPANDED", "VIA", "FROM"}


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
