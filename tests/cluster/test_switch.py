"""Live strategy switches on a real 2-process cluster: one step for all workers, carried-over state."""
from __future__ import annotations

import functools
import time

import numpy as np
import pytest

import workbench
from workbench.errors import ConfigError, TrainingError
from workbench.plane.rundir import read_metrics
from workbench.run.handle import Run

import helpers
from helpers import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


digits_job = functools.partial(helpers.digits_job, lr=0.05, momentum=0.7, batch_size=8, epochs=5)


def steps_done(run):
    latest = run.table.last_steps()
    return min((r["step"] for r in latest.values()), default=-1) if len(latest) == 2 else -1


def switched(run, switch_id):
    return sorted((e for e in run.events("switched") if e["switch_id"] == switch_id), key=lambda e: e["worker"])


def assert_one_step_per_switch(run, switch_id, old, new):
    """Both workers switched at the same step, and their step records change strategy exactly there."""
    events = switched(run, switch_id)
    assert [e["worker"] for e in events] == [0, 1]
    assert len({e["step"] for e in events}) == 1, events
    at = events[0]["step"]
    assert all(e["from"] == old and e["to"] == new for e in events)
    frame = run.metrics
    for worker in (0, 1):
        rows = frame[frame["worker"] == worker]
        window = rows[(rows["step"] >= at - 3) & (rows["step"] < at + 3)].sort_values("step")
        expected = [old if step < at else new for step in window["step"]]
        assert list(window["strategy"]) == expected
    return at


def test_switch_from_average_starts_the_server_from_the_averaged_weights(client, run_dir):
    # A period longer than the run: the workers' weights drift apart until the switch averages them.
    run = workbench.train(digits_job(epochs=200), "average", client=client, run_dir=run_dir, period=100_000)
    try:
        wait_until(lambda: steps_done(run) >= 20, timeout_s=60)
        run.switch("async", push_every=2)
        wait_until(lambda: len(switched(run, 1)) == 2, timeout_s=60)
        at = assert_one_step_per_switch(run, 1, "average", "async")
        wait_until(lambda: steps_done(run) >= at + 10, timeout_s=60)
    finally:
        run.stop()
    run.wait(120)
    before = np.array([e["weights_before"] for e in switched(run, 1)])
    after = np.array([e["weights_after"] for e in switched(run, 1)])
    assert not np.allclose(before[0], before[1], rtol=1e-4)  # the workers had drifted apart
    for worker_after in after:  # each starts from the average (fingerprints are linear)
        np.testing.assert_allclose(worker_after, before.mean(axis=0), rtol=1e-5, atol=1e-4)
    # SGD momentum buffers went to the server's optimizer.
    assert all(list(e["carried_optimizer_state"]) == ["momentum_buffer"] for e in switched(run, 1))
    frame = run.metrics
    assert frame[(frame["step"] > at) & frame["staleness"].notna()].shape[0] > 0  # pushes after the switch


def test_switch_from_the_server_gives_every_worker_the_server_weights(client, run_dir):
    run = workbench.train(digits_job(epochs=200), "ssp", client=client, run_dir=run_dir, max_staleness=1)
    try:
        wait_until(lambda: steps_done(run) >= 20, timeout_s=60)
        run.switch("allreduce")
        wait_until(lambda: len(switched(run, 1)) == 2, timeout_s=60)
        at = assert_one_step_per_switch(run, 1, "ssp", "allreduce")
        wait_until(lambda: steps_done(run) >= at + 5, timeout_s=60)
    finally:
        run.stop()
    assert run.wait(120) == "stopped"
    events = switched(run, 1)
    # Asynchronous workers hold different weights; after the switch all hold the server's, exactly.
    assert events[0]["weights_before"] != events[1]["weights_before"]
    assert events[0]["weights_after"] == events[1]["weights_after"]
    assert all(list(e["carried_optimizer_state"]) == ["momentum_buffer"] for e in events)
    frame = run.metrics
    after = frame[frame["step"] > at]
    assert after["comm_s"].gt(0).all() and after["staleness"].isna().all()


def test_async_to_average_and_back_still_reaches_090(client, run_dir):
    # Digits steps take a fraction of a millisecond; a small delay makes each phase span many steps.
    run = Run(digits_job(epochs=8), "async", client=client, workers=None, run_dir=run_dir, name=None,
              collective_timeout_s=60, settings={}, step_delays={0: 0.003, 1: 0.003})
    run.start()
    try:
        wait_until(lambda: steps_done(run) >= 100, timeout_s=60)
        run.switch("average", period=4)
        wait_until(lambda: len(switched(run, 1)) == 2, timeout_s=60)
        first = switched(run, 1)[0]["step"]
        wait_until(lambda: steps_done(run) >= first + 150, timeout_s=60)
        run.switch("async")
        wait_until(lambda: len(switched(run, 2)) == 2, timeout_s=60)
        assert switched(run, 2)[0]["step"] < run.total_steps - 100  # a real async phase follows
        run.wait(180)
    finally:
        run.stop()
    assert_one_step_per_switch(run, 1, "async", "average")
    assert_one_step_per_switch(run, 2, "average", "async")
    assert run.strategy == "async"
    assert run.evaluate()["accuracy"] >= 0.9
    # The run directory holds the switches too, in order.
    kinds = [r["kind"] for r in read_metrics(run.directory.path) if r["kind"] in ("switched", "run-finished")]
    assert kinds == ["switched"] * 4 + ["run-finished"]


def test_live_changes_are_recorded_at_the_step_each_worker_applies_them(client, run_dir):
    run = workbench.train(digits_job(epochs=200), "average", client=client, run_dir=run_dir, period=2)
    try:
        wait_until(lambda: steps_done(run) >= 10, timeout_s=60)
        run.set_lr(0.02)
        run.update(period=6)
        wait_until(lambda: len([e for e in run.events("changed") if "settings" in e]) == 2, timeout_s=60)
        wait_until(lambda: steps_done(run) >= max(e["step"] for e in run.events("changed")) + 12, timeout_s=60)
    finally:
        run.stop()
    run.wait(120)
    changes = run.events("changed")
    lr_steps = {e["worker"]: e["step"] for e in changes if e.get("lr") == 0.02}
    period_steps = {e["worker"]: e["step"] for e in changes if e.get("settings") == {"period": 6}}
    assert len(set(lr_steps.values())) == 1 and len(set(period_steps.values())) == 1
    frame = run.metrics
    at = period_steps[0]
    syncs = frame[(frame["worker"] == 0) & (frame["step"] >= at) & frame["divergence"].notna()]["step"]
    assert len(syncs) >= 2 and set(np.diff(syncs.to_numpy())) == {6}
    assert (frame[frame["step"] >= lr_steps[0]]["lr"] == 0.02).all()


def test_bad_switches_are_refused_at_once(client, run_dir):
    run = workbench.train(digits_job(epochs=1), "allreduce", client=client, run_dir=run_dir)
    try:
        with pytest.raises(ConfigError, match="strategy"):
            run.switch("nonsense")
        with pytest.raises(ConfigError, match="max_staleness"):
            run.switch("ssp", max_staleness=-1)
        with pytest.raises(ConfigError, match="shards"):
            run.switch("async", shards=3)
        with pytest.raises(ConfigError, match="push_every"):
            run.switch("average", push_every=2)
    finally:
        run.stop()
    run.wait(60)
    with pytest.raises(TrainingError, match="already ended"):
        run.switch("async")
    assert run.events("switched") == []


def test_a_switch_reaches_a_worker_held_back_by_the_ssp_bound(client, run_dir):
    # Worker 1 is slow, so worker 0 spends most of its time waiting at the bound (max_staleness 0).
    # The switch must interrupt that wait: worker 1 meets the others for the switch and would otherwise
    # never advance the clock worker 0 waits for.
    run = Run(digits_job(epochs=200), "ssp", client=client, workers=None, run_dir=run_dir, name=None,
              collective_timeout_s=20, settings={"max_staleness": 0}, step_delays={1: 0.02})
    run.start()
    try:
        run.wait_for_step(20, timeout=60)
        frame = run.metrics
        assert frame[frame["worker"] == 0]["wait_s"].sum() > 0.1  # worker 0 really is held back
        run.switch("average", period=2)
        events = run.wait_for_event("switched", since=0, timeout=10)  # far below the 20 s timeouts
        assert events[0]["step"] == events[1]["step"]
        run.wait_for_step(events[0]["step"] + 5, timeout=60)
    finally:
        run.stop()
    assert run.wait(120) == "stopped"


@pytest.mark.parametrize("order", ["switch-then-pause", "pause-then-switch"])
def test_a_switch_and_a_pause_together_never_deadlock(client, run_dir, order):
    run = Run(digits_job(epochs=200), "async", client=client, workers=None, run_dir=run_dir, name=None,
              collective_timeout_s=30, settings={}, step_delays={0: 0.002, 1: 0.002})
    run.start()
    try:
        run.wait_for_step(20, timeout=60)
        since = time.time()
        if order == "switch-then-pause":  # back to back: workers may read either state first
            run.switch("average", period=4)
            run.pause()
        else:
            run.pause()
            run.wait_for_event("paused", since, timeout=30)
            run.switch("average", period=4)
        switched_events = run.wait_for_event("switched", since, timeout=20)
        assert switched_events[0]["step"] == switched_events[1]["step"]
        # ... and the run is paused again right after the switch, at the switch step.
        wait_until(lambda: {e["worker"] for e in run.events("paused") if e["time"] >= switched_events[0]["time"]}
                   == {0, 1}, timeout_s=20)
        paused = {e["worker"]: e["step"] for e in run.events("paused") if e["time"] >= switched_events[0]["time"]}
        assert paused == {0: switched_events[0]["step"], 1: switched_events[0]["step"]}
        since = time.time()
        run.resume()
        run.wait_for_event("resumed", since, timeout=20)
        run.wait_for_step(switched_events[0]["step"] + 5, timeout=60)
    finally:
        run.stop()
    assert run.wait(120) == "stopped"


def test_adam_state_carries_through_elastic_averaging_and_back(client, run_dir):
    job = digits_job(epochs=200, optimizer="adam", lr=0.002, momentum=0.0)
    # Averaging never within the test: the workers' weights and Adam states drift apart.
    run = workbench.train(job, "average", client=client, run_dir=run_dir, period=100_000)
    try:
        run.wait_for_step(20, timeout=60)
        run.switch("easgd", period=4)
        first = run.wait_for_event("switched", 0, timeout=30)
        run.wait_for_step(first[0]["step"] + 20, timeout=60)
        since = time.time()
        run.switch("allreduce")
        second = run.wait_for_event("switched", since, timeout=30)
        run.wait_for_step(second[0]["step"] + 5, timeout=60)
    finally:
        run.stop()
    run.wait(120)
    # EASGD workers keep their own Adam: its moments and step go into the switch and come back out.
    for event in first + second:
        assert list(event["carried_optimizer_state"]) == ["exp_avg", "exp_avg_sq", "step"]
    # From averaging to easgd each worker keeps its own Adam and its own weights (both train their own
    # copy; no mean sent over the link), over the global weights they agree on; back to allreduce they
    # take the mean, and the center.
    assert first[0]["weights_after"] != first[1]["weights_after"]
    assert [e["weights_after"] for e in first] == [e["weights_before"] for e in first]
    assert first[0]["common_weights"] == first[1]["common_weights"] is not None
    assert first[0]["optimizer_state_after"] != first[1]["optimizer_state_after"]
    assert second[0]["common_weights"] is None
    assert second[0]["weights_after"] == second[1]["weights_after"]
    assert second[0]["optimizer_state_after"] == second[1]["optimizer_state_after"]


def test_control_actions_need_a_started_run(client, run_dir):
    run = workbench.train(digits_job(epochs=1), "average", client=client, run_dir=run_dir, start=False)
    for action in (lambda: run.set_lr(0.1), lambda: run.update(period=2), lambda: run.switch("async"),
                   run.pause, run.resume):
        with pytest.raises(TrainingError, match="has not started"):
            action()
    run.stop()  # harmless
    assert run.status == "created" and run.snapshot()["run_id"] is None
