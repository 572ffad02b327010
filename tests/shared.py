"""Where the shared agent runs are: ``$TRELLIS_SHARED_DATA``, else ``shared/data`` beside the
checkout or beside any folder above it (``../shared/data`` for a checkout next to it)."""

from __future__ import annotations

import os
from pathlib import Path


def shared_data(name: str) -> Path:
    """The shared dataset ``name`` (e.g. ``openevolve-circle-packing``); the first candidate if none exists."""
    env = os.environ.get("TRELLIS_SHARED_DATA")
    roots = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    roots += [p / "shared" / "data" for p in (here, *here.parents)]
    for r in roots:
        if (r / name).is_dir():
            return r / name
    return roots[0] / name
