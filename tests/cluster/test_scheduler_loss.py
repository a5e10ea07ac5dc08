"""Losing the Dask scheduler mid-run (issue 18, item 3): the command ends with one error that names the
run directory and the exact command that goes on from the last checkpoint; nothing else is printed, and
the run loses at most one checkpoint interval."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import dask_cluster_on_loopback, wait_until
from workbench.plane.rundir import read_metrics

pytestmark = [pytest.mark.cluster]
WORKBENCH = str(Path(sys.executable).with_name("workbench"))
EVERY = 25


def _scheduler_process() -> psutil.Process:
    (scheduler,) = [p for p in psutil.Process().children(recursive=True)
                    if "scheduler" in " ".join(p.cmdline()[:3])]
    return scheduler


def _checkpointed_step(run_dir: Path) -> int | None:
    for record in reversed(read_metrics(run_dir)) if (run_dir / "metrics.jsonl").exists() else []:
        if record.get("kind") == "checkpoint":
            return record["step"]
    return None


@pytest.mark.timeout(240)
def test_a_lost_scheduler_ends_the_run_with_how_to_resume_and_nothing_else(tmp_path):
    runs = tmp_path / "runs"
    with dask_cluster_on_loopback(tmp_path) as address:
        command = subprocess.Popen(
            [WORKBENCH, "train", "--scheduler", address, "--strategy", "average", "--epochs", "200",
             "--checkpoint-every-steps", str(EVERY), "--no-progress", "--run-dir", str(runs), "--timeout", "20"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            wait_until(lambda: runs.exists() and any(runs.iterdir())
                       and (_checkpointed_step(next(runs.iterdir())) or 0) >= 2 * EVERY, timeout_s=150)
            run_dir = next(runs.iterdir())
            _scheduler_process().send_signal(signal.SIGKILL)
            killed_at = time.time()
            out, err = command.communicate(timeout=90)
        finally:
            if command.poll() is None:
                command.kill()
    ended_after = time.time() - killed_at
    assert command.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and "distributed." not in err, err
    assert len(lines) == 2 and lines[0].startswith("workbench: error: run ") and lines[0].endswith("failed:"), err
    assert "lost the connection to the Dask scheduler" in lines[1]
    assert f"workbench train --resume {run_dir}" in lines[1] and f"workbench.resume({str(run_dir)!r}" in lines[1]
    assert ended_after < 30  # not Dask's whole reconnect timeout and more
    # What is lost: at most one checkpoint interval of steps (plus those in flight).
    records = read_metrics(run_dir)
    last_step = max(r["step"] for r in records if r["kind"] == "step")
    kept = json.loads((run_dir / "summary.json").read_text())
    checkpointed = _checkpointed_step(run_dir)
    assert kept["status"] == "failed" and last_step - checkpointed <= EVERY + 5
    assert records[-1]["kind"] == "run-failed"
