"""What the supervisor does when a group of workers ends: pure decisions over what it observed.

No cluster here: the supervisor (run/supervisor.py) gathers facts (which tasks are done, which failed
because their process died, which workers the scheduler still has, what the user asked for) and these
functions say who is lost, whether the run fails, stops, or goes on with whom, and how the workers'
errors read. `tests/unit/test_regroup.py` checks them without a cluster.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TaskEnd:
    """One rank's task as the supervisor found it once its group was told to end."""

    address: str
    done: bool
    process_died: bool = False  # failed with KilledWorker: its worker process went away


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What becomes of the run after a group ended: 'fail', 'stop', 'too-few' or 'regroup' (with `workers`)."""

    action: str
    workers: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()


def newly_lost(tasks: list[TaskEnd], known_lost: set[str], present: set[str], timeout_s: float) -> dict[str, str]:
    """Workers lost that the scheduler did not report, each with the reason: the process died, or the
    task is still busy after every timeout (stuck, in user code say)."""
    found = {}
    for task in tasks:
        if task.address in known_lost:
            continue
        if task.address not in present or task.process_died:
            found[task.address] = "its worker process died"
        elif not task.done:
            found[task.address] = f"stuck: no answer within {timeout_s:g} s"
    return found


# What a rank says when it gave up waiting on the others (gloo's collectives, the parameter server's calls
# and its bounded-staleness wait): the group stalled, no worker's own code failed.
STALL_WORDS = ("timed out waiting", "did not answer within", "no progress within", "s for the slowest worker to reach")


def stalled(errors: list[str]) -> bool:
    """Whether every failed rank failed only by giving up waiting on another: a link cut for longer than
    the timeout, or a peer paused that long (each side then times out on the other), rather than an error
    of the user's code or the workbench's."""
    return bool(errors) and all(any(words in error.lower() for words in STALL_WORDS) for error in errors)


def after_failure(addresses: list[str], lost: set[str], present: set[str], stop_requested: bool,
                  min_workers: int, only_stalled: bool = False) -> Verdict:
    """A worker failed or was lost. Nobody lost: the run fails with the workers' errors, unless the group
    `only_stalled` (every failure a timeout waiting on the others, see `stalled`): it then goes on with
    every worker still present, from the last checkpoint. Otherwise it goes on with the survivors, unless
    it was being stopped (it stops, keeping its last checkpoint) or fewer than `min_workers` are left."""
    if not lost:
        survivors = tuple(a for a in addresses if a in present)
        if only_stalled and not stop_requested and len(survivors) >= min_workers:
            return Verdict("regroup", survivors)
        return Verdict("fail")
    ordered = tuple(sorted(lost))
    survivors = tuple(a for a in addresses if a not in lost and a in present)
    if stop_requested:
        return Verdict("stop", survivors, ordered)
    if len(survivors) < min_workers:
        return Verdict("too-few", survivors, ordered)
    return Verdict("regroup", survivors, ordered)


def after_success(any_stopped: bool, regroup_to: list[str] | None, stop_requested: bool) -> Verdict:
    """Every task of the group returned. Stopped for a join (and not by the user): go on with the larger
    group; else the run has ended, 'stop'ped or finished ('finish')."""
    if regroup_to is not None and any_stopped and not stop_requested:
        return Verdict("regroup", tuple(regroup_to))
    return Verdict("stop" if any_stopped else "finish")


@dataclasses.dataclass(frozen=True)
class WorkerError:
    rank: int
    address: str
    type_name: str
    text: str
    traceback: str = ""


def failure_text(errors: list[WorkerError]) -> str:
    """The workers' errors as the run's error: the first to fail says why (the others mostly failed
    because it left, with a closed or reset connection), and an error every rank had is said once."""
    lines, seen = [], set()
    for error in errors:
        said = f"{error.type_name}: {error.text}"
        if said in seen:  # the same error on several ranks (a group that cannot form)
            lines.append(f"worker {error.rank} ({error.address}) failed: {error.type_name}: the same error\n")
            continue
        seen.add(said)
        lines.append(f"worker {error.rank} ({error.address}) failed: {said}\n" + error.traceback)
    lines.sort(key=lambda text: "Connection closed by peer" in text or "Connection reset" in text)
    return "\n".join(lines) or "the workers ended without a result"
