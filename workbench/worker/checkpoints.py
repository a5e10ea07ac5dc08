"""Checkpoints on a worker: when the loop takes one, what goes in it, and starting from one.

Every rank adds its part (its step, random-number state and strategy state); rank 0 assembles the
checkpoint (weights, optimizer and strategy state, data position) and leaves it in the worker for the
client to fetch (`checkpoint.leave_snapshot`), or at the end returns it. Weights gone NaN or infinite
stop the run instead of being kept. The format is `plane/checkpoint_format.py`'s; the client's side is
`run/checkpoints.py`.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from workbench.comm.averaging import flatten
from workbench.comm.device_staging import to_host
from workbench.errors import DivergenceError
from workbench.plane import kinds
from workbench.plane.checkpoint_format import all_finite, leave_snapshot, wait_fetched
from workbench.strategies.base import Carried, TrainingContext


class LoopCheckpoints:
    """One rank's checkpoints. `loop` is the worker loop: its task, step, strategy, context and sender."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.last_step = -1  # the step of the last one taken (never two at one step)
        # Ranks at their own pace: the step the running strategy started at, and the group's step at the
        # last look (a periodic checkpoint is due when it crosses a multiple of the interval).
        self.strategy_since = 0
        self.group_seen = 0

    def strategy_started(self) -> None:
        """The loop set up a strategy (at the start or after a switch) at its current step."""
        self.strategy_since = self.group_seen = self.loop.step

    def group_step(self, version: int | None = None) -> int:
        """Where the group is: this rank's step when the ranks step together; ranks at their own pace, the
        mean of their steps as the server counts them (at `version`, or its newest known). Rank 0 decides
        and labels a checkpoint it takes alone by this, not by its own step: its worker also serves a
        shard and lags (80 steps against the others' 185 once, on 2 cores), and a checkpoint labelled with
        its step would send every rank back to it."""
        loop = self.loop
        if loop.control.agreement.checkpoints_together:
            return loop.step
        return min(loop.task.total_steps, self.strategy_since + int(loop.strategy.group_steps(version)))

    def due(self, agreed: int | None, agreed_at: int) -> bool:
        """A checkpoint asked for and agreed on (`agreed`, to take at step `agreed_at`), or one every
        `checkpoint_every_steps` steps.

        Process-group strategies: the same answer on every rank (they step together), and all take it.
        Parameter-server strategies: rank 0 takes it alone from the server, never holding the others
        (their ranks do not meet at a step), each time the group's step crosses a multiple.
        """
        loop, task = self.loop, self.loop.task
        if agreed is not None and loop.step >= agreed_at:
            return True
        every = task.checkpoint_every_steps
        if not every or not loop.control.agreement.periodic_checkpoint(task.rank):
            return False
        if loop.control.agreement.checkpoints_together:
            return bool(loop.step % every == 0 and task.start_step < loop.step < task.total_steps
                        and loop.step != self.last_step)
        seen, self.group_seen = self.group_seen, self.group_step()
        return self.group_seen // every > seen // every and self.group_seen < task.total_steps

    def take(self, final: bool = False) -> dict[str, Any] | None:
        """Collective: every rank adds its part; rank 0 assembles the checkpoint and leaves it for the
        client (or, at the end, returns it). Parameters gone NaN or infinite stop the run instead."""
        loop, task = self.loop, self.loop.task
        started = time.perf_counter()
        context, strategy = loop.context, loop.strategy
        together = final or loop.control.agreement.checkpoints_together
        carried, strategy_state = strategy.checkpoint_state(context, together)
        own = {"step": loop.step, "rng": torch.get_rng_state(), "strategy": to_host(strategy.rank_state())}
        if context.device.type == "cuda":  # dropout and other random layers on the GPU draw from its own generator
            own["cuda_rng"] = torch.cuda.get_rng_state(context.device)
        # Alone (rank 0 of a parameter-server run), the other ranks' own states are not in it: a resumed
        # run then starts every rank at the group's step.
        ranks = loop.comm.all_gather_objects(own) if together else None
        self.last_step = loop.step
        if task.rank != 0:
            return None
        weights = {name: value.detach().cpu().clone() for name, value in context.model.state_dict().items()}
        offset = 0
        for name, parameter in context.model.named_parameters():
            weights[name] = carried.weights[offset:offset + parameter.numel()].view_as(parameter).detach().cpu().clone()
            offset += parameter.numel()
        if not all_finite(weights):
            raise DivergenceError(f"training diverged: the parameters became NaN or infinite by step {loop.step} "
                                  f"(found on worker {task.rank} while checkpointing). Lower the learning "
                                  "rate or check the data.")
        step = min(part["step"] for part in ranks) if ranks else self.group_step(strategy_state.get("server_version"))
        checkpoint = {
            "step": step, "weights": weights,
            "optimizer": {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in carried.optimizer_state.items()},
            "strategy": strategy.name, "settings": dataclasses.asdict(strategy.settings),
            "lr": context.optimizer.param_groups[0]["lr"], "strategy_state": to_host(strategy_state), "ranks": ranks,
            "world_size": task.world_size, "generation": task.generation, "time": time.time(),
            "steps_per_epoch": task.shard_samples // task.job.batch_size,
            "final": final,
        }
        if final:
            return checkpoint
        leave_snapshot(task.run_id, checkpoint)
        loop.sender.event(kinds.CHECKPOINT_READY, step=loop.step, generation=task.generation,
                          took_s=time.perf_counter() - started)
        # Until the client has fetched it, it lives in this process only: lost with this worker, a regroup
        # goes back to the one before, and rank 0 may have gone on by more than an interval (under load,
        # 104 steps of a 40-step interval once, `ssp` with its shard on rank 0). So rank 0 goes on once
        # it is fetched (a round trip to the client; others hold at their next collective or SSP bound),
        # after `collective_timeout_s`, or at a pause, stop or switch.
        wait_fetched(task.run_id, checkpoint, task.collective_timeout_s, loop.control.waiting)
        return None

    def restore(self, context: TrainingContext, checkpoint: dict[str, Any]) -> None:
        """Start from a checkpoint: weights, optimizer and strategy state, and (on as many workers as it
        was taken with) this rank's random-number state and its own strategy state."""
        loop, task = self.loop, self.loop.task
        context.model.load_state_dict(checkpoint["weights"])
        weights = flatten(list(context.model.parameters()))
        loop.strategy.carry_in(context, Carried(weights, checkpoint.get("optimizer") or {}))
        ranks = checkpoint.get("ranks") or []
        own = ranks[task.rank] if len(ranks) == task.world_size else None
        loop.strategy.restore(checkpoint.get("strategy_state") or {}, own and own.get("strategy"))
        if own is not None:
            torch.set_rng_state(own["rng"])
            if context.device.type == "cuda" and own.get("cuda_rng") is not None:
                torch.cuda.set_rng_state(own["cuda_rng"], context.device)
