"""Tenants, roles and tokens of a served store (``trellis serve``, ``trellis token``).

**Tenants are separate stores.** The served folder is the store of tenant ``default``; tenant
``t`` is the store in ``<folder>/tenants/t/``, created on first use. A query of one tenant runs
over its own tables, catalog, indexes and mirror, so it can never return, count, rank by or be
timed by another tenant's rows, and an edge to another tenant's node is refused as an unknown
parent. Purging a tenant deletes its folder. The embedded mode is the one implicit tenant: the
folder itself.

**Tokens** are bound to one tenant and one role. The registry ``<folder>/tokens.json`` keeps
each token's SHA-256, never the token (it is shown once, when made):

- ``agent``: write sessions (its own: a session another token opened is refused), read its tenant;
- ``analyst``: read its tenant;
- ``admin``: everything in its tenant, including views, exports, tags, bulk ingest,
  quarantine, purge and the tenant's tokens.

A token may have an expiry (``create(..., expires="30d")``, ``trellis token create --expires``):
from then on :meth:`Tokens.lookup` refuses it with an ``AccessError`` naming the moment.

>>> import tempfile
>>> reg = Tokens(tempfile.mkdtemp())
>>> secret = reg.create("acme", "agent", name="worker-1")
>>> reg.lookup(secret)
Principal(name='worker-1', tenant='acme', role='agent')
>>> reg.lookup("not-a-token") is None
True
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trellisdb.errors import AccessError, CorruptionError, ValidationError

ROLES = ("agent", "analyst", "admin")
DEFAULT_TENANT = "default"
TOKENS_FILE = "tokens.json"
TENANTS_DIR = "tenants"
#: A tenant (and token) name: a folder name on every system, never a path.
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
#: A token's lifetime: a number and a unit (seconds, minutes, hours, days, weeks).
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: What each role may do, for refusals.
ROLE_HELP = ("agent: read, and write its own sessions; analyst: read; admin: also any session, views, exports, "
             "tags, ingest, quarantine, purge, tokens")


@dataclass(frozen=True)
class Principal:
    """Who a request is: the token's name, its tenant and its role; ``key``, the token's SHA-256
    (what a server keys per-token state by: a token made again under a revoked one's name has
    another), and ``expires``, when it stops working (None: never). Two principals are equal by
    name, tenant and role."""

    name: str
    tenant: str
    role: str
    key: str = field(default="", repr=False, compare=False)
    expires: dt.datetime | None = field(default=None, repr=False, compare=False)

    def may(self, need: str) -> bool:
        """Whether the role allows ``need`` (``read``, ``write`` or ``admin``)."""
        allowed = {"analyst": ("read",), "agent": ("read", "write"), "admin": ("read", "write", "admin")}
        return need in allowed[self.role]

    def refusal(self, need: str) -> str:
        """Why this principal may not do what needs ``need``."""
        return (f"token {self.name!r} is an {self.role} of tenant {self.tenant!r}; this needs the {need} right "
                f"({ROLE_HELP})")

    def require(self, need: str) -> None:
        """Raise ``AccessError`` unless the role allows ``need``."""
        if not self.may(need):
            raise AccessError(self.refusal(need))

    def same_token(self, other: Principal | None) -> bool:
        """Whether ``other`` is this very token (not another made under its name)."""
        return other is not None and (self.name, self.tenant, self.key) == (other.name, other.tenant, other.key)


def check_tenant(name: object) -> str:
    """``name`` if it can name a tenant (lower-case letters, digits, ``-``, ``_``; at most 63)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValidationError(f"tenant {name!r}: use 1-63 lower-case letters, digits, '-' or '_', starting "
                              "with a letter or digit")
    return name


def tenant_path(root: str, tenant: str) -> str:
    """The folder of ``tenant``'s store in the served folder ``root``."""
    check_tenant(tenant)
    return root if tenant == DEFAULT_TENANT else os.path.join(root, TENANTS_DIR, tenant)


def token_key(token: str) -> str:
    """The SHA-256 of ``token``: what the registry keeps, and :attr:`Principal.key`."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()



#: The furthest ahead a token may expire.
MAX_EXPIRY = dt.timedelta(days=100 * 365)


def expiry(value: object, now: dt.datetime | None = None) -> dt.datetime | None:
    """When a token made ``now`` with ``expires=value`` stops working (UTC): a duration
    (``"90s"``, ``"30m"``, ``"12h"``, ``"30d"``, ``"2w"``), an ISO time with its zone
    (``"2027-01-01T00:00:00Z"``), an aware datetime, or None (never). It must lie ahead.

    >>> start = dt.datetime(2027, 1, 1, tzinfo=dt.UTC)
    >>> expiry("12h", start).isoformat(), expiry("2027-02-01T00:00:00+01:00", start).isoformat()
    ('2027-01-01T12:00:00+00:00', '2027-01-31T23:00:00+00:00')
    """
    if value is None:
        return None
    now = now or dt.datetime.now(dt.UTC)
    when: dt.datetime | None = value if isinstance(value, dt.datetime) else None
    far = ValidationError(f"expires {value!r:.80}: too far ahead; give at most {MAX_EXPIRY.days // 365} years "
                          "(or no expiry)")
    if isinstance(value, str):
        m = _DURATION.fullmatch(value.strip())
        if m:
            seconds = float(m.group(1)) * _UNIT[m.group(2)]
            if not seconds <= MAX_EXPIRY.total_seconds():
                raise far
            when = now + dt.timedelta(seconds=seconds)
        else:
            try:
                when = dt.datetime.fromisoformat(value.strip())
            except ValueError:
                when = None
    if when is None or when.tzinfo is None:
        raise ValidationError(f"expires {value!r:.80}: give a duration (90s, 30m, 12h, 30d, 2w) or an ISO time with "
                              "its zone (2027-01-01T00:00:00Z)")
    try:
        when = when.astimezone(dt.UTC)
    except OverflowError:  # a time at the end of the calendar, in a zone behind UTC
        raise far from None
    if when - now > MAX_EXPIRY:
        raise far
    if when <= now:
        raise ValidationError(f"expires {value!r:.80}: {when.isoformat(timespec='seconds')} has passed; give a "
                              "moment ahead")
    return when


def _principal(e: dict[str, Any]) -> Principal:
    expires = e.get("expires")
    return Principal(e["name"], e["tenant"], e["role"], key=e["sha256"],
                     expires=None if expires is None else dt.datetime.fromisoformat(expires))


class Tokens:
    """The token registry of a served folder (see the module notes); safe across threads, and
    across processes that write it one at a time (``trellis token`` while a server runs: the
    server reads the file again when it changes)."""

    def __init__(self, root: str) -> None:
        self.path = os.path.join(root, TOKENS_FILE)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._entries: list[dict[str, Any]] = []
        self._by_hash: dict[str, Principal] = {}

    def _load(self) -> None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._entries, self._by_hash = None, [], {}
            return
        if self._seen == (st.st_ino, st.st_mtime_ns, st.st_size):
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
            entries = list(data["tokens"])
            by_hash = {e["sha256"]: _principal(e) for e in entries}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptionError(f"{self.path} is damaged ({e}); restore it from a backup or remove it and make "
                                  "new tokens with `trellis token create`") from None
        self._seen, self._entries, self._by_hash = (st.st_ino, st.st_mtime_ns, st.st_size), entries, by_hash

    @contextlib.contextmanager
    def _file_lock(self) -> Iterator[None]:
        """Held while the registry is read and rewritten: a ``trellis token`` and a server's
        ``POST /v1/tokens`` never lose each other's change."""
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._seen = None  # another process may have changed it: read it again
            yield
        finally:
            os.close(fd)

    def _save(self) -> None:
        tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"tokens": self._entries}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
        self._seen = None

    def enabled(self) -> bool:
        """Whether any token exists (a server with none and no ``--token`` is open to all)."""
        with self._lock:
            self._load()
            return bool(self._entries)

    def lookup(self, token: str) -> Principal | None:
        """The principal of ``token`` (None: no such token); an expired one raises
        ``AccessError`` naming its expiry."""
        with self._lock:
            self._load()
            who = self._by_hash.get(token_key(token))
        if who is not None and who.expires is not None and who.expires <= dt.datetime.now(dt.UTC):
            raise AccessError(f"token {who.name!r} of tenant {who.tenant!r} expired at "
                              f"{who.expires.isoformat(timespec='seconds')}; ask an admin for a new one "
                              "(`trellis token create`, POST /v1/tokens)")
        return who

    def active_keys(self) -> frozenset[str]:
        """The SHA-256 of every token that works now (not revoked, not expired)."""
        now = dt.datetime.now(dt.UTC)
        with self._lock:
            self._load()
            return frozenset(k for k, who in self._by_hash.items() if who.expires is None or who.expires > now)

    def create(self, tenant: str, role: str, *, name: str | None = None, expires: object = None) -> str:
        """Make a token for ``role`` in ``tenant``; return it (it is not kept: show it once).
        ``expires``: when it stops working (see :func:`expiry`; None: never)."""
        check_tenant(tenant)
        if role not in ROLES:
            raise ValidationError(f"role {role!r}: roles are {', '.join(ROLES)}")
        until = expiry(expires)
        token = f"trl_{secrets.token_urlsafe(32)}"
        with self._lock, self._file_lock():
            self._load()
            name = name or f"{tenant}-{role}-{secrets.token_hex(3)}"
            if not _NAME.fullmatch(name):
                raise ValidationError(f"token name {name!r}: use 1-63 lower-case letters, digits, '-' or '_'")
            if any(e["name"] == name for e in self._entries):
                raise ValidationError(f"a token named {name!r} exists; revoke it first or choose another name")
            self._entries.append({"name": name, "tenant": tenant, "role": role, "sha256": token_key(token),
                                  "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                                  **({} if until is None else {"expires": until.isoformat(timespec="seconds")})})
            self._save()
        return token

    def list(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """The tokens (name, tenant, role, created, expires: None for never; never the token), of
        one tenant or all."""
        with self._lock:
            self._load()
            return [_listed(e) for e in self._entries if tenant is None or e["tenant"] == tenant]

    def has_tenant(self, tenant: str) -> bool:
        """Whether some token is bound to ``tenant``."""
        with self._lock:
            self._load()
            return any(e["tenant"] == tenant for e in self._entries)

    def revoke_tenant(self, tenant: str) -> tuple[str, ...]:
        """Remove every token of ``tenant``; their names."""
        with self._lock, self._file_lock():
            self._load()
            gone = tuple(e["name"] for e in self._entries if e["tenant"] == tenant)
            self._entries = [e for e in self._entries if e["tenant"] != tenant]
            self._save()
        return gone

    def revoke(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        """Remove token ``name`` (of ``tenant``, when given); what it was."""
        with self._lock, self._file_lock():
            self._load()
            hit = [e for e in self._entries if e["name"] == name and (tenant is None or e["tenant"] == tenant)]
            if not hit:
                raise ValidationError(f"no token named {name!r}" + (f" in tenant {tenant!r}" if tenant else ""))
            self._entries = [e for e in self._entries if e is not hit[0]]
            self._save()
        return _listed(hit[0])


def _listed(e: dict[str, Any]) -> dict[str, Any]:
    """A registry entry as listed: never its hash."""
    return {**{k: e[k] for k in ("name", "tenant", "role", "created")}, "expires": e.get("expires")}
