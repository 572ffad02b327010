"""``ViewSpec``: a view's definition, checked, with the forms the catalog and exports keep.

The options are ``ViewOptions``' (``options.py``); the checks every kind shares are here, in
the order they have always run, and each kind adds its own (``ViewKind.validate``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trellisdb.errors import ValidationError
from trellisdb.training.kinds import KINDS
from trellisdb.training.options import LINEAGE, ViewOptions

_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True)
class ViewSpec(ViewOptions):
    """A view's definition. ``where`` and ``reward`` are TQL expressions over nodes."""

    @property
    def shape(self) -> str:
        """The rows' layout: the kind, or ``sft_path`` for an sft view of paths."""
        return KINDS[self.kind].shape(self)

    @property
    def paths(self) -> bool:
        """Whether a row follows a node back to its root (stepwise, sft paths): its rows read ancestors."""
        return KINDS[self.kind].paths(self)

    def __post_init__(self) -> None:
        for f in ("reward", "where", "entropy", "prompt", "response", "system", "messages"):
            v = getattr(self, f)
            if not (isinstance(v, str) or (v is None and f in ("reward", "where", "entropy", "messages"))):
                raise ValidationError(f"view option {f} must be a string, not {v!r}")
        for f in ("seed", "min_size", "size"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValidationError(f"view option {f} must be an integer, not {v!r}")
        for f in ("pairs_from", "via"):
            v = getattr(self, f)
            if not isinstance(v, tuple) or not all(isinstance(x, str) for x in v):
                raise ValidationError(f"view option {f} must be a list of names, not {v!r}")
        for f in ("drop_zero_variance", "path", "keep_texts", "include_quarantined"):
            if not isinstance(getattr(self, f), bool):
                raise ValidationError(f"{f} must be True or False, not {getattr(self, f)!r}")
        kind = KINDS.get(self.kind) if isinstance(self.kind, str) else None
        if self.path and (kind is None or "path" not in kind.options):
            raise ValidationError(f"path=True is an sft option (the root-to-node path); a {self.kind} view has none")
        if self.messages is not None and (kind is None or "messages" not in kind.options):
            raise ValidationError(f"messages= is an sft option (an artifact of chat turns); a {self.kind} view has none")
        if self.messages == "":
            raise ValidationError("messages= names an artifact (e.g. messages='messages'), not ''")
        if not isinstance(self.name, str) or not self.name or set(self.name) - _NAME_CHARS or len(self.name) > 128:
            raise ValidationError(f"view name {self.name!r} must be 1 to 128 letters, digits, '_' or '-'")
        if kind is None:
            raise ValidationError(f"unknown view kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        if self.reward is None and kind.needs_reward:
            raise ValidationError(f"a {self.kind} view needs reward=..., e.g. reward=\"reward('score')\"")
        if self.group_by not in ("parent", "prompt"):
            raise ValidationError(f"group_by must be 'parent' or 'prompt', not {self.group_by!r}")
        if not (isinstance(self.margin, int | float) and math.isfinite(self.margin) and self.margin >= 0):
            raise ValidationError(f"margin must be a finite number >= 0, not {self.margin!r}")
        if self.threshold is not None and not (isinstance(self.threshold, int | float) and math.isfinite(self.threshold)):
            raise ValidationError(f"threshold must be a finite number, not {self.threshold!r}")
        if kind.needs_threshold and self.threshold is None:
            raise ValidationError(f"a {self.kind} view needs threshold=... (reward >= threshold is desirable)")
        if set(self.pairs_from) - {"siblings", "comparisons"} or not self.pairs_from:
            raise ValidationError(f"pairs_from takes 'siblings' and/or 'comparisons', not {self.pairs_from!r}")
        if not isinstance(self.min_size, int) or self.min_size < 2:
            raise ValidationError(f"min_size must be an integer >= 2, not {self.min_size!r}")
        kind.validate(self)
        bad = set(self.via) - set(LINEAGE) - {"inspired_by", "retrieved", "depends_on"}
        if bad:
            raise ValidationError(f"unknown edge kind(s) {sorted(bad)} in via")

    def definition(self) -> str:
        """The definition as text (kept in the catalog and in every export's manifest)."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if v != _DEFAULTS.get(k) and k not in ("name", "kind")}
        args = ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v!r}" for k, v in d.items())
        return f"{self.kind}({args})"

    def why_empty(self) -> str:
        """Why a view of this definition can have no rows, in its own terms (for the message that
        says an export or a materialize came out empty).

        >>> ViewSpec("best", "sft", reward="reward('score')", threshold=0.3).why_empty()
        "no node passes threshold 0.3 (reward('score') >= 0.3)"
        """
        scored = f"a reward ({self.reward})" if self.reward else "a reward"
        if self.kind == "sft" and self.messages is not None:
            why = f"no selected node has a {self.messages!r} artifact"
            if self.threshold is not None:
                why += f" and {self.reward} >= {self.threshold}"
        elif self.kind == "sft" and self.threshold is not None:
            why = f"no node passes threshold {self.threshold} ({self.reward} >= {self.threshold})"
        elif self.kind == "sft":
            return f"no node matches where {self.where}" if self.where else "the database has no node to select"
        elif self.kind == "preference":
            sources = [f"siblings (by {self.group_by}) whose rewards ({self.reward}) differ by at least {self.margin}"
                       if "siblings" in self.pairs_from else "",
                       "comparisons that decide a pair" if "comparisons" in self.pairs_from else ""]
            why = f"no pair: no {' and no '.join(x for x in sources if x)}"
        elif self.kind == "grpo":
            why = (f"no group (by {self.group_by}) has {self.min_size} or more members with {scored}"
                   + (" and different rewards" if self.drop_zero_variance else ""))
        else:  # kto, stepwise, replay: every selected node with a reward counts
            why = f"no selected node has {scored}"
        if self.where:
            why += f" among the nodes where {self.where}"
        return why

    def as_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ViewSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValidationError(f"unknown view option(s) {sorted(unknown)}; options are {sorted(known - {'name'})}")
        args: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
        return cls(**args)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ViewSpec) if f.default is not dataclasses.MISSING}
