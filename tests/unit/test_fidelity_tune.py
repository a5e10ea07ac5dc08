"""The learning-rate sweep of the fidelity job (benchmarks/fidelity_tune.py): each configuration judged at
its own best rate, the seeds planned at that rate, and the rate reaching both kinds of run."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from workbench.schedule import lr_factor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import fidelity  # noqa: E402
import fidelity_tune  # noqa: E402

SPARSE = "average p4 sparse"


def cell(config, lr, loss, seed=0):
    curve = [{"step": 64, "seconds": 10.0, "loss": 3.5}, {"step": 256, "seconds": 40.0, "loss": loss}]
    return {"config": config, "lr": lr, "seed": seed, "condition": fidelity_tune.condition_of(lr), "curve": curve}


GRID = [cell("ddp", 0.003, 2.90), cell("ddp", 0.006, 2.70), cell("ddp", 0.012, 2.55), cell("ddp", 0.024, 2.95),
        cell(SPARSE, 0.003, 2.46), cell(SPARSE, 0.006, 2.50), cell(SPARSE, 0.012, 2.60), cell(SPARSE, 0.024, 3.10),
        {"config": SPARSE, "lr": 0.024, "seed": 0, "error": "stopped"}]  # a failed run counts for nothing


def test_the_sweep_runs_every_rate_ddp_first_then_the_seeds_at_each_ones_best_rate():
    assert fidelity_tune.plan((0.003, 0.012), ("average p16", SPARSE)) == [
        (0.003, "ddp"), (0.003, "average p16"), (0.003, SPARSE), (0.012, "ddp"), (0.012, "average p16"),
        (0.012, SPARSE)]
    assert fidelity_tune.best_rates(GRID) == {"ddp": 0.012, SPARSE: 0.003}
    assert fidelity_tune.seeded(GRID, 3) == [(0.012, "ddp", 1), (0.012, "ddp", 2), (0.003, SPARSE, 1),
                                             (0.003, SPARSE, 2)]
    assert fidelity_tune.seeded(GRID, 1) == []
    assert fidelity_tune.condition_of(0.012) == "lr 0.012" and set(fidelity_tune.TUNED) <= {
        name for name, _, _ in fidelity.CONFIGS}


def test_each_configuration_is_judged_at_its_own_best_rate_against_ddp_at_its_best():
    # DDP's seeds at its best rate: 2.55, 2.57, 2.56 (median 2.56); the sparse one's at 0.003: 2.46, 2.48, 2.47
    # (median 2.47). `average` p64 outer is best inside the sweep, at 0.006 (one seed), and above the sparse one.
    outer = "average p64 outer"
    cells = GRID + [cell("ddp", 0.012, 2.57, 1), cell("ddp", 0.012, 2.56, 2), cell(SPARSE, 0.003, 2.48, 1),
                    cell(SPARSE, 0.003, 2.47, 2), cell(SPARSE, 0.006, 2.20, 1),  # not a seed the sweep plans
                    cell(outer, 0.003, 2.70), cell(outer, 0.006, 2.65), cell(outer, 0.012, 2.80)]
    result = fidelity_tune.tune_headline(cells, 0.003)  # fidelity.py's rate, as it was
    assert result["ddp_best_lr"] == 0.012 and result["ddp_loss_best_lr"] == pytest.approx(2.56)
    # At fidelity.py's 3e-3 against its best rate, seed 0 both (the seeds the rate was chosen by).
    assert result["ddp_default_lr_excess"] == pytest.approx((2.90 - 2.55) / 2.55)
    sparse = result["tuned"][SPARSE]
    assert sparse["best_lr"] == 0.003 and sparse["seeds_at_best_lr"] == 3
    assert sparse["loss_best_lr"] == pytest.approx(2.47)
    assert sparse["gap_vs_tuned_ddp"] == pytest.approx((2.47 - 2.56) / 2.56)
    assert sparse["gap_at_default_lr"] == pytest.approx((2.46 - 2.90) / 2.90)
    assert sparse["loss_by_lr"] == {"0.003": 2.46, "0.006": 2.50, "0.012": 2.60, "0.024": 3.10}
    assert result["tuned_best"] == SPARSE and result["tuned_best_gap_vs_ddp"] == sparse["gap_vs_tuned_ddp"]
    assert result["tuned_sync_gap_p64_outer"] == pytest.approx((2.65 - 2.56) / 2.56)
    # The sparse one's best is the sweep's lowest rate: its own best may lie below; DDP's and p64's are inside.
    assert result["best_lr_at_edge"] == [SPARSE] and result["rates"] == [0.003, 0.006, 0.012, 0.024]
    assert fidelity_tune.tune_headline([c for c in cells if c["config"] != "ddp"], 0.003) == {}
    # Where fidelity.py's own rate was not swept, nothing is said about it; nor about p64 outer unmeasured.
    unswept = fidelity_tune.tune_headline([c for c in cells if c["lr"] != 0.003 and c["config"] != outer], 0.003)
    assert unswept["ddp_default_lr_excess"] is None and unswept["tuned"][SPARSE]["gap_at_default_lr"] is None
    assert unswept["tuned_sync_gap_p64_outer"] is None and unswept["tuned_best"] == SPARSE


class SpawningLab:
    """What `fidelity.run_ddp` asks of the lab: two worker hosts, and the specs it spawns ranks with."""
    size, addresses = 3, ["10.0.0.1", "10.0.0.2", "10.0.0.3"]

    def __init__(self):
        self.processes, self.specs = [], []

    def spawn(self, host, argv, name, env):
        self.specs.append(json.loads(argv[argv.index("--ddp-rank") + 1]))
        process = types.SimpleNamespace(returncode=0, wait=lambda timeout: 0, kill=lambda: None)
        self.processes.append((host, process))
        return process

    def tail(self, name):
        return ""


def test_the_rate_reaches_the_workbench_job_and_the_ddp_ranks(monkeypatch, tmp_path):
    assert fidelity.job_fields(256, 0, 0.012)["lr"] == 0.012  # what run_workbench builds its Job from
    assert fidelity.job_fields(256, 0)["lr"] == fidelity.LR
    lab = SpawningLab()
    assert "error" in fidelity.run_ddp(lab, tmp_path, 8, 0, [0], 60.0, lr=0.012)  # the stand-in ranks wrote nothing
    assert [spec["lr"] for spec in lab.specs] == [0.012, 0.012] and [spec["rank"] for spec in lab.specs] == [0, 1]
    # A rank given that spec trains at its rate: its optimizer's peak, scaled by the schedule each step.
    seen = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            seen.append(self.param_groups[0]["lr"])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    spec = dict(lab.specs[0], steps=4, alone=True, out=str(tmp_path / "alone.json"))
    fidelity._ddp_rank(spec)
    warmup = fidelity.job_fields(4, 0)["warmup_steps"]
    assert seen == pytest.approx([0.012 * lr_factor(step, 4, "cosine", warmup) for step in range(4)])
    assert max(seen) == pytest.approx(0.012) and json.loads((tmp_path / "alone.json").read_text())["samples_per_s"] > 0


def test_a_sweep_without_rates_is_refused_naming_the_arguments(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fidelity_tune.py", "--rates", "0.003,-1"])
    with pytest.raises(SystemExit):
        fidelity_tune.main()
    assert "--rates '0.003,-1'" in capsys.readouterr().err
