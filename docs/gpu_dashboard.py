"""Draws the team dashboard showing a run trained on the GPU machine, from that run's recorded directory.

The GPU machine has no browser, so the dashboard is served here, on a local scheduler, with the recorded
run directory as its runs directory, and loaded in headless Chromium: what it draws is the run's own
records (throughput, loss, switches, held-out metrics, and each worker's GPU memory and use). Two runs:
- docs/dashboard-gpu.png (the default): two workers sharing one NVIDIA H200 on `digits`, all-reduce
  switched live to async and back (the live-switch test of tests/cluster/test_gpu.py),
  benchmarks/results/gpu-run-nvidia-h200/;
- docs/dashboard-gpu-gpt.png: the GPT (gpt-small) on the standard library's text, two workers sharing an
  H200 under `auto` (benchmarks/gpt_gpu.py, part 2; the run `gpt-strategies.json` names),
  docs/runs/gpt-auto-run-nvidia-h200/.

    python docs/gpu_dashboard.py [RUN_DIR PNG]   # needs chromium (apt-get install chromium) and the test extras
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import workbench  # noqa: E402
from helpers import chromium  # noqa: E402
from test_dashboard import COUNT, open_dashboard, served  # noqa: E402

RECORDED = ROOT / "benchmarks" / "results" / "gpu-run-nvidia-h200"


def main(recorded: Path = RECORDED, picture: Path = ROOT / "docs" / "dashboard-gpu.png") -> None:
    with tempfile.TemporaryDirectory() as scratch:
        runs = Path(scratch) / "runs"
        run_id = __import__("json").loads((recorded / "config.json").read_text())["run_id"]
        shutil.copytree(recorded, runs / run_id)
        with workbench.client_session(workers=1, dashboard_address=":0") as client, \
                served(client, runs) as url, chromium() as browser:
            page = open_dashboard(browser, url, run_id)
            page.locator(".worker-table table").first.wait_for(timeout=30_000)
            # The plots hold the run's points (drawn after the table).
            page.wait_for_function(f"() => ({COUNT.format(name='throughput', column='time')}) () >= 2"
                                   f" && ({COUNT.format(name='loss', column='step')}) () >= 2", timeout=30_000)
            page.screenshot(path=str(picture), full_page=True)
            print(page.locator(".worker-table table").first.inner_text())


if __name__ == "__main__":
    main(*(Path(argument) for argument in sys.argv[1:3]))
