"""``views.json``: the views' definitions and, per materialized view, its commit, row count and
the versions of its files."""

from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass, field
from typing import Any

from trellisdb.errors import QueryError, TrellisError
from trellisdb.training.files import CATALOG, rows_file
from trellisdb.training.spec import ViewSpec


@dataclass
class ViewCatalog:
    """``<db>/views.json``: definitions and, per materialized view, its commit, row count and file."""

    root: str
    entries: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def path(self) -> str:
        return os.path.join(self.root, CATALOG)

    def load(self) -> ViewCatalog:
        if not os.path.exists(self.path):
            self.entries = {}
            return self
        try:
            with open(self.path) as fh:
                self.entries = json.load(fh)["views"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise TrellisError(f"{self.path} is unreadable ({e}); restore it from a backup or remove it "
                               "(the views' definitions are lost, the data is not)") from e
        return self

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({"views": self.entries}, fh, indent=1, default=str)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)

    def spec(self, name: str) -> ViewSpec:
        e = self.entries.get(name)
        if e is None:
            known = ", ".join(sorted(self.entries)) or "none yet"
            raise QueryError(f"unknown view {name!r}; views: {known} (create one with db.create_view)")
        return ViewSpec.from_dict(e["spec"])


def declared(spec: ViewSpec) -> dict[str, Any]:
    """The catalog entry of a view just declared (nothing computed yet)."""
    return {"spec": spec.as_dict(), "definition": spec.definition(), "commit": None,
            "rows": None, "file": None, "version": None}


def entry(spec: ViewSpec, commit: int, rows: int, version: int, next_row: int, how: str,
          texts_version: int | None, n_texts: int, sorted: bool = False) -> dict[str, Any]:
    """The catalog entry of a view materialized (or refreshed) at ``commit``: its rows at
    ``version`` of its rows' dataset (``next_row``: the next row id), its texts at
    ``texts_version`` (None: not kept), and how it was computed."""
    return {"spec": spec.as_dict(), "definition": spec.definition(), "commit": commit, "rows": rows,
            "file": rows_file(spec.name), "version": version, "next_row": next_row,
            "texts_version": texts_version, "texts": n_texts,
            "computed_at": dt.datetime.now(dt.UTC).isoformat(), "how": how, "sorted": sorted}
