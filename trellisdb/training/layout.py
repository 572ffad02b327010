"""Pieces of the export layouts the kinds share: chat messages in polars, decoded text columns.

An export hands each kind (``ViewKind.layout``) a chunk of its rows with a text column per
hash column (``system``, ``prompt``, ``response`` ...: dictionaries over the view's texts,
``export.py``); the kind lays the chunk out as the trainer's format reads it.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa

#: The field metadata marking a text column to be written as the dictionary it is (``export._dictionaries``).
KEEP = b"trellis.dictionary"


def plain_schema(schema: pa.Schema, keep: bool = False) -> pa.Schema:
    """``schema`` with dictionary text columns as plain strings (``keep``: those marked ``KEEP``
    stay dictionaries)."""
    return pa.schema([f.with_type(f.type.value_type)
                      if pa.types.is_dictionary(f.type) and not (keep and f.metadata and KEEP in f.metadata) else f
                      for f in schema])


def plain(t: pa.Table, keep: bool = False) -> pa.Table:
    """``t`` with its dictionary-encoded text columns decoded (one chunk's texts copied)."""
    return t.cast(plain_schema(t.schema, keep))


def frame(t: pa.Table) -> pl.DataFrame:
    """``t`` as a polars frame, with a (null) ``system`` column if it has none."""
    df = pl.from_arrow(t)
    assert isinstance(df, pl.DataFrame)
    if "system" not in df.columns:
        df = df.with_columns(pl.lit(None, pl.String).alias("system"))
    return df


def msg(role: str, col: str) -> pl.Expr:
    """A chat message ``{role, content}`` with the text of column ``col``."""
    return pl.struct(role=pl.lit(role), content=pl.col(col))


def prompt_msgs() -> pl.Expr:
    """[system?, user]: the system prompt (when the row has one) and the prompt."""
    sys = pl.when(pl.col("system").is_not_null()).then(msg("system", "system"))
    return pl.concat_list([sys, msg("user", "prompt")]).list.drop_nulls()


def conversation(t: pa.Table) -> pl.DataFrame:
    """``messages``: [system?, user, assistant] (the prompt and the response)."""
    msgs = pl.concat_list([prompt_msgs(), pl.concat_list([msg("assistant", "response")])])
    return frame(t).select(msgs.alias("messages"))
