"""What a run hears and says on the client: its metrics topic into the table and the run directory,
records of the client's own (a lost worker, a regroup, a checkpoint) onto that topic, and the loss
watch's warnings.

Messages arrive on the client's IO-loop thread, where nothing may block: they are stored, appended to
the run directory as they come (no data lost if the client dies later), and anything needing a blocking
call (publishing a warning, fetching a checkpoint) is queued for the supervisor's or the writer's thread.
"""
from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

from workbench.cluster.announcements import RUNS_TOPIC
from workbench.plane import kinds
from workbench.plane.metrics import MetricsTable, expand, messages_in, topic, wire_form
from workbench.run.health import LinkWatch, LossWatch


class RunFeed:
    """The run's metrics table, directory and topic; `changed` wakes whoever waits on what arrived."""

    def __init__(self, table: MetricsTable) -> None:
        self.table = table
        self.changed = threading.Condition()  # notified on every message
        self.client: Any = None
        self.run_id = ""
        self.directory: Any = None
        self.loss_watch: LossWatch | None = None
        self.link_watch: LinkWatch | None = None  # under a parameter server: would allreduce be faster?
        self.generation = -1
        self.finished_ranks: set[int] = set()  # of the current generation
        self.on_checkpoint_ready: Callable[[dict[str, Any]], None] = lambda message: None
        self.exports: Any = None  # export.Exports, when the run exports to TensorBoard or MLflow
        self._warnings: SimpleQueue = SimpleQueue()
        # The client's own records sent and not yet heard back, in their JSON form (NaN equal to itself):
        # they are kept at once by `publish`, so their echo is dropped.
        self._unechoed: collections.deque[str] = collections.deque(maxlen=1000)
        self._unechoed_lock = threading.Lock()

    def open(self, client: Any, run_id: str, directory: Any) -> None:
        self.client, self.run_id, self.directory = client, run_id, directory

    def new_generation(self, generation: int) -> None:
        with self.changed:
            self.generation, self.finished_ranks = generation, set()

    def on_message(self, event: tuple[float, dict[str, Any]]) -> None:
        # Runs on the client's IO-loop thread: store and append, nothing blocking.
        for message in messages_in(event[1]):
            if not self._own_echo(message):
                self._on_one(message)

    def _own_echo(self, message: dict[str, Any]) -> bool:
        if not self._unechoed or message.get("kind") in (kinds.STEPS, kinds.BATCHES):  # workers' alone
            return False
        form = json.dumps(message, sort_keys=True, default=str)
        with self._unechoed_lock:
            if form not in self._unechoed:
                return False
            self._unechoed.remove(form)
            return True

    def _on_one(self, message: dict[str, Any]) -> None:
        records = expand(message)
        self.table.add(records)
        self.directory.append(records)
        if self.exports is not None:
            self.exports.put(records)  # queued: written on the exports' own thread
        kind = message.get("kind")
        if kind == kinds.STEPS:
            watches = [watch for watch in (self.loss_watch, self.link_watch) if watch is not None]
            for record in records:
                for watch in watches:
                    warning = watch.observe(record)
                    if warning is not None:  # published by the supervisor: no blocking calls on this thread
                        self._warnings.put({**warning, "time": time.time(), "strategy": record.get("strategy")})
        if kind == kinds.CHECKPOINT_READY:
            self.on_checkpoint_ready(message)
        with self.changed:  # wakes `wait_for_step`, `wait_for_event` and the supervisor
            if kind in kinds.RANK_ENDED and message.get("generation", self.generation) == self.generation:
                self.finished_ranks.add(message["rank"])
            self.changed.notify_all()

    def publish(self, message: dict[str, Any]) -> None:
        """A record of the client's own: kept here at once, and sent on the run's topic so that every other
        viewer gets it. Not kept from its echo: the subscription travels on the client's batched stream
        while `log_event` is a direct call, so a record sent right after subscribing can reach the
        scheduler first and is then never echoed (a run's first `generation-started` went missing so)."""
        message = wire_form(message)  # as every viewer reads it, this client included
        form = json.dumps(message, sort_keys=True, default=str)
        with self._unechoed_lock:
            self._unechoed.append(form)
        self._on_one(message)
        try:
            self.client.log_event(topic(self.run_id), message)
        except Exception:  # the scheduler is unreachable: no echo will come
            with self._unechoed_lock:
                if form in self._unechoed:
                    self._unechoed.remove(form)

    def wait_for_ranks(self, ranks: int, timeout: float) -> None:
        """Wait (at most `timeout`) for `ranks` ranks' last messages: they may trail their results."""
        with self.changed:
            self.changed.wait_for(lambda: len(self.finished_ranks) >= ranks, timeout=timeout)

    def _taken_warnings(self) -> list[dict[str, Any]]:
        taken = []
        while True:
            try:
                taken.append(self._warnings.get_nowait())
            except Empty:
                return taken

    def publish_warnings(self) -> None:
        """The loss and link watches' warnings, queued on the IO-loop thread, kept and sent from here."""
        for warning in self._taken_warnings():
            self.publish(warning)



def announce(client: Any, message: dict[str, Any]) -> None:
    """Tell every client on the cluster (the team dashboard) about a run: registered, or a new status."""
    try:
        client.log_event(RUNS_TOPIC, wire_form(message))
    except Exception:  # the scheduler may be gone at shutdown; the run directory still has everything
        pass
