"""The per-host metrics relay (workbench/plane/relay.py) on the session cluster: a rank's messages through
a relay on another worker arrive as `batches` messages in order, with none lost, and straight from the rank
when the relay cannot be reached; a run large enough to relay trains with every record kept (which rank
relays for which: tests/unit/test_metrics_relay.py); a record the run's client publishes right after
subscribing to its topic is kept, once."""
from __future__ import annotations

import sys

import cloudpickle
import dask
import pytest
from distributed import Client

import workbench
from workbench.plane import kinds
from workbench.plane import relay as metrics_relay
from workbench.plane.metrics import messages_in, topic

from helpers import wait_until

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _send_through(relay: str, topic_name: str, count: int) -> bool:
    from distributed import get_worker

    sender = metrics_relay.RelaySender(get_worker(), topic_name, relay)
    for step in range(count):
        sender({"kind": kinds.STEPS, "rank": 7, "records": [{"worker": 7, "step": step, "time": 0.0}]})
    return sender.close(30)


def _log_from_a_worker(topic_name: str, message: dict) -> bool:
    from distributed import get_worker

    get_worker().log_event(topic_name, message)
    return True


def _install(dask_worker) -> None:
    metrics_relay.install(dask_worker, 0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reachable", [True, False], ids=["through-the-relay", "relay-unreachable"])
def test_a_ranks_messages_arrive_in_order_and_all_through_the_relay_or_straight(client, reachable):
    relay, sender = sorted(client.scheduler_info(n_workers=-1)["workers"])[:2]
    if reachable:
        client.run(_install, workers=[relay])
    else:
        relay = "tcp://127.0.0.1:9"  # nothing listens there
    name = f"relay-test-{reachable}"
    arrived = []
    client.subscribe_topic(name, lambda event: arrived.append(event[1]))
    try:
        assert client.submit(_send_through, relay, name, 60, workers=[sender], pure=False).result(60)
        wait_until(lambda: sum(len(m["records"]) for raw in arrived for m in messages_in(raw)) >= 60, timeout_s=30)
    finally:
        client.unsubscribe_topic(name)
    inner = [m for raw in arrived for m in messages_in(raw)]
    assert [r["step"] for m in inner for r in m["records"]] == list(range(60))  # in order, none lost or twice
    assert {m["worker"] for m in inner} == {sender}  # each message says which worker made it
    relayed = [raw for raw in arrived if raw["kind"] == kinds.BATCHES]
    if reachable:
        assert relayed and len(relayed) < len(inner) and all(raw["worker"] == relay for raw in relayed)
    else:
        assert not relayed


@pytest.mark.timeout(180)
def test_a_run_large_enough_to_relay_keeps_every_record(client, run_dir):
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", lr=0.1, momentum=0.9, batch_size=16, epochs=20)
    with dask.config.set({metrics_relay.RELAY_FROM_KEY: 2}):  # the 2 local workers share one host
        run = workbench.train(job, "average", client=client, run_dir=run_dir, period=4)
    arrived = []
    # Its own client: a topic has one handler per client, and the run's client's is the run's feed.
    with Client(client.scheduler.address) as observer:
        observer.subscribe_topic(topic(run.run_id), lambda event: arrived.append(event[1]))
        assert run.wait(timeout=150) == "finished"
        wait_until(lambda: any(m["kind"] == kinds.WORKER_FINISHED for raw in arrived for m in messages_in(raw)))
    # Both ranks' records reached the scheduler in the relay's messages, not their own.
    relayed = {m["rank"] for raw in arrived if raw["kind"] == kinds.BATCHES for m in raw["messages"]}
    assert relayed == {0, 1} and not [raw for raw in arrived if raw["kind"] == kinds.STEPS]
    finished = {e["worker"]: e["steps"] for e in run.events(kinds.WORKER_FINISHED)}
    steps = run.table.steps()
    assert set(finished) == {0, 1}
    for rank, count in finished.items():
        mine = steps[steps["worker"] == rank]["step"]
        assert count > 0 and sorted(mine) == list(range(count)), rank
    assert run.evaluate()["accuracy"] >= 0.9


@pytest.mark.timeout(120)
def test_a_record_published_right_after_subscribing_is_kept_once(client, tmp_path):
    from workbench.plane.metrics import MetricsTable
    from workbench.plane.rundir import RunDirectory, read_metrics
    from workbench.run.feed import RunFeed

    feed = RunFeed(MetricsTable())
    directory = RunDirectory(tmp_path / "run")
    feed.open(client, "published-right-after-subscribing", directory)
    name = topic(feed.run_id)
    # As a run starts: subscribe (on the client's batched stream), then publish at once (a direct call),
    # which may reach the scheduler before the subscription does.
    client.subscribe_topic(name, feed.on_message)
    try:
        feed.publish({"kind": kinds.GENERATION_STARTED, "time": 1.0, "generation": 0, "workers": []})
        # Sent from a task, so after the subscription: heard here, and after the first record's echo
        # when one comes (the scheduler sends this client its events in order).
        finished = {"kind": kinds.WORKER_FINISHED, "rank": 0, "generation": 0, "steps": 0}
        assert client.submit(_log_from_a_worker, name, finished, pure=False).result(60)
        wait_until(lambda: feed.table.events(kinds.WORKER_FINISHED))
    finally:
        client.unsubscribe_topic(name)
        directory.close()
    assert [e["generation"] for e in feed.table.events(kinds.GENERATION_STARTED)] == [0]
    assert [r["kind"] for r in read_metrics(tmp_path / "run")] == [kinds.GENERATION_STARTED, kinds.WORKER_FINISHED]
    # It also went out to every other viewer: the scheduler's log of the topic has it once.
    assert [message["kind"] for _, message in client.get_events(name)] == [kinds.GENERATION_STARTED,
                                                                          kinds.WORKER_FINISHED]
