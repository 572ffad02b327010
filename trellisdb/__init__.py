"""trellisdb: a database for the experience graphs of long-horizon agents.

>>> import tempfile, trellisdb
>>> db = trellisdb.connect(tempfile.mkdtemp() + "/db", embedding_dim=4)
>>> with db.session(task="demo", agent="me") as s:
...     n = s.add_node(summary="first attempt")
...     s.add_reward(n, "score", 1.0)
>>> db.sql("SELECT channel, value FROM rewards").to_pylist()
[{'channel': 'score', 'value': 1.0}]
"""

from __future__ import annotations

from trellisdb.database import Database, connect
from trellisdb.errors import (
    AccessError,
    BusyError,
    CommitError,
    CorruptionError,
    DuplicateIdError,
    EmbeddingDimensionError,
    EmptySpaceError,
    ExportError,
    FormatVersionError,
    ImportFormatError,
    InvalidRewardError,
    MissingDependencyError,
    NotADatabaseError,
    PlanError,
    QueryCancelledError,
    QueryError,
    QueryLimitError,
    QueryMemoryError,
    QueryNameError,
    QuerySyntaxError,
    QueryTimeoutError,
    QueryTypeError,
    ReadOnlyError,
    TransactionError,
    TrellisError,
    TrellisWarning,
    UnknownCommitError,
    UnknownNodeError,
    UnknownParentError,
    UnknownSessionError,
    UnknownTagError,
    ValidationError,
)
from trellisdb.result import Result
from trellisdb.snapshot import Snapshot
from trellisdb.tql.run import QueryResult
from trellisdb.writer import SessionWriter

__version__ = "0.1.0"

__all__ = [
    "AccessError",
    "BusyError",
    "CommitError",
    "CorruptionError",
    "Database",
    "DuplicateIdError",
    "EmbeddingDimensionError",
    "EmptySpaceError",
    "ExportError",
    "FormatVersionError",
    "ImportFormatError",
    "InvalidRewardError",
    "MissingDependencyError",
    "NotADatabaseError",
    "PlanError",
    "QueryCancelledError",
    "QueryError",
    "QueryLimitError",
    "QueryMemoryError",
    "QueryNameError",
    "QueryResult",
    "QuerySyntaxError",
    "QueryTimeoutError",
    "QueryTypeError",
    "ReadOnlyError",
    "Result",
    "SessionWriter",
    "Snapshot",
    "TransactionError",
    "TrellisError",
    "TrellisWarning",
    "UnknownCommitError",
    "UnknownNodeError",
    "UnknownParentError",
    "UnknownSessionError",
    "UnknownTagError",
    "ValidationError",
    "connect",
]
