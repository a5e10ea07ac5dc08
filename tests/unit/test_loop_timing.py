"""The loop's accounting of one step, on a scripted clock: what its record counts as compute, communication
and waiting, and the step's own time the strategy is told at the next step's start (`Strategy.step_timed`,
what a balanced cut measures a worker's speed by). A real model and optimizer step; stand-ins only for the
strategy's reports, the control point and the metrics sender."""
from __future__ import annotations

import time
import types

import pytest
import torch

from workbench.worker import loop as loop_module


class _Strategy:
    name = "stand-in"

    def __init__(self) -> None:
        self.timed: list[float] = []

    def batch_share(self, context):
        return None

    def after_backward(self, context):
        return {"comm_s": 0.10}  # the exchange the step blocked on after backward

    def after_step(self, context, step):
        return {"comm_s": 0.05, "wait_s": 0.02, "bytes_sent": 123}  # a rebalance's exchange, a bound's wait

    def step_timed(self, context, own_s):
        self.timed.append(own_s)


class _Shard:
    def __init__(self) -> None:
        self.data = types.SimpleNamespace(batch=lambda indices: (torch.ones(len(indices), 3), torch.zeros(len(indices), 1)))

    def part(self, row, batch_size, share):
        return row[:batch_size]


def _loop(monkeypatch, clock: list[float]):
    """A `_Loop` without its constructor: the parts `_train_step` and `_time_last_step` use, on `clock`."""
    readings = iter(clock)
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(
        perf_counter=lambda: next(readings), time=time.time, process_time=time.process_time))
    loop = loop_module._Loop.__new__(loop_module._Loop)
    model = torch.nn.Linear(3, 1)
    job = types.SimpleNamespace(batch_size=4, precision="float32")
    loop.task = types.SimpleNamespace(job=job, rank=0, step_delay_s=0.0, sample_delay_s=0.0)
    loop.strategy, loop.forward, loop.step, loop.recent_step_s = _Strategy(), model, 0, 0.0
    loop._cpu_mark, loop._last_cycle = time.process_time(), None
    records, events = [], []
    loop.sender = types.SimpleNamespace(record=records.append, event=lambda kind, **fields: events.append(fields))
    loop.control = types.SimpleNamespace(take_settled_s=lambda: 0.03)  # waited at the control point, for an exchange
    loop.apply_lr = lambda: None
    context = types.SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return loop, context, records, events


def test_a_steps_record_splits_its_time_and_the_strategy_is_told_its_own_time_at_the_next_start(monkeypatch):
    # The step starts at 100.0 after 0.05 s at its control point (0.03 of it an exchange's settling) and
    # ends at 100.4: 0.15 s of exchange and 0.02 s of a strategy's wait are reported by the strategy.
    loop, context, records, _ = _loop(monkeypatch, clock=[100.0, 100.4])
    loop._train_step(context, torch.nn.functional.mse_loss, _Shard(), torch.arange(8), 0, 0.05, torch.device("cpu"))
    [record] = records
    assert record["compute_s"] == pytest.approx(0.4 - 0.15 - 0.02)
    assert record["comm_s"] == pytest.approx(0.15 + 0.03)  # the settling counts as communication
    assert record["wait_s"] == pytest.approx(0.05 - 0.03 + 0.02)  # and not also as waiting
    assert record["settled_s"] == 0.03  # and is told apart: not hidden, though the exchange ended before the sync
    assert record["bytes_sent"] == 123 and record["samples"] == 4
    assert loop.step == 1 and loop.strategy.timed == []  # not told before its whole cycle is known

    # The next step starts at 100.5: the cycle ran from its control point (99.95) to here, 0.55 s, of which
    # 0.18 communication and 0.04 waiting; the 0.1 s between the record and the next start is the step's own.
    loop._time_last_step(context, 100.5)
    assert loop.strategy.timed == [pytest.approx(0.55 - 0.18 - 0.04)]
    loop._time_last_step(context, 101.0)  # once per step: a second start without a step tells nothing
    assert len(loop.strategy.timed) == 1


def test_a_step_followed_by_an_evaluation_is_not_timed(monkeypatch):
    # The step runs 10.0-10.2, rank 0 evaluates 10.3-11.0 (the loop's own `_evaluate`), the next step starts
    # at 11.1: that cycle holds the evaluation, which is no measure of the worker's training speed.
    loop, context, _, events = _loop(monkeypatch, clock=[10.0, 10.2, 10.3, 11.0])
    monkeypatch.setattr(loop_module, "evaluate", lambda model, data, loss_fn, device: {"loss": 0.5})
    loop._train_step(context, torch.nn.functional.mse_loss, _Shard(), torch.arange(8), 0, 0.0, torch.device("cpu"))
    loop._evaluate(loop.forward, None, torch.nn.functional.mse_loss, torch.device("cpu"), 0)
    [event] = events
    assert event["eval_s"] == pytest.approx(0.7) and event["step"] == 1 and event["loss"] == 0.5
    loop._time_last_step(context, 11.1)
    assert loop.strategy.timed == []
