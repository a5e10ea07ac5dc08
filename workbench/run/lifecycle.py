"""A run's status, with one owner: which status may follow which, decided in one place under one lock.

The kernel (pause, resume, stop), the supervisor thread (started, ended) and the thread serving other
clients' requests all change a run's status. Each asks `Lifecycle.move`; a run that has ended stays
ended (a pause arriving as the run finishes must not leave it looking paused), and a move the table
does not allow is a bug of ours, said at once.
"""
from __future__ import annotations

import threading

FINISHED_STATES = ("finished", "stopped", "failed")

# What may follow each status. "running" -> "running" is a resume of a run that was not paused.
_NEXT = {
    "created": {"queued", "running", "failed"},
    "queued": {"running", "stopped", "failed"},
    "running": {"running", "paused", *FINISHED_STATES},
    "paused": {"running", "paused", *FINISHED_STATES},
}


def allowed(current: str, wanted: str) -> bool:
    """Whether a run may go from status `current` to `wanted`."""
    return wanted in _NEXT.get(current, ())


class Lifecycle:
    """The status of one run; `move` is the only way to change it."""

    def __init__(self) -> None:
        self._status = "created"
        self._lock = threading.Lock()

    @property
    def status(self) -> str:
        return self._status

    @property
    def ended(self) -> bool:
        return self._status in FINISHED_STATES

    def move(self, wanted: str, only_from: tuple[str, ...] | None = None) -> bool:
        """Go to `wanted`; False (nothing changes) once the run has ended, or when `only_from` is given
        and the status is not one of them. A move not in the table raises: it is a bug, not a race."""
        with self._lock:
            current = self._status
            if current in FINISHED_STATES or (only_from is not None and current not in only_from):
                return False
            if not allowed(current, wanted):
                raise RuntimeError(f"a run cannot go from '{current}' to '{wanted}'")
            self._status = wanted
            return True
