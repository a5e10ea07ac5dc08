"""`average`: local SGD with synchronous parameter averaging every `period` steps.

Workers train independently between syncs; at a sync all weights (and optionally the optimizer state)
are replaced by their mean. With period 1, plain SGD and equal shards this equals one process training
on the union of the workers' batches. Metrics: steps since the last sync, and at each sync the worker's
relative divergence from the average just before it was overwritten.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from .. import collectives
from ..averaging import flatten, optimizer_state_tensors, relative_divergence, unflatten_into
from ..errors import ConfigError
from .base import Carried, Strategy, StrategySettings, TrainingContext, check_positive_int


@dataclasses.dataclass
class AverageSettings(StrategySettings):
    live = ("period",)

    period: int = 4
    """Steps between parameter averages (1 = every step)."""
    average_optimizer_state: bool = False
    """Also average optimizer state (momentum buffers, Adam moments) at each sync."""

    def validate(self) -> None:
        check_positive_int("period", self.period)
        if not isinstance(self.average_optimizer_state, bool):
            raise ConfigError("average_optimizer_state", self.average_optimizer_state, "True or False")


class Average(Strategy):
    name = "average"
    settings_class = AverageSettings
    uses_process_group = True
    summary = "Synchronous parameter averaging every `period` steps (local SGD). Less traffic, some drift."
    local_weights_drift = True

    def setup(self, context: TrainingContext) -> None:
        collectives.broadcast_tensors(list(context.model.state_dict().values()))
        self.parameters = [p for p in context.model.parameters()]
        # A resumed run keeps its sync points where they were.
        self.steps_since_sync = getattr(self, "restored_steps_since_sync", 0)

    def checkpoint_state(self, context: TrainingContext, together: bool = True) -> tuple[Carried, dict[str, Any]]:
        carried, _ = super().checkpoint_state(context, together)
        return carried, {"steps_since_sync": self.steps_since_sync}

    def restore(self, strategy_state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        self.restored_steps_since_sync = int(strategy_state.get("steps_since_sync", 0))

    def after_step(self, context: TrainingContext, step: int) -> dict[str, Any]:
        self.steps_since_sync += 1
        if self.steps_since_sync < self.settings.period:
            return {"steps_since_sync": self.steps_since_sync}
        started = time.perf_counter()
        divergence = self._synchronise(context)
        return {"comm_s": time.perf_counter() - started, "steps_since_sync": 0, "divergence": divergence}

    def finish(self, context: TrainingContext) -> None:
        if self.steps_since_sync > 0:
            self._synchronise(context)

    def control_alignment(self) -> int:
        # Agree on control at sync points, so a period is not broken up by extra barriers; a very long
        # period would make pause and stop wait for the next sync, so those agree in between.
        return self.settings.period if self.settings.period <= 32 else 1

    def _synchronise(self, context: TrainingContext) -> float:
        local = flatten(self.parameters)
        average = local.clone()
        collectives.all_reduce_mean(average)
        divergence = relative_divergence(local, average)
        unflatten_into(average, [p.data for p in self.parameters])
        if self.settings.average_optimizer_state:
            state = optimizer_state_tensors(context.optimizer)
            if state:
                vector = flatten(state)
                collectives.all_reduce_mean(vector)
                unflatten_into(vector, state)
        self.steps_since_sync = 0
        return divergence
