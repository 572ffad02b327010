"""The package's shape, checked: layers that only look down, and no reaching into privates.

- No import cycle among ``trellisdb`` modules, counting every import: at module level, inside
  functions, and those made only for type checking (``if TYPE_CHECKING:``). A seam that two
  layers share is a protocol or a small module below both.
- No module reads or writes another object's private attribute (``x._name`` where ``x`` is
  not ``self`` / ``cls`` or a class of the same module): the facade's parts talk through
  their public methods.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parents[1] / "trellisdb"


def _module(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every trellisdb module ``name`` imports (a package's ``__init__`` counts as the package)."""
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join([*pkg, base] if base else pkg)
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `from trellisdb.x import name`: the module is trellisdb.x
                t = t.rpartition(".")[0]
            if t and t != name and t != "trellisdb":
                out.add(t)
    return out


def test_no_import_cycles() -> None:
    mods = _modules()
    g: nx.DiGraph = nx.DiGraph()
    g.add_nodes_from(mods)
    for name, path in mods.items():
        for dep in _imports(name, path, set(mods)):
            if not name.startswith(dep + "."):  # a module may import its own package's __init__ names
                g.add_edge(name, dep)
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join([*c, c[0]]) for c in sorted(cycles, key=len)[:10])


def test_storage_looks_only_down() -> None:
    """``storage/`` imports only errors, schema, names and itself."""
    mods = _modules()
    allowed = {"trellisdb.errors", "trellisdb.schema", "trellisdb.names"}
    bad = {f"{n} -> {d}" for n, p in mods.items() if n.startswith("trellisdb.storage")
           for d in _imports(n, p, set(mods)) if not d.startswith("trellisdb.storage") and d not in allowed}
    assert not bad, sorted(bad)


#: Third-party private API we call on purpose, each in one place: (file, expression).
ALLOWED = {
    # Lance's take by row address is "internal use only"; storage/tables.take is the one caller
    ("trellisdb/storage/tables.py", "ds._take_rows"),
}


def test_no_reaching_into_private_members() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        own_classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            v = node.value
            if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id in own_classes):
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super" and not v.args:
                continue  # super()._x: the object's own member, as its base class defines it
            where = str(path.relative_to(PACKAGE.parent))
            if (where, ast.unparse(node)) not in ALLOWED:
                bad.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    assert not bad, "private members reached from outside their object:\n" + "\n".join(bad)


def test_the_facade_stays_small() -> None:
    """``database.py`` wires the parts and documents the API; the work lives below it."""
    code = [line for line in (PACKAGE / "database.py").read_text().splitlines() if line.strip()]
    tree = ast.parse((PACKAGE / "database.py").read_text())
    doc_lines = sum(
        len(ast.get_docstring(n, clean=False).splitlines())  # type: ignore[union-attr]
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.ClassDef | ast.Module) and ast.get_docstring(n) is not None
    )
    assert len(code) - doc_lines <= 300, f"database.py has {len(code) - doc_lines} lines besides docstrings"
