"""How the `trellis` command shows rows: an aligned table, CSV, or JSON lines.

The one module of the command that turns a result into text, for the command and for
`trellis demo` alike. polars lays out the table and writes the CSV, under explicit settings
(`pl.Config`), so what prints does not depend on the terminal or on POLARS_FMT_* variables.
A table cuts texts at `width` characters (`--width`; 0: never) and says so below it when it
did; CSV lines end in a line feed alone (LF, as JSON lines do), never CRLF.

>>> print(format_table(pa.table({"id": ["n1"], "summary": ["a" * 70]}), "table", width=8))
| id | summary     |
|----|-------------|
| n1 | aaaaaaaa... |
(1 row; texts longer than 8 characters are cut: --width N to widen, --width 0 for whole texts)
"""

from __future__ import annotations

import json
from typing import Any, Literal

import polars as pl
import pyarrow as pa

Format = Literal["table", "json", "csv"]

#: how a table looks: a header, a rule, one line per row (more where a text has line breaks),
#: every row and column, texts cut at 60 characters (``WIDTH``; ``format_table``'s ``width``
#: overrides it), never wrapped to a terminal's width
TABLE_CONFIG: dict[str, Any] = {
    "tbl_formatting": "ASCII_MARKDOWN",
    "tbl_hide_column_data_types": True,
    "tbl_hide_dataframe_shape": True,  # the row count goes below the table instead
    "tbl_cell_alignment": "LEFT",
    "tbl_rows": -1,
    "tbl_cols": -1,
    "tbl_width_chars": 65_535,  # the most polars takes
    "fmt_str_lengths": 60,
    "fmt_float": "mixed",
}

#: the column types a polars table cell and a CSV field show as they are; others become text
_NATIVE = (pl.Boolean, pl.String, pl.Categorical, pl.Enum, pl.Date, pl.Datetime, pl.Time, pl.Null)


#: The characters of a text a table cell shows by default (``--width``).
WIDTH = 60


def format_table(t: pa.Table, fmt: Format, width: int = WIDTH) -> str:
    """`t` as text: `table` (aligned, with a row count; texts cut at `width` characters, 0: never),
    `csv` (with a header; lines end in LF) or `json` (one object a line)."""
    df = to_frame(t)
    if fmt == "json":
        # json.dumps, not polars: the same spacing as before, and bytes / decimals / times as text
        return "\n".join(json.dumps(r, default=str) for r in df.iter_rows(named=True))
    if fmt == "csv":
        # LF, not the CRLF of Python's csv module and RFC 4180: polars' default, pinned
        return _plain(df).write_csv(line_terminator="\n").rstrip("\n")
    if fmt != "table":
        raise ValueError(f"unknown format {fmt!r}: table, json or csv")
    if isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be a whole number >= 0 (0: texts are never cut), not {width!r}")
    n = df.height
    count = f"({n} row{'s' if n != 1 else ''})"
    if df.width == 0:
        return count
    plain = _plain(df)
    longest = _longest_text(plain)
    if width and longest > width:
        count = (f"{count[:-1]}; texts longer than {width} characters are cut: --width N to widen, "
                 "--width 0 for whole texts)")
    with pl.Config(restore_defaults=True, **{**TABLE_CONFIG, "fmt_str_lengths": width or max(longest, 1)}):
        return f"{plain}\n{count}"


def _longest_text(df: pl.DataFrame) -> int:
    """The characters of the longest text cell of ``df`` (0: none)."""
    most = 0
    for s in df.get_columns():
        if isinstance(s.dtype, pl.String | pl.Categorical | pl.Enum) and s.len() > s.null_count():
            most = max(most, int(s.cast(pl.String).str.len_chars().max()))  # type: ignore[arg-type]
    return most


def to_frame(t: pa.Table) -> pl.DataFrame:
    """`t` as a polars frame: repeated column names numbered (`a`, `a_1`), and a column polars cannot
    hold (intervals, unions) as the text of its values."""
    columns = []
    for name, col in zip(_unique(t.column_names), t.columns, strict=True):
        try:
            s = pl.Series(name, col)
        except (pl.exceptions.PolarsError, TypeError, ValueError, NotImplementedError):
            s = pl.Series(name, [None if v is None else str(v) for v in col.to_pylist()], dtype=pl.String)
        columns.append(s)
    return pl.DataFrame(columns)


def _unique(names: list[str]) -> list[str]:
    seen: set[str] = set(names)
    out: list[str] = []
    for name in names:
        if name in out:
            i = 1
            while f"{name}_{i}" in seen:
                i += 1
            name = f"{name}_{i}"
            seen.add(name)
        out.append(name)
    return out


def _plain(df: pl.DataFrame) -> pl.DataFrame:
    """Binary values as `<N bytes>`, nested ones (lists, structs, maps) as JSON text, and any other
    type a CSV field cannot hold (durations) as Python writes it: what a table cell or a CSV field shows."""
    out = []
    for s in df.get_columns():
        if s.dtype.is_numeric() or isinstance(s.dtype, _NATIVE):
            out.append(s)
        elif isinstance(s.dtype, pl.Binary):
            size = pl.col(s.name).bin.size()
            out.append(s.to_frame().select(pl.format("<{} bytes>", size).alias(s.name)).to_series())
        else:
            out.append(pl.Series(s.name, [None if v is None else _text(v) for v in s.to_list()], dtype=pl.String))
    return pl.DataFrame(out)


def _text(v: Any) -> str:
    if isinstance(v, list | tuple | dict):
        return json.dumps(v, default=_text, ensure_ascii=False)
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    return str(v)
