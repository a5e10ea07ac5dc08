"""The supervisor's decisions and the run's status, without a cluster: who is lost, whether a run fails,
stops or goes on with whom after a group ends, how the workers' errors read, and which status may
follow which (`run/regroup.py`, `run/lifecycle.py`)."""
import threading

import pytest

from workbench.run import regroup
from workbench.run.lifecycle import FINISHED_STATES, Lifecycle, allowed

A, B, C = "tcp://10.0.0.1:1", "tcp://10.0.0.2:1", "tcp://10.0.0.3:1"


def test_lost_workers_are_those_gone_dead_or_stuck_and_each_is_named_once():
    tasks = [regroup.TaskEnd(A, done=True), regroup.TaskEnd(B, done=False),
             regroup.TaskEnd(C, done=True, process_died=True)]
    found = regroup.newly_lost(tasks, known_lost=set(), present={A, B, C}, timeout_s=30)
    assert found == {B: "stuck: no answer within 30 s", C: "its worker process died"}
    # Gone from the scheduler counts as dead; one the scheduler already reported is not named again.
    assert regroup.newly_lost(tasks, known_lost={C}, present={A, C}, timeout_s=30) == {B: "its worker process died"}
    assert regroup.newly_lost([regroup.TaskEnd(A, done=True)], set(), {A}, 30) == {}


def test_after_a_failure_the_run_fails_stops_or_goes_on_with_the_survivors_in_rank_order():
    addresses = [A, B, C]
    assert regroup.after_failure(addresses, set(), {A, B, C}, False, 1) == regroup.Verdict("fail")
    verdict = regroup.after_failure(addresses, {B}, {A, B, C}, False, 2)
    assert verdict == regroup.Verdict("regroup", (A, C), (B,))
    # A survivor the scheduler no longer has does not go on either.
    assert regroup.after_failure(addresses, {B}, {C}, False, 1).workers == (C,)
    assert regroup.after_failure(addresses, {B, C}, {A}, False, 2) == regroup.Verdict("too-few", (A,), (B, C))
    # Stopping wins over regrouping: the user asked for the run to end.
    assert regroup.after_failure(addresses, {B}, {A, C}, True, 1).action == "stop"


GLOO_TIMEOUT = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "15000ms for recv operation to complete")


def test_a_group_whose_every_failure_is_a_timeout_stalled_and_goes_on_with_every_worker_present():
    server = "TrainingError: the parameter server did not answer within 15 s"
    assert regroup.stalled([GLOO_TIMEOUT, GLOO_TIMEOUT]) and regroup.stalled([GLOO_TIMEOUT, server])
    assert not regroup.stalled([GLOO_TIMEOUT, "ValueError: bad labels in the batch"])  # the user's code failed
    assert not regroup.stalled([])
    addresses = [A, B, C]
    assert regroup.after_failure(addresses, set(), {A, B, C}, False, 1, only_stalled=True) == \
        regroup.Verdict("regroup", (A, B, C))
    assert regroup.after_failure(addresses, set(), {A, C}, False, 1, only_stalled=True).workers == (A, C)
    # Too few left, or the user stopping: the run ends as before.
    assert regroup.after_failure(addresses, set(), {A}, False, 2, only_stalled=True).action == "fail"
    assert regroup.after_failure(addresses, set(), {A, B, C}, True, 1, only_stalled=True).action == "fail"


def test_after_success_a_join_regroups_unless_the_user_stopped():
    assert regroup.after_success(False, None, False) == regroup.Verdict("finish")
    assert regroup.after_success(True, None, False) == regroup.Verdict("stop")
    assert regroup.after_success(True, [A, B, C], False) == regroup.Verdict("regroup", (A, B, C))
    assert regroup.after_success(True, [A, B, C], True) == regroup.Verdict("stop")
    # The group finished its steps before the join took effect: the run has finished.
    assert regroup.after_success(False, [A, B, C], False) == regroup.Verdict("finish")


def test_failure_text_puts_the_cause_first_and_says_a_repeated_error_once():
    errors = [regroup.WorkerError(0, A, "RuntimeError", "Connection closed by peer", "tb0\n"),
              regroup.WorkerError(1, B, "ValueError", "bad batch", "tb1\n"),
              regroup.WorkerError(2, C, "ValueError", "bad batch", "tb2\n")]
    text = regroup.failure_text(errors)
    assert text.index("worker 1") < text.index("worker 2") < text.index("worker 0")
    assert text.count("bad batch") == 1 and "worker 2 (tcp://10.0.0.3:1) failed: ValueError: the same error" in text
    assert "tb1" in text and "tb2" not in text
    assert regroup.failure_text([]) == "the workers ended without a result"


def test_a_run_that_ended_stays_ended_and_only_allowed_moves_happen():
    life = Lifecycle()
    assert life.status == "created" and not life.ended
    with pytest.raises(RuntimeError, match="cannot go from 'created' to 'paused'"):
        life.move("paused")
    assert life.move("running") and not life.move("paused", only_from=("queued",)) and life.status == "running"
    assert life.move("paused") and life.move("finished") and life.ended
    # A pause or a resume arriving as the run ends leaves it ended.
    assert not life.move("paused") and not life.move("running") and life.status == "finished"
    assert all(not allowed(end, "running") for end in FINISHED_STATES)
    assert allowed("queued", "stopped") and not allowed("created", "finished")


def test_racing_moves_leave_one_final_status():
    for _ in range(50):
        life = Lifecycle()
        life.move("running")
        barrier = threading.Barrier(3)

        def pause_and_resume():
            barrier.wait()
            for _ in range(20):
                life.move("paused")
                life.move("running")

        def finish():
            barrier.wait()
            life.move("finished")

        threads = [threading.Thread(target=pause_and_resume), threading.Thread(target=pause_and_resume),
                   threading.Thread(target=finish)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert life.status == "finished"
