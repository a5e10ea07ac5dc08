"""The CUDA path for real, on a GPU machine: dask-cuda's cluster, NCCL and gloo on CUDA tensors, every
strategy, a live switch, checkpoint and resume with the CUDA generator, bf16 autocast, GPU metrics.

Skipped where no CUDA device or no dask-cuda is visible (CI, the 2-core VM); run there with
`python -m pytest -m gpu`. Two clusters: `dask_cuda.LocalCUDACluster` as `connect()` starts it (one
worker per GPU, NCCL), and one worker more than the GPUs (`SharedGpuCluster`: two ranks share a GPU, gloo).
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

import workbench
from workbench.cluster import connection as cluster_module
from workbench.strategies import STRATEGIES

import helpers
from helpers import wait_until
from test_training import reference_sgd

# The model factories and worker probes below travel by value: the workers cannot import this module.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CUDA = torch.cuda.is_available() and cluster_module.dask_cuda_available()
pytestmark = [pytest.mark.gpu, pytest.mark.cluster, pytest.mark.timeout(300),
              pytest.mark.skipif(not CUDA, reason="needs a CUDA device and dask-cuda")]


@pytest.fixture(scope="module")
def gpu_client():
    client = workbench.connect(dashboard_address=":0")
    try:
        yield client
    finally:
        workbench.shutdown(client)


@pytest.fixture(scope="module")
def shared_client():
    gpus = torch.cuda.device_count()
    with pytest.warns(UserWarning, match=f"^{gpus + 1} workers on {gpus} GPU"):
        client = workbench.connect(workers=gpus + 1, dashboard_address=":0")
    try:
        yield client
    finally:
        workbench.shutdown(client)


def _worker_gpu():
    return torch.cuda.current_device(), torch.cuda.get_device_name(0), os.environ.get("CUDA_VISIBLE_DEVICES")


# digits_job(strategy, **changes): the strategy's suggested SGD, on CUDA.
digits_job = functools.partial(helpers.digits_job, batch_size=32, epochs=5, device="cuda")


def assert_gpu_metrics(run):
    steps = run.metrics
    assert len(steps) > 0
    # Every step record carries the gauges (sampled once a second, repeated between samples).
    assert steps["gpu_memory_mb"].gt(0).all(), steps["gpu_memory_mb"].describe()
    assert steps["gpu_memory_mb"].lt(torch.cuda.get_device_properties(0).total_memory / 2**20).all()
    assert steps["gpu_utilization"].between(0, 100).all()
    # What the notebook panel's and the dashboard's worker tables show: each worker's latest gauges.
    rows = run.table.live_view()["workers"]
    assert rows and all(row["gpu_memory_mb"] > 0 and 0 <= row["gpu_utilization"] <= 100 for row in rows), rows


def test_connect_starts_one_cuda_worker_per_gpu_each_seeing_its_own_as_cuda0(gpu_client):
    from dask_cuda import LocalCUDACluster

    assert isinstance(gpu_client.cluster, LocalCUDACluster)
    seen = list(gpu_client.run(_worker_gpu).values())
    assert len(seen) == torch.cuda.device_count()
    assert all(device == 0 and name == torch.cuda.get_device_name(0) for device, name, _ in seen)
    assert sorted(visible.split(",")[0] for *_, visible in seen) == [str(i) for i in range(len(seen))]


def test_allreduce_on_cuda_fp32_matches_single_process_sgd_and_records_the_device(gpu_client, tmp_path):
    job = workbench.Job(model=workbench.mlp(64, 10, (32,)), data="digits", lr=0.2, batch_size=16, steps=60, seed=5,
                        device="cuda")
    run = workbench.train(job, "allreduce", client=gpu_client, run_dir=tmp_path)
    assert run.wait(timeout=120) == "finished"
    world = torch.cuda.device_count()
    expected = reference_sgd(job, world, 60).state_dict()
    trained = run.model().state_dict()
    initial = (torch.manual_seed(5), job.model())[1].state_dict()
    for name, value in expected.items():
        assert not torch.allclose(value, initial[name])
        # float32 on both (TF32 is off by default for matmuls); summation order differs by a few ulps.
        torch.testing.assert_close(trained[name], value, rtol=1e-3, atol=1e-4)
    assert [d["name"] for d in run.config["devices"]] == [torch.cuda.get_device_name(0)] * world
    assert_gpu_metrics(run)


@pytest.mark.parametrize("strategy,settings", [("allreduce", {}), ("average", {"period": 4})])
def test_nccl_strategies_train_digits_on_one_worker_per_gpu(gpu_client, tmp_path, strategy, settings):
    run = workbench.train(digits_job(strategy), strategy, client=gpu_client, run_dir=tmp_path, **settings)
    assert run.wait(timeout=180) == "finished"
    assert run.evaluate()["accuracy"] >= 0.9
    assert_gpu_metrics(run)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_trains_digits_on_workers_sharing_a_gpu(shared_client, tmp_path, strategy):
    run = workbench.train(digits_job(strategy), strategy, client=shared_client, run_dir=tmp_path)
    assert run.wait(timeout=180) == "finished"
    assert run.evaluate()["accuracy"] >= 0.9
    assert run.metrics["worker"].nunique() == len(shared_client.scheduler_info(n_workers=-1)["workers"])
    assert_gpu_metrics(run)
    if strategy in ("async", "ssp", "easgd"):
        assert run.metrics["staleness"].notna().any() or strategy == "easgd"


def test_a_live_switch_from_cuda_allreduce_to_async_and_back(shared_client, tmp_path):
    # Its run directory is kept under test-artifacts/ (git-ignored): docs/dashboard-gpu.png shows it.
    kept = ARTIFACTS / "gpu-runs"
    run = workbench.train(digits_job("allreduce", epochs=200), "allreduce", client=shared_client, run_dir=kept)
    workers = len(shared_client.scheduler_info(n_workers=-1)["workers"])

    def steps_done():
        latest = run.table.last_steps()
        return min((r["step"] for r in latest.values()), default=-1) if len(latest) == workers else -1

    try:
        wait_until(lambda: steps_done() >= 30, timeout_s=90)
        run.switch("async")
        wait_until(lambda: len([e for e in run.events("switched") if e["switch_id"] == 1]) == workers, timeout_s=90)
        at = run.events("switched")[0]["step"]
        wait_until(lambda: steps_done() >= at + 30, timeout_s=90)
        run.switch("allreduce")
        wait_until(lambda: len([e for e in run.events("switched") if e["switch_id"] == 2]) == workers, timeout_s=90)
        back = [e for e in run.events("switched") if e["switch_id"] == 2][0]["step"]
        # Back on all-reduce the run learns again: a held-out evaluation (every epoch, of the synchronised
        # weights) reaches 0.9. How many steps that takes depends on how far the async phase, with the
        # job's momentum 0.9 on stale pushes, threw the weights: 150 steps were not always enough (0.79).
        wait_until(lambda: any(e["step"] > back and e["accuracy"] >= 0.9 for e in run.events("eval")), timeout_s=90)
    finally:
        run.stop()
    assert run.wait(120) == "stopped"
    frame = run.metrics
    assert set(frame[(frame["step"] > at) & (frame["step"] < back)]["strategy"]) == {"async"}
    assert frame[(frame["step"] > at) & (frame["step"] < back)]["staleness"].notna().any()
    assert set(frame[frame["step"] > back]["strategy"]) == {"allreduce"}
    # Back on all-reduce every worker starts from the server's weights: equal fingerprints.
    after = [e for e in run.events("switched") if e["switch_id"] == 2]
    assert len({e["weights_after"] for e in after}) == 1


def dropout_model():
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                               torch.nn.Linear(128, 10))


def test_checkpoint_and_resume_on_cuda_restores_the_cuda_generator(gpu_client, tmp_path):
    # Dropout on the GPU draws from the CUDA generator: a resume that did not restore it would draw
    # other masks, and the weights would differ from the uninterrupted run's by far more than rounding.
    # Long enough (a few ms a step) that the stop lands well before the end.
    job = workbench.Job(model=dropout_model, data="digits", lr=0.05, batch_size=16, steps=3000, seed=3, device="cuda")
    interrupted = workbench.train(job, "allreduce", client=gpu_client, run_dir=tmp_path / "interrupted",
                                  checkpoint_every_steps=100)
    wait_until(lambda: len(interrupted.metrics) >= 200 * torch.cuda.device_count(), timeout_s=90)
    interrupted.stop()
    assert interrupted.wait(120) == "stopped"
    resumed = workbench.resume(next((tmp_path / "interrupted").iterdir()), client=gpu_client)
    assert resumed.wait(timeout=120) == "finished"
    from_step = resumed.events("run-resumed")[0]["from_step"]
    assert 200 <= from_step < 3000
    reference = workbench.train(job, "allreduce", client=gpu_client, run_dir=tmp_path / "reference")
    assert reference.wait(timeout=120) == "finished"
    expected, found = reference.model().state_dict(), resumed.model().state_dict()
    for name in expected:
        torch.testing.assert_close(found[name], expected[name], rtol=1e-4, atol=1e-5)


def _bf16_in_autocast():
    from workbench.job import autocast

    job = workbench.Job(model=workbench.mlp(8, 2), data="digits", precision="bf16")
    layer = torch.nn.Linear(8, 8).cuda()
    with autocast(job, torch.device("cuda", 0)):
        return str(layer(torch.randn(4, 8, device="cuda")).dtype)


def test_bf16_autocast_is_a_job_setting_that_trains(gpu_client, tmp_path):
    assert set(gpu_client.run(_bf16_in_autocast).values()) == {"torch.bfloat16"}
    run = workbench.train(digits_job("allreduce", precision="bf16"), "allreduce", client=gpu_client, run_dir=tmp_path)
    assert run.wait(timeout=180) == "finished"
    assert run.evaluate()["accuracy"] >= 0.9
    assert run.config["job"]["precision"] == "bf16"
    # The weights stay float32: bf16 is the forward pass's, not the model's.
    assert all(value.dtype == torch.float32 for value in run.model().state_dict().values())


# The real workload at test size (gpt-test on a 2 MB slice of the standard library's source), on CUDA in bf16.
text_job = functools.partial(helpers.text_job, steps=240, device="cuda", precision="bf16", eval_every=120)


def test_a_compiled_bf16_gpt_learns_the_text_on_cuda(gpu_client, tmp_path):
    run = workbench.train(text_job(compile=True), "allreduce", client=gpu_client, run_dir=tmp_path)
    assert run.wait(timeout=240) == "finished"
    evaluations = run.events("eval")
    final = [e for e in evaluations if e["final"]][-1]
    # Bytes at random are 8 bits each; after 240 steps the model has learned the text's structure.
    assert final["bits_per_char"] < 4.0, evaluations
    assert 0.3 < final["token_accuracy"] <= 1.0
    assert run.config["job"]["compile"] is True and run.config["data"]["corpus"] == "stdlib-text"
    # The schedule ran on the GPU worker: warm-up, then cosine down to a tenth at the last step.
    lrs = run.metrics.sort_values("step")["lr"].tolist()
    assert lrs[0] == pytest.approx(3e-3 / 12) and max(lrs) == pytest.approx(3e-3)
    assert lrs[-1] == pytest.approx(3e-4, rel=1e-3)
    assert_gpu_metrics(run)


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_every_strategy_trains_the_gpt_on_workers_sharing_a_gpu(shared_client, tmp_path, strategy):
    run = workbench.train(text_job(steps=160, eval_every=None), strategy, client=shared_client, run_dir=tmp_path)
    assert run.wait(timeout=240) == "finished"
    final = [e for e in run.events("eval") if e["final"]][-1]
    assert final["bits_per_char"] < 5.0, (strategy, final)
    if strategy in ("async", "ssp"):
        assert run.summary()["staleness"]["max"] >= 1
