"""Where a benchmark's result goes and what every result file holds besides its measurements.

One current file per benchmark and machine class: `benchmarks/results/<machine-class>/<name>.json`
(`cpu-2core` for this project's 2-core VM, `gpu-h200` for the device machine). History is git's. Each file
holds the commit it measured (and whether the tree was dirty: `python -m benchmarks run` refuses a dirty
tree), the date, the machine, the settings, the raw cells and the headline keys, all written by the
benchmark's own script through `write` (atomically: a cut run leaves the previous file or the new one).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
ROOT = HERE.parent
PAGE = ROOT / "docs" / "benchmarks.md"  # rendered from the result files (pages.py)
FIGURES = ROOT / "docs" / "figures"  # the page's pictures, drawn from the result files with it (pages.py)
PROVENANCE = ("benchmark", "commit", "dirty", "date", "machine", "settings")  # what every result file holds


def machine_class() -> str:
    """The folder for this machine's results: `gpu-<model>` with a CUDA device, else `cpu-<cores>core`
    (WORKBENCH_MACHINE_CLASS overrides, e.g. for the device machine's copy of the tree)."""
    if os.environ.get("WORKBENCH_MACHINE_CLASS"):
        return os.environ["WORKBENCH_MACHINE_CLASS"]
    try:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0).lower()
            model = next((m for m in ("h200", "h100", "a100", "l4", "a10") if m in name), name.split()[-1])
            return f"gpu-{model}"
    except ImportError:
        pass
    return f"cpu-{os.cpu_count()}core"


def path_for(name: str, machine: str | None = None) -> Path:
    """The current result file of benchmark `name` on `machine` (this machine's class by default)."""
    return RESULTS / (machine or machine_class()) / f"{name}.json"


def commit() -> dict[str, Any]:
    """The commit measured: as the caller says (COMMIT=..., DIRTY=...: the device machine's copy of the tree
    is not the clone it came from), else from git."""
    if os.environ.get("COMMIT"):
        said = os.environ.get("DIRTY", "unknown")
        return {"commit": os.environ["COMMIT"], "dirty": {"true": True, "false": False}.get(said.lower(), said)}
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        return {"commit": head, "dirty": tree_is_dirty()}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty": "unknown"}


# What `python -m benchmarks run` and `render` write: not code a result measures. A run of several benchmarks
# writes the first one's file before the next starts, and counting it marked every later result dirty.
OUTPUTS = (RESULTS, PAGE, FIGURES)


def tree_is_dirty(root: Path = ROOT) -> bool:
    """Whether tracked files differ from the commit, the benchmarks' own outputs (OUTPUTS) aside; untracked
    ones, such as scratch output, do not count either."""
    outputs = [f":(exclude){path.relative_to(ROOT)}" for path in OUTPUTS]
    return bool(subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".",
                                *outputs], capture_output=True, text=True, check=True).stdout.strip())


def machine(description: str = "") -> dict[str, Any]:
    """The machine measured on: cores, CPU, memory, accelerator and the versions that matter."""
    import dask
    import distributed
    import torch

    model = ""
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    memory_kib = next((int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal")), 0)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    summary = f"{os.cpu_count()} cores ({model}), {memory_kib / 2**20:.0f} GiB, " + (gpu or "no GPU used")
    return {"class": machine_class(), "description": f"{summary}; {description}" if description else summary,
            "cores": os.cpu_count(), "cpu": model, "memory_gib": round(memory_kib / 2**20), "gpu": gpu,
            "arch": platform.machine(), "kernel": platform.release(), "python": platform.python_version(),
            "torch": torch.__version__, "dask": dask.__version__, "distributed": distributed.__version__}


def document(benchmark: str, settings: dict[str, Any], description: str = "") -> dict[str, Any]:
    """A new result document: its provenance and settings; the script adds cells and headline keys."""
    return {"benchmark": benchmark, **commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(description), "settings": settings}


def write(path: str | os.PathLike[str], result: dict[str, Any]) -> None:
    """Write `result` to `path` atomically (a temporary file, then a rename)."""
    missing = [key for key in PROVENANCE if key not in result]
    if missing:
        raise ValueError(f"a result file needs {', '.join(missing)}; start it with resultfile.document(...)")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False)
    with handle:
        handle.write(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(handle.name, path)


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
