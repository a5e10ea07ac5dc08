"""The GPT benchmark of the GPU suite (benchmarks/gpt_gpu.py) run small on the CPU, as a session checks it
before it takes the GPU machine's time: both parts, through the arguments the catalog gives them, write
result files that carry their provenance and every headline key the catalog asks of them."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import catalog  # noqa: E402
import resultfile  # noqa: E402


@pytest.mark.timeout(420)
def test_the_gpt_script_run_small_on_the_cpu_writes_each_parts_result_with_its_headline(tmp_path):
    """Both parts of gpt_gpu.py on the CPU with the test-sized GPT, through the same arguments the catalog
    gives the GPU suite plus the small settings: each writes a result file with its provenance, the headline
    keys the catalog names, and values that follow from its cells."""
    small = ["--device", "cpu", "--size", "gpt-test", "--strategy-size", "gpt-test", "--batch", "4", "--context", "32",
             "--warmup", "2", "--steps", "4", "--repeats", "1", "--strategy-steps", "8", "--strategy-batch", "4",
             "--eval-every", "4", "--eval-windows", "8", "--only", "allreduce,async", "--runs", str(tmp_path / "runs")]
    for name in ("gpu-gpt-compiled", "gpu-gpt-strategies"):
        benchmark = catalog.BY_NAME[name]
        out = tmp_path / f"{name}.json"
        # The catalog's own arguments first: a later flag of the same name (the small settings) wins.
        done = subprocess.run([sys.executable, str(BENCHMARKS / benchmark.script), *benchmark.args, *small,
                               "--out", str(out)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        result = resultfile.read(out)
        assert result["benchmark"] == name
        assert [k for k in resultfile.PROVENANCE + benchmark.headline if k not in result] == []
        if name == "gpu-gpt-compiled":
            (row,) = result["cells"]
            assert result["one_worker_vs_plain"] == pytest.approx(
                row["workbench_samples_per_s"] / row["plain_samples_per_s"])
            assert result["plain_mfu"] is None  # no bf16 peak for a CPU: said, not guessed
        else:
            assert set(result["strategies"]) == {"allreduce", "async p4"}
            assert result["strategies_run"] == 2 and result["strategies_finished"] == 2
            assert result["held_out_loss_vs_allreduce"]["allreduce"] == 1.0
            assert all(len(cell["curve"]) >= 2 for cell in result["strategies"].values())
