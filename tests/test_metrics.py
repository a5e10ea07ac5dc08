"""Unit tests of the metrics plane's pure parts: batching on workers, expansion, throughput, the table."""
import pandas as pd
import pytest

from workbench.metrics import (MetricsSender, MetricsTable, communication_summary, expand, staleness_summary,
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
        {"worker": 0, "time": 10.0, "bytes_sent": 400, "comm_s": 0.0, "comm_total_s": None, "server_version": None},
        {"worker": 0, "time": 11.0, "bytes_sent": None, "comm_s": 0.1, "comm_total_s": 0.4, "server_version": 4},
        {"worker": 1, "time": 12.0, "bytes_sent": 400, "comm_s": 0.0, "comm_total_s": 0.6, "server_version": 10},
        {"worker": 1, "time": 13.0, "bytes_sent": None, "comm_s": 0.0, "comm_total_s": None, "server_version": None},
    ])
    summary = communication_summary(frame)
    assert summary["bytes_sent_per_step"] == 200.0
    assert summary["comm_hidden_fraction"] == pytest.approx(0.9)  # 0.1 s of 1.0 s exposed
    assert summary["server_versions_per_s"] == pytest.approx(6.0)  # 6 versions in 1 s
    assert communication_summary(pd.DataFrame([{"worker": 0, "time": 1.0, "comm_s": 0.0}])) == {}
