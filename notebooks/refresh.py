"""Execute the example notebooks top to bottom and store them with their outputs, so that a reader on a
code host sees every table, printout and static figure without running anything.

Each runs in a fresh kernel of this interpreter (nbclient), full size (not WORKBENCH_NOTEBOOK_QUICK),
in a temporary working directory (its run directories are thrown away), with the widgets' state stored.
The figure of the cell tagged `readme-figure` (notebook 02's strategy comparison) is copied to
`docs/strategy-comparison.png`, which the README shows. The tests execute the notebooks afresh either
way; this only refreshes what is committed.

    python notebooks/refresh.py [NAME ...]      # e.g. 02-compare-strategies; default: all of them
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
README_FIGURE = HERE.parent / "docs" / "strategy-comparison.png"


def kernel(root: Path) -> str:
    """A kernelspec for this very interpreter, so the kernel imports the workbench of this checkout."""
    spec = root / "kernels" / "workbench-refresh"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "workbench", "language": "python"}))
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("JUPYTER_PATH")]))
    return "workbench-refresh"


def readme_figure(notebook: nbformat.NotebookNode) -> bytes | None:
    for cell in notebook.cells:
        if "readme-figure" in cell.get("metadata", {}).get("tags", []):
            for output in cell.get("outputs", []):
                if "image/png" in output.get("data", {}):
                    return base64.b64decode(output["data"]["image/png"])
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebooks to refresh (default: all)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    arguments = parser.parse_args()
    os.environ.pop("WORKBENCH_NOTEBOOK_QUICK", None)
    paths = sorted(HERE.glob("*.ipynb"))
    if arguments.names:
        paths = [path for path in paths if path.stem in arguments.names]
    with tempfile.TemporaryDirectory(prefix="notebooks-") as scratch:
        name = kernel(Path(scratch) / "jupyter")
        for path in paths:
            started = time.monotonic()
            notebook = nbformat.read(path, as_version=4)
            kernelspec = notebook.metadata.get("kernelspec")
            workdir = Path(scratch) / path.stem
            workdir.mkdir()
            NotebookClient(notebook, timeout=arguments.timeout, kernel_name=name, store_widget_state=True,
                           resources={"metadata": {"path": str(workdir)}}).execute()
            if kernelspec is not None:  # the scratch kernel's name means nothing to a reader
                notebook.metadata["kernelspec"] = kernelspec
            nbformat.write(notebook, path)
            figure = readme_figure(notebook)
            if figure is not None:
                README_FIGURE.write_bytes(figure)
            print(f"{path.name}: {time.monotonic() - started:.0f} s, {path.stat().st_size / 1024:.0f} KiB"
                  + (f", {README_FIGURE.relative_to(HERE.parent)} written" if figure else ""), flush=True)


if __name__ == "__main__":
    main()
