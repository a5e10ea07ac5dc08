"""The simulator benchmark's calibration (`benchmarks/simulator.py`): each lab's points are predicted from
the calibration run measured in that lab (the machine's speed drifts over a grid), the one of median
throughput; documents from before hold runs of the 2-host lab only, or one run. The crowding probe's loss
and its side-by-side loops. Synthetic records, but for the loops (one real process, about 3 s)."""
from __future__ import annotations

import time

import pytest
from helpers import load_benchmark
from test_simulate import MODEL_BYTES, _average_p4_records

from planner import simulate


def _run(lab_workers: int, samples_per_s: float, compute_s: float = 0.02) -> dict:
    records = [{**r, "compute_s": compute_s} for r in _average_p4_records()]
    return {"strategy": "average", "settings": {"period": 4}, "repeat": 0, "lab_workers": lab_workers,
            "records": records, "samples_per_s": samples_per_s, "loadavg_before": [1.0]}


def _cell(workers: int, samples_per_s: float) -> dict:
    return {"config": "average p16", "strategy": "average", "settings": {"period": 16}, "condition": "unlimited",
            "workers": workers, "repeat": 0, "samples_per_s": samples_per_s, "loadavg_before": [1.0]}


def test_the_calibration_run_is_the_median_of_its_lab_else_of_the_smallest_lab():
    simulator = load_benchmark("simulator")
    runs = [_run(2, 100.0), _run(2, 300.0), _run(2, 200.0), _run(4, 50.0), _run(4, 70.0), _run(3, 10.0)]
    document = {"calibration_runs": {"average p4": runs}}
    assert simulator.calibration_run(document, "average p4", 2)["samples_per_s"] == 200.0
    assert simulator.calibration_run(document, "average p4", 4)["samples_per_s"] == 50.0  # the lower middle
    assert simulator.calibration_run(document, "average p4", 3)["samples_per_s"] == 10.0
    assert simulator.calibration_run(document, "average p4", 5)["samples_per_s"] == 200.0  # none there: 2's
    assert simulator.calibration_run(document, "average p4")["samples_per_s"] == 200.0
    # Runs from before 2026-11-26 carry no lab: the 2-host lab's. Before 2026-11-25: one run, not a list.
    legacy = [{k: v for k, v in run.items() if k != "lab_workers"} for run in runs[:3]]
    assert simulator.calibration_run({"calibration_runs": {"average p4": legacy}}, "average p4", 4)["samples_per_s"] == 200.0
    single = _run(2, 123.0)
    assert simulator.calibration_run({"calibration_runs": {"average p4": single}}, "average p4", 3) is single


def test_each_labs_points_are_predicted_from_its_own_calibration_run():
    simulator = load_benchmark("simulator")
    fast, slow = _run(2, 9000.0, compute_s=0.02), _run(3, 6000.0, compute_s=0.03)
    document = {"machine": {"cores": 2}, "calibration_runs": {"average p4": [fast, slow]},
                "cells": [_cell(2, 12000.0), _cell(3, 9000.0)]}

    def expected(run: dict, workers: int) -> float:
        calibration = simulate.calibrate(run["records"], model_bytes=simulator.MODEL_BYTES, workers=2, cores=2)
        return simulate.predict(calibration, "average", {"period": 16}, workers, None, cores=2).samples_per_s

    own = {row["workers"]: row["predicted_samples_per_s"] for row in simulator.predict_points(document, "average p4")["table"]}
    assert own[2] == pytest.approx(expected(fast, 2)) and own[3] == pytest.approx(expected(slow, 3))
    assert own[3] < expected(fast, 3) * 0.9  # the slower lab's compute, not the first lab's
    result = simulator.predict_points(document, "average p4")
    assert set(result["calibration_by_lab"]) == {"2", "3"} and "measured in each lab" in result["calibrated_with"]
    # Without: every point from the smallest lab's run.
    single = simulator.predict_points(document, "average p4", per_lab=False)
    assert {row["workers"]: row["predicted_samples_per_s"] for row in single["table"]}[3] == pytest.approx(expected(fast, 3))
    assert single["calibration_by_lab"] is None
    assert MODEL_BYTES == simulator.MODEL_BYTES


def test_the_grid_predicts_with_the_default_crowding_and_reads_its_probes_beside_it():
    simulator = load_benchmark("simulator")
    run = _run(2, 9000.0)
    # Probes as the JSON file holds them (string keys), each at its own machine speed: losses 0.2 and 0.3
    # and one window whose machine sped up (no loss): the median is 0.2.
    probes = [{"lab_workers": 2, "repeat": r, "totals": {"2": 2 * s, "3": 2 * s * (1 - loss / 3), "4": 2 * s * (1 - loss / 2)}}
              for r, (s, loss) in enumerate([(8000, 0.2), (7000, 0.3), (7500, -0.1)])]
    document = {"machine": {"cores": 2}, "calibration_runs": {"average p4": [run]}, "crowding_probes": probes,
                "cells": [_cell(2, 12000.0), _cell(4, 12000.0)]}
    assert simulator.crowding_loss(document) == pytest.approx(0.2)
    assert simulator.crowding_loss({**document, "crowding_probes": []}) is None

    def predicted(crowding):
        result = simulator.predict_points(document, "average p4", crowding=crowding)
        return result, {row["workers"]: row["predicted_samples_per_s"] for row in result["table"]}

    default, by_default = predicted(None)
    assert default["crowding_loss"] == {"value": simulate.Calibration.crowding_loss, "from": "the default (measured before)"}
    probed, by_probes = predicted(0.2)
    assert probed["crowding_loss"]["value"] == 0.2
    # Two workers on two cores take no turns: the same prediction. Four lose more with the larger loss.
    assert by_probes[2] == pytest.approx(by_default[2])
    assert by_probes[4] < by_default[4] * 0.99
    calibration = simulate.calibrate(run["records"], model_bytes=simulator.MODEL_BYTES, workers=2, cores=2,
                                     crowding_loss=0.2)
    assert by_probes[4] == pytest.approx(simulate.predict(calibration, "average", {"period": 16}, 4, None,
                                                          cores=2).samples_per_s)


def test_side_by_side_loops_count_the_steps_inside_one_window_opened_once_all_are_ready(tmp_path):
    network = load_benchmark("network")
    spec = {"rank": 0, "processes": 1, "barrier": str(tmp_path / "probe"), "window_s": 1.0, "ready_timeout_s": 30.0}
    result = network._plain_loop(spec)
    ready = float((tmp_path / "probe-ready-0").read_text())
    # Steps of a few tens of ms: the window holds many, and their rate is about what they did in it.
    assert result["steps"] >= 5
    assert result["samples_per_s"] == pytest.approx(result["steps"] * network.BATCH / 1.0, rel=0.3)
    assert time.time() >= ready + 2.0  # the window opened 1 s after ready and lasted 1 s
    # A second process that never comes: the first says so once its time to wait is over.
    with pytest.raises(RuntimeError, match="1 of 2 processes were ready after 0.5 s"):
        network._plain_loop({**spec, "barrier": str(tmp_path / "lonely"), "processes": 2, "ready_timeout_s": 0.5})


def test_a_point_is_the_median_of_its_repetitions_less_the_failed_and_the_disturbed():
    simulator = load_benchmark("simulator")
    cells = [{**_cell(3, rate), "repeat": i} for i, rate in enumerate((6_000.0, 8_000.0, 7_000.0, 3_000.0))]
    cells[3]["disturbed"] = "three workers started beside it"
    cells.append({**_cell(3, 0.0), "repeat": 4, "error": "the run had 6 of 3 workers"})
    [point] = simulator.median_points(cells)
    assert point["runs"] == [6_000, 8_000, 7_000] and point["samples_per_s"] == 7_000.0
    [gone] = simulator.median_points([{**cells[3]}, cells[4]])
    assert gone["error"] == "every repetition failed" and "samples_per_s" not in gone
