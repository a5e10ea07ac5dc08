"""Which cluster `connect()` starts, for real: the embedded CPU default, one worker more than the GPUs
(CPU processes here, each with its own CUDA_VISIBLE_DEVICES), and the workers a client sees present. The
choice itself, without a cluster: tests/unit/test_cluster_choice.py."""
import os

import dask

import pytest

import workbench
from workbench.cluster import connection as cluster_module


def _training_settings():
    """Runs on each worker: the settings `connect()` gives training workers."""
    return (dask.config.get("distributed.worker.profile.enabled"), dask.config.get("distributed.worker.daemon"),
            os.environ.get("MALLOC_TRIM_THRESHOLD_"))


@pytest.mark.timeout(120)
def test_embedded_default_is_a_local_cluster_of_single_threaded_processes_configured_for_training():
    with workbench.client_session(workers=2, dashboard_address=":0") as client:
        info = client.scheduler_info(n_workers=-1)["workers"]
        assert len(info) == 2 and all(w["nthreads"] == 1 for w in info.values())
        settings = client.run(_training_settings)
        assert set(settings.values()) == {(False, False, None)}
        pids = client.run(os.getpid)
        assert len(set(pids.values())) == 2 and os.getpid() not in pids.values()

def _visible_devices():
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.mark.timeout(120)
def test_more_workers_than_gpus_start_a_shared_cluster_that_says_how_it_places_them(monkeypatch):
    # A real local cluster (CPU processes here): what matters is each worker's CUDA_VISIBLE_DEVICES.
    monkeypatch.setattr(cluster_module, "count_gpus", lambda: 2)
    monkeypatch.setattr(cluster_module, "dask_cuda_available", lambda: True)
    with pytest.warns(UserWarning, match="^3 workers on 2 GPUs: up to 2 workers share a GPU"):
        client = workbench.connect(workers=3, dashboard_address=":0")
    try:
        assert isinstance(client.cluster, cluster_module.SharedGpuCluster)
        seen = sorted(client.run(_visible_devices).values())
        assert seen == ["0,1", "0,1", "1,0"]
    finally:
        workbench.shutdown(client)


@pytest.mark.timeout(120)
def test_the_workers_present_are_never_the_clients_cached_empty_list():
    # The client refreshes its cached scheduler identity (with 0 workers) on a timer; at 1 ms the old way
    # (scheduler_info(n_workers=-1), then the cache) said "no workers" in 33 of 500 calls here.
    from distributed import Client, LocalCluster

    from workbench.run.launcher import present_workers

    with dask.config.set({"distributed.client.scheduler-info-interval": "1ms"}), \
            LocalCluster(n_workers=2, processes=False, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(2, timeout=30)
        expected = sorted(cluster.scheduler.workers)
        assert [present_workers(client) for _ in range(300)] == [expected] * 300
