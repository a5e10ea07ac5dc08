"""The GPU suite of `python -m benchmarks` (benchmarks/gpt_gpu.py, throughput_cuda.py, catalog.py) checked on
the CPU before it takes the GPU machine's time: what the suite runs, and its headline keys from raw cells
(tests/cluster/test_gpu_suite_on_cpu.py runs the GPT script itself small)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import catalog  # noqa: E402
import resultfile  # noqa: E402


def test_the_gpu_suite_runs_the_gpt_parts_and_the_throughput_and_only_with_a_gpu():
    suite = {b.name: b for b in catalog.in_suite("gpu")}
    assert set(suite) == {"gpu-gpt-compiled", "gpu-gpt-strategies", "gpu-throughput"}
    assert {b.needs for b in suite.values()} == {"gpu"}
    assert "--device" in suite["gpu-throughput"].args and "cuda" in suite["gpu-throughput"].args


def test_the_strategy_headline_counts_finished_runs_and_takes_the_worst_loss_against_allreduce():
    import gpt_gpu

    cells = {"allreduce": {"status": "finished", "held_out_loss": 2.0},
             "average p16": {"status": "finished", "held_out_loss": 2.2},
             "async p4": {"status": "finished", "held_out_loss": 1.9},
             "ssp p4": {"status": "stopped", "held_out_loss": 3.0},
             "easgd p16": {"strategy": "easgd", "error": "TimeoutError: ..."}}
    headline = gpt_gpu.strategy_headline(cells)
    assert headline["strategies_run"] == 5 and headline["strategies_finished"] == 3
    assert headline["held_out_loss_vs_allreduce"] == pytest.approx(
        {"allreduce": 1.0, "average p16": 1.1, "async p4": 0.95, "ssp p4": 1.5})
    assert headline["worst_loss_vs_allreduce"] == pytest.approx(1.5)
    # Without a finished allreduce there is no reference: said, not guessed.
    without = gpt_gpu.strategy_headline({k: v for k, v in cells.items() if k != "allreduce"})
    assert without["worst_loss_vs_allreduce"] is None and without["held_out_loss_vs_allreduce"] == {}


def test_the_gpu_throughput_report_has_a_row_per_configuration_and_ratios_of_medians():
    import throughput_cuda

    samples = {"plain": [1000.0, 1200.0, 1100.0], "workbench 1 worker": [1050.0],
               "ddp x1 nccl": [1080.0], "plain x2 side by side": [1600.0], "allreduce x2": [1200.0],
               "ddp x2 gloo": [1000.0]}
    extras = {"workbench 1 worker": {"compute_ms": 110.0, "comm_ms": 0.0, "gpu_utilization": 97.0}}
    report = throughput_cuda.report(samples, extras, repeats=3, steps=100)
    assert report["one_worker_vs_plain"] == pytest.approx(1050 / 1100)  # the median of plain
    assert report["one_worker_vs_ddp_x1"] == pytest.approx(1050 / 1080)
    assert report["allreduce_x2_vs_limit"] == pytest.approx(1200 / 1600)
    assert report["ddp_x2_gloo_vs_limit"] == pytest.approx(1000 / 1600)
    batch = throughput_cuda.BATCH
    assert report["workbench_overhead_ms_per_step"] == pytest.approx(1e3 * batch / 1050 - 1e3 * batch / 1100)
    assert "average_p16_x2_vs_limit" not in report  # not measured: no ratio
    rows = report["cells"]
    assert set(rows) == set(samples)
    assert rows["plain"]["each"] == [1000.0, 1200.0, 1100.0] and rows["plain"]["vs_limit"] is None
    assert rows["allreduce x2"]["vs_limit"] == pytest.approx(0.75)
    assert rows["workbench 1 worker"]["gpu_utilization"] == 97.0
    benchmark = catalog.BY_NAME["gpu-throughput"]
    assert [key for key in benchmark.headline if key not in report] == []


def test_the_gpu_throughput_table_prints_each_row_from_the_result(capsys):
    import throughput_cuda

    samples = {"plain": [1000.0], "plain x2 side by side": [1600.0], "allreduce x2": [1200.0]}
    extras = {"allreduce x2": {"compute_ms": 80.0, "comm_ms": 25.5, "gpu_utilization": 91.0}}
    result = {"machine": {"gpu": "NVIDIA H200", "torch": "2.13.0"}, **throughput_cuda.report(samples, extras, 1, 100)}
    throughput_cuda.print_table(result)
    lines = {line.split()[0] + (" " + line.split()[1] if "x2" in line else ""): line
             for line in capsys.readouterr().out.splitlines()[2:] if line}
    assert lines["allreduce x2"].split()[2:] == ["1,200", "213.3", "1.200", "0.750", "80.0", "25.5", "91"]
    assert lines["plain"].split()[1:] == ["1,000", "128.0", "1.000"]  # no limit, no extras: left blank
