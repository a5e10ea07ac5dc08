"""Is the run learning? A watch over the training loss that says so while the run trains.

A run can finish without an error and still have learned nothing: asynchronous updates with too much
momentum, a learning rate far too high. `LossWatch` is fed every step record as it arrives and answers
with a warning the first time the loss climbs far above where it started, or when, a good part of the
way into the run, it still sits where it started (for a classifier that starts at chance, at chance).
Pure logic, no I/O: the run publishes what it returns as a `training-warning` record.
"""
from __future__ import annotations

import collections
import math
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
                    f"momentum {defaults['momentum']:g})")
        return "Try a lower learning rate (run.set_lr), or check the data and the loss"
