"""Embedding spaces, vector and keyword search, and the ANN index behind them.

- ``trellisdb/storage/spaces.py``: a space as stored (its record, table schema, ``spaces.json``);
- ``search.py``: exact / IVF_SQ cosine search with prefilters, BM25 search, rank fusion;
- ``index.py``: the background index maintainer;
- ``service.py``: ``Vectors``, the one object per open database that retrieval, ``db.embed``
  and ``db.add_vectors`` call;
- embedders are ``trellisdb/embed.py`` (the ``Embedder`` protocol and MiniLM).
"""

from trellisdb.storage.spaces import (
    BUILTIN,
    TARGETS,
    TEXT_COLUMN,
    Space,
    SpaceRegistry,
    as_matrix,
    check_space_name,
    space_schema,
    vector_column,
)
from trellisdb.vectors.index import INDEX_MIN_ROWS, RETRAIN_GROWTH, UPDATE_FRACTION, UPDATE_MIN_ROWS, IndexMaintainer
from trellisdb.vectors.search import (
    EXACT_CANDIDATES,
    REFINE_FACTOR,
    RRF_K,
    SearchStats,
    keyword_search,
    nprobes_for,
    partitions_for,
    rrf,
    text_index,
    vector_index,
    visibility,
)

__all__ = [
    "BUILTIN", "EXACT_CANDIDATES", "INDEX_MIN_ROWS", "REFINE_FACTOR", "RETRAIN_GROWTH", "RRF_K", "TARGETS",
    "TEXT_COLUMN", "UPDATE_FRACTION", "UPDATE_MIN_ROWS", "IndexMaintainer", "SearchStats", "Space", "SpaceRegistry",
    "as_matrix", "check_space_name", "keyword_search", "nprobes_for", "partitions_for", "rrf",
    "space_schema", "text_index", "vector_column", "vector_index", "visibility",
]
