"""Exception types of the workbench: one per kind of failure, so callers can catch precisely.

Messages follow one rule: say what was passed, what is allowed, and how to fix it.
"""
from __future__ import annotations

from typing import Any


class WorkbenchError(Exception):
    """Base class of every error the workbench raises on purpose."""


class ConfigError(WorkbenchError, ValueError):
    """A job, strategy or cluster parameter is invalid; raised on the client before anything starts."""

    def __init__(self, parameter: str, value: Any, allowed: str, hint: str = "") -> None:
        self.parameter, self.value, self.allowed, self.hint = parameter, value, allowed, hint
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        message = f"{parameter}={shown} is not allowed: expected {allowed}"
        if hint:
            message += f". {hint}"
        super().__init__(message)


class ClusterError(WorkbenchError, RuntimeError):
    """The Dask cluster could not be started or reached, or lacks what the run needs."""


class TrainingError(WorkbenchError, RuntimeError):
    """A worker failed while training; the message carries the worker's traceback."""


class ResumeError(ConfigError):
    """A run directory or checkpoint cannot be resumed from (missing, unreadable, or another model's)."""


class DivergenceError(TrainingError):
    """The loss or the parameters became NaN or infinite; the message names the step and the worker."""
