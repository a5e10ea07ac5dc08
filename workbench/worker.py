"""The training loop, written once, that every worker runs as one long-lived Dask task.

The loop owns the order of things (control, forward, backward, optimizer step, metrics); the strategy
plugs in through hooks. It leaves the worker's thread pool (`secede`) so the worker stays responsive,
reads control state from an in-memory poller, and sends metrics in batches while it trains.
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import os
import socket
import time
import traceback
from typing import Any

import torch
from distributed import get_client, get_worker, secede
from distributed.comm import get_address_host

from . import kinds
from . import collectives
from .averaging import fingerprint, flatten
from .checkpoint import all_finite, data_position, leave_snapshot
from .control import ControlPoller, ControlState
from .data import DataSource, Shard, concatenate_blocks
from .errors import DivergenceError, TrainingError
from .evaluation import evaluate
from .job import Job, loss_function
from .metrics import MetricsSender, topic
from .strategies import StrategySettings, TrainingContext, get_strategy, make_settings
from .strategies.base import Carried
from .switching import Decision, Position, SwitchRequest, decide

PAUSE_POLL_S = 0.25
# How often each worker reads the control variable from the scheduler (in a thread, off the step path).
CONTROL_POLL_S = 0.2
# Workers of a process-group strategy agree on control state about this often: rarely enough to cost
# nothing, often enough that pause and stop feel immediate.
CONTROL_AGREEMENT_S = 0.25
MAX_CONTROL_INTERVAL_STEPS = 1024


@dataclasses.dataclass
class WorkerTask:
    """Everything one rank needs, decided on the client."""

    run_id: str
    rank: int
    world_size: int
    job: Job
    strategy: str
    settings: StrategySettings
    shard_samples: int
    total_steps: int
    local_data: bool
    master_host: str
    master_port: int
    collective_timeout_s: float
    addresses: list[str] = dataclasses.field(default_factory=list)  # the run's workers, by rank
    metrics_interval_s: float = 0.25
    step_delay_s: float = 0.0  # test hook: makes this worker deliberately slow
    generation: int = 0  # which group of workers this is (see `ControlState.generation`)
    start_step: int = 0  # steps already made, when resuming from a checkpoint
    checkpoint_every_steps: int | None = None  # process-group strategies checkpoint at these steps exactly
    applied_switch: int = 0  # live switches the run made before this group started (its strategy is the last)
    known_checkpoint: int = 0  # checkpoints asked for before this group started


class _StopRequested(Exception):
    pass


class _Superseded(Exception):
    """The client ended this group of workers (a worker was lost, or the client is gone): leave at once."""


def train_on_worker(task: WorkerTask, train_data: Any, eval_data: DataSource | None,
                    resume_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one rank of a job to its end; returns the rank's summary (and, on rank 0, the final weights
    and a checkpoint to go on from)."""
    secede()
    worker = get_worker()
    allocator_tuned = _configure_worker_for_training(worker)
    sender = MetricsSender(lambda message: worker.log_event(topic(task.run_id), message), task.rank,
                           task.metrics_interval_s)
    key = worker.get_current_task()
    # A task the scheduler no longer wants (its client is gone) is told so through its state here.
    poller = ControlPoller(get_client(), task.run_id, interval_s=CONTROL_POLL_S,
                           released=lambda: _task_released(worker, key))
    loop = _Loop(task, get_strategy(task.strategy)(task.settings), poller, sender)
    poller.after_each_poll(loop.break_group_if_ended)
    try:
        sender.event(kinds.WORKER_STARTED, address=worker.address, pid=os.getpid(), host=socket.gethostname(),
                     generation=task.generation, start_step=task.start_step, allocator_tuned=allocator_tuned)
        result = loop.run(train_data, eval_data, resume_from)
        sender.event(kinds.WORKER_FINISHED, steps=result["steps"], stopped=result["stopped"], generation=task.generation,
                     weights=result["weights"])
        return result
    except BaseException as error:
        superseded = isinstance(error, _Superseded) or loop.superseded()
        if not superseded and peer_lost(error):
            # Leave the process group before waiting for the client's verdict: peers blocked on this
            # worker's connections then fail at once instead of waiting out their collective timeout.
            _leave(loop, abandoned=True)
            superseded = loop.await_verdict(min(VERDICT_WAIT_S, task.collective_timeout_s))
        if not superseded:
            sender.event(kinds.WORKER_FAILED, step=loop.step, error=f"{type(error).__name__}: {error}",
                         traceback=traceback.format_exc(), generation=task.generation)
            raise
        # The client ended this group (another worker failed or was lost): whatever this worker was
        # waiting on broke because of that, so it leaves rather than report a failure of its own.
        if loop.strategy is not None:
            loop.strategy.abandoned = True  # no goodbyes to services that may be gone with the lost worker
        sender.event(kinds.WORKER_LEFT, step=loop.step, generation=task.generation,
                     error=None if isinstance(error, _Superseded) else f"{type(error).__name__}: {error}")
        return {"rank": task.rank, "steps": loop.step, "stopped": True, "superseded": True, "state_dict": None,
                "checkpoint": None}
    finally:
        try:
            sender.flush()
            poller.close()
        finally:
            _leave(loop)


def _leave(loop: _Loop, abandoned: bool = False) -> None:
    """Close the strategy in use (after any switches) and leave the process group; once."""
    if loop.strategy is None:
        return
    try:
        if abandoned:
            loop.strategy.abandoned = True
        loop.strategy.close()
    finally:
        if loop.joined_group:  # never another run's group, when joining failed because one trains here
            collectives.destroy_process_group()
        # The context's callbacks point back at the loop: without this cycle broken, the strategy (and a
        # parameter server's actors) would stay alive until the worker's next garbage collection.
        loop.context = loop.strategy = None
        gc.collect()  # and the objects in such cycles (torch's process-group handles, their sockets) go now


# Words of the errors a worker sees when a peer (or the worker holding a server shard) dies under it.
PEER_LOSS_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "connection refused",
                   "commclosederror", "stream is closed", "was ended")
VERDICT_WAIT_S = 5.0  # how long a worker whose peer vanished waits to learn whether the client ended the group


def peer_lost(error: BaseException) -> bool:
    """Whether `error` looks like a peer's or a server shard's loss rather than a failure of this worker.
    A timeout is not: a stuck peer is found out by the client only through the survivors' reports. Nor is a
    group that could not form: every rank reports that one itself."""
    if isinstance(error, collectives.GroupFormationError):
        return False
    if isinstance(error, (ConnectionError, EOFError)):
        return True
    text = f"{type(error).__name__}: {error}".lower()
    return any(words in text for words in PEER_LOSS_WORDS)


def _dask_ports(task: WorkerTask) -> list[int]:
    """The ports of the Dask servers this worker talks to (the run's workers and the scheduler)."""
    addresses = [*task.addresses, get_worker().scheduler.address]
    return [int(address.rsplit(":", 1)[1]) for address in addresses if address.rsplit(":", 1)[-1].isdigit()]


def _task_released(worker: Any, key: Any) -> bool:
    state = worker.state.tasks.get(key)
    return state is None or state.state in ("cancelled", "released", "forgotten")


class _Loop:
    def __init__(self, task: WorkerTask, strategy: Any, poller: ControlPoller, sender: MetricsSender) -> None:
        self.task, self.strategy, self.poller, self.sender = task, strategy, poller, sender
        self.step = 0
        self.epoch = 0
        self.joined_group = False
        self.group_broken = False
        self._recent_step_s = 0.0  # moving average of step time, for the control interval
        self._gpu = GpuGauge()
        self.control = ControlState(lr=task.job.lr, strategy=task.strategy,
                                    settings=dataclasses.asdict(task.settings))
        self.applied_switch = task.applied_switch  # switches made so far (the same on every rank)
        self.pending: SwitchRequest | None = None  # a switch agreed on, made when `step` reaches `switch_at`
        self.switch_at = 0
        # Checkpoints asked for by the client: the newest id agreed on, and the step it is taken at.
        self.known_checkpoint = task.known_checkpoint
        self.pending_checkpoint: int | None = None
        self.checkpoint_at = 0
        self.last_checkpoint_step = -1

    def superseded(self) -> bool:
        """Whether the client has ended this group of workers, or no longer wants this task."""
        return self.poller.latest().generation > self.task.generation or self.poller.released()

    def break_group_if_ended(self) -> None:
        """On the poller's thread: once the client has ended this group, break its connections, so that a
        training thread blocked in a collective on a departed peer fails now, not after its timeout."""
        # Only when the client ended the group (a regroup waits on it), not when the client is gone: then
        # every rank leaves by itself, and breaking sockets under a rank between two collectives can kill
        # its process (seen once when a client was killed, the run's worker died with it).
        if self.joined_group and not self.group_broken and self.poller.latest().generation > self.task.generation:
            self.group_broken = collectives.break_process_group()

    def await_verdict(self, timeout_s: float) -> bool:
        """After a peer vanished: whether the client ends this group within `timeout_s` (it does once it
        notices the loss, within a second or so). A survivor then leaves instead of reporting the broken
        connection as a failure of its own, which misled the run's records."""
        deadline = time.monotonic() + timeout_s
        while not self.superseded():
            if time.monotonic() >= deadline:
                return False
            time.sleep(CONTROL_POLL_S / 4)  # the poller's thread refreshes the state every CONTROL_POLL_S
        return True

    def run(self, train_data: Any, eval_data: DataSource | None,
            resume_from: dict[str, Any] | None = None) -> dict[str, Any]:
        task, job = self.task, self.task.job
        device = _resolve_device(job.device)
        torch.manual_seed(job.seed)
        self.step = task.start_step
        # Every run forms the process group, whatever its strategy: workers agree on switches and on the
        # end of the run through it, and a switch to a synchronous strategy needs it.
        collectives.init_process_group(task.master_host, task.master_port, task.rank, task.world_size,
                                       device, task.collective_timeout_s, dask_ports=_dask_ports(task),
                                       own_host=get_address_host(get_worker().address))
        self.joined_group = True
        if task.local_data:
            data = concatenate_blocks(*train_data)
        else:
            data = train_data.load()
        if device.type == "cuda" and hasattr(data, "to"):
            data = data.to(device)  # once per shard, not per step
        shard = Shard(data, task.world_size, task.rank, job.seed, task.shard_samples, task.local_data)
        evaluation = eval_data.load() if (eval_data is not None and task.rank == 0) else None

        model = job.model().to(device)
        context = self.context = TrainingContext(
            task.rank, task.world_size, device, model, None, task.collective_timeout_s, task.run_id,
            task.addresses, job, interrupted=self._control_waiting, abandoned=self.superseded)
        context.optimizer = self.strategy.local_optimizer(job, model.parameters())
        if resume_from is not None:
            self._restore(context, resume_from)
        self.strategy.setup(context)
        loss_fn = loss_function(job)
        next_agreement, stopped = 0, False
        try:
            for epoch, indices in self._batches(shard, evaluation, loss_fn, device):
                started = time.perf_counter()
                while True:  # control and switches before this step; a switch is followed by an agreement
                    if self.superseded():
                        raise _Superseded
                    if self.pending is not None and self.step >= self.switch_at:
                        self._switch()
                        next_agreement = self.step  # e.g. a pause asked for with the switch applies here
                    if self.pending is None and self.step >= next_agreement and self.step < task.total_steps:
                        next_agreement = self.step + self._agree_and_apply()
                        if self.pending is not None and self.step >= self.switch_at:
                            continue
                    if self._checkpoint_due():
                        self._checkpoint()
                    break
                wait_s = time.perf_counter() - started
                if self.step >= task.total_steps:
                    break
                self._train_step(context, loss_fn, shard, indices, epoch, wait_s, device)
                if evaluation is not None and job.eval_every and self.step % job.eval_every == 0:
                    self._evaluate(model, evaluation, loss_fn, device, epoch)
        except _StopRequested:
            stopped = True
        self._meet_at_end(stopped)
        self.strategy.finish(context)
        collectives.barrier()  # every rank holds the final weights before any service is released
        regrouping = self.control.regroup or self.poller.latest().regroup
        if evaluation is not None and not regrouping:  # the final weights, after the last synchronisation
            self._evaluate(model, evaluation, loss_fn, device, self.epoch, final=True)
        # What the run goes on from when it is resumed, or continued on other workers.
        checkpoint = self._checkpoint(final=True)
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if task.rank == 0 else None
        # The final weights' fingerprint: anyone can check from the metrics that every worker ended equal.
        return {"rank": task.rank, "steps": self.step, "stopped": stopped, "state_dict": state,
                "checkpoint": checkpoint, "weights": fingerprint(flatten(list(model.parameters())))}

    def _restore(self, context: TrainingContext, checkpoint: dict[str, Any]) -> None:
        """Start from a checkpoint: weights, optimizer and strategy state, and (on as many workers as it
        was taken with) this rank's random-number state and its own strategy state."""
        context.model.load_state_dict(checkpoint["weights"])
        weights = flatten(list(context.model.parameters()))
        self.strategy.carry_in(context, Carried(weights, checkpoint.get("optimizer") or {}))
        ranks = checkpoint.get("ranks") or []
        own = ranks[self.task.rank] if len(ranks) == self.task.world_size else None
        self.strategy.restore(checkpoint.get("strategy_state") or {}, own and own.get("strategy"))
        if own is not None:
            torch.set_rng_state(own["rng"])

    # --- checkpoints -------------------------------------------------------------------------------------

    def _checkpoint_due(self) -> bool:
        """A checkpoint asked for and agreed on, or one every `checkpoint_every_steps` steps.

        Process-group strategies: the same answer on every rank (they step together), and all take it.
        Parameter-server strategies: rank 0 takes it alone from the server, never holding the others
        (their ranks do not meet at a step).
        """
        if self.pending_checkpoint is not None and self.step >= self.checkpoint_at:
            return True
        every = self.task.checkpoint_every_steps
        return bool(every and (self.strategy.uses_process_group or self.task.rank == 0)
                    and self.step % every == 0 and self.task.start_step < self.step < self.task.total_steps
                    and self.step != self.last_checkpoint_step)

    def _checkpoint(self, final: bool = False) -> dict[str, Any] | None:
        """Collective: every rank adds its part; rank 0 assembles the checkpoint and leaves it for the
        client (or, at the end, returns it). Parameters gone NaN or infinite stop the run instead."""
        started = time.perf_counter()
        context = self.context
        together = final or self.strategy.uses_process_group
        carried, strategy_state = self.strategy.checkpoint_state(context, together)
        own = {"step": self.step, "rng": torch.get_rng_state(), "strategy": self.strategy.rank_state()}
        # Alone (rank 0 of a parameter-server run), the other ranks' own states are not in it: a resumed
        # run then starts every rank at rank 0's step.
        ranks = collectives.all_gather_objects(own) if together else None
        self.pending_checkpoint, self.last_checkpoint_step = None, self.step
        if self.task.rank != 0:
            return None
        weights = {name: value.detach().cpu().clone() for name, value in context.model.state_dict().items()}
        offset = 0
        for name, parameter in context.model.named_parameters():
            weights[name] = carried.weights[offset:offset + parameter.numel()].view_as(parameter).detach().cpu().clone()
            offset += parameter.numel()
        if not all_finite(weights):
            raise DivergenceError(f"training diverged: the parameters became NaN or infinite by step {self.step} "
                                  f"(found on worker {self.task.rank} while checkpointing). Lower the learning "
                                  "rate or check the data.")
        checkpoint = {
            "step": min(part["step"] for part in ranks) if ranks else self.step, "weights": weights,
            "optimizer": {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in carried.optimizer_state.items()},
            "strategy": self.strategy.name, "settings": dataclasses.asdict(self.strategy.settings),
            "lr": context.optimizer.param_groups[0]["lr"], "strategy_state": strategy_state, "ranks": ranks,
            "world_size": self.task.world_size, "generation": self.task.generation, "time": time.time(),
            "steps_per_epoch": self.task.shard_samples // self.task.job.batch_size,
            "final": final,
        }
        if final:
            return checkpoint
        leave_snapshot(self.task.run_id, checkpoint)
        self.sender.event(kinds.CHECKPOINT_READY, step=self.step, generation=self.task.generation,
                          took_s=time.perf_counter() - started)
        return None

    def _batches(self, shard: Shard, evaluation: Any, loss_fn: Any, device: torch.device):
        """(epoch, batch indices) without end, from the step the run starts at; evaluates at epoch ends
        when no `eval_every` is set."""
        job = self.task.job
        first_epoch, skip = data_position(self.task.start_step, self.task.shard_samples // job.batch_size)
        for epoch in range(first_epoch, 1 << 30):
            self.epoch = epoch
            batches = shard.epoch_batches(epoch, job.batch_size)
            for indices in batches[skip:] if epoch == first_epoch else batches:
                yield epoch, indices
            if evaluation is not None and job.eval_every is None and self.step < self.task.total_steps:
                self._evaluate(self.context.model, evaluation, loss_fn, device, epoch)

    def _control_waiting(self) -> bool:
        """Whether the newest control state asks for something the loop must handle (see `interrupted`)."""
        latest = self.poller.latest()
        known = self.pending.switch_id if self.pending is not None else self.applied_switch
        return (latest.stop or latest.paused or latest.switch_id > known or latest.checkpoint_id > self.known_checkpoint
                or self.superseded())

    # --- switching strategies --------------------------------------------------------------------------

    def _rendezvous(self, at_end: bool, stopping: bool = False) -> Decision:
        """Meet every other rank (see `switching`); all return the same decision."""
        latest = self.poller.latest()
        newest = latest if latest.version > self.control.version else self.control
        position = Position(self.step, at_end, stopping, newest.to_message())
        positions = [Position.from_message(m) for m in collectives.all_gather_json(position.to_message())]
        decision = decide(positions, self.applied_switch, self.known_checkpoint)
        if decision.newest["version"] > self.control.version:  # e.g. the lr the next strategy starts with
            self.control = ControlState.from_message(decision.newest)
        if not self.strategy.uses_process_group:
            # Ranks of a parameter-server run read checkpoint requests on their own; from here on they
            # agree on the newest (a switch to a process-group strategy needs them to).
            self.known_checkpoint = max(self.known_checkpoint, decision.newest.get("checkpoint_id", 0))
        elif decision.checkpoint is not None and not decision.stop:
            self.known_checkpoint, self.pending_checkpoint = decision.checkpoint, decision.checkpoint
            self.checkpoint_at = decision.target_step
        return decision

    def _meet_at_end(self, stopped: bool) -> None:
        """Out of steps (or stopping): meet the others until all are, making any switch still agreed on."""
        while True:
            if self.superseded():
                raise _Superseded
            if self.pending is not None:  # a switch agreed for the step this worker has reached
                self._switch()
            if self.pending_checkpoint is not None:  # agreed for a step this worker has reached
                self._checkpoint()
            decision = self._rendezvous(at_end=True, stopping=stopped)
            if decision.finished or (decision.stop and decision.all_at_end):
                return
            if decision.switch is not None:
                self.pending, self.switch_at = decision.switch, decision.target_step

    def _switch(self) -> None:
        """Change strategy on every rank at this step, carrying the weights and optimizer state over."""
        request, context, old = self.pending, self.context, self.strategy
        started = time.perf_counter()
        before = fingerprint(flatten(list(context.model.parameters())))
        old.finish(context)  # common weights: averaged, or the server's
        carried = old.carry_out(context)
        collectives.barrier()  # every rank holds the carried state before the old services go
        old.close()
        settings = make_settings(request.strategy, request.settings)
        new = get_strategy(request.strategy)(settings)
        context.optimizer = new.local_optimizer(context.job, context.model.parameters())
        if self.control.lr is not None:
            for group in context.optimizer.param_groups:
                group["lr"] = self.control.lr
        new.carry_in(context, carried)
        new.setup(context)
        self.strategy, self.applied_switch, self.pending = new, request.switch_id, None
        # The fingerprints let anyone check from the metrics that every worker starts the new strategy
        # from the same, carried-over weights.
        self.sender.event(kinds.SWITCHED, step=self.step, switch_id=request.switch_id, settings=dataclasses.asdict(settings),
                          took_s=time.perf_counter() - started, carried_optimizer_state=sorted(carried.optimizer_state),
                          weights_before=before, weights_after=fingerprint(flatten(list(context.model.parameters()))),
                          **{"from": old.name, "to": new.name})

    def _train_step(self, context: TrainingContext, loss_fn: Any, shard: Shard, indices: torch.Tensor,
                    epoch: int, wait_s: float, device: torch.device) -> None:
        started = time.perf_counter()
        if self.task.step_delay_s:
            time.sleep(self.task.step_delay_s)
        inputs, targets = shard.data.batch(indices)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        context.optimizer.zero_grad(set_to_none=not self.strategy.keeps_gradient_buffers)
        loss = loss_fn(context.model(inputs), targets)
        loss.backward()
        report = self.strategy.after_backward(context)
        context.optimizer.step()
        after_step = self.strategy.after_step(context, self.step)
        comm_s = report.get("comm_s", 0.0) + after_step.get("comm_s", 0.0)
        strategy_wait_s = after_step.get("wait_s", 0.0)  # e.g. SSP holding a worker back
        loss_value = float(loss.detach())
        elapsed = time.perf_counter() - started
        self._recent_step_s = elapsed if not self._recent_step_s else 0.9 * self._recent_step_s + 0.1 * elapsed
        if not math.isfinite(loss_value):
            raise DivergenceError(f"training diverged: the loss became {loss_value} at step {self.step} on worker "
                                  f"{self.task.rank}. Lower the learning rate or check the data.")
        record = {
            "worker": self.task.rank, "step": self.step, "epoch": epoch, "time": time.time(),
            "loss": loss_value, "samples": len(indices), "compute_s": elapsed - comm_s - strategy_wait_s,
            "comm_s": comm_s, "wait_s": wait_s + strategy_wait_s, "lr": context.optimizer.param_groups[0]["lr"],
            "strategy": self.strategy.name,
        }
        # Strategy-specific fields: steps_since_sync, divergence, staleness, bytes_sent, clock, ...
        record.update({k: v for k, v in after_step.items() if k not in ("comm_s", "wait_s")})
        if device.type == "cuda":
            record.update(self._gpu.sample(device))
        self.sender.record(record)
        self.step += 1

    def _agree_and_apply(self) -> int:
        """All ranks take one control state at this step; returns the steps until the next agreement.

        Pausing blocks here until resumed, stopped or switched. A switch not made yet leads to a
        rendezvous first, paused or not: another worker may be waiting there already, having read the
        switch before the pause (or the other way round); a paused run pauses again after the switch.
        """
        control, interval = self._agree(self.poller.latest())
        if control.checkpoint_id > self.known_checkpoint and not self.strategy.uses_process_group:
            self.known_checkpoint = control.checkpoint_id
            if self.task.rank == 0:  # taken alone, here and now (see `_checkpoint_due`)
                self._checkpoint()
        while True:
            if self.superseded():
                raise _Superseded
            if (control.switch_id > self.applied_switch or control.checkpoint_id > self.known_checkpoint) \
                    and not control.stop:
                decision = self._rendezvous(at_end=False)
                if decision.stop:
                    raise _StopRequested
                if decision.switch is not None:
                    # The rest (a pause, an lr) is applied at the agreement right after the switch.
                    self.pending, self.switch_at = decision.switch, decision.target_step
                    return interval
            if not control.paused or control.stop:
                break
            self.sender.event(kinds.PAUSED, step=self.step)
            while (control.paused and not control.stop and control.switch_id <= self.applied_switch
                   and control.checkpoint_id <= self.known_checkpoint and not self.superseded()):
                control, interval = self._agree(self.poller.wait_for_change(control.version, PAUSE_POLL_S))
            if not control.paused and not control.stop:
                self.sender.event(kinds.RESUMED, step=self.step)
        if control.stop:
            raise _StopRequested
        if control.version > self.control.version:
            self.control = control
        changes: dict[str, Any] = {}
        optimizer = self.context.optimizer
        if control.lr is not None and optimizer.param_groups[0]["lr"] != control.lr:
            for group in optimizer.param_groups:
                group["lr"] = control.lr
            changes["lr"] = control.lr
        if control.strategy == self.strategy.name and control.switch_id == self.applied_switch:
            live = {k: v for k, v in control.settings.items()
                    if k in self.strategy.settings.live and getattr(self.strategy.settings, k) != v}
            if live:
                self.strategy.update_settings(live)
                changes["settings"] = live
                # A new period moves the sync points; agree again at the next one (the same on every rank,
                # unlike the timing-based interval only rank 0 computes).
                interval = self.strategy.control_alignment()
        if changes:
            self.sender.event(kinds.CHANGED, step=self.step, strategy=self.strategy.name, **changes)
        return interval

    def _agree(self, local: ControlState) -> tuple[ControlState, int]:
        """Rank 0's control state and agreement interval on every rank (each its own without a group)."""
        if not self.strategy.uses_process_group:
            return local, 1
        message = collectives.broadcast_json(
            {"control": local.to_message(), "interval": self._control_interval()} if self.task.rank == 0 else None)
        return ControlState.from_message(message["control"]), message["interval"]

    def _control_interval(self) -> int:
        """Steps until the next agreement: about CONTROL_AGREEMENT_S of training, on the strategy's grid."""
        alignment = self.strategy.control_alignment()
        step_s = self._recent_step_s or CONTROL_AGREEMENT_S
        multiples = max(1, round(CONTROL_AGREEMENT_S / (step_s * alignment)))
        return min(multiples * alignment, max(alignment, MAX_CONTROL_INTERVAL_STEPS))

    def _evaluate(self, model: torch.nn.Module, evaluation: Any, loss_fn: Any, device: torch.device,
                  epoch: int, final: bool = False) -> None:
        result = evaluate(model, evaluation, loss_fn, device)
        self.sender.event(kinds.EVAL, step=self.step, epoch=epoch, final=final, **result)


def _resolve_device(requested: str) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainingError("device='cuda' was asked for, but this worker sees no CUDA device")
    return torch.device("cuda", 0)  # dask-cuda gives each worker its own GPU as cuda:0


def _configure_worker_for_training(worker: Any) -> bool:
    """Quiet the worker's own housekeeping that competes with training for the CPU.

    The statistical profiler samples every thread every 10 ms; on a small machine it costs a visible
    share of throughput (design.md section 5). Clusters the workbench starts are configured this way
    already; this also covers existing clusters.
    """
    torch.set_num_threads(max(1, int(getattr(worker.state, "nthreads", 1))))
    tuned = keep_freed_memory()

    def stop_profiler() -> None:
        for name in ("profile", "profile-cycle"):
            callback = worker.periodic_callbacks.get(name)
            if callback is not None:
                callback.stop()

    worker.loop.add_callback(stop_profiler)
    return tuned


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# The largest threshold glibc's own dynamic adjustment reaches on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_BYTES = 32 << 20


def keep_freed_memory() -> bool:
    """Let this worker's allocator reuse freed tensor memory instead of handing it back to the OS at once.

    A Dask nanny starts its worker with `MALLOC_TRIM_THRESHOLD_=65536`, which also switches off glibc's
    dynamic mmap threshold: every tensor over 128 KiB was then mapped and unmapped each step. Measured on
    the benchmark's MLP (784-1024-1024-10, batch 128): 4,657 page faults a step with the variable set, 1,333
    without it, 1 after this call; about 25% of step time. The environment cannot be changed after
    start-up (glibc reads it once), but `mallopt` can, so this works on any cluster, however started.
    Measured in a worker thread on the same MLP: 8,146 page faults and 83-88 ms a step with the variable,
    852-912 and 38-43 ms without it, 53-2,598 and 32-34 ms with it and this call. Returns whether it
    applied (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                    and libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing of this applies


class GpuGauge:
    """GPU memory and utilisation for the step records, read at most once a second (NVML is not free)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self._interval_s = interval_s
        self._next = 0.0
        self._last: dict[str, float] = {}

    def sample(self, device: torch.device) -> dict[str, float]:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._interval_s
            self._last = {"gpu_memory_mb": torch.cuda.memory_allocated(device) / 2**20}
            try:
                self._last["gpu_utilization"] = float(torch.cuda.utilization(device))
            except Exception:  # no NVML binding on this machine: memory only
                pass
        return dict(self._last)
