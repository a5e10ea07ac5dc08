"""The real workload on the cluster and from the command line: runs of the GPT on the 2-process cluster and
from the CLI, on a slice of the corpus and the test-size model, seconds each (the corpus, the model, the
schedule, evaluation and the checks on bad input, without a cluster: tests/unit/test_text_workload.py)."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings

import pytest
import torch

import workbench
from workbench import text
from workbench.cli import main as cli
from workbench.schedule import lr_factor
from workbench.strategies import STRATEGIES

from helpers import TEXT_SLICE as SLICE, cli_in_process, text_job


# --- on the cluster ------------------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_gpt_learns_the_text_under_allreduce_with_its_schedule(client, run_dir):
    run = workbench.train(text_job(), "allreduce", client=client, run_dir=run_dir)
    assert run.wait(timeout=200) == "finished"
    evaluations = run.events("eval")
    assert [e["step"] for e in evaluations] == [60, 120, 120]
    final = evaluations[-1]
    assert final["final"] and final["bits_per_char"] < 4.5 and final["token_accuracy"] > 0.25
    assert final["bits_per_char"] <= evaluations[0]["bits_per_char"] + 0.05
    assert run.config["data"]["sha256"] == text.load_corpus(SLICE).info["sha256"]
    # The schedule, as every worker applied it, step by step.
    for _, rows in run.metrics.groupby("worker"):
        lrs = rows.sort_values("step")["lr"].tolist()
        assert lrs == pytest.approx([3e-3 * lr_factor(s, 120, "cosine", 12) for s in range(120)])
    # The control panel's and the dashboard's views carry the held-out metrics.
    assert run.snapshot()["evaluations"][-1]["bits_per_char"] == pytest.approx(final["bits_per_char"])


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_schedule_reaches_the_parameter_server_and_a_set_lr_scales_it(client, run_dir):
    run = workbench.train(text_job(steps=100, eval_every=None), "async", client=client, run_dir=run_dir)
    # A learning rate set while the run trains scales the schedule from then on.
    workbench_lr = 1.5e-3
    run.set_lr(workbench_lr)
    assert run.wait(timeout=200) == "finished"
    final = run.events("eval")[-1]
    assert final["bits_per_char"] < 5.0
    for _, rows in run.metrics.groupby("worker"):
        rows = rows.sort_values("step")
        changed = rows[rows["lr"].sub(3e-3 * rows["step"].map(lambda s: lr_factor(s, 100, "cosine", 12))).abs() > 1e-9]
        assert len(changed), "the set learning rate never arrived"
        expected = changed["step"].map(lambda s: workbench_lr * lr_factor(s, 100, "cosine", 12))
        assert changed["lr"].tolist() == pytest.approx(expected.tolist())
    assert run.summary()["staleness"]["max"] >= 1  # two workers pushing every step: some pushes were stale


@pytest.mark.cluster
@pytest.mark.timeout(120)
def test_in_memory_tensors_reach_the_workers_without_a_large_graph(client, run_dir):
    windows = text.windows(text.load_corpus(SLICE).train, context=64)
    inputs, targets = windows.batch(torch.arange(len(windows)))  # 31k windows: 31 MB of int64
    job = workbench.Job(model=workbench.gpt("gpt-test"), data=(inputs, targets), optimizer="adamw", lr=3e-3,
                        steps=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # Dask's "Sending large graph of size ..." is one
        run = workbench.train(job, "allreduce", client=client, run_dir=run_dir)
        assert run.wait(timeout=100) == "finished"
    assert run.metrics["step"].max() == 4


# --- the CLI ---------------------------------------------------------------------------------------------------


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_the_cli_trains_the_gpt_on_the_text_and_reports_bits_per_character(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "workbench", "train", "--dataset", "stdlib-text", "--model", "gpt-test", "--context",
         "32", "--steps", "30", "--strategy", "average", "--period", "4", "--no-progress", "--run-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=220)
    assert out.returncode == 0, out.stderr[-2000:]
    bits = float(re.search(r"held-out bits per character: ([0-9.]+)", out.stdout).group(1))
    loss = float(re.search(r"held-out loss: ([0-9.]+)", out.stdout).group(1))
    assert bits == pytest.approx(loss / math.log(2), abs=1e-3) and bits < 7.0
    assert re.search(r"held-out next-token accuracy: 0\.[0-9]+", out.stdout)


@pytest.mark.cluster
@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", sorted(STRATEGIES) + ["auto"])
def test_every_strategy_trains_the_gpt_from_the_cli_with_its_own_defaults(strategy, client, tmp_path, capsys):
    # Only the strategy named: the optimizer (AdamW), learning rate, schedule and warm-up follow the job
    # (a language model), each strategy's settings its own defaults. Against the session's cluster.
    code = cli.main(["train", "--dataset", "stdlib-text", "--model", "gpt-test", "--context", "32", "--steps", "40",
                     "--strategy", strategy, "--workers", "2", "--scheduler", client.scheduler.address,
                     "--no-progress", "--run-dir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    bits = float(re.search(r"held-out bits per character: ([0-9.]+)", out).group(1))
    assert bits < 6.5, out  # from 8 (a uniform guess over 256 bytes) in 40 steps of 32 windows a worker
    assert "warning" not in out + err
    config = json.loads(next(tmp_path.glob("*/config.json")).read_text())
    assert config["job"]["optimizer"] == "adamw" and config["job"]["lr_schedule"] == "cosine"


def test_the_cli_refuses_a_context_longer_than_the_models_positions(tmp_path, capsys):
    # The command's main in this process (the installed command's own run: test_existing_cluster_and_cli.py).
    code, lines = cli_in_process(["train", "--dataset", "stdlib-text", "--model", "gpt-test", "--context", "1000",
                                  "--no-progress", "--run-dir", str(tmp_path)], capsys)
    assert code == 2 and len(lines) == 1 and "context" in lines[0] and "1000" in lines[0] and "64" in lines[0], lines
    code, lines = cli_in_process(["train", "--dataset", "stdlib-text", "--model", "mlp", "--run-dir", str(tmp_path)],
                                 capsys)
    assert code == 2 and len(lines) == 1 and "--model" in lines[0] and "gpt-mini" in lines[0], lines
