"""Where a database's views live, under its folder::

    views.json                  the catalog (``catalog.py``)
    views/<name>.lance          a materialized view's rows (``rows.py``)
    views/<name>.texts.lance    the texts they name (``texts.py``)
"""

from __future__ import annotations

import os
from typing import Final

VIEWS_DIR: Final = "views"
CATALOG: Final = "views.json"


def rows_file(name: str) -> str:
    """The rows of view ``name``, relative to the database folder (as the catalog names them)."""
    return os.path.join(VIEWS_DIR, f"{name}.lance")


def texts_file(name: str) -> str:
    """The text table of view ``name``, relative to the database folder."""
    return os.path.join(VIEWS_DIR, f"{name}.texts.lance")
