"""Bad input refused on the client, on the session cluster: every train()/resume() argument, with nothing
left behind on the cluster; and importing the engine in a fresh process pulls in no UI module (the
checks that need no cluster: tests/unit/test_validation.py)."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import workbench
from workbench.errors import ConfigError, ResumeError

from helpers import digits_job as good_job


def _unpicklable_factory():
    lock = threading.Lock()
    return lambda: (lock, torch.nn.Linear(2, 2))[1]


_X, _Y = torch.rand(200, 64), torch.randint(0, 10, (200,))


def _with_nan(inputs, sample=17, position=5):
    inputs = inputs.clone()
    inputs[sample, position] = float("nan")
    return inputs


def test_importing_the_engine_pulls_in_no_ui_module():
    code = ("import sys, workbench; bad = [m for m in ('panel', 'bokeh', 'ipywidgets', 'IPython', 'widgets') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# --- every train()/resume() argument, refused on the client before anything starts on the cluster --------


def _run_directory_of_another_model(tmp_path):
    directory = tmp_path / "other-model"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    from workbench.plane import checkpoint_format as checkpoints

    checkpoints.save(directory / checkpoints.CHECKPOINT_FILE, {
        "step": 3, "weights": torch.nn.Linear(3, 2).state_dict(), "strategy": "allreduce", "settings": {},
        "lr": 0.1, "optimizer": {}})
    return directory


def _run_directory_without_checkpoint(tmp_path):
    directory = tmp_path / "no-checkpoint"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    return directory


def _a_file(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    return path / "runs"


# (parameter named, exception type, how to start the run given (client, tmp_path))
BAD_RUNS = [
    ("strategy", ConfigError, lambda c, d: workbench.train(good_job(), "allreduce-ish", client=c, run_dir=d)),
    ("period", ConfigError, lambda c, d: workbench.train(good_job(), "allreduce", client=c, run_dir=d, period=2)),
    ("period", ConfigError, lambda c, d: workbench.train(good_job(), "average", client=c, run_dir=d, period=0)),
    ("push_every", ConfigError, lambda c, d: workbench.train(good_job(), "async", client=c, run_dir=d, push_every=0)),
    ("lr", ConfigError, lambda c, d: workbench.train(good_job(lr=float("nan")), client=c, run_dir=d)),
    ("lr", ConfigError, lambda c, d: workbench.train(good_job(lr=-1.0), client=c, run_dir=d)),
    ("momentum", ConfigError, lambda c, d: workbench.train(good_job(momentum=1.0), client=c, run_dir=d)),
    ("batch_size", ConfigError, lambda c, d: workbench.train(good_job(batch_size=0), client=c, run_dir=d)),
    # digits has 1,437 training samples: 718 per worker of 2
    ("batch_size", ConfigError, lambda c, d: workbench.train(good_job(batch_size=1000), client=c, run_dir=d)),
    ("workers", ConfigError, lambda c, d: workbench.train(good_job(), client=c, run_dir=d, workers=5)),
    ("data", ConfigError, lambda c, d: workbench.train(good_job(data=(np.zeros((10, 3)), np.zeros(9))),
                                                       client=c, run_dir=d)),
    ("data", ConfigError, lambda c, d: workbench.train(good_job(data=(_X, _Y + 20)), "async", client=c, run_dir=d)),
    ("data", ConfigError, lambda c, d: workbench.train(good_job(data=(_with_nan(_X), _Y)), client=c, run_dir=d)),
    ("steps", ConfigError, lambda c, d: workbench.train(good_job(epochs=2, steps=5), client=c, run_dir=d)),
    ("model", ConfigError, lambda c, d: workbench.train(good_job(model=_unpicklable_factory()), client=c, run_dir=d)),
    ("run_dir", ConfigError, lambda c, d: workbench.train(good_job(), client=c, run_dir=_a_file(d))),
    ("shards", ConfigError, lambda c, d: workbench.train(good_job(), "async", client=c, run_dir=d, shards=3)),
    ("alpha", ConfigError, lambda c, d: workbench.train(good_job(), "easgd", client=c, run_dir=d, alpha=0)),
    ("compression", ConfigError, lambda c, d: workbench.train(good_job(), "ssp", client=c, run_dir=d,
                                                              compression="zip")),
    ("max_staleness", ConfigError, lambda c, d: workbench.train(good_job(), "ssp", client=c, run_dir=d,
                                                                max_staleness=-1)),
    ("checkpoint_every_steps", ConfigError,
     lambda c, d: workbench.train(good_job(), client=c, run_dir=d, checkpoint_every_steps=0)),
    ("checkpoint_every_s", ConfigError,
     lambda c, d: workbench.train(good_job(), client=c, run_dir=d, checkpoint_every_s=-5)),
    ("min_workers", ConfigError, lambda c, d: workbench.train(good_job(), client=c, run_dir=d, min_workers=3)),
    ("collective_timeout_s", ConfigError,
     lambda c, d: workbench.train(good_job(), client=c, run_dir=d, collective_timeout_s=float("inf"))),
    ("auto_join", ConfigError, lambda c, d: workbench.train(good_job(), client=c, run_dir=d, auto_join="yes")),
    ("owner", ConfigError, lambda c, d: workbench.train(good_job(), client=c, run_dir=d, owner="  ")),
    ("run_dir", ResumeError, lambda c, d: workbench.resume(d / "no-such-run", client=c)),
    ("run_dir", ResumeError, lambda c, d: workbench.resume(_run_directory_without_checkpoint(d), client=c)),
    ("checkpoint", ResumeError,
     lambda c, d: workbench.resume(_run_directory_of_another_model(d), client=c, job=good_job())),
    ("period", ConfigError,
     lambda c, d: workbench.resume(_run_directory_of_another_model(d), client=c, job=workbench.Job(
         model=lambda: torch.nn.Linear(3, 2), data=(torch.zeros(64, 3), torch.zeros(64, dtype=torch.long))),
         period=3)),
]


def _cluster_state(client):
    keys = client.run_on_scheduler(lambda dask_scheduler: sorted(str(k) for k in dask_scheduler.tasks))
    return {"pids": client.run(os.getpid), "tasks": [k for k in keys if "workbench" in k]}


@pytest.mark.timeout(120)
def test_bad_runs_are_refused_on_the_client_with_nothing_left_behind(client, tmp_path):
    import time

    before = _cluster_state(client)
    for index, (parameter, error_type, start) in enumerate(BAD_RUNS):
        directory = tmp_path / f"case-{index}"
        directory.mkdir()
        started = time.monotonic()
        with pytest.raises(error_type) as caught:
            start(client, directory)
        assert time.monotonic() - started < 10, f"case {index} ({parameter}) took too long"
        assert type(caught.value) is error_type, f"case {index}: {type(caught.value).__name__}"
        assert caught.value.parameter == parameter, f"case {index}: {caught.value}"
        assert str(caught.value).startswith(f"{parameter}=") and "expected" in str(caught.value)
    assert len(BAD_RUNS) >= 20
    assert _cluster_state(client) == before  # no task, no new or lost worker process
    assert not any(client.run(lambda: __import__("torch").distributed.is_initialized()).values())
