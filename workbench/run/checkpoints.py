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
from workbench.plane.checkpoint_format import age
from workbench.run.launcher import scatter_to_each


class CheckpointStore:
    """The run's latest checkpoint (`latest`, `info`), and the thread that fetches and writes new ones and
    sends each to the group's other workers to keep (`kept_by`)."""

    def __init__(self, latest: dict[str, Any] | None, every_s: float | None) -> None:
        self.latest = latest  # what the run goes on from after a loss
        self.kept_by: set[str] = set()  # the workers that keep `latest` in memory too (taken from, or sent it)
        self.holders: set[str] = set()  # every worker that kept one (each keeps its newest until the run ends)
        self.info: dict[str, Any] | None = None  # the newest written: step, path, time, generation
        self.every_s = every_s
        self._lock = threading.Lock()  # the writer thread and the supervisor both store them
        self._ready: SimpleQueue = SimpleQueue()  # rank 0 has one to fetch (None: stop writing)
        self._to_send: SimpleQueue = SimpleQueue()  # written, to send to the other workers (None: stop)
        self._next_due = math.inf
        self._closed = False  # the run has ended: nothing more is sent to be kept
        self.path: Path | None = None
        self.publish: Callable[[dict[str, Any]], None] = lambda message: None

    def open(self, directory: Path, publish: Callable[[dict[str, Any]], None]) -> None:
        self.path, self.publish = directory / checkpoints.CHECKPOINT_FILE, publish
        if self.latest is not None:  # resumed: the checkpoint it goes on from is the latest
            self.info = {"step": self.latest["step"], "written": 0.0, "generation": None, "path": str(self.path),
                         "kept_on": []}

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
        with self._lock:
            self._closed = True
        self._ready.put(None)

    def write_ready(self, client: Any, run_id: str, timeout_s: float, current: Callable[[], tuple[int, list[str]]]) -> None:
        """Fetch each checkpoint rank 0 has left, write it and send it to the group's other workers to
        keep; a thread's body, since fetching waits on a worker. `current()` says the group now training
        and its workers (rank 0 first): an older group's is skipped. The sending is another thread's: rank 0
        waits for each fetch, and a send to a worker lost meanwhile would hold up the next."""
        replicator = threading.Thread(target=self._send_newest, args=(client, run_id, timeout_s, current),
                                      name=f"workbench-checkpoint-copies-{run_id}", daemon=True)
        replicator.start()
        try:
            self._fetch_and_write(client, run_id, timeout_s, current)
        finally:
            self._to_send.put(None)

    def _fetch_and_write(self, client: Any, run_id: str, timeout_s: float,
                         current: Callable[[], tuple[int, list[str]]]) -> None:
        while (message := self._ready.get()) is not None:
            generation, addresses = current()
            if message.get("generation") != generation or not addresses:
                continue
            address = addresses[0]
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
                self.store(checkpoint, holder=address)
                if not checkpoint.get("final"):  # after a group's final one, no regroup can follow
                    self._to_send.put(checkpoint)

    def _send_newest(self, client: Any, run_id: str, timeout_s: float,
                     current: Callable[[], tuple[int, list[str]]]) -> None:
        """Send each checkpoint written to the other workers of its group, skipping one a newer one replaced
        meanwhile, or whose group has ended (a thread's body)."""
        while (checkpoint := self._to_send.get()) is not None:
            while not self._to_send.empty():  # a newer one, or the end, came while the last was sent
                newer = self._to_send.get()
                if newer is None:
                    return
                checkpoint = newer
            generation, addresses = current()
            if checkpoint is self.latest and checkpoint.get("generation") == generation:
                self.replicate(client, run_id, checkpoint, addresses[1:], timeout_s)

    def replicate(self, client: Any, run_id: str, checkpoint: dict[str, Any], addresses: list[str],
                  timeout_s: float) -> None:
        """Send `checkpoint` to `addresses` to keep in memory, as in-memory checkpointing systems keep
        copies on peers (Gemini, SOSP 2023): a regroup after rank 0's worker is lost then starts without
        the checkpoint crossing the link while the run waits (on the lab at 100 Mbit/s, 0.9-1.2 s of a
        1.7-2.1 s recovery). Here, off the run's path, it costs link time once per checkpoint. A worker
        that does not answer in `timeout_s` (lost meanwhile) is sent it again at the regroup, if it
        takes part. Each worker is sent its copy on its own (`launcher.scatter_to_each` says why)."""
        if not addresses or self._closed:
            return
        futures: list[Any] = []
        kept = []
        for address in addresses:  # one by one: a worker lost meanwhile costs only its own copy
            try:
                sent = scatter_to_each(client, checkpoint, [address], timeout_s)[address]
                futures.append(sent)
                futures.append(client.submit(checkpoints.keep_copy, run_id, sent, workers=[address],
                                             allow_other_workers=False, pure=False))
                if futures[-1].result(timeout=timeout_s):
                    kept.append(address)
            except Exception:
                continue  # lost meanwhile: a regroup sends the checkpoint where it is not kept
            finally:
                for future in futures:
                    future.release()
                futures.clear()
        with self._lock:
            self.holders.update(kept)
            closed = self._closed
            if self.latest is checkpoint:
                self.kept_by.update(kept)
                self.info = dict(self.info, kept_on=sorted(self.kept_by))
        if closed and kept:  # the run ended while they were sent: what the end freed, free here too
            try:
                client.run(checkpoints.forget, run_id, workers=kept, on_error="ignore")
            except Exception:
                pass  # the client or the workers gone too: nothing of the run left to free

    def all_holders(self) -> list[str]:
        """Every worker that kept one of the run's checkpoints (to free them when the run ends)."""
        with self._lock:
            return sorted(self.holders)

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
            self.latest, self.kept_by = checkpoint, {holder} if holder else set()
            self.holders.update(self.kept_by)
            self.info = {"step": checkpoint["step"], "path": str(self.path), "written": time.time(),
                         "generation": checkpoint.get("generation"), "kept_on": sorted(self.kept_by)}
        self.publish({"kind": kinds.CHECKPOINT, "time": time.time(), "step": checkpoint["step"], "path": str(self.path),
                      "generation": checkpoint.get("generation"), "final": checkpoint.get("final", False)})
