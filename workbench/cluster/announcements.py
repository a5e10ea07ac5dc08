"""Runs announce themselves on the scheduler, and take control requests from other clients.

A run's owning client logs `run-registered` and `run-status` messages on one cluster-wide event topic,
so any other client (the team dashboard) can list the runs on a cluster, including ones started before
it connected (the scheduler keeps the last messages of each topic). Another client asks the owner to
pause, resume, stop, change the learning rate or switch strategy by logging a control request on the
run's request topic; the owner carries it out through the same public methods as the notebook and
records who asked. Deciding *who may ask* is the asking side's job (the dashboard checks its signed-in
user's role); anyone who can reach the scheduler can already run code on the cluster.
"""
from __future__ import annotations

import uuid
from typing import Any

from workbench.errors import ConfigError

RUNS_TOPIC = "workbench-runs"

# What another client may ask a run to do, and the arguments each action takes.
CONTROL_ACTIONS: dict[str, tuple[str, ...]] = {
    "pause": (), "resume": (), "stop": (), "set_lr": ("lr",), "switch": ("strategy", "settings"),
    "pin": (),  # strategy='auto': keep the current strategy
}


def requests_topic(run_id: str) -> str:
    """The event topic a run's owner listens on for control requests."""
    return f"workbench-requests-{run_id}"


def control_request(action: str, by: str | None, **arguments: Any) -> dict[str, Any]:
    """A control request message: validated shape, a fresh id to match the owner's answer with."""
    if action not in CONTROL_ACTIONS:
        raise ConfigError("action", action, f"one of {', '.join(CONTROL_ACTIONS)}")
    expected = set(CONTROL_ACTIONS[action])
    if set(arguments) != expected and not (action == "switch" and set(arguments) == {"strategy"}):
        raise ConfigError("arguments", sorted(arguments), f"{action} takes {sorted(expected) or 'no arguments'}")
    return {"action": action, "by": by or "anonymous", "request_id": uuid.uuid4().hex, "arguments": arguments}


def send_control_request(client: Any, run_id: str, action: str, by: str | None, **arguments: Any) -> str:
    """Ask the owner of `run_id` to carry out `action`; returns the request id (the answer arrives as a
    `control-request` record on the run's metrics topic, and lands in its run directory)."""
    request = control_request(action, by, **arguments)
    client.log_event(requests_topic(run_id), request)
    return request["request_id"]
