"""The training loop, written once, that every worker runs as one long-lived Dask task.

`_Loop.run` reads top to bottom: form the process group, load the shard, build the model and the
strategy, then for each batch: the control point (`worker/control_point.py`: pause, stop, lr, settings,
switches, checkpoints, all agreed between ranks), one step with the strategy's hooks, metrics; then the
meeting at the end, the final weights and checkpoint. Checkpoint mechanics are `worker/checkpoints.py`'s,
the machine's preparation `worker/host.py`'s. The task leaves the worker's thread pool (`secede`) so the
worker stays responsive, reads control state from an in-memory poller, and sends metrics in batches.
"""
from __future__ import annotations

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

from workbench.comm import collectives
from workbench.comm.averaging import fingerprint, flatten
from workbench.comm.transport import ProcessGroupTransport, Transport
from workbench.data import DataSource, Shard, concatenate_blocks
from workbench.errors import DivergenceError
from workbench.evaluation import evaluate
from workbench.job import Job, autocast, loss_function
from workbench.plane import kinds, relay as metrics_relay
from workbench.plane.checkpoint_format import KeptCheckpoint, data_position
from workbench.plane.control import ControlPoller
from workbench.plane.metrics import MetricsSender, topic
from workbench.schedule import lr_factor
from workbench.strategies import StrategySettings, TrainingContext, get_strategy
from workbench.worker.checkpoints import LoopCheckpoints
from workbench.worker.control_point import (CONTROL_AGREEMENT_S, CONTROL_POLL_S, Action, ControlPoint, StopRequested,
                                            Superseded, SwitchNow)
from workbench.worker.host import GpuGauge, configure_worker_for_training, resolve_device
from workbench.worker.strategy_switch import switch_strategy


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
    metrics_relay: str | None = None  # the worker that relays this rank's metrics (plane/relay.py); None: itself
    step_delay_s: float = 0.0  # test hook: makes this worker deliberately slow
    sample_delay_s: float = 0.0  # test hook: slower in proportion to the samples it takes (as a slower CPU)
    generation: int = 0  # which group of workers this is (see `ControlState.generation`)
    start_step: int = 0  # steps already made, when resuming from a checkpoint
    checkpoint_every_steps: int | None = None  # process-group strategies checkpoint at these steps exactly
    applied_switch: int = 0  # live switches the run made before this group started (its strategy is the last)
    known_checkpoint: int = 0  # checkpoints asked for before this group started


def train_on_worker(task: WorkerTask, train_data: Any, eval_data: DataSource | None,
                    resume_from: dict[str, Any] | KeptCheckpoint | None = None) -> dict[str, Any]:
    """Run one rank of a job to its end; returns the rank's summary (and, on rank 0, the final weights
    and a checkpoint to go on from). `resume_from`: the checkpoint, or where this worker keeps it."""
    secede()
    worker = get_worker()
    allocator_tuned, restore_housekeeping = configure_worker_for_training(worker)
    send = _metrics_send(worker, task)
    sender = MetricsSender(send, task.rank, task.metrics_interval_s)
    key = worker.get_current_task()
    # A task the scheduler no longer wants (its client is gone) is told so through its state here.
    poller = ControlPoller(get_client(), task.run_id, interval_s=CONTROL_POLL_S,
                           released=lambda: _task_released(worker, key))
    loop = _Loop(task, get_strategy(task.strategy)(task.settings), poller, sender, ProcessGroupTransport())
    poller.after_each_poll(loop.control.break_group_if_ended)
    try:
        # Where its checkpoint came from: kept in this worker's memory, or sent by the client.
        origin = "kept" if isinstance(resume_from, KeptCheckpoint) else "sent" if resume_from is not None else None
        sender.event(kinds.WORKER_STARTED, address=worker.address, pid=os.getpid(), host=socket.gethostname(),
                     generation=task.generation, start_step=task.start_step, allocator_tuned=allocator_tuned,
                     checkpoint=origin)
        device = resolve_device(task.job.device)
        # Every run forms the process group, whatever its strategy: workers agree on switches and on the
        # end of the run through it, and a switch to a synchronous strategy needs it.
        collectives.init_process_group(task.master_host, task.master_port, task.rank, task.world_size,
                                       device, task.collective_timeout_s, dask_ports=_dask_ports(task),
                                       own_host=get_address_host(worker.address))
        loop.control.joined_group = True
        if isinstance(resume_from, KeptCheckpoint):
            resume_from = resume_from.resolve()
        result = loop.run(train_data, eval_data, device, resume_from)
        sender.event(kinds.WORKER_FINISHED, steps=result["steps"], stopped=result["stopped"], generation=task.generation,
                     weights=result["weights"])
        return result
    except BaseException as error:
        superseded = isinstance(error, Superseded) or loop.control.superseded()
        if not superseded and peer_lost(error):
            # Leave the process group before waiting for the client's verdict: peers blocked on this
            # worker's connections then fail at once instead of waiting out their collective timeout.
            _leave(loop, abandoned=True)
            superseded = loop.control.await_verdict(min(VERDICT_WAIT_S, task.collective_timeout_s))
        if not superseded:
            sender.event(kinds.WORKER_FAILED, step=loop.step, error=f"{type(error).__name__}: {error}",
                         traceback=traceback.format_exc(), generation=task.generation)
            raise
        # The client ended this group (another worker failed or was lost): whatever this worker was
        # waiting on broke because of that, so it leaves rather than report a failure of its own.
        if loop.strategy is not None:
            loop.strategy.abandoned = True  # no goodbyes to services that may be gone with the lost worker
        sender.event(kinds.WORKER_LEFT, step=loop.step, generation=task.generation,
                     error=None if isinstance(error, Superseded) else f"{type(error).__name__}: {error}")
        return {"rank": task.rank, "steps": loop.step, "stopped": True, "superseded": True, "state_dict": None,
                "checkpoint": None}
    finally:
        # Leave before the poller stops: closing the strategy may wait on a server shard that is gone (a
        # peer that failed released it; Dask's call to a vanished actor never answers), and only the
        # poller tells that wait the group was ended. Closed first, a rank that failed on its own waited
        # out its whole timeout there, and the client counted it stuck and regrouped without it.
        try:
            sender.flush()
            if isinstance(send, metrics_relay.RelaySender):
                send.close()  # every message passed on before the rank's result reaches the client
        finally:
            try:
                _leave(loop)
            finally:
                poller.close()
                restore_housekeeping()


def _metrics_send(worker: Any, task: WorkerTask) -> Any:
    """How this rank's metrics reach the scheduler: itself, or through its host's relay (metrics_relay)."""
    if task.metrics_relay is None:
        return lambda message: worker.log_event(topic(task.run_id), message)
    return metrics_relay.RelaySender(worker, topic(task.run_id), task.metrics_relay)


def _leave(loop: _Loop, abandoned: bool = False) -> None:
    """Close the strategy in use (after any switches) and leave the process group; once."""
    if loop.strategy is None:
        return
    try:
        if abandoned:
            loop.strategy.abandoned = True
        loop.strategy.close()
    finally:
        if loop.control.joined_group:  # never another run's group, when joining failed because one trains here
            collectives.destroy_process_group()
            # The poller's thread can outlive this task by a poll (up to 5 s): it must not break the group
            # of the next run on this worker for this one.
            loop.control.joined_group = False
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
    """One rank's training: the loop itself, its steps and evaluations. Control is `control`'s
    (worker/control_point.py), checkpoints are `checkpoints`' (worker/checkpoints.py)."""

    def __init__(self, task: WorkerTask, strategy: Any, poller: Any, sender: MetricsSender, comm: Transport,
                 agreement_s: float = CONTROL_AGREEMENT_S) -> None:
        self.task, self.strategy, self.sender, self.comm = task, strategy, sender, comm
        self.context: TrainingContext | None = None
        self.step = 0
        self.epoch = 0
        self.recent_step_s = 0.0  # moving average of step time, for the control interval
        self._cpu_mark = time.process_time()  # the process's CPU time at the previous step record
        # The last step's cycle start and what its record counts as communication and waiting, until the next
        # step starts and its own time is known (`Strategy.step_timed`); None after an evaluation.
        self._last_cycle: tuple[float, float] | None = None
        self._gpu = GpuGauge()
        self.control = ControlPoint(self, poller, agreement_s)
        self.checkpoints = LoopCheckpoints(self)

    def run(self, train_data: Any, eval_data: DataSource | None, device: torch.device,
            resume_from: dict[str, Any] | None = None) -> dict[str, Any]:
        """Train this rank to the end of the run (or a stop); returns its summary. Talks to the other
        ranks only through `comm`, with them in the process group already."""
        task, job = self.task, self.task.job
        torch.manual_seed(job.seed)
        self.step = task.start_step
        shard = self._shard(train_data, device)
        evaluation = eval_data.load() if (eval_data is not None and task.rank == 0) else None
        model = job.model().to(device)
        # The compiled module shares the model's parameters: strategies, checkpoints and the final weights
        # keep working on `model` itself; only the forward pass goes through the compiled graph.
        self.forward = torch.compile(model) if getattr(job, "compile", False) else model
        context = self.context = TrainingContext(
            task.rank, task.world_size, device, model, None, task.collective_timeout_s, task.run_id,
            task.addresses, job, interrupted=self.control.waiting, abandoned=self.control.superseded, comm=self.comm,
            global_batches=not shard.local)
        context.optimizer = self.strategy.local_optimizer(job, model.parameters())
        if resume_from is not None:
            self.checkpoints.restore(context, resume_from)
        self.strategy.setup(context)
        self.checkpoints.strategy_started()
        if resume_from is not None:  # a recovery's phase ends here (run/recovery.py)
            self.sender.event(kinds.RESTORED, step=self.step, generation=task.generation)
        loss_fn = loss_function(job)

        stopped = False
        try:
            for epoch, row in self._batches(shard, evaluation, loss_fn, device):
                started = time.perf_counter()
                self._time_last_step(context, started)
                while (action := self.control.before_step()) is not None:  # pause, stop, lr, settings: agreed
                    self._carry_out(action)  # a switch or a checkpoint, at the step the ranks agreed on
                if self.step >= task.total_steps:
                    break
                self._train_step(context, loss_fn, shard, row, epoch, time.perf_counter() - started, device)
                if evaluation is not None and job.eval_every and self.step % job.eval_every == 0:
                    self._evaluate(model, evaluation, loss_fn, device, epoch)
        except StopRequested:
            stopped = True
        while (action := self.control.at_end(stopped)) is not None:
            self._carry_out(action)
        self.strategy.finish(context)
        self.comm.barrier()  # every rank holds the final weights before any service is released
        regrouping = self.control.control.regroup or self.control.poller.latest().regroup
        if evaluation is not None and not regrouping:  # the final weights, after the last synchronisation
            self._evaluate(model, evaluation, loss_fn, device, self.epoch, final=True)
        # What the run goes on from when it is resumed, or continued on other workers.
        checkpoint = self.checkpoints.take(final=True)
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if task.rank == 0 else None
        # The final weights' fingerprint: anyone can check from the metrics that every worker ended equal.
        return {"rank": task.rank, "steps": self.step, "stopped": stopped, "state_dict": state,
                "checkpoint": checkpoint, "weights": fingerprint(flatten(list(model.parameters())))}

    def _shard(self, train_data: Any, device: torch.device) -> Shard:
        task = self.task
        data = concatenate_blocks(*train_data) if task.local_data else train_data.load()
        if device.type == "cuda" and hasattr(data, "to"):
            data = data.to(device)  # once per shard, not per step
        return Shard(data, task.world_size, task.rank, task.job.seed, task.shard_samples, task.local_data)

    def _batches(self, shard: Shard, evaluation: Any, loss_fn: Any, device: torch.device):
        """(epoch, the step's global batch) without end, from the step the run starts at; evaluates at
        epoch ends when no `eval_every` is set."""
        job = self.task.job
        first_epoch, skip = data_position(self.task.start_step, self.task.shard_samples // job.batch_size)
        for epoch in range(first_epoch, 1 << 30):
            self.epoch = epoch
            rows = shard.epoch_rows(epoch, job.batch_size)
            for row in rows[skip:] if epoch == first_epoch else rows:
                yield epoch, row
            if evaluation is not None and job.eval_every is None and self.step < self.task.total_steps:
                self._evaluate(self.context.model, evaluation, loss_fn, device, epoch)

    def _train_step(self, context: TrainingContext, loss_fn: Any, shard: Shard, row: torch.Tensor,
                    epoch: int, wait_s: float, device: torch.device) -> None:
        started = time.perf_counter()
        indices = shard.part(row, self.task.job.batch_size, self.strategy.batch_share(context))
        if self.task.step_delay_s or self.task.sample_delay_s:
            time.sleep(self.task.step_delay_s + self.task.sample_delay_s * len(indices))
        inputs, targets = shard.data.batch(indices)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        self.apply_lr()
        context.optimizer.zero_grad(set_to_none=True)
        with autocast(self.task.job, device):
            loss = loss_fn(self.forward(inputs), targets)
        loss.backward()
        report = self.strategy.after_backward(context)
        context.optimizer.step()
        after_step = self.strategy.after_step(context, self.step)
        comm_s = report.get("comm_s", 0.0) + after_step.get("comm_s", 0.0)
        strategy_wait_s = after_step.get("wait_s", 0.0)  # e.g. SSP holding a worker back
        settled_s = self.control.take_settled_s()  # an exchange waited for at the control point, before the step
        loss_value = float(loss.detach())
        elapsed = time.perf_counter() - started
        # The process's CPU, every thread (the exchange's copies, the server actor, Dask's own): what a
        # host's CPU cap or a CPU bill counts, which wall-clock step parts do not show.
        cpu_now = time.process_time()
        cpu_s, self._cpu_mark = cpu_now - self._cpu_mark, cpu_now
        self.recent_step_s = elapsed if not self.recent_step_s else 0.9 * self.recent_step_s + 0.1 * elapsed
        if not math.isfinite(loss_value):
            raise DivergenceError(f"training diverged: the loss became {loss_value} at step {self.step} on worker "
                                  f"{self.task.rank}. Lower the learning rate or check the data.")
        record = {
            "worker": self.task.rank, "step": self.step, "epoch": epoch, "time": time.time(),
            "loss": loss_value, "samples": len(indices), "compute_s": elapsed - comm_s - strategy_wait_s,
            "comm_s": comm_s + settled_s, "wait_s": wait_s - settled_s + strategy_wait_s,
            "lr": context.optimizer.param_groups[0]["lr"],
            "strategy": self.strategy.name, "cpu_s": cpu_s,
        }
        if settled_s:  # the part of comm_s that was an exchange finished at the control point, not hidden
            record["settled_s"] = settled_s
        # Strategy-specific fields: steps_since_sync, divergence, staleness, bytes_sent, clock, ...
        record.update({k: v for k, v in after_step.items() if k not in ("comm_s", "wait_s")})
        if device.type == "cuda":
            record.update(self._gpu.sample(device))
        self.sender.record(record)
        self._last_cycle = (started - wait_s, record["comm_s"] + record["wait_s"])
        self.step += 1

    def _time_last_step(self, context: TrainingContext, now: float) -> None:
        """Tell the strategy the last step's own time: from its cycle's start (its control point's) to this
        one's, less its communication and waiting."""
        if self._last_cycle is not None:
            cycle_started, waited_s = self._last_cycle
            self.strategy.step_timed(context, now - cycle_started - waited_s)
            self._last_cycle = None

    def _carry_out(self, action: Action) -> None:
        """What the ranks agreed on at the control point: switch strategy, or take a checkpoint."""
        if not isinstance(action, SwitchNow):
            self.checkpoints.take()
            return

        def new_optimizer() -> None:
            self.control.take_switch_lr()
            self.apply_lr()

        self.strategy, event = switch_strategy(self.strategy, action.request, self.context, self.comm, new_optimizer)
        self.control.switched(action.request, self.strategy)
        self.checkpoints.strategy_started()
        self.sender.event(kinds.SWITCHED, step=self.step, **event)

    def apply_lr(self) -> None:
        """The run's learning rate (the job's, or as last set while it runs) times the job's schedule at
        this step, on every parameter group of the optimizer in use."""
        job = self.task.job
        lr = self.control.base_lr * lr_factor(self.step, self.task.total_steps, getattr(job, "lr_schedule", "constant"),
                                              getattr(job, "warmup_steps", 0), getattr(job, "min_lr_fraction", 0.1))
        for group in self.context.optimizer.param_groups:
            group["lr"] = lr

    def _evaluate(self, model: torch.nn.Module, evaluation: Any, loss_fn: Any, device: torch.device,
                  epoch: int, final: bool = False) -> None:
        self._last_cycle = None  # the step before is not timed: its cycle holds the evaluation
        started = time.perf_counter()
        result = evaluate(model, evaluation, loss_fn, device)
        # How long the other ranks wait for rank 0 at their next collective (plane/deadline.py).
        eval_s = time.perf_counter() - started
        self.sender.event(kinds.EVAL, step=self.step, epoch=epoch, final=final, eval_s=eval_s, **result)
