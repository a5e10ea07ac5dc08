"""The worker loop's control point: where the ranks agree on pause, stop, learning rate, live settings,
checkpoints and strategy switches, and carry them out together.

Before each step the loop asks `ControlPoint.before_step` what to do: nothing, switch strategy, or
take a checkpoint (an action the loop carries out itself, then asks again). How the ranks agree is the
running strategy's policy (`worker/agreement.py`): in lockstep, rank 0's control state every few steps
(one broadcast, about every CONTROL_AGREEMENT_S of training), or each rank on its own. A switch or a
checkpoint makes every rank meet at a rendezvous (`switching.decide`, pure) and act at one agreed step;
a pause blocks here. Out of steps, `at_end` keeps meeting until every rank is. It also answers whether
the client has ended this group (`superseded`), so that a rank leaves instead of waiting.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from workbench.comm import collectives
from workbench.plane import kinds
from workbench.plane.control import ControlPoller, ControlState
from workbench.worker.agreement import Agreements
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


@dataclasses.dataclass(frozen=True)
class SwitchNow:
    """Action: change to the strategy `request` names, at this step (`strategy_switch.switch_strategy`)."""

    request: SwitchRequest


class TakeCheckpoint:
    """Action: take a checkpoint at this step (`LoopCheckpoints.take`)."""


TAKE_CHECKPOINT = TakeCheckpoint()
Action = SwitchNow | TakeCheckpoint


class ControlPoint:
    """One rank's side of the control agreement. It reads the worker loop (`loop`: its step, strategy,
    transport, metrics sender and checkpoints) and never changes it: what the ranks agreed on is returned
    as an action."""

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
        self.timeout_s = task.collective_timeout_s  # the timeout this rank's waits have now
        self.agreements = Agreements()
        self.agreement = self.agreements.for_strategy(loop.strategy)  # again after each switch (`switched`)

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

    def before_step(self) -> Action | None:
        """Control before this step: None to train it, or an action to carry out first (then ask again).
        Raises `StopRequested` or `Superseded`."""
        step = self.loop.step
        if self.superseded():
            raise Superseded
        self._follow_timeout()
        if self.pending is not None and step >= self.switch_at:
            return SwitchNow(self.pending)
        if self.pending is None and step >= self.next_agreement and step < self.task.total_steps:
            interval = self._agree_and_apply()
            if interval is TAKE_CHECKPOINT:
                return interval  # agreed again at this step, once it is taken
            self.next_agreement = step + interval
            if self.pending is not None and step >= self.switch_at:
                return SwitchNow(self.pending)
        if self.loop.checkpoints.due(self.pending_checkpoint, self.checkpoint_at):
            self.pending_checkpoint = None
            return TAKE_CHECKPOINT
        return None

    def at_end(self, stopped: bool) -> Action | None:
        """Out of steps (or stopping): meet the others until all are (None), first carrying out any
        switch or checkpoint agreed on for the step this worker has reached."""
        while True:
            if self.superseded():
                raise Superseded
            if self.pending is not None:
                return SwitchNow(self.pending)
            if self.pending_checkpoint is not None:
                self.pending_checkpoint = None
                return TAKE_CHECKPOINT
            decision = self._rendezvous(at_end=True, stopping=stopped)
            if decision.finished or (decision.stop and decision.all_at_end):
                return None
            if decision.switch is not None:
                self.pending, self.switch_at = decision.switch, decision.target_step

    # --- agreement --------------------------------------------------------------------------------------

    def _agree_and_apply(self) -> int | TakeCheckpoint:
        """All ranks take one control state at this step; returns the steps until the next agreement, or,
        on rank 0 of ranks agreeing on their own, a checkpoint the client asked for (taken at once, alone).

        Pausing blocks here until resumed, stopped or switched. A switch not made yet leads to a
        rendezvous first, paused or not: another worker may be waiting there already, having read the
        switch before the pause (or the other way round); a paused run pauses again after the switch.
        """
        loop = self.loop
        self._settle()  # before reading the control state: what arrived meanwhile is agreed on now
        control, interval = self._agree(self.poller.latest())
        if control.checkpoint_id > self.known_checkpoint and not self.agreement.checkpoints_together:
            self.known_checkpoint = control.checkpoint_id
            if self.task.rank == 0:  # taken alone, here and now (see `LoopCheckpoints.due`)
                return TAKE_CHECKPOINT
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

    def _follow_timeout(self) -> None:
        """The run's timeout in force (measured by the client, plane/deadline.py), on this rank's waits: its
        process group's collectives and the strategy's own. Each rank on its own: a timeout needs no
        agreement, only to be in force before the next wait."""
        latest = self.poller.latest().timeout_s
        wanted = latest if latest is not None else self.task.collective_timeout_s
        if wanted == self.timeout_s:
            return
        loop = self.loop
        self.timeout_s = wanted
        loop.comm.set_timeout(wanted)
        loop.context.timeout_s = wanted
        loop.strategy.follow_timeout(wanted)
        loop.sender.event(kinds.DEADLINE_APPLIED, step=loop.step, timeout_s=wanted)

    def _agree(self, local: ControlState) -> tuple[ControlState, int]:
        """The control state and agreement interval every rank takes (the policy's: rank 0's, or its own)."""
        return self.agreement.agree(self.loop.comm, self.task.rank, local, self._control_interval)

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
        # Ranks at their own pace first meet without a deadline (a lost peer ends the wait through
        # `superseded`): one out of steps may be far ahead of another on a thin link.
        if not self.agreement.meet(self.loop.comm, self.superseded):
            raise Superseded
        self._settle()
        latest = self.poller.latest()
        newest = latest if latest.version > self.control.version else self.control
        position = Position(self.loop.step, at_end, stopping, newest.to_message())
        positions = [Position.from_message(m) for m in self.loop.comm.all_gather_json(position.to_message())]
        decision = decide(positions, self.applied_switch, self.known_checkpoint)
        if decision.newest["version"] > self.control.version:  # e.g. the lr the next strategy starts with
            self.control = ControlState.from_message(decision.newest)
        if not self.agreement.checkpoints_together:
            # Ranks of a parameter-server run read checkpoint requests on their own; from here on they
            # agree on the newest (a switch to a process-group strategy needs them to).
            self.known_checkpoint = max(self.known_checkpoint, decision.newest.get("checkpoint_id", 0))
        elif decision.checkpoint is not None and not decision.stop:
            self.known_checkpoint, self.pending_checkpoint = decision.checkpoint, decision.checkpoint
            self.checkpoint_at = decision.target_step
        return decision

    def switched(self, request: SwitchRequest, strategy: Any) -> None:
        """The loop made the agreed switch to `strategy`: the next agreement follows at once (a pause asked
        for with the switch applies here), under the new strategy's way of agreeing."""
        self.agreement = self.agreements.for_strategy(strategy)
        self.applied_switch, self.pending = request.switch_id, None
        self.next_agreement = self.loop.step

    def take_switch_lr(self) -> None:
        """The learning rate the next strategy starts with: the newest agreed on (see `_rendezvous`)."""
        if self.control.lr is not None:
            self.base_lr = self.control.lr
