"""Results show themselves: an HTML table in a notebook, a small text table in a terminal; both
bounded, escaped, and saying what they left out. ``to_pandas`` when pandas is there."""

from __future__ import annotations

import re
import sys
from html.parser import HTMLParser

import pyarrow as pa
import pytest

import trellisdb
from trellisdb.errors import MissingDependencyError
from trellisdb.result import (
    HTML_CELL,
    HTML_ROWS,
    TEXT_CELL,
    TEXT_ROWS,
    TEXT_WIDTH,
    Result,
)


class Cells(HTMLParser):
    """The text of every <caption>, <th> and <td>, as a browser would show it (entities decoded)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.cells: list[tuple[str, str]] = []
        self.text: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        if tag in ("caption", "th", "td"):
            self.text = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("caption", "th", "td") and self.text is not None:
            self.cells.append((tag, "".join(self.text)))
            self.text = None

    def handle_data(self, data: str) -> None:
        if self.text is not None:
            self.text.append(data)


def parsed(markup: str) -> Cells:
    p = Cells()
    p.feed(markup)
    p.close()
    return p


def tds(markup: str) -> list[str]:
    return [text for tag, text in parsed(markup).cells if tag == "td"]


def test_text_cells_are_escaped_in_html() -> None:
    r = Result(pa.table({"<b>name</b>": ["<script>alert('x')</script>", "a & b"]}))
    markup = r._repr_html_()
    assert "<script>" not in markup and "<b>name" not in markup
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in markup and "a &amp; b" in markup
    assert set(parsed(markup).tags) <= {"div", "table", "caption", "thead", "tbody", "tr", "th", "td", "br", "span"}
    assert tds(markup) == ["<script>alert('x')</script>", "a & b"]  # what the reader sees: the text itself


def test_header_has_names_and_types_and_caption_the_size() -> None:
    r = Result(pa.table({"id": ["a"], "score": pa.array([0.5], pa.float32()), "tags": [["x", "y"]]}))
    cells = parsed(r._repr_html_()).cells
    assert cells[0] == ("caption", "Result: 1 row × 3 columns")
    assert [text for tag, text in cells if tag == "th"] == ["idstring", "scorefloat", "tagslist<item: string>"]
    assert tds(r._repr_html_()) == ["a", "0.5", '["x", "y"]']


def test_rows_are_bounded() -> None:
    r = Result(pa.table({"n": list(range(1000)), "s": [f"row {i}" for i in range(1000)]}))
    cells = tds(r._repr_html_())
    assert cells[: 2 * HTML_ROWS] == [c for i in range(HTML_ROWS) for c in (str(i), f"row {i}")]
    assert cells[2 * HTML_ROWS:] == [f"… {1000 - HTML_ROWS} more rows"]
    lines = repr(r).splitlines()
    assert lines[0] == "Result: 1,000 rows × 2 columns"
    assert lines[4:-1] == [f"{i:>5}  row {i}" for i in range(TEXT_ROWS)]  # int64 is 5 wide
    assert lines[-1] == f"… {1000 - TEXT_ROWS} more rows"


def test_empty_result() -> None:
    r = Result(pa.table({"id": pa.array([], pa.string()), "n": pa.array([], pa.int64())}))
    assert tds(r._repr_html_()) == ["no rows"]
    assert repr(r).splitlines() == ["Result: 0 rows × 2 columns", "id          n", "string  int64",
                                    "------  -----", "(no rows)"]
    nothing = Result(pa.table({}))
    assert repr(nothing) == "Result: 0 rows × 0 columns"
    assert tds(nothing._repr_html_()) == [] and "0 rows × 0 columns" in nothing._repr_html_()


def test_nested_list_binary_and_null_cells() -> None:
    t = pa.table({
        "vec": pa.array([[0.1, 0.25], None], pa.list_(pa.float32())),
        "meta": pa.array([{"k": "v\n", "n": None}, None], pa.struct([("k", pa.string()), ("n", pa.int64())])),
        "blob": pa.array([b"\x89PNG" + bytes(100), b"ab"], pa.binary()),
        "flag": [True, None],
        "text": [None, "null"],
    })
    r = Result(t)
    html_cells = tds(r._repr_html_())
    assert html_cells == ['[0.1, 0.25]', '{"k": "v\\n", "n": null}', "b'\\x89PNG\\x00\\x00\\x00\\x00…' (104 bytes)",
                          "true", "null",
                          "null", "null", "b'ab'", "null", "null"]
    # a missing value is dimmed in HTML, so the text "null" and a null differ
    assert len(re.findall(r'<span style="opacity:.55">null</span>', r._repr_html_())) == 4
    assert repr(r).splitlines()[3:] == [
        "-----------------  ---------------------------  --------------------------------  ----  ------",
        """[0.1, 0.25]        {"k": "v\\n", "n": null}      b'\\x89PNG\\x00\\x00\\x00\\x00…' (10…  true  null""",
        "null               null                         b'ab'                             null  null",
    ]


def test_long_text_and_long_lists_are_cut() -> None:
    wide = "word " * 5000
    r = Result(pa.table({"code": [wide], "embedding": [[0.5] * 384]}))
    code, emb = tds(r._repr_html_())
    assert len(code) == HTML_CELL and code.endswith("…") and wide.startswith(code[:-1])
    assert len(emb) == HTML_CELL and emb.startswith("[0.5, 0.5") and emb.endswith("…")
    assert len(r._repr_html_()) < 2000
    row = repr(r).splitlines()[4]
    assert row.startswith(wide[: TEXT_CELL - 1] + "…")
    assert len(row) <= 2 * TEXT_CELL + 2


def test_control_characters_cannot_reach_the_terminal() -> None:
    r = Result(pa.table({"out": ["\x1b[2J\x1b[31mred\ttab\r\nnext"]}))
    text = repr(r)
    assert "\x1b" not in text and "\r" not in text and "\t" not in text
    assert text.splitlines()[4] == "\\x1b[2J\\x1b[31mred\\ttab\\r\\nnext"


def test_wide_tables_name_the_columns_left_out() -> None:
    r = Result(pa.table({f"column_{i:02d}": [i] for i in range(30)}))
    lines = repr(r).splitlines()
    assert all(len(line) <= TEXT_WIDTH for line in lines)
    shown = lines[1].split()
    assert shown == [f"column_{i:02d}" for i in range(len(shown))] and 3 <= len(shown) < 30
    assert lines[-1].startswith(f"… {30 - len(shown)} more columns: column_{len(shown):02d}, ")
    many = Result(pa.table({f"c{i}": [i] for i in range(80)}))
    assert tds(many._repr_html_())[-1].startswith("… 30 more columns: c50, c51")


def test_query_result_caption_names_the_commit(db: trellisdb.Database) -> None:
    with db.session(task="t", agent="a") as s:
        root = s.add_node(summary="<root>", embedding=[1, 0, 0, 0])
        s.add_reward(root, "score", 0.5)
    first = db.tag("early")
    with db.session(task="t", agent="a") as s:
        s.add_node(parents=[root], summary="child", embedding=[0, 1, 0, 0])
    now = db.query("NODES RETURN id, summary")
    assert repr(now).splitlines()[0] == f"QueryResult: 2 rows × 2 columns, as of commit {now.snapshot}"
    then = db.query("NODES RETURN id, summary AS OF TAG 'early'")
    head = f"QueryResult: 1 row × 2 columns, as of commit {first} (tag 'early'; the latest is {now.snapshot})"
    assert repr(then).splitlines()[0] == head
    assert parsed(then._repr_html_()).cells[0] == ("caption", head)
    assert "&lt;root&gt;" in then._repr_html_()
    found = db.query("RETRIEVE 1 SIMILAR TO $v RETURN id", v=[1, 0, 0, 0])
    assert repr(found).splitlines()[1].startswith("vector: ")
    explained = db.query("EXPLAIN NODES LIMIT 2")
    assert "-- logical plan" in repr(explained) and "-- DuckDB plan" in repr(explained)
    assert "<pre>" in explained._repr_html_() and "-- SQL (DuckDB)" in explained._repr_html_()
    views = db.query("SHOW VIEWS")
    assert repr(views).splitlines()[-1] == "(no rows)"


def test_to_pandas_without_pandas_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # `import pandas` raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install pandas") as e:
        Result(pa.table({"x": [1]})).to_pandas()
    assert isinstance(e.value, trellisdb.TrellisError) and isinstance(e.value, ImportError)


def test_to_pandas() -> None:
    pd = pytest.importorskip("pandas")
    df = Result(pa.table({"x": [1, 2], "s": ["a", None]})).to_pandas()
    assert isinstance(df, pd.DataFrame)
    assert df["x"].tolist() == [1, 2] and list(df.columns) == ["x", "s"]
