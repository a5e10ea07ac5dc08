"""`average`: local SGD with synchronous parameter averaging every `period` steps, and its slow-link options.

Workers train independently between syncs; at a sync all weights (and optionally the optimizer state)
are replaced by their mean. With period 1, plain SGD and equal shards this equals one process training
on the union of the workers' batches.

For slow links (arithmetic in `averaging`, tested there without a process group):
- `wire_dtype` fp16/bf16: the change since the last common weights travels in half precision;
- `outer_lr`/`outer_momentum`: DiLoCo's outer optimizer, Nesterov SGD on the averaged change, so that
  long periods still converge (1 and 0 are plain averaging, bit for bit);
- `overlap`: a sync starts the exchange in the background and training goes on; the next sync, one
  period later, waits for it and applies it keeping each worker's progress made meanwhile
  (`averaging.delayed_apply`). `finish`, `carry_out` and checkpoints complete an exchange in flight.

`balance` (live) cuts each local step's global batch by the workers' measured speeds (`strategies/balance.py`,
re-cut at syncs) and weights each worker's change since the global weights by its share of the samples: on
mixed hardware the workers' periods end together, and with period 1 and plain SGD it is still one process
on the global batch.

Every worker's weights are always the common global weights (`global_weights`, equal on all ranks)
plus its own progress not yet averaged; that invariant is what lets overlap be switched on and off
live. Metrics: steps since the last sync; at each sync `bytes_sent` (what a ring all-reduce sends per
worker; the coded bytes when a thin link's sum goes coded, `comm/coded_sum.py`), `comm_s` (what the step paid: the wait plus copying weights in and out), `comm_total_s` (that
plus the rest of the exchange's time: hidden behind training, or waited for at the control point the step
before, `settle`) and the worker's relative divergence
from the average it receives.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from workbench.checks import check_positive_int, check_positive_number
from workbench.comm import sparse_outer
from workbench.comm.averaging import (
    WIRE_DTYPES,
    all_gather_bytes_sent,
    all_reduce_bytes_sent,
    decode_average,
    delayed_apply,
    encode_weights,
    flatten,
    optimizer_state_tensors,
    outer_step,
    relative_divergence,
    unflatten_into,
)
from workbench.errors import ConfigError
from workbench.strategies.balance import BatchBalance
from workbench.strategies.base import Carried, Strategy, StrategySettings, TrainingContext, Traits, check_wire_dtype

# The blocking sync's all-reduce channel (`Transport.start_all_reduce`): apart from `allreduce`'s buckets (0, 1, ...).
SYNC_CHANNEL = 1 << 20


@dataclasses.dataclass
class AverageSettings(StrategySettings):
    live = ("period", "overlap", "wire_dtype", "outer_lr", "outer_momentum", "balance", "rebalance_every")

    period: int = 4
    """Steps between parameter averages (1 = every step)."""
    average_optimizer_state: bool = False
    """Also average optimizer state (momentum buffers, Adam moments) at each sync (always in float32)."""
    overlap: bool = False
    """Exchange in the background while the next period trains; apply the average one period late."""
    wire_dtype: str = "float32"
    """What travels: 'float32' (the weights, exact), 'fp16' or 'bf16' (the change since the last average)."""
    outer_lr: float = 1.0
    """Outer (DiLoCo) learning rate on the averaged change; 1 with outer_momentum 0 is plain averaging."""
    outer_momentum: float = 0.0
    """Outer Nesterov momentum (DiLoCo uses outer_lr 0.7, outer_momentum 0.9 with periods of hundreds)."""
    sparse_density: float | None = None
    """Send only this share of each worker's change, the largest, with error feedback (SparseLoCo: 0.01-0.03);
    None sends it whole."""
    sparse_bits: int = 2
    """Bits per value sent when `sparse_density` is set: 2, 4 or 8."""
    balance: bool = False
    """Share each local step's global batch out by the workers' measured speeds; changes weighted by samples."""
    rebalance_every: int = 10
    """With balance: steps measured before the next sync cuts the batch anew."""

    def validate(self) -> None:
        check_positive_int("period", self.period)
        if not isinstance(self.average_optimizer_state, bool):
            raise ConfigError("average_optimizer_state", self.average_optimizer_state, "True or False")
        if not isinstance(self.overlap, bool):
            raise ConfigError("overlap", self.overlap, "True or False")
        if self.overlap and self.average_optimizer_state:
            # A delayed average of momentum buffers has no clear meaning (unlike weights, they are not
            # "global plus own progress"); averaging them blocking would bring the wait back.
            raise ConfigError("overlap", self.overlap, "False while average_optimizer_state=True",
                              "Turn one of them off")
        check_wire_dtype("wire_dtype", self.wire_dtype)
        check_positive_number("outer_lr", self.outer_lr)
        momentum = self.outer_momentum
        if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
            raise ConfigError("outer_momentum", momentum, "a number in [0, 1), e.g. 0.9 (0 = no momentum)")
        if not isinstance(self.balance, bool):
            raise ConfigError("balance", self.balance, "True or False")
        check_positive_int("rebalance_every", self.rebalance_every)
        if self.sparse_density is not None:
            sparse_outer.check_sparse(self.sparse_density, self.sparse_bits)
            if self.balance:  # its residual is this worker's unsent change, unweighted: the weights would mix
                raise ConfigError("balance", True, "False while sparse_density is set")
            if self.wire_dtype != "float32":
                raise ConfigError("wire_dtype", self.wire_dtype, "'float32' while sparse_density is set",
                                  f"A sparse exchange sends {self.sparse_bits}-bit values already; leave "
                                  "wire_dtype out")
            if self.average_optimizer_state:
                raise ConfigError("average_optimizer_state", True, "False while sparse_density is set",
                                  "A sparse exchange sends the weights' change only")


@dataclasses.dataclass
class _Exchange:
    """One exchange of the workers' weights started at a sync (overlap) and not applied yet."""

    work: Any
    mean: Callable[[], torch.Tensor]  # the workers' mean weights, once `work` completes
    base: torch.Tensor  # the global weights it was encoded against
    snapshot: torch.Tensor  # this worker's weights when it started: the progress since is its own
    launched: float
    finished: float = math.inf  # set from the collective's completion callback
    average: torch.Tensor | None = None  # decoded once waited for

    def note_finished(self, _future: Any) -> None:
        self.finished = time.perf_counter()


class Average(Strategy):
    name = "average"
    settings_class = AverageSettings
    settings: AverageSettings
    traits = Traits(summary="Synchronous parameter averaging every `period` steps (local SGD). Less traffic, "
                            "some drift.",
                    uses_process_group=True, paced_by_slowest=True, local_weights_drift=True,
                    own_optimizer_states=True)

    def __init__(self, settings: AverageSettings) -> None:
        super().__init__(settings)
        self.restored: dict[str, Any] = {}  # what a resumed run's checkpoint kept (`restore`), used by `setup`

    def setup(self, context: TrainingContext) -> None:
        self.comm = context.comm
        self.comm.broadcast_tensors(list(context.model.state_dict().values()))
        self.parameters = [p for p in context.model.parameters()]
        self.world_size = context.world_size
        restored = self.restored
        # A resumed run keeps its sync points where they were, and its outer optimizer's state.
        self.steps_since_sync = int(restored.get("steps_since_sync", 0))
        weights = flatten(self.parameters)
        saved = restored.get("global_weights")
        fits = isinstance(saved, torch.Tensor) and saved.shape == weights.shape
        # Without saved global weights (a checkpoint from before they were kept), the common weights the
        # workers resume from are the base of the next outer step.
        self.global_weights = saved.to(weights.device, copy=True) if fits else weights
        buffer = restored.get("outer_momentum_buffer")
        fits = isinstance(buffer, torch.Tensor) and buffer.shape == weights.shape
        self.outer_buffer = buffer.to(weights.device, copy=True) if fits else None
        self.exchange: _Exchange | None = None
        self.settled_s = 0.0  # waited for an exchange at the control point since the last sync (`settle`)
        # A sparse exchange's encoder: what this worker has not sent yet is its residual.
        density = self.settings.sparse_density
        self.feedback = None if density is None else sparse_outer.OuterFeedback(
            weights.numel(), density, self.settings.sparse_bits, weights.device)
        balanceable = context.global_batches and self.world_size > 1
        self.balance = (BatchBalance(context.rank, self.world_size, context.job.batch_size,
                                     self.settings.rebalance_every) if balanceable else None)

    def restore(self, strategy_state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        self.restored = strategy_state

    def checkpoint_state(self, context: TrainingContext, together: bool = True) -> tuple[Carried, dict[str, Any]]:
        # What the workers would hold once the exchange in flight is applied: waited for here (the wait
        # changes no value), applied at the next sync as planned, so the checkpoint changes no training.
        carried = Strategy.carry_out(self, context)
        global_weights, buffer, in_flight = self.global_weights, self.outer_buffer, self.exchange is not None
        if self.exchange is not None:
            global_weights, buffer = self._outer_step(self._arrived())
            carried.weights = delayed_apply(carried.weights, self.exchange.snapshot, global_weights)
        scale = self._scale()
        if scale is not None:  # balanced: each worker's progress counts for its share of the samples
            carried.weights = global_weights + (carried.weights - global_weights) * scale
        context.comm.all_reduce_mean(carried.weights)
        # On the CPU: the checkpoint travels to the client, which may have no GPU.
        return carried, {"steps_since_sync": self.steps_since_sync,
                         "global_weights": global_weights.to("cpu", copy=True),
                         "outer_momentum_buffer": None if buffer is None else buffer.to("cpu", copy=True),
                         "exchange_in_flight": in_flight}

    def _balancing(self) -> bool:
        return self.balance is not None and self.settings.balance

    def _scale(self) -> float | None:
        """Balanced: what this worker's change counts for in the mean, its share of the samples times the
        workers (the mean divides by them); None: equal shares, plain mean."""
        return self.balance.weight * self.world_size if self._balancing() else None

    def batch_share(self, context: TrainingContext) -> tuple[int, int] | None:
        return self.balance.share() if self._balancing() else None

    def after_backward(self, context: TrainingContext) -> dict[str, Any]:
        if self._balancing():
            self.balance.computed()
        return {}

    def _rebalance(self) -> None:
        """At a sync with nothing in flight on the process group (the exchange just landed, the next not
        started): a new cut once enough steps are measured."""
        if self._balancing() and self.balance.due:
            self.balance.rebalance(self.comm)

    def step_timed(self, context: TrainingContext, own_s: float) -> None:
        if self._balancing():
            self.balance.timed(own_s)

    def after_step(self, context: TrainingContext, step: int) -> dict[str, Any]:
        self.steps_since_sync += 1
        if self.steps_since_sync < self.settings.period:
            return {"steps_since_sync": self.steps_since_sync}
        started = time.perf_counter()
        if self.settings.overlap:
            report = self._overlapped_sync()
        else:
            report = self._synchronise(context)
            self._rebalance()
            report["comm_s"] = time.perf_counter() - started
            # An overlapped exchange waited for at the control point, then applied there (overlap turned
            # off): the step's record counts that wait in its comm_s, so its total has it too.
            report["comm_total_s"] = report["comm_s"] + self.settled_s
        self.settled_s = 0.0
        return {**report, "steps_since_sync": 0}

    def settle(self, context: TrainingContext) -> float:
        # The control point comes one step before a sync (`steps_to_control_point`), which would wait for
        # this exchange anyway: waited for there instead, a switch agreed on lands it at once. On a link
        # where an exchange outlasts its period it is always in flight: a switch waited for the rest of it
        # (1.06-1.16 s at 20 Mbit/s), after the agreement's messages had queued behind part of it.
        # Only there: elsewhere in a period (periods over 32 agree in between) the wait would be new, and
        # would take away the overlap; the control messages queue behind part of the exchange instead.
        if self.exchange is None or self.steps_since_sync < self.settings.period - 1:
            return 0.0
        started = time.perf_counter()
        self.comm.wait(self.exchange.work)  # decoded at the sync, as without a control point before it
        # Up to its end as its completion callback saw it: the step's record then counts it once, as
        # waited for here (comm_s, and on its own as settled_s) or hidden (comm_total_s beyond comm_s).
        waited = max(0.0, min(self.exchange.finished, time.perf_counter()) - started)
        self.settled_s += waited
        return waited

    def finish(self, context: TrainingContext) -> None:
        if self.exchange is not None:
            self._land()
        # Progress not averaged yet (after landing, the progress since it started): the last average is
        # whole. Decided on what every rank shares, so that all ranks make that collective or none. A sparse
        # exchange's residual is not averaged in: it is its error feedback, which plays the outer momentum's
        # part (SparseLoCo), not progress owed (`sparse_outer`).
        if self.steps_since_sync > 0:
            self._synchronise(context, whole=True)

    def common_base(self, context: TrainingContext) -> torch.Tensor | None:
        # The global weights, once the exchange in flight has landed: the next strategy goes on from each
        # worker's own weights over them, without the final average `finish` makes (on a slow link, a
        # model-sized exchange: measured 1.2-2.3 s of a 2.8 s switch to easgd at 20 Mbit/s).
        if self.exchange is not None:
            self._land()
        return self.global_weights

    def close(self) -> None:
        # Nothing to wait for: every normal exit has landed the exchange in `finish`; after a failure the
        # process group goes, and the exchange with it.
        self.exchange = None

    def control_alignment(self) -> int:
        # Agree on control once a period, so a period is not broken up by extra barriers; a very long
        # period would make pause and stop wait for the next sync, so those agree in between.
        return self.settings.period if self.settings.period <= 32 else 1

    def steps_to_control_point(self) -> int:
        # The point is just before the step that ends a period, not just after it: a switch (or a
        # checkpoint) agreed there goes before that step's exchange starts, and `settle` waits there for
        # the one before it, which that step's sync would wait for anyway (just after the sync it would
        # wait for the exchange just started, and overlap would hide nothing).
        if self.control_alignment() == 1:
            return 1
        ahead = self.settings.period - 1 - self.steps_since_sync
        return ahead if ahead > 0 else self.settings.period

    def update_settings(self, changes: dict[str, Any]) -> None:
        # Called at the same step on every worker, at the control point (`settle` has waited for the
        # exchange in flight). Turning overlap off applies that exchange now, so the next sync blocks from
        # the same invariant (global weights plus own progress). A new wire_dtype or outer optimizer
        # applies from the next exchange or landing on.
        super().update_settings(changes)
        if not self.settings.overlap and self.exchange is not None:
            self._land()
        if self.balance is not None:
            self.balance.follow(self.settings)

    # --- the two kinds of sync -----------------------------------------------------------------------

    def _synchronise(self, context: TrainingContext, whole: bool = False) -> dict[str, Any]:
        """Blocking: average now, apply the outer step, every worker continues from the new global weights
        (`whole`: every worker's whole change, never sparse)."""
        local = flatten(self.parameters)
        work, mean, sent = self._encode(local, whole, self._scale(), channel=SYNC_CHANNEL)
        launched = time.perf_counter()
        self.comm.wait(work)
        # The exchange alone, apart from the sync's own copies around it (flatten, encode, the
        # divergence, copying back): what a capacity model needs to tell the wire from the local work.
        exchange_s = time.perf_counter() - launched
        sent = getattr(work, "bytes_sent", sent)  # coded across a thin link: what it sent (`comm/coded_sum.py`)
        average = mean()
        divergence = relative_divergence(local, average)
        self.global_weights, self.outer_buffer = self._outer_step(average)
        unflatten_into(self.global_weights, [p.data for p in self.parameters])
        if self.settings.average_optimizer_state:
            state = optimizer_state_tensors(context.optimizer)
            if state:
                # float32 always: Adam's second moments (1e-10 and less) would flush to zero in fp16.
                vector = flatten(state)
                self.comm.all_reduce_mean(vector)
                unflatten_into(vector, state)
                sent += all_reduce_bytes_sent(vector.numel() * vector.element_size(), self.world_size)
        self.steps_since_sync = 0
        return {"divergence": divergence, "bytes_sent": sent, "exchange_s": exchange_s}

    def _encode(self, weights: torch.Tensor, whole: bool = False, scale: float | None = None,
                channel: int | None = None) -> tuple[Any, Callable[[], torch.Tensor], int]:
        """Start the exchange of this worker's `weights` (flat, kept unchanged until it lands), its change
        times `scale` when balanced: the work, how to read the workers' mean weights once it is done, and
        the bytes each worker sends. `channel`: the blocking sync's (waited for at once), so that a dense
        exchange goes through shared memory when every worker is on one machine."""
        base, world = self.global_weights, self.world_size
        if scale is not None:
            weights = base + (weights - base) * scale
        if self.feedback is None or whole:
            summed = encode_weights(weights, base, WIRE_DTYPES[self.settings.wire_dtype], world)
            work = self.comm.start_all_reduce(summed, channel=channel)
            return (work, lambda: decode_average(summed, base, world),
                    all_reduce_bytes_sent(summed.numel() * summed.element_size(), world))
        density, bits = self.feedback.density, self.feedback.bits
        wire = sparse_outer.to_wire(self.feedback.encode(weights - base))
        work, parts = self.comm.start_all_gather(wire)
        # Every rank adds the same packets in rank order: the same mean on every worker, bit for bit.
        return (work, lambda: base + sparse_outer.mean_of_wires(parts, base.numel(), density, bits),
                all_gather_bytes_sent(wire.numel(), world))

    def _overlapped_sync(self) -> dict[str, Any]:
        """Apply the exchange started one period ago (waiting only if it is still running), start the next."""
        started = time.perf_counter()
        report: dict[str, Any] = {}
        hidden, weights = 0.0, None
        if self.exchange is not None:
            hidden = max(0.0, min(self.exchange.finished, started) - self.exchange.launched)
            if self.exchange.finished <= started:  # it ended behind the steps: its own duration, all hidden
                report["exchange_s"] = self.exchange.finished - self.exchange.launched
            report["divergence"], weights = self._land()
        scale = self._scale()  # the period's share, before a new cut changes it
        self._rebalance()
        report["bytes_sent"] = self._start_exchange(flatten(self.parameters) if weights is None else weights, scale)
        self.steps_since_sync = 0
        report["comm_s"] = time.perf_counter() - started
        report["comm_total_s"] = report["comm_s"] + hidden
        return report

    def _start_exchange(self, snapshot: torch.Tensor, scale: float | None) -> int:
        """Start the all-reduce of this worker's weights `snapshot` (flat, kept unchanged until it lands)."""
        work, mean, sent = self._encode(snapshot, scale=scale)
        self.exchange = _Exchange(work, mean, self.global_weights, snapshot, time.perf_counter())
        self.comm.when_done(work, self.exchange.note_finished)
        return sent

    def _arrived(self) -> torch.Tensor:
        """The workers' mean weights of the exchange in flight, waiting for it if it is still running."""
        exchange = self.exchange
        if exchange.average is None:
            self.comm.wait(exchange.work)
            exchange.average = exchange.mean()
        return exchange.average

    def _land(self) -> tuple[float, torch.Tensor]:
        """Apply the exchange in flight: new global weights, and each worker keeps its progress since.
        Returns the divergence of the weights it was started from, and the weights now (flat)."""
        average = self._arrived()
        exchange, self.exchange = self.exchange, None
        assert exchange.base is self.global_weights  # nothing moves the global weights while one is in flight
        divergence = relative_divergence(exchange.snapshot, average)
        self.global_weights, self.outer_buffer = self._outer_step(average)
        local = delayed_apply(flatten(self.parameters), exchange.snapshot, self.global_weights)
        unflatten_into(local, [p.data for p in self.parameters])
        return divergence, local

    def _outer_step(self, average: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return outer_step(self.global_weights, average, self.outer_buffer, self.settings.outer_lr,
                          self.settings.outer_momentum)
