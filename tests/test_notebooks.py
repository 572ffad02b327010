"""The notebooks run: their code cells execute in order in one namespace (their own asserts
check the results), without Jupyter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path) -> None:
    cells = json.loads(path.read_text())["cells"]
    ns: dict[str, object] = {"__name__": "__notebook__"}
    for i, cell in enumerate(c for c in cells if c["cell_type"] == "code"):
        src = "".join(cell["source"])
        exec(compile(src, f"{path.name}[code cell {i}]", "exec"), ns)
