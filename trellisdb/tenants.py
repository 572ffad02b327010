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
from dataclasses import dataclass
from typing import Any

from trellisdb.errors import CorruptionError, ValidationError

ROLES = ("agent", "analyst", "admin")
DEFAULT_TENANT = "default"
TOKENS_FILE = "tokens.json"
TENANTS_DIR = "tenants"
#: A tenant (and token) name: a folder name on every system, never a path.
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")


@dataclass(frozen=True)
class Principal:
    """Who a request is: the token's name, its tenant and its role."""

    name: str
    tenant: str
    role: str

    def may(self, need: str) -> bool:
        """Whether the role allows ``need`` (``read``, ``write`` or ``admin``)."""
        allowed = {"analyst": ("read",), "agent": ("read", "write"), "admin": ("read", "write", "admin")}
        return need in allowed[self.role]


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


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


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
            by_hash = {e["sha256"]: Principal(e["name"], e["tenant"], e["role"]) for e in entries}
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
        """The principal of ``token`` (None: no such token)."""
        with self._lock:
            self._load()
            return self._by_hash.get(_digest(token))

    def create(self, tenant: str, role: str, *, name: str | None = None) -> str:
        """Make a token for ``role`` in ``tenant``; return it (it is not kept: show it once)."""
        check_tenant(tenant)
        if role not in ROLES:
            raise ValidationError(f"role {role!r}: roles are {', '.join(ROLES)}")
        token = f"trl_{secrets.token_urlsafe(32)}"
        with self._lock, self._file_lock():
            self._load()
            name = name or f"{tenant}-{role}-{secrets.token_hex(3)}"
            if not _NAME.fullmatch(name):
                raise ValidationError(f"token name {name!r}: use 1-63 lower-case letters, digits, '-' or '_'")
            if any(e["name"] == name for e in self._entries):
                raise ValidationError(f"a token named {name!r} exists; revoke it first or choose another name")
            self._entries.append({"name": name, "tenant": tenant, "role": role, "sha256": _digest(token),
                                  "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")})
            self._save()
        return token

    def list(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """The tokens (name, tenant, role, created; never the token), of one tenant or all."""
        with self._lock:
            self._load()
            return [{k: e[k] for k in ("name", "tenant", "role", "created")} for e in self._entries
                    if tenant is None or e["tenant"] == tenant]

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
        return {k: hit[0][k] for k in ("name", "tenant", "role", "created")}
