"""The phases of a recovery from lost workers, timed from a run's records (run/recovery.py, pure)."""
from __future__ import annotations

import pytest

from workbench.plane import kinds
from workbench.run.recovery import describe, recoveries


def _step(worker, time, step):
    return {"kind": kinds.STEP, "worker": worker, "time": time, "step": step}


def _records(lost_last_seen=10.0):
    """Three workers; the one at rank 2 dies after its step at t=10; the other two go on as a group of 2."""
    records = [{"kind": kinds.GENERATION_STARTED, "time": 0.0, "generation": 0, "workers": ["a", "b", "c"]}]
    records += [_step(w, 1.0 + t, t) for t in range(10) for w in (0, 1, 2)]
    records += [{"kind": kinds.WORKER_LOST, "time": 11.5, "rank": 2, "address": "c", "generation": 0,
                 "step": 9, "last_seen": lost_last_seen, "reason": "the scheduler removed the worker"},
                {"kind": kinds.REGROUPED, "time": 12.0, "generation": 1, "workers": ["a", "b"], "lost": ["c"],
                 "from_step": 8, "reason": "workers lost"},
                {"kind": kinds.GENERATION_STARTED, "time": 12.1, "generation": 1, "workers": ["a", "b"]},
                {"kind": kinds.RESTORED, "worker": 0, "time": 12.6, "generation": 1},
                {"kind": kinds.RESTORED, "worker": 1, "time": 12.9, "generation": 1}]
    return records


def test_each_phase_runs_between_the_records_that_end_it_and_they_add_up():
    records = _records() + [_step(0, 13.5, 8), _step(1, 13.7, 8), _step(0, 14.0, 9)]
    (entry,) = recoveries(reversed(records))  # any order: sorted by time
    assert entry["lost"] == ["c"] and entry["generation"] == 1 and entry["from_step"] == 8
    assert entry["moments"] == {"fault": 10.0, "detected": 11.5, "agreed": 12.0, "restored": 12.9,
                                "first_step": 13.7}  # every rank of the new group stepped
    assert entry["phases_s"] == pytest.approx({"detected": 1.5, "agreed": 0.5, "restored": 0.9, "first_step": 0.8})
    assert entry["total_s"] == pytest.approx(3.7) == pytest.approx(sum(entry["phases_s"].values()))
    assert describe(entry).startswith("recovered from losing c in 3.7 s (fault to detected 1.5 s, ")


def test_a_recovery_is_reported_only_once_every_new_rank_has_started_and_stepped():
    assert recoveries(_records()) == []  # nobody stepped yet
    assert recoveries(_records() + [_step(0, 13.5, 8)]) == []  # one of the two
    started_one = [r for r in _records() if not (r["kind"] == kinds.RESTORED and r["worker"] == 1)]
    assert recoveries(started_one + [_step(0, 13.5, 8), _step(1, 13.7, 8)]) == []


def test_a_regroup_for_joined_workers_is_no_recovery_and_an_unseen_worker_counts_from_its_detection():
    joined = [{"kind": kinds.REGROUPED, "time": 5.0, "generation": 1, "workers": ["a", "b", "c"], "lost": [],
               "reason": "workers joined"}]
    assert recoveries(joined) == []
    (entry,) = recoveries(_records(lost_last_seen=None) + [_step(0, 13.5, 8), _step(1, 13.7, 8)])
    assert entry["moments"]["fault"] == 11.5 and entry["phases_s"]["detected"] == 0.0
