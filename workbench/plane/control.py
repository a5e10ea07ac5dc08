"""The control plane: pause, stop, learning rate, live strategy settings and strategy switches, from
client to workers.

The client writes a `ControlState` (a small dict) into a named Dask `Variable` per run; each worker
polls it in a background thread so the training step never waits on the scheduler. Workers of a
process-group strategy then agree on rank 0's view at chosen steps, so all apply a change at one step.
"""
from __future__ import annotations

import dataclasses
import inspect
import threading
from collections.abc import Callable
from typing import Any

from distributed import Variable


@dataclasses.dataclass
class ControlState:
    """What the workers should be doing; `version` grows with every change."""

    version: int = 0
    paused: bool = False
    stop: bool = False
    lr: float | None = None
    strategy: str = ""  # the strategy the run should be using
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # that strategy's settings
    switch_id: int = 0  # switches asked for so far; a worker that has made fewer has one to make
    checkpoint_id: int = 0  # checkpoints asked for so far (besides those every N steps)
    generation: int = 0  # the group of workers that should train; an older group's workers leave at once
    regroup: bool = False  # with stop: end this group cleanly so that the run goes on with other workers
    timeout_s: float | None = None  # the timeout measured for the running strategy; None: the task's own

    def to_message(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> ControlState:
        return cls(**message)


def variable_name(run_id: str) -> str:
    return f"workbench-control-{run_id}"


class ControlWriter:
    """Client side: the single writer of a run's control state."""

    def __init__(self, client: Any, run_id: str, initial: ControlState) -> None:
        self._variable = Variable(variable_name(run_id), client=client)
        self._lock = threading.Lock()
        self.state = initial
        self._variable.set(self.state.to_message())

    def update(self, **changes: Any) -> ControlState:
        with self._lock:
            settings = {**self.state.settings, **changes.pop("settings", {})}
            self.state = dataclasses.replace(self.state, version=self.state.version + 1, settings=settings, **changes)
            self._variable.set(self.state.to_message())
            return self.state

    def switch(self, strategy: str, settings: dict[str, Any]) -> ControlState:
        """Ask for a live switch to `strategy` with (all of) its `settings`. What was measured of the old
        strategy's waits says nothing of the new one's: the switch is made under the task's own timeout."""
        with self._lock:
            self.state = dataclasses.replace(self.state, version=self.state.version + 1, strategy=strategy,
                                             settings=dict(settings), switch_id=self.state.switch_id + 1,
                                             timeout_s=None)
            self._variable.set(self.state.to_message())
            return self.state

    def delete(self) -> None:
        try:
            self._variable.delete()
        except Exception:  # the scheduler may already be gone at shutdown
            pass


class ControlPoller:
    """Worker side: a daemon thread keeping the latest control state in memory."""

    def __init__(self, client: Any, run_id: str, interval_s: float = 0.1,
                 released: Callable[[], bool] = lambda: False) -> None:
        self._variable = Variable(variable_name(run_id), client=client)
        self._released_check = released
        self._released = False
        self._interval_s = interval_s
        self._latest = ControlState()
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._after_poll: Callable[[], Any] = lambda: None
        self._thread = threading.Thread(target=self._poll, name="workbench-control", daemon=True)
        self._thread.start()

    def latest(self) -> ControlState:
        return self._latest

    def released(self) -> bool:
        """Whether the task this poller serves is no longer wanted by the scheduler (its client is gone)."""
        return self._released

    def wait_for_change(self, version: int, timeout_s: float) -> ControlState:
        """Block until a state newer than `version` arrives or `timeout_s` passes; return the latest."""
        with self._changed:
            self._changed.wait_for(lambda: self._latest.version > version, timeout=timeout_s)
            return self._latest

    def after_each_poll(self, callback: Callable[[], Any]) -> None:
        """Call `callback` on the poller's thread after every poll (to act while the training thread is blocked)."""
        self._after_poll = callback

    def close(self) -> None:
        self._stopping.set()
        self._thread.join(timeout=2)

    def _poll(self) -> None:
        while not self._stopping.is_set():
            try:
                message = self._variable.get(timeout=5)
            except Exception:  # scheduler busy or variable not yet visible: try again next tick
                message = None
            if inspect.iscoroutine(message):
                # A client closing under the poller (its worker lost the scheduler) answers with an
                # unawaited coroutine instead of raising: nothing came, and the thread must not die.
                message.close()
                message = None
            try:
                self._released = self._released or self._released_check()
            except Exception:  # the worker's state is being torn down
                pass
            if message is not None:
                state = ControlState.from_message(message)
                if state.version > self._latest.version:
                    with self._changed:
                        self._latest = state
                        self._changed.notify_all()
            try:
                self._after_poll()
            except Exception:  # never let a callback end the polling
                pass
            self._stopping.wait(self._interval_s)
