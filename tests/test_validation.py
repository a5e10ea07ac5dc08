"""Bad input is refused on the client, at once, with the right type and a message naming the parameter."""
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import workbench
from workbench.errors import ClusterError, ConfigError
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
    ("epochs", dict(epochs=None)),
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
