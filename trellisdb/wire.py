"""Values on the wire between ``trellisdb.connect("http://...")`` and ``trellis serve``.

JSON carries None, booleans, numbers, text, lists and objects; the embedded API also takes and
returns bytes (artifact contents), datetimes (event times, commit times) and Arrow tables
(``ingest``). Those travel as one-key objects: ``{"$bytes": base64}``, ``{"$time": ISO 8601}``,
``{"$arrow": base64 of an Arrow IPC stream}``. An object of the caller's own with one key starting
``$`` is wrapped as ``{"$dict": {...}}``, so no value of the caller's is ever read as a tag.
Numbers JSON cannot carry (NaN, infinities) are refused before anything is sent.

>>> import datetime as dt
>>> v = {"at": dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc), "code": b"\\x00\\x01", "$x": 1}
>>> encode(v)
{'at': {'$time': '2026-01-02T00:00:00+00:00'}, 'code': {'$bytes': 'AAE='}, '$x': 1}
>>> decode(encode(v)) == v
True
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import io
import math
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from trellisdb.errors import ValidationError

#: How deep a value may nest (a step's attributes are a few levels; a JSON bomb is refused).
MAX_DEPTH = 64


def encode(value: Any, _depth: int = 0) -> Any:
    """``value`` as JSON-ready data (see the module notes); ``ValidationError`` for what JSON
    cannot carry."""
    if _depth > MAX_DEPTH:
        raise ValidationError(f"a value nests deeper than {MAX_DEPTH} levels")
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValidationError(f"{value} cannot be sent: JSON carries only finite numbers")
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, dt.datetime):
        return {"$time": value.isoformat()}
    if isinstance(value, pa.Table):
        sink = io.BytesIO()
        with pa.ipc.new_stream(sink, value.schema) as w:
            w.write_table(value)
        return {"$arrow": base64.b64encode(sink.getvalue()).decode()}
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValidationError(f"mapping keys must be text to be sent, got {type(k).__name__} {k!r}")
            out[k] = encode(v, _depth + 1)
        return {"$dict": out} if len(out) == 1 and next(iter(out)).startswith("$") else out
    if isinstance(value, list | tuple):
        return [encode(v, _depth + 1) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        return encode(tolist(), _depth + 1)
    raise ValidationError(f"a {type(value).__name__} cannot be sent; send numbers, text, bytes, datetimes, "
                          "lists and mappings")


def decode(value: Any, _depth: int = 0) -> Any:
    """The value :func:`encode` was given (``ValidationError`` for a malformed tag)."""
    if _depth > MAX_DEPTH:
        raise ValidationError(f"a value nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, list):
        return [decode(v, _depth + 1) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((k, v),) = value.items()
        if k == "$dict":
            if not isinstance(v, dict):
                raise ValidationError("a '$dict' value must be an object")
            return {key: decode(x, _depth + 1) for key, x in v.items()}
        if k in ("$bytes", "$arrow"):
            if not isinstance(v, str):
                raise ValidationError(f"a {k!r} value must be base64 text")
            try:
                raw = base64.b64decode(v, validate=True)
            except (binascii.Error, ValueError):
                raise ValidationError(f"a {k!r} value is not valid base64") from None
            if k == "$bytes":
                return raw
            try:
                return pa.ipc.open_stream(raw).read_all()
            except (pa.ArrowInvalid, OSError) as e:
                raise ValidationError(f"an '$arrow' value is not an Arrow IPC stream: {e}") from None
        if k == "$time":
            if not isinstance(v, str):
                raise ValidationError("a '$time' value must be ISO 8601 text")
            try:
                return dt.datetime.fromisoformat(v)
            except ValueError:
                raise ValidationError(f"a '$time' value is not ISO 8601: {v[:60]!r}") from None
        if k.startswith("$"):
            raise ValidationError(f"unknown tagged value {k!r}; tags: $bytes, $time, $arrow, $dict")
    return {k: decode(v, _depth + 1) for k, v in value.items()}
