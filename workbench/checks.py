"""The one set of value checks: every parameter a user gives (job fields, run options, strategy settings,
dashboard options, CLI flags) is checked here, and a bad one raises `ConfigError` naming the parameter,
the value and what is allowed."""
from __future__ import annotations

import math
from typing import Any

from workbench.errors import ConfigError


def check_number(parameter: str, value: Any, minimum: float, integer: bool = False, strictly: bool = False,
                 below: float | None = None, none_means: str | None = None, unit: str = "") -> None:
    """A finite number (`integer`: a whole one) >= `minimum` (`strictly`: >), < `below` if given; None
    too when `none_means` says what None does."""
    if value is None and none_means is not None:
        return
    kind = ("an integer" if integer else "a finite number") + (f" of {unit}" if unit else "")
    allowed = f"{kind} {'>' if strictly else '>='} {minimum:g}" + (f" and < {below:g}" if below is not None else "")
    if none_means is not None:
        allowed += f", or None {none_means}"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or (integer and not float(value).is_integer()) or value < minimum or (strictly and value == minimum) \
            or (below is not None and value >= below):
        raise ConfigError(parameter, value, allowed)


def check_positive_int(parameter: str, value: Any) -> None:
    """An integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(parameter, value, "an integer >= 1")


def check_positive_number(parameter: str, value: Any) -> None:
    """A finite number > 0."""
    check_number(parameter, value, 0, strictly=True)


def check_bool(parameter: str, value: Any, meaning: str = "True or False") -> None:
    if not isinstance(value, bool):
        raise ConfigError(parameter, value, meaning)


def check_run_options(collective_timeout_s: Any, checkpoint_every_steps: Any, checkpoint_every_s: Any,
                      min_workers: Any, auto_join: Any, queue: Any) -> None:
    """The options of `train()` / `resume()` beside the job and the strategy."""
    if collective_timeout_s is not None:  # None: measured (plane/deadline.py)
        check_number("collective_timeout_s", collective_timeout_s, 0, strictly=True, unit="seconds")
    if checkpoint_every_steps is not None:
        if isinstance(checkpoint_every_steps, bool) or not isinstance(checkpoint_every_steps, int) \
                or checkpoint_every_steps < 1:
            raise ConfigError("checkpoint_every_steps", checkpoint_every_steps,
                              "an integer >= 1, or None for no step-based checkpoints")
    check_number("checkpoint_every_s", checkpoint_every_s, 0, strictly=True, unit="seconds",
                 none_means="for no timed checkpoints")
    check_positive_int("min_workers", min_workers)
    check_bool("auto_join", auto_join)
    check_bool("queue", queue, "True (wait for free workers) or False (refuse at once)")
