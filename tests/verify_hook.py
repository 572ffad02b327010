"""A verify-before-insert hook for the tests (``trellis serve --verify tests.verify_hook:check``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check(write: Mapping[str, Any]) -> Any:
    """Reject a summary carrying an injected instruction; hold a reward too good to be true."""
    summary = str(write["node"].get("summary") or "")
    if "ignore previous instructions" in summary.lower():
        return ("reject", "an injected instruction in the summary")
    if any(v > 0.99 for v in write["rewards"].values()):
        return ("hold", f"reward too good to be true (from token {write['token']})")
    if summary == "confused hook":
        return 42  # a hook's bug: the write is refused, not guessed at
    return "accept"
