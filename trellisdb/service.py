"""What ``trellis serve`` does for its clients, on one open database; no HTTP here (``server.py``
carries it), so every piece is testable in-process.

- **Group commit across clients.** A write that must be durable when its call returns (a whole
  step, a ``flush``) takes a *ticket* once its rows are staged; one committer thread flushes
  ``window`` seconds after the first ticket it has not covered (more join meanwhile) and wakes
  the calls its flush covered: everything staged before the flush began. A failed flush is
  raised to the calls it covered (their writes stay pending in the committer, which retries).
- **Sessions.** A session's writer is opened once and kept until the client closes the session;
  calls on one session run one at a time (a writer numbers its steps).
- **Who writes.** Each write carries its caller (a ``tenants.Principal``): the nodes it writes
  have provenance ``token:<name>``, a session it opens records that as its own
  (``names.SESSION_PROVENANCE``), and an ``agent`` may write only the sessions its token opened
  (an admin any).
- **Transactions spanning calls.** ``begin`` starts a worker thread that opens
  ``db.transaction`` and runs the calls carrying the transaction's id (the committer keeps a
  transaction per thread); ``commit`` ends the block, ``rollback`` (or ``timeout`` seconds
  without a call) discards it.
- **Verify before insert.** An optional ``verify`` callable sees each node an agent writes (a
  whole step, or a session's ``add_node``) before it is staged, and answers ``"accept"``,
  ``"hold"`` (stored quarantined: kept out of RETRIEVE, FRONTIER and the training views until an
  admin releases it) or ``"reject"`` (refused with a ``ValidationError``), alone or as
  ``(verdict, reason)``; see :func:`verdict_of`.
- **Calls.** :data:`DB_CALLS` and :data:`SESSION_CALLS` are the whole remote API: each method
  of the embedded handle or of a session writer a client may call, with what it may not pass
  (callables). Anything else is refused by name.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import queue
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb.errors import (
    AccessError,
    CommitError,
    TransactionError,
    UnknownNodeError,
    UnknownSessionError,
    ValidationError,
)
from trellisdb.names import SESSION_PROVENANCE
from trellisdb.result import Result
from trellisdb.writer import reward_value

if TYPE_CHECKING:
    from trellisdb.database import Database
    from trellisdb.tenants import Principal
    from trellisdb.writer import SessionWriter

#: Seconds the committer waits after the first unflushed ticket, for others to join its commit.
WINDOW = 0.002
#: A transaction is rolled back after this many seconds without a call (a client may ask up to MAX).
TX_TIMEOUT = 30.0
TX_TIMEOUT_MAX = 600.0
#: At most this many transactions open at once (each holds a thread).
MAX_TRANSACTIONS = 256
#: Transactions one token may hold open at once (so one agent cannot take every one of its tenant's).
MAX_TRANSACTIONS_PER_TOKEN = 32
#: Nodes whose session a server remembers (``Service._wrote``): about 100 bytes each.
NODE_SESSIONS = 1 << 20

#: The remote API: methods of the database handle and of a session's writer a client may call,
#: each with the parameters it may not pass (callables).
DB_CALLS: dict[str, frozenset[str]] = {
    **{m: frozenset() for m in (
        "add_task", "set_attrs", "label", "unlabel", "tag", "untag", "tags", "resolve_as_of", "views",
        "create_view", "materialize", "refresh", "view", "drop_view", "spaces", "add_vectors", "index_status",
        "build_index", "ingest")},
    "create_space": frozenset({"embedder"}),
    "export": frozenset({"progress"}),
}
SESSION_CALLS: dict[str, frozenset[str]] = {m: frozenset() for m in (
    "add_node", "add_edge", "add_artifact", "add_reward", "add_comparison", "set_status", "set_attrs", "label",
    "unlabel")}
DB_CALLS.update({m: frozenset() for m in ("quarantine", "release", "purge")})
#: Who may change what, for an agent (an admin may change anything): the argument of each session
#: call naming what it changes, which must be the agent's own -- nodes of sessions its token
#: opened (for ``set_attrs``: of the ``scope`` it names; a session's, its own session; a task's,
#: an admin's only). Not here, so open to any node the agent can read: ``add_node``'s parents (an
#: edge into its new node), ``add_edge``'s ``src`` and ``add_comparison``'s nodes (a judgment is
#: its own row).
OWN: dict[str, str] = {"add_reward": "node_id", "set_status": "node_id", "label": "node_ids", "unlabel": "node_ids",
                       "set_attrs": "entity", "add_artifact": "node_id", "add_edge": "dst"}
#: Step fields a whole-step call may carry (``add_node``'s arguments).
STEP_FIELDS = frozenset({"id", "parents", "edge_kind", "kind", "step", "status", "summary", "cost", "embedding",
                         "artifacts", "source", "attrs", "labels", "at", "action", "state"})


class _Tx:
    """A transaction held open across calls: a worker thread inside ``db.transaction``."""

    _COMMIT = object()
    _ROLLBACK = object()

    class _Abort(Exception):
        pass

    def __init__(self, db: Database, message: str | None, meta: Mapping[str, Any] | None, timeout: float,
                 owner: Principal | None = None) -> None:
        self.db, self.message, self.meta, self.timeout = db, message, meta, timeout
        self.owner = owner  # who began it: the only caller it takes
        self._calls: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self.ended: str | None = None  # why it can take no more calls
        self._outcome: Future[int | None] = Future()
        self._started: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, name="trellisdb-remote-tx", daemon=True)
        self._thread.start()
        self._started.result()  # a bad message or meta is raised to begin()

    def _run(self) -> None:
        try:
            with self.db.transaction(self.message, self.meta) as tx:
                self._started.set_result(None)
                while True:
                    try:
                        item = self._calls.get(timeout=self.timeout)
                    except queue.Empty:
                        with self._lock:
                            if self._calls.empty():  # else a call slipped in: take it
                                self.ended = f"it was rolled back after {self.timeout:g} s without a call"
                                raise _Tx._Abort() from None
                        continue
                    if item is _Tx._COMMIT:
                        break
                    if item is _Tx._ROLLBACK:
                        raise _Tx._Abort()
                    fn, done = item
                    try:
                        done.set_result(fn())
                    except BaseException as e:  # the caller's error; the transaction stays open
                        done.set_exception(e)
            self._outcome.set_result(tx.commit_id)
        except _Tx._Abort:
            self._outcome.set_result(None)
        except BaseException as e:
            if not self._started.done():
                self._started.set_exception(e)
            self._outcome.set_exception(e)

    def _put(self, item: Any, ending: str | None) -> None:
        with self._lock:
            if self.ended is not None:
                raise TransactionError(f"the transaction is over: {self.ended}")
            if ending is not None:
                self.ended = ending
            self._calls.put(item)

    def run(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` inside the transaction (on its thread); its result or error."""
        done: Future[Any] = Future()
        self._put((fn, done), None)
        return done.result()

    def end(self, commit: bool) -> int | None:
        """Commit (the commit id; None if nothing was written) or roll back."""
        self._put(_Tx._COMMIT if commit else _Tx._ROLLBACK, "it was committed" if commit else "it was rolled back")
        return self._outcome.result()


class Service:
    """The server's work on one open database (see the module notes)."""

    def __init__(self, db: Database, *, window: float = WINDOW, verify: Verify | None = None) -> None:
        self.db = db
        self.window = window
        self.verify = verify
        self._writers: dict[str, SessionWriter] = {}
        self._session_locks: dict[str, threading.Lock] = {}
        #: who opened each session seen (``owner``): its provenance, None for none
        self._owners: dict[str, str | None] = {}
        #: the session of each node this server wrote outside a transaction (a node's session is part
        #: of its identity: it never changes but by a purge), so that an agent's change of its own
        #: node asks the store nothing (``_check_targets``); emptied past ``NODE_SESSIONS`` entries
        self._node_sessions: dict[str, str] = {}
        self._lock = threading.Lock()
        self._txs: dict[str, _Tx] = {}
        #: transactions being begun (their thread starting), with who begins each: counted as open
        self._opening: dict[str, Principal | None] = {}
        self._tx_ids = itertools.count(1)
        # group commit: tickets staged, tickets durable (or failed), the committer thread
        self._stage = threading.Lock()
        self._done = threading.Condition()
        self._staged = 0
        self._durable = 0
        self._commit = 0
        self._failed: tuple[int, BaseException] | None = None
        #: the tickets awaited on event loops (``durable_async``): ticket, loop, future
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[int]]] = []
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._commit_loop, name="trellisdb-server-commit", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the committer; open transactions are rolled back."""
        for tx in list(self._txs.values()):
            if tx.ended is None:
                tx.end(commit=False)
        self._closed = True
        self._wake.set()
        self._thread.join()
        with self._done:
            left, self._waiters = self._waiters, []
        for _, loop, fut in left:
            loop.call_soon_threadsafe(_settle, fut, CommitError(
                "the server stopped before this write's group commit; retry it with its id when it is back "
                "(a step with an id is written once)"))

    # ------------------------------------------------------------ group commit
    def _commit_loop(self) -> None:
        while not self._closed:
            self._wake.wait()
            if self._closed:
                return
            time.sleep(self.window)  # let the steps arriving meanwhile join this commit
            self._wake.clear()
            with self._stage:
                upto = self._staged  # every ticket up to here is staged: the flush takes it
            try:
                commit = self.db.flush() or self.db.snapshot().commit
                failed: tuple[int, BaseException] | None = None
            except BaseException as e:  # told to the calls it covered
                failed = (upto, e)
            with self._done:
                if failed is None:
                    self._durable, self._commit = upto, commit
                else:
                    self._failed = failed
                self._done.notify_all()
                covered = [w for w in self._waiters if w[0] <= upto]
                self._waiters = [w for w in self._waiters if w[0] > upto]
            for _, loop, fut in covered:  # the async waiters it covered, woken on their loops
                outcome: int | BaseException = commit if failed is None else _failed_commit(failed[1])
                loop.call_soon_threadsafe(_settle, fut, outcome)

    def _ticket(self) -> int:
        with self._stage:
            self._staged += 1
            return self._staged

    def _wait_durable(self, ticket: int) -> int:
        """Block until the flush covering ``ticket`` is done; its commit id (or its error)."""
        self._wake.set()
        with self._done:
            while self._durable < ticket:
                if self._failed is not None and self._failed[0] >= ticket:
                    raise _failed_commit(self._failed[1])
                self._done.wait()
            return self._commit

    def durable(self) -> int:
        """Every write made before this call is durable on return; the commit that holds them."""
        return self._wait_durable(self._ticket())

    def ticket(self) -> int:
        """A ticket covering every write staged so far (for :meth:`durable_async`)."""
        return self._ticket()

    async def durable_async(self, ticket: int) -> int:
        """:meth:`_wait_durable` on an event loop: awaits the flush covering ``ticket`` without
        holding a thread (the committer resolves the future); its commit id (or its error)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()
        with self._done:
            if self._durable >= ticket:
                return self._commit
            if self._failed is not None and self._failed[0] >= ticket:
                raise _failed_commit(self._failed[1])
            self._waiters.append((ticket, loop, fut))
        self._wake.set()
        return await fut

    # ------------------------------------------------------------ reads
    def health(self) -> dict[str, Any]:
        """Answered from memory (no I/O, no flush): an event loop may call it."""
        return {"ok": True, "commit": self.db.latest_commit}

    def query(self, body: Mapping[str, Any], who: Principal | None = None) -> pa.Table:
        """TQL for ``who``: every door's TQL (``/v1/query``, MCP's tools) comes here, so each
        statement's role check (:func:`need_of_query`) is made in this one place."""
        text = field(body, "tql", str)
        params = field(body, "params", dict, optional=True) or {}
        if who is not None:
            who.require(need_of_query(text))
        return self.db.query(text, **params).to_arrow()

    def sql(self, body: Mapping[str, Any]) -> pa.Table:
        text = field(body, "sql", str)
        params = body.get("params")
        if params is not None and not isinstance(params, list | dict):
            raise ValidationError("params must be a list (for $1, $2...) or an object (for $name)")
        as_of = body.get("as_of")
        if as_of is not None and (isinstance(as_of, bool) or not isinstance(as_of, int | str)):
            raise ValidationError("as_of must be a commit id, a tag or an ISO timestamp")
        return self.db.sql(text, as_of=as_of, params=params).to_arrow()

    def log(self) -> list[dict[str, Any]]:
        return self.db.log()

    # ------------------------------------------------------------ sessions
    def _writer(self, sid: str, who: Principal | None) -> SessionWriter:
        """The writer of session ``sid`` for ``who`` (an owner check; under its session lock)."""
        self._check_owner(sid, who)
        with self._lock:
            w = self._writers.get(sid)
        if w is None:  # a session the server has not seen since it started: resumed
            resumed = self.db.resume(sid)
            with self._lock:
                w = self._writers.setdefault(sid, resumed)
        w.provenance = provenance_of(who)  # who writes this call's nodes
        return w

    def _session_lock(self, sid: str) -> threading.Lock:
        with self._lock:
            return self._session_locks.setdefault(sid, threading.Lock())

    def owner(self, sid: str) -> tuple[bool, str | None]:
        """Whether session ``sid`` exists (committed, or opened here), and who opened it (its
        ``SESSION_PROVENANCE``; None: a session opened without one, e.g. embedded)."""
        with self._lock:
            if sid in self._owners:
                return True, self._owners[sid]
        rows = self.db.sql(
            "SELECT s.id, (SELECT text FROM attributes a WHERE a.scope = 'session' AND a.entity = s.id AND "
            "a.key = $2) AS owner FROM sessions s WHERE s.id = $1", params=[sid, SESSION_PROVENANCE]).to_pylist()
        if not rows:
            return False, None
        with self._lock:
            self._owners[sid] = rows[0]["owner"]
        return True, rows[0]["owner"]

    def _check_owner(self, sid: str, who: Principal | None) -> None:
        """Refuse an ``agent`` writing a session its token did not open."""
        if who is None or who.may("admin"):
            return
        exists, owner = self.owner(sid)
        if exists and owner != provenance_of(who):
            raise AccessError(f"session {sid[:200]!r} was opened by {owner or 'a writer without a token'}; token "
                              f"{who.name!r} (an agent) may write only the sessions it opened")

    def _opened(self, w: SessionWriter, who: Principal | None) -> None:
        with self._lock:
            self._writers[w.id] = w
            self._owners.setdefault(w.id, provenance_of(who))

    def open_session(self, body: Mapping[str, Any], who: Principal | None = None) -> dict[str, Any]:
        """Open (or reopen) a session: ``Database.session``'s arguments; its id and task."""
        kw = field(body, "kwargs", dict, optional=True) or {}
        _check_args("session", self.db.session, [], kw, frozenset({"provenance"}))
        sid = kw.get("id")
        if not isinstance(sid, str):  # a new id: nobody else can be opening it
            w = self._in_tx(body, lambda: self.db.session(**kw, provenance=provenance_of(who)), who)
            self._opened(w, who)
            return {"id": w.id, "task_id": w.task_id}
        with self._session_lock(sid):  # two callers opening one id: the second sees the first's
            self.owner(sid)  # its stored owner, known before an admin's reopening could pass for it
            self._check_owner(sid, who)
            w = self._in_tx(body, lambda: self.db.session(**kw, provenance=provenance_of(who)), who)
            self._opened(w, who)
        return {"id": w.id, "task_id": w.task_id}

    def resume_session(self, body: Mapping[str, Any], who: Principal | None = None) -> dict[str, Any]:
        sid = field(body, "session", str)
        self._check_owner(sid, who)
        w = self.db.resume(sid, provenance=provenance_of(who))
        with self._lock:
            self._writers[sid] = w
        return {"id": w.id, "task_id": w.task_id}

    def close_session(self, body: Mapping[str, Any], who: Principal | None = None) -> dict[str, Any]:
        """Record a session's final status; durable on return (outside a transaction)."""
        sid = field(body, "session", str)
        status = field(body, "status", str, optional=True) or "completed"
        with self._session_lock(sid):
            w = self._writer(sid, who)
            self._in_tx(body, lambda: w.close(status), who)
            with self._lock:
                self._writers.pop(sid, None)
        return {"id": sid}

    def step(self, body: Mapping[str, Any], who: Principal | None = None) -> dict[str, Any]:
        """A whole step: the node (``add_node``'s arguments) and its rewards; durable on return
        (:meth:`stage_step`, then the wait for the group commit holding it)."""
        out, ticket = self.stage_step(body, who)
        return {**out, "commit": self._wait_durable(ticket)}

    def stage_step(self, body: Mapping[str, Any], who: Principal | None = None) -> tuple[dict[str, Any], int]:
        """Stage a whole step (checked first: a bad reward stages nothing); its answer (``id``,
        and ``held`` when the verify hook held it) and the ticket a group commit makes durable
        (:meth:`wait_durable` in a thread, :meth:`durable_async` on an event loop)."""
        node = field(body, "node", dict)
        rewards = field(body, "rewards", dict, optional=True) or {}
        unknown = sorted(set(node) - STEP_FIELDS)
        if unknown:
            raise ValidationError(f"node has unknown field(s) {unknown}; fields: {', '.join(sorted(STEP_FIELDS))}")
        for channel, value in rewards.items():  # all or nothing: a bad reward stages no node
            reward_value(str(node.get("id") or "(new node)"), channel, value)
        sid = field(body, "session", str)
        with self._session_lock(sid):  # (opening a session holds its own lock, never the service's)
            with self._lock:
                known = sid in self._writers
            if not known and not self.owner(sid)[0]:  # a new session: opened by this step
                w = self.db.session(task=field(body, "task", str), id=sid, agent=body.get("agent"),
                                    model=body.get("model"), provenance=provenance_of(who))
                self._opened(w, who)
            w = self._writer(sid, who)
            held = self._verified(sid, node, rewards, who)
            with self._stage:  # staged, then ticketed: a flush takes both
                node_id = w.add_node(**node, **held)
                for channel, value in rewards.items():
                    w.add_reward(node_id, channel, value)
                self._staged += 1
                ticket = self._staged
            self._wrote(node_id, sid)
        return ({"id": node_id, "held": held["quarantine"]} if held else {"id": node_id}), ticket

    def _verified(self, sid: str, node: Mapping[str, Any], rewards: Mapping[str, Any],
                  who: Principal | None) -> dict[str, Any]:
        """The ``verify`` hook's verdict on a node about to be written: ``{}`` (accept),
        ``{"quarantine": reason}`` (hold); a rejection raised."""
        if self.verify is None:
            return {}
        seen = {"session": sid, "node": dict(node), "rewards": dict(rewards),
                "token": None if who is None else who.name, "tenant": None if who is None else who.tenant}
        verdict, reason = verdict_of(self.verify(seen))
        if verdict == "reject":
            raise ValidationError(f"the server's verify hook rejected this step: {reason or 'no reason given'}")
        return {"quarantine": reason or "held by the server's verify hook"} if verdict == "hold" else {}

    # ------------------------------------------------------------ calls
    def call(self, body: Mapping[str, Any], who: Principal | None = None) -> Any:
        """One method of the remote API (:data:`DB_CALLS`; :data:`SESSION_CALLS` with a
        ``session``): ``{"method", "args", "kwargs", "session", "tx"}`` with decoded values; its
        result (a ``Result`` stays one)."""
        method = field(body, "method", str)
        sid = field(body, "session", str, optional=True)
        calls = DB_CALLS if sid is None else SESSION_CALLS
        if method not in calls:
            raise ValidationError(f"unknown method {method!r} of {'a database' if sid is None else 'a session'}; "
                                  f"methods: {', '.join(sorted(calls))}")
        refused = calls[method]
        args = field(body, "args", list, optional=True) or []
        kwargs = field(body, "kwargs", dict, optional=True) or {}
        if sid is None:
            if method == "export":  # a remote export writes under the server's export root only
                args, kwargs = _export_args(self.db, args, kwargs)
            if method == "ingest" and who is not None:  # the nodes are who sent them
                kwargs = {**kwargs, "provenance": provenance_of(who)}
            fn = getattr(self.db, method)
            _check_args(method, fn, args, kwargs, refused)
            out = self._in_tx(body, lambda: fn(*args, **kwargs), who)
            if method == "purge":  # the purged sessions' writers (and owners, and nodes) are gone with them
                with self._lock:
                    self._writers.clear()
                    self._owners.clear()
                    self._node_sessions.clear()
            return out
        with self._session_lock(sid):
            w = self._writer(sid, who)
            fn = getattr(w, method)
            bound = _check_args(method, fn, args, kwargs, refused)
            if method == "add_node":  # a node written call by call passes the same check as a step
                kwargs = {**kwargs, **self._verified(sid, kwargs, {}, who)}

            def write() -> Any:  # checked where it runs (a transaction's thread sees its own nodes)
                self._check_targets(w, method, bound, who)
                return fn(*args, **kwargs)
            out = self._in_tx(body, write, who)
            if method == "add_node" and isinstance(out, str) and body.get("tx") is None:
                self._wrote(out, sid)  # (a transaction's nodes may yet be rolled back)
            return out

    def _wrote(self, node_id: str, sid: str) -> None:
        """Remember that session ``sid`` wrote node ``node_id`` (staged outside a transaction)."""
        with self._lock:
            if len(self._node_sessions) >= NODE_SESSIONS:
                self._node_sessions.clear()
            self._node_sessions[node_id] = sid

    def _check_targets(self, w: SessionWriter, method: str, bound: inspect.BoundArguments,
                       who: Principal | None) -> None:
        """Refuse an agent's session call that changes what is not its own (see :data:`OWN`):
        the nodes a call scores, labels, re-states, gives attributes or artifacts, or links to
        (an edge's ``dst``) must be nodes of sessions its token opened; a session's attributes
        its own session's; a task's attributes are an admin's. Every session call of every door
        (``/v1/call``, MCP's tools) passes here; a whole step writes only the node it makes. An
        unknown node is refused here too (else another session could create it meanwhile)."""
        if who is None or who.may("admin") or method not in OWN:
            return
        bound.apply_defaults()
        value = bound.arguments[OWN[method]]
        scope = bound.arguments.get("scope", "node") if method == "set_attrs" else "node"
        if scope == "task":
            raise AccessError(f"set_attrs: task {str(value)[:200]!r}: a task's attributes are an admin's (a task "
                              f"is shared by every agent of tenant {who.tenant!r}); set them on your nodes or session")
        mine = provenance_of(who)
        if scope == "session" and isinstance(value, str):
            exists, owner = self.owner(value)
            if not exists:
                raise UnknownSessionError(f"attributes of session {value[:200]!r}: it does not exist; add it first")
            if owner != mine:
                raise AccessError(f"set_attrs: session {value[:200]!r} was opened by "
                                  f"{owner or 'a writer without a token'}; token {who.name!r} (an agent) may set "
                                  "attributes only of the sessions it opened")
            return
        ids = [value] if isinstance(value, str) else value
        if scope != "node" or not isinstance(ids, list | tuple) or not all(isinstance(i, str) for i in ids):
            return  # the method refuses the value (or the scope) itself
        with self._lock:
            sessions = {i: self._node_sessions[i] for i in ids if i in self._node_sessions}
        if len(sessions) < len(set(ids)):  # nodes this server did not write: the store says whose
            sessions.update(w.sessions_of([i for i in ids if i not in sessions]))
        for node in ids:
            sid = sessions.get(node)
            if sid is None:
                raise UnknownNodeError(f"{method}: node {node[:200]!r} does not exist; add it first")
            owner = self.owner(sid)[1]
            if owner != mine:
                raise AccessError(
                    f"{method}: node {node[:200]!r} is of session {sid[:200]!r}, opened by "
                    f"{owner or 'a writer without a token'}; token {who.name!r} (an agent) may change only the "
                    "nodes of the sessions it opened (it may link its own nodes to others' and compare any: see "
                    "docs/server.md, Who may change what)")

    def flush(self, body: Mapping[str, Any], who: Principal | None = None) -> int | None:
        """Make every pending write durable (shared with other clients' flushes); the commit."""
        meta = field(body, "meta", dict, optional=True)
        if meta is not None:  # a commit carrying run state: its own
            return self.db.flush(meta)
        return self.durable()

    # ------------------------------------------------------------ transactions
    def begin(self, body: Mapping[str, Any], who: Principal | None = None) -> dict[str, Any]:
        message = field(body, "message", str, optional=True)
        meta = field(body, "meta", dict, optional=True)
        timeout = body.get("timeout", TX_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout <= TX_TIMEOUT_MAX:
            raise ValidationError(f"timeout must be seconds in (0, {TX_TIMEOUT_MAX:g}], got {timeout!r}")
        tx_id = f"tx{next(self._tx_ids)}-{secrets.token_hex(8)}"
        with self._lock:  # counted and reserved at once: two begins cannot both take the last place
            for k in [k for k, t in self._txs.items() if t.ended is not None]:
                del self._txs[k]
            owners = [t.owner for t in self._txs.values()] + list(self._opening.values())
            if len(owners) >= MAX_TRANSACTIONS:
                raise TransactionError(f"{MAX_TRANSACTIONS} transactions are open on this tenant's store; commit "
                                       "or roll back one first")
            mine = sum(1 for o in owners if (o is None if who is None else who.same_token(o)))
            if mine >= MAX_TRANSACTIONS_PER_TOKEN:
                raise TransactionError(f"token {who.name if who else 'anonymous'!r} holds {mine} open transactions, "
                                       f"the most one token may ({MAX_TRANSACTIONS_PER_TOKEN}); commit or roll back "
                                       "one first")
            self._opening[tx_id] = who
        try:
            tx = _Tx(self.db, message, meta, float(timeout), who)
            with self._lock:
                self._txs[tx_id] = tx
        finally:
            with self._lock:
                self._opening.pop(tx_id, None)
        return {"tx": tx_id, "timeout": tx.timeout}

    def end(self, body: Mapping[str, Any], commit: bool, who: Principal | None = None) -> dict[str, Any]:
        tx_id = field(body, "tx", str)
        tx = self._tx(tx_id, who)
        try:
            return {"commit_id": tx.end(commit)}
        finally:
            with self._lock:
                self._txs.pop(tx_id, None)

    def _tx(self, tx_id: str, who: Principal | None) -> _Tx:
        """Open transaction ``tx_id``, if ``who`` began it: a transaction is its token's alone
        (an admin's included: no one else has a reason to write into, commit or roll back
        another client's block; it times out on its own)."""
        with self._lock:
            tx = self._txs.get(tx_id)
        if tx is None:
            raise TransactionError(f"no open transaction {tx_id[:80]!r}: it was committed, rolled back, timed out "
                                   "or the server restarted; begin a new one")
        if not (who is None if tx.owner is None else tx.owner.same_token(who)):
            raise AccessError(f"transaction {tx_id[:80]!r} was begun by another token; only the token that began a "
                              "transaction may call in it, commit it or roll it back")
        return tx

    def _in_tx(self, body: Mapping[str, Any], fn: Callable[[], Any], who: Principal | None) -> Any:
        """Run ``fn`` in the transaction the call names (on its thread; ``who``'s own), else here."""
        tx_id = field(body, "tx", str, optional=True)
        return fn() if tx_id is None else self._tx(tx_id, who).run(fn)


class Caller:
    """A :class:`Service`'s work on behalf of one caller (``mcp_server.Writes``: what MCP's tools
    call inside ``trellis serve``)."""

    def __init__(self, service: Service, who: Principal | None,
                 reads: Callable[[Callable[[], pa.Table]], Awaitable[pa.Table]] | None = None) -> None:
        self.service, self.who = service, who
        #: how a read runs (the server's admission: turns, time limit, read threads); else a worker thread
        self._reads = reads

    async def query(self, body: Mapping[str, Any]) -> pa.Table:
        """TQL for this caller, awaited on the event loop (no thread held while it waits its turn)."""
        def work() -> pa.Table:
            return self.service.query(body, self.who)
        if self._reads is not None:
            return await self._reads(work)
        import anyio.to_thread

        return await anyio.to_thread.run_sync(work)

    def step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.service.step(body, self.who)

    def call(self, body: Mapping[str, Any]) -> Any:
        return self.service.call(body, self.who)

    def durable(self) -> int:
        return self.service.durable()


#: The verify-before-insert hook: what a node write looks like (``{"session", "node": add_node's
#: arguments, "rewards", "token", "tenant"}``) in, a verdict out (see :func:`verdict_of`).
Verify = Callable[[Mapping[str, Any]], Any]
VERDICTS = ("accept", "hold", "reject")


def verdict_of(answer: Any) -> tuple[str, str | None]:
    """A verify hook's answer as ``(verdict, reason)``: ``"accept"``, ``"hold"`` or ``"reject"``,
    alone or with a reason (``None`` or ``True``: accept; ``False``: reject). Anything else is the
    hook's bug, refused as such (the write is not made).

    >>> verdict_of(None), verdict_of(("hold", "reward too good")), verdict_of(False)
    (('accept', None), ('hold', 'reward too good'), ('reject', None))
    """
    if answer is None or answer is True:
        return "accept", None
    if answer is False:
        return "reject", None
    verdict, reason = (answer, None) if isinstance(answer, str) else (answer if isinstance(answer, tuple) and
                                                                       len(answer) == 2 else (None, None))
    if verdict not in VERDICTS or not (reason is None or isinstance(reason, str)):
        raise ValidationError(f"the server's verify hook answered {answer!r:.200}; it must answer one of "
                              f"{', '.join(VERDICTS)}, alone or as (verdict, reason): the write was not made")
    return verdict, reason


def _failed_commit(cause: BaseException) -> CommitError:
    e = CommitError(f"the group commit holding these writes failed: {cause}; they are kept and retried by the "
                    "server")
    e.__cause__ = cause
    return e


def _settle(fut: asyncio.Future[int], outcome: int | BaseException) -> None:
    if fut.done():  # the caller went away (its request was cancelled)
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


def provenance_of(who: Principal | None) -> str | None:
    """The provenance of what ``who`` writes: ``token:<name>`` (None: the database's default)."""
    return None if who is None else f"token:{who.name}"


def field(body: Mapping[str, Any], name: str, kind: type, *, optional: bool = False) -> Any:
    """``body[name]``, checked to be a ``kind`` (None allowed when ``optional``)."""
    v = body.get(name)
    if v is None and optional:
        return None
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ValidationError(f"the request needs {name!r} as a {kind.__name__}, got {type(v).__name__}")
    return v


def _check_args(method: str, fn: Callable[..., Any], args: list[Any], kwargs: Mapping[str, Any],
                refused: frozenset[str]) -> inspect.BoundArguments:
    bad = sorted(refused & set(kwargs))
    if bad:
        raise ValidationError(f"{method}: {', '.join(bad)} cannot be passed to a remote store")
    try:
        return inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        raise ValidationError(f"{method}: {e}") from None


def _export_args(db: Database, args: list[Any], kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
    """An export's path, read relative to the server's export root (``Database.export_target``)."""
    args, kwargs = list(args), dict(kwargs)
    if len(args) >= 2:
        args[1] = db.export_target(field({"path": args[1]}, "path", str))
    elif "path" in kwargs:
        kwargs["path"] = db.export_target(field(kwargs, "path", str))
    return args, kwargs


def result_table(value: Any) -> pa.Table | None:
    """The Arrow table of a call's result, when it is rows."""
    return value.to_arrow() if isinstance(value, Result) else None


#: What each remote call needs of the caller's role (``tenants.Principal.may``).
READS = frozenset({"tags", "resolve_as_of", "views", "view", "spaces", "index_status"})
#: (An agent writes through its sessions; the handle's own writers touch any node: an admin's.)
ADMIN = frozenset({"tag", "untag", "create_view", "materialize", "refresh", "drop_view", "export", "create_space",
                   "build_index", "ingest", "quarantine", "release", "purge", "set_attrs", "label", "unlabel",
                   "add_vectors"})


def need_of_call(body: Mapping[str, Any]) -> str:
    """``read``, ``write`` or ``admin``: what a ``/v1/call`` body asks of the caller."""
    method = body.get("method")
    if body.get("session") is not None:
        return "write"
    return "read" if method in READS else "admin" if method in ADMIN else "write"


def need_of_query(text: object) -> str:
    """What a TQL text asks: view statements other than SHOW VIEWS change the store (``admin``)."""
    from trellisdb.errors import QueryError
    from trellisdb.tql import ast as A
    from trellisdb.tql.parser import parse

    if not isinstance(text, str):
        return "read"  # the query call refuses it
    try:
        statement = parse(text).statement
    except QueryError:
        return "read"  # the query call raises the error, with its position
    return "admin" if isinstance(statement, A.ViewCommand) and statement.action != "show" else "read"


class Services:
    """The tenants of a served folder: each tenant's store opened on first use, with its own
    :class:`Service` (so its own group commit); the caller of a request resolved from its token
    (``trellisdb/tenants.py``).

    ``token``: one shared token (``trellis serve --token``), the default tenant's admin. With
    neither it nor a token in the registry, the server is open: every caller is that admin.
    ``options``: what the tenants' stores are opened with (``open_local``'s, e.g. ``query_timeout``)."""

    def __init__(self, db: Database, *, token: str | None = None, window: float = WINDOW,
                 verify: Verify | None = None, options: Mapping[str, Any] | None = None) -> None:
        from trellisdb.tenants import DEFAULT_TENANT, Tokens

        self.root = db.path
        self.tokens = Tokens(self.root)
        self._token = token
        self._window = window
        self._verify = verify
        self._options = dict(options or {})
        self._lock = threading.Lock()
        self._services: dict[str, Service] = {DEFAULT_TENANT: Service(db, window=window, verify=verify)}
        self._opened: list[Database] = []

    def principal(self, authorization: str | None) -> Principal | None:
        """Who sends ``Authorization: <authorization>`` (None: nobody we know, or a header that is
        not ``Bearer <token>``, the scheme in any case); an expired token raises ``AccessError``
        naming its expiry."""
        import hmac

        from trellisdb.tenants import DEFAULT_TENANT, Principal, token_key

        if authorization is None or not authorization.strip():
            if self._token is None and not self.tokens.enabled():
                return Principal("anonymous", DEFAULT_TENANT, "admin")
            return None
        scheme, _, given = authorization.strip().partition(" ")
        given = given.strip()
        if scheme.lower() != "bearer" or not given:
            return None
        if self._token is not None and hmac.compare_digest(given.encode(), self._token.encode()):
            return Principal("server-token", DEFAULT_TENANT, "admin", key=token_key(given))
        return self.tokens.lookup(given)

    def active_keys(self) -> frozenset[str]:
        """The :attr:`Principal.key` of every caller whose token works now (not revoked, not
        expired; ``""``: the anonymous admin of an open server): what a cache of a token's state
        (``server.py``'s MCP servers) checks before keeping it."""
        from trellisdb.tenants import token_key

        keys = self.tokens.active_keys()
        if self._token is not None:
            return keys | {token_key(self._token)}
        return keys if self.tokens.enabled() else frozenset({""})

    def service(self, tenant: str) -> Service:
        """The service of ``tenant``'s store (opened, and created, on first use)."""
        from trellisdb.database import open_local
        from trellisdb.tenants import tenant_path

        with self._lock:
            s = self._services.get(tenant)
            if s is None:
                if not self.tokens.has_tenant(tenant):  # purged while this request was on its way
                    raise AccessError(f"tenant {tenant!r} has no tokens (it was purged); make one with "
                                      "`trellis token create`")
                db = open_local(tenant_path(self.root, tenant), **self._options)
                self._opened.append(db)
                s = self._services[tenant] = Service(db, window=self._window, verify=self._verify)
            return s

    def purge_tenant(self, tenant: str, *, by: str | None = None) -> dict[str, Any]:
        """Delete ``tenant``: its tokens revoked (new requests are refused), its service stopped
        (open transactions rolled back, calls in flight get errors), its store's folder removed,
        and an audit commit in the served folder's own log (message ``purge tenant``, meta
        ``{"purge_tenant": {"tenant", "tokens_revoked", "store_removed", "by"}}``: the tenant's
        log went with it). The default tenant is the served folder itself: purge its sessions
        instead."""
        import shutil

        from trellisdb.tenants import DEFAULT_TENANT, check_tenant, tenant_path

        check_tenant(tenant)
        if tenant == DEFAULT_TENANT:
            raise ValidationError("the default tenant is the served folder itself: purge its sessions "
                                  "(purge(task=...)) or stop the server and delete the folder")
        tokens = self.tokens.revoke_tenant(tenant)
        with self._lock:
            s = self._services.pop(tenant, None)
        if s is not None:
            s.close()
            s.db.close()
            with self._lock:
                self._opened.remove(s.db)
        path = tenant_path(self.root, tenant)
        existed = os.path.isdir(path)
        if existed:
            shutil.rmtree(path)
        report = {"tenant": tenant, "tokens_revoked": list(tokens), "store_removed": existed, "by": by}
        with self._services[DEFAULT_TENANT].db.transaction(message="purge tenant", meta={"purge_tenant": report}) as tx:
            pass
        return {**report, "audit_commit": tx.commit_id}

    def opened(self, tenant: str) -> Service | None:
        """``tenant``'s service if it is open (no lock, no I/O: an event loop may ask)."""
        return self._services.get(tenant)

    def services(self) -> list[tuple[str, Service]]:
        with self._lock:
            return list(self._services.items())

    def close(self) -> None:
        """Stop every tenant's service; close the stores this opened (the default one is the caller's)."""
        for _, s in self.services():
            s.close()
        for db in self._opened:
            db.close()
