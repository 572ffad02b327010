"""OpenEvolve runs: ``checkpoints/checkpoint_<k>/`` folders, one commit (and tag) per checkpoint.

OpenEvolve saves its program database every few iterations as a checkpoint folder: a
``metadata.json`` (islands, archive, MAP-Elites feature map, best program id, last iteration)
and ``programs/<id>.json`` (code, parent, metrics, prompts). A checkpoint repeats every program
still in the population, so the import writes each program once, at its first appearance, and
each checkpoint's memberships (population, islands, archive, best, MAP-Elites elites) as
*changes* of labels: as of the tag ``checkpoint_<k>`` the labels are exactly that checkpoint's
sets. See ``docs/import-openevolve.md`` for the whole mapping.

The path may be the run's output folder (holding ``checkpoints/``), the ``checkpoints`` folder,
or one checkpoint folder (then that checkpoint alone is imported, as its own source).

>>> _summary("Full rewrite\\nof the constructor")
'Full rewrite'
>>> _json_safe({"score": float("nan"), "ok": (1, 2)})
{'score': 'NaN', 'ok': [1, 2]}
"""

from __future__ import annotations

import ast
import contextlib
import datetime as dt
import hashlib
import heapq
import inspect
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from trellisdb.errors import ImportFormatError, TrellisWarning, ValidationError
from trellisdb.importers.units import (
    SURROGATE_ESCAPE_BYTES,
    Unit,
    broken_link,
    inside,
    json_path,
    lone_surrogate,
    outside_error,
    unreadable,
)
from trellisdb.names import check_name, did_you_mean
from trellisdb.rules import INT64_MAX

__all__ = ["IncompleteCheckpointWarning", "source_name", "units"]

#: The options ``units`` takes (``import_run(db, "openevolve", path, **options)``).
OPTIONS = ("task", "tag_prefix", "session")

#: A checkpoint folder's name: ``checkpoint_<k>``, k written as OpenEvolve writes it (no leading zeros).
_CHECKPOINT = re.compile(r"checkpoint_(0|[1-9][0-9]{0,17})")  # at most 18 digits: k fits in 64 bits

#: Top-level fields of a program file the import maps itself; any other becomes an attribute.
_PROGRAM_FIELDS = frozenset({"id", "code", "language", "parent_id", "timestamp", "metrics", "metadata",
                             "prompts", "artifacts_json"})
#: Metadata fields that are memberships (labels), not run-level state (commit meta).
_MEMBERSHIP_FIELDS = frozenset({"islands", "archive", "feature_map", "island_feature_maps"})

#: Media type of a program's code by its ``language``.
_MEDIA = {"python": "text/x-python", "javascript": "text/javascript", "typescript": "text/x-typescript",
          "rust": "text/x-rust", "c": "text/x-c", "cpp": "text/x-c++", "c++": "text/x-c++", "java": "text/x-java",
          "go": "text/x-go", "r": "text/x-r", "julia": "text/x-julia"}

#: Attributes above this size as JSON go to an artifact of the node instead (the write API's limit).
_ATTR_MAX_BYTES = 64 * 1024
#: Commit meta is refused above 64 KiB; the import keeps below this.
_META_BUDGET = 60 * 1024
#: A node's summary: the first line of its ``changes``, at most this many characters.
_SUMMARY_CHARS = 200

VERIFIER = "openevolve"
SOURCE = "openevolve"


class IncompleteCheckpointWarning(TrellisWarning):
    """The last checkpoint folder has no ``metadata.json`` (OpenEvolve writes it last, so the
    checkpoint is still being written, or the run stopped while writing it): it is not imported
    now; importing again once it is complete imports it. The message names the folder; the
    warning is raised when the import starts, at the caller's line (``import_run``)."""


# ------------------------------------------------------------------ layout


@dataclass(frozen=True)
class _Layout:
    run: str  # the run's output folder (names the task and the session)
    source: str  # what identifies the import (absolute path): the run folder, or the one checkpoint
    checkpoints: list[tuple[int, str]]  # (k, folder), ascending
    single: bool  # one checkpoint folder was given


def _listed(it: Iterator[os.DirEntry[str]], wanted: Callable[[str], bool], folders: bool) -> Iterator[os.DirEntry[str]]:
    """The entries of a folder listing whose name is ``wanted`` and that are folders (``folders``)
    or files; a symbolic link among them that cannot be followed (a loop, a link to nothing) raises
    ``ImportFormatError`` naming it rather than being passed over."""
    for entry in it:
        if not wanted(entry.name):
            continue
        try:
            kind = entry.is_dir() if folders else entry.is_file()
        except OSError as e:  # a link loop
            raise unreadable(entry.path, e) from None
        if kind:
            yield entry
        elif (bad := broken_link(entry.path)) is not None:
            raise bad


def _checkpoint_dirs(folder: str) -> list[tuple[int, str]]:
    """The ``checkpoint_<k>`` sub-folders of ``folder``, ascending by k (anything else is ignored)."""
    try:
        it = os.scandir(folder)
    except OSError as e:
        raise unreadable(folder, e) from None
    with it:
        found = _listed(it, lambda n: _CHECKPOINT.fullmatch(n) is not None, folders=True)
        out = [(int(e.name.rsplit("_", 1)[1]), e.path) for e in found]
    return sorted(out)


def _layout(path: str) -> _Layout:
    for link in (path, os.path.join(path, "checkpoints")):  # a loop or a link to nothing: not "no checkpoints"
        if (bad := broken_link(link)) is not None:
            raise bad
    p = os.path.realpath(path)
    if not os.path.isdir(p):
        raise ImportFormatError(f"{path}: an OpenEvolve run is a folder (the output folder holding checkpoints/, "
                                "the checkpoints folder, or one checkpoint_<k> folder)")
    sub = os.path.join(p, "checkpoints")
    if os.path.isdir(sub):
        return _Layout(p, p, _checkpoint_dirs(sub), False)
    found = _checkpoint_dirs(p)
    if found:
        run = os.path.dirname(p) if os.path.basename(p) == "checkpoints" else p
        return _Layout(run, run, found, False)
    m = _CHECKPOINT.fullmatch(os.path.basename(p))
    if m or os.path.exists(os.path.join(p, "metadata.json")):
        parent = os.path.dirname(p)
        run = os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else parent
        k = int(m.group(1)) if m else _last_iteration(os.path.join(p, "metadata.json"))
        return _Layout(run, p, [(k, p)], True)
    raise ImportFormatError(f"{path}: no OpenEvolve checkpoints here (no checkpoints/ folder, no checkpoint_<k> "
                            "folders, no metadata.json); give the run's output folder")


def _last_iteration(meta_path: str) -> int:
    meta = _mapping(_read_json(meta_path), meta_path, "metadata")
    k = meta.get("last_iteration")
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= INT64_MAX:
        raise ImportFormatError(f"{meta_path}: the folder is not named checkpoint_<k> and last_iteration is "
                                f"{k!r}, not an iteration number")
    return k


# ------------------------------------------------------------------ reading files


def _json_error(where: str, e: json.JSONDecodeError) -> ImportFormatError:
    return ImportFormatError(f"{where}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})")


def _parse(data: bytes, where: str) -> Any:
    try:
        value = json.loads(data)
    except json.JSONDecodeError as e:
        raise _json_error(where, e) from None
    except UnicodeDecodeError as e:
        raise ImportFormatError(f"{where}: not UTF-8 text at byte {e.start}; OpenEvolve writes JSON") from None
    except (ValueError, RecursionError) as e:  # a number of thousands of digits; nesting too deep
        why = "values nested too deeply" if isinstance(e, RecursionError) else str(e)
        raise ImportFormatError(f"{where}: JSON this reader cannot take ({why})") from None
    if SURROGATE_ESCAPE_BYTES.search(data):
        _no_surrogates(value, where, "")
    return value


def _no_surrogates(value: Any, where: str, name: str) -> None:
    """Refuse a string (or key) of ``value`` that UTF-8 cannot hold (a lone surrogate, which JSON
    and Python literals can escape), naming where it is."""
    bad = lone_surrogate(value)
    if bad is not None:
        at = ".".join(x for x in (name, json_path(bad[0])) if x) or "the file"
        at = at.encode("utf-8", "backslashreplace").decode()
        raise ImportFormatError(f"{where}: {at} is not valid UTF-8 text ({bad[1]}); the file escapes half of a "
                                "UTF-16 surrogate pair, which no text can hold")


def _read_json(where: str) -> Any:
    try:
        with open(where, "rb") as f:
            data = f.read()
    except OSError as e:
        raise unreadable(where, e) from None
    return _parse(data, where)


def _literal(text: str) -> Any:
    """A Python literal as ``repr`` writes it (``nan`` and ``inf`` too), or ValueError."""
    tree = ast.parse(text.strip(), mode="eval")

    class Floats(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> ast.AST:
            if node.id in ("nan", "inf"):
                return ast.copy_location(ast.Constant(float(node.id)), node)
            return node

    return ast.literal_eval(Floats().visit(tree))


def _structured(value: Any, where: str, name: str) -> Any:
    """``value``, or the list / mapping a string holds as JSON or as a Python ``repr`` (some
    OpenEvolve versions write sets, tuples or whole dicts that way); sets become sorted lists."""
    if not isinstance(value, str) or value.lstrip()[:1] not in ("[", "{", "("):
        return value  # parsed JSON holds no sets or tuples
    try:
        out = json.loads(value)
    except (ValueError, RecursionError):
        try:
            out = _plain(_literal(value))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            raise ImportFormatError(f"{where}: {name} is a string that is neither JSON nor a Python literal: "
                                    f"{value[:80]!r}") from None
    _no_surrogates(out, where, name)
    return out


def _plain(value: Any) -> Any:
    """Sets and tuples (from a Python literal) as lists; sets sorted, for a deterministic import."""
    if isinstance(value, set | frozenset):
        return sorted((_plain(v) for v in value), key=repr)
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _mapping(value: Any, where: str, name: str) -> dict[str, Any]:
    value = _structured(value, where, name)
    if not isinstance(value, dict):
        raise ImportFormatError(f"{where}: {name} is a {type(value).__name__}, not a JSON object")
    return value


def _ids(value: Any, where: str, name: str) -> list[str]:
    """A list of program ids (null entries dropped)."""
    value = _structured(value, where, name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(v is None or isinstance(v, str) for v in value):
        raise ImportFormatError(f"{where}: {name} is not a list of program ids: {str(value)[:80]!r}")
    return [v for v in value if v is not None]


def _json_safe(value: Any) -> Any:
    """``value`` as JSON values: a non-finite float as the text JSON would need (``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``), an integer beyond a double's range as its decimal text,
    keys as strings, anything else exotic as its ``repr``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > _DOUBLE_MAX:
        return str(value)
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(v) for v in _plain(value)]
    return repr(value)


def _dumps(value: Any) -> str:
    """``value`` as JSON text (keys sorted); scalars without the encoder's per-call setup."""
    if isinstance(value, str):
        return str(_ENCODE_STR(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return repr(value)
    return json.dumps(value, sort_keys=True, allow_nan=False, ensure_ascii=False)


#: The largest finite double (an integer beyond it has no number an attribute can hold).
_DOUBLE_MAX = sys.float_info.max

#: JSON text of a string, as ``json.dumps(s, ensure_ascii=False)`` writes it
_ENCODE_STR: Any = getattr(json.encoder, "c_encode_basestring", None) or json.encoder.py_encode_basestring


def _utf8(text: str, where: str, what: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ImportFormatError(f"{where}: {what} is not valid UTF-8 text (a lone surrogate at {e.start})") from None


def _time(value: Any, where: str, name: str) -> dt.datetime | None:
    """Epoch seconds as a UTC time (None: not given)."""
    if value is None:
        return None
    try:
        finite = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an integer beyond a double's range
        finite = False
    if not finite:
        raise ImportFormatError(f"{where}: {name} is {str(value)[:40]}, not seconds since the epoch")
    try:
        return dt.datetime.fromtimestamp(value, dt.UTC)
    except (OverflowError, OSError, ValueError):
        raise ImportFormatError(f"{where}: {name} {value!r} is out of range for a time") from None


def _summary(changes: Any) -> str | None:
    """The first non-empty line of a program's ``changes``, cut to ``_SUMMARY_CHARS``."""
    if not isinstance(changes, str):
        return None
    line = next((s.strip() for s in changes.splitlines() if s.strip()), "")
    if not line:
        return None
    return line if len(line) <= _SUMMARY_CHARS else line[: _SUMMARY_CHARS - 1] + "…"


# ------------------------------------------------------------------ one program


@dataclass
class _Facts:
    """What a program file says about its node besides the node row and its parent edge."""

    rewards: dict[str, float] = field(default_factory=dict)
    attrs: dict[str, str] = field(default_factory=dict)  # key -> JSON text
    artifacts: dict[str, tuple[str, str, bytes]] = field(default_factory=dict)  # name -> (hash, media, content)


@dataclass
class _Program:
    id: str
    parent_id: str | None
    iteration: int
    timestamp: float
    at: dt.datetime | None
    node: dict[str, Any]
    facts: _Facts


def _artifact(facts: _Facts, name: str, media: str, content: bytes) -> None:
    facts.artifacts[name] = (hashlib.sha256(content).hexdigest(), media, content)


def _attr(facts: _Facts, key: str, value: Any, where: str) -> None:
    if value is None:
        return
    text = _dumps(_json_safe(value))
    if len(text) > _ATTR_MAX_BYTES // 4 and len(text.encode()) > _ATTR_MAX_BYTES:  # bulky: an artifact of the node, as the write API asks
        _artifact(facts, key, "application/json", _utf8(text, where, key))
    else:
        facts.attrs[key] = text


def _program(raw: Any, where: str, stem: str, session: str, task: str) -> _Program:
    """The rows of one program file (``where``; its name's stem ``stem``)."""
    if not isinstance(raw, dict):
        raise ImportFormatError(f"{where}: a program file holds a JSON object, not a {type(raw).__name__}")
    pid = raw.get("id")
    if pid != stem:
        raise ImportFormatError(f"{where}: the file holds program id {pid!r}; OpenEvolve names each program file "
                                "<id>.json (a renamed or copied file?)")
    parent = raw.get("parent_id")
    if parent is not None and not isinstance(parent, str):
        raise ImportFormatError(f"{where}: parent_id is {parent!r}, not a program id")
    parent = parent or None
    metadata = _mapping(raw.get("metadata") or {}, where, "metadata")
    metrics = _mapping(raw.get("metrics") or {}, where, "metrics")
    prompts = _mapping(raw.get("prompts") or {}, where, "prompts")
    it = raw.get("iteration_found")
    if it is not None and (isinstance(it, bool) or not isinstance(it, int) or not 0 <= it <= INT64_MAX):
        raise ImportFormatError(f"{where}: iteration_found is {str(it)[:40]}, not an iteration number (a whole "
                                f"number from 0 to {INT64_MAX})")
    ts = raw.get("timestamp")
    at = _time(ts, where, "timestamp")
    facts = _Facts()
    for name, v in metrics.items():  # numbers are rewards; anything else (an error text, a flag, NaN) an attribute
        if isinstance(v, int | float) and not isinstance(v, bool):
            try:
                x = float(v)
            except OverflowError:  # an integer beyond a double's range: kept as its text
                x = math.nan
            if math.isfinite(x):
                facts.rewards[str(name)] = x
                continue
        _attr(facts, f"metric.{name}", v, where)
    for key in ("generation", "iteration_found", "complexity", "diversity", "language"):
        _attr(facts, key, raw.get(key), where)
    for key, v in raw.items():
        if key not in _PROGRAM_FIELDS and key not in facts.attrs:
            _attr(facts, key, v, where)
    for key, v in metadata.items():
        name = key if key not in facts.attrs and key not in _PROGRAM_FIELDS else f"metadata.{key}"
        _attr(facts, name, _structured(v, where, f"metadata.{key}") if key == "parent_metrics" else v, where)
    code = raw.get("code")
    if isinstance(code, str):
        lang = raw.get("language")
        media = _MEDIA.get(lang.lower(), "text/plain") if isinstance(lang, str) else "text/plain"
        _artifact(facts, "code", media, _utf8(code, where, "code"))
    for template, texts in sorted(prompts.items()):
        texts = _mapping(texts, where, f"prompts.{template}")
        for key, v in sorted(texts.items()):
            if key == "responses":
                responses = _structured(v, where, f"prompts.{template}.responses")
                if isinstance(responses, str):  # one response, not in a list
                    responses = [responses]
                if responses is not None and not isinstance(responses, list):
                    raise ImportFormatError(f"{where}: prompts.{template}.responses is a {type(responses).__name__}, "
                                            "not a list of texts")
                for i, r in enumerate(responses or []):
                    if isinstance(r, str) and r:
                        _artifact(facts, f"response/{template}/{i}", "text/plain", _utf8(r, where, "a response"))
            elif isinstance(v, str) and v:
                _artifact(facts, f"prompt/{template}/{key}", "text/plain", _utf8(v, where, f"prompt {key}"))
    evals = raw.get("artifacts_json")
    if evals is not None:
        text = evals if isinstance(evals, str) else _dumps(_json_safe(evals))
        _artifact(facts, "artifacts_json", "application/json", _utf8(text, where, "artifacts_json"))
    node = {"id": pid, "session_id": session, "task_id": task, "kind": "program", "step": it, "status": "evaluated",
            "summary": _summary(metadata.get("changes")), "source": SOURCE, "event_time": at}
    tsf = float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else 0.0
    return _Program(pid, parent, it if it is not None else 0, tsf, at, node, facts)


def _topological(new: dict[str, _Program]) -> tuple[list[_Program], set[str]]:
    """``new`` with parents before children (ties: iteration_found, timestamp, id), and the ids
    whose parent among ``new`` could not come first (a cycle of parent ids: that edge is dropped)."""
    def key(p: _Program) -> tuple[int, float, str]:
        return (p.iteration, p.timestamp, p.id)

    children: dict[str, list[str]] = {}
    waiting: dict[str, int] = {}
    for p in new.values():
        if p.parent_id is not None and p.parent_id in new and p.parent_id != p.id:
            children.setdefault(p.parent_id, []).append(p.id)
            waiting[p.id] = 1
    ready = [key(p) for p in new.values() if p.id not in waiting]
    heapq.heapify(ready)
    order: list[_Program] = []
    broken: set[str] = set()
    placed: set[str] = set()
    while len(order) < len(new):
        if not ready:  # only cycles are left: start at the smallest, without its parent edge
            p = min((q for q in new.values() if q.id not in placed), key=key)
            broken.add(p.id)
            ready.append(key(p))
        _, _, pid = heapq.heappop(ready)
        if pid in placed:
            continue
        placed.add(pid)
        order.append(new[pid])
        for c in children.get(pid, ()):
            if c not in placed:
                waiting[c] -= 1
                if waiting[c] == 0:
                    heapq.heappush(ready, key(new[c]))
    return order, broken


# ------------------------------------------------------------------ options


def _options(options: Mapping[str, Any]) -> tuple[str | None, str, str | None]:
    unknown = [k for k in options if k not in OPTIONS]
    if unknown:
        raise ValidationError(f"openevolve import has no option {unknown[0]!r}{did_you_mean(unknown[0], OPTIONS)}; "
                              f"options are {', '.join(OPTIONS)}")
    task, prefix, session = options.get("task"), options.get("tag_prefix"), options.get("session")
    for name, v in (("task", task), ("tag_prefix", prefix), ("session", session)):
        if v is not None and not isinstance(v, str):
            raise ValidationError(f"openevolve import option {name} must be a string, got {type(v).__name__}")
    return task, prefix or "", session


def source_name(path: str, **options: Any) -> str:
    """What identifies the import (its units are skipped when imported again): the absolute path
    of the run's output folder, or of the one checkpoint folder given."""
    _options(options)
    return _layout(path).source


# ------------------------------------------------------------------ units


@dataclass
class _Run:
    """What the units of the checkpoints read so far left behind (the next unit's diff is against it)."""

    session: str
    task: str
    seen: set[str] = field(default_factory=set)  # program ids written (nodes)
    copies: dict[str, bytes] = field(default_factory=dict)  # program id -> its file in the previous checkpoint
    facts: dict[str, _Facts] = field(default_factory=dict)  # program id -> facts as written
    hashes: set[str] = field(default_factory=set)  # artifacts written
    labels: dict[str, set[str]] = field(default_factory=dict)  # label -> members
    cells: dict[str, str] = field(default_factory=dict)  # program id -> MAP-Elites cell written
    pending: dict[str, list[tuple[str, dt.datetime | None]]] = field(default_factory=dict)  # parent -> children


def _program_files(ckpt: str) -> dict[str, str]:
    """Program id (the file name's stem) -> file, for the ``<id>.json`` files of ``programs/``;
    hidden files and other names are ignored."""
    folder = os.path.join(ckpt, "programs")
    out: dict[str, str] = {}
    try:
        it = os.scandir(folder)
    except (FileNotFoundError, NotADirectoryError):
        if (bad := broken_link(folder)) is not None:
            raise bad from None
        return out
    except OSError as e:  # a link loop
        raise unreadable(folder, e) from None
    with it:
        for entry in _listed(it, lambda n: n.endswith(".json") and not n.startswith(".") and len(n) > 5, folders=False):
            out[entry.name[:-5]] = entry.path
    return dict(sorted(out.items()))


def units(path: str, **options: Any) -> Iterator[Unit]:
    """One :class:`Unit` per checkpoint, ascending (see the module notes and
    ``docs/import-openevolve.md``); a file that cannot be read raises ImportFormatError naming it
    when its checkpoint's turn comes (the checkpoints before it are committed by then). The
    folders are listed here, at the call: a layout error, a file linking outside the run, and
    the :class:`IncompleteCheckpointWarning` come from it, in the caller's thread."""
    task_opt, prefix, session_opt = _options(options)
    layout = _layout(path)
    name = os.path.basename(layout.run) or "run"
    task = task_opt or f"openevolve:{name}"
    session = session_opt or f"openevolve:{name}"
    check_name(task, "task id")
    check_name(session, "session id")
    check_name(f"{prefix}checkpoint_0", "tag (tag_prefix + checkpoint_<k>)")
    ckpts = list(layout.checkpoints)
    if not ckpts:
        raise ImportFormatError(f"{path}: the checkpoints folder holds no checkpoint_<k> folder")
    last_k, last = ckpts[-1]
    if (bad := broken_link(os.path.join(last, "metadata.json"))) is not None:  # a loop is not "being written"
        raise bad
    if not os.path.exists(os.path.join(last, "metadata.json")):
        if layout.single:
            raise ImportFormatError(f"{os.path.join(last, 'metadata.json')}: missing; the checkpoint is incomplete "
                                    "(OpenEvolve writes metadata.json last)")
        warnings.warn(f"{last}: no metadata.json, the checkpoint is incomplete (being written?); checkpoint_{last_k} "
                      "is not imported now (import again once it is complete)", IncompleteCheckpointWarning,
                      stacklevel=_caller_level())
        ckpts.pop()
    # Every program file of the run, by id: a parent that appears only in a later checkpoint gets
    # its edge when it is written; one with no file anywhere is recorded on the child.
    files = {k: _program_files(d) for k, d in ckpts}
    for k, d in ckpts:  # a file that links outside the folder given is not read
        for f in (os.path.join(d, "metadata.json"), os.path.join(d, "best_program_info.json"), *files[k].values()):
            if (bad := broken_link(f)) is not None:  # a loop, or a link to nothing: not a missing file
                raise bad
            if os.path.lexists(f) and not inside(f, layout.source):
                raise outside_error(f, layout.source)
    anywhere = {pid for fs in files.values() for pid in fs}
    return _units(_Run(session, task), ckpts, files, anywhere, prefix, layout.run)


def _caller_level() -> int:
    """The ``stacklevel`` of a warning raised in the caller of this function that points at the
    first frame outside the importers (the line that called ``import_run``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    me = inspect.currentframe()
    frame, level = (me.f_back if me is not None else None), 1
    while frame is not None and frame.f_back is not None and \
            os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


def _units(run: _Run, ckpts: list[tuple[int, str]], files: dict[int, dict[str, str]], anywhere: set[str],
           prefix: str, run_folder: str) -> Iterator[Unit]:
    for i, (k, folder) in enumerate(ckpts):
        yield _unit(run, k, folder, files[k], anywhere, first=(i == 0), prefix=prefix, run_folder=run_folder)


def _unit(run: _Run, k: int, folder: str, files: dict[str, str], anywhere: set[str], *, first: bool, prefix: str,
          run_folder: str) -> Unit:
    meta_path = os.path.join(folder, "metadata.json")
    if not os.path.exists(meta_path):
        raise ImportFormatError(f"{meta_path}: missing; a checkpoint before the last one is incomplete "
                                "(OpenEvolve writes metadata.json last)")
    metadata = _mapping(_read_json(meta_path), meta_path, "metadata.json")
    info_path = os.path.join(folder, "best_program_info.json")
    saved: dt.datetime | None = None
    saved_at: Any = None
    if os.path.exists(info_path):
        info = _read_json(info_path)
        saved_at = info.get("saved_at") if isinstance(info, dict) else None
        saved = _time(saved_at, info_path, "saved_at")
    rows: dict[str, list[dict[str, Any]]] = {t: [] for t in ("nodes", "edges", "artifacts", "node_artifacts",
                                                             "rewards", "attributes", "labels")}
    new: dict[str, _Program] = {}
    copies: dict[str, bytes] = {}
    for pid, where in files.items():
        try:
            with open(where, "rb") as f:
                data = f.read()
        except OSError as e:
            raise unreadable(where, e) from None
        copies[pid] = data
        if run.copies.get(pid) == data:  # the previous checkpoint's file, byte for byte: nothing to parse
            continue
        prog = _program(_parse(data, where), where, pid, run.session, run.task)
        if pid in run.seen:  # re-added after an eviction, or a copy that differs: only what changed
            _changes(rows, run, prog)
        else:
            run.seen.add(pid)
            new[pid] = prog
    run.copies = copies  # bounded by the population, not by the run
    order, broken = _topological(new)
    for p in order:
        rows["nodes"].append(p.node)
        if p.parent_id is not None:
            if p.id in broken or p.parent_id == p.id:
                p.facts.attrs["parent_id_cycle"] = _dumps(p.parent_id)
            elif p.parent_id in run.facts or p.parent_id in new:
                rows["edges"].append(_edge(p.parent_id, p.id, run.session, p.at))
            elif p.parent_id in anywhere:  # its parent comes in a later checkpoint: the edge then
                run.pending.setdefault(p.parent_id, []).append((p.id, p.at))
            else:
                p.facts.attrs["parent_id_missing"] = _dumps(p.parent_id)
        for child, at in run.pending.pop(p.id, ()):
            rows["edges"].append(_edge(p.id, child, run.session, at))
            # an earlier import, before this parent's checkpoint existed, found it missing: no longer
            rows["attributes"].append({"scope": "node", "entity": child, "key": "parent_id_missing", "value": None,
                                       "retracted": True, "session_id": run.session, "event_time": at})
        _facts_rows(rows, run, p.id, p.at, _Facts(), p.facts)
        run.facts[p.id] = p.facts
    population = set(files)
    meta = _memberships(rows, run, k, meta_path, metadata, population, saved)
    if saved_at is not None:
        meta["saved_at"] = saved_at
    if first:
        rows["tasks"] = [{"id": run.task, "name": os.path.basename(run_folder) or None}]
        times = [p.at for p in order if p.at is not None]
        rows["sessions"] = [{"id": run.session, "task_id": run.task, "agent": "openevolve",
                             "event_time": min(times) if times else None}]
    return Unit(name=f"checkpoint_{k}", rows={t: r for t, r in rows.items() if r}, where=folder,
                meta=_fit(meta), tag=f"{prefix}checkpoint_{k}")


def _edge(src: str, dst: str, session: str, at: dt.datetime | None) -> dict[str, Any]:
    return {"src": src, "dst": dst, "kind": "derived_from", "session_id": session, "event_time": at}


def _facts_rows(rows: dict[str, list[dict[str, Any]]], run: _Run, pid: str, at: dt.datetime | None, old: _Facts,
                new: _Facts) -> None:
    """The rows that take a node from ``old`` facts to ``new`` ones (all of them for a new node)."""
    for ch, v in new.rewards.items():
        if old.rewards.get(ch) != v:
            rows["rewards"].append({"node_id": pid, "channel": ch, "value": v, "verifier": VERIFIER,
                                    "event_time": at})
    for key, text in new.attrs.items():
        if old.attrs.get(key) != text:
            rows["attributes"].append({"scope": "node", "entity": pid, "key": key, "value": text,
                                       "retracted": False, "session_id": run.session, "event_time": at})
    for key in sorted(old.attrs.keys() - new.attrs.keys()):
        rows["attributes"].append({"scope": "node", "entity": pid, "key": key, "value": None,
                                   "retracted": True, "session_id": run.session, "event_time": at})
    for name, (h, media, content) in new.artifacts.items():
        if h not in run.hashes:
            run.hashes.add(h)
            rows["artifacts"].append({"hash": h, "media_type": media, "size": len(content), "content": content})
        if name not in old.artifacts or old.artifacts[name][0] != h:
            rows["node_artifacts"].append({"node_id": pid, "name": name, "hash": h})


def _changes(rows: dict[str, list[dict[str, Any]]], run: _Run, prog: _Program) -> None:
    """A program already imported whose file in this checkpoint differs: its changed facts."""
    old = run.facts[prog.id]
    for key in ("parent_id_missing", "parent_id_cycle"):  # found when it was written; not in the file
        if key in old.attrs:
            prog.facts.attrs[key] = old.attrs[key]
    _facts_rows(rows, run, prog.id, prog.at, old, prog.facts)
    kept = {ch: v for ch, v in old.rewards.items() if ch not in prog.facts.rewards}  # a reward is never retracted
    prog.facts.rewards.update(kept)
    run.facts[prog.id] = prog.facts


def _memberships(rows: dict[str, list[dict[str, Any]]], run: _Run, k: int, where: str, metadata: dict[str, Any],
                 population: set[str], saved: dt.datetime | None) -> dict[str, Any]:
    """The checkpoint's memberships as label changes against the previous checkpoint's, and its
    run-level state (the commit meta)."""
    named: set[str] = set()
    islands = _structured(metadata.get("islands"), where, "islands") or []
    if not isinstance(islands, list):
        raise ImportFormatError(f"{where}: islands is not a list of lists of program ids")
    island_sets = [_ids(isl, where, f"islands[{i}]") for i, isl in enumerate(islands)]
    archive = _ids(metadata.get("archive"), where, "archive")
    best = metadata.get("best_program_id")
    if best is not None and not isinstance(best, str):
        raise ImportFormatError(f"{where}: best_program_id is {best!r}, not a program id")
    cells: dict[str, str] = {}  # program -> cell key
    maps = [metadata.get("feature_map")]
    island_maps = _structured(metadata.get("island_feature_maps"), where, "island_feature_maps") or []
    if not isinstance(island_maps, list):
        raise ImportFormatError(f"{where}: island_feature_maps is a {type(island_maps).__name__}, not a list of "
                                "feature maps (one per island)")
    maps += island_maps
    for i, fm in enumerate(maps):
        if fm is None:
            continue
        for cell, pid in _mapping(fm, where, "feature_map" if i == 0 else f"island_feature_maps[{i - 1}]").items():
            if isinstance(pid, str):
                named.add(pid)
                cells.setdefault(pid, str(cell))
    island_best = _structured(metadata.get("island_best_programs"), where, "island_best_programs")
    if isinstance(island_best, list):
        named.update(v for v in island_best if isinstance(v, str))
    for s in (*island_sets, archive, [best] if best else []):
        named.update(s)
    dangling = sorted(named - population)
    want: dict[str, set[str]] = {"population": population}
    for i, isl in enumerate(island_sets):
        want[f"island_{i}"] = set(isl) & population
    want["archive"] = set(archive) & population
    want["best"] = {best} & population if best else set()
    want["feature_map"] = set(cells) & population
    for label in sorted(want.keys() | run.labels.keys()):
        now, before = want.get(label, set()), run.labels.get(label, set())
        for pid in sorted(now - before):
            rows["labels"].append({"node_id": pid, "label": label, "present": True, "session_id": run.session,
                                   "event_time": saved})
        for pid in sorted(before - now):
            rows["labels"].append({"node_id": pid, "label": label, "present": False, "session_id": run.session,
                                   "event_time": saved})
    run.labels = {label: s for label, s in want.items() if s}
    for pid, cell in sorted(cells.items()):
        if pid in population and run.cells.get(pid) != cell:
            run.cells[pid] = cell
            rows["attributes"].append({"scope": "node", "entity": pid, "key": "cell", "value": _dumps(cell),
                                       "retracted": False, "session_id": run.session, "event_time": saved})
    meta: dict[str, Any] = {"checkpoint": k}
    for key, v in metadata.items():
        if key not in _MEMBERSHIP_FIELDS:
            with contextlib.suppress(ImportFormatError):  # a text that only looks like a literal stays text
                v = _structured(v, where, key)
            meta[key] = _json_safe(v)
    meta.update({"population_size": len(population), "island_sizes": [len(s) for s in island_sets],
                 "archive_size": len(archive), "feature_map_size": len(cells), "dangling": dangling})
    return meta


def _fit(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` within the commit-meta limit: the largest optional entries left out (named in
    ``omitted``), the dangling ids cut (their count kept in ``dangling_count``)."""
    def size(m: dict[str, Any]) -> int:
        return len(_dumps(m).encode())

    if size(meta) <= _META_BUDGET:
        return meta
    meta = dict(meta)
    meta["dangling_count"] = len(meta["dangling"])
    keep = {"checkpoint", "best_program_id", "last_iteration", "dangling", "dangling_count", "population_size",
            "archive_size", "island_sizes", "feature_map_size"}
    optional = sorted((k for k in meta if k not in keep), key=lambda k: -len(_dumps(meta[k])))
    omitted: list[str] = []
    for key in optional:
        if size(meta) <= _META_BUDGET:
            break
        del meta[key]
        omitted.append(key)
    if omitted:
        meta["omitted"] = omitted
    while size(meta) > _META_BUDGET and meta["dangling"]:
        meta["dangling"] = meta["dangling"][: len(meta["dangling"]) // 2]
    return meta
