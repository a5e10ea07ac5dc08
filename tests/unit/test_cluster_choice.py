"""Which cluster `connect()` starts: the CPU default here, LocalCUDACluster only with dask-cuda and a GPU.

The GPU branch cannot run on this machine, so its keyword arguments are checked against a stand-in of
LocalCUDACluster; the real one runs in the `gpu`-marked tests on a GPU machine. The clusters started for
real: tests/cluster/test_cluster_choice_cluster.py.
"""
import sys
import types

import pytest

import workbench
from workbench.cluster import connection as cluster_module
from workbench.errors import ConfigError


def test_without_gpus_the_choice_is_cpu_and_never_raises():
    # With dask-cuda installed but no NVML library, dask-cuda itself raises NVMLError; we must not.
    assert cluster_module.count_gpus() == 0
    assert cluster_module.choose_kind("auto", None) == "cpu"
    if cluster_module.dask_cuda_available():  # installed in CI: its own constructor fails here ...
        import dask_cuda

        with pytest.raises(Exception, match="NVML"):
            dask_cuda.LocalCUDACluster(n_workers=1)
    with pytest.raises(ConfigError, match="^kind='cuda'"):
        cluster_module.choose_kind("cuda", 1)


def test_gpu_branch_starts_local_cuda_cluster_with_one_worker_per_gpu(monkeypatch):
    calls = {}

    class FakeLocalCUDACluster:
        def __init__(self, **kwargs):
            calls.update(kwargs)
            raise RuntimeError("stand-in stops here")

    monkeypatch.setattr(cluster_module, "count_gpus", lambda: 2)
    monkeypatch.setattr(cluster_module, "dask_cuda_available", lambda: True)
    monkeypatch.setitem(sys.modules, "dask_cuda", types.SimpleNamespace(LocalCUDACluster=FakeLocalCUDACluster))
    assert cluster_module.choose_kind("auto", None) == "cuda"
    assert cluster_module.choose_kind("auto", 3) == cluster_module.choose_kind("cuda", 3) == "cuda"  # shared
    with pytest.raises(RuntimeError, match="stand-in"):
        workbench.connect(workers=2)
    assert calls["n_workers"] == 2 and calls["threads_per_worker"] == 1 and calls["device_memory_limit"] == 0


def test_gpu_placement_is_round_robin_with_each_workers_own_gpu_first():
    assert cluster_module.gpu_placement(2, 2) == ["0,1", "1,0"]
    assert cluster_module.gpu_placement(3, 1) == ["0", "0", "0"]
    assert cluster_module.gpu_placement(5, 2) == ["0,1", "1,0", "0,1", "1,0", "0,1"]
    assert cluster_module.placement_message(2, 2) is None
    message = cluster_module.placement_message(5, 2)
    assert message.startswith("5 workers on 2 GPUs: up to 3 workers share a GPU") and "gloo" in message
