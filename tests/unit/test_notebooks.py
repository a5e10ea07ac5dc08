"""The example notebooks are each covered by the executing test (tests/cluster/test_notebooks_cluster.py)
and stored executed top to bottom, with their pictures."""
from __future__ import annotations

from pathlib import Path

import nbformat

from helpers import notebook_expectations

NOTEBOOKS, EXPECTED_OUTPUT = notebook_expectations()
DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_notebook_is_covered_and_stored_executed_with_pictures():
    # Committed executed (notebooks/refresh.py), so that a reader on a code host sees the results; the
    # cluster tier's tests still execute every notebook afresh. Every code cell ran, in order, and every notebook
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
    figure = DOCS / "strategy-comparison.png"
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "](strategy-comparison.png)" in (DOCS / "strategies.md").read_text()
