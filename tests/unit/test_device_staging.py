"""The CPU side of the GPU path: what crosses Dask is brought to the host, the backend follows whether
ranks share a GPU, and bf16 autocast is a job setting checked at once (a bf16 run on the session cluster:
tests/cluster/test_device_staging_cluster.py; the CUDA side: tests/cluster/test_gpu.py)."""
from __future__ import annotations

import collections

import pytest
import torch

import workbench
from workbench.comm import collectives
from workbench.comm.device_staging import HostStaging, to_host
from workbench.errors import ConfigError
from workbench.job import autocast


def test_staging_on_a_cpu_worker_is_the_identity():
    staging = HostStaging(6, torch.device("cpu"))
    vector = torch.arange(6.0)
    assert staging.to_host(vector) is vector and staging.to_device(vector) is vector


def test_to_host_reaches_every_tensor_in_nested_values_and_keeps_their_shape():
    Pair = collections.namedtuple("Pair", "a b")
    value = {"x": [torch.ones(2), (torch.zeros(1), 3)], "p": Pair(torch.ones(1), "s"), "n": None}
    moved = to_host(value)
    assert isinstance(moved["p"], Pair) and moved["p"].b == "s" and moved["n"] is None
    assert isinstance(moved["x"][1], tuple) and moved["x"][1][1] == 3
    torch.testing.assert_close(moved["x"][0], torch.ones(2))


def test_ranks_sharing_a_gpu_use_gloo_for_cuda_tensors():
    assert not collectives.shares_a_gpu(["host/a", "host/b"])
    assert collectives.shares_a_gpu(["host/a", "host/b", "host/a"])
    cuda = torch.device("cuda", 0)
    assert collectives.backend_for(cuda) == "cpu:gloo,cuda:nccl"
    assert collectives.backend_for(cuda, shares_a_gpu=True) == "cpu:gloo,cuda:gloo"
    assert collectives.backend_for(torch.device("cpu"), shares_a_gpu=True) == "gloo"


def test_precision_is_checked_at_once_and_bf16_autocasts_the_forward_pass():
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", precision="fp8")
    with pytest.raises(ConfigError, match="^precision='fp8'.*'float32', 'bf16'"):
        job.prepare()
    layer = torch.nn.Linear(4, 4)
    for precision, dtype in (("bf16", torch.bfloat16), ("float32", torch.float32)):
        with autocast(workbench.Job(model=workbench.mlp(4, 2), data="digits", precision=precision), torch.device("cpu")):
            assert layer(torch.randn(2, 4)).dtype == dtype
