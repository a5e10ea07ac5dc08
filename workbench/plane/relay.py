"""Per-host metrics relay: a large run's workers on one host hand their metrics to one of them, which sends
them to the scheduler as one message every flush, so the scheduler handles a message per host rather than
per worker.

Every worker sends its step records about 4 times a second (`MetricsSender`). The scheduler spends about
120 microseconds on each message whatever it carries (benchmarks/scale.py: 0.575 of a core for 1,024
workers each sending its own, 0.189 for the same records in eights), so from a size on
(`workbench.metrics-relay-from`, 64 workers) the lowest rank on each host relays for the others, and ranks
alone on their host are relayed in eights (`relay_addresses`, pure). Each rank's messages stay in order and are never dropped for the relay's sake:
a rank hands its queued messages to the relay in one call and takes the next only once the relay has
passed them on to the scheduler's stream (`HostRelay.receive` answers after its flush); when the relay
cannot be reached (not started yet, or its worker gone) the rank sends them itself, in the same order.
"""
from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from typing import Any

import dask
from distributed.comm import get_address_host

from workbench.plane import kinds

HANDLER = "workbench_metrics_relay"
RELAY_FROM_KEY = "workbench.metrics-relay-from"  # dask config: runs of this many workers or more relay
RELAY_FROM = 64
GROUP = 8  # ranks alone on their hosts relayed together
CLOSE_TIMEOUT_S = 10.0
RELAY_TIMEOUT_S = 5.0


def relay_addresses(addresses: list[str], relay_from: int, group: int = GROUP) -> list[str | None]:
    """For each rank (by its worker's address): the address of the worker that relays its metrics, or None
    to send its own. Runs smaller than `relay_from` send their own. Otherwise the lowest rank on each host
    relays for that host's others; ranks alone on their host go in groups of `group`, by rank, the group's
    first relaying (one more hop on the network, and the scheduler still sees a message per group)."""
    if len(addresses) < relay_from:
        return [None] * len(addresses)
    hosts = [get_address_host(address) for address in addresses]
    first: dict[str, str] = {}
    count: dict[str, int] = defaultdict(int)
    for host, address in zip(hosts, addresses):
        first.setdefault(host, address)  # the lowest rank on the host
        count[host] += 1
    relays: list[str | None] = [first[host] if count[host] > 1 else None for host in hosts]
    alone = [rank for rank, host in enumerate(hosts) if count[host] == 1]
    for start in range(0, len(alone), group):
        members = alone[start:start + group]
        if len(members) > 1:
            for rank in members:
                relays[rank] = addresses[members[0]]
    return relays


def relay_from() -> int:
    return int(dask.config.get(RELAY_FROM_KEY, RELAY_FROM))


class HostRelay:
    """In a worker process: takes other ranks' messages (the `HANDLER` rpc) and sends what arrived since
    the last flush as one `batches` message per run topic. Lives as long as the worker process: a relay
    rank whose own training ended still serves its host's other ranks."""

    def __init__(self, worker: Any, interval_s: float) -> None:
        self.worker = worker
        self.interval_s = interval_s
        self.pending: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.flushed: asyncio.Future | None = None
        self.task: asyncio.Task | None = None

    async def receive(self, topic: str, messages: list[dict[str, Any]]) -> str:
        # Answers once the messages are on the scheduler's stream: the sender then holds nothing back.
        self.pending[topic].extend(messages)
        if self.flushed is None:
            self.flushed = asyncio.get_running_loop().create_future()
        if self.task is None or self.task.done():
            self.task = asyncio.ensure_future(self._flush_after_interval())
        await asyncio.shield(self.flushed)
        return "ok"

    async def _flush_after_interval(self) -> None:
        await asyncio.sleep(self.interval_s)
        pending, self.pending = self.pending, defaultdict(list)
        flushed, self.flushed = self.flushed, None
        for topic, messages in pending.items():
            self.worker.log_event(topic, {"kind": kinds.BATCHES, "messages": messages})
        if flushed is not None:
            flushed.set_result(None)


def install(dask_worker: Any, interval_s: float = 0.25) -> None:
    """This worker process relays from now on, flushing every `interval_s` (a worker's own flush interval,
    `MetricsSender`), once per process: later runs reuse it. Run by the client on the relaying workers
    (`client.run`) before the ranks start, so no rank finds it missing."""
    if HANDLER not in dask_worker.handlers:
        dask_worker.handlers[HANDLER] = HostRelay(dask_worker, interval_s).receive


class RelaySender:
    """`send` for a rank's `MetricsSender`: hands its messages to the host's relay, in order, from the
    worker's event loop; sends them itself where the relay cannot take them."""

    def __init__(self, worker: Any, topic: str, relay: str) -> None:
        self.worker, self.topic = worker, topic
        self.relay: str | None = relay
        self._queue: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()

    def __call__(self, message: dict[str, Any]) -> None:
        # The worker's own address on the message, as Dask adds it to a worker's own events.
        message = {**message, "worker": self.worker.address}
        with self._lock:
            self._queue.append(message)
            start = self._idle.is_set()
            self._idle.clear()
        if start:
            asyncio.run_coroutine_threadsafe(self._drain(), self.worker.loop.asyncio_loop)

    async def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._idle.set()
                    return
                batch, self._queue = self._queue, []
            if self.relay is not None:
                try:
                    call = self.worker.rpc(self.relay).workbench_metrics_relay(topic=self.topic, messages=batch)
                    # Dask retries a refused connection for 30 s; a relay that does not answer within a
                    # few of its flushes is taken for gone.
                    await asyncio.wait_for(call, RELAY_TIMEOUT_S)
                    continue
                except Exception:  # the relay's worker is gone: from now on this rank sends its own
                    self.relay = None
            for message in batch:
                self.worker.log_event(self.topic, message)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Wait until every message was passed on (True), at most `timeout_s`."""
        return self._idle.wait(timeout_s)
