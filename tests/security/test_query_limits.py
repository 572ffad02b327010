"""Pathological TQL: long flat chains run, everything else too big is refused with a clear error.

A query is data from an agent or a user, so its size must not decide whether the
process survives: a flat ``a AND b AND ...`` of thousands of terms prepares in
well under a second, and deeper nesting, more keys, longer lists or a longer text
than the limits in ``trellisdb/tql/parser.py`` allow are a QuerySyntaxError that
names the limit and points at the place (line, column, caret), never a
RecursionError, a hang, or a DuckDB failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import trellisdb
from trellisdb.tql.compile import Compiled, compile_plan
from trellisdb.tql.parser import (
    MAX_EXPAND_STEPS,
    MAX_FUNCTION_ARGS,
    MAX_IN_ITEMS,
    MAX_NESTING,
    MAX_QUERY_CHARS,
    MAX_RETURN_COLUMNS,
    MAX_SORT_KEYS,
    MAX_VIA_KINDS,
    MAX_VIEW_LIST_ITEMS,
    MAX_VIEW_OPTIONS,
    parse,
)
from trellisdb.tql.plan import build
from trellisdb.tql.resolve import Catalog, resolve

CATALOG = Catalog(
    channels=lambda: {"score"},
    sessions=lambda: {"s1"},
    tasks=lambda: {"t"},
    tags={},
    commits={1: {"id": 1, "time": 1_700_000_000.0}},
    last_commit=1,
    step_commit=lambda s, k: 1,
)


def prepare(text: str) -> Compiled:
    """The pure stages: parse -> resolve -> plan -> compile (no store)."""
    return compile_plan(build(resolve(parse(text), CATALOG)))


def refusal(text: str, stage: Callable[[str], object] = prepare) -> trellisdb.QuerySyntaxError:
    with pytest.raises(trellisdb.QuerySyntaxError) as ei:
        stage(text)
    return ei.value


def assert_points_at(e: trellisdb.QuerySyntaxError, text: str, offset: int) -> None:
    """The error names the line and column of ``text[offset]`` and draws a caret under it."""
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    assert (e.line, e.column) == (line, column), str(e)
    assert str(e).startswith(f"line {line}, column {column}: "), str(e)
    assert any(ln.strip() == "^" for ln in str(e).splitlines()), str(e)


# ------------------------------------------------------------------ flat chains
@pytest.mark.parametrize("op", ["AND", "OR"])
def test_a_flat_chain_of_thousands_of_terms_prepares_quickly(op: str) -> None:
    terms = [f"step > {i}" for i in range(2000)]
    text = "NODES WHERE " + f" {op} ".join(terms)
    start = time.perf_counter()
    c = prepare(text)
    took = time.perf_counter() - start
    assert took < 2.0, f"2,000 {op} terms took {took:.2f}s (about 0.25s expected)"
    # one flat chain in the SQL, not 2,000 levels of parentheses
    assert c.sql.count(f" {op} ") == 1999
    assert "(" * 4 not in c.sql


def test_chains_longer_than_the_old_recursion_limit_mix_and_nest() -> None:
    text = "NODES WHERE " + " OR ".join(
        "(" + " AND ".join(f"step <> {i * 10 + j}" for j in range(10)) + ")" for i in range(300)
    )
    assert prepare(text).sql.count(" AND ") == 300 * 9


# ------------------------------------------------------------------ nesting depth
#: Ways to nest one more level: (wrap a number, wrap a condition).
NUMBER_LEVELS = ["-({})", "abs({})", "({}) + 1", "({}) * 2", "coalesce({}, 0)", "(({}))"]
CONDITION_LEVELS = ["NOT ({})", "({}) AND TRUE", "FALSE OR ({})", "({}) = TRUE", "({}) IS NOT NULL",
                    "({}) IN (TRUE)"]


def nested(numbers: list[str], conditions: list[str]) -> tuple[str, int]:
    """A WHERE condition nesting the given levels, and how many levels it nests."""
    e = "step"
    for w in numbers:
        e = w.format(e)
    e = f"({e}) > 0"
    for w in conditions:
        e = w.format(e)
    free = sum(w == "(({}))" for w in numbers)  # parentheses alone are no level
    return "NODES WHERE " + e, len(numbers) - free + 1 + len(conditions)


@pytest.mark.parametrize("level", NUMBER_LEVELS[:-1] + CONDITION_LEVELS)
def test_nesting_up_to_the_limit_compiles_and_one_more_is_refused_with_a_place(level: str) -> None:
    numeric = level in NUMBER_LEVELS
    for depth in (MAX_NESTING, MAX_NESTING + 1):
        n = depth - 1  # the comparison is one level
        text, levels = nested([level] * n, []) if numeric else nested([], [level] * n)
        assert levels == depth
        if depth <= MAX_NESTING:
            prepare(text)
        else:
            e = refusal(text)
            assert "nests too deeply" in str(e) and f"more than {MAX_NESTING}" in str(e)
            assert e.line == 1 and e.column > 1


#: Nesting shapes: (text before, one level opened, the innermost value, one level closed, text after).
SHAPES = [("NODES WHERE ", "NOT ", "TRUE", "", ""), ("NODES WHERE ", "abs(", "step", ")", " > 1"),
          ("NODES WHERE ", "(step = 1 OR ", "TRUE", ")", ""), ("NODES WHERE ", "step + ", "1", "", " > 1"),
          ("NODES WHERE ", "- ", "step", "", " > 1"), ("NODES RETURN ", "coalesce(", "1", ", 2)", "")]


@pytest.mark.parametrize("n", [MAX_NESTING + 1, 1000, MAX_QUERY_CHARS])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[1].strip() for s in SHAPES])
def test_any_nesting_up_to_the_text_limit_is_a_clean_error_with_a_place(
        shape: tuple[str, str, str, str, str], n: int) -> None:
    head, opened, inner, closed, tail = shape
    n = min(n, (MAX_QUERY_CHARS - len(head) - len(inner) - len(tail)) // (len(opened) + len(closed)))
    text = head + opened * n + inner + closed * n + tail
    e = refusal(text)
    assert "nests too deeply" in str(e)
    assert e.line == 1 and e.column > 1, str(e)


def test_a_long_arithmetic_chain_is_nesting_and_says_so_at_its_start() -> None:
    """``a + b + c`` is ``(a + b) + c``: arithmetic cannot be flattened, so it counts per operator."""
    ok = "NODES WHERE " + " + ".join(["step"] * MAX_NESTING) + " > 1"  # 63 additions + the comparison
    prepare(ok)
    text = "NODES WHERE step * 2 > " + " - ".join(["1"] * (MAX_NESTING + 1))
    assert_points_at(refusal(text), text, text.index("1 - "))


# ------------------------------------------------------------------ repeated items
def sort_keys(n: int) -> str:
    return "NODES ORDER BY " + ", ".join(["step DESC"] * n)


def rank_keys(n: int) -> str:
    return "FRONTIER RANK BY " + ", ".join(["reward('score')"] * n)


def return_columns(n: int) -> str:
    return "NODES RETURN " + ", ".join(f"step AS c{i}" for i in range(n))


def in_items(n: int) -> str:
    return "NODES WHERE step IN (" + ", ".join(str(i) for i in range(n)) + ")"


def not_in_items(n: int) -> str:
    return "NODES WHERE id NOT IN (" + ", ".join(f"'n{i}'" for i in range(n)) + ")"


def call_args(n: int) -> str:
    return "NODES WHERE greatest(" + ", ".join(["step"] * n) + ") > 1"


def expand_steps(n: int) -> str:
    return "RETRIEVE 5 SIMILAR TO 'x' EXPAND " + ", ".join(["ANCESTORS 1"] * n)


def via_kinds(n: int) -> str:
    return "LINEAGE OF 'n1' ANCESTORS VIA " + ", ".join(["derived_from"] * n)


def view_options(n: int) -> str:
    return "CREATE VIEW v AS preference WITH " + ", ".join(f"o{i} = 1" for i in range(n))


def view_list_items(n: int) -> str:
    return "CREATE VIEW v AS preference WITH pairs_from = [" + ", ".join(["'siblings'"] * n) + "]"


#: (query with n items, the limit, what the message calls the owner, runs through every pure stage at the limit)
REPEATS: dict[str, tuple[Callable[[int], str], int, str, bool]] = {
    "order_by": (sort_keys, MAX_SORT_KEYS, "ORDER BY has", True),
    "rank_by": (rank_keys, MAX_SORT_KEYS, "RANK BY has", True),
    "return": (return_columns, MAX_RETURN_COLUMNS, "RETURN has", True),
    "in": (in_items, MAX_IN_ITEMS, "the IN list has", True),
    "not_in": (not_in_items, MAX_IN_ITEMS, "the NOT IN list has", True),
    "call": (call_args, MAX_FUNCTION_ARGS, "greatest() has", False),  # greatest() itself takes 16
    "expand": (expand_steps, MAX_EXPAND_STEPS, "EXPAND has", True),
    "via": (via_kinds, MAX_VIA_KINDS, "VIA has", True),
    "view_with": (view_options, MAX_VIEW_OPTIONS, "WITH has", False),  # a view statement has no plan
    "view_list": (view_list_items, MAX_VIEW_LIST_ITEMS, "the [list] has", False),
}


@pytest.mark.parametrize("kind", list(REPEATS))
def test_the_most_items_allowed_work_and_one_more_is_refused_at_the_extra_item(kind: str) -> None:
    make, limit, owner, pure = REPEATS[kind]
    (prepare if pure else parse)(make(limit))
    text = make(limit + 1)
    e = refusal(text, parse)
    assert f"{owner} {limit + 1} " in str(e) and f"over the limit of {limit};" in str(e), str(e)
    # the caret is under the first item past the limit: after the limit-th ", " of the list
    at = text.index({"in": "(", "not_in": "(", "call": "(", "view_list": "["}.get(kind, owner.split()[0]))
    for _ in range(limit):
        at = text.index(", ", at + 1)
    assert_points_at(e, text, at + 2)


@pytest.mark.parametrize("make", [in_items, not_in_items])
def test_the_largest_in_list_prepares_quickly_and_one_value_more_is_refused_as_quickly(
        make: Callable[[int], str]) -> None:
    for n in (MAX_IN_ITEMS, MAX_IN_ITEMS + 1):
        start = time.perf_counter()
        if n > MAX_IN_ITEMS:
            refusal(make(n))
        else:
            prepare(make(n))
        took = time.perf_counter() - start
        assert took < 3.0, f"an IN list of {n} took {took:.2f}s (about 0.4s expected)"


def test_plans_built_by_hand_keep_the_key_limit() -> None:
    from trellisdb.tql import ast as A
    from trellisdb.tql import plan as P

    keys = (A.OrderItem(A.Column("step"), False),) * (MAX_SORT_KEYS + 1)
    with pytest.raises(P.PlanError, match=f"at most {MAX_SORT_KEYS} keys"):
        P.Sort(P.Scan("nodes", 1), keys)


def test_huge_queries_are_not_kept_in_the_caches() -> None:
    """Distinct texts near the limit would otherwise pin ~9 MB of AST each, 1,024 of them."""
    from trellisdb.tql import compile as C

    short = "NODES WHERE step > 1 AND step < 9"
    assert parse(short) is parse(short)  # agents repeat short queries: cached
    long = "NODES WHERE " + " AND ".join(f"step > {i}" for i in range(1000))
    assert parse(long) is not parse(long)
    before = C._compile_shape.cache_info().currsize
    prepare(long)
    assert C._compile_shape.cache_info().currsize == before


# ------------------------------------------------------------------ text length
def padded(length: int) -> str:
    text = "NODES WHERE step > 1 --"
    return text + "x" * (length - len(text))


def test_the_text_limit_is_exact_and_its_error_says_what_to_do() -> None:
    prepare(padded(MAX_QUERY_CHARS))
    e = refusal(padded(MAX_QUERY_CHARS + 1), parse)
    assert f"{MAX_QUERY_CHARS + 1} characters long, over the limit of {MAX_QUERY_CHARS}" in str(e)
    assert "$parameters" in str(e)


# ------------------------------------------------------------------ properties
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(st.data())
def test_nesting_of_any_kind_is_accepted_exactly_up_to_the_limit(data: st.DataObject) -> None:
    n, m = data.draw(st.integers(0, 300)), data.draw(st.integers(0, 300))
    numbers = data.draw(st.lists(st.sampled_from(NUMBER_LEVELS), min_size=n, max_size=n))
    conditions = data.draw(st.lists(st.sampled_from(CONDITION_LEVELS), min_size=m, max_size=m))
    text, levels = nested(numbers, conditions)
    if levels <= MAX_NESTING:
        prepare(text)
    else:
        e = refusal(text)
        assert "nests too deeply" in str(e) and e.line == 1, str(e)


TERMS = ["step > 1", "id = 'x'", "reward('score') < 0.5", "NOT status IN ('a', 'b')", "summary IS NULL",
         "step BETWEEN 1 AND 3", "(step = 2 OR step = 3)", "TRUE", "lower(id) <> 'n'"]


@settings(PROPERTY, max_examples=25)
@given(st.data())
def test_flat_chains_of_any_length_and_mix_prepare(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 3000))
    chain = data.draw(st.lists(st.tuples(st.sampled_from(["AND", "OR"]), st.sampled_from(TERMS)),
                               min_size=n, max_size=n))
    text = "NODES WHERE step > 0" + "".join(f" {op} {term}" for op, term in chain)
    assert prepare(text).sql


@PROPERTY
@given(st.sampled_from(list(REPEATS)), st.integers(-40, 40))
@example("in", 0)
@example("not_in", 1)
def test_repeated_items_are_accepted_exactly_up_to_their_limit(kind: str, delta: int) -> None:
    make, limit, _, _ = REPEATS[kind]
    n = max(1, limit + delta)
    if n <= limit:
        parse(make(n))
    else:
        assert f"over the limit of {limit}" in str(refusal(make(n), parse))


PIECES = ["(", ")", "NOT ", "-", " - ", "abs(", "step", " AND ", " OR ", " + ", "'", "''", ",", "1", " ", "\n",
          "--", "=", " IN (", "$p", "ORDER BY ", "reward('score')", "é", "\x00"]


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["NODES WHERE ", "NODES ORDER BY ", "FRONTIER RANK BY ", "NODES RETURN ", ""]),
       st.lists(st.sampled_from(PIECES), min_size=1, max_size=4), st.integers(-200, 200))
def test_long_texts_near_and_over_the_limit_only_ever_raise_trellis_errors(
        head: str, pattern: list[str], offset: int) -> None:
    unit = "".join(pattern)
    length = MAX_QUERY_CHARS + offset
    text = (head + unit * (length // len(unit) + 1))[:length]
    start = time.perf_counter()
    try:
        prepare(text)
    except trellisdb.TrellisError as e:
        if length > MAX_QUERY_CHARS:
            assert "over the limit" in str(e)
    took = time.perf_counter() - start
    assert took < 10.0, f"{took:.1f}s for {text[:60]!r}..."


# ------------------------------------------------------------------ through a real store
STEPS = 50


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[trellisdb.Database]:
    db = trellisdb.connect(Path(tmp_path_factory.mktemp("limits")) / "db", embedding_dim=4)
    s = db.session(task="t", agent="a", id="s1")
    with db.transaction():
        for i in range(STEPS):
            s.add_node(id=f"n{i}", parents=[f"n{i - 1}"] if i else [], step=i)
            s.add_reward(f"n{i}", "score", i / 100)
    yield db
    db.close()


def ids(result: trellisdb.QueryResult) -> list[str]:
    return [r["id"] for r in result.to_pylist()]


def test_a_500_term_and_chain_returns_the_right_rows(store: trellisdb.Database) -> None:
    terms = [f"step > {-i}" for i in range(1, 499)] + ["step >= 3", "step < 10"]
    assert len(terms) == 500
    got = store.query("NODES WHERE " + " AND ".join(terms) + " ORDER BY step RETURN id")
    assert ids(got) == [f"n{i}" for i in range(3, 10)]


def test_a_2000_term_or_chain_of_texts_returns_the_right_rows(store: trellisdb.Database) -> None:
    wanted = {7, 11, 42}
    terms = [f"id = 'n{i}'" if i in wanted else f"id = 'missing{i}'" for i in range(2000)]
    got = store.query("NODES WHERE " + " OR ".join(terms) + " ORDER BY step RETURN id")
    assert ids(got) == [f"n{i}" for i in sorted(wanted)]
    assert len(got.params) == 2000  # every text is a parameter, never SQL text


def test_the_most_sort_keys_work_and_one_more_is_a_clear_error(store: trellisdb.Database) -> None:
    keys = ["step % 2 DESC", "step % 3"] + ["reward('score') DESC"] * (MAX_SORT_KEYS - 2)
    got = store.query("NODES ORDER BY " + ", ".join(keys) + " RETURN id")
    expected = sorted(range(STEPS), key=lambda i: (-(i % 2), i % 3, -i))
    assert ids(got) == [f"n{i}" for i in expected]
    text = "NODES ORDER BY " + ", ".join([*keys, "step"]) + " RETURN id"
    with pytest.raises(trellisdb.QuerySyntaxError, match=f"ORDER BY has {MAX_SORT_KEYS + 1} keys, over the limit"):
        store.query(text)


def test_the_queries_of_the_report_are_refused_quickly_or_run(store: trellisdb.Database) -> None:
    """ORDER BY with 10,000 keys took about 6 s to prepare; 200 ANDs were "the query nests too deeply"."""
    start = time.perf_counter()
    with pytest.raises(trellisdb.QuerySyntaxError, match=f"ORDER BY has 10000 keys, over the limit of {MAX_SORT_KEYS}"):
        store.query("NODES ORDER BY " + ", ".join(["step"] * 10_000))
    assert time.perf_counter() - start < 2.0
    got = store.query("NODES WHERE " + " AND ".join(f"step > {i}" for i in range(200)) + " RETURN id")
    assert ids(got) == []  # step > 199 holds for none of the 50 nodes


def test_the_largest_in_list_runs_quickly_in_duckdb(store: trellisdb.Database) -> None:
    values = [i * 7 for i in range(MAX_IN_ITEMS)]  # multiples of 7: steps 0, 7, ..., 49
    start = time.perf_counter()
    got = store.query("NODES WHERE step IN (" + ", ".join(map(str, values)) + ") ORDER BY step RETURN id")
    took = time.perf_counter() - start
    assert ids(got) == [f"n{i}" for i in range(0, STEPS, 7)]
    assert took < 5.0, f"an IN list of {MAX_IN_ITEMS} took {took:.2f}s end to end"
    text = "NODES WHERE id NOT IN (" + ", ".join(f"'n{i}'" for i in range(MAX_IN_ITEMS)) + ")"
    assert ids(store.query(text)) == []
    with pytest.raises(trellisdb.QuerySyntaxError, match=f"over the limit of {MAX_IN_ITEMS}; split"):
        store.query(text.replace("IN (", "IN ('extra', "))


def test_nesting_at_the_limit_runs_in_duckdb_and_one_more_is_refused(store: trellisdb.Database) -> None:
    nots = MAX_NESTING - 1  # and the comparison: the limit exactly
    got = store.query("NODES WHERE " + "NOT " * nots + "step > 45 ORDER BY step RETURN id")
    assert ids(got) == ([f"n{i}" for i in range(46)] if nots % 2 else [f"n{i}" for i in range(46, STEPS)])
    adds = MAX_NESTING - 1  # additions, and the comparison
    got = store.query("NODES WHERE step" + " + 1" * adds + f" > {45 + adds} RETURN id")
    assert sorted(ids(got)) == sorted(f"n{i}" for i in range(46, STEPS))
    with pytest.raises(trellisdb.QuerySyntaxError, match="nests too deeply"):
        store.query("NODES WHERE " + "NOT " * (nots + 1) + "step > 45")
