"""A run's checkpoints on the client: when to ask the workers for one, fetching what rank 0 left, and
writing it atomically, newest only, never one holding NaN or infinity.

The checkpoint format and the file operations are `plane/checkpoint_format.py`'s; this is the run's side of it:
which checkpoint is the latest (what a regroup or a resume goes on from) and where it was written.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from queue import SimpleQueue
from typing import Any

from workbench.plane import checkpoint_format as checkpoints, kinds


def age(checkpoint: dict[str, Any]) -> tuple[int, int, bool]:
    """Orders checkpoints of one run: later groups, then later steps, then a group's final one."""
    return checkpoint.get("generation", -1), checkpoint["step"], bool(checkpoint.get("final"))


class CheckpointStore:
    """The run's latest checkpoint (`latest`, `info`), and the thread that fetches and writes new ones."""

    def __init__(self, latest: dict[str, Any] | None, every_s: float | None) -> None:
        self.latest = latest  # what the run goes on from after a loss
        self.holder: str | None = None  # the worker that keeps `latest` in memory too (the one it came from)
        self.holders: set[str] = set()  # every worker that kept one (each keeps its newest until the run ends)
        self.info: dict[str, Any] | None = None  # the newest written: step, path, time, generation
        self.every_s = every_s
        self._lock = threading.Lock()  # the writer thread and the supervisor both store them
        self._ready: SimpleQueue = SimpleQueue()  # rank 0 has one to fetch (None: stop writing)
        self._next_due = math.inf
        self.path: Path | None = None
        self.publish: Callable[[dict[str, Any]], None] = lambda message: None

    def open(self, directory: Path, publish: Callable[[dict[str, Any]], None]) -> None:
        self.path, self.publish = directory / checkpoints.CHECKPOINT_FILE, publish
        if self.latest is not None:  # resumed: the checkpoint it goes on from is the latest
            self.info = {"step": self.latest["step"], "written": 0.0, "generation": None, "path": str(self.path)}

    def restart_timer(self) -> None:
        """A new group of workers: the next timed checkpoint is `every_s` from now."""
        self._next_due = time.monotonic() + (self.every_s or math.inf)

    def due(self) -> bool:
        """Whether a timed checkpoint is due now (then the timer starts again). Those every
        `checkpoint_every_steps` steps the workers take on their own, at exactly those steps."""
        if time.monotonic() < self._next_due:
            return False
        self.restart_timer()
        return True

    def ready(self, message: dict[str, Any]) -> None:
        """Rank 0 says it has left one (called on the client's IO loop: the writer thread fetches it)."""
        self._ready.put(message)

    def close(self) -> None:
        self._ready.put(None)

    def write_ready(self, client: Any, run_id: str, timeout_s: float, current: Callable[[], tuple[int, str | None]]) -> None:
        """Fetch each checkpoint rank 0 has left and write it; a thread's body, since fetching waits on
        a worker. `current()` says the group now training and its rank 0: an older group's is skipped."""
        while (message := self._ready.get()) is not None:
            generation, address = current()
            if message.get("generation") != generation or address is None:
                continue
            fetched = None
            try:
                fetched = client.submit(checkpoints.take_snapshot, run_id, workers=[address],
                                        allow_other_workers=False, pure=False)
                checkpoint = fetched.result(timeout=timeout_s)
            except Exception:
                continue  # rank 0 was lost with it: the previous checkpoint stands
            finally:  # the worker's copy goes now, not when the next one is fetched (or again if lost)
                if fetched is not None:
                    fetched.release()
            if checkpoint is not None:
                self.holders.add(address)
                self.store(checkpoint, holder=address)

    def store(self, checkpoint: dict[str, Any], holder: str | None = None) -> None:
        """Write a checkpoint atomically unless it holds NaN or infinity (the last good one is kept);
        `holder`: the worker it was taken from, which keeps it too."""
        if not checkpoints.all_finite(checkpoint["weights"]):
            self.publish({"kind": kinds.CHECKPOINT_REFUSED, "time": time.time(), "step": checkpoint["step"],
                          "reason": "non-finite weights"})
            return
        with self._lock:
            current = self.latest
            if current is not None and current is not checkpoint and age(current) > age(checkpoint):
                return  # an older one fetched late
            checkpoints.save(self.path, checkpoint)
            self.latest, self.holder = checkpoint, holder
            self.info = {"step": checkpoint["step"], "path": str(self.path), "written": time.time(),
                         "generation": checkpoint.get("generation")}
        self.publish({"kind": kinds.CHECKPOINT, "time": time.time(), "step": checkpoint["step"], "path": str(self.path),
                      "generation": checkpoint.get("generation"), "final": checkpoint.get("final", False)})
