"""Generated ids: time-ordered, unique across processes.

>>> a, b = new_id(), new_id()
>>> len(a) == 24 and a != b
True
"""

from __future__ import annotations

import secrets
import time


def new_id() -> str:
    """A 24-hex-char id: 48 bits of milliseconds, then 48 random bits."""
    return f"{time.time_ns() // 1_000_000:012x}{secrets.token_hex(6)}"
