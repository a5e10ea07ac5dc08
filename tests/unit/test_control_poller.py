"""The worker-side control poller (`workbench.plane.control.ControlPoller`) outlives what its Dask client does
when the worker loses its scheduler. No cluster: the Variable is a stand-in for that one case."""
from __future__ import annotations

import threading

from workbench.plane import control
from helpers import wait_until


class _ClosingVariable:
    """What a worker's `Variable.get` returned on the lab once the worker's scheduler connection broke:
    an unawaited coroutine (its client had gone asynchronous while closing), then a real message."""

    def __init__(self, name: str, client: object = None) -> None:
        self.calls = 0

    def get(self, timeout: float) -> object:
        self.calls += 1
        if self.calls <= 3:
            async def _get() -> None:
                return None
            return _get()
        return control.ControlState(version=7).to_message()


def test_a_coroutine_from_a_closing_client_neither_kills_the_poller_nor_counts_as_a_state(monkeypatch):
    died: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda hook: died.append(hook.exc_value))
    monkeypatch.setattr(control, "Variable", _ClosingVariable)
    poller = control.ControlPoller(client=None, run_id="r", interval_s=0.01)
    try:
        wait_until(lambda: poller.latest().version == 7, timeout_s=10)
        assert poller._variable.calls > 3 and not died
    finally:
        poller.close()
