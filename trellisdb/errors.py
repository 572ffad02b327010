"""The error hierarchy. Every error trellisdb raises derives from `TrellisError`.

Each message names the offending value and says what to do instead::

    >>> import trellisdb
    >>> try:
    ...     raise trellisdb.UnknownParentError("parent 'n9' of node 'n10' does not exist")
    ... except trellisdb.TrellisError as e:
    ...     print(type(e).__name__)
    UnknownParentError
"""

from __future__ import annotations


class TrellisError(Exception):
    """Root of every error raised by trellisdb."""


class TrellisWarning(UserWarning):
    """A condition worth knowing that does not stop the call (a store opened while its commit
    log lacks acknowledged records: reads work, writes wait for ``trellis repair``)."""


class NotADatabaseError(TrellisError):
    """The folder is not a trellisdb database."""


class FormatVersionError(TrellisError):
    """The database was written by an incompatible format version."""


class CorruptionError(TrellisError):
    """A file of the database is truncated or corrupted."""


class ValidationError(TrellisError):
    """A value given to a write call is not acceptable."""


class UnknownParentError(ValidationError):
    """A node names a parent (or an edge an endpoint) that does not exist."""


class UnknownSessionError(ValidationError):
    """A write names a session that does not exist."""


class UnknownNodeError(ValidationError):
    """A write names a node that does not exist."""


class InvalidRewardError(ValidationError):
    """A reward is NaN, infinite or not a number."""


class EmbeddingDimensionError(ValidationError):
    """An embedding has the wrong dimension for its space."""


class DuplicateIdError(ValidationError):
    """An id is reused with different content."""


class UnknownTagError(TrellisError):
    """A tag name that does not exist."""


class UnknownCommitError(TrellisError):
    """A commit id or timestamp that does not name a commit."""


class QueryError(TrellisError):
    """A SQL or TQL query failed."""


class CommitError(TrellisError):
    """A commit failed before its commit point (a full disk, an unwritable file); the writes it
    held are kept pending and retried by the next flush."""


class ReadOnlyError(TrellisError):
    """A write, a view change or an export through a handle opened with ``read_only=True``."""


class TransactionError(TrellisError):
    """A transaction was used wrongly (nested, or after it ended)."""


class QuerySyntaxError(QueryError):
    """A TQL text that does not parse; the message shows the line, a caret and what was expected."""

    def __init__(self, message: str, line: int = 0, column: int = 0) -> None:
        super().__init__(message)
        self.line = line
        self.column = column


class QueryTypeError(QueryError):
    """A TQL expression whose operands do not fit (text compared with a number, a WHERE that is no condition)."""


class QueryNameError(QueryError):
    """A TQL query naming an unknown column, function, channel, session, task, tag or parameter."""


class EmbedderError(TrellisError):
    """An embedder is missing, misconfigured, or returned vectors of the wrong shape."""


class UnknownSpaceError(ValidationError):
    """A write or call names an embedding space that does not exist."""


class EmptySpaceError(QueryError):
    """A retrieval over an embedding space that holds no vectors as of the query's commit."""


class ExportError(TrellisError):
    """An export that cannot be written as asked: missing texts, or a path that exists."""
