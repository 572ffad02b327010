"""Checksummed JSON record lines and durable folder entries: shared by the commit log
(``log.py``) and the write-ahead log's frame headers (``wal.py``).

A line is ``<json>\\t<crc32 hex>\\n`` (keys sorted, compact separators).

    >>> decode_line(encode_line({"op": "begin", "id": 3}))
    {'id': 3, 'op': 'begin'}
    >>> decode_line(encode_line({"op": "begin", "id": 3}).replace(b"3", b"4")) is None
    True
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any


def encode_line(record: dict[str, Any]) -> bytes:
    body = json.dumps(record, separators=(",", ":"), sort_keys=True)
    return f"{body}\t{zlib.crc32(body.encode()) & 0xFFFFFFFF:08x}\n".encode()


def decode_line(line: bytes) -> dict[str, Any] | None:
    """The record of one complete line, or None when the line is damaged."""
    try:
        body, crc = line.rstrip(b"\n").rsplit(b"\t", 1)
        if int(crc, 16) != zlib.crc32(body) & 0xFFFFFFFF:
            return None
        rec = json.loads(body)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def sync_dir(path: str) -> None:
    """Make a file created or renamed in folder ``path`` durable."""
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
