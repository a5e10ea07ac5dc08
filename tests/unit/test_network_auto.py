"""`auto` in the network benchmark (`benchmarks/network.py`): measured once it has settled under the
condition, and judged per condition against the best of every fixed configuration, repeat by repeat.
Pure: a stand-in for the autopilot's counters and synthetic cells."""
from __future__ import annotations

import types

import pytest
from helpers import load_benchmark


def pilot(judged=0, decisions=0, pending=None):
    return types.SimpleNamespace(judged=judged, decisions=decisions, chooser=types.SimpleNamespace(pending=pending))


def test_auto_is_settled_after_windows_in_a_row_without_a_move_or_a_pending_choice():
    network = load_benchmark("network")
    watched = pilot(judged=7)
    settled = network.AutoSettled(watched, 3)
    watched.judged = 9
    assert not settled()  # two windows since the condition was set
    watched.judged, watched.decisions = 10, 1  # a move: the count starts again from here
    assert not settled()
    watched.judged = 12
    assert not settled()
    watched.judged = 13
    assert settled()
    watched.chooser.pending = "easgd"  # a choice waiting to be confirmed is not settled
    assert not settled()


def cell(config, condition, repeat, rate, **more):
    return {"config": config, "condition": condition, "repeat": repeat, "samples_per_s": rate,
            "loadavg_before": (1.0, 1.0, 1.0), **more}


def test_auto_is_judged_against_the_best_fixed_configuration_of_each_condition_repeat_by_repeat():
    network = load_benchmark("network")
    chose = lambda name: {"auto": {"name": name}}  # noqa: E731
    cells = [cell("ddp", "unlimited", r, 500.0) for r in range(3)]
    cells += [cell("allreduce", "unlimited", r, v) for r, v in enumerate([400.0, 420.0, 380.0])]
    cells += [cell("average p16", "unlimited", r, v) for r, v in enumerate([300.0, 310.0, 290.0])]
    cells += [cell("auto", "unlimited", r, v, **chose("allreduce")) for r, v in enumerate([360.0, 420.0, 400.0])]
    cells += [cell("allreduce", "100mbit", r, v) for r, v in enumerate([100.0, 90.0, 110.0])]
    cells += [cell("average p16", "100mbit", r, v) for r, v in enumerate([200.0, 180.0, 220.0])]
    cells += [cell("auto", "100mbit", 0, 150.0, **chose("average p16")), {**cell("auto", "100mbit", 1, None),
              "error": "auto did not settle within 120 s"}, cell("auto", "100mbit", 2, 220.0, **chose("average p64"))]
    table = network.build_table(cells, ["ddp", "allreduce", "average p16", "auto"], ["unlimited", "100mbit"])
    result = network.auto_against_fixed(table, cells)
    clear, slow = result["auto_vs_best_fixed"]["unlimited"], result["auto_vs_best_fixed"]["100mbit"]
    # DDP is not a configuration of the workbench: the best fixed one is allreduce, at its median 400.
    assert clear["best_fixed"] == "allreduce" and clear["vs_best_fixed"] == pytest.approx(400 / 400)
    assert clear["per_repeat"] == pytest.approx([360 / 400, 420 / 420, 400 / 380])
    assert clear["spread"] == pytest.approx([0.9, 400 / 380]) and (clear["rank"], clear["of"]) == (1, 2)
    # The failed repeat counts in no median and no ratio; it is in the table's errors.
    assert slow["best_fixed"] == "average p16" and slow["vs_best_fixed"] == pytest.approx(185 / 200)
    assert slow["per_repeat"] == pytest.approx([150 / 200, 220 / 220]) and slow["rank"] == 2
    assert slow["chose"] == ["average p16", "average p64"]
    assert result["auto_worst_condition"] == "100mbit"
    assert result["auto_worst_vs_best_fixed"] == pytest.approx(185 / 200)
    assert result["auto_median_vs_best_fixed"] == pytest.approx((1 + 185 / 200) / 2)
    assert "| 100mbit | average p16 | 200 | 185 | 0.93 | 0.75-1.00 | 2 of 3 |" in network.auto_table(result)


def test_what_auto_trained_with_in_its_window_is_named_as_the_fixed_rows_name_it():
    network = load_benchmark("network")
    decisions = [{"time": 105.0, "to": "average", "settings": {"period": 16, "overlap": True}, "reason": "link"},
                 {"time": 130.0, "to": "easgd", "settings": {"period": 16}, "reason": "later"}]
    seen = network.auto_choices(decisions, began=100.0, window={"window": (110.0, 120.0)})
    assert seen["name"] == "average p16 overlap" and seen["in_window"] == 0
    assert [m["s"] for m in seen["moves"]] == [5.0, 30.0]
    inside = network.auto_choices(decisions, began=100.0, window={"window": (110.0, 131.0)})
    assert inside["in_window"] == 1
    assert network.auto_choices([], 100.0, {"window": (110.0, 120.0)})["name"] == "allreduce"
    assert network.config_name("allreduce", {"balance": True}) == "allreduce balanced"  # a fixed row
    assert network.config_name("allreduce", {"bucket_mb": 1.0}) == "allreduce bucket_mb=1.0"  # none: spelt out
