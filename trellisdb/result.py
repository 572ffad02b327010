"""Query results: a materialized Arrow table with DataFrame conveniences, that shows itself.

In a notebook a result is an HTML table (``_repr_html_``), in a terminal a small text table
(``repr``); both show the first rows only, cut long cells and say how much they left out.

>>> import pyarrow as pa
>>> r = Result(pa.table({"x": [1, 2], "note": ["a\\nb", None]}))
>>> r.to_pylist()
[{'x': 1, 'note': 'a\\nb'}, {'x': 2, 'note': None}]
>>> r
Result: 2 rows × 2 columns
    x  note
int64  string
-----  ------
    1  a\\nb
    2  null
"""

from __future__ import annotations

import html
import importlib
import json
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb.errors import MissingDependencyError

if TYPE_CHECKING:
    import polars as pl

#: How much of a result each display shows: rows, characters of a cell, columns (HTML) or
#: characters of a line (text; columns past it are named below the table).
HTML_ROWS = 20
HTML_CELL = 120
HTML_COLUMNS = 50
TEXT_ROWS = 10
TEXT_CELL = 32
TEXT_WIDTH = 100

# Control characters shown as escapes: a cell stays on one line, and an ANSI escape sequence in
# an agent's output cannot drive the terminal that prints the result.
_VISIBLE = {i: f"\\x{i:02x}" for i in (*range(32), 127)} | {9: "\\t", 10: "\\n", 13: "\\r"}


class Result:
    """The answer to a query, held as an Arrow table."""

    def __init__(self, table: pa.Table, sql: str | None = None) -> None:
        self._table = table
        self.sql = sql

    def to_arrow(self) -> pa.Table:
        return self._table

    def pl(self) -> pl.DataFrame:
        import polars as pl

        df = pl.from_arrow(self._table)
        assert isinstance(df, pl.DataFrame)
        return df

    def to_pandas(self) -> Any:
        """The rows as a pandas DataFrame. pandas is not a dependency of trellisdb: install it
        yourself (``pip install pandas``), or use ``.pl()`` (polars) or ``.to_arrow()``."""
        try:
            importlib.import_module("pandas")
        except ImportError as e:
            raise MissingDependencyError(
                "to_pandas() needs pandas, which trellisdb does not install: `pip install pandas`, "
                "or use .pl() for a polars DataFrame or .to_arrow() for the Arrow table"
            ) from e
        return self._table.to_pandas()

    def to_pylist(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self._table.to_pylist()
        return rows

    @property
    def columns(self) -> list[str]:
        return list(self._table.column_names)

    def __len__(self) -> int:
        return int(self._table.num_rows)

    # ------------------------------------------------------------ display
    def _about(self) -> list[str]:
        """What the caption says after the size (a subclass adds its metadata)."""
        return []

    def _caption(self) -> tuple[str, list[str]]:
        """The caption's first line (kind, size, ``_about``'s first item) and its further lines."""
        n, m = self._table.num_rows, self._table.num_columns
        about = self._about()
        head = f"{type(self).__name__}: {_count(n, 'row')} × {_count(m, 'column')}"
        return (f"{head}, {about[0]}" if about else head), about[1:]

    def __repr__(self) -> str:
        head, more = self._caption()
        return "\n".join([head, *more, *text_table(self._table, TEXT_ROWS, TEXT_CELL, TEXT_WIDTH)])

    def _repr_html_(self) -> str:
        head, more = self._caption()
        caption = "<br>".join(html.escape(line) for line in [head, *more])
        return html_table(self._table, caption, HTML_ROWS, HTML_CELL, HTML_COLUMNS)


def text_table(table: pa.Table, rows: int, cell: int, width: int) -> list[str]:
    """The lines of a plain table of ``table``'s first ``rows`` rows: names, types, a rule, the
    cells cut at ``cell`` characters; columns past ``width`` characters are named below it."""
    fields = list(table.schema)
    if not fields:
        return []
    shown = table.slice(0, rows).to_pylist()
    kept: list[tuple[str, bool, list[str]]] = []  # (name, right-aligned, [name, type, cells...])
    used = 0
    for f in fields:
        texts = [_cut(f.name.translate(_VISIBLE), cell), _cut(str(f.type), cell),
                 *(cell_text(r[f.name], cell) for r in shown)]
        w = max(map(len, texts))
        if kept and used + 2 + w > width:
            break
        used += (2 if kept else 0) + w
        kept.append((f.name, _numeric(f.type), texts))
    widths = [max(map(len, texts)) for _, _, texts in kept]
    grid = [[texts[0] for _, _, texts in kept], [texts[1] for _, _, texts in kept], ["-" * w for w in widths],
            *([texts[2 + j] for _, _, texts in kept] for j in range(len(shown)))]
    lines = ["  ".join(c.rjust(w) if right else c.ljust(w)
                       for c, w, (_, right, _) in zip(cells, widths, kept, strict=True)).rstrip() for cells in grid]
    if not shown:
        lines.append("(no rows)")
    elif table.num_rows > len(shown):
        lines.append(f"… {_count(table.num_rows - len(shown), 'more row')}")
    if len(kept) < len(fields):
        lines.append(_cut(_more_columns([f.name for f in fields[len(kept):]]), width))
    return lines


def html_table(table: pa.Table, caption: str, rows: int, cell: int, columns: int) -> str:
    """An HTML table of ``table``'s first ``rows`` rows and ``columns`` columns, cells cut at
    ``cell`` characters and escaped; ``caption`` is HTML already."""
    fields = list(table.schema)[:columns]
    shown = table.select([f.name for f in fields]).slice(0, rows).to_pylist() if fields else []
    left = ' style="text-align:left"'
    dim = '<span style="opacity:.55">{}</span>'
    out = ['<div class="trellisdb-result">', '<table class="dataframe">',
           f'<caption style="caption-side:top;text-align:left">{caption}</caption>']
    if fields:
        out.append("<thead><tr>" + "".join(
            f"<th{'' if _numeric(f.type) else left}>{_escape(f.name, cell)}<br>"
            f"<span style=\"font-weight:normal;opacity:.55\">{_escape(str(f.type), 60)}</span></th>"
            for f in fields) + "</tr></thead>")
    out.append("<tbody>")
    for r in shown:
        out.append("<tr>" + "".join(
            f"<td{'' if _numeric(f.type) else left}>"
            f"{dim.format('null') if r[f.name] is None else html.escape(cell_text(r[f.name], cell))}</td>"
            for f in fields) + "</tr>")
    notes = []
    if fields and not shown:
        notes.append("no rows")
    elif table.num_rows > len(shown):
        notes.append(f"… {_count(table.num_rows - len(shown), 'more row')}")
    if table.num_columns > len(fields):
        notes.append(html.escape(_more_columns(table.column_names[len(fields):])))
    span = max(len(fields), 1)
    out += [f'<tr><td colspan="{span}"{left}>{dim.format(note)}</td></tr>' for note in notes]
    out += ["</tbody>", "</table>", "</div>"]
    return "\n".join(out)


def cell_text(value: Any, limit: int) -> str:
    """A cell on one line, at most ``limit`` characters: null, true/false, numbers (floats to 7
    significant digits), text with control characters escaped, bytes by their size, and lists
    and structs written like JSON.

    >>> cell_text([1.0000001192092896, None, {"k": "v"}], 40)
    '[1, null, {"k": "v"}]'
    >>> cell_text("x" * 50, 10)
    'xxxxxxxxx…'
    >>> print(cell_text(b"PNG" + bytes(2000), 60))
    b'PNG\\x00\\x00\\x00\\x00\\x00…' (2,003 bytes)
    """
    return _cut(_render(value, limit, nested=False), limit)


def _render(v: Any, budget: int, nested: bool) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        r = repr(v)
        return r if len(r) <= 10 else format(v, ".7g")  # float32's noise: 0.10000000149011612 -> 0.1
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False) if nested else v.translate(_VISIBLE)
    if isinstance(v, bytes):
        return repr(v) if len(v) <= 8 else f"{repr(v[:8])[:-1]}…' ({len(v):,} bytes)"
    if isinstance(v, dict):
        return "{" + _join((f"{_render(str(k), budget, True)}: {_render(x, budget, True)}" for k, x in v.items()),
                           budget) + "}"
    if isinstance(v, list | tuple):
        return "[" + _join((_render(x, budget, True) for x in v), budget) + "]"
    return str(v).translate(_VISIBLE)


def _join(parts: Any, budget: int) -> str:
    """``", ".join(parts)``, stopping once past ``budget`` characters (a 384-d embedding in a
    cell costs what the display shows, not the whole list)."""
    out: list[str] = []
    size = 0
    for p in parts:
        if size > budget:
            out.append("…")
            break
        out.append(p)
        size += len(p) + 2
    return ", ".join(out)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def _escape(text: str, limit: int) -> str:
    return html.escape(_cut(text.translate(_VISIBLE), limit))


def _numeric(t: pa.DataType) -> bool:
    return bool(pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t))


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _more_columns(names: list[str]) -> str:
    listed = ", ".join(_cut(n.translate(_VISIBLE), 40) for n in names[:8])
    return f"… {_count(len(names), 'more column')}: {listed}{', …' if len(names) > 8 else ''}"
