"""Pure bookkeeping of a parameter server: versions, each worker's fetches and clocks, staleness, and the
stale-synchronous (SSP) bound. No tensors and no I/O: the server actor is a thin shell around this.

Definitions used throughout (metrics, docs, tests):

* version: the number of updates the server has applied.
* staleness of a push: the versions applied between that worker's last fetch and its push, that is
  the updates its gradients did not see.
* clock: the number of push windows a worker has completed. Under SSP a worker at clock c may start
  its next window only while c - (slowest worker's clock) <= max_staleness; 0 is bulk-synchronous.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class PushReceipt:
    """What the server tells a worker about one applied push."""

    version: int  # server version after this push
    staleness: int  # versions applied since this worker's last fetch
    clock_gap: int  # this worker's clock minus the slowest active worker's clock
    slowest_clock: int  # the slowest active worker's clock (this worker's own when it is alone)


def ssp_allows(clock: int, clocks: Iterable[int], max_staleness: int) -> bool:
    """May a worker that has completed `clock` windows start the next one, given every worker's clock?"""
    slowest = min(clocks, default=clock)
    return clock - min(slowest, clock) <= max_staleness


class ServerBook:
    """Versions, fetches and clocks of one parameter-server shard; safe to call from several threads."""

    def __init__(self, workers: Iterable[int] = (), version: int = 0) -> None:
        self._lock = threading.Lock()
        self.version = version  # a resumed run's server goes on counting where it stopped
        self.fetched: dict[int, int] = {}  # worker -> version it last fetched
        self.clocks: dict[int, int] = {}  # active worker -> completed windows
        self.finished: set[int] = set()
        self.staleness_counts: dict[int, dict[int, int]] = {}  # worker -> {staleness: pushes}
        for worker in workers:
            self.join(worker)

    def join(self, worker: int, version: int | None = None) -> None:
        """A worker starts (at clock 0) holding the weights of `version` (default: the current one)."""
        with self._lock:
            self.fetched[worker] = self.version if version is None else version
            self.clocks.setdefault(worker, 0)
            self.staleness_counts.setdefault(worker, {})

    def fetch(self, worker: int) -> int:
        """Record that `worker` took the current weights; returns their version."""
        with self._lock:
            self.fetched[worker] = self.version
            return self.version

    def push(self, worker: int, clock: int | None = None) -> PushReceipt:
        """Record one update applied from `worker` (that completed `clock` windows)."""
        with self._lock:
            staleness = self.version - self.fetched.get(worker, 0)
            self.version += 1
            if clock is not None and worker not in self.finished:
                self.clocks[worker] = max(clock, self.clocks.get(worker, 0))
            counts = self.staleness_counts.setdefault(worker, {})
            counts[staleness] = counts.get(staleness, 0) + 1
            own = self.clocks.get(worker, clock or 0)
            slowest = min(min(self.clocks.values(), default=own), own)
            return PushReceipt(self.version, staleness, own - slowest, slowest)

    def exchange(self, worker: int, clock: int | None = None) -> PushReceipt:
        """A push followed at once by a fetch of the result (elastic averaging's exchange)."""
        receipt = self.push(worker, clock)
        self.fetch(worker)
        return receipt

    def finish(self, worker: int) -> None:
        """A worker is done: it no longer holds the others back."""
        with self._lock:
            self.finished.add(worker)
            self.clocks.pop(worker, None)

    def slowest_clock(self) -> float:
        with self._lock:
            return min(self.clocks.values(), default=math.inf)

    def may_proceed(self, worker: int, clock: int, max_staleness: int) -> bool:
        with self._lock:
            others = [c for w, c in self.clocks.items() if w != worker]
            return ssp_allows(clock, others + [clock], max_staleness)

    def all_finished(self, workers: Iterable[int]) -> bool:
        with self._lock:
            return set(workers) <= self.finished
