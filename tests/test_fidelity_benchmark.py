"""The fidelity benchmark's arithmetic (benchmarks/fidelity.py): time to a target loss along a curve, the
three headline keys from raw cells, the plan of cells, and the picture drawn from a result."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import fidelity  # noqa: E402


def curve(points):
    return [{"step": 64 * (i + 1), "seconds": s, "loss": loss} for i, (s, loss) in enumerate(points)]


def cell(config, condition, points, seed=0):
    return {"config": config, "condition": condition, "seed": seed, "samples_per_step": 64, "curve": curve(points)}


def test_time_to_a_target_interpolates_between_evaluations():
    points = curve([(10, 3.0), (20, 2.0), (30, 1.5)])
    assert fidelity.time_to(points, 2.5) == pytest.approx(15.0)
    assert fidelity.time_to(points, 3.5) == 10  # reached at the first evaluation
    assert fidelity.time_to(points, 1.5) == 30
    assert fidelity.time_to(points, 1.0) is None  # never reached: said, not guessed


def test_the_headline_keys_come_from_the_cells():
    cells = [
        cell("ddp", "unlimited", [(10, 3.0), (20, 2.0)]), cell("ddp", "unlimited", [(10, 3.0), (22, 2.2)], seed=1),
        cell("ddp", "unlimited", [(10, 3.0), (21, 2.1)], seed=2),  # DDP's median end: 2.1, the target
        cell("average p64 outer", "unlimited", [(5, 2.6), (9, 2.142)]),
        cell("ddp", "100mbit", [(40, 2.5), (80, 2.1)]),
        cell("average p64 outer", "100mbit", [(10, 2.3), (20, 2.0)]),  # 2.1 at 16.67 s
        cell("async p4", "100mbit", [(10, 2.9), (20, 2.5)]),  # never
        cell("auto", "100mbit", [(10, 2.2), (20, 2.0)]),  # 2.1 at 15 s
        cell("auto", "unlimited", [(5, 2.5), (10, 2.05)]),  # 2.1 at 9.44 s
        cell("allreduce", "unlimited", [(6, 2.3), (12, 2.0)]),  # 2.1 at 10 s
    ]
    result = fidelity.headline(cells, quick=False)
    assert result["target_loss"] == pytest.approx(2.1)
    assert result["sync_gap_p64_outer"] == pytest.approx(0.02)
    assert result["best_at_100mbit"] == "average p64 outer"
    assert result["best_time_to_target_vs_ddp_100mbit"] == pytest.approx((10 + 10 * 2 / 3) / 80)
    assert result["time_to_target_s"]["100mbit"]["async p4"] is None
    # auto against the best fixed configuration in each condition, the worst of them.
    assert result["auto_vs_best_fixed_by_condition"]["100mbit"] == pytest.approx(15 / (10 + 10 * 2 / 3))
    unlimited = result["auto_vs_best_fixed_by_condition"]["unlimited"]
    assert unlimited == pytest.approx((5 + 5 * 0.4 / 0.45) / 10)
    assert result["auto_time_to_target_vs_best_fixed"] == pytest.approx(max(unlimited, 15 / (10 + 10 * 2 / 3)))


def test_quick_judges_against_ddp_at_100mbit_and_plans_four_runs():
    cells = [cell("ddp", "100mbit", [(40, 2.5), (80, 2.1)]), cell("auto", "100mbit", [(10, 2.3), (30, 2.0)]),
             cell("average p64 outer", "100mbit", [(10, 2.3), (20, 2.0)])]
    result = fidelity.headline(cells, quick=True)
    assert result["target_from"].endswith("100mbit") and result["sync_gap_p64_outer"] is None
    assert result["auto_time_to_target_vs_best_fixed"] == pytest.approx((10 + 20 * 2 / 3) / (10 + 10 * 2 / 3))
    arguments = argparse.Namespace(quick=True, conditions="", only=None, seeds=3)
    assert [(c[0], c[1]) for c in fidelity.plan(arguments)] == [
        ("100mbit", "ddp"), ("100mbit", "average p64 outer"), ("100mbit", "async p4"), ("100mbit", "auto")]
    grid = fidelity.plan(argparse.Namespace(quick=False, conditions="unlimited", only=None, seeds=3))
    seeds = {}
    for _, name, _, _, seed in grid:
        seeds.setdefault(name, []).append(seed)
    assert seeds["ddp"] == seeds["average p64 outer"] == seeds["auto"] == [0, 1, 2] and seeds["async p4"] == [0]


def test_the_picture_draws_a_line_per_run_and_a_panel_per_condition():
    pytest.importorskip("matplotlib")
    from widgets.figures import held_out_figure

    cells = [cell("ddp", "unlimited", [(10, 3.0), (20, 2.0)]), cell("auto", "unlimited", [(10, 2.5), (20, 2.2)]),
             cell("ddp", "100mbit", [(40, 2.5), (80, 2.1)]), {"config": "auto", "condition": "100mbit", "error": "x"}]
    picture = held_out_figure({"cells": cells, "target_loss": 2.0})
    panels = picture.figure.axes
    assert [axes.get_title() for axes in panels] == ["unlimited", "100mbit"]
    assert [len(axes.get_lines()) for axes in panels] == [3, 2]  # the runs and the target line
    assert list(panels[0].get_lines()[1].get_xdata()) == [10, 20]
    by_samples = held_out_figure({"cells": cells}, against="samples").figure.axes[0]
    assert list(by_samples.get_lines()[0].get_xdata()) == [64 * 64, 128 * 64]
    assert picture.png().startswith(b"\x89PNG")
