"""A run's status and how it ended, with one owner: which status may follow which, decided in one place
under one lock; the error and the final weights set through two narrow calls.

The kernel (pause, resume, stop), the supervisor thread (started, ended) and the thread serving other
clients' requests all change a run's status. Each asks `Lifecycle.move`; a run that has ended stays
ended (a pause arriving as the run finishes must not leave it looking paused), and a move the table
does not allow is a bug of ours, said at once. The supervisor says why a run failed (`fail_with`) and
what it ended with (`keep_final_weights`); everyone else reads them.
"""
from __future__ import annotations

import threading
from typing import Any

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
    """The status of one run (`move` is the only way to change it), its error and its final weights."""

    def __init__(self) -> None:
        self._status = "created"
        self._lock = threading.Lock()
        self._error: str | None = None
        self._diverged = False
        self._final_weights: dict[str, Any] | None = None

    @property
    def status(self) -> str:
        return self._status

    @property
    def error(self) -> str | None:
        """Why the run failed (or is failing: set before the status moves to 'failed'), for a person."""
        return self._error

    @property
    def diverged(self) -> bool:
        """Whether it failed because the weights or the loss became NaN or infinite."""
        return self._diverged

    @property
    def final_weights(self) -> dict[str, Any] | None:
        """The weights the run ended with (finished or stopped), or None."""
        return self._final_weights

    def fail_with(self, error: str, diverged: bool = False) -> None:
        """Say why the run fails; its status moves once everything is written."""
        self._error, self._diverged = error, self._diverged or diverged

    def keep_final_weights(self, weights: dict[str, Any] | None) -> None:
        self._final_weights = weights

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
