"""The example notebooks, executed top to bottom in a real kernel (nbclient) on the embedded default
cluster, shrunk by WORKBENCH_NOTEBOOK_QUICK=1; any cell error fails the test."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from workbench import lab as labs

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# What each notebook must have printed or shown, beyond running without an error.
EXPECTED_OUTPUT = {
    "01-quickstart": ["held-out accuracy", "application/vnd.jupyter.widget-view+json"],
    "02-compare-strategies": ["Fastest:", "staleness mean", "application/vnd.jupyter.widget-view+json"],
    "03-live-control": ["paused at steps", "average -> async", "back to async at step"],
    "04-existing-cluster": ["held-out accuracy", "tcp://127.0.0.1"],
    "05-bring-your-own-model": ["on shifted images", "parameters"],
    "06-team-dashboard": ["Dashboard at", "samples/s", "application/vnd.holoviews_exec.v0+json"],
    # Emulated hosts need root and iproute2: without them the notebook says why and skips its lab cells.
    "07-slow-network": (["keeps", "of its 1gbit throughput at 100mbit", "application/vnd.jupyter.widget-view+json"]
                        if labs.available() is None else ["No emulated hosts here"]),
    "08-capacity-planning": ["calibration", "measured lab points from", "max throughput error", "image/png"],
}


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


README = Path(__file__).resolve().parent.parent / "README.md"


def test_every_notebook_is_covered_and_stored_executed_with_pictures():
    # Committed executed (notebooks/refresh.py), so that a reader on a code host sees the results; the
    # tests below still execute every notebook afresh. Every code cell ran, in order, and every notebook
    # that trains holds a static figure beside its live widgets (06 shows the dashboard's screenshot).
    assert [path.stem for path in NOTEBOOKS] == sorted(EXPECTED_OUTPUT)
    for path in NOTEBOOKS:
        notebook = nbformat.read(path, as_version=4)
        code = [cell for cell in notebook.cells if cell.cell_type == "code"]
        assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), \
            f"{path.name} is not stored executed top to bottom: run python notebooks/refresh.py {path.stem}"
        images = [output for cell in code for output in cell.outputs if "image/png" in output.get("data", {})]
        if path.stem == "06-team-dashboard":
            assert "../docs/dashboard.png" in "".join(cell.source for cell in notebook.cells)
        else:
            assert images, f"{path.name} shows no static figure"
    figure = README.parent / "docs" / "strategy-comparison.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "docs/strategy-comparison.png" in README.read_text()


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
