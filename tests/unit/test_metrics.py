"""Unit tests of the metrics plane's pure parts: batching on workers, expansion, throughput, the table."""
import pandas as pd
import pytest

from workbench.plane.metrics import (MetricsSender, MetricsTable, communication_summary, expand, staleness_summary,
                               throughput, time_split)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_sender_batches_steps_by_time_and_flushes_before_events():
    sent, clock = [], FakeClock()
    sender = MetricsSender(sent.append, worker=1, flush_interval_s=0.25, clock=clock)
    sender.record({"step": 0})
    sender.record({"step": 1})
    assert sent == []
    clock.now = 0.3
    sender.record({"step": 2})
    assert sent == [{"kind": "steps", "rank": 1, "records": [{"step": 0}, {"step": 1}, {"step": 2}]}]
    sender.record({"step": 3})
    sender.event("eval", accuracy=0.5)
    assert sent[1]["records"] == [{"step": 3}]
    assert sent[2]["kind"] == "eval" and sent[2]["accuracy"] == 0.5 and sent[2]["rank"] == 1


def test_expand_turns_batches_into_step_records():
    records = expand({"kind": "steps", "rank": 0, "worker": "tcp://w:1", "records": [{"worker": 0, "step": 5}]})
    assert records == [{"kind": "step", "worker": 0, "step": 5}]
    # Dask stamps the worker's address into top-level "worker"; the record keeps the rank there.
    event = expand({"kind": "eval", "rank": 1, "worker": "tcp://w:1", "accuracy": 1.0})
    assert event == [{"kind": "eval", "worker": 1, "address": "tcp://w:1", "accuracy": 1.0}]


def _steps(worker, times, samples=10):
    return [{"kind": "step", "worker": worker, "step": i, "time": t, "samples": samples, "loss": 1.0,
             "compute_s": 0.01, "comm_s": 0.005, "wait_s": 0.0} for i, t in enumerate(times)]


def test_throughput_per_worker_and_total():
    records = _steps(0, [0.0, 1.0, 2.0]) + _steps(1, [0.0, 2.0, 4.0])
    rate = throughput(records)
    assert rate["per_worker"] == {0: 10.0, 1: 5.0}
    assert rate["samples_per_s"] == 15.0
    assert rate["steps_per_s"] == (1.0 + 0.5) / 2


def test_table_throughput_window_uses_only_recent_records():
    table = MetricsTable()
    table.add(_steps(0, [0.0, 10.0, 11.0, 12.0]))
    assert table.throughput(window_s=2.0)["per_worker"][0] == 10.0
    assert table.throughput(window_s=None)["per_worker"][0] == 30 / 12


def test_table_keeps_steps_and_events_apart_and_is_bounded():
    table = MetricsTable(max_steps=3)
    table.add(_steps(0, [0.0, 1.0, 2.0, 3.0]) + [{"kind": "eval", "accuracy": 0.9}])
    frame = table.steps()
    assert list(frame["step"]) == [1, 2, 3] and "kind" not in frame
    assert table.steps_received == 4
    assert table.events("eval") == [{"kind": "eval", "accuracy": 0.9}]
    assert table.last_steps()[0]["step"] == 3
    split = time_split(frame)
    assert abs(split["compute"] - 2 / 3) < 1e-9 and abs(split["comm"] - 1 / 3) < 1e-9


def test_staleness_summary_per_worker_with_histogram():
    frame = pd.DataFrame([
        {"worker": 0, "step": 0, "staleness": 0}, {"worker": 0, "step": 1, "staleness": None},
        {"worker": 0, "step": 2, "staleness": 2}, {"worker": 1, "step": 0, "staleness": 1},
        {"worker": 1, "step": 1, "staleness": 1}, {"worker": 1, "step": 2, "staleness": 4},
    ])
    summary = staleness_summary(frame)
    assert summary[0] == {"pushes": 2, "mean": 1.0, "max": 2, "histogram": {0: 1, 2: 1}}
    assert summary[1] == {"pushes": 3, "mean": 2.0, "max": 4, "histogram": {1: 2, 4: 1}}
    assert staleness_summary(pd.DataFrame([{"worker": 0, "step": 0}])) == {}


def test_communication_summary_bytes_hidden_share_and_version_rate():
    frame = pd.DataFrame([
        {"worker": 0, "time": 10.0, "bytes_sent": 400, "comm_s": 0.0, "comm_total_s": None, "server_version": None,
         "bytes_received": None},
        {"worker": 0, "time": 11.0, "bytes_sent": None, "comm_s": 0.1, "comm_total_s": 0.4, "server_version": 4,
         "bytes_received": 1000},
        {"worker": 1, "time": 12.0, "bytes_sent": 400, "comm_s": 0.0, "comm_total_s": 0.6, "server_version": 10,
         "bytes_received": 50},
        {"worker": 1, "time": 13.0, "bytes_sent": None, "comm_s": 0.0, "comm_total_s": None, "server_version": None,
         "bytes_received": None},
    ])
    summary = communication_summary(frame)
    assert summary["bytes_sent_per_step"] == 200.0
    assert summary["bytes_received_per_step"] == 262.5  # 1050 bytes over 4 steps
    assert summary["bytes_per_worker"] == {0: {"sent_per_step": 200.0, "received_per_step": 500.0},
                                           1: {"sent_per_step": 200.0, "received_per_step": 25.0}}
    assert summary["comm_hidden_fraction"] == pytest.approx(0.9)  # 0.1 s of 1.0 s exposed
    assert summary["server_versions_per_s"] == pytest.approx(6.0)  # 6 versions in 1 s
    assert communication_summary(pd.DataFrame([{"worker": 0, "time": 1.0, "comm_s": 0.0}])) == {}


def test_live_view_aggregates_loss_throughput_staleness_and_workers_exactly():
    from workbench.plane.metrics import MetricsTable, control_markers, downsample

    table = MetricsTable()
    table.add([{"kind": "worker-started", "worker": 0, "address": "tcp://a", "time": 100.0},
               {"kind": "worker-started", "worker": 1, "address": "tcp://b", "time": 100.0}])
    records = []
    for step in range(4):
        for worker in (0, 1):
            records.append({"kind": "step", "worker": worker, "step": step, "time": 1000.0 + step, "samples": 8,
                            "loss": float(step + worker), "staleness": worker + step % 2})
    records.append({"kind": "step", "worker": 0, "step": 4, "time": 1004.5, "samples": 8, "loss": 0.0})
    table.add(records)
    table.add([{"kind": "paused", "worker": 1, "step": 4, "time": 1005.0}])
    view = table.live_view()
    assert view["loss"] == {"step": [0, 1, 2, 3, 4], "loss": [0.5, 1.5, 2.5, 3.5, 0.0]}
    # Whole seconds 1000..1003 (1004 is still filling up): 8 samples per worker each.
    assert view["throughput"]["time"] == [0, 1, 2, 3]
    assert view["throughput"]["per_worker"] == {0: [8, 8, 8, 8], 1: [8, 8, 8, 8]}
    assert view["throughput"]["total"] == [16, 16, 16, 16]
    assert view["staleness"]["histogram"] == {0: 2, 1: 4, 2: 2}
    assert view["staleness"]["max"] == 2 and view["staleness"]["recent_mean"] == 1.0
    rows = {row["worker"]: row for row in view["workers"]}
    assert rows[0]["state"] == "running" and rows[0]["step"] == 4 and rows[0]["address"] == "tcp://a"
    assert rows[1]["state"] == "paused" and rows[1]["step"] == 3
    assert downsample([0, 1, 2, 3, 4], [1, 1, 3, 3, 5], 3) == ([0.5, 2.5, 4.0], [1.0, 3.0, 5.0])

    markers = control_markers([
        {"kind": "switched", "worker": 0, "step": 40, "time": 2.0, "from": "async", "to": "average"},
        {"kind": "switched", "worker": 1, "step": 40, "time": 2.0, "from": "async", "to": "average"},
        {"kind": "changed", "worker": 0, "step": 10, "time": 1.0, "lr": 0.02, "settings": {"period": 6}},
        {"kind": "paused", "worker": 0, "step": 50, "time": 3.0},
        {"kind": "eval", "worker": 0, "step": 45, "time": 2.5},
    ])
    assert [(m["step"], m["label"]) for m in markers] == [(10, "lr 0.02, period 6"), (40, "async -> average"),
                                                          (50, "paused")]


def test_a_batches_message_expands_to_every_workers_records_and_its_lifecycle_messages():
    from workbench.plane import kinds
    from workbench.plane.metrics import messages_in

    steps = {"kind": kinds.STEPS, "rank": 3, "records": [{"worker": 3, "step": 7}, {"worker": 3, "step": 8}]}
    ended = {"kind": kinds.WORKER_FINISHED, "rank": 5, "worker": "tcp://w:5", "steps": 9}
    both = {"kind": kinds.BATCHES, "messages": [steps, ended]}
    assert messages_in(both) == [steps, ended] and messages_in(steps) == [steps]
    assert expand(both) == expand(steps) + expand(ended)
    assert [(r["kind"], r["worker"]) for r in expand(both)] == [("step", 3), ("step", 3), (kinds.WORKER_FINISHED, 5)]


def test_the_runs_feed_takes_each_message_a_batches_message_carries(tmp_path):
    from workbench.plane import kinds
    from workbench.run.feed import RunFeed
    from workbench.plane.rundir import RunDirectory, read_metrics

    feed = RunFeed(MetricsTable())
    directory = RunDirectory(tmp_path / "run")
    feed.open(None, "run", directory)
    feed.new_generation(0)
    records = [{"worker": 3, "step": step, "time": 100.0 + step, "loss": 0.5, "samples": 32} for step in (7, 8)]
    steps = {"kind": kinds.STEPS, "rank": 3, "records": records}
    ended = {"kind": kinds.WORKER_FINISHED, "rank": 5, "worker": "tcp://w:5", "steps": 9, "generation": 0}
    feed.on_message((0.0, {"kind": kinds.BATCHES, "messages": [steps, ended]}))
    directory.close()
    assert feed.finished_ranks == {5} and feed.table.steps_received == 2
    assert [(r["kind"], r["worker"]) for r in read_metrics(tmp_path / "run")] == [
        ("step", 3), ("step", 3), (kinds.WORKER_FINISHED, 5)]


class _Scheduler:
    """A client's `log_event` as far as the feed sees it: the echo (msgpack's round trip, as the scheduler
    sends it) comes back when the subscription has reached the scheduler, none before, an error when
    the scheduler cannot be reached."""

    def __init__(self, feed, subscribed=True, reachable=True):
        self.feed, self.subscribed, self.reachable, self.sent = feed, subscribed, reachable, []

    def log_event(self, topic, message):
        import msgpack

        if not self.reachable:
            raise OSError("scheduler unreachable")
        self.sent.append(message)
        if self.subscribed:
            self.feed.on_message((0.0, msgpack.unpackb(msgpack.packb(message))))


@pytest.mark.parametrize("subscribed", [True, False], ids=["echoed", "sent-before-the-subscription"])
def test_a_record_of_the_clients_own_is_kept_once_whether_or_not_its_echo_comes(tmp_path, subscribed):
    from workbench.plane import kinds
    from workbench.plane.rundir import RunDirectory, read_metrics
    from workbench.run.feed import RunFeed

    feed = RunFeed(MetricsTable())
    directory = RunDirectory(tmp_path / "run")
    scheduler = _Scheduler(feed, subscribed=subscribed)
    feed.open(scheduler, "run", directory)
    started = {"kind": kinds.GENERATION_STARTED, "time": 5.0, "generation": 0, "workers": ("a", "b")}
    warning = {"kind": "loss-warning", "time": 6.0, "loss": float("nan")}  # NaN: unequal to itself
    feed.publish(started)
    feed.publish(warning)
    feed.publish(started)  # the same record twice is kept twice
    # Another client's record of the same kind on the topic is not this client's echo.
    other = {"kind": kinds.GENERATION_STARTED, "time": 5.0, "generation": 1, "workers": ["a", "b"]}
    feed.on_message((0.0, other))
    directory.close()
    assert len(scheduler.sent) == 3  # every record also went out to the other viewers
    kept = [(r["kind"], r.get("generation")) for r in read_metrics(tmp_path / "run")]
    assert kept == [(kinds.GENERATION_STARTED, 0), ("loss-warning", None), (kinds.GENERATION_STARTED, 0),
                    (kinds.GENERATION_STARTED, 1)]
    assert [e["generation"] for e in feed.table.events(kinds.GENERATION_STARTED)] == [0, 0, 1]


def test_a_record_of_the_clients_own_is_kept_when_the_scheduler_is_unreachable(tmp_path):
    from workbench.plane.rundir import RunDirectory, read_metrics
    from workbench.run.feed import RunFeed

    feed = RunFeed(MetricsTable())
    directory = RunDirectory(tmp_path / "run")
    feed.open(_Scheduler(feed, reachable=False), "run", directory)
    lost = {"kind": "worker-lost", "time": 1.0, "rank": 1}
    feed.publish(lost)
    # No echo of it will come: the same record heard later (a resumed client's) is not taken for one.
    feed.on_message((0.0, dict(lost)))
    directory.close()
    assert [r["kind"] for r in read_metrics(tmp_path / "run")] == ["worker-lost", "worker-lost"]


def test_a_record_of_the_clients_own_goes_out_in_the_form_the_scheduler_carries():
    import numpy as np
    import torch
    from distributed.client import _is_dumpable

    from workbench.plane.metrics import wire_form

    record = {"kind": "auto-decision", "measured": {"compute_s": {0: np.float64(0.01), 2: 0.02}},
              "workers": (1, 2), "loss": torch.tensor(0.5), "rows": [{3: np.int64(7)}], "reason": None}
    assert not _is_dumpable(record)
    sent = wire_form(record)
    assert _is_dumpable(sent)
    assert sent == {"kind": "auto-decision", "measured": {"compute_s": {"0": 0.01, "2": 0.02}}, "workers": [1, 2],
                    "loss": 0.5, "rows": [{"3": 7}], "reason": None}
    assert type(sent["measured"]["compute_s"]["0"]) is float and type(sent["rows"][0]["3"]) is int
