"""The strategy interface: a few hooks the one training loop calls, and the settings each strategy takes.

A strategy decides how workers combine their results. It never owns the loop; it is handed a
`TrainingContext` (model, optimizer, rank) and returns per-step metrics from its hooks.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from workbench.comm.averaging import (
    WIRE_DTYPES,
    flat_optimizer_state,
    flatten,
    load_flat_optimizer_state,
    unflatten_into,
)
from workbench.errors import ConfigError
from workbench.job import make_optimizer


@dataclasses.dataclass
class TrainingContext:
    """What a strategy may touch on a worker."""

    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    timeout_s: float = 60.0  # the most any wait on other workers or services may take
    run_id: str = ""
    addresses: list[str] = dataclasses.field(default_factory=list)  # the run's workers, by rank
    job: Any = None
    # True when a control action (pause, stop, switch) waits to be handled: long waits end early for it.
    interrupted: Callable[[], bool] = lambda: False
    # True once the client has ended this group of workers (a worker was lost): every wait ends at once.
    abandoned: Callable[[], bool] = lambda: False
    # How this rank reaches the others and the run's services (comm/transport.py): passed in, never ambient.
    comm: Any = dataclasses.field(default_factory=lambda: _process_group())
    # Every rank indexes the whole dataset, so a step's global batch can be cut into unequal shares (not
    # so for Dask-array blocks, each worker training on those it holds).
    global_batches: bool = True


@dataclasses.dataclass
class Carried:
    """The training state one strategy hands the next at a live switch: the same on every worker, except
    between two local-SGD strategies, where each worker carries its own (see `common_base`)."""

    weights: torch.Tensor  # flat, in `model.parameters()` order
    optimizer_state: dict[str, Any]  # `averaging.flat_optimizer_state` of the job's optimizer
    # Where each worker carries its own weights: the weights they all agree on, each one's own being
    # these plus its progress since (the same on every worker). None: `weights` are common.
    common: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Traits:
    """What the loop, the control point, checkpoints, switches and the UI need to know of a strategy,
    declared once per class (`Strategy.traits`); none of it changes while a run trains."""

    summary: str = ""  # one line for the UI's strategy lists
    # The ranks meet on torch.distributed: control agreements and checkpoints are taken together.
    uses_process_group: bool = False
    # The ranks go at the slowest one's pace over a run: in step, or held within a bound of it (ssp). What
    # the link or compute allows is then the slowest worker's; otherwise each worker's own, summed.
    paced_by_slowest: bool = False
    # The workers' weights drift apart between synchronisations: a checkpoint takes their mean.
    local_weights_drift: bool = False
    # Each worker steps its own optimizer and the states drift apart (local SGD: `average`, `easgd`). A
    # switch between two such strategies lets each worker keep its own state instead of carrying the
    # mean: that is what it would have gone on with, and the mean is a model-sized exchange (measured:
    # 2.2 s of a 3.4 s switch from average to easgd on a 20 Mbit/s link).
    own_optimizer_states: bool = False
    # The strategy can start with each worker on its own weights over a common base (`Carried.common`),
    # so a switch to it from a strategy that has one skips bringing the workers together (`common_base`).
    takes_own_weights: bool = False
    # The SGD learning rate, momentum and schedule this strategy trains well with by default (the CLI's
    # defaults): what suits synchronous training overshoots under asynchrony (see AsyncSGD).
    suggested_lr: float = 0.1
    suggested_momentum: float = 0.9
    suggested_schedule: str = "constant"


@dataclasses.dataclass
class StrategySettings:
    """Base of each strategy's settings; fields are what users set, and what may change live."""

    # Settings that may change while the run trains (applied at an agreed step on all workers).
    live: ClassVar[tuple[str, ...]] = ()

    def validate(self) -> None:
        """Raise `ConfigError` naming the setting if a value is not allowed."""


class Strategy:
    """Base class with no-op hooks; subclasses register themselves by `name`."""

    name: ClassVar[str]
    settings_class: ClassVar[type[StrategySettings]] = StrategySettings
    traits: ClassVar[Traits] = Traits()
    # Set when the run's group of workers is being ended after a loss: close without waiting on others.
    abandoned: bool = False

    def __init__(self, settings: StrategySettings) -> None:
        self.settings = settings

    @classmethod
    def check_world(cls, settings: StrategySettings, world_size: int) -> None:
        """Client side, before anything starts: refuse settings this number of workers cannot honour."""

    def local_optimizer(self, job: Any, parameters: Any) -> torch.optim.Optimizer:
        """The optimizer each worker steps its own model with (default: the job's)."""
        return make_optimizer(job, parameters)

    def setup(self, context: TrainingContext) -> None:
        """Called once after the model and optimizer exist, before the first step."""

    def batch_share(self, context: TrainingContext) -> tuple[int, int] | None:
        """At the start of each step, before its batch is read: the (start, stop) of this rank's samples in
        the step's global batch (`sharding.global_batches`), or None for its equal part."""
        return None

    def after_backward(self, context: TrainingContext) -> dict[str, Any]:
        """Called between backward and the optimizer step (gradients are ready)."""
        return {}

    def after_step(self, context: TrainingContext, step: int) -> dict[str, Any]:
        """Called after each optimizer step; returns metrics such as `comm_s` to merge into the record."""
        return {}

    def step_timed(self, context: TrainingContext, own_s: float) -> None:
        """After a step, once its whole cycle is known: its own time, the cycle less what its record counts as
        communication and waiting (the control point's, an exchange's). What a balanced cut measures a
        worker's speed by (`strategies/balance.py`); steps followed by an evaluation are not told."""

    def settle(self, context: TrainingContext) -> float:
        """Before the ranks exchange control messages on the process group: wait for whatever this
        strategy has in flight on it (applying nothing), so those small messages do not queue behind it
        on a slow link and whatever they agree on (a switch, a checkpoint) finds nothing left to wait for.
        Returns the seconds waited: communication, which the step's record counts as such."""
        return 0.0

    def finish(self, context: TrainingContext) -> None:
        """Called once after the last step (or before a switch): bring workers to common weights."""

    def common_base(self, context: TrainingContext) -> torch.Tensor | None:
        """Before a switch to a strategy that `Traits.takes_own_weights`, instead of `finish`: the weights every
        worker agrees on, each worker's own being those plus its progress since, with nothing left in
        flight; None where this strategy keeps no such base (the switch then calls `finish`). Collective."""
        return None

    def carry_out(self, context: TrainingContext, own_state: bool = False) -> Carried:
        """After `finish` (or `common_base`), before a switch: the weights and the job optimizer's state to carry over.

        Collective: every rank calls it. Here the workers' own optimizers hold the state; it is averaged
        (equal already under `allreduce`, drifted apart under `average`), or with `own_state` each
        worker's own is kept (see `Traits.own_optimizer_states`).
        """
        state = flat_optimizer_state(context.optimizer)
        if own_state:
            return Carried(flatten(list(context.model.parameters())), state)
        # The ranks' states may differ in shape (one rank saw no gradient for some parameter yet):
        # agree on the layout first, so that every rank makes the same collectives.
        layout = {key: value.numel() if isinstance(value, torch.Tensor) else "scalar" for key, value in state.items()}
        if any(other != layout for other in context.comm.all_gather_json(layout)):
            state = {}  # no common state: the next optimizer starts fresh
        tensors = [value for value in state.values() if isinstance(value, torch.Tensor)]
        if tensors:
            vector = flatten(tensors)
            context.comm.all_reduce_mean(vector)
            unflatten_into(vector, tensors)
        return Carried(flatten(list(context.model.parameters())), state)

    def carry_in(self, context: TrainingContext, carried: Carried) -> None:
        """Before `setup` of the strategy switched to: start from the carried weights and optimizer state."""
        unflatten_into(carried.weights, [p.data for p in context.model.parameters()])
        load_flat_optimizer_state(context.optimizer, carried.optimizer_state)

    def checkpoint_state(self, context: TrainingContext, together: bool = True) -> tuple[Carried, dict[str, Any]]:
        """Changing nothing in training: the common weights (the workers' mean where they drift apart),
        the job optimizer's state (the workers' mean) and the strategy's own state, for a checkpoint.
        Collective when `together` (every rank at one agreed step); else rank 0 alone. Only rank 0's
        result is kept."""
        carried = Strategy.carry_out(self, context)
        if self.traits.local_weights_drift:
            context.comm.all_reduce_mean(carried.weights)
        return carried, {}

    def rank_state(self) -> dict[str, Any]:
        """This worker's own part of a checkpoint (compression residuals, say), kept per rank."""
        return {}

    def restore(self, strategy_state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        """When a run resumes, after `carry_in` and before `setup`: take back what `checkpoint_state` and
        `rank_state` saved (`rank_state` is None when the run resumes on a different number of workers)."""

    def close(self) -> None:
        """Release hooks and buffers; called on every exit path."""

    def follow_timeout(self, timeout_s: float) -> None:
        """The run's timeout in force changed (plane/deadline.py): a strategy that keeps its own copy for
        its waits takes the new one. Collectives take it from the process group."""

    def control_alignment(self) -> int:
        """Control agreements among workers (pause, stop, lr) happen at multiples of this many steps."""
        return 1

    def steps_to_control_point(self) -> int:
        """Steps from this one to the next point on the `control_alignment` grid (1 or more)."""
        return self.control_alignment()

    def update_settings(self, changes: dict[str, Any]) -> None:
        """Apply live setting changes (already validated on the client)."""
        self.settings = dataclasses.replace(self.settings, **changes)


def build_settings(strategy_class: type[Strategy], values: dict[str, Any]) -> StrategySettings:
    """Validated settings for `strategy_class` from user keyword arguments."""
    settings_class = strategy_class.settings_class
    known = {field.name for field in dataclasses.fields(settings_class)}
    unknown = sorted(set(values) - known)
    if unknown:
        allowed = ", ".join(sorted(known)) or "none"
        raise ConfigError(unknown[0], values[unknown[0]], f"a setting of strategy '{strategy_class.name}' ({allowed})")
    settings = settings_class(**values)
    settings.validate()
    return settings


def check_wire_dtype(parameter: str, value: Any) -> None:
    if not isinstance(value, str) or value not in WIRE_DTYPES:
        raise ConfigError(parameter, value, f"one of {list(WIRE_DTYPES)}",
                          "fp16 and bf16 halve the bytes on the wire; float32 is exact")


def _process_group() -> Any:
    from workbench.comm.transport import ProcessGroupTransport

    return ProcessGroupTransport()
