"""bf16 autocast on the session cluster: a run trains `digits` and keeps float32 weights (the CPU side of
the GPU path, without a cluster: tests/unit/test_device_staging.py; the CUDA side: tests/cluster/test_gpu.py)."""
from __future__ import annotations

import pytest
import torch

import workbench


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_bf16_run_trains_digits_and_keeps_float32_weights(client, tmp_path):
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", lr=0.1, momentum=0.9, batch_size=32, epochs=5,
                        precision="bf16")
    run = workbench.train(job, "allreduce", client=client, run_dir=tmp_path)
    assert run.wait(timeout=150) == "finished"
    assert run.evaluate()["accuracy"] >= 0.9
    assert run.config["job"]["precision"] == "bf16"
    assert run.config["devices"] == [{"device": "cpu", "name": run.config["devices"][0]["name"]}] * 2
    assert all(value.dtype == torch.float32 for value in run.model().state_dict().values())
