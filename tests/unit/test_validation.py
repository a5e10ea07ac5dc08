"""Bad input is refused on the client, at once, with the right type and a message naming the parameter
(every train()/resume() argument on the session cluster: tests/cluster/test_validation_cluster.py)."""
import threading

import numpy as np
import pytest
import torch

import workbench
from workbench.errors import ClusterError, ConfigError
from workbench.strategies import make_settings

from helpers import digits_job as good_job


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
