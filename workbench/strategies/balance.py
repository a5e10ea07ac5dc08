"""A rank's share of the group's global batch, balanced to the ranks' measured speeds (`balance` of
`allreduce` and `average`).

Each rank times its own compute (from the start of a step to its gradients being ready) per sample, and
what its step costs whatever its share (the optimizer step, from the exchange's end to `after_step`), each
as the median over the steps measured: one stalled step (a pause of the process, a busy moment of the
machine) would otherwise pull a mean over the few steps of a window, and the cut with it.
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


class BatchBalance:
    """One rank's view of the cut: the shares (samples per rank, in rank order) and its own timing."""

    def __init__(self, rank: int, world_size: int, batch_size: int, every: int) -> None:
        self.rank, self.world_size, self.batch_size, self.every = rank, world_size, batch_size, every
        self.total = batch_size * world_size
        self.shares = [batch_size] * world_size
        self._started: float | None = None
        self._rates: list[float] = []  # samples/s of each step's compute measured since the last rebalance
        self._fixed_s: list[float] = []  # each step's optimizer step, from the exchange's end to `after_step`
        self._free_at: float | None = None
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
                self._rates.append(self.shares[self.rank] / (now - self._started))
            self._started, self._free_at = None, now
            self._steps += 1

    def exchanged(self) -> None:
        """The step's exchange is done (under allreduce, after the gradients' all-reduce): the optimizer
        step comes next."""
        if self._free_at is not None:
            self._free_at = time.perf_counter()

    def stepped(self) -> None:
        """At `after_step`: the optimizer has stepped, in a time no share changes."""
        if self._free_at is not None:
            self._fixed_s.append(time.perf_counter() - self._free_at)
            self._free_at = None

    @property
    def due(self) -> bool:
        """Whether enough steps are measured since the last cut (`every`; FIRST_CUT_STEPS for the first),
        the same on every rank in step."""
        return self._steps >= (self.every if self._measured else min(self.every, FIRST_CUT_STEPS))

    def rebalance(self, comm: Any) -> bool:
        """Share the measurements and cut anew: every rank at the same step. Returns whether the shares
        changed."""
        own = ([statistics.median(self._rates), statistics.median(self._fixed_s) if self._fixed_s else 0.0]
               if self._rates else [0.0, 0.0])
        measured = [(float(rate), float(fixed)) for rate, fixed in comm.all_gather_json(own)]
        self._rates, self._fixed_s, self._steps = [], [], 0
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
        self._rates, self._fixed_s, self._steps = [], [], 0
        self._started, self._free_at, self._measured, self._warm = None, None, False, False
