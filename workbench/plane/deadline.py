"""Deadlines that set themselves: how long a wait on another worker may take, from what the run measured.

A worker that waits on a peer (a collective, the parameter server, the end-of-run meeting) gives up after
the run's collective timeout, and the client counts a worker that stays silent that long as stuck. One
fixed figure cannot fit every run: a run whose averaging period makes an exchange take minutes on a thin
link must not be declared lost, and a run stepping every 30 ms must not wait a minute to notice a peer
that hung. So unless the user fixes it, the timeout follows the running strategy's measurements:

* the longest wait a worker should see is the longest a peer takes between two points where it answers:
  a step (its compute and its exchange, `compute_s + comm_s`) or an exchange of its own, overlapped or
  not (`exchange_s`; a parameter server's round trip, `comm_total_s`);
* nothing is lowered before the running strategy's first exchange was measured: the steps between the
  syncs of `average` with a long period say nothing of an exchange that may take minutes;
* the timeout is HEADROOM times that, within [FLOOR_S, CEILING_S]: a wait ten times the longest seen is
  no longer a slow peer;
* steps are judged over the last WINDOW records, so that a faster link lowers the timeout again; an
  exchange is rare (one every period), so the longest since the strategy started is kept;
* rank 0's held-out evaluations hold the others at their next collective: the longest is kept, and a
  run that evaluates keeps the unmeasured timeout until its first evaluation was timed;
* it rises at once, and falls only below half of the timeout in force (no change on every wobble);
* a switch or a regroup starts the measurement again from UNMEASURED_S, the old fixed default.

Pure: `WaitBook` is fed step records and proposes; the client (`run/supervisor.py`) applies a proposal
through the run's control state, and each worker sets it on its process group (`worker/control_point.py`).
"""
from __future__ import annotations

import collections
from typing import Any

FLOOR_S = 15.0  # below this, a busy machine's pauses (a collection, a checkpoint) would read as a lost peer
CEILING_S = 1800.0  # torch's own default for gloo: a longer wait is a stuck run, whatever it measured
HEADROOM = 10.0  # the timeout over the longest wait measured
UNMEASURED_S = 60.0  # until MIN_STEPS steps of the running strategy were measured
MIN_STEPS = 8  # step records of the running strategy before the first measured timeout
WINDOW = 256  # step records over which the longest step is judged
LOWER_BELOW = 0.5  # a measured timeout under this share of the one in force replaces it
LEAVE_HEADROOM = 3.0  # a worker told to leave does so within this many of its longest measured waits...
LEAVE_FLOOR_S = 5.0  # ...or this, whichever is longer (leaving a group took 0.05-0.9 s in benchmarks/chaos.py)


def timeout_for(longest_wait_s: float) -> float:
    """The timeout a run whose longest measured wait is `longest_wait_s` should have."""
    return min(CEILING_S, max(FLOOR_S, HEADROOM * longest_wait_s))


def leave_within(in_force_s: float, longest_wait_s: float | None, silent_s: float) -> float:
    """How long the client waits, once it has ended a group, for a worker not known lost to leave before it
    counts the worker as stuck. `silent_s`: how long the worker has made no step.

    A worker silent for a whole timeout already (a stuck one: its peers gave up on it after that timeout)
    gets a few of its longest measured waits: it would leave at its next step or as its blocked collective
    is broken (`comm/collectives.py`), so it is found after one timeout and this, not after two. Any other
    worker (it stepped until the fault) gets the whole timeout in force, as does every worker while nothing
    was measured: a survivor still blocked on a lost peer is not stuck in its own code, and calling it lost
    would end a run that can go on."""
    if longest_wait_s is None or silent_s < in_force_s:
        return in_force_s
    return min(in_force_s, max(LEAVE_FLOOR_S, LEAVE_HEADROOM * longest_wait_s))


def wait_of(record: dict[str, Any]) -> tuple[float, float]:
    """(the step's own time, its exchange's time) from a step record; 0.0 where a field is missing. A
    control point's wait (`wait_s`: a pause, the user's) is not a wait on a peer."""
    step = (record.get("compute_s") or 0.0) + (record.get("comm_s") or 0.0)
    exchange = max(record.get("exchange_s") or 0.0, record.get("comm_total_s") or 0.0)
    return step, exchange


class WaitBook:
    """The waits measured under the running strategy (fed each step record), and the timeout they call for."""

    def __init__(self) -> None:
        self.strategy: str | None = None
        self.steps: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.longest_exchange_s = 0.0
        self.measured = 0
        self.exchanged = False  # the strategy's first exchange was measured
        self.longest_evaluation_s = 0.0  # whatever the strategy: rank 0's evaluations cost the same
        self.evaluations = 0

    def add_evaluation(self, record: dict[str, Any]) -> None:
        """One 'eval' event: the time rank 0 spent on it (`eval_s`) is a wait for every other rank."""
        self.longest_evaluation_s = max(self.longest_evaluation_s, record.get("eval_s") or 0.0)
        self.evaluations += 1

    def add(self, record: dict[str, Any]) -> None:
        """One step record; another strategy than the one measured starts the measurement again."""
        strategy = record.get("strategy")
        if strategy != self.strategy:
            self.restart(strategy)
        step, exchange = wait_of(record)
        self.steps.append(step)
        self.longest_exchange_s = max(self.longest_exchange_s, exchange)
        self.measured += 1
        self.exchanged = self.exchanged or any(record.get(f) is not None for f in ("exchange_s", "comm_total_s"))

    def restart(self, strategy: str | None = None) -> None:
        """Measure again (a switch, a regroup): what was measured says nothing of the new waits."""
        self.strategy = strategy
        self.steps.clear()
        self.longest_exchange_s = 0.0
        self.measured = 0
        self.exchanged = False

    def longest_wait_s(self) -> float | None:
        """The longest wait a peer should see now; None until MIN_STEPS records and one exchange were
        measured."""
        if self.measured < MIN_STEPS or not self.exchanged:
            return None
        return max(max(self.steps, default=0.0), self.longest_exchange_s, self.longest_evaluation_s)

    def propose(self, in_force_s: float, strategy: str, evaluates: bool = False) -> float | None:
        """The timeout to set instead of `in_force_s`, or None to keep it: raised at once, lowered only
        below LOWER_BELOW of it. None too while the records measured are not yet of `strategy`, the one
        the run asked for (a switch is made under the unmeasured timeout), and, for a run that
        `evaluates`, until its first evaluation was timed."""
        longest = self.longest_wait_s()
        if longest is None or strategy != self.strategy or (evaluates and not self.evaluations):
            return None
        wanted = timeout_for(longest)
        if wanted > in_force_s or wanted < LOWER_BELOW * in_force_s:
            return wanted
        return None


def policy(fixed_s: float | None) -> dict[str, Any]:
    """How a run's timeout is decided, for its config: the user's, or measured within its bounds."""
    if fixed_s is not None:
        return {"how": "set", "timeout_s": fixed_s}
    return {"how": "measured", "headroom": HEADROOM, "floor_s": FLOOR_S, "ceiling_s": CEILING_S,
            "unmeasured_s": UNMEASURED_S, "min_steps": MIN_STEPS, "window": WINDOW}


def describe(event: dict[str, Any]) -> str:
    """One line on the timeout in force, from the newest 'deadline' event: how long, and why."""
    timeout = f"{event['timeout_s']:.3g} s"
    if event.get("how") == "set":
        return f"timeout: {timeout}, as set (a worker silent for longer counts as lost)"
    if event.get("how") == "measured" and event.get("longest_wait_s") is not None:
        return (f"timeout: {timeout}, measured: {HEADROOM:g} times the longest step or exchange of "
                f"{event.get('strategy')} ({event['longest_wait_s']:.3g} s), within {FLOOR_S:g} s and "
                f"{CEILING_S:g} s")
    return f"timeout: {timeout} until {event.get('strategy')}'s steps and exchanges are measured"
