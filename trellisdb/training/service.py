"""``ViewStore``: the training-data views of one open database.

It owns the catalog (``views.json``, ``catalog.py``), the stored rows (``rows.py``), the kept
texts (``texts.py``) and what this process keeps in memory about them for the next refresh
(``RowStore.kept``, ``TextStore.known``, ``TextStore.addresses``); it reads the database
through ``Reads`` / ``Snapshot`` and takes the writer lock of the ``Store`` around catalog
changes. ``Database``'s view methods delegate here.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from trellisdb.errors import TransactionError, ValidationError
from trellisdb.progress import Progress, Steps, counted
from trellisdb.training.catalog import ViewCatalog, declared
from trellisdb.training.compute import build, check
from trellisdb.training.export import export
from trellisdb.training.refresh import refresh_rows
from trellisdb.training.rows import RowStore
from trellisdb.training.spec import ViewSpec
from trellisdb.training.texts import TextStore

if TYPE_CHECKING:
    from trellisdb.committer import Committer
    from trellisdb.snapshot import Reads
    from trellisdb.store import Store


class ViewStore:
    """Views of one store: ``create``, ``list``, ``materialize``, ``refresh``, ``rows``, ``drop``, ``export``."""

    def __init__(self, store: Store, reads: Reads, committer: Committer) -> None:
        self.store = store
        self.reads = reads
        self.committer = committer
        #: the database folder (``views.json`` and ``views/`` are in it)
        self.path = store.path
        #: the views' kept texts, and the keys and artifact addresses a refresh reuses
        self.texts = TextStore(store.path)
        #: the views' stored rows, and the provenance a refresh reuses
        self.stored = RowStore(store.path, self.texts)

    def catalog(self) -> ViewCatalog:
        """``views.json`` as it is now."""
        return ViewCatalog(self.path).load()

    def create(self, name: str, kind: str, *, replace: bool = False, **options: Any) -> dict[str, Any]:
        """Declare view ``name`` (nothing computed yet); returns its catalog entry."""
        self.store.writable("create_view")
        spec = ViewSpec.from_dict({**options, "name": name, "kind": kind})
        check(self.reads.at(), spec)
        with self.store.lock.held():
            cat = self.catalog()
            if name in cat.entries and not replace:
                raise ValidationError(f"view {name!r} exists; pass replace=True to redefine it (its rows go)")
            cat.entries[name] = declared(spec)
            cat.save()
            self.stored.remove(name)
        return dict(cat.entries[name])

    def list(self) -> list[dict[str, Any]]:
        """Every view: name, kind, definition, the commit it is materialized at and its row count."""
        cat = self.catalog()
        return [{"name": n, "kind": e["spec"]["kind"], "definition": e["definition"], "commit": e["commit"],
                 "rows": e["rows"], "computed_at": e.get("computed_at")} for n, e in sorted(cat.entries.items())]

    def materialize(self, name: str, as_of: object = None, *, progress: bool | None = None) -> dict[str, Any]:
        """Compute view ``name`` as of ``as_of`` (default: the latest commit) and store its rows
        (``progress``: a bar over the steps, ``progress.py``)."""
        self.store.writable("materialize")
        self.committer.flush()
        snap = self.reads.at(as_of)
        spec = self.catalog().spec(name)
        steps = ("compute rows", "resolve texts", "write") if spec.keep_texts else ("compute rows", "write")
        with Steps(f"materialize {name}", steps, progress) as step:
            rows, texts = build(self.texts, snap, spec, step)
            step("write")
            with self.store.lock.held():
                cat = self.catalog()
                cat.spec(name)
                return self.stored.write(cat, spec, rows, texts, snap.commit, "built")

    def refresh(self, name: str, *, progress: bool | None = None) -> dict[str, Any]:
        """Bring a materialized view to the latest commit, recomputing only what changed
        (``progress``: a bar over the steps, ``progress.py``)."""
        self.store.writable("refresh")
        self.committer.flush()
        for _attempt in range(3):
            cat = self.catalog()
            spec = cat.spec(name)
            entry = cat.entries[name]
            snap = self.reads.at()
            upto = snap.commit
            if entry["commit"] is None:
                return self.materialize(name, progress=progress)
            if entry["commit"] >= upto:
                return dict(entry)
            with Steps(f"refresh {name}", ("find touched nodes", "recompute rows", "resolve texts", "write"),
                       progress) as step:
                r = refresh_rows(self.stored, snap, spec, entry, int(entry["commit"]), step)
                step("write")
                with self.store.lock.held():
                    cat = self.catalog()
                    now = cat.entries.get(name)
                    if now is None or now.get("version") != entry["version"]:
                        continue  # another process changed the view meanwhile: start again from its state
                    if r.rows is not None:
                        return self.stored.write(cat, spec, r.rows, r.texts, upto, r.how)
                    assert r.fresh is not None
                    return self.stored.write_delta(cat, spec, entry, r.drop, r.fresh, r.texts, upto, r.how)
        raise TransactionError(f"view {name!r} kept changing under this refresh; try again")

    def rows(self, name: str) -> pa.Table:
        """The stored rows of materialized view ``name`` (hashes, provenance), in key order."""
        cat = self.catalog()
        cat.spec(name)
        entry = cat.entries[name]
        if entry.get("version") is None:
            raise ValidationError(f"view {name!r} is not materialized yet; run db.materialize({name!r})")
        return self.stored.read(entry)

    def drop(self, name: str) -> None:
        """Forget view ``name`` and delete its rows and texts."""
        self.store.writable("drop_view")
        with self.store.lock.held():
            cat = self.catalog()
            cat.spec(name)
            cat.entries.pop(name)
            cat.save()
            self.stored.remove(name)

    def clear(self, name: str) -> None:
        """Delete view ``name``'s rows and texts but keep its definition (declared, not
        materialized): what a purge does to a view it cannot compute again."""
        self.store.writable("clear_view")
        with self.store.lock.held():
            cat = self.catalog()
            spec = cat.spec(name)
            cat.entries[name] = declared(spec)
            cat.save()
            self.stored.remove(name)

    def export(self, name: str, path: str | os.PathLike[str], format: str = "trl", *, validation: float = 0.0,
               overwrite: bool = False, skip_missing: bool = False,
               progress: Progress = None) -> dict[str, Any]:
        """Write materialized view ``name`` to folder ``path`` (``export.py``); returns the manifest.
        ``progress``: a bar over the rows written (``progress.py``), or a ``progress(done, total)`` callable."""
        self.store.writable("export")
        report, done = counted(f"export {name}", progress)
        try:
            return export(self.stored, self.reads, name, path, format, validation=validation, overwrite=overwrite,
                          skip_missing=skip_missing, progress=report)
        finally:
            done()
