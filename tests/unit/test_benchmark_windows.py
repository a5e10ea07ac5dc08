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


def test_staleness_is_every_workers_pushes_over_one_interval():
    # A worker beside the server pushes every 0.1 s, each missing nothing but the far worker's pushes; the
    # far worker, behind a slow link, pushes every 1 s and misses the 10 pushes made since its last one.
    # Over an interval that tiles both, the push-weighted mean is 1 (the workers less one).
    network = load_benchmark("network")
    rows, far_pushes = [], [100.0 + k for k in range(1, 12)]
    for k in range(1, 111):
        now = 100.0 + k * 0.1 + 0.05
        missed = sum(1 for t in far_pushes if now - 0.1 < t <= now)
        rows.append({"worker": 0, "step": k, "time": now, "samples": 128, "staleness": missed})
    for k, now in enumerate(far_pushes, 1):
        rows.append({"worker": 1, "step": k, "time": now, "samples": 128, "staleness": 10})
    frame = pd.DataFrame(rows)
    started = 101.0
    rates, inside = network.window_steps(frame, started, 104.1, 1)
    # The far worker's whole-cycle span ends at 105.0, the near one's at 104.15.
    assert inside[inside["worker"] == 1]["time"].max() == 105.0 and inside[inside["worker"] == 0]["time"].max() < 104.2
    # Over (101, 105]: the near worker's 40 pushes, 4 of them missing one far push; the far worker's 4, 10 each.
    assert network.window_staleness(frame, started, inside) == pytest.approx((4 * 1 + 4 * 10) / (40 + 4))
    # Each worker over its own span leaves out the near worker's last 8 pushes: 44 / 36, too high.
    assert inside["staleness"].mean() == pytest.approx((4 * 1 + 4 * 10) / (32 + 4))
    # No pushes, no staleness.
    assert network.window_staleness(frame.drop(columns="staleness"), started, inside) is None


def test_the_window_reads_the_links_limit_as_the_run_does_from_a_frame_with_gaps():
    # Two ssp workers exchanging the 7.45 MB model each way every step in 1.2 s; the frame's NaN where a
    # field is missing counts as nothing.
    network = load_benchmark("network")
    rows = [{"worker": w, "step": s, "time": 100 + 1.27 * s, "samples": 128, "compute_s": 0.07, "comm_s": 0.0,
             "strategy": "ssp", "bytes_sent": 7_450_000.0 if s else float("nan"),
             "bytes_received": 7_450_000.0 if s else float("nan"), "comm_total_s": 1.2 if s else float("nan")}
            for s in range(32) for w in range(2)]
    link = network.window_link(pd.DataFrame(rows), "ssp")
    assert link["bound"] == "link" and link["link_mb_per_s"] == pytest.approx(2 * 7.45 / 1.2)
    assert link["link_samples_per_s"] == pytest.approx(2 * 128 / (1.2 * 31 / 32))  # the first step sent nothing
    assert network.window_link(pd.DataFrame(rows).assign(bytes_sent=float("nan"), bytes_received=float("nan")),
                               "ssp") is None
