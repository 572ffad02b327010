"""Query results: a materialized Arrow table with DataFrame conveniences.

>>> import pyarrow as pa
>>> r = Result(pa.table({"x": [1, 2]}))
>>> r.to_pylist()
[{'x': 1}, {'x': 2}]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pyarrow as pa

if TYPE_CHECKING:
    import polars as pl


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

    def to_pylist(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = self._table.to_pylist()
        return rows

    @property
    def columns(self) -> list[str]:
        return list(self._table.column_names)

    def __len__(self) -> int:
        return int(self._table.num_rows)

    def __repr__(self) -> str:
        return f"Result({self._table.num_rows} rows: {', '.join(self.columns)})"
