"""Which run holds which worker: leases and a queue, decided in one place, the scheduler.

A cluster a team shares must never let one run start on workers another is training on (two process
groups on one worker, or two stores racing for one port, destroy both runs). Before a run starts, its
client asks the scheduler for workers; a small scheduler plugin holds a `LeaseBook` and answers from it
on the scheduler's event loop, one request at a time, so two clients asking at the same moment are
decided atomically: one gets the workers, the other is refused (told who holds what) or waits in the
queue. Leases end when the run ends (every way it can: the run releases them), when its client is gone
(the scheduler's `remove_client`), and per worker when the worker leaves the cluster.

The queue is first come, first served: a waiting run is never overtaken, neither by a newcomer nor by
a running run that wants more workers, so no run waits forever behind smaller ones.

This module imports nothing of the workbench: its scheduler-side code travels to the scheduler by value,
so a scheduler that cannot import the workbench (a stock image) still decides leases.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import cloudpickle
from distributed.diagnostics.plugin import SchedulerPlugin

PLUGIN_NAME = "workbench-leases"


@dataclasses.dataclass
class Lease:
    """Workers a run holds."""

    run_id: str
    owner: str
    client: str  # the Dask client id that asked; the lease ends with that client
    workers: list[str]
    since: float


@dataclasses.dataclass
class Waiting:
    """A run waiting in the queue for `wanted` free workers."""

    run_id: str
    owner: str
    client: str
    wanted: int
    since: float


class LeaseBook:
    """The leases and the queue of one cluster: pure bookkeeping (no Dask), so it is tested alone.

    Every method takes the workers present in the cluster where it matters; answers are plain dicts
    that travel to clients as they are.
    """

    def __init__(self) -> None:
        self.leases: dict[str, Lease] = {}
        self.queue: list[Waiting] = []

    # --- questions ------------------------------------------------------------------------------------

    def holder(self, worker: str) -> str | None:
        for lease in self.leases.values():
            if worker in lease.workers:
                return lease.run_id
        return None

    def free(self, present: list[str]) -> list[str]:
        held = {worker for lease in self.leases.values() for worker in lease.workers}
        return [worker for worker in sorted(present) if worker not in held]

    def position(self, run_id: str) -> int | None:
        """1 for the run first in the queue; None when it is not waiting."""
        for index, waiting in enumerate(self.queue):
            if waiting.run_id == run_id:
                return index + 1
        return None

    def view(self, present: list[str]) -> dict[str, Any]:
        """Who holds what, what is free and who waits: for the refusal message and the dashboard."""
        return {
            "workers": {worker: (self._holding(worker) or None) for worker in sorted(present)},
            "free": self.free(present),
            "runs": {run_id: {"owner": lease.owner, "workers": list(lease.workers), "since": lease.since}
                     for run_id, lease in self.leases.items()},
            "queue": [{"run_id": w.run_id, "owner": w.owner, "wanted": w.wanted, "since": w.since,
                       "position": index + 1} for index, w in enumerate(self.queue)],
        }

    def _holding(self, worker: str) -> dict[str, str] | None:
        run_id = self.holder(worker)
        return {"run_id": run_id, "owner": self.leases[run_id].owner} if run_id else None

    # --- changes --------------------------------------------------------------------------------------

    def acquire(self, run_id: str, owner: str, client: str, wanted: int, queue: bool, present: list[str],
                now: float) -> dict[str, Any]:
        """Lease `wanted` free workers to `run_id`: granted at once when that many are free and nobody
        waits ahead; else queued (`queue`) or refused. Asking again for a run that holds a lease or waits
        answers as the first time did."""
        if run_id in self.leases:
            return {"state": "leased", "workers": list(self.leases[run_id].workers)}
        if wanted > len(present):
            return {"state": "impossible", **self.view(present)}
        if self.position(run_id) is None:
            free = self.free(present)
            if not self.queue and len(free) >= wanted:
                self.leases[run_id] = Lease(run_id, owner, client, free[:wanted], now)
                return {"state": "leased", "workers": free[:wanted]}
            if not queue:
                return {"state": "refused", **self.view(present)}
            self.queue.append(Waiting(run_id, owner, client, wanted, now))
        return self.poll(run_id, present, now)

    def poll(self, run_id: str, present: list[str], now: float) -> dict[str, Any]:
        """Where a run stands: leased (its workers), queued (its position), or gone (never asked, its
        request was cancelled, or its client left)."""
        self.promote(present, now)
        if run_id in self.leases:
            return {"state": "leased", "workers": list(self.leases[run_id].workers)}
        position = self.position(run_id)
        if position is None:
            return {"state": "gone"}
        return {"state": "queued", "position": position, **self.view(present)}

    def promote(self, present: list[str], now: float) -> list[str]:
        """Grant waiting runs their workers, first come first served; returns the runs granted."""
        granted = []
        while self.queue:
            head = self.queue[0]
            free = self.free(present)
            if len(free) < head.wanted:
                break  # the head waits; nobody overtakes it
            self.queue.pop(0)
            self.leases[head.run_id] = Lease(head.run_id, head.owner, head.client, free[:head.wanted], now)
            granted.append(head.run_id)
        return granted

    def extend(self, run_id: str, workers: list[str], present: list[str]) -> list[str]:
        """Add `workers` to a running run's lease, those of them that are free, and only while nobody
        waits (a waiting run comes before a running run's growth); returns the workers added."""
        lease = self.leases.get(run_id)
        if lease is None or self.queue:
            return []
        free = set(self.free(present))
        added = [worker for worker in workers if worker in free]
        lease.workers.extend(added)
        return added

    def release(self, run_id: str, workers: list[str] | None, present: list[str], now: float) -> None:
        """End a run's lease (or give back some of its workers), and cancel its place in the queue."""
        self.queue = [waiting for waiting in self.queue if waiting.run_id != run_id]
        lease = self.leases.get(run_id)
        if lease is not None:
            lease.workers = [] if workers is None else [w for w in lease.workers if w not in workers]
            if not lease.workers:
                del self.leases[run_id]
        self.promote(present, now)

    def drop_client(self, client: str, present: list[str], now: float) -> list[str]:
        """The client is gone: its leases end and its waiting runs leave the queue; returns those runs."""
        ended = [run_id for run_id, lease in self.leases.items() if lease.client == client]
        ended += [waiting.run_id for waiting in self.queue if waiting.client == client]
        for run_id in ended:
            self.leases.pop(run_id, None)
        self.queue = [waiting for waiting in self.queue if waiting.client != client]
        self.promote(present, now)
        return ended

    def worker_removed(self, worker: str) -> None:
        """A worker left the cluster: no run holds it any more (a new worker may take its address)."""
        for run_id, lease in list(self.leases.items()):
            if worker in lease.workers:
                lease.workers.remove(worker)


# --- on the scheduler ---------------------------------------------------------------------------------

class LeasePlugin(SchedulerPlugin):
    """Runs in the scheduler: holds the cluster's `LeaseBook` and ends leases with clients and workers."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.book = LeaseBook()
        self.scheduler: Any = None

    def start(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def present(self) -> list[str]:
        return list(self.scheduler.workers) if self.scheduler is not None else []

    def remove_client(self, scheduler: Any, client: str) -> None:
        self.book.drop_client(client, list(scheduler.workers), time.time())

    def add_worker(self, scheduler: Any, worker: str) -> None:
        self.book.promote(list(scheduler.workers), time.time())

    def remove_worker(self, scheduler: Any, worker: str, **kwargs: Any) -> None:
        self.book.worker_removed(worker)


def _book_call(method: str, *args: Any, dask_scheduler: Any = None) -> Any:
    """On the scheduler's event loop (so one call at a time): call a `LeaseBook` method with the workers
    present now and the time, installing the plugin on first use."""
    plugin = dask_scheduler.plugins.get(PLUGIN_NAME)
    if plugin is None:
        plugin = LeasePlugin()
        dask_scheduler.add_plugin(plugin, name=PLUGIN_NAME)
        plugin.scheduler = dask_scheduler
    book, present, now = plugin.book, list(dask_scheduler.workers), time.time()
    if method == "acquire":
        return book.acquire(*args, present=present, now=now)
    if method == "poll":
        return book.poll(*args, present=present, now=now)
    if method == "extend":
        return book.extend(*args, present=present)
    if method == "release":
        return book.release(*args, present=present, now=now)
    return book.view(present)


# The scheduler-side code travels by value: the scheduler needs distributed, not the workbench.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- on the client --------------------------------------------------------------------------------------

def acquire(client: Any, run_id: str, owner: str, wanted: int, queue: bool) -> dict[str, Any]:
    """Ask the scheduler for `wanted` workers for `run_id` (see `LeaseBook.acquire`)."""
    return client.run_on_scheduler(_book_call, "acquire", run_id, owner, client.id, wanted, queue)


def poll(client: Any, run_id: str) -> dict[str, Any]:
    return client.run_on_scheduler(_book_call, "poll", run_id)


def extend(client: Any, run_id: str, workers: list[str]) -> list[str]:
    return client.run_on_scheduler(_book_call, "extend", run_id, list(workers))


def release(client: Any, run_id: str, workers: list[str] | None = None) -> None:
    """Give back all of a run's workers (None), or those listed; cancels its place in the queue."""
    client.run_on_scheduler(_book_call, "release", run_id, None if workers is None else list(workers))


def view(client: Any) -> dict[str, Any]:
    """Who holds which worker, what is free, and who waits (see `LeaseBook.view`)."""
    return client.run_on_scheduler(_book_call, "view")


def describe_holders(answer: dict[str, Any]) -> str:
    """'run a (owner alice) holds w1, w2; run b (bob) waits for 2' from a refusal or queue answer."""
    parts = [f"run {run_id} ({info['owner']}) holds {', '.join(info['workers'])}"
             for run_id, info in answer.get("runs", {}).items()]
    parts += [f"run {w['run_id']} ({w['owner']}) waits for {w['wanted']}" for w in answer.get("queue", [])]
    return "; ".join(parts) or "no run holds any"
