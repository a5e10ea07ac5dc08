"""The lab benchmarks' throughput window (`benchmarks/network.py`'s `window_steps`, used by the network and
simulator benchmarks): a worker that trains in bursts between long exchanges is measured over whole
exchange cycles, so its rate does not depend on where the window's ends fell. Pure: synthetic records."""
from __future__ import annotations

import pandas as pd
import pytest
from helpers import load_benchmark

CYCLE, QUICK_S, EXCHANGE_S = 4, 0.01, 0.5


def bursty_records(cycles: int = 12) -> pd.DataFrame:
    # Three quick steps, then one whose record ends after a long exchange: one cycle every 0.53 s.
    rows, now = [], 100.0
    for step in range(cycles * CYCLE):
        now += EXCHANGE_S if step % CYCLE == CYCLE - 1 else QUICK_S
        rows.append({"worker": 0, "step": step, "time": now, "samples": 128, "compute_s": QUICK_S,
                     "comm_s": 0.0, "wait_s": 0.0})
    return pd.DataFrame(rows)


def test_a_bursty_worker_is_measured_over_whole_cycles_wherever_the_window_falls():
    network = load_benchmark("network")
    frame = bursty_records()
    true_rate = CYCLE * 128 / (3 * QUICK_S + EXCHANGE_S)
    whole, steps_only = [], []
    for offset in (0.0, 0.005, 0.015, 0.1, 0.3, 0.52):
        for length in (1.3, 1.6, 1.85):  # 2.5 to 3.5 cycles
            started = 100.6 + offset
            whole.append(network.window_steps(frame, started, started + length, CYCLE)[0][0])
            steps_only.append(network.window_steps(frame, started, started + length)[0][0])
    assert whole == pytest.approx([true_rate] * len(whole), rel=1e-9)
    # Whole steps only (the rule before): 14-24% low here, by where the ends fell.
    assert all(rate < 0.9 * true_rate for rate in steps_only)


def test_the_records_counted_are_the_span_after_its_first_step():
    network = load_benchmark("network")
    frame = bursty_records()
    rates, inside = network.window_steps(frame, 101.0, 102.5, CYCLE)
    assert len(inside) % CYCLE == 0  # whole cycles
    assert rates[0] == pytest.approx(len(inside) * 128 / (inside["time"].max() - frame[frame["time"] <= 101.0]["time"].max()))
