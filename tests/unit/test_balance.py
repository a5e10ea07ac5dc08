"""Unit tests of the balanced cut of a global batch: the shares' arithmetic (`sharding.balanced_shares`),
the global batch every rank's equal part is a slice of, and one rank's timing and agreement
(`strategies/balance.py`) against a stand-in for the ranks' all-gather."""
import statistics
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.sharding import balanced_shares, batches, global_batches, shard_indices, share_range
from workbench.strategies.balance import (FIRST_CUT_STEPS, REBALANCE_STEP, BatchBalance, compute_model, fitted_per_step,
                                         typical)


@given(n=st.integers(1, 400), world=st.integers(1, 6), batch=st.integers(1, 9), epoch=st.integers(0, 3),
       seed=st.integers(0, 100))
@settings(max_examples=60, deadline=None)
def test_a_ranks_equal_part_of_each_global_batch_is_its_batch_from_its_shard(n, world, batch, epoch, seed):
    rows = global_batches(n, world, epoch, seed, batch)
    for rank in range(world):
        own = batches(shard_indices(n, world, rank, epoch, seed), batch)
        assert len(own) == len(rows)
        for row, expected in zip(rows, own):
            assert torch.equal(row[rank * batch : (rank + 1) * batch], expected)
    if rows:
        joined = torch.cat(rows)
        assert len(set(joined.tolist())) == len(joined)  # no sample twice in an epoch


@given(rates=st.lists(st.floats(0.01, 1000.0), min_size=1, max_size=8), per_rank=st.integers(1, 64),
       minimum=st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_shares_sum_to_the_batch_respect_the_minimum_and_follow_the_speeds(rates, per_rank, minimum):
    total = per_rank * len(rates) * minimum
    shares = balanced_shares(rates, total, minimum)
    assert sum(shares) == total and min(shares) >= minimum
    for i in range(len(rates)):
        for j in range(len(rates)):
            if rates[i] > rates[j]:
                assert shares[i] >= shares[j], "a faster rank never gets fewer samples"
    ideal = [total * r / sum(rates) for r in rates]
    unconstrained = all(value >= minimum + 1 for value in ideal)
    if unconstrained:  # rounding moves a share by less than one sample
        assert all(abs(share - value) < 1 for share, value in zip(shares, ideal))


def test_shares_in_proportion_to_speed():
    assert balanced_shares([1.0, 2.0], 48) == [16, 32]
    assert balanced_shares([1.0, 1.0, 1.0], 10) == [4, 3, 3]  # the remainder by rank, the same on every rank
    assert balanced_shares([1.0, 100.0], 48, minimum=4) == [4, 44]


def test_a_half_step_moves_halfway_from_the_current_shares():
    assert balanced_shares([1.0, 3.0], 64, current=[32, 32], step=0.5) == [24, 40]
    assert balanced_shares([1.0, 3.0], 64, current=[16, 48], step=0.5) == [16, 48]  # there already: stays


@pytest.mark.parametrize("rates, total, minimum", [([], 8, 1), ([1.0, 0.0], 8, 1), ([1.0, float("nan")], 8, 1),
                                                   ([1.0, 1.0, 1.0], 5, 2)])
def test_impossible_shares_are_refused(rates, total, minimum):
    with pytest.raises(ValueError):
        balanced_shares(rates, total, minimum)


def test_share_ranges_lay_the_shares_out_in_rank_order():
    assert [share_range([5, 3, 8], rank) for rank in range(3)] == [(0, 5), (5, 8), (8, 16)]


class Gather:
    """The ranks' all-gather, each rank's value given in advance (what the others measured)."""

    def __init__(self, others: dict[int, list[float]], rank: int) -> None:
        self.others, self.rank, self.calls = others, rank, 0

    def all_gather_json(self, value):
        self.calls += 1
        return [value if r == self.rank else self.others[r] for r in range(len(self.others) + 1)]


def test_a_rank_times_its_compute_and_the_ranks_cut_anew_every_few_steps(monkeypatch):
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr("workbench.strategies.balance.time.perf_counter", lambda: next(clock))
    balance = BatchBalance(rank=0, world_size=2, batch_size=16, every=4)
    comm = Gather({1: [16 / 3.0, 0.0]}, rank=0)  # rank 1 took 3 s per 16 samples, no optimizer time

    def step():  # 1 s of compute (the clock ticks a second a call), and 1 s more of the step's own time
        start = balance.share()
        balance.computed()
        balance.timed(2.0)  # the optimizer step, the loop's work: what its cycle held beside compute and exchange
        return start

    for _ in range(3):  # the first step pays one-off costs and is not measured
        assert step() == (0, 16) and balance.weight == 0.5 and not balance.due
    step()
    # The first cut after FIRST_CUT_STEPS (3), later ones after `every` (4).
    assert FIRST_CUT_STEPS == 3 and balance.due and balance.rebalance(comm) and comm.calls == 1
    assert not balance.due
    # Rank 0: 16 samples a second of compute and 1 s a step fixed (its optimizer step); rank 1: 16/3 and
    # none. Equal step times: 1 + b0 / 16 = b1 / (16 / 3), b0 + b1 = 32: b0 = 20, b1 = 12.
    assert balance.shares == [20, 12]
    assert balance.share() == (0, 20) and balance.weight == 20 / 32
    comm.others[1] = [16 / 3.0, 1.0]  # rank 1's optimizer step as long: then in proportion, 24/8
    for _ in range(4):
        step()
    assert balance.due and balance.rebalance(comm) and REBALANCE_STEP == 0.5
    # Rank 0 now computes 20 samples a second (its share, in a tick), rank 1 16/3, both 1 s fixed: equal
    # times at 25.3/6.7; a later cut goes half way there from 20/12.
    assert balance.shares == [23, 9]
    balance.reset()
    assert balance.shares == [16, 16] and not balance.due
    for _ in range(4):
        step()
    assert balance.rebalance(Gather({1: [16 / 3.0, 1.0]}, rank=0))  # after a reset the first cut is whole
    assert balance.shares == [24, 8]


def test_one_stalled_step_does_not_swing_the_cut(monkeypatch):
    now = [0.0]
    monkeypatch.setattr("workbench.strategies.balance.time.perf_counter", lambda: now[0])
    balance = BatchBalance(rank=0, world_size=2, batch_size=16, every=4)
    for compute_s in (1.0, 1.0, 10.0, 1.0):  # the first step is not measured; the third stalled for 9 s
        balance.share()
        now[0] += compute_s
        balance.computed()
        balance.timed(compute_s)  # nothing beyond its compute
    assert balance.due and balance.rebalance(Gather({1: [16 / 3.0, 0.0]}, rank=0))
    # Rank 0's median step: 16 samples a second against rank 1's 16/3, a cut of 24/8 (a mean over the three,
    # 48 samples in 12 s, would have cut 14/18, the fast rank taking the smaller share).
    assert balance.shares == [24, 8]


def test_steps_in_bursts_under_a_cpu_quota_read_as_their_mean_and_a_lone_stall_is_left_out():
    # A host under a CPU quota: some steps whole within it (1 s here), some across a throttled gap (10 s).
    # Five of eleven throttled in one window, six in the next: the median is one mode, then the other.
    first, second = [1.0] * 6 + [10.0] * 5, [1.0] * 5 + [10.0] * 6
    assert (statistics.median(first), statistics.median(second)) == (1.0, 10.0)
    # Trimmed (the shortest and the longest left out), each window reads near its mean (4.6 and 5.9 s).
    assert typical(first) == pytest.approx(45 / 9) and typical(second) == pytest.approx(54 / 9)
    assert typical([1.0] * 9 + [10.0]) == 1.0  # one stalled step in ten does not count
    assert typical([1.0, 10.0, 1.0]) == 1.0  # fewer than five: the median
    assert typical([2.0, 1.0, 3.0, 5.0, 4.0]) == pytest.approx(3.0)


def test_what_a_step_takes_beyond_its_compute_counts_whatever_the_share(monkeypatch):
    # Two ranks computing alike (16 samples a second); rank 1's host loses 1 s a step outside its compute (a
    # throttled gap in the loop's own work, its optimizer step), which no share shrinks. Its own time tells
    # it (`timed`), and the cut gives it less: equal steps at 1 + b1 / 16 = b0 / 16, b0 + b1 = 32.
    now = [0.0]
    monkeypatch.setattr("workbench.strategies.balance.time.perf_counter", lambda: now[0])
    balance = BatchBalance(rank=1, world_size=2, batch_size=16, every=4)
    for _ in range(4):  # the first is not measured
        balance.share()
        now[0] += 1.0
        balance.computed()
        balance.timed(2.0)
    balance.timed(5.0)  # told twice for one step (no compute measured since): nothing more counts
    assert balance.due and balance.rebalance(Gather({0: [16.0, 0.0]}, rank=1))
    assert balance.shares == [24, 8]


def test_a_rank_that_measured_nothing_keeps_the_cut():
    balance = BatchBalance(rank=0, world_size=2, batch_size=8, every=1)
    assert not balance.rebalance(Gather({1: [10.0, 0.0]}, rank=0))
    assert balance.shares == [8, 8]


def test_shares_even_the_step_times_when_a_part_of_the_step_is_fixed():
    # A fast rank (190 samples/s) and one at a quarter of its speed with a slower optimizer step too.
    assert balanced_shares([190.0, 45.0], 64) == [52, 12]
    assert balanced_shares([190.0, 45.0], 64, fixed_s=[0.01, 0.04]) == [53, 11]
    # A rank whose fixed time alone outlasts the others' whole step keeps the minimum.
    assert balanced_shares([100.0, 100.0], 64, minimum=2, fixed_s=[0.0, 1.0]) == [62, 2]
    with pytest.raises(ValueError):
        balanced_shares([1.0, 1.0], 8, fixed_s=[0.0])


def test_a_ranks_compute_is_fitted_as_a_part_per_step_and_a_part_per_sample():
    # 0.43 ms a step and 8.5 us a sample (the MLP 64-256-256 on one thread, measured: 0.47 ms at 4 samples,
    # 0.71 ms at 32): two measurements at shares far enough apart give the part per step, 50.6 samples' worth.
    per_step = fitted_per_step([(32, 0.43e-3 + 32 * 8.5e-6), (16, 0.43e-3 + 16 * 8.5e-6)])
    assert per_step == pytest.approx(0.43e-3 / 8.5e-6)
    rate, fixed = compute_model(16, 0.43e-3 + 16 * 8.5e-6, per_step)
    assert rate == pytest.approx(1 / 8.5e-6) and fixed == pytest.approx(0.43e-3)
    # The newest measurement is paired with the latest one far enough from it (30 is too close to 32).
    assert fitted_per_step([(16, 0.566e-3), (30, 9.0), (32, 0.702e-3)]) == pytest.approx(0.43e-3 / 8.5e-6)
    # No pair far enough apart, more samples taking no longer, or a step under nothing (the speed changed
    # between the two): no fit.
    assert fitted_per_step([(32, 0.7e-3)]) is None
    assert fitted_per_step([(30, 0.5e-3), (32, 0.7e-3)]) is None
    assert fitted_per_step([(16, 1.0), (20, 1.0)]) is None
    assert fitted_per_step([(16, 1.4e-3), (24, 0.6e-3)]) is None  # slowed at the smaller share
    assert fitted_per_step([(20, 1.6e-3), (14, 0.55e-3)]) is None  # given its CPU back
    # Nothing fitted: the newest measurement's samples per second, nothing fixed.
    assert compute_model(32, 0.7e-3, 0.0) == (32 / 0.7e-3, 0.0)
    # A CPU 2.5 times faster scales both parts: the part per step in samples still reads the speed right.
    rate, fixed = compute_model(14, (0.43e-3 + 14 * 8.5e-6) / 2.5, per_step)
    assert rate == pytest.approx(2.5 / 8.5e-6) and fixed == pytest.approx(0.43e-3 / 2.5)


class _Pair:
    """Two ranks' all-gather in threads: each rank's call returns once both have given their value."""

    def __init__(self) -> None:
        self.barrier, self.values = threading.Barrier(2, timeout=10), [None, None]

    def comm(self, rank: int):
        pair = self

        class Comm:
            def all_gather_json(self, value):
                pair.values[rank] = value
                pair.barrier.wait()
                gathered = list(pair.values)
                pair.barrier.wait()  # both have read before either writes again
                return gathered

        return Comm()


def _cuts_until_even(monkeypatch, fit: bool, slow_cuts: int = 0, mixed_steps: int = 0) -> int:
    """Two ranks of one speed, 0.43 ms a step and 8.5 us a sample. The second's host was slow (at 0.6 of
    the speed for `slow_cuts` cuts from equal shares, or with no such history its share at the minimum,
    94/2), and is back, the first `mixed_steps` of the first window after still slow: the cuts from then
    until it takes 80% of its equal part again."""
    clock = threading.local()
    monkeypatch.setattr("workbench.strategies.balance.time.perf_counter", lambda: clock.now)
    if not fit:  # the cut before the fit: proportional to samples per second
        monkeypatch.setattr("workbench.strategies.balance.compute_model", lambda share, seconds, per_step: (
            share / seconds, 0.0))
    pair, cuts, every = _Pair(), [None, None], 4

    def rank(r: int) -> None:
        clock.now = 0.0
        balance = BatchBalance(rank=r, world_size=2, batch_size=48, every=every)
        balance._warm = True
        if not slow_cuts:
            balance.shares, balance._measured = [94, 2], True
        for cut in range(1 - slow_cuts, 100):
            for step in range(every if balance._measured else FIRST_CUT_STEPS):
                speed = 0.6 if r == 1 and (cut <= 0 or (cut == 1 and step < mixed_steps)) else 1.0
                balance.share()
                compute_s = (0.43e-3 + 8.5e-6 * balance.shares[r]) / speed
                clock.now += compute_s
                balance.computed()
                balance.timed(compute_s)
            balance.rebalance(pair.comm(r))
            if cut > 0 and balance.shares[1] >= 0.8 * 48:
                cuts[r] = cut
                return

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert cuts[0] == cuts[1] is not None, cuts  # the ranks agree on every cut
    return cuts[0]


def test_a_share_comes_back_within_a_few_cuts_when_its_hosts_speed_does(monkeypatch):
    # Fitted: the first cut is proportional, the next ones fit the step's fixed part (half steps toward it).
    assert _cuts_until_even(monkeypatch, fit=True) <= 4
    # In proportion to samples per second, the rank with the smaller share reads slower than it is: 9 cuts.
    assert _cuts_until_even(monkeypatch, fit=False) >= 8


def test_a_part_per_step_fitted_before_a_change_of_speed_reads_the_speed_after_it(monkeypatch):
    # The slow host's cuts from equal shares fit the part per step; once it is back, its measurements at the
    # new speed fit nothing against the slow ones, and the part in samples fitted before still holds.
    # 2 cuts, with or without slow steps in the first window after; fitting only the newest pair gave 4,
    # as many as samples per second give.
    assert _cuts_until_even(monkeypatch, fit=True, slow_cuts=8) <= 2
    assert _cuts_until_even(monkeypatch, fit=True, slow_cuts=8, mixed_steps=2) <= 2
    assert _cuts_until_even(monkeypatch, fit=False, slow_cuts=8, mixed_steps=2) >= 4
