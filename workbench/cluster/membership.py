"""Cluster membership as the scheduler reports it: workers added and removed, for the runs of one client.

A small scheduler plugin logs `add-worker` and `remove-worker` on the `workbench-membership` event topic
the moment the scheduler learns of them (a killed worker process closes its connection, so a loss is
known within about a second). Not the scheduler's own `all` topic: it also carries events the scheduler
cannot serialise for a client (measured: a failed task's event holding a `WorkerState` closed the
subscribed client's connection). Dask keeps one handler per topic and client, so one dispatcher per
client serves every run of that client. `Roster` keeps one run's account of it: workers lost, joined.
"""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin

MEMBERSHIP_TOPIC = "workbench-membership"

Listener = Callable[[str, str], None]  # (action: 'add-worker' | 'remove-worker', worker address)

_dispatchers: weakref.WeakKeyDictionary[Any, _Dispatcher] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


class _Dispatcher:
    def __init__(self) -> None:
        self.listeners: list[Listener] = []

    def __call__(self, event: tuple[float, Any]) -> None:
        # On the client's event loop: listeners only note what happened.
        _, message = event
        if not isinstance(message, dict) or message.get("action") not in ("add-worker", "remove-worker"):
            return
        for listener in list(self.listeners):
            try:
                listener(message["action"], message.get("worker", ""))
            except Exception:  # one run's bug must not keep the others from hearing
                pass


class MembershipRelay(SchedulerPlugin):
    """Runs in the scheduler: tells subscribers of MEMBERSHIP_TOPIC about workers added and removed."""

    name = "workbench-membership"

    def add_worker(self, scheduler: Any, worker: str) -> None:
        scheduler.log_event(MEMBERSHIP_TOPIC, {"action": "add-worker", "worker": worker})

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        scheduler.log_event(MEMBERSHIP_TOPIC, {"action": "remove-worker", "worker": worker})


def _installed(dask_scheduler: Any) -> bool:
    return MembershipRelay.name in dask_scheduler.plugins


def install(client: Any) -> bool:
    """Put the relay in the scheduler (once per scheduler; again is harmless). False where the scheduler
    cannot import the workbench: lost workers are then noticed through their tasks alone."""
    try:
        if not client.run_on_scheduler(_installed):
            client.register_plugin(MembershipRelay(), name=MembershipRelay.name)
        return True
    except Exception:
        return False


def watch(client: Any, listener: Listener) -> Callable[[], None]:
    """Call `listener(action, address)` on every membership change; returns the function that stops it."""
    with _lock:
        dispatcher = _dispatchers.get(client)
        if dispatcher is None:
            install(client)
            dispatcher = _dispatchers[client] = _Dispatcher()
            client.subscribe_topic(MEMBERSHIP_TOPIC, dispatcher)
        dispatcher.listeners.append(listener)

    def stop() -> None:
        with _lock:
            if listener in dispatcher.listeners:
                dispatcher.listeners.remove(listener)

    return stop


class Roster:
    """One run's view of membership: the changes heard (queued on the client's event loop, where
    publishing cannot block), the run's workers the scheduler removed, and workers that joined."""

    def __init__(self) -> None:
        self._changes: SimpleQueue = SimpleQueue()
        self.lost: set[str] = set()  # addresses of the run's workers the scheduler removed
        self.joined: list[str] = []  # workers that joined the cluster during the run

    def heard(self, action: str, address: str) -> None:
        """The listener given to `watch`: notes the change for `take` at the supervisor's next tick."""
        self._changes.put((action, address, time.time()))

    def take(self, training: list[str], on_lost: Callable[[str, float], None],
             on_joined: Callable[[str, float], None]) -> None:
        """Go through the changes heard: a removed worker of `training` is lost (once); an added one not
        training has joined (a worker back on the same address is a new one)."""
        while True:
            try:
                action, address, when = self._changes.get_nowait()
            except Empty:
                return
            if action == "remove-worker":
                self.joined = [a for a in self.joined if a != address]
                if address in training and address not in self.lost:
                    self.lost.add(address)
                    on_lost(address, when)
            elif action == "add-worker" and address not in training:
                self.lost.discard(address)
                self.joined.append(address)
                on_joined(address, when)
