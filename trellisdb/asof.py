"""What a point in time names: the one place ``AS OF`` (TQL) and ``as_of=`` (Python) are resolved.

A point in time is a commit id, a tag, a timestamp (the last commit made at or before it;
commit time, naive times are UTC) or None (the latest commit). Functions here are pure:
they take the commit log's state and return a commit id, or raise an error that says
what exists.

>>> commits = {1: {"time": 10.0}, 2: {"time": 20.0}}
>>> resolve(commits, {"v1": 1}, 2, "v1"), resolve(commits, {}, 2, None), resolve(commits, {}, 2, "2")
(1, 2, 2)
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from trellisdb.errors import UnknownCommitError, UnknownTagError, ValidationError
from trellisdb.names import did_you_mean, known
from trellisdb.storage.log import last_commit_at

#: What ``as_of=`` takes in the Python API.
AsOf = int | str | dt.datetime | None


def commit(commits: Mapping[int, Any], last: int, n: int) -> int:
    """Commit ``n`` itself (0: before the first commit), if it exists."""
    if n != 0 and n not in commits:
        raise UnknownCommitError(f"commit {n} does not exist (last commit is {last}); see `trellis log`")
    return n


def tag(tags: Mapping[str, int], name: str) -> int:
    """The commit tag ``name`` names."""
    if name not in tags:
        raise UnknownTagError(f"unknown tag {name!r}{did_you_mean(name, tags)}{known('tags', tags)}")
    return tags[name]


def time(commits: Mapping[int, Mapping[str, Any]], ts: dt.datetime) -> int:
    """The last commit made at or before ``ts`` (0 if none)."""
    return last_commit_at(commits, ts)


def parse_time(text: str) -> dt.datetime | None:
    """``text`` as an ISO time, or None."""
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        return None


def resolve(commits: Mapping[int, Mapping[str, Any]], tags: Mapping[str, int], last: int, as_of: object) -> int:
    """The commit id ``as_of`` names: a commit id, a tag, digits, an ISO time, a datetime or None."""
    if as_of is None:
        return last
    if isinstance(as_of, bool):
        raise ValidationError(f"as_of must be a commit id, tag or timestamp, not {as_of!r}")
    if isinstance(as_of, int):
        return commit(commits, last, as_of)
    if isinstance(as_of, str):
        if as_of in tags:
            return tags[as_of]
        if as_of.isdigit():
            return commit(commits, last, int(as_of))
        ts = parse_time(as_of)
        if ts is None:
            raise UnknownTagError(f"{as_of!r} is neither a tag nor an ISO timestamp{did_you_mean(as_of, tags)}")
        return time(commits, ts)
    if isinstance(as_of, dt.datetime):
        return time(commits, as_of)
    raise ValidationError(f"as_of must be a commit id, tag or timestamp, not {type(as_of).__name__}")
