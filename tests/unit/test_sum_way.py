"""Which way a channel's sums go, plain or coded (`comm/sum_way.py`): the eligibility, the link's figure,
each rank's timed sums and the group's choice from the agreed figures, also over many sums simulated with
the cutter's own order of agreeing (`connections.SumCutter.start`). Pure logic, no process group."""
from __future__ import annotations

import math
import random

import torch

from workbench.comm import sum_way
from workbench.comm.averaging import all_reduce_bytes_sent
from workbench.comm.sum_way import AGREE_EVERY, PROBE_FIRST, PROBE_LENGTH, PROBE_MOST, SumTimes, WayChoice

MB4 = 4_000_000  # a ring of two sends 4 MB for a 4 MB sum


def test_only_large_contiguous_float32_cpu_sums_with_a_peer_can_be_coded():
    big = torch.zeros(MB4 // 4)
    assert sum_way.codable(big, 2) and not sum_way.codable(big, 1)
    assert not sum_way.codable(big.double(), 2) and not sum_way.codable(big.bfloat16(), 2)
    assert not sum_way.codable(torch.zeros(sum_way.MIN_CODED_BYTES // 4 - 1), 2)
    assert sum_way.codable(torch.zeros(sum_way.MIN_CODED_BYTES // 4), 2)
    assert not sum_way.codable(torch.zeros(2 * MB4 // 4)[::2], 2)  # not contiguous


def test_a_link_is_thin_below_the_rate_for_a_ring_of_bytes():
    assert all_reduce_bytes_sent(MB4, 2) == MB4 and all_reduce_bytes_sent(MB4, 4) == 6_000_000
    assert sum_way.thin(MB4, 2, 0.6)  # 100 Mbit/s: 6.7 MB/s
    assert sum_way.thin(MB4, 2, 0.035)  # 1 Gbit/s: 114 MB/s
    assert not sum_way.thin(MB4, 2, 0.008)  # the lab's unlimited link: 500 MB/s
    assert not sum_way.thin(MB4, 2, None)  # none timed yet
    assert sum_way.thin(MB4, 4, 0.045) and not sum_way.thin(MB4, 4, 0.035)  # 6 MB in a ring of four
    assert not sum_way.thin(MB4, 2, 0.6, below_bytes_per_s=1e6)


def test_a_ranks_vote_is_its_fastest_plain_sum_since_the_last_and_each_ways_median_of_its_stint():
    times = SumTimes()
    assert times.vote() == [math.inf] * 3  # nothing timed
    for seconds in (0.05, 0.004, 0.03):
        times.add(False, seconds, times.stint)
    assert times.vote() == [0.004, 0.03, math.inf]
    times.add(False, 0.02, times.stint)
    assert times.vote() == [0.02, 0.025, math.inf]  # the fastest is of the sums since the last vote
    times.new_stint(True)
    old = times.stint - 1
    times.add(False, 0.001, old)  # a sum of the stint before, ending late: not counted
    times.add(True, 0.5, times.stint)
    times.add(True, 0.7, times.stint)
    assert times.vote() == [math.inf, 0.025, 0.6]
    times.new_stint(False)  # plain taken up anew: its old sums no longer count
    assert times.vote() == [math.inf, math.inf, 0.6]
    for seconds in range(1, 20):
        times.add(False, float(seconds), times.stint)
    assert times.vote()[1] == statistics_median(range(20 - sum_way.STINT_SAMPLES, 20))  # the newest only


def statistics_median(values):
    values = sorted(values)
    middle = len(values) // 2
    return float(values[middle]) if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def _choice():
    return WayChoice(MB4, 2, codable=True)


def test_a_fast_link_or_an_uncodable_sum_is_never_coded():
    fast, uncodable = _choice(), WayChoice(MB4, 2, codable=False)
    for _ in range(3 * PROBE_MOST):
        assert not fast.agree(0.008, 0.01, 0.005)  # coded sums faster, but the link is not thin
        assert not uncodable.agree(0.6, 0.6, 0.5)


def test_a_thin_link_is_coded_while_coding_is_faster_and_plain_is_tried_again_ever_later():
    choice = _choice()
    assert choice.agree(0.6, 0.62, math.inf)  # thin, coded never timed: try it
    ways = [choice.agree(math.inf, math.inf, 0.54) for _ in range(3 * PROBE_FIRST + 2 * PROBE_LENGTH)]
    # Coded for PROBE_FIRST agreements, plain tried for PROBE_LENGTH; it lost (the plain figure is still
    # 0.62): coded again, and the next try comes twice as late.
    first_try = PROBE_FIRST - 1
    assert ways[:first_try] == [True] * first_try
    assert ways[first_try:first_try + PROBE_LENGTH] == [False] * PROBE_LENGTH
    second_try = first_try + PROBE_LENGTH + 2 * PROBE_FIRST
    assert ways[first_try + PROBE_LENGTH:second_try] == [True] * (2 * PROBE_FIRST)
    assert ways[second_try:] == [False] * PROBE_LENGTH + [True]
    assert choice.wait == 4 * PROBE_FIRST  # lost again: the next try four times as late as the first
    for _ in range(50 * PROBE_MOST):
        choice.agree(math.inf, math.inf, 0.54)
    assert choice.wait == PROBE_MOST  # capped


def test_a_try_that_wins_keeps_its_way_and_a_link_grown_fast_ends_coding():
    choice = _choice()
    choice.agree(0.6, 0.62, math.inf)
    for _ in range(PROBE_FIRST - 1):
        assert choice.agree(math.inf, math.inf, 0.54)
    assert not choice.agree(math.inf, math.inf, 0.54)  # the plain try begins
    # The link grew fast meanwhile: the try's plain sums take 8 ms, coding (38 ms) is the bound now.
    assert not choice.agree(0.008, 0.008, 0.038)
    for _ in range(3 * PROBE_MOST):
        assert not choice.agree(0.008, 0.008, math.inf)


def test_a_link_that_falls_is_coded_at_the_next_agreement():
    choice = _choice()
    for _ in range(5):
        assert not choice.agree(0.008, 0.008, math.inf)
    assert choice.agree(3.1, 3.1, math.inf)


def _simulate(plain_s, coded_s, uses, seed=0):
    """The cutter's order over `uses` sums of one channel: at each use the agreement in flight is read (its
    way for this sum), then every `AGREE_EVERY`-th use votes with what ended before it, then the sum ends
    after `plain_s(random)` or `coded_s(random)` seconds. Returns the share of sums coded."""
    rng, times, choice, pending, coded = random.Random(seed), SumTimes(), _choice(), None, 0
    for use in range(uses):
        if pending is not None:
            before = choice.coding
            if choice.agree(*pending) != before:
                times.new_stint(choice.coding)
            pending = None
        way, stint = choice.coding, times.stint
        coded += way
        if use % AGREE_EVERY == 1:
            pending = times.vote()
        times.add(way, (coded_s if way else plain_s)(rng), stint)
    return coded / uses


def test_a_host_at_half_a_core_is_not_taken_for_a_thin_link():
    # The lab on the unlimited link with one host at half a core: most plain sums of 4 MB take 3-8 ms, one
    # in three meets the throttled part of the host's period and takes 20-50 ms (seen in a lab run); coding
    # there takes 20-80 ms. At most the first try and a few later ones go coded.
    def plain(rng):
        return rng.uniform(0.02, 0.05) if rng.random() < 1 / 3 else rng.uniform(0.003, 0.008)

    for seed in range(5):
        assert _simulate(plain, lambda rng: rng.uniform(0.02, 0.08), 2000, seed) < 0.02


def test_a_thin_link_goes_coded_and_stays_so():
    # 100 Mbit/s: plain sums of 7.45 MB 0.61-0.63 s, coded 0.53-0.55 s.
    share = _simulate(lambda rng: rng.uniform(0.61, 0.63), lambda rng: rng.uniform(0.53, 0.55), 1000)
    assert share > 0.95
    # Where coding is slower on a thin link (a slow CPU at 1 Gbit/s), it stays plain but for its tries.
    share = _simulate(lambda rng: rng.uniform(0.055, 0.06), lambda rng: rng.uniform(0.07, 0.08), 1000)
    assert share < 0.05
