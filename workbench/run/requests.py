"""Control requests from other clients (a team dashboard, a teammate's notebook), carried out for a run.

A request arrives on the run's requests topic on the client's IO loop, where the blocking control calls
must not run: one thread carries requests out in the order they came, through the run's public methods
(so a remote pause is exactly a local one), and publishes each outcome on the run's metrics topic, where
it lands in the run directory and in every viewer.
"""
from __future__ import annotations

import threading
import time
from queue import SimpleQueue
from typing import Any

from workbench.cluster.announcements import CONTROL_ACTIONS, requests_topic
from workbench.errors import ConfigError
from workbench.plane import kinds


class RequestServer:
    """Serves one run's control requests until `close()`."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._queue: SimpleQueue = SimpleQueue()

    def start(self, client: Any, run_id: str) -> None:
        client.subscribe_topic(requests_topic(run_id), lambda event: self._queue.put(event[1]))
        threading.Thread(target=self._serve, name=f"workbench-requests-{run_id}", daemon=True).start()

    def close(self) -> None:
        self._queue.put(None)

    def _serve(self) -> None:
        while (request := self._queue.get()) is not None:
            self.carry_out(request)

    def carry_out(self, request: dict[str, Any]) -> None:
        """Carry out one request with the run's public methods, and publish the outcome."""
        run = self.run
        action, arguments = request.get("action"), dict(request.get("arguments") or {})
        try:
            if action in ("pause", "resume", "stop", "pin"):
                getattr(run, action)()
            elif action == "set_lr":
                run.set_lr(arguments.get("lr"))
            elif action == "switch":
                run.switch(arguments.get("strategy"), **(arguments.get("settings") or {}))
            else:
                raise ConfigError("action", action, f"one of {', '.join(CONTROL_ACTIONS)}")
            outcome: dict[str, Any] = {"ok": True, "error": None}
        except Exception as error:
            outcome = {"ok": False, "error": f"{type(error).__name__}: {error}".splitlines()[0]}
        message = {"kind": kinds.CONTROL_REQUEST, "time": time.time(), "action": action, "arguments": arguments,
                   "by": request.get("by"), "request_id": request.get("request_id"), **outcome}
        run.feed.publish(message)
