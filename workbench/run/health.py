"""Is the run learning, and is its strategy a good one for its link? Watches over the step records that
say so while the run trains.

A run can finish without an error and still have learned nothing: asynchronous updates with too much
momentum, a learning rate far too high. `LossWatch` is fed every step record as it arrives and answers
with a warning the first time the loss climbs far above where it started, or when, a good part of the
way into the run, it still sits where it started (for a classifier that starts at chance, at chance).
`LinkWatch` answers once when a parameter-server strategy trains slower than `allreduce` would on the
same link and machines (seen: `ssp` with its defaults at 209 samples/s where `allreduce` made 383, at
100 Mbit/s, issue 46). Pure logic, no I/O: the run publishes what they return as `training-warning`s.
"""
from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

from workbench.plane import kinds
from workbench.strategies import suggested_sgd

CLIMB_FACTOR = 2.0  # a recent loss this many times the starting loss ...
CLIMB_MARGIN = 0.5  # ... and at least this much above it (small losses are noisy in ratio) is climbing
STALL_FRACTION = 0.9  # a recent loss above this share of the starting loss has not come down
STALL_AFTER_FRACTION = 0.25  # judged only after this share of the run's steps ...
STALL_AFTER_STEPS = 50  # ... and at least this many steps


class LossWatch:
    """Feed it step records (`observe`); it returns each kind of warning once, as a record to publish."""

    def __init__(self, total_steps: int, first_step: int = 0, window: int = 40, strategy: str = "",
                 momentum: float = 0.0) -> None:
        self.total_steps = total_steps
        self.first_step = first_step
        self.strategy = strategy
        self.momentum = momentum
        self._start: list[float] = []  # losses of the first step seen, every worker: the baseline
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self.raised: set[str] = set()

    @property
    def baseline(self) -> float | None:
        return sum(self._start) / len(self._start) if self._start else None

    def observe(self, record: dict[str, Any]) -> dict[str, Any] | None:
        loss, step = record.get("loss"), record.get("step")
        if loss is None or step is None or not math.isfinite(loss):
            return None  # non-finite losses end the run on the worker (DivergenceError)
        if step <= self.first_step:
            self._start.append(loss)
            return None
        self._recent.append(loss)
        baseline = self.baseline
        if baseline is None or len(self._recent) < self._recent.maxlen:
            return None
        recent = sum(self._recent) / len(self._recent)
        strategy = record.get("strategy") or self.strategy  # the one training now (a switch may have changed it)
        if "loss-climbing" not in self.raised and recent > max(CLIMB_FACTOR * baseline, baseline + CLIMB_MARGIN):
            return self._warn("loss-climbing", step, recent, strategy,
                              f"the training loss climbed to {recent:.3g} (mean of the last {len(self._recent)} "
                              f"records) at step {step}, from {baseline:.3g} at the start")
        stall_after = max(STALL_AFTER_STEPS, STALL_AFTER_FRACTION * self.total_steps)
        if "not-learning" not in self.raised and step - self.first_step >= stall_after \
                and recent >= STALL_FRACTION * baseline:
            return self._warn("not-learning", step, recent, strategy,
                              f"the training loss is still {recent:.3g} at step {step}, where it started "
                              f"({baseline:.3g}): the run is not learning")
        return None

    def _warn(self, reason: str, step: int, recent: float, strategy: str, what: str) -> dict[str, Any]:
        self.raised.add(reason)
        named = f"under {strategy}, {what}" if strategy else what[:1].upper() + what[1:]
        return {"kind": kinds.TRAINING_WARNING, "reason": reason, "step": step, "loss": recent, "baseline": self.baseline,
                "strategy": strategy, "message": f"{named}. {self.hint()}"}

    def hint(self) -> str:
        """What usually helps, for this strategy."""
        if self.strategy in ("async", "ssp") and self.momentum > 0.7:
            defaults = suggested_sgd(self.strategy)
            return (f"Under {self.strategy}, stale updates act like extra momentum: try momentum 0-0.4 and a "
                    f"lower learning rate (run.set_lr), or this strategy's defaults (lr {defaults['lr']:g}, "
                    f"momentum {defaults['momentum']:g}, {defaults['lr_schedule']} schedule)")
        return "Try a lower learning rate (run.set_lr), or check the data and the loss"


SERVER_STRATEGIES = ("async", "ssp", "easgd")
LINK_MIN_RECORDS = 16  # judged once every worker has this many under the strategy
LINK_MIN_MODEL_BYTES = 1 << 20  # below this an exchange's time is its latency, not the link's rate
SLOWER_THAN = 0.8  # warn below this share of what allreduce would make
LINK_JUDGE_EVERY_S = 1.0  # judged at most this often (seconds of run time)


def allreduce_estimate(compute_s: list[float], batch: int, model_bytes: int, link_bytes_per_s: float) -> float:
    """Samples/s `allreduce` would make: every worker waits for the slowest's compute, then a ring
    all-reduce of the dense gradient, which sends and receives 2(n-1)/n of it on each worker's link (no
    overlap counted: DDP-style buckets would only make it faster)."""
    workers = len(compute_s)
    exchange_s = 2 * (workers - 1) / workers * model_bytes / link_bytes_per_s
    return workers * batch / (max(compute_s) + exchange_s)


class LinkWatch:
    """Fed every step record after the run's metrics table took it (`observe`); under a parameter-server
    strategy it returns, once per strategy, a warning when `allreduce` would train faster on the link the
    run measured.

    The link is the table's reading (`limit(min_records)`, `plane/link.py`: the one the summary and the
    live views show), from the strategy's own exchanges: a round trip (`comm_total_s`) moves the push
    (`bytes_sent`) and the reply (`bytes_received`) one after the other; each worker's fastest round trip
    reads its link (the others waited longer in the queue of a shard that serves every worker). The
    slowest worker's link counts (a ring all-reduce goes at its pace; a worker beside the server's shard
    exchanges over loopback). The server's time still counts as link time, so the estimate of `allreduce`
    errs low: a warning is earned."""

    def __init__(self, model_bytes: int, batch: int, limit: Callable[[int], dict[str, Any] | None]) -> None:
        self.model_bytes, self.batch, self.limit = model_bytes, batch, limit
        self._strategy: str | None = None
        self._judged_at = float("-inf")
        self.raised: set[str] = set()

    def observe(self, record: dict[str, Any]) -> dict[str, Any] | None:
        strategy = record.get("strategy")
        if self.model_bytes < LINK_MIN_MODEL_BYTES:
            return None
        if strategy != self._strategy:  # a switch: judge the new strategy on its own records
            self._strategy, self._judged_at = strategy, float("-inf")
        if strategy not in SERVER_STRATEGIES or strategy in self.raised:
            return None
        # Judged at most once a second of run time: every step record passes through here, on the client's
        # metrics handler, and a reading goes over every worker's window.
        if record["time"] - self._judged_at < LINK_JUDGE_EVERY_S:
            return None
        reading = self.reading()  # None, and cheap, until every worker has LINK_MIN_RECORDS
        if reading is None:
            return None
        self._judged_at = record["time"]
        if reading["strategy"] != strategy or reading["workers"] < 2:
            return None
        # Only where the link is the bound (an exchange takes longer than a step's compute): on shared cores
        # a server's work slows the workers' compute too, which no choice of link usage changes.
        if reading["exchange_s"] <= reading["compute_s"] \
                or reading["samples_per_s"] >= SLOWER_THAN * reading["allreduce_samples_per_s"]:
            return None
        self.raised.add(strategy)
        every = reading["steps_per_exchange"]
        message = (f"under {strategy}, this run makes {reading['samples_per_s']:,.0f} samples/s where allreduce would "
                   f"make about {reading['allreduce_samples_per_s']:,.0f} on this link (about "
                   f"{reading['link_mb_per_s']:,.1f} MB/s, one exchange of the model every {every:.0f} step"
                   f"{'s' if round(every) != 1 else ''}, {reading['exchange_s']:.2f} s each). Exchange less often "
                   f"(push_every=16), or switch to allreduce or average")
        return {"kind": kinds.TRAINING_WARNING, "reason": "slower-than-allreduce", "step": record["step"],
                "strategy": strategy, "message": message, "measured": reading}

    def reading(self) -> dict[str, Any] | None:
        """What the newest records say: the run's rate, the link's, and what allreduce would make."""
        limit = self.limit(LINK_MIN_RECORDS)
        if limit is None or limit["samples_per_s"] <= 0:
            return None
        estimate = allreduce_estimate(limit["compute_s_per_worker"], self.batch, self.model_bytes,
                                      limit["link_mb_per_s"] * 1e6)
        return {**limit, "allreduce_samples_per_s": estimate}
