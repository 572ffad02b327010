"""The notebooks run as Jupyter runs them: nbclient executes every cell in order in a kernel (this
interpreter's ipykernel), in an empty folder, with a time limit per cell; the notebooks' own
asserts check the results.

The same execution refreshes the outputs saved in the notebooks (``notebooks/README.md``)::

    .venv/bin/python -m tests.test_notebooks                 # every notebook
    .venv/bin/python -m tests.test_notebooks notebooks/training_views.ipynb
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook extra (nbclient, nbformat, ipykernel) is not installed")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  (installed with nbclient)
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from traitlets import default  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
#: seconds a cell may run (the slowest takes about one)
CELL_TIMEOUT = 120
#: characters of output a saved cell may keep
SAVED_OUTPUT_LIMIT = 20_000

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class ThisPythonKernel(AsyncKernelManager):
    """The ``python3`` kernel is this interpreter's ipykernel: with no kernel folder searched,
    jupyter_client falls back on the spec ipykernel builds from ``sys.executable``, so a kernel
    spec elsewhere on the machine (a user's ``~/.local/share/jupyter/kernels/python3`` for
    another Python) cannot stand in for the venv's."""

    @default("kernel_spec_manager")
    def _kernel_spec_manager_default(self) -> KernelSpecManager:
        return KernelSpecManager(kernel_dirs=[])


class NotebookFailed(Exception):
    def __init__(self, path: Path, index: int, cell: Any, error: BaseException) -> None:
        first = next((x for x in str(cell.source).splitlines() if x.strip()), "") if cell is not None else ""
        super().__init__(f"{path.name}: cell {index} (`{first}`) failed: {_ANSI.sub('', str(error)).strip()}")


def execute(path: Path, cwd: Path, *, timing: bool = True) -> Any:
    """``path`` executed in a fresh kernel whose working folder is ``cwd``: the notebook with its
    outputs (not written anywhere). Raises ``NotebookFailed`` naming the cell on an error, a
    timeout or a dead kernel."""
    nb = nbformat.read(path, as_version=4)
    started: list[int] = []

    def on_cell_start(cell: Any, cell_index: int) -> None:
        started.append(cell_index)

    client = nbclient.NotebookClient(
        nb, kernel_name="python3", kernel_manager_class=ThisPythonKernel, timeout=CELL_TIMEOUT,
        resources={"metadata": {"path": str(cwd)}}, record_timing=timing, on_cell_start=on_cell_start,
    )
    try:
        client.execute()
    except (nbclient.exceptions.CellExecutionError, nbclient.exceptions.CellTimeoutError,
            nbclient.exceptions.DeadKernelError) as e:
        index = started[-1] if started else -1
        raise NotebookFailed(path, index, nb.cells[index] if started else None, e) from e
    return nb


def test_there_are_notebooks() -> None:
    assert NOTEBOOKS


def test_the_kernel_is_this_python() -> None:
    spec = ThisPythonKernel(kernel_name="python3").kernel_spec
    assert spec is not None and spec.argv[0] == sys.executable and "ipykernel_launcher" in spec.argv


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    try:
        nb = execute(path, tmp_path)
    except NotebookFailed as e:
        pytest.fail(str(e), pytrace=False)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


def test_saved_outputs_are_current_and_small() -> None:
    """A notebook is saved executed (every code cell has its outputs, in order), without the
    machine it ran on: no temporary or home folder, no timing metadata, no huge output."""
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), (
            f"{path.name} is not saved executed: run `python -m tests.test_notebooks {path.name}`")
        for c in code:
            shown = json.dumps(c.outputs)
            assert "execution" not in c.metadata, f"{path.name}: timing metadata saved"
            assert len(shown) <= SAVED_OUTPUT_LIMIT, f"{path.name}: a cell's output is huge"
            assert not re.search(r"/tmp/|/home/|/Users/|\\\\Temp\\\\|trellis-notebook-", shown), (
                f"{path.name}: an output names a folder of the machine it ran on")


def save(path: Path) -> None:
    """Execute ``path`` in a temporary folder and write it back with its outputs: no timing
    metadata, so a refresh changes only what the cells show."""
    with tempfile.TemporaryDirectory(prefix="trellis-notebook-run-") as cwd:
        nb = execute(path, Path(cwd), timing=False)
    for cell in nb.cells:
        size = len(json.dumps(cell.get("outputs", [])))
        if size > SAVED_OUTPUT_LIMIT:
            raise SystemExit(f"{path.name}: a cell's output is {size:,} characters; show less (e.g. .head())")
    nbformat.write(nb, path)
    print(f"saved {path} with its outputs")


def main(argv: list[str]) -> int:
    paths = [Path(a).resolve() for a in argv] or NOTEBOOKS
    for p in paths:
        try:
            save(p)
        except NotebookFailed as e:
            print(e, file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
