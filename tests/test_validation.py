"""Bad input is refused on the client, at once, with the right type and a message naming the parameter."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import workbench
from workbench.errors import ClusterError, ConfigError, ResumeError
from workbench.strategies import make_settings


def good_job(**changes):
    fields = dict(model=workbench.mlp(64, 10), data="digits")
    fields.update(changes)
    return workbench.Job(**fields)


def _unpicklable_factory():
    lock = threading.Lock()
    return lambda: (lock, torch.nn.Linear(2, 2))[1]


BAD_JOBS = [
    ("model", dict(model="not callable")),
    ("model", dict(model=lambda: "not a module")),
    ("model", dict(model=lambda: torch.nn.ReLU())),  # no parameters
    ("model", dict(model=_unpicklable_factory())),
    ("data", dict(data="no-such-dataset")),
    ("data", dict(data="no_such_module:function")),
    ("data", dict(data=(np.zeros((10, 3)), np.zeros(9)))),  # mismatched lengths
    ("data", dict(data=42)),
    ("loss", dict(loss="hinge")),
    ("optimizer", dict(optimizer="lbfgs")),
    ("momentum", dict(momentum=1.5)),
    ("lr", dict(lr=0)),
    ("lr", dict(lr=float("nan"))),
    ("lr", dict(lr=-0.1)),
    ("batch_size", dict(batch_size=0)),
    ("batch_size", dict(batch_size=2.5)),
    ("epochs", dict(epochs=0)),
    ("epochs", dict(epochs=2.5)),
    ("steps", dict(steps=-3)),
    ("eval_every", dict(eval_every=0)),
    ("device", dict(device="tpu")),
    ("seed", dict(seed=-1)),
]


@pytest.mark.parametrize("parameter,changes", BAD_JOBS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_JOBS)])
def test_bad_job_fields_are_refused_naming_the_parameter(parameter, changes):
    with pytest.raises(ConfigError) as caught:
        good_job(**changes).prepare()
    assert caught.value.parameter == parameter
    assert str(caught.value).startswith(f"{parameter}=")
    assert "expected" in str(caught.value)


class _Pairs(torch.utils.data.Dataset):
    """A map-style dataset of (input, label) items, as users write them."""

    def __init__(self, inputs, targets):
        self.inputs, self.targets = inputs, targets

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index]


_X, _Y = torch.rand(200, 64), torch.randint(0, 10, (200,))


def _with_nan(inputs, sample=17, position=5):
    inputs = inputs.clone()
    inputs[sample, position] = float("nan")
    return inputs


def _dask_pair(inputs, targets):
    import dask.array as da

    return da.from_array(inputs.numpy(), chunks=50), da.from_array(targets.numpy(), chunks=50)


# Data that cannot train the model: refused by prepare() with the data named and the offending values said.
BAD_DATA = [
    ("data", dict(data=(_X, torch.randint(0, 27, (200,)))), "labels 0..9: the model has 10 outputs"),
    # Every label from 10 to 26 in the first batch (the check reads one): random labels missed 10 there
    # one time in seven.
    ("data", dict(data=_Pairs(_X, torch.arange(200) % 17 + 10)), "labels from 10 to 26"),
    ("data", dict(data=(_with_nan(_X), _Y)), "nan at sample 17, position 5"),
    ("data", dict(data=_Pairs(_with_nan(_X, sample=3), _Y)), "sample 3, position 5"),
    ("data", dict(data=(_X[:0], _Y[:0])), "0 samples"),
    ("data", dict(data=_Pairs(_X[:0], _Y[:0])), "0 samples"),
    ("data", dict(data=(torch.randint(0, 16, (200, 64)), _Y)), "convert them (inputs.float())"),
    ("data", dict(data=(_X, _Y.float())), "class indices (an integer dtype)"),
    ("data", dict(data=(_X[:, :60], _Y)), "inputs have 60 features; the model's first layer takes 64"),
    ("data", dict(data=_dask_pair(_X[:, :60], _Y)), "inputs have 60 features"),
    ("data", dict(data=_dask_pair(_X, _Y + 5)), "labels 0..9"),
    ("data", dict(data=(_X, _Y), loss="mse"), "targets the loss 'mse' can take"),
    ("eval_data", dict(eval_data=(_X, torch.randint(0, 12, (200,)))), "labels 0..9"),
    ("steps", dict(epochs=3, steps=10), "either epochs"),
    ("loss", dict(loss=lambda outputs, targets: outputs.sum(dim=1)), "returning a scalar tensor"),
    ("loss", dict(loss=lambda outputs, targets: torch.nn.functional.mse_loss(outputs, targets)),
     "targets torch.int64 of shape (32,)"),
]


@pytest.mark.parametrize("parameter,changes,fragment", BAD_DATA, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD_DATA)])
def test_data_the_model_cannot_take_is_refused_before_anything_starts(parameter, changes, fragment):
    with pytest.raises(ConfigError) as caught:
        good_job(**changes).prepare()
    assert caught.value.parameter == parameter
    assert str(caught.value).startswith(f"{parameter}=") and "expected" in str(caught.value)
    assert fragment.lower() in str(caught.value).lower(), str(caught.value)


def test_a_dataset_that_cannot_be_read_is_named():
    class Broken(_Pairs):
        def __getitem__(self, index):
            raise KeyError(index)

    with pytest.raises(ConfigError, match=r"^data=.*Reading its first 32 items raised KeyError"):
        good_job(data=Broken(_X, _Y)).prepare()


BAD_SETTINGS = [
    ("strategy", "allreduce-ish", {}),
    ("period", "average", {"period": 0}),
    ("period", "average", {"period": 2.5}),
    ("average_optimizer_state", "average", {"average_optimizer_state": "yes"}),
    ("bucket_mb", "allreduce", {"bucket_mb": -1}),
    ("push_every", "average", {"push_every": 4}),  # a setting the strategy does not have
    ("push_every", "async", {"push_every": 0}),
    ("fetch_every", "async", {"fetch_every": -2}),
    ("max_staleness", "ssp", {"max_staleness": -1}),
    ("max_staleness", "async", {"max_staleness": 2}),  # only 'ssp' has a bound
    ("alpha", "easgd", {"alpha": 1.5}),
    ("alpha", "easgd", {"alpha": float("nan")}),
    ("compression", "async", {"compression": "gzip"}),
    ("reply_compression", "easgd", {"reply_compression": "gzip"}),
    ("topk_ratio", "async", {"compression": "topk", "topk_ratio": 0}),
    ("threshold_tau", "ssp", {"threshold_tau": -1e-3}),
    ("shards", "easgd", {"shards": 0}),
    ("staleness_aware_lr", "async", {"staleness_aware_lr": "yes"}),
]


@pytest.mark.parametrize("parameter,strategy,values", BAD_SETTINGS)
def test_bad_strategy_settings_are_refused(parameter, strategy, values):
    with pytest.raises(ConfigError) as caught:
        make_settings(strategy, values)
    assert caught.value.parameter == parameter


def test_cluster_arguments_are_checked_before_anything_starts():
    with pytest.raises(ConfigError, match="^workers="):
        workbench.connect(workers=0)
    with pytest.raises(ConfigError, match="^kind="):
        workbench.connect(kind="tpu")
    with pytest.raises(ConfigError, match="^scheduler="):
        workbench.connect(scheduler="nonsense")


@pytest.mark.timeout(30)
def test_unreachable_scheduler_fails_within_the_timeout():
    import time

    started = time.monotonic()
    with pytest.raises(ClusterError, match="could not reach the Dask scheduler at tcp://127.0.0.1:9"):
        workbench.connect(scheduler="tcp://127.0.0.1:9", timeout_s=2)
    assert time.monotonic() - started < 15


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
    from workbench import checkpoint as checkpoints

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
