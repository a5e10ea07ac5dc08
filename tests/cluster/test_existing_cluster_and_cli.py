"""An existing cluster started with the `dask scheduler` / `dask worker` commands, and the CLI end to end."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import workbench
from workbench.plane import deadline

from helpers import cli_in_process, dask_cluster_on_loopback, wait_until
from workbench.worker.host import HOUSEKEEPING_MS

pytestmark = [pytest.mark.cluster]
WORKBENCH = str(Path(sys.executable).with_name("workbench"))




@pytest.mark.timeout(240)
def test_existing_cluster_started_with_dask_commands_trains_a_job(tmp_path):
    with dask_cluster_on_loopback(tmp_path) as address:
        client = workbench.connect(scheduler=address, timeout_s=30)
        try:
            client.wait_for_workers(2, timeout=90)
            names = (*HOUSEKEEPING_MS, "profile")

            def _housekeeping(dask_worker):  # defined here: sent by value (the workers cannot import tests)
                """A worker's timed housekeeping: callback name -> (interval in ms, running)."""
                return {name: (callback.callback_time, callback.is_running())
                        for name, callback in dask_worker.periodic_callbacks.items() if name in names}

            before = client.run(_housekeeping)  # workers started with Dask's defaults
            assert all(h["tick"] == (20, True) and h["profile"][1] for h in before.values()), before
            # Long enough (about 1,300 steps a worker) that the pause below lands while the ranks still train.
            job = workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=16, lr=0.1, momentum=0.9,
                                epochs=30)
            run = workbench.train(job, "allreduce", client=client, run_dir=tmp_path / "runs")
            run.wait_for_step(5)
            run.pause()  # held while the workers' housekeeping is read: the ranks are still in their task
            # While a rank trains, its worker's profiler is stopped and its timers run at the quiet intervals.
            # The profiler keeps its interval, whatever Dask's default: it is stopped, not slowed.
            quiet = {worker: {**{name: (ms, True) for name, ms in HOUSEKEEPING_MS.items()},
                              "profile": (h["profile"][0], False)} for worker, h in before.items()}
            wait_until(lambda: client.run(_housekeeping) == quiet, timeout_s=30, interval_s=0.2)
            run.resume()
            assert run.wait(timeout=120) == "finished"
            # And once it is done they run as before, for whatever the cluster does next.
            wait_until(lambda: client.run(_housekeeping) == before, timeout_s=30, interval_s=0.2)
            assert run.config["scheduler"] == address
            assert run.evaluate()["accuracy"] >= 0.9
            # The CLI trains on the same cluster through --scheduler.
            result = subprocess.run(
                [WORKBENCH, "train", "--scheduler", address, "--strategy", "average", "--period", "2",
                 "--epochs", "5", "--run-dir", str(tmp_path / "cli-runs"), "--no-progress"],
                capture_output=True, text=True, timeout=180)
            assert result.returncode == 0, result.stderr
            assert "held-out accuracy" in result.stdout
        finally:
            client.close()


@pytest.mark.timeout(240)
def test_cli_trains_on_the_embedded_cluster_and_prints_accuracy(tmp_path):
    result = subprocess.run(
        [WORKBENCH, "train", "--strategy", "average", "--period", "4", "--workers", "2", "--epochs", "5",
         "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr
    accuracy_lines = [line for line in result.stdout.splitlines() if "accuracy" in line]
    assert accuracy_lines and float(accuracy_lines[0].split()[-1]) >= 0.9
    assert "samples/s" in result.stderr  # the live progress bar
    run_dirs = list(tmp_path.iterdir())
    assert len(run_dirs) == 1 and (run_dirs[0] / "model.pt").exists() and (run_dirs[0] / "summary.json").exists()
    # The summary carries the best held-out metric (the dashboard lists the run from it alone).
    summary = json.loads((run_dirs[0] / "summary.json").read_text())
    assert summary["best_metric"][0] == "accuracy" and 0.9 <= summary["best_metric"][1] <= 1.0
    # No --timeout: measured from average's steps, syncs and evaluations once they are (a run this short
    # may end first, under load), and the one in force at the end is said as the summary has it.
    in_force = summary["deadline"]
    assert in_force["strategy"] == "average" and in_force["how"] in ("measured", "unmeasured")
    if in_force["how"] == "measured":
        assert in_force["timeout_s"] == max(15.0, 10 * in_force["longest_wait_s"])
    config = json.loads((run_dirs[0] / "config.json").read_text())
    assert config["collective_timeout_s"] is None and config["deadline"]["how"] == "measured"
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("timeout: ")]
    assert line == deadline.describe(in_force)


def test_cli_prints_staleness_and_bytes_for_the_parameter_server(tmp_path):
    result = subprocess.run(
        [WORKBENCH, "train", "--strategy", "ssp", "--compression", "topk", "--workers", "2", "--epochs", "2",
         "--lr", "0.05", "--momentum", "0.7", "--batch-size", "8", "--no-progress", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=200)
    assert result.returncode == 0, result.stderr
    lines = {line.split(":")[0]: line for line in result.stdout.splitlines()}
    mean, maximum = lines["staleness"].replace(",", "").split()[2:5:2]
    assert 0 < float(mean) <= int(maximum)
    assert "throughput" in lines and "slowest worker" in lines["throughput"]
    sent, received = re.search(r"sent ([\d,.]+) KiB, received ([\d,.]+) KiB", lines["per step"]).groups()
    # Top-k both ways: 2% of the 4810-parameter MLP's 18.8 KiB each way.
    assert 0 < float(sent.replace(",", "")) < 1 and 0 < float(received.replace(",", "")) < 1
    # What the link alone would allow and the share of it the run reached (on loopback: far from it).
    assert re.search(r"^link: about [\d,.]+ MB/s, [\d,.]+ (B|KiB) a step per worker; the link alone would allow "
                     r"[\d,]+ samples/s, compute alone [\d,]+; the run makes [\d,]+, \d+% of the link's limit "
                     r"\((bound by compute|bound by the link|waiting bounds it)", lines["link"]), result.stdout


@pytest.mark.parametrize("arguments,fragment", [
    (["train", "--workers", "0"], "--workers"),
    (["train", "--strategy", "nonsense"], "--strategy"),
    (["train", "--lr", "-1"], "--lr"),
    (["train", "--dataset", "no_module_here:make"], "--dataset"),
    (["train", "--batch-size", "5000", "--workers", "2"], "batch_size=5000"),
    (["train", "--scheduler", "tcp://127.0.0.1:9"], "could not reach"),
    (["frobnicate"], "invalid choice"),
    (["train", "--strategy", "allreduce", "--push-every", "4"], "push_every=4"),
    (["train", "--strategy", "ssp", "--max-staleness", "-1"], "max_staleness=-1"),
    (["train", "--strategy", "async", "--shards", "3", "--workers", "2"], "shards=3"),
])
@pytest.mark.timeout(120)
def test_cli_refuses_bad_arguments_with_one_line(arguments, fragment, tmp_path, capsys):
    code, lines = cli_in_process([*arguments, "--run-dir", str(tmp_path)] if arguments[0] == "train"
                                 else arguments, capsys)
    # 2 for bad input; 1 for a cluster that cannot be reached (the input may be right)
    assert code == (1 if fragment == "could not reach" else 2) and len(lines) == 1 and fragment in lines[0], lines


@pytest.mark.timeout(120)
def test_the_installed_command_refuses_bad_input_with_one_line_and_its_exit_code(tmp_path):
    # As a shell runs it (the checks above run its `main` in this process): the entry point, the exit
    # code, and nothing else on stderr, neither a traceback nor Dask's logging.
    for arguments, fragment, code in ((["train", "--strategy", "nonsense"], "--strategy", 2),
                                      (["train", "--scheduler", "tcp://127.0.0.1:9"], "could not reach", 1)):
        result = subprocess.run([WORKBENCH, *arguments, "--run-dir", str(tmp_path)], capture_output=True, text=True,
                                timeout=100)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == code and len(lines) == 1 and fragment in lines[0], result.stderr
