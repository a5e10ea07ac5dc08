"""Live export (issue 20, item 1), the pure part: step records fold into per-second points, checked
against hand-made records, and bad export options are refused by name (the exports of real runs, read back
with TensorBoard's and MLflow's own readers: tests/cluster/test_export_cluster.py)."""
from __future__ import annotations

import pytest

import workbench
from workbench.run.export import SecondTotals, check_export_options, evaluation_values


def test_step_records_fold_into_one_point_per_second():
    totals = SecondTotals()
    records = [  # two workers in second 100, one in 101; worker 1 pushes with staleness
        {"worker": 0, "step": 4, "time": 100.2, "loss": 1.0, "samples": 32, "compute_s": 0.01, "comm_s": 0.0, "wait_s": 0},
        {"worker": 1, "step": 4, "time": 100.3, "loss": 3.0, "samples": 32, "compute_s": 0.03, "comm_s": 0.02,
         "wait_s": 0, "staleness": 2},
        {"worker": 0, "step": 5, "time": 100.9, "loss": 2.0, "samples": 32, "compute_s": 0.02, "comm_s": 0.0, "wait_s": 0},
        {"worker": 0, "step": 6, "time": 101.5, "loss": 0.5, "samples": 16, "compute_s": 0.02, "comm_s": 0.0, "wait_s": 0},
    ]
    for record in records:
        totals.add(record)
    assert totals.complete(102.9) == []  # second 100 may still get records sent before 101.5 + settling
    ((second, step, values),) = totals.complete(103.0)
    assert (second, step) == (100, 5)
    assert values["loss"] == pytest.approx(2.0) and values["samples_per_s"] == 96
    assert values["staleness"] == 2 and values["comm_s"] == pytest.approx(0.02 / 3)
    assert values["worker_0/loss"] == pytest.approx(1.5) and values["worker_0/samples_per_s"] == 64
    assert values["worker_1/loss"] == 3.0 and values["worker_1/samples_per_s"] == 32
    ((second, step, values),) = totals.complete(None)  # the run ended: the rest at once
    assert (second, step, values["samples_per_s"]) == (101, 6, 16) and "staleness" not in values
    assert totals.complete(None) == []
    assert evaluation_values({"kind": "eval", "step": 9, "epoch": 1, "final": True, "loss": 0.3,
                              "samples": 360, "accuracy": 0.9}) == {"eval/loss": 0.3, "eval/accuracy": 0.9}


@pytest.mark.parametrize("tensorboard,mlflow", [(1, False), (False, 3), (False, "  ")])
def test_bad_export_options_are_refused_naming_them(tensorboard, mlflow):
    name = "tensorboard" if tensorboard else "mlflow"
    with pytest.raises(workbench.ConfigError, match=f"^{name}="):
        check_export_options(tensorboard, mlflow)
