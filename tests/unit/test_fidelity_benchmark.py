"""The fidelity benchmark's arithmetic (benchmarks/fidelity.py): time to a target loss along a curve, the
three headline keys from raw cells, the plan of cells, and the picture drawn from a result."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
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


def test_the_target_is_ddps_loss_at_half_its_budget_the_median_over_its_seeds_at_100mbit():
    four = [(20, 2.8), (40, 2.5), (60, 2.3), (80, 2.1)]  # steps 64 to 256: half the budget is step 128
    assert fidelity.loss_at_step(curve(four), 128) == 2.5
    assert fidelity.loss_at_step(curve(four), 96) == pytest.approx(2.65)  # between evaluations: linear
    assert fidelity.loss_at_step(curve(four), 32) is None and fidelity.loss_at_step([], 64) is None
    cells = [cell("ddp", "unlimited", [(10, 3.0), (15, 2.2), (20, 2.0), (25, 1.9)]),  # not the seeded condition
             cell("ddp", "100mbit", four), cell("ddp", "100mbit", [(20, 2.7), (40, 2.4), (60, 2.2), (80, 2.0)], seed=1),
             cell("ddp", "100mbit", [(20, 2.9), (40, 2.6), (60, 2.4), (80, 2.3)], seed=2)]
    assert fidelity.target_loss(cells) == (2.5, "DDP at 0.5 of its budget, 100mbit, the median of 3 run(s)")
    # Without the seeded condition (--balance, --thin), the first condition DDP ran in; without DDP, none.
    assert fidelity.target_loss([cells[0]])[0] == 2.2
    assert fidelity.target_loss([c for c in cells if c["config"] != "ddp"]) == (None, "DDP did not finish")


def test_the_headline_keys_come_from_the_cells():
    cells = [
        cell("ddp", "unlimited", [(10, 3.0), (20, 2.0)]),  # the seeded condition's DDP sets the target
        cell("ddp", "100mbit", [(40, 2.5), (80, 2.1)]), cell("ddp", "100mbit", [(40, 2.4), (80, 2.0)], seed=1),
        cell("ddp", "100mbit", [(40, 2.6), (80, 2.2)], seed=2),  # at half: 2.5, 2.4, 2.6; the target 2.5
        cell("average p64 outer", "unlimited", [(5, 2.6), (9, 2.55)]),  # the gap is judged at 100 Mbit/s
        cell("average p64 outer", "100mbit", [(10, 2.8), (20, 2.2)]),  # 2.5 at 15 s
        cell("average p64 outer", "100mbit", [(10, 3.0), (20, 2.6)], seed=1),  # never reaches 2.5
        cell("average p64 outer", "100mbit", [(10, 2.9), (20, 2.1)], seed=2),  # 2.5 at 15 s
        cell("async p4", "100mbit", [(10, 2.9), (20, 2.6)]),  # never
        cell("auto", "100mbit", [(10, 2.9), (20, 2.3)]),  # 2.5 at 16.67 s
        cell("auto", "unlimited", [(5, 2.7), (10, 2.3)]),  # 2.5 at 7.5 s
        cell("allreduce", "unlimited", [(6, 2.6), (12, 2.4)]),  # 2.5 at 9 s
    ]
    result = fidelity.headline(cells)
    assert result["target_loss"] == pytest.approx(2.5)
    # At equal samples, the medians over the seeds at 100 Mbit/s: p64 outer 2.2 (2.2, 2.6, 2.1), DDP 2.1.
    assert result["sync_gap_p64_outer"] == pytest.approx((2.2 - 2.1) / 2.1)
    assert result["best_at_100mbit"] == "average p64 outer"
    # Times are medians over the seeds, a seed that never reaches the target counting as the latest:
    # DDP 40, 40 and 40 + 40 * 0.1 / 0.4 s.
    assert result["time_to_target_s"]["100mbit"]["ddp"] == 40
    assert result["time_to_target_s"]["100mbit"]["average p64 outer"] == pytest.approx(15)
    assert result["best_time_to_target_vs_ddp_100mbit"] == pytest.approx(15 / 40)
    assert fidelity.median_or_none([80, None, 70]) == 80 and fidelity.median_or_none([80, None, None]) is None
    assert result["time_to_target_s"]["100mbit"]["async p4"] is None
    # auto against the best fixed configuration in each condition, the worst of them.
    assert result["auto_vs_best_fixed_by_condition"]["100mbit"] == pytest.approx((10 + 10 * 0.4 / 0.6) / 15)
    assert result["auto_vs_best_fixed_by_condition"]["unlimited"] == pytest.approx(7.5 / 9)
    assert result["auto_time_to_target_vs_best_fixed"] == pytest.approx((10 + 10 * 0.4 / 0.6) / 15)


def test_quick_judges_against_ddp_at_100mbit_and_plans_five_runs():
    cells = [cell("ddp", "100mbit", [(40, 2.5), (80, 2.1)]), cell("auto", "100mbit", [(10, 2.9), (30, 2.0)]),
             cell("average p64 outer", "100mbit", [(10, 2.7), (20, 2.0)])]
    result = fidelity.headline(cells)
    assert result["target_from"] == "DDP at 0.5 of its budget, 100mbit, the median of 1 run(s)"
    assert result["sync_gap_p64_outer"] == pytest.approx((2.0 - 2.1) / 2.1)
    assert result["auto_time_to_target_vs_best_fixed"] == pytest.approx((10 + 20 * 0.4 / 0.9) / (10 + 10 * 0.2 / 0.7))
    arguments = argparse.Namespace(quick=True, conditions="", only=None, seeds=3)
    assert [(c[0], c[1]) for c in fidelity.plan(arguments)] == [
        ("100mbit", "ddp"), ("100mbit", "average p16"), ("100mbit", "async p4"), ("100mbit", "easgd p16"),
        ("100mbit", "auto")]
    arguments = argparse.Namespace(quick=False, conditions="100mbit,unlimited", only=None, seeds=3)
    grid = fidelity.plan(arguments)
    assert {seed for *_, seed in grid} == {0} and len(grid) == 2 * (1 + len(fidelity.CONFIGS))
    # Once the 100 Mbit/s row is measured, its seeds: DDP, p64 outer, auto and the best fixed there (by time
    # to the target, DDP's 2.5, where one reaches it: here easgd, though p64 outer ends lower).
    measured = [cell("ddp", "100mbit", [(40, 2.5), (80, 2.1)]), cell("auto", "100mbit", [(10, 2.7), (30, 2.0)]),
                cell("average p64 outer", "100mbit", [(10, 2.6), (20, 1.9)]),
                cell("easgd p16", "100mbit", [(10, 2.4), (20, 2.0)]), cell("async p4", "100mbit", [(5, 2.7)])]
    more = fidelity.seeded(arguments, measured)
    assert [(c[0], c[1], c[4]) for c in more] == [("100mbit", name, seed) for seed in (1, 2) for name in
                                                   ("ddp", "average p64 outer", "easgd p16", "auto")]
    assert fidelity.best_fixed(measured, "100mbit", 1.0) == "average p64 outer"  # none reaches it: lowest end


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


def test_the_table_shows_each_configuration_against_ddp_in_its_condition():
    cells = [cell("ddp", "100mbit", [(40, 2.5), (80, 2.0)]), cell("ddp", "100mbit", [(40, 2.5), (80, 2.2)], seed=1),
             cell("async p4", "100mbit", [(10, 2.9), (20, 2.6)]), cell("average p64", "100mbit", [(10, 2.9), (20, 1.9)]),
             {"config": "auto", "condition": "100mbit", "seed": 0, "error": "TimeoutError: over 1800 s"}]
    for c in cells:
        c.setdefault("wall_s", c["curve"][-1]["seconds"] if "curve" in c else None)
    result = {"cells": cells, **fidelity.headline(cells)}
    lines = fidelity.table(result).splitlines()
    assert lines[0] == "| 100mbit | runs | held-out loss | vs DDP | wall time | to 2.500 |"  # DDP's at half
    rows = [line.split(" | ") for line in lines[2:6]]
    assert [row[0] for row in rows] == ["| PyTorch DDP", "| `average p64`", "| `async p4`", "| `auto`"]
    assert rows[0][1:5] == ["2", "2.100", "1.000", "80 s"]
    assert rows[1][2:6] == ["1.900", "0.905", "20 s", "14 s |"]  # 2.5 at 10 + 10 * (2.9 - 2.5) / (2.9 - 1.9) s
    assert rows[2][5] == "never |" and rows[3][2].startswith("failed: TimeoutError")
    assert "- `auto_time_to_target_vs_best_fixed`: null" in lines


def test_balance_plans_the_capacity_first_and_judges_each_run_against_it():
    arguments = argparse.Namespace(quick=False, balance=True, conditions="", only=None, seeds=3)
    plan = fidelity.plan(arguments)
    repeat = ["alone", "lockstep", "ddp balanced", "allreduce balanced"]
    assert [c[1] for c in plan[:17]] == repeat * 3 + ["alone", "ddp", "allreduce", "async p4", "auto"]
    assert {c[0] for c in plan[:17]} == {"slow-host"}
    assert {c[0] for c in plan} == {"slow-host", "quarter-host"} and len(plan) == 34
    assert fidelity.seeded(arguments, []) == []
    cells = [dict(cell("ddp", "slow-host", [(40, 2.5), (80, 2.1)]), steady_samples_per_s=200.0),
             dict(cell("allreduce balanced", "slow-host", [(30, 2.3), (60, 2.1)]), steady_samples_per_s=285.0),
             {"condition": "slow-host", "config": "alone", "seed": 0, "samples_per_s": 300.0,
              "samples_per_s_by_host": [200.0, 100.0]},
             {"condition": "quarter-host", "config": "alone", "seed": 0, "samples_per_s": 250.0},
             dict(cell("allreduce balanced", "quarter-host", [(30, 2.3)]), steady_samples_per_s=200.0)]
    result = fidelity.balance_headline(cells)
    assert result["capacity_samples_per_s"] == {"slow-host": 300.0, "quarter-host": 250.0}
    assert result["share_of_capacity"]["slow-host"] == {"ddp": pytest.approx(2 / 3), "allreduce balanced": 0.95}
    assert result["balanced_share_of_capacity"] == 0.95 and result["balanced_share_of_capacity_quarter"] == 0.8
    assert "slow-host" in fidelity.headline(cells)["target_from"]  # no seeded row: DDP's first condition
    assert fidelity.balance_headline([c for c in cells if c["config"] != "alone"]) == {}


def test_the_references_run_on_the_batch_cut_by_the_hosts_speeds_and_are_judged_as_speeds():
    # 64 samples at 190 : 85 samples/s is 44.2 : 19.8; at 1000 : 1 the slow host still gets one.
    assert fidelity.speed_cut([190.0, 85.0], 64) == [44, 20] and sum(fidelity.speed_cut([192.0, 37.0], 64)) == 64
    assert fidelity.speed_cut([1000.0, 1.0], 64) == [63, 1] and fidelity.speed_cut([3.0, 1.0, 1.0], 10) == [6, 2, 2]
    assert fidelity.speed_cut(None, 64) == [32, 32] and fidelity.speed_cut([100.0, None], 64) == [32, 32]
    alone = [{"condition": "slow-host", "config": "alone", "samples_per_s": 280.0, "samples_per_s_by_host": [180.0, 100.0]},
             {"condition": "quarter-host", "config": "alone", "samples_per_s": 220.0, "samples_per_s_by_host": [190.0, 30.0]}]
    assert fidelity.last_alone(alone, "slow-host") == [180.0, 100.0] and fidelity.last_alone(alone, "unlimited") is None

    def reference(name, rate):
        return {"condition": "slow-host", "config": name, "seed": 0, "steady_samples_per_s": rate, "cut": [41, 23]}

    cells = [alone[0], reference("lockstep", 266.0), reference("ddp balanced", 252.0),
             dict(cell("allreduce balanced", "slow-host", [(30, 2.3)]), steady_samples_per_s=238.0, cut_held=[44, 20]),
             dict(alone[0], samples_per_s=280.0)]
    result = fidelity.balance_headline(cells)
    assert result["lockstep_share_of_capacity"] == pytest.approx(0.95)
    assert result["ddp_balanced_share_of_capacity"] == pytest.approx(0.9)
    assert result["balanced_share_of_capacity"] == pytest.approx(0.85)
    # The cut each run trained on: the references' set, the balanced run's as held.
    assert result["cut_runs"]["slow-host"] == {"lockstep": [[41, 23]], "ddp balanced": [[41, 23]],
                                               "allreduce balanced": [[44, 20]]}
    document = dict(result, cells=cells, target_loss=None)
    lines = fidelity.table(document).splitlines()
    assert ("| slow-host: capacity 280 samples/s | share of capacity (median) | each run | "
            "samples a step by host, each run |") in lines
    assert "| `allreduce balanced` | 0.850 | 0.850 | 44/20 |" in lines
    shares = [line.split(" | ")[:2] for line in lines if line.startswith("| `")]
    # The held-out table has the balanced run alone (one run; the references have no curve); the shares, all three.
    assert shares == [["| `allreduce balanced`", "1"], ["| `lockstep`", "0.950"], ["| `ddp balanced`", "0.900"],
                      ["| `allreduce balanced`", "0.850"]]


def test_the_cut_held_is_each_ranks_median_samples_a_step_after_its_first_quarter():
    # Rank 0 starts at 32 and is moved to 44 (45 once), rank 1 the rest; the even start is left out.
    first, second = [32, 32, 42, 44, 44, 45, 44, 44], [32, 32, 22, 20, 20, 19, 20, 20]
    assert fidelity.held_cut([first, second]) == [44, 20]
    assert fidelity.held_cut([[32], []]) == [32]  # a rank without steps has no share to tell


def test_each_balanced_run_is_judged_against_the_capacity_measured_around_it():
    def alone(rate):
        return {"condition": "slow-host", "config": "alone", "seed": 0, "samples_per_s": rate}

    def balanced(rate):
        return dict(cell("allreduce balanced", "slow-host", [(30, 2.3)]), steady_samples_per_s=rate)

    # The hosts slowed down during the second pair: each run against the capacity just before and after it.
    cells = [alone(250.0), balanced(230.0), alone(200.0), balanced(190.0), alone(250.0),
             dict(cell("ddp", "slow-host", [(30, 2.3)]), steady_samples_per_s=150.0)]
    result = fidelity.balance_headline(cells)
    assert result["capacity_samples_per_s"]["slow-host"] == 250.0  # the median of the three
    assert result["balanced_share_of_capacity"] == pytest.approx((230 / 225 + 190 / 225) / 2)
    assert result["share_of_capacity_runs"]["slow-host"]["allreduce balanced"] == pytest.approx([230 / 225, 190 / 225])
    assert result["share_of_capacity"]["slow-host"]["ddp"] == pytest.approx(150 / 250)  # the last one before it
    assert fidelity.nearest_capacity(cells, 0) == 200.0 and fidelity.nearest_capacity(cells[1:2], 0) is None


def test_a_steady_rate_leaves_the_first_quarter_of_the_time_out():
    # Steps of 16 samples ending each second for 8 s, after a slow first one: 0-2 s is the first quarter.
    ends = [0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert fidelity.steady_rate(ends, [16] * 8) == pytest.approx(16 * 6 / 6.0)
    assert fidelity.steady_rate([1.0], [16]) is None


def test_a_steady_rate_leaves_out_the_intervals_that_held_an_evaluation():
    # Steps of 16 samples each second, but the one ending at 6.0 waited 3 s more for rank 0's evaluation.
    ends = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 9.0, 10.0, 11.0, 12.0]
    assert fidelity.steady_rate(ends, [16] * 10) == pytest.approx(16 * 6 / 9.0)  # from 3 s: 6 steps in 9 s
    assert fidelity.steady_rate(ends, [16] * 10, pauses=[8.5]) == pytest.approx(16.0)
    assert fidelity.steady_rate(ends, [16] * 10, pauses=[20.0]) == fidelity.steady_rate(ends, [16] * 10)


def test_thin_plans_ddp_on_the_unlimited_link_only_and_keeps_the_fastest_config_within_3_percent():
    arguments = argparse.Namespace(quick=False, balance=False, thin=True, conditions="", only=None, seeds=3)
    plan = [(c[0], c[1]) for c in fidelity.plan(arguments)]
    assert plan[0] == ("unlimited", "ddp") and sum(name == "ddp" for _, name in plan) == 1
    assert {condition for condition, _ in plan} == {"unlimited", "20mbit", "10mbit"}
    assert len(plan) == 1 + 3 * len(fidelity.THIN) + 2 * 2 * 4 and fidelity.seeded(arguments, []) == []
    # Then the four candidates (not the float32 one) twice more, unlimited and 10 Mbit/s back to back.
    again = plan[1 + 3 * len(fidelity.THIN):]
    assert again[:2] == [("unlimited", "average p16 overlap bf16"), ("10mbit", "average p16 overlap bf16")]
    assert {name for _, name in again} == set(fidelity.THIN) - {"average p16"}
    assert all(sum(1 for c in plan if c == (condition, name)) == 3 for condition, name in again)
    assert sum(1 for c in plan if c == ("20mbit", "average p1 overlap sparse")) == 1
    dense, sparse = "average p16 overlap bf16", "average p16 sparse"

    def run(config, condition, rate, loss, sent, settings=None):
        return dict(cell(config, condition, [(10, 3.0), (20, loss)]), steady_samples_per_s=rate,
                    bytes_per_exchange=sent, settings=settings or {})

    cells = [run("ddp", "unlimited", 300.0, 2.00, 1000),
             run(dense, "unlimited", 300.0, 2.04, 1700), run(dense, "10mbit", 285.0, 2.05, 1700),
             run(sparse, "unlimited", 290.0, 2.08, 30, {"sparse_density": 1 / 64}),
             run(sparse, "10mbit", 290.0, 2.08, 30, {"sparse_density": 1 / 64})]
    result = fidelity.thin_headline(cells, parameters=1000)
    # Three runs of the sparse one at 10 Mbit/s: its speed there is their median, each run kept beside it.
    again = [run(sparse, "10mbit", 200.0, 2.08, 30), run(sparse, "10mbit", 280.0, 2.08, 30)]
    repeated = fidelity.thin_headline(cells + again, parameters=1000)["thin"][sparse]
    assert repeated["samples_per_s_runs"]["10mbit"] == [290.0, 200.0, 280.0]
    assert repeated["retention_10mbit"] == pytest.approx(280.0 / 290.0) and repeated["samples_per_s"]["20mbit"] is None
    # Both keep over 0.9 of their speed; the dense one ends closer to DDP (2.5% against 4%): the best.
    assert result["thin"][sparse]["retention_10mbit"] == 1.0 and result["thin"][sparse]["gap_10mbit"] > 0.03
    assert result["best_at_10mbit"] == dense and result["best_retention_10mbit"] == pytest.approx(0.95)
    assert result["sync_gap_10mbit"] == pytest.approx(0.025) and result["targets_met_10mbit"]
    # The dense one slowed to half its speed: only the sparse one keeps 0.9, and it is the best, though its
    # loss misses the 3%.
    slowed = [dict(c, steady_samples_per_s=150.0) if c["config"] == dense and c["condition"] == "10mbit" else c
              for c in cells]
    result = fidelity.thin_headline(slowed, parameters=1000)
    assert result["best_at_10mbit"] == sparse and not result["targets_met_10mbit"]
    assert result["sparse_bytes_ratio"] == pytest.approx(4000 / 30)
    assert fidelity.thin_headline([c for c in cells if c["config"] != "ddp"], 1000) == {}


def test_a_run_stopped_over_its_time_has_no_final_loss_and_says_so():
    curve = [{"step": 64, "seconds": 30.0, "loss": 3.1}, {"step": 128, "seconds": 60.0, "loss": 2.8}]
    finished = {"status": "finished", "curve": curve, "wall_s": 61.0}
    stopped = {"status": f"{fidelity.STOPPED} 900 s (TimeoutError)", "curve": curve, "wall_s": 900.0}
    assert fidelity.final_loss(finished) == 2.8 and fidelity.final_loss(stopped) is None
    # Its curve still times a target it reached before it was stopped.
    assert fidelity.time_to(stopped["curve"], 2.95) == pytest.approx(45.0)
    assert fidelity.outcome(finished) == "held-out loss 2.8000 after 61 s"
    assert fidelity.outcome(stopped) == f"no final held-out loss ({stopped['status']})"
    assert fidelity.outcome({"error": "DDP over 900 s"}) == "DDP over 900 s"
    assert fidelity.outcome({"samples_per_s": 250.4, "samples_per_s_by_host": [150.0, 100.4]}) == "250 samples/s"
    assert fidelity.outcome({"steady_samples_per_s": 240.0, "cut": [40, 24]}) == "240 samples/s, cut [40, 24]"
    # A condition whose only run of a configuration was stopped shows it as a run without a loss.
    assert fidelity.median_or_none([fidelity.final_loss(c) for c in (stopped,)]) is None


def test_a_rate_below_or_at_zero_is_refused_naming_it(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["fidelity.py", "--lr", "0"])
    with pytest.raises(SystemExit):
        fidelity.main()
    assert "--lr 0.0: a peak learning rate above 0" in capsys.readouterr().err
