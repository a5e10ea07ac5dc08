"""How the ranks of the running strategy agree on control state: in lockstep or each on its own.

Two policies, one per kind of strategy, chosen when the strategy starts (and again after a switch, from
the new strategy's `uses_process_group` trait), so that the control point asks its policy instead of
branching on the strategy at every turn:

- `Lockstep` (allreduce, average, easgd): the ranks step together, so they take rank 0's control state
  every few steps (one broadcast) and take a checkpoint together at one agreed step.
- `Independent` (async, ssp): the ranks run at their own pace, each reads the control state itself at
  every step; rank 0 takes a checkpoint alone from the server; before a rendezvous they first meet
  without a deadline, as one may be far behind another on a thin link.
"""
from __future__ import annotations

from typing import Any, Callable

from workbench.plane.control import ControlState


class Lockstep:
    """Ranks that step together: rank 0's control state on every rank, checkpoints taken together."""

    checkpoints_together = True

    def agree(self, comm: Any, rank: int, local: ControlState, interval: Callable[[], int]) -> tuple[ControlState, int]:
        """Rank 0's control state and the steps to the next agreement, on every rank (one broadcast)."""
        message = comm.broadcast_json({"control": local.to_message(), "interval": interval()} if rank == 0 else None)
        return ControlState.from_message(message["control"]), message["interval"]

    def meet(self, comm: Any, give_up: Callable[[], bool]) -> bool:
        """Nothing to wait for before a rendezvous: the ranks are at the same step already."""
        return True

    def periodic_checkpoint(self, rank: int) -> bool:
        return True  # every rank adds its part at the same step


class Independent:
    """Ranks at their own pace: each its own control state at every step; rank 0 checkpoints alone."""

    checkpoints_together = False

    def __init__(self) -> None:
        # Rendezvous met so far, alike on every rank: each names its meeting point in the group's store.
        # One counter for the whole task, so that a later asynchronous strategy (after a switch) never
        # reuses a point an earlier one met at.
        self.meetings = 0

    def agree(self, comm: Any, rank: int, local: ControlState, interval: Callable[[], int]) -> tuple[ControlState, int]:
        return local, 1

    def meet(self, comm: Any, give_up: Callable[[], bool]) -> bool:
        """Wait, without a deadline, until every rank has come to this rendezvous; False when `give_up`
        (the group was ended). The collective after it then never waits out its timeout on a rank that is
        only behind (seen: `async` p4 at 20 Mbit/s, issue 46)."""
        self.meetings += 1
        return comm.meet(self.meetings, give_up)

    def periodic_checkpoint(self, rank: int) -> bool:
        return rank == 0  # from the server, never holding the others back


class Agreements:
    """The two policies of one rank, made once (the independent one keeps its meeting count)."""

    def __init__(self) -> None:
        self.lockstep, self.independent = Lockstep(), Independent()

    def for_strategy(self, strategy: Any) -> Lockstep | Independent:
        return self.lockstep if strategy.traits.uses_process_group else self.independent
