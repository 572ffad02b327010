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

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """Where a node is in the query text: offsets [start, end), 1-based line and column."""

    start: int
    end: int
    line: int
    column: int


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
    """A SQL or TQL query failed.

    An error about a place in a TQL text carries that place as data, besides the
    line and column its message names: ``span``, a :class:`Span`
    (offsets ``[start, end)`` into the text, 1-based ``line`` and ``column``), and
    ``query``, the text itself, so ``e.query[e.span.start:e.span.end]`` is what the
    error is about. ``span`` is None for an error without a place (a parameter given
    but not used), ``query`` where the raising code had no TQL text (SQL, views)::

        >>> import trellisdb
        >>> from trellisdb.tql.parser import parse
        >>> try:
        ...     parse("NODES WHERE step == 3")
        ... except trellisdb.QuerySyntaxError as e:
        ...     print(e.span.line, e.span.column, repr(e.query[e.span.start:e.span.end]))
        1 19 '='
    """

    #: where in ``query`` the error is (None: the error has no place in the text)
    span: Span | None = None
    #: the TQL text (None where the raising code had none)
    query: str | None = None

    def __init__(self, *args: object, span: Span | None = None, query: str | None = None) -> None:
        super().__init__(*args)
        self.span = span
        self.query = query


class QueryLimitError(QueryError):
    """A query stopped at a limit of the store that opened it: its time limit
    (:class:`QueryTimeoutError`), the engine's memory (:class:`QueryMemoryError`), or its
    caller went away (:class:`QueryCancelledError`). The message names the limit and how to
    raise it; ``limit`` names the option (``query_timeout``, ``memory_limit``, None for a
    cancel)."""

    #: the option that set the limit the query met (None: it was cancelled)
    limit: str | None = None


class QueryTimeoutError(QueryLimitError):
    """A query ran past its time limit (``connect(query_timeout=...)``, ``trellis serve
    --query-timeout``) and was stopped; the engine's threads are free again."""

    limit = "query_timeout"


class QueryMemoryError(QueryLimitError):
    """A query needed more memory than the store's query engine may use (``connect(memory_limit=...)``,
    ``trellis serve --memory-limit``) and was stopped."""

    limit = "memory_limit"


class QueryCancelledError(QueryLimitError):
    """A query was stopped before it finished because its caller asked (``QueryScope.cancel``):
    on a server, because the client went away."""


class BusyError(TrellisError):
    """A served store has no room for another read now: the caller's token's, its tenant's or the
    server's reads are all running (``trellis serve --token-reads``, ``--tenant-reads``,
    ``--max-reads``) and none finished within ``--read-wait``. Retry after a moment (HTTP 429 or
    503, with ``Retry-After``)."""


class CommitError(TrellisError):
    """A commit failed before its commit point (a full disk, an unwritable file); the writes it
    held are kept pending and retried by the next flush."""


class ReadOnlyError(TrellisError):
    """A write, a view change or an export through a handle opened with ``read_only=True``."""


class TransactionError(TrellisError):
    """A transaction was used wrongly (nested, or after it ended)."""


class QuerySyntaxError(QueryError):
    """A TQL text that does not parse; the message shows the line, a caret and what was expected.

    ``line`` and ``column`` (1-based; 0 when unknown) are those of ``span`` when one is given."""

    def __init__(self, message: str, line: int = 0, column: int = 0, *, span: Span | None = None,
                 query: str | None = None) -> None:
        super().__init__(message, span=span, query=query)
        if span is not None and not line:
            line, column = span.line, span.column
        self.line = line
        self.column = column


class QueryTypeError(QueryError):
    """A TQL expression whose operands do not fit (text compared with a number, a WHERE that is no condition)."""


class QueryNameError(QueryError):
    """A TQL query naming an unknown column, function, channel, session, task, tag or parameter."""


class PlanError(QueryError):
    """A plan that breaks an operator's rule (a bug in the planner, reported clearly)."""


class MissingDependencyError(TrellisError, ImportError):
    """An optional package a method needs is not installed (the message says what to install)."""


class EmbedderError(TrellisError):
    """An embedder is missing, misconfigured, or returned vectors of the wrong shape."""


class UnknownSpaceError(ValidationError):
    """A write or call names an embedding space that does not exist."""


class EmptySpaceError(QueryError):
    """A retrieval over an embedding space that holds no vectors as of the query's commit."""


class ExportError(TrellisError):
    """An export that cannot be written as asked: missing texts, or a path that exists."""


class ImportFormatError(ValidationError):
    """A file of a run being imported that its format's reader cannot read as that format; the
    message names the file (and line). Nothing of the unit holding it was written."""


class AccessError(TrellisError):
    """A served store refused the caller: no token, an unknown one, or a role that may not do
    this (``trellisdb/tenants.py``)."""
