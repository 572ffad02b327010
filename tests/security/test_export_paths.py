"""Exports cannot write outside their root, replace what no export wrote, or touch the store."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import trellisdb
from trellisdb.cli import main
from trellisdb.client import RemoteDatabase

from ..serving import free_port, start, stop


@pytest.fixture
def v(tmp_path: Path) -> Iterator[trellisdb.Database]:
    """A store with a materialized sft view ``v`` of two scored nodes."""
    db = trellisdb.connect(tmp_path / "db", embedding_dim=4)
    with db.session(task="t", agent="a") as s:
        for i in range(2):
            n = s.add_node(summary=f"n{i}", artifacts={"prompt": f"p{i}", "response": f"r{i}"})
            s.add_reward(n, "score", 1.0)
    db.create_view("v", "sft", reward="reward('score')", threshold=0.5)
    db.materialize("v")
    yield db
    db.close()


def _store_files(db: trellisdb.Database) -> dict[str, int]:
    out = {}
    for root, _dirs, files in os.walk(db.path):
        for f in files:
            p = os.path.join(root, f)
            out[os.path.relpath(p, db.path)] = os.path.getsize(p)
    return out


def test_tql_export_lands_under_the_export_root(v: trellisdb.Database) -> None:
    r = v.query("EXPORT v TO 'runs/sft'").to_pylist()[0]
    assert r["rows"] == 2
    out = Path(v.path) / "exports" / "runs" / "sft"
    assert (out / "train.jsonl").is_file() and json.loads((out / "manifest.json").read_text())["trellisdb_export"] == 1


@pytest.mark.parametrize("path", [
    "/tmp/evil", "../evil", "../../etc", "a/../../evil", "./../x", "~/x", "a/\x00b", "\x00", "", "   ", ".", "a\nb",
    "..", "x/..", "\ud800",
])
def test_tql_export_path_must_stay_inside_the_root(v: trellisdb.Database, path: str) -> None:
    before = _store_files(v)
    with pytest.raises(trellisdb.TrellisError):
        v.query("EXPORT v TO $p", p=path)
    lit = path.replace("'", "''")
    if "\x00" not in path and "\ud800" not in path:
        with pytest.raises(trellisdb.TrellisError):
            v.query(f"EXPORT v TO '{lit}'")
    assert _store_files(v) == before
    assert not os.path.exists("/tmp/evil") or path != "/tmp/evil"


def test_overwrite_cannot_delete_the_store_or_any_folder(v: trellisdb.Database, tmp_path: Path) -> None:
    """The reproduction: EXPORT ... WITH overwrite = true aimed at the store's own table deleted it."""
    before = _store_files(v)
    for target in ("../tables/nodes.lance", "../tables", "..", "../..", "/"):
        with pytest.raises(trellisdb.TrellisError):
            v.query("EXPORT v TO $p WITH overwrite = true", p=target)
    # a root the opener points at the store's parent does not make the store a target either
    wide = trellisdb.connect(v.path, export_root=tmp_path)
    for target in ("db", "db/tables/nodes.lance", "db/tables", "db/views"):
        with pytest.raises(trellisdb.ExportError):
            wide.query("EXPORT v TO $p WITH overwrite = true", p=target)
    # nor through the Python API
    for target in (v.path, os.path.join(v.path, "tables", "nodes.lance"), str(tmp_path), os.path.join(v.path, "views")):
        with pytest.raises(trellisdb.ExportError):
            v.export("v", target, overwrite=True)
    wide.close()
    assert _store_files(v) == before
    assert v.sql("SELECT count(*) AS n FROM nodes").to_pylist() == [{"n": 2}]


def test_overwrite_replaces_only_a_previous_export(v: trellisdb.Database, tmp_path: Path) -> None:
    keep = tmp_path / "precious"
    keep.mkdir()
    (keep / "thesis.tex").write_text("years of work")
    with pytest.raises(trellisdb.ExportError, match="no export manifest"):
        v.export("v", keep, overwrite=True)
    assert (keep / "thesis.tex").read_text() == "years of work"
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(trellisdb.ExportError, match="not an export folder"):
        v.export("v", a_file, overwrite=True)
    assert a_file.read_text() == "x"
    fake = tmp_path / "fake"  # a manifest.json that is not an export's
    fake.mkdir()
    (fake / "manifest.json").write_text('{"name": "my app"}')
    with pytest.raises(trellisdb.ExportError):
        v.export("v", fake, overwrite=True)
    out = tmp_path / "out"
    v.export("v", out)
    with pytest.raises(trellisdb.ExportError, match="exists"):
        v.export("v", out)
    assert v.export("v", out, overwrite=True, format="parquet")["format"] == "parquet"
    assert (out / "train.parquet").is_file() and not (out / "train.jsonl").exists()


def test_symlinks_out_of_the_root_are_refused(v: trellisdb.Database, tmp_path: Path) -> None:
    root = Path(v.export_root)
    root.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "escape").symlink_to(outside)
    with pytest.raises(trellisdb.ExportError, match="symbolic link"):
        v.query("EXPORT v TO 'escape/x'")
    with pytest.raises(trellisdb.ExportError, match="symbolic link"):
        v.query("EXPORT v TO 'escape' WITH overwrite = true")
    (root / "tables").symlink_to(Path(v.path) / "tables")
    with pytest.raises(trellisdb.ExportError):
        v.query("EXPORT v TO 'tables/nodes.lance' WITH overwrite = true")
    assert list(outside.iterdir()) == []


def test_export_root_is_set_by_the_opener_not_the_query(v: trellisdb.Database, tmp_path: Path) -> None:
    db = trellisdb.connect(v.path, export_root=tmp_path / "shared-exports")
    assert db.query("EXPORT v TO 'a'").to_pylist()[0]["rows"] == 2
    assert (tmp_path / "shared-exports" / "a" / "train.jsonl").is_file()
    with pytest.raises(trellisdb.ValidationError, match="inside the database folder"):
        trellisdb.connect(v.path, export_root=Path(v.path) / "tables")
    db.close()


@pytest.mark.parametrize(("options", "needle"), [
    ("WITH bogus = 0.1", "no option 'bogus'"),
    ("WITH progress = 1", "no option 'progress'"),
    ("WITH overwrite = 1", "true or false"),
    ("WITH validation = 'x'", "fraction"),
    ("WITH validation = 2", "fraction"),
    ("WITH skip_missing = 'yes'", "true or false"),
])
def test_export_options_are_checked(v: trellisdb.Database, options: str, needle: str) -> None:
    """Fuzzing found a TypeError escaping from an unknown option; every option is checked."""
    with pytest.raises(trellisdb.QueryError, match=needle):
        v.query(f"EXPORT v TO 'x' {options}")


def test_export_path_parameter(v: trellisdb.Database) -> None:
    """``EXPORT v TO $p`` raised an AssertionError; a parameter now carries the path."""
    assert v.query("EXPORT v TO $p", p="by-param").to_pylist()[0]["path"] == "by-param"
    with pytest.raises(trellisdb.QueryNameError, match=r"\$p"):
        v.query("EXPORT v TO $p")
    with pytest.raises(trellisdb.QueryError, match="folder path"):
        v.query("EXPORT v TO $p", p=5)


def test_cli_export_is_confined(v: trellisdb.Database, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v.close()
    db = ["--db", v.path]
    assert main([*db, "export", "v", "/tmp/abs"]) == 1
    assert "relative to the export root" in capsys.readouterr().err
    assert main([*db, "export", "v", "../tables", "--overwrite"]) == 1
    assert main([*db, "export", "v", "cli"]) == 0
    assert (Path(v.path) / "exports" / "cli" / "train.jsonl").is_file()
    assert main([*db, "--export-root", str(tmp_path / "r"), "export", "v", "cli"]) == 0
    assert (tmp_path / "r" / "cli" / "train.jsonl").is_file()


#: Paths no file system holds (issue 35): a 5,000-character name, 2,500 folders, a path over
#: PATH_MAX, a name one byte over NAME_MAX (in UTF-8 bytes: 128 two-byte letters).
TOO_LONG = {"name 5000": "x" * 5000, "2500 folders": "a/" * 2500, "path 5025": ("b" * 200 + "/") * 25,
            "name 256": "c" * 256, "name 256 bytes": "é" * 128}


@pytest.mark.parametrize("path", list(TOO_LONG.values()), ids=list(TOO_LONG))
def test_a_path_too_long_is_an_export_error_at_every_door(v: trellisdb.Database, tmp_path: Path, path: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """An ExportError saying which limit, before anything is written: not an OSError
    (ENAMETOOLONG) or a RecursionError from creating the folders, which the server answered 500."""
    before = _store_files(v)
    want = r"bytes long|folders deep"
    with pytest.raises(trellisdb.ExportError, match=want):
        v.query("EXPORT v TO $p", p=path)
    with pytest.raises(trellisdb.ExportError, match=want):
        v.export_target(path)
    with pytest.raises(trellisdb.ExportError, match=want):  # the embedded API takes any path
        v.export("v", str(tmp_path / path))
    assert _store_files(v) == before and sorted(os.listdir(tmp_path)) == ["db"]
    v.close()
    assert main(["--db", v.path, "export", "v", path]) == 1
    assert re.search(want, capsys.readouterr().err)


def test_a_name_as_long_as_the_file_system_allows_exports_and_is_replaced(v: trellisdb.Database) -> None:
    name = "n" * 255  # NAME_MAX: the export's own name; its temporary and old copies have short names
    assert v.query("EXPORT v TO $p", p=name).to_pylist()[0]["rows"] == 2
    assert v.query("EXPORT v TO $p WITH overwrite = true", p=name).to_pylist()[0]["rows"] == 2
    assert sorted(os.listdir(Path(v.path) / "exports")) == [name]


def test_a_file_where_a_folder_must_be_is_an_export_error(v: trellisdb.Database) -> None:
    (Path(v.path) / "exports").mkdir(exist_ok=True)
    (Path(v.path) / "exports" / "afile").write_text("x")
    with pytest.raises(trellisdb.ExportError, match=r"afile/sub' cannot be written there \(File exists\)"):
        v.query("EXPORT v TO 'afile/sub'")


def test_the_server_answers_400_for_a_path_too_long(v: trellisdb.Database) -> None:
    """Over HTTP, TQL and the remote export: HTTP 400 with the ExportError (was 500), and the
    server keeps serving."""
    v.close()
    port = free_port()
    proc = start(Path(v.path), port, "tok")
    try:
        url, h = f"http://127.0.0.1:{port}", {"authorization": "Bearer tok"}
        for path in TOO_LONG.values():
            r = httpx.post(f"{url}/v1/query", json={"tql": "EXPORT v TO $p", "params": {"p": path}}, headers=h)
            assert r.status_code == 400 and r.json()["error"] == "ExportError", r.text[:300]
            assert re.search(r"bytes long|folders deep", r.json()["message"])
        with RemoteDatabase(url, token="tok") as db:
            with pytest.raises(trellisdb.ExportError, match="bytes long"):
                db.export("v", "x" * 5000)
            assert db.query("EXPORT v TO 'fine'").to_pylist()[0]["rows"] == 2
    finally:
        stop(proc)
