"""The client's side of the measured timeout (plane/deadline.py holds the measuring, pure).

At each supervision tick: what the run's waits call for is proposed by its metrics table, put in force
through the run's control state (each worker sets it on its waits at its next step), and every change of
the timeout in force, measured, back to unmeasured after a switch or a regroup, or set by the user, is
said once as a 'deadline' event: the CLI, the notebook panel and the dashboard show the newest.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from workbench.plane import deadline, kinds


def in_force(measured_s: float | None, fixed_s: float | None) -> float:
    """The timeout in force: the one measured (in the control state), else the user's, else unmeasured."""
    if measured_s is not None:
        return measured_s
    return fixed_s if fixed_s is not None else deadline.UNMEASURED_S


class TimeoutKeeper:
    """Owns nothing but what it last said; the timeout itself lives in the control state."""

    def __init__(self) -> None:
        self.shown: float | None = None  # the timeout in force the last 'deadline' event said

    def follow(self, table: Any, control: Any, publish: Callable[[dict[str, Any]], None], fixed_s: float | None,
               evaluates: bool) -> None:
        """`fixed_s`: the user's timeout (None: measured); `evaluates`: the run evaluates on held-out data."""
        state = control.state
        now = in_force(state.timeout_s, fixed_s)
        proposal, longest = table.deadline_proposal(now, state.strategy, evaluates)
        if proposal is not None and fixed_s is None:
            state = control.update(timeout_s=proposal)
            now = proposal
        if now == self.shown:
            return
        self.shown = now
        how = "set" if fixed_s is not None else "measured" if state.timeout_s is not None else "unmeasured"
        publish({"kind": kinds.DEADLINE, "time": time.time(), "timeout_s": now, "how": how,
                 "longest_wait_s": longest if how == "measured" else None, "strategy": state.strategy})
