"""Where an export may write, and what it may replace.

An export writes one folder. Three rules keep it from damaging anything else:

- **Confinement** (exports named in TQL or on the command line): the path is
  relative to the handle's *export root* (``connect(export_root=...)``,
  default ``<db>/exports``), and stays inside it: no absolute path, no ``..``,
  no NUL or control character, and no symbolic link that leads out of it.
  Whoever opens the store sets the root; a query never can.
- **The store is never a target**: no export folder lies inside the database
  folder (but for its ``exports/`` folder), and none contains it.
- **Overwrite replaces only an export**: ``overwrite=True`` replaces a folder
  that a previous export wrote (it carries that export's ``manifest.json``),
  never a file, a link or any other folder.

A path the file system cannot hold is refused before anything is written (``check_length``):
a name longer than the folder's file system allows (``NAME_MAX``, 255 bytes on most), a path
longer than ``PATH_MAX`` (4,095 bytes), or more than :data:`MAX_DEPTH` folders deep. Should the
file system still refuse a name (``ENAMETOOLONG``, a link loop, a file where a folder must be),
``path_error`` turns that into an ``ExportError`` too: the caller's path, never the server's
fault.

    >>> import os, tempfile
    >>> store = tempfile.mkdtemp()
    >>> confined(os.path.join(store, "exports"), store, "pairs/v1") == os.path.join(
    ...     os.path.realpath(store), "exports", "pairs", "v1")
    True
    >>> confined(os.path.join(store, "exports"), store, "../tables")
    Traceback (most recent call last):
    ...
    trellisdb.errors.ExportError: export path '../tables' must stay inside the export root: no '..' (write a path such as 'pairs' or 'runs/pairs')
    >>> confined(os.path.join(store, "exports"), store, "x" * 5000)
    Traceback (most recent call last):
    ...
    trellisdb.errors.ExportError: export path 'xxxxxxxxxxxxxxxxxxxxxxxx'...'xxxxxxxxxxxxxxxxxxxxxxxx' (5000 characters): the name 'xxxxxxxxxxxxxxxxxxxxxxxx'... is 5000 bytes long; a name is at most 255 bytes here: choose a shorter one
"""

from __future__ import annotations

import errno
import json
import os

from trellisdb.errors import ExportError, ValidationError
from trellisdb.names import check_text

MANIFEST = "manifest.json"
#: The longest path and folder name, in bytes, where the file system does not say (``os.pathconf``):
#: Linux's ``PATH_MAX`` (4,096 with the final NUL) and ``NAME_MAX``.
PATH_MAX_BYTES = 4095
NAME_MAX_BYTES = 255
#: The most folders an export path may go through (from the file system's root): far above any
#: real layout, and below what creating the folders one by one can take.
MAX_DEPTH = 128
#: What the file system says about a path that cannot be (a name or path too long, a link loop, a
#: file where a folder must be): the caller's path, reported as an ``ExportError``.
PATH_ERRNOS = frozenset({errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR, errno.EEXIST, errno.EISDIR})
#: Keys every export manifest has (manifests before ``trellisdb_export`` was written carry these).
_MANIFEST_KEYS = {"view", "format", "commit", "files"}


def _inside(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies under it (both absolute and resolved)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def default_root(store: str) -> str:
    return os.path.join(os.path.abspath(store), "exports")


def check_root(root: str, store: str) -> str:
    """The export root as an absolute path, refused if it lies inside the store (but for
    its ``exports/`` folder)."""
    try:
        check_text(root, "export_root", optional=False)
        if "\x00" in root:
            raise ValidationError(f"export_root {root!r} contains a NUL character")
        real = os.path.realpath(root)
    except (TypeError, ValueError) as e:
        raise ValidationError(f"export_root {root!r} is not a usable path ({e})") from None
    s = os.path.realpath(store)
    if _inside(real, s) and not _inside(real, os.path.join(s, "exports")):
        raise ValidationError(
            f"export_root {root!r} lies inside the database folder {store!r}; use its exports/ folder "
            "(the default) or a folder outside it"
        )
    return os.path.abspath(root)


def confined(root: str, store: str, path: object) -> str:
    """The absolute folder that an export named ``path`` (as a query or the CLI gives it)
    writes under ``root``; ``ExportError`` when it would leave the root or touch the store."""
    if not isinstance(path, str):
        raise ExportError(f"an export path is text, e.g. 'pairs' or 'runs/pairs', not {type(path).__name__}")
    try:
        check_text(path, "export path", optional=False)
    except ValidationError as e:
        raise ExportError(str(e)) from None
    hint = "(write a path such as 'pairs' or 'runs/pairs')"
    if not path.strip():
        raise ExportError(f"export path {path!r} is empty {hint}")
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ExportError(f"export path {path!r} contains a NUL or control character {hint}")
    if os.path.isabs(path) or path.startswith("~"):
        raise ExportError(
            f"export path {path!r} must be relative to the export root {root!r}, not absolute {hint}; "
            "the root is set by whoever opens the database (connect(export_root=...), trellis --export-root)"
        )
    parts = path.replace("\\", "/").split("/")
    if ".." in parts:
        raise ExportError(f"export path {path!r} must stay inside the export root: no '..' {hint}")
    parts = [p for p in parts if p not in ("", ".")]
    if not parts:
        raise ExportError(f"export path {path!r} names the export root itself {hint}")
    if len(parts) > MAX_DEPTH:
        raise ExportError(f"export path {_short(path)} goes {len(parts)} folders deep; at most {MAX_DEPTH} {hint}")
    real_root = os.path.realpath(root)
    target = os.path.join(real_root, *parts)
    check_length(path, target)  # before any file system call on it: those fail on a name too long
    # a symbolic link on the way (or as the folder itself) must not lead out of the root
    if not _inside(os.path.realpath(os.path.dirname(target)), real_root) or os.path.islink(target):
        raise ExportError(f"export path {path!r} leads out of the export root {root!r} through a symbolic link")
    check_target(store, target)
    return target


def _short(path: str) -> str:
    """``path`` for a message: a long one cut in the middle (its start and its end), with its length."""
    return repr(path) if len(path) <= 160 else f"{path[:24]!r}...{path[-24:]!r} ({len(path)} characters)"


def _limit(folder: str, name: str, default: int) -> int:
    """The file system's ``pathconf`` limit ``name`` for the nearest existing folder of ``folder``."""
    while folder and not os.path.isdir(folder):
        up = os.path.dirname(folder)
        if up == folder:
            break
        folder = up
    try:
        got = os.pathconf(folder or os.sep, name)
    except (OSError, ValueError, AttributeError):  # not on every platform or file system
        return default
    return got if got > 0 else default


def check_length(path: str, target: str) -> None:
    """Refuse an export ``target`` (absolute, written for the caller's ``path``) that the file
    system cannot hold: a folder name over ``NAME_MAX`` bytes, the whole over ``PATH_MAX``, or
    deeper than :data:`MAX_DEPTH` (``ExportError``, naming the part)."""
    hint = "choose a shorter one"
    names = [p for p in target.split(os.sep) if p]
    if len(names) > MAX_DEPTH:
        raise ExportError(f"export path {_short(path)} is {len(names)} folders deep; at most {MAX_DEPTH}: {hint}")
    parent = os.path.dirname(target)
    most_name = _limit(parent, "PC_NAME_MAX", NAME_MAX_BYTES)
    for name in names:
        n = len(name.encode("utf-8", "surrogateescape"))
        if n > most_name:
            cut = repr(name) if len(name) <= 24 else f"{name[:24]!r}..."
            raise ExportError(f"export path {_short(path)}: the name {cut} is {n} bytes long; a name is at most "
                              f"{most_name} bytes here: {hint}")
    most_path = min(PATH_MAX_BYTES, _limit(parent, "PC_PATH_MAX", PATH_MAX_BYTES + 1) - 1)
    n = len(target.encode("utf-8", "surrogateescape"))
    if n > most_path:
        raise ExportError(f"export path {_short(path)} makes a path {n} bytes long; a path is at most {most_path} "
                          f"bytes here: {hint}")


def path_error(path: object, e: OSError) -> ExportError | None:
    """The ``ExportError`` for what the file system said writing the export at ``path``, when it
    is about the path itself (:data:`PATH_ERRNOS`); None for anything else (a full disk, a
    permission), which is the host's to mend."""
    if e.errno not in PATH_ERRNOS:
        return None
    shown = _short(path) if isinstance(path, str) else repr(path)
    return ExportError(f"export path {shown} cannot be written there ({e.strerror or e}); choose another path")


def check_target(store: str, target: str) -> None:
    """Refuse a target inside the database folder (but for its ``exports/`` folder) or one
    that contains it."""
    real = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(target))), os.path.basename(target))
    s = os.path.realpath(store)
    if _inside(s, real):
        raise ExportError(f"export path {target!r} contains the database folder {store!r}; choose another folder")
    exports = os.path.join(s, "exports")
    if _inside(real, s) and (real == exports or not _inside(real, exports)):
        raise ExportError(
            f"export path {target!r} lies inside the database folder {store!r}; exports go to its exports/ "
            "folder or outside it"
        )


def replaceable(target: str) -> None:
    """Refuse to replace ``target`` unless it is a folder a previous export wrote."""
    if os.path.islink(target) or not os.path.isdir(target):
        raise ExportError(
            f"{target} exists and is not an export folder; overwrite only replaces a folder a previous export "
            "wrote (with its manifest.json). Choose another path"
        )
    try:
        with open(os.path.join(target, MANIFEST), encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError):
        manifest = None
    if not isinstance(manifest, dict) or not (manifest.get("trellisdb_export") or set(manifest) >= _MANIFEST_KEYS):
        raise ExportError(
            f"{target} exists and holds no export manifest ({MANIFEST}); overwrite only replaces a folder a "
            "previous export wrote. Choose another path"
        )
