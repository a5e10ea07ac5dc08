"""Which way a channel's sums cross hosts, plain (gloo's ring) or coded (`comm/coded_sum.py`), from the
figures its group agreed. Pure: no clock and no process group; `connections.SumCutter` times each sum, has
the group agree on the figures every `AGREE_EVERY` uses and asks `WayChoice` for the way of the next ones.

Two figures, because a sum is slow for two reasons and only one of them is the link's:

* the link: the fastest plain sum of the last agreement's uses (the fastest over every rank). A thin link
  makes every sum slow; a host at half a core makes some slow, those that meet its cgroup's throttled
  part of a period. Measured in the lab with one host at half a core on the unlimited link, single timed
  sums of the same 3.7 MB bucket read from 3 ms to 50 ms: a decision taken on one sum (as before) read a
  thin link one time in three and coded on the throttled host, where coding costs what the link saves
  (`allreduce` fell to 0.80 of DDP in that run). Coding is considered only while the fastest sum says the
  link is below `CODE_BELOW_BYTES_PER_S` for a ring's bytes.
* the ways against each other: the median sum of each way over its current stint (up to `STINT_SAMPLES`
  uses). While the link is thin the way with the shorter median is kept; the other is tried again for
  `PROBE_LENGTH` agreements after `PROBE_FIRST` agreements, and after each try that loses twice as late
  (up to `PROBE_MOST`), so a way that keeps losing costs less and less, while a change of link is still
  found.

Every rank holds the same `WayChoice` fed the same agreed figures, so every rank takes the same way for
every sum: a rank coding a sum its peer sums with gloo would hang the group.
"""
from __future__ import annotations

import collections
import math
import statistics

import torch

from workbench.comm.averaging import all_reduce_bytes_sent

# A coded sum of the MLP's 7.45 MB of gradients between two lab hosts (median of 16): 0.86 of gloo's time at
# 100 Mbit/s (0.54 s against 0.62 s), 0.89 at 1 Gbit/s (51 ms against 57 ms), but 38 ms against 8 ms on the
# unlimited link, where coding is the bound: worth it up to about 165 MB/s of a ring's bytes; a margin below.
CODE_BELOW_BYTES_PER_S = 150e6
MIN_CODED_BYTES = 256 * 1024  # smaller sums: the link's latency, not its rate, is what they pay
# Uses of a channel between two agreements. Each agreement is a 3-number sum started beside the channel's
# own (a few tens of microseconds of a 30 ms step on the lab's unlimited link); often, so that a link that
# falls is followed within a few sums: at 20 Mbit/s a sum of the MLP takes 3 s.
AGREE_EVERY = 2
STINT_SAMPLES = 8  # a way's median is of its newest sums since it was last taken up, at most this many
PROBE_FIRST = 8  # agreements on the one way before the other is tried again
PROBE_MOST = 64  # the longest wait, after tries that lost
PROBE_LENGTH = 2  # agreements a try lasts: its median is of the 2-3 sums of its own it has by then


def codable(vector: torch.Tensor, world_size: int) -> bool:
    """Whether a sum of `vector` can go coded at all: float32 on the CPU, contiguous, `MIN_CODED_BYTES` or
    more, with a peer to send to."""
    return (world_size > 1 and vector.dtype == torch.float32 and vector.device.type == "cpu"
            and vector.is_contiguous() and vector.numel() * 4 >= MIN_CODED_BYTES)


def thin(nbytes: int, world_size: int, link_s: float | None, below_bytes_per_s: float | None = None) -> bool:
    """Whether plain sums of `nbytes` whose fastest took `link_s` (None: none timed yet) move a ring's bytes
    at under `below_bytes_per_s` (`CODE_BELOW_BYTES_PER_S`)."""
    limit = CODE_BELOW_BYTES_PER_S if below_bytes_per_s is None else below_bytes_per_s
    return link_s is not None and all_reduce_bytes_sent(nbytes, world_size) < limit * link_s


class SumTimes:
    """One rank's timed sums of a channel, as they end (from any thread), and its vote from them:
    (the fastest plain sum since the last vote, the median plain and the median coded sum of each way's
    current stint), infinity for a figure it has no sum for."""

    def __init__(self) -> None:
        self.fastest_plain = math.inf
        self.stints = {False: collections.deque(maxlen=STINT_SAMPLES), True: collections.deque(maxlen=STINT_SAMPLES)}
        self.stint = 0  # taken up anew at each change of way: a sum of an older stint no longer counts

    def add(self, coded: bool, seconds: float, stint: int) -> None:
        if stint != self.stint:
            return
        self.stints[coded].append(seconds)
        if not coded:
            self.fastest_plain = min(self.fastest_plain, seconds)

    def new_stint(self, coded: bool) -> None:
        self.stint += 1
        self.stints[coded].clear()

    def vote(self) -> list[float]:
        figures = [self.fastest_plain] + [statistics.median(s) if s else math.inf for s in self.stints.values()]
        self.fastest_plain = math.inf
        return figures


class WayChoice:
    """The way of a channel's sums, from the group's agreed figures (`agree`): the same on every rank."""

    def __init__(self, nbytes: int, world_size: int, codable: bool) -> None:
        self.nbytes, self.world_size, self.codable = nbytes, world_size, codable
        self.link_s: float | None = None  # the group's fastest plain sum, from the newest agreement with one
        self.typical: dict[bool, float | None] = {False: None, True: None}  # median sum, per way (coded?)
        self.coding = False
        self.trying = 0  # agreements left in a try of the way the figures do not favour
        self.wait = PROBE_FIRST  # agreements between tries, doubled after each that lost
        self.until_try = PROBE_FIRST

    def agree(self, fastest_plain: float, median_plain: float, median_coded: float) -> bool:
        """Take the group's figures (infinity: none); returns whether the next sums go coded."""
        if not math.isinf(fastest_plain):
            self.link_s = fastest_plain
        for coded, figure in ((False, median_plain), (True, median_coded)):
            if not math.isinf(figure):
                self.typical[coded] = figure
        if not self.codable or not thin(self.nbytes, self.world_size, self.link_s):
            self.coding, self.trying, self.until_try = False, 0, self.wait
            return False
        if self.trying:
            self.trying -= 1
            if self.trying == 0:  # the try is over: kept only if it beat the way it interrupted
                won = self.favoured() == self.coding
                self.wait = PROBE_FIRST if won else min(2 * self.wait, PROBE_MOST)
                self.coding, self.until_try = self.favoured(), self.wait
            return self.coding
        if self.favoured() != self.coding:
            self.coding, self.until_try = self.favoured(), self.wait
            return self.coding
        self.until_try -= 1
        if self.until_try <= 0:
            self.coding, self.trying = not self.coding, PROBE_LENGTH
        return self.coding

    def favoured(self) -> bool:
        """Coded while it has not been timed, or while its sums are the shorter."""
        plain, coded = self.typical[False], self.typical[True]
        return coded is None or (plain is not None and coded < plain)
