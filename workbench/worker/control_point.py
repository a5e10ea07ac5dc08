"""The worker loop's control point: where the ranks agree on pause, stop, learning rate, live settings,
checkpoints and strategy switches, and carry them out together.

Before each step the loop asks `ControlPoint.before_step`. Process-group strategies take rank 0's
control state every few steps (one broadcast, about every CONTROL_AGREEMENT_S of training); a switch or
a checkpoint makes every rank meet at a rendezvous (`switching.decide`, pure) and act at one agreed step;
a pause blocks here. Out of steps, `meet_at_end` keeps meeting until every rank is. It also answers
whether the client has ended this group (`superseded`), so that a rank leaves instead of waiting.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from workbench.comm import collectives
from workbench.comm.averaging import fingerprint, flatten
from workbench.plane import kinds
from workbench.plane.control import ControlPoller, ControlState
from workbench.strategies import get_strategy, make_settings
from workbench.worker.switching import Decision, Position, SwitchRequest, decide

PAUSE_POLL_S = 0.25
# How often each worker reads the control variable from the scheduler (in a thread, off the step path).
CONTROL_POLL_S = 0.2
# Workers of a process-group strategy agree on control state about this often: rarely enough to cost
# nothing, often enough that pause and stop feel immediate.
CONTROL_AGREEMENT_S = 0.25
MAX_CONTROL_INTERVAL_STEPS = 1024


class StopRequested(Exception):
    """The ranks agreed to stop."""


class Superseded(Exception):
    """The client ended this group of workers (a worker was lost, or the client is gone): leave at once."""


class ControlPoint:
    """One rank's side of the control agreement. `loop` is the worker loop: its step, strategy, context,
    metrics sender and checkpoints."""

    def __init__(self, loop: Any, poller: ControlPoller, agreement_s: float = CONTROL_AGREEMENT_S) -> None:
        task = loop.task
        self.loop, self.task, self.poller = loop, task, poller
        self.agreement_s = agreement_s  # 0: agree at every step (in one process, where steps take microseconds)
        self.control = ControlState(lr=task.job.lr, strategy=task.strategy, settings=dataclasses.asdict(task.settings))
        self.applied_switch = task.applied_switch  # switches made so far (the same on every rank)
        # The run's learning rate as last agreed; the loop scales it by the job's schedule at every step.
        self.base_lr = task.job.lr
        self.pending: SwitchRequest | None = None  # a switch agreed on, made when the step reaches `switch_at`
        self.switch_at = 0
        # Checkpoints asked for by the client: the newest id agreed on, and the step it is taken at.
        self.known_checkpoint = task.known_checkpoint
        self.pending_checkpoint: int | None = None
        self.checkpoint_at = 0
        self.next_agreement = 0
        self.settled_s = 0.0  # waited at this control point for the strategy's exchange in flight (`settle`)
        self.joined_group = False
        self.group_broken = False
        self.meetings = 0  # rendezvous of an asynchronous strategy so far (`_rendezvous`), alike on every rank

    # --- is this group still wanted? ------------------------------------------------------------------

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

    def waiting(self) -> bool:
        """Whether the newest control state asks for something the loop must handle (`interrupted`)."""
        latest = self.poller.latest()
        known = self.pending.switch_id if self.pending is not None else self.applied_switch
        return (latest.stop or latest.paused or latest.switch_id > known or latest.checkpoint_id > self.known_checkpoint
                or self.superseded())

    # --- before each step and at the end --------------------------------------------------------------

    def before_step(self) -> None:
        """Control and switches before this step (a switch is followed by an agreement), and a checkpoint
        if one is due. Raises `StopRequested` or `Superseded`."""
        loop = self.loop
        while True:
            if self.superseded():
                raise Superseded
            if self.pending is not None and loop.step >= self.switch_at:
                self._switch()
                self.next_agreement = loop.step  # e.g. a pause asked for with the switch applies here
            if self.pending is None and loop.step >= self.next_agreement and loop.step < self.task.total_steps:
                self.next_agreement = loop.step + self._agree_and_apply()
                if self.pending is not None and loop.step >= self.switch_at:
                    continue
            if loop.checkpoints.due(self.pending_checkpoint, self.checkpoint_at):
                self._take_checkpoint()
            return

    def meet_at_end(self, stopped: bool) -> None:
        """Out of steps (or stopping): meet the others until all are, making any switch still agreed on."""
        while True:
            if self.superseded():
                raise Superseded
            if self.pending is not None:  # a switch agreed for the step this worker has reached
                self._switch()
            if self.pending_checkpoint is not None:  # agreed for a step this worker has reached
                self._take_checkpoint()
            decision = self._rendezvous(at_end=True, stopping=stopped)
            if decision.finished or (decision.stop and decision.all_at_end):
                return
            if decision.switch is not None:
                self.pending, self.switch_at = decision.switch, decision.target_step

    def _take_checkpoint(self) -> None:
        self.pending_checkpoint = None
        self.loop.checkpoints.take()

    # --- agreement --------------------------------------------------------------------------------------

    def _agree_and_apply(self) -> int:
        """All ranks take one control state at this step; returns the steps until the next agreement.

        Pausing blocks here until resumed, stopped or switched. A switch not made yet leads to a
        rendezvous first, paused or not: another worker may be waiting there already, having read the
        switch before the pause (or the other way round); a paused run pauses again after the switch.
        """
        loop, strategy = self.loop, self.loop.strategy
        self._settle()  # before reading the control state: what arrived meanwhile is agreed on now
        control, interval = self._agree(self.poller.latest())
        if control.checkpoint_id > self.known_checkpoint and not strategy.traits.uses_process_group:
            self.known_checkpoint = control.checkpoint_id
            if self.task.rank == 0:  # taken alone, here and now (see `LoopCheckpoints.due`)
                self._take_checkpoint()
        while True:
            if self.superseded():
                raise Superseded
            if (control.switch_id > self.applied_switch or control.checkpoint_id > self.known_checkpoint) \
                    and not control.stop:
                decision = self._rendezvous(at_end=False)
                if decision.stop:
                    raise StopRequested
                if decision.switch is not None:
                    # The rest (a pause, an lr) is applied at the agreement right after the switch.
                    self.pending, self.switch_at = decision.switch, decision.target_step
                    return interval
            if not control.paused or control.stop:
                break
            loop.sender.event(kinds.PAUSED, step=loop.step)
            while (control.paused and not control.stop and control.switch_id <= self.applied_switch
                   and control.checkpoint_id <= self.known_checkpoint and not self.superseded()):
                control, interval = self._agree(self.poller.wait_for_change(control.version, PAUSE_POLL_S))
            if not control.paused and not control.stop:
                loop.sender.event(kinds.RESUMED, step=loop.step)
        if control.stop:
            raise StopRequested
        if control.version > self.control.version:
            self.control = control
        return self._apply(control, interval)

    def _apply(self, control: ControlState, interval: int) -> int:
        """Apply an agreed learning rate and live settings; returns the (maybe realigned) interval."""
        loop, strategy = self.loop, self.loop.strategy
        changes: dict[str, Any] = {}
        if control.lr is not None and control.lr != self.base_lr:
            self.base_lr = control.lr
            loop.apply_lr()
            changes["lr"] = control.lr
        if control.strategy == strategy.name and control.switch_id == self.applied_switch:
            live = {k: v for k, v in control.settings.items()
                    if k in strategy.settings.live and getattr(strategy.settings, k) != v}
            if live:
                strategy.update_settings(live)
                changes["settings"] = live
                # A new period moves the sync points; agree again at the next one (the same on every rank,
                # unlike the timing-based interval only rank 0 computes).
                interval = strategy.steps_to_control_point()
        if changes:
            loop.sender.event(kinds.CHANGED, step=loop.step, strategy=strategy.name, **changes)
        return interval

    def _agree(self, local: ControlState) -> tuple[ControlState, int]:
        """Rank 0's control state and agreement interval on every rank (each its own without a group)."""
        if not self.loop.strategy.traits.uses_process_group:
            return local, 1
        message = self.loop.comm.broadcast_json(
            {"control": local.to_message(), "interval": self._control_interval()} if self.task.rank == 0 else None)
        return ControlState.from_message(message["control"]), message["interval"]

    def _settle(self) -> None:
        """Let the strategy finish what it has in flight on the process group before the ranks exchange
        control messages on it (`Strategy.settle`)."""
        self.settled_s += self.loop.strategy.settle(self.loop.context)

    def take_settled_s(self) -> float:
        """The seconds this control point waited on the strategy's exchange since last asked: the step's
        record counts them as communication, not as a wait for control."""
        settled, self.settled_s = self.settled_s, 0.0
        return settled

    def _control_interval(self) -> int:
        """Steps until the next agreement: about CONTROL_AGREEMENT_S of training, on the strategy's grid."""
        strategy = self.loop.strategy
        alignment, first = strategy.control_alignment(), strategy.steps_to_control_point()
        step_s = self.loop.recent_step_s or CONTROL_AGREEMENT_S
        multiples = max(1, round(self.agreement_s / (step_s * alignment)))
        return min(first + (multiples - 1) * alignment, max(first, MAX_CONTROL_INTERVAL_STEPS))

    # --- rendezvous and switch ------------------------------------------------------------------------

    def _rendezvous(self, at_end: bool, stopping: bool = False) -> Decision:
        """Meet every other rank (see `switching`); all return the same decision."""
        if not self.loop.strategy.traits.uses_process_group:
            # The ranks of an asynchronous strategy run at their own pace: one out of steps (or at a switch)
            # may be far ahead of another on a thin link. They first meet without a deadline (a lost peer
            # ends the wait through `superseded`), so that the collective below never waits out its timeout
            # on a peer that is only behind (seen: `async` p4 at 20 Mbit/s, issue 46).
            self.meetings += 1
            if not self.loop.comm.meet(self.meetings, self.superseded):
                raise Superseded
        self._settle()
        latest = self.poller.latest()
        newest = latest if latest.version > self.control.version else self.control
        position = Position(self.loop.step, at_end, stopping, newest.to_message())
        positions = [Position.from_message(m) for m in self.loop.comm.all_gather_json(position.to_message())]
        decision = decide(positions, self.applied_switch, self.known_checkpoint)
        if decision.newest["version"] > self.control.version:  # e.g. the lr the next strategy starts with
            self.control = ControlState.from_message(decision.newest)
        if not self.loop.strategy.traits.uses_process_group:
            # Ranks of a parameter-server run read checkpoint requests on their own; from here on they
            # agree on the newest (a switch to a process-group strategy needs them to).
            self.known_checkpoint = max(self.known_checkpoint, decision.newest.get("checkpoint_id", 0))
        elif decision.checkpoint is not None and not decision.stop:
            self.known_checkpoint, self.pending_checkpoint = decision.checkpoint, decision.checkpoint
            self.checkpoint_at = decision.target_step
        return decision

    def _switch(self) -> None:
        """Change strategy on every rank at this step, carrying the weights and optimizer state over."""
        loop = self.loop
        request, context, old = self.pending, loop.context, loop.strategy
        started = time.perf_counter()
        parts: dict[str, float] = {}  # where the switch's time went (on a slow link: the exchanges in it)

        marks = [started]

        def lap(part: str) -> None:
            marks.append(time.perf_counter())
            parts[part] = round(marks[-1] - marks[-2], 3)

        before = fingerprint(flatten(list(context.model.parameters())))
        new_class = get_strategy(request.strategy)
        # Between two local-SGD strategies each worker goes on with its own optimizer state and, where the
        # old one keeps a common base and the new one can start from it, its own weights: what it would
        # have gone on with, and no model-sized exchange to bring the workers together first.
        own = old.traits.own_optimizer_states and new_class.traits.own_optimizer_states
        common = old.common_base(context) if own and new_class.traits.takes_own_weights else None
        if common is None:
            old.finish(context)  # common weights: averaged, or the server's
        lap("finish")
        carried = old.carry_out(context, own_state=own)
        carried.common = common
        lap("carry_out")
        loop.comm.barrier()  # every rank holds the carried state before the old services go
        old.close()
        lap("close")
        settings = make_settings(request.strategy, request.settings)
        new = new_class(settings)
        context.optimizer = new.local_optimizer(context.job, context.model.parameters())
        if self.control.lr is not None:
            self.base_lr = self.control.lr
        loop.apply_lr()
        new.carry_in(context, carried)
        new.setup(context)
        lap("setup")
        loop.strategy, self.applied_switch, self.pending = new, request.switch_id, None
        # The fingerprints let anyone check from the metrics that every worker starts the new strategy
        # from the same, carried-over weights (or, each with its own, over the same common base).
        loop.sender.event(kinds.SWITCHED, step=loop.step, switch_id=request.switch_id,
                          settings=dataclasses.asdict(settings), took_s=time.perf_counter() - started, parts_s=parts,
                          carried_optimizer_state=sorted(carried.optimizer_state), weights_before=before,
                          weights_after=fingerprint(flatten(list(context.model.parameters()))),
                          optimizer_state_after=_state_print(carried.optimizer_state),
                          common_weights=fingerprint(common) if common is not None else None,
                          **{"from": old.name, "to": new.name})


def _state_print(state: dict[str, Any]) -> list[float] | None:
    """The carried optimizer state's fingerprint (its tensors), to tell a common state from each worker's own."""
    tensors = [value for value in state.values() if isinstance(value, torch.Tensor)]
    return fingerprint(flatten(tensors)) if tensors else None
