"""The example notebooks, executed top to bottom in a real kernel (nbclient) on the embedded default
cluster, shrunk by WORKBENCH_NOTEBOOK_QUICK=1; any cell error fails the test (what each must show:
`notebook_expectations` in tests/helpers.py; stored executed: tests/unit/test_notebooks.py)."""
from __future__ import annotations

import json
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient

from testbed import lab as labs

from helpers import notebook_expectations

NOTEBOOKS, EXPECTED_OUTPUT = notebook_expectations()


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """A kernelspec for this very interpreter, so the kernel imports the workbench under test."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / "workbench-tests"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "workbench tests", "language": "python"}))
    saved = {key: os.environ.get(key) for key in ("JUPYTER_PATH", "WORKBENCH_NOTEBOOK_QUICK")}
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), saved["JUPYTER_PATH"]]))
    os.environ["WORKBENCH_NOTEBOOK_QUICK"] = "1"
    yield "workbench-tests"
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _execute(path, kernel_name, tmp_path):
    """The notebook's outputs, all cells' together, as JSON text."""
    notebook = nbformat.read(path, as_version=4)
    # Run directories and files land in tmp_path, the notebook's working directory.
    NotebookClient(notebook, timeout=300, kernel_name=kernel_name, store_widget_state=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    return json.dumps([cell.get("outputs", []) for cell in notebook.cells])


@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_top_to_bottom(path, kernel_name, tmp_path):
    shown = _execute(path, kernel_name, tmp_path)
    for expected in EXPECTED_OUTPUT[path.stem]:
        assert expected in shown, f"{path.name} did not show {expected!r}"


@pytest.mark.cluster
@pytest.mark.timeout(300)
@pytest.mark.skipif(labs.available() is not None, reason="covered by the run above: no emulated hosts here")
def test_slow_network_notebook_without_the_lab_says_why_and_skips_it(kernel_name, tmp_path, monkeypatch):
    # Where the lab can be built, the path a user without root takes is run too (the kernel inherits this).
    monkeypatch.setenv("WORKBENCH_NOTEBOOK_NO_LAB", "1")
    path = next(p for p in NOTEBOOKS if p.stem == "07-slow-network")
    shown = _execute(path, kernel_name, tmp_path)
    assert "No emulated hosts here (WORKBENCH_NOTEBOOK_NO_LAB=1 is set)" in shown
    assert "samples/s" not in shown and "keeps" not in shown
