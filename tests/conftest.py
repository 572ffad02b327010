"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import trellisdb


@pytest.fixture
def db(tmp_path: Path) -> Iterator[trellisdb.Database]:
    """A fresh database with 4-dimensional embeddings, closed after the test."""
    database = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    try:
        yield database
    finally:
        database.close()
