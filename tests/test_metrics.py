"""Unit tests of the metrics plane's pure parts: batching on workers, expansion, throughput, the table."""
from workbench.metrics import MetricsSender, MetricsTable, expand, throughput, time_split


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
