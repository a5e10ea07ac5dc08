"""Agreeing on a live strategy switch: the pure decision the workers take together at a rendezvous.

Workers of an asynchronous strategy run at different steps and read the control state at different
moments. A worker that sees a switch request, or reaches the end of its steps, calls a rendezvous: an
all-gather of every worker's `Position`. Each call on one worker meets exactly one call on every other
(each worker eventually sees the request or ends), and all take the same `decide()` of the positions:

- stop everyone, if any worker is stopping or the newest control state says stop;
- otherwise switch to the newest control state's strategy, if its switch has not been made yet, at the
  largest step any worker has reached (the others train up to it first, under the old strategy);
- otherwise, once every worker is at its end, finish.

A checkpoint asked for by the client (its `checkpoint_id` above the one the workers know) is taken by
every worker at the same largest step, the same way.

The newest control state (highest version) decides, so every worker uses the same strategy and settings
even if some read an older state before a late change.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class SwitchRequest:
    """The strategy every worker changes to, counted by `switch_id` (the how-many-th switch of the run)."""

    switch_id: int
    strategy: str
    settings: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Position:
    """What one worker brings to a rendezvous."""

    step: int  # steps done
    at_end: bool  # out of steps, or stopping
    stopping: bool
    control: dict[str, Any]  # the newest control state it has read (`ControlState.to_message()`)

    def to_message(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> Position:
        return cls(**message)


@dataclasses.dataclass(frozen=True)
class Decision:
    stop: bool
    switch: SwitchRequest | None  # made by all workers once they reach `target_step`
    target_step: int
    all_at_end: bool
    newest: dict[str, Any]  # the newest control state any worker had read
    checkpoint: int | None = None  # a checkpoint asked for, taken by all workers at `target_step`

    @property
    def finished(self) -> bool:
        """Every worker is done and nothing is left to switch: the run may end."""
        return self.all_at_end and self.switch is None


def decide(positions: list[Position], applied_switch_id: int, known_checkpoint_id: int = 0) -> Decision:
    """The one decision every worker takes from the same gathered positions."""
    if not positions:
        raise ValueError("a rendezvous needs the position of at least one worker")
    newest = max((p.control for p in positions), key=lambda control: control.get("version", 0))
    stop = any(p.stopping for p in positions) or bool(newest.get("stop"))
    switch = None
    if not stop and newest.get("switch_id", 0) > applied_switch_id:
        switch = SwitchRequest(newest["switch_id"], newest["strategy"], dict(newest.get("settings", {})))
    checkpoint = newest.get("checkpoint_id", 0)
    return Decision(stop=stop, switch=switch, target_step=max(p.step for p in positions),
                    all_at_end=all(p.at_end for p in positions), newest=newest,
                    checkpoint=checkpoint if checkpoint > known_checkpoint_id else None)
