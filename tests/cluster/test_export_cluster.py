"""Live export to TensorBoard and MLflow (issue 20, item 1), read back with the libraries' own readers.

The folding of step records into per-second points is pure and checked against hand-made records
(tests/unit/test_export.py); the exports themselves come from real runs on the session's cluster: through
`train()` with a live switch, a stop and a resume that goes on in the same MLflow run, and through the CLI's flags.
"""
from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest

import workbench
from workbench.cli import main as cli
from workbench.plane import kinds
from workbench.plane.rundir import read_metrics

from helpers import wait_until

tensorboard_reader = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
mlflow_tracking = pytest.importorskip("mlflow.tracking")


def _scalars(logdir: Path) -> dict[str, list]:
    accumulator = tensorboard_reader.EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return {tag: accumulator.Scalars(tag) for tag in accumulator.Tags()["scalars"]}


def _texts(logdir: Path) -> list[str]:
    accumulator = tensorboard_reader.EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    accumulator.Reload()
    return [event.tensor_proto.string_val[0].decode() for tag in accumulator.Tags()["tensors"]
            if tag.startswith("events") for event in accumulator.Tensors(tag)]


def _job(epochs: int) -> workbench.Job:
    return workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=16, epochs=epochs, lr=0.1,
                         momentum=0.9)


@pytest.mark.cluster
@pytest.mark.timeout(240)
def test_a_run_exports_live_to_tensorboard_and_mlflow_and_a_resume_goes_on_in_the_same_mlflow_run(client, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = workbench.train(_job(epochs=30), "allreduce", client=client, run_dir=tmp_path / "runs",
                          tensorboard=True, mlflow=uri, checkpoint_every_steps=20)
    reader = mlflow_tracking.MlflowClient(tracking_uri=uri)
    mlflow_id = run.config["export"]["mlflow"]["run_id"]
    logdir = Path(run.config["export"]["tensorboard"])
    assert logdir == run.directory.path.resolve()
    run.wait_for_step(5)
    run.pause()  # held while the live export is checked: nothing depends on how fast it trains
    # Live: points reach both while the run trains, not only at its end.
    wait_until(lambda: reader.get_metric_history(mlflow_id, "samples_per_s"), timeout_s=30, interval_s=0.2)
    wait_until(lambda: (logdir / "worker_1").is_dir(), timeout_s=30, interval_s=0.2)
    assert reader.get_run(mlflow_id).info.status == "RUNNING" and not run.done
    run.resume()
    since = time.time()
    run.switch("average", period=4)
    run.wait_for_event(kinds.SWITCHED, since, timeout=60)
    run.stop()
    assert run.wait(120) == "stopped"
    assert reader.get_run(mlflow_id).info.status == "KILLED"

    resumed = workbench.resume(run.directory.path, client=client)
    assert resumed.config["export"]["mlflow"]["run_id"] == mlflow_id  # the same MLflow run goes on
    assert resumed.wait(180) == "finished"
    records = read_metrics(run.directory.path)
    steps = [r for r in records if r["kind"] == kinds.STEP]
    evaluations = [r for r in records if r["kind"] == kinds.EVAL]

    # TensorBoard: every step's loss per worker, the same values as the run directory's.
    for worker in (0, 1):
        mine = [r for r in steps if r["worker"] == worker]
        logged = _scalars(logdir / f"worker_{worker}")["loss/step"]
        assert [(e.step, e.value) for e in logged] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in mine]
    main = _scalars(logdir)
    # Per-second totals: every sample counted once, over both parts of the run.
    assert sum(e.value for e in main["samples_per_s"]) == sum(r["samples"] for r in steps)
    assert [e.value for e in main["eval/accuracy"]] == pytest.approx([r["accuracy"] for r in evaluations])
    assert evaluations[-1]["accuracy"] >= 0.8
    texts = _texts(logdir)
    assert any(t.startswith("switched:") and '"average"' in t for t in texts), texts
    assert any(t.startswith("run-resumed:") for t in texts)

    # MLflow: the run, its parameters, the same numbers, and its final status.
    finished = reader.get_run(mlflow_id)
    assert finished.info.status == "FINISHED" and finished.info.run_name == run.run_id
    assert finished.data.params["strategy"] == "allreduce" and finished.data.params["world_size"] == "2"
    assert finished.data.tags["workbench.run_id"] == run.run_id
    assert any("switched" in value for key, value in finished.data.tags.items() if key.startswith("event."))
    history = reader.get_metric_history(mlflow_id, "samples_per_s")
    assert sum(m.value for m in history) == sum(r["samples"] for r in steps)
    accuracy = reader.get_metric_history(mlflow_id, "eval/accuracy")
    assert [m.value for m in accuracy] == pytest.approx([r["accuracy"] for r in evaluations])
    losses = reader.get_metric_history(mlflow_id, "worker_1/loss")
    assert losses and all(math.isfinite(m.value) for m in losses)
    artifacts = {a.path for a in reader.list_artifacts(mlflow_id)}
    assert {"config.json", "summary.json"} <= artifacts
    # Beside the SQLite store, not in ./mlruns of whatever directory the test runs in.
    assert (tmp_path / "mlruns").is_dir() and reader.get_run(mlflow_id).info.artifact_uri.startswith((tmp_path / "mlruns").as_uri())
    assert "export_error" not in resumed.summary()


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_the_command_line_exports_with_its_flags(client, tmp_path, capsys):
    uri = f"sqlite:///{tmp_path / 'cli.db'}"
    code = cli.main(["train", "--dataset", "digits", "--workers", "2", "--scheduler", client.scheduler.address,
                     "--no-progress", "--run-dir", str(tmp_path / "runs"), "--epochs", "2",
                     "--tensorboard", str(tmp_path / "tb"), "--mlflow", uri])
    out, err = capsys.readouterr()
    assert code == 0, err
    (run_directory,) = (tmp_path / "runs").iterdir()
    steps = [r for r in read_metrics(run_directory) if r["kind"] == kinds.STEP]
    logged = _scalars(tmp_path / "tb" / run_directory.name)  # a subdirectory per run under the one given
    assert sum(e.value for e in logged["samples_per_s"]) == sum(r["samples"] for r in steps)
    (found,) = mlflow_tracking.MlflowClient(tracking_uri=uri).search_runs(
        [mlflow_tracking.MlflowClient(tracking_uri=uri).get_experiment_by_name("workbench").experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == run_directory.name
    evaluations = [r for r in read_metrics(run_directory) if r["kind"] == kinds.EVAL]
    assert found.data.metrics["eval/accuracy"] == pytest.approx(evaluations[-1]["accuracy"])
    assert re.search(r"held-out accuracy: ([0-9.]+)", out)
