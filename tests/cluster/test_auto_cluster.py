"""`auto` on a real 2-process cluster: a straggling worker gets a smaller share of each batch (balanced
allreduce) with the reason said, a teammate pins it from the dashboard and turns it on again (the
decision table: tests/unit/test_auto.py)."""
import pytest


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_auto_moves_off_allreduce_when_a_worker_straggles_says_why_and_a_teammate_pins_it(client, run_dir):
    import workbench
    from workbench.plane import kinds
    from workbench.plane.metrics import messages_in, topic
    from workbench.run.handle import Run

    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", lr=0.1, momentum=0.9, batch_size=16, steps=100_000)
    # Worker 1 takes 1.25 ms more per sample (20 ms a step at its equal part: a slower CPU): under
    # allreduce worker 0 waits for it at every step.
    run = Run(job, "auto", client=client, workers=2, run_dir=run_dir, name=None, collective_timeout_s=60,
              settings={}, sample_delays={1: 0.00125})
    run.start()
    try:
        assert run.strategy == "allreduce" and run.config["auto"]
        decision = _wait_for_kind(run, kinds.AUTO_DECISION, timeout_s=60)[0]
        # First the move that stays synchronous and exact: worker 1's share of each batch cut to its speed.
        assert decision["from"] == decision["to"] == "allreduce" and decision["settings"] == {"balance": True}
        assert "worker 1 computes at" in decision["reason"] and decision["measured"]["speed_spread"] < 0.6
        assert decision["lr"] == pytest.approx(0.1)  # the same updates: the same lr
        # It went out on the run's topic, so every viewer (the team's dashboard) has it, keyed as it reads it.
        on_topic = [m for _, message in client.get_events(topic(run.run_id)) for m in messages_in(message)
                    if m.get("kind") == kinds.AUTO_DECISION]
        assert on_topic and set(on_topic[0]["measured"]["compute_s"]) == {"0", "1"}, on_topic
        run._wait_for(lambda: _share_of(run, 1, decision["time"]) <= 8, 60, "worker 1's share to shrink")
        per_step = run.table.steps().groupby("step")["samples"].agg(["sum", "count"])
        assert (per_step[per_step["count"] == 2]["sum"] == 32).all(), "every step trains the whole global batch"
        assert not run.events(kinds.SWITCHED) and run.settings["balance"] is True  # a live setting, no switch
        # A teammate pins it from the dashboard (a control request): auto is off and says so; a switch
        # by hand afterwards changes the strategy and nothing of auto.
        workbench.cluster.announcements.send_control_request(client, run.run_id, "pin", "teammate")
        pinned = _wait_for_kind(run, kinds.AUTO_PINNED, timeout_s=30)
        assert pinned[0]["why"] == "pinned by hand" and not run.auto_pilot.on
        answered = _wait_for_kind(run, kinds.CONTROL_REQUEST, timeout_s=30)
        assert answered[0]["action"] == "pin" and answered[0]["ok"] and answered[0]["by"] == "teammate"
        assert pinned[0]["strategy"] == "allreduce"
        run.switch("average", period=4)
        assert len(run.events(kinds.AUTO_PINNED)) == 1 and run.strategy == "average"
        # The teammate turns auto on again (the dashboard's strategy list has 'auto'): it judges afresh
        # from 'average' and, the straggler still there, cuts its batches by speed there too.
        workbench.cluster.announcements.send_control_request(client, run.run_id, "switch", "teammate", strategy="auto",
                                                settings={})
        on = _wait_for_kind(run, kinds.AUTO_ON, timeout_s=30)
        assert on[0]["strategy"] == "average" and run.auto_pilot.on
        run._wait_for(lambda: len(run.events(kinds.AUTO_DECISION)) == 2, 60, "a second decision")
        again = run.events(kinds.AUTO_DECISION)[1]
        assert (again["from"], again["to"], again["settings"]) == ("average", "average", {"balance": True})
        assert again["time"] > on[0]["time"]
    finally:
        run.stop()
        run.wait(120)
    assert run.status == "stopped" and len(run.events(kinds.AUTO_DECISION)) == 2


def _wait_for_kind(run, kind, timeout_s):
    run._wait_for(lambda: bool(run.events(kind)), timeout_s, f"a '{kind}' record")
    return run.events(kind)


def _share_of(run, worker, since):
    """The samples `worker` took in its latest step after `since` (its part of the global batch of 32)."""
    steps = run.table.steps()
    mine = steps[(steps["worker"] == worker) & (steps["time"] > since)]
    return int(mine["samples"].iloc[-1]) if len(mine) else 16
