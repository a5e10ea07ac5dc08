"""A rank's share of the group's global batch, balanced to the ranks' measured speeds (`balance` of
`allreduce` and `average`).

Each rank times its own compute (from the start of a step to its gradients being ready) per sample, and
what its step costs whatever its share: the rest of the step's own time (`timed`: its whole cycle, less
what its record counts as communication and waiting), the optimizer step and the loop's own work around
the step. On a host under a CPU quota a throttled gap lands in that rest as often as its CPU time says: on
the lab (MLP, batch 256, a host at a fifth of a core) the straggler spent 1.7-2.6 ms a step outside its
compute and exchange, the others 0.3-0.5, and a cut that counted only the optimizer step left the others
waiting 40% of their steps for it. Each is
a trimmed mean over the steps measured (`typical`): one stalled step (a pause of the process, a busy
moment of the machine) would otherwise pull a mean over the few steps of a window, and the cut with it. Not
the median: a host under a CPU quota (a cgroup's, a container's CPU limit) runs its steps in bursts, some
whole within its quota and some across a throttled gap, and the median of such steps is one mode or the
other from window to window. On the lab (MLP, a host at a fifth of a core over 10 ms periods) its share
went 256, 303, 190, 215, 149, 200 from cut to cut, where the others waited for it throughout.
A step's compute is not all per sample: a small model's forward and backward pay a cost per step whatever
the batch (measured, MLP 64-256-256 on one thread: 0.47 ms at 4 samples, 0.71 ms at 32). A cut in
proportion to samples per second would read the rank with the smaller share as slower per sample than it
is, and keep its share small: on the lab (`average` p64, cut at its syncs) a host given its CPU back took
550 steps to take 80% of its part again. So each rank fits its compute time as a part per step and a part
per sample from two measurements at shares far enough apart (`fitted_per_step`), and sends that part per
step as fixed time. A fit needs both measurements at one speed of the host, which a change of speed
breaks: a host given its CPU back at a small share read against its slow measurements, and the cut fell
back to samples per second (on CI, 623 steps to 80% of its part). But a faster or slower CPU scales both
parts alike, so the part per step counted in samples (`per_step_samples`) outlives the change: each rank
keeps the median of its last fits of it, and its newest measurement alone gives its speed
(`compute_model`).
Once `every` steps are measured, at a point the strategy chooses (`allreduce`: any step; `average`: a sync)
the ranks share those measurements, and each computes the same new cut of the global batch
(`sharding.balanced_shares`): a worker twice as fast takes about twice the samples, so the ranks' steps
end together and no one waits for a straggler. What each rank sends is weighted by its samples (`weight`):
under `allreduce` each update is the one a single process would make on the same global batch.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from workbench.sharding import balanced_shares, share_range

# Half a step toward the measured proportions at each rebalance after the first: measurements on a busy
# machine are noisy, and a full step on each noisy window would swing the shares back and forth. The first
# takes the whole step: equal shares say nothing, and on the lab (GPT, a host at a quarter of a core) half
# steps from them took five measurements, 50 steps of 0.3-0.6 s, to come near the speeds.
REBALANCE_STEP = 0.5
# The first cut comes after this many steps measured, whatever `every`: equal shares keep the fast workers
# waiting at every step, and `auto`, which turned balance on, judges the next windows by whether the steps
# came even (on the lab, GPT, a host at a quarter of a core: 10 steps of 0.7 s were 7 s, and `auto` had
# left for easgd before the first cut).
FIRST_CUT_STEPS = 3
# Two measurements fit a part per step only at shares this far apart (of the larger): closer, a few percent
# of noise in a median step time swings the fitted slope by more than its size.
FIT_SPREAD = 0.2
TRIM = 0.1  # of the steps measured, left out at each end of the sorted times (`typical`), one at least from 5 steps
KEPT = 4  # measurements kept per rank for the fit, and fits for their median: the newest and the ones before


def typical(seconds: list[float]) -> float:
    """What a step takes, from the steps measured: their mean with the TRIM shortest and longest left out
    (one each from 5 steps on); the median of fewer."""
    if len(seconds) < 5:
        return statistics.median(seconds)
    cut = max(1, int(len(seconds) * TRIM))
    return statistics.fmean(sorted(seconds)[cut:-cut])


def fitted_per_step(points: list[tuple[int, float]]) -> float | None:
    """A step's part that no share changes, counted in samples of the same step (seconds a step whatever
    the share over seconds a sample), from a rank's measurements (share, `typical` compute seconds a step),
    oldest first: the newest with the latest one at a share FIT_SPREAD apart give a line. None where there
    is no such pair, or the line says that more samples take no longer or that a step takes less than
    nothing (the speed changed between the two, or noise)."""
    share, seconds = points[-1]
    for old_share, old_seconds in reversed(points[:-1]):
        if abs(share - old_share) >= FIT_SPREAD * max(share, old_share):
            per_sample = (seconds - old_seconds) / (share - old_share)
            fixed = seconds - per_sample * share
            return fixed / per_sample if per_sample > 0 and fixed >= 0 else None
    return None


def compute_model(share: int, seconds: float, per_step_samples: float) -> tuple[float, float]:
    """A rank's compute speed from its newest measurement (`share` samples in a `typical` `seconds` a step) and
    the part of a step no share changes, in samples (`fitted_per_step`; 0 where none is known): (samples
    per second, seconds a step whatever the share)."""
    per_sample = seconds / (per_step_samples + share)
    return 1.0 / per_sample, per_step_samples * per_sample


class BatchBalance:
    """One rank's view of the cut: the shares (samples per rank, in rank order) and its own timing."""

    def __init__(self, rank: int, world_size: int, batch_size: int, every: int) -> None:
        self.rank, self.world_size, self.batch_size, self.every = rank, world_size, batch_size, every
        self.total = batch_size * world_size
        self.shares = [batch_size] * world_size
        self._started: float | None = None
        self._compute_s: list[float] = []  # each step's compute measured since the last rebalance, at this share
        self._points: list[tuple[int, float]] = []  # (share, typical compute) of the last KEPT cuts' measurements
        self._per_step: list[float] = []  # the last KEPT fits of a step's part no share changes, in samples
        self._fixed_s: list[float] = []  # each step's own time beyond its compute (`timed`)
        self._last_compute: float | None = None  # the step's compute, until its whole own time is known
        self._steps = 0  # measured since the last rebalance: the same count on every rank, whatever it timed
        self._measured = False  # no rebalance yet: the first takes the whole step
        # The first step after a start (or a reset) is not measured: it pays one-off costs (allocation, the
        # first collectives), and the first cut, taken whole from 3 steps, swung by it (seen in the tests).
        self._warm = False

    def share(self) -> tuple[int, int]:
        """Where this rank's samples lie in the step's global batch; marks the step's start for the timing."""
        self._started = time.perf_counter()
        return share_range(self.shares, self.rank)

    @property
    def weight(self) -> float:
        """This rank's part of the global batch: what its mean gradient counts for in the sum."""
        return self.shares[self.rank] / self.total

    def computed(self) -> None:
        """The step's gradients are ready: its compute time counts toward this rank's speed."""
        if self._started is not None and not self._warm:
            self._warm, self._started = True, None
        elif self._started is not None:
            now = time.perf_counter()
            if now > self._started:
                self._compute_s.append(now - self._started)
                self._last_compute = now - self._started
            self._started = None
            self._steps += 1

    def timed(self, own_s: float) -> None:
        """The measured step's own time (`Strategy.step_timed`): what it took beyond its compute counts as
        this rank's time a step whatever its share."""
        if self._last_compute is not None:
            self._fixed_s.append(max(0.0, own_s - self._last_compute))
            self._last_compute = None

    @property
    def due(self) -> bool:
        """Whether enough steps are measured since the last cut (`every`; FIRST_CUT_STEPS for the first),
        the same on every rank in step."""
        return self._steps >= (self.every if self._measured else min(self.every, FIRST_CUT_STEPS))

    def rebalance(self, comm: Any) -> bool:
        """Share the measurements and cut anew: every rank at the same step. Returns whether the shares
        changed."""
        own = [0.0, 0.0]
        if self._compute_s:
            share, seconds = self.shares[self.rank], typical(self._compute_s)
            self._points = (self._points + [(share, seconds)])[-KEPT:]
            fitted = fitted_per_step(self._points)
            if fitted is not None:
                self._per_step = (self._per_step + [fitted])[-KEPT:]
            rate, per_step = compute_model(share, seconds, statistics.median(self._per_step) if self._per_step else 0.0)
            own = [rate, per_step + (typical(self._fixed_s) if self._fixed_s else 0.0)]
        measured = [(float(rate), float(fixed)) for rate, fixed in comm.all_gather_json(own)]
        self._compute_s, self._fixed_s, self._steps = [], [], 0
        if min(rate for rate, _ in measured) <= 0:  # a rank measured nothing yet (it joined): keep the cut
            return False
        step_size = REBALANCE_STEP if self._measured else 1.0
        shares = balanced_shares([rate for rate, _ in measured], self.total, minimum=1, current=self.shares,
                                 step=step_size, fixed_s=[fixed for _, fixed in measured])
        changed, self.shares, self._measured = shares != self.shares, shares, True
        return changed

    def follow(self, settings: Any) -> None:
        """A live change of the strategy's `balance` or `rebalance_every`, at the step every rank makes it."""
        self.every = settings.rebalance_every
        if not settings.balance:
            self.reset()  # equal parts from the next step

    def reset(self) -> None:
        """Equal shares again (balance turned off): the ranks' parts of the batch as without it."""
        self.shares = [self.batch_size] * self.world_size
        self._compute_s, self._fixed_s, self._points, self._per_step, self._steps = [], [], [], [], 0
        self._started, self._last_compute, self._measured, self._warm = None, None, False, False
