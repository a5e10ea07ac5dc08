"""The chaos benchmark's arithmetic (benchmarks/chaos.py): pauses around a fault, steps a regroup threw
away, records missing inside a group, and the headline keys from raw runs and faults."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import chaos  # noqa: E402

pytestmark = pytest.mark.unit


def steps(*pairs, worker=0):
    return [{"time": t, "step": s, "worker": worker} for t, s in pairs]


def test_the_pause_around_a_fault_is_the_longest_gap_overlapping_it():
    times = [0.0, 0.1, 0.2, 0.3, 3.3, 3.4, 3.5]
    assert chaos.median_pause(times) == pytest.approx(0.1)
    assert chaos.pause_over(times, 0.25, 3.4) == pytest.approx(3.0)  # the fault at 0.25 s: 3 s without a step
    assert chaos.pause_over(times, 3.35, 5.0) == pytest.approx(0.1)  # after the recovery: none
    # A pause that ends after the next fault began is that fault's, not this one's.
    assert chaos.pause_over(times, 0.0, 0.3) == pytest.approx(0.1)


def test_a_regroup_rewinds_to_its_checkpoint():
    records = steps((1, 70), (2, 71), (3, 72), (9, 64), (10, 65))
    regroups = [{"time": 5.0, "from_step": 64}]
    assert chaos.rewound_steps(regroups, records, 0.0, 6.0) == 9  # steps 64 to 72 made twice
    assert chaos.rewound_steps(regroups, records, 6.0, 20.0) == 0  # not this fault's
    # A second regroup counts only what its own group made: steps 64 and 65, from its checkpoint at 64.
    regroups.append({"time": 11.0, "from_step": 64})
    assert chaos.rewound_steps(regroups, records, 10.5, 20.0) == 2


def test_records_missing_are_counted_inside_each_workers_run_of_steps_within_a_group():
    first = steps((1, 0), (2, 1), (3, 3)) + steps((1, 0), (2, 1), (3, 2), worker=1)  # step 2 of worker 0 lost
    # The next group starts at step 64 from a checkpoint, a worker renumbered: no loss across groups.
    second = steps((11, 64), (12, 65)) + steps((11, 64), (12, 65), worker=1)
    assert chaos.records_missing(first + second, [0.0, 10.0]) == 1
    assert chaos.records_missing(first[:2] + second, [0.0, 10.0]) == 0


def test_the_headline_keys_come_from_the_runs_and_faults():
    undisturbed = {"final_loss": 2.0}
    runs = [{"status": "finished", "final_loss": 2.2, "records_lost": 0},
            {"status": "finished", "final_loss": 2.0, "records_lost": 1},
            {"status": "failed", "final_loss": None, "records_lost": 0}]
    faults = [{"kind": "kill", "lost_s": 1.0}, {"kind": "kill", "lost_s": 3.0}, {"kind": "cut", "lost_s": 20.0},
              {"kind": "rate", "lost_s": None}]
    keys = chaos.headline(undisturbed, runs, faults)
    assert keys["faults_injected"] == 4 and keys["runs_started"] == 3 and keys["runs_finished"] == 2
    assert keys["records_lost"] == 1
    assert keys["median_s_lost_per_fault"] == 3.0 and keys["worst_s_lost_per_fault"] == 20.0
    assert keys["lost_s_by_kind"] == {"kill": 2.0, "cut": 20.0}
    assert keys["held_out_loss_vs_undisturbed"] == pytest.approx(1.05)


def test_the_recovery_target_holds_only_when_every_recovery_was_timed_within_it():
    cells = [{"total_s": 0.6}, {"total_s": 1.9}, {"total_s": 1.0}]
    assert chaos.recovery_headline(cells) == {"recovery_worst_s": 1.9, "recovery_median_s": 1.0,
                                              "recovery_target_met": True, "recoveries": 3,
                                              "recoveries_over_target": 0}
    over = chaos.recovery_headline(cells + [{"total_s": 2.5}])
    assert not over["recovery_target_met"] and over["recoveries_over_target"] == 1
    # A run that never recorded its recovery (it failed) is not a recovery within the target.
    failed = chaos.recovery_headline(cells + [{"status": "failed"}])
    assert not failed["recovery_target_met"] and (failed["recoveries"], failed["recoveries_over_target"]) == (4, 1)
    assert chaos.recovery_headline([])["recovery_worst_s"] is None


def test_the_recovery_headline_says_the_worst_per_rank_killed():
    cells = [{"total_s": 1.2, "killed_rank": "last"}, {"total_s": 2.1, "killed_rank": "first"},
             {"total_s": 0.9, "killed_rank": "last"}]
    headline = chaos.recovery_headline(cells)
    assert headline["recovery_worst_s_last_rank_killed"] == 1.2 and headline["recovery_worst_s_first_rank_killed"] == 2.1
    assert headline["recovery_worst_s"] == 2.1 and not headline["recovery_target_met"]
