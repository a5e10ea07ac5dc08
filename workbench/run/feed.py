"""What a run hears and says on the client: its metrics topic into the table and the run directory,
records of the client's own (a lost worker, a regroup, a checkpoint) onto that topic, and the loss
watch's warnings.

Messages arrive on the client's IO-loop thread, where nothing may block: they are stored, appended to
the run directory as they come (no data lost if the client dies later), and anything needing a blocking
call (publishing a warning, fetching a checkpoint) is queued for the supervisor's or the writer's thread.
"""
from __future__ import annotations

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

    def open(self, client: Any, run_id: str, directory: Any) -> None:
        self.client, self.run_id, self.directory = client, run_id, directory

    def new_generation(self, generation: int) -> None:
        with self.changed:
            self.generation, self.finished_ranks = generation, set()

    def on_message(self, event: tuple[float, dict[str, Any]]) -> None:
        # Runs on the client's IO-loop thread: store and append, nothing blocking.
        for message in messages_in(event[1]):
            self._on_one(message)

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
        """A record of the client's own on the run's topic, so that the run directory and every viewer
        get it; kept here directly when the scheduler is unreachable."""
        message = wire_form(message)  # as every viewer reads it, this client included
        try:
            self.client.log_event(topic(self.run_id), message)
        except Exception:
            self.on_message((time.time(), message))

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
        for warning in self._taken_warnings():
            self.publish(warning)

    def publish_leftover_warnings(self) -> None:
        """Warnings from the last records, once this client no longer hears its own topic: kept here
        directly, and sent for the other viewers."""
        for warning in map(wire_form, self._taken_warnings()):
            self.on_message((time.time(), warning))
            try:
                self.client.log_event(topic(self.run_id), warning)
            except Exception:
                pass


def announce(client: Any, message: dict[str, Any]) -> None:
    """Tell every client on the cluster (the team dashboard) about a run: registered, or a new status."""
    try:
        client.log_event(RUNS_TOPIC, wire_form(message))
    except Exception:  # the scheduler may be gone at shutdown; the run directory still has everything
        pass
