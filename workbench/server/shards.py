"""The parameter server: global weights, version counter and server-side optimizer in Dask actors.

`ParameterShard` is the actor, one per contiguous range of the flattened parameters (`shards=K` puts K
of them on different workers). It is a thin shell: bookkeeping (versions, clocks, staleness) is the pure
`ServerBook`, decompression of pushes is `compression.decode`, and compressed replies (weights as deltas
against per-worker mirrors, elastic pulls) are the pure `replies.WeightMirrors` / `ElasticMirrors`.
Tensor arithmetic runs in plain methods, on the worker's single actor thread; waiting (the SSP bound,
the end of the run) happens in `async def` methods on the worker's event loop, so a waiting worker never
blocks the actor thread for the others.

`ServerHandle` is the picklable description the client hands to the workers; `ServerClient` is the
worker-side view that splits vectors over the shards and calls them concurrently.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

import torch
from distributed.protocol import register_generic

from workbench.comm.averaging import (
    flat_optimizer_state,
    join_optimizer_states,
    load_flat_optimizer_state,
    slice_optimizer_state,
)
from workbench.errors import TrainingError
from workbench.job import Job, make_optimizer
from workbench.server.book import ServerBook
from workbench.server.compression import Packet, decode
from workbench.server.replies import ElasticMirrors, WeightMirrors
from workbench.sharding import split_ranges


@dataclasses.dataclass
class Reply:
    """A shard's answer to a fetch, push or exchange."""

    version: int
    staleness: int = 0
    clock_gap: int = 0
    slowest_clock: int = 0
    # When fetched: the shard's weights, in full or as a compressed change (see `server/replies.py`).
    weights: Packet | None = None
    pull: Packet | None = None  # elastic averaging: what the worker subtracts from its weights


@dataclasses.dataclass
class Replies:
    """All shards' replies to one call, seen as one: shard 0's version and clocks (the coordinator's),
    the largest staleness, and the shards' packets in range order."""

    version: int
    staleness: int = 0
    clock_gap: int = 0
    slowest_clock: int = 0
    weights: list[Packet] | None = None
    pull: list[Packet] | None = None

    @property
    def nbytes(self) -> int:
        """Tensor bytes the replies carried (what `bytes_received` reports)."""
        return sum(packet.nbytes for packets in (self.weights, self.pull) for packet in packets or ())


# Tensors inside these travel as raw frames through Dask's tensor serializer; pickled, each 7 MB of
# weights cost about 7 ms to serialise and 9 ms to deserialise, more than a training step.
register_generic(Packet)
register_generic(Reply)


class ParameterShard:
    """Dask actor holding one range of the global parameters and the server-side optimizer over it."""

    def __init__(self, index: int, weights: torch.Tensor, job: Job, workers: list[int],
                 staleness_aware_lr: bool = False, optimizer_state: dict[str, Any] | None = None,
                 version: int = 0, replies: tuple[str, float, float] = ("none", 0.01, 1e-3),
                 elastic: bool = False) -> None:
        self.index = index
        self.parameter = torch.nn.Parameter(weights.detach().clone().float(), requires_grad=False)
        self.optimizer = make_optimizer(job, [self.parameter])
        # After a live switch the server goes on with the optimizer state the workers had.
        load_flat_optimizer_state(self.optimizer, optimizer_state or {})
        self.staleness_aware_lr = staleness_aware_lr
        self.book = ServerBook(workers, version)
        # Replies compressed as `replies` = (kind, topk_ratio, threshold_tau), against one mirror of this
        # shard's range per worker: the weights it knows (async, ssp; none kept when replies are not
        # compressed), or for elastic averaging its own weights. A new shard has none, so its first reply
        # to each worker carries the weights in full.
        self.mirrors = ElasticMirrors(*replies, start=self.parameter.data, workers=len(workers)) if elastic else WeightMirrors(*replies)
        self.created = time.time()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self.waiting = 0

    # --- tensor work: plain methods, run on the actor thread --------------------------------------------

    def fetch(self, worker: int, full: bool = False) -> Reply:
        """The shard's weights for `worker` (`full`: in full, for a worker that holds none yet)."""
        version = self.book.fetch(worker)
        return Reply(version, weights=self.mirrors.reply(worker, self.parameter.data, full))

    def push(self, worker: int, packet: Packet, lr: float, clock: int | None = None, fetch: bool = False) -> Reply:
        """Apply one worker's accumulated gradient with the server optimizer; optionally return the weights."""
        gradient = decode(packet)
        receipt = self.book.push(worker, clock)
        scale = 1.0 / max(1, receipt.staleness) if self.staleness_aware_lr else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = lr * scale
        self.parameter.grad = gradient
        self.optimizer.step()
        self.parameter.grad = None
        reply = Reply(**dataclasses.asdict(receipt))
        if fetch:
            reply.version = self.book.fetch(worker)
            reply.weights = self.mirrors.reply(worker, self.parameter.data)
        self._notify()
        return reply

    def elastic(self, worker: int, packet: Packet, alpha: float, clock: int | None = None) -> Reply:
        """Elastic averaging exchange: returns the pull the worker subtracts from its weights."""
        pull = self.mirrors.exchange(worker, self.parameter.data, packet, alpha)
        receipt = self.book.exchange(worker, clock)
        self._notify()
        return Reply(**dataclasses.asdict(receipt), pull=pull)

    def finish(self, worker: int) -> int:
        self.book.finish(worker)
        # It only takes the final weights now, in full: its mirrors can go.
        self.mirrors.forget(worker)
        self._notify()
        return self.book.version

    def weights(self) -> torch.Tensor:
        return self.parameter.data.clone()

    def optimizer_state(self) -> dict[str, Any]:
        return flat_optimizer_state(self.optimizer)

    def stats(self) -> dict[str, Any]:
        return {"index": self.index, "version": self.book.version, "clocks": dict(self.book.clocks),
                "finished": sorted(self.book.finished), "waiting": self.waiting,
                "staleness_counts": {w: dict(c) for w, c in self.book.staleness_counts.items()},
                "versions_per_s": self.book.version / max(1e-9, time.time() - self.created)}

    # --- waiting: async methods on the worker's event loop ------------------------------------------------

    async def wait_for_clock(self, worker: int, clock: int, max_staleness: int, timeout_s: float) -> dict[str, Any]:
        """Return once `worker` at `clock` is within `max_staleness` clocks of the slowest worker (SSP)."""
        started = time.perf_counter()
        await self._wait_until(lambda: self.book.may_proceed(worker, clock, max_staleness), timeout_s,
                               f"worker {worker} waited for the slowest worker to reach clock "
                               f"{clock - max_staleness}")
        slowest = min(self.book.slowest_clock(), clock)
        return {"waited_s": time.perf_counter() - started, "clock_gap": clock - slowest, "slowest_clock": slowest}

    async def wait_finished(self, workers: list[int], timeout_s: float) -> int:
        """Return the final version once every worker in `workers` has finished."""
        await self._wait_until(lambda: self.book.all_finished(workers), timeout_s,
                               f"waited for workers {sorted(set(workers) - self.book.finished)} to finish")
        return self.book.version

    async def _wait_until(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        loop = self._loop = asyncio.get_running_loop()
        if self._changed is None:
            self._changed = asyncio.Event()
        deadline = loop.time() + timeout_s
        self.waiting += 1
        try:
            while True:
                # Clear before checking: a change made after the check sets the event again.
                self._changed.clear()
                if condition():
                    return
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"{what}: no progress within {timeout_s} s")
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.waiting -= 1

    def _notify(self) -> None:
        # Called on the actor thread; the waiters live on the event loop.
        loop, changed = self._loop, self._changed
        if loop is not None and changed is not None:
            loop.call_soon_threadsafe(changed.set)


@dataclasses.dataclass
class ServerHandle:
    """The shards of one run's parameter server (picklable, handed to every worker) and their ranges."""

    actors: list[Any]
    ranges: list[tuple[int, int]]
    futures: list[Any] = dataclasses.field(default_factory=list, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        # Workers get the actors; the futures that keep the actors alive stay with the client.
        return {"actors": self.actors, "ranges": self.ranges, "futures": []}

    def __copy__(self) -> ServerHandle:
        """A worker's copy, as one that travelled: its own list of the actors, none of the futures."""
        return ServerHandle(list(self.actors), self.ranges)

    def release(self) -> None:
        """Let the actors go (the client's references are what keep them alive)."""
        for future in self.futures:
            future.release()
        self.futures.clear()
        let_go(self.actors)


def let_go(actors: list[Any]) -> None:
    """Drop this process's claims on the actors' keys, and the handles: each `distributed.Actor` handle
    holds a future of its own (`_future`, private), and a handle caught in a closure of a call or in a
    traceback kept a shard alive until the worker's next full garbage collection (30 s and more, once in
    a few full runs: test_user_errors [async-dataset-rank-1]). Released here, a handle still held
    elsewhere keeps nothing alive."""
    for actor in actors:
        future = getattr(actor, "_future", None)
        if future is not None:
            future.release()  # once per future: Future.release is idempotent
            actor._future = None
    actors.clear()


def start_parameter_server(client: Any, run_id: str, addresses: list[str], weights: torch.Tensor, job: Job,
                           shards: int, world_size: int, staleness_aware_lr: bool,
                           optimizer_state: dict[str, Any] | None = None, version: int = 0,
                           replies: tuple[str, float, float] = ("none", 0.01, 1e-3),
                           elastic: bool = False) -> ServerHandle:
    """Create `shards` actors over contiguous ranges of `weights` (and of the optimizer state, when one is
    carried over), spread over the run's workers; `replies`: (compression kind, topk_ratio,
    threshold_tau) of what they send back, `elastic`: for elastic averaging (see `server/replies.py`)."""
    ranges = split_ranges(weights.numel(), shards)
    state = optimizer_state or {}
    futures = []
    for index, (start, stop) in enumerate(ranges):
        address = addresses[index % len(addresses)]
        # The shard's tensors go straight to the worker that will hold it: passed to `submit` they would
        # travel in the task, to the scheduler and on from there, each way over the link (measured: on a
        # 20 Mbit/s link a switch to easgd spent seconds creating its shard, on the worker it started on).
        tensors, = client.scatter([(weights[start:stop].clone(), slice_optimizer_state(state, start, stop))],
                                  workers=[address], direct=True, hash=False)
        futures.append(client.submit(_new_shard, index, tensors, job, list(range(world_size)), staleness_aware_lr,
                                     version, tuple(replies), elastic, actor=True, workers=[address],
                                     allow_other_workers=False, pure=False,
                                     key=f"workbench-{run_id}-server-{index}-{uuid.uuid4().hex[:8]}"))
    actors = [future.result() for future in futures]
    return ServerHandle(actors, ranges, futures)


def _new_shard(index: int, tensors: tuple[torch.Tensor, dict[str, Any]], job: Job, workers: list[int],
               staleness_aware_lr: bool, version: int, replies: tuple[str, float, float], elastic: bool) -> ParameterShard:
    weights, optimizer_state = tensors
    return ParameterShard(index, weights, job, workers, staleness_aware_lr, optimizer_state, version, replies, elastic)


WAIT_SLICE_S = 0.5  # how often a waiting worker checks whether a control action interrupts the wait


class Call:
    """Calls to every shard in flight; `done()` never blocks, `result()` waits with a timeout.

    The calls are awaited on the worker's event loop, which notes when the last reply arrived, so the
    round-trip time is exact even when the training thread collects the result later.
    """

    def __init__(self, futures: list[Any], loop: asyncio.AbstractEventLoop | None,
                 abandoned: Callable[[], bool] = lambda: False) -> None:
        self.started = time.perf_counter()
        self._futures = futures
        self._abandoned = abandoned
        self._done: ConcurrentFuture | None = None
        if loop is not None:
            self._done = asyncio.run_coroutine_threadsafe(self._gather(), loop)

    async def _gather(self) -> tuple[list[Any], float]:
        return [await future for future in self._futures], time.perf_counter()

    def done(self) -> bool:
        if self._done is not None:
            return self._done.done()
        return all(future.done() for future in self._futures)

    def result(self, timeout_s: float) -> tuple[list[Any], float]:
        """(replies of all shards, seconds from start to the last reply)."""
        try:
            if self._done is not None:
                replies, finished = self._wait_in_slices(timeout_s)
            else:
                replies, finished = [future.result(timeout_s) for future in self._futures], time.perf_counter()
        except TimeoutError:
            raise TrainingError(f"the parameter server did not answer within {timeout_s} s") from None
        return replies, finished - self.started

    def _wait_in_slices(self, timeout_s: float) -> tuple[list[Any], float]:
        # A shard on a lost worker may never answer: the group is ended then, and the wait with it.
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._done.result(min(WAIT_SLICE_S, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
                if self._abandoned():
                    raise TrainingError("the run's group of workers was ended while waiting for the parameter "
                                        "server") from None


class ServerClient:
    """A worker's (or the client's) view of the sharded server."""

    def __init__(self, handle: ServerHandle, timeout_s: float, loop: asyncio.AbstractEventLoop | None = None,
                 abandoned: Callable[[], bool] = lambda: False) -> None:
        self.actors, self.ranges, self.timeout_s, self._loop = handle.actors, handle.ranges, timeout_s, loop
        self._abandoned = abandoned

    def split(self, vector: torch.Tensor) -> list[torch.Tensor]:
        return [vector[start:stop] for start, stop in self.ranges]

    def fetch(self, worker: int, full: bool = False) -> Replies:
        """The server's weights for `worker`: in full when `full` or when a shard has no mirror of it,
        else as compressed changes (see `server/replies.py`)."""
        replies, _ = self._call(lambda actor, _: actor.fetch(worker, full)).result(self.timeout_s)
        return merge_replies(replies)

    def push(self, worker: int, packets: list[Packet], lr: float, clock: int | None, fetch: bool) -> Call:
        return self._call(lambda actor, i: actor.push(worker, packets[i], lr, clock, fetch))

    def elastic(self, worker: int, packets: list[Packet], alpha: float, clock: int | None) -> Call:
        return self._call(lambda actor, i: actor.elastic(worker, packets[i], alpha, clock))

    def wait_for_clock(self, worker: int, clock: int, max_staleness: int,
                       interrupted: Callable[[], bool] = lambda: False) -> dict[str, Any]:
        """Wait until `worker` at `clock` is within `max_staleness` clocks of the slowest worker.

        Waits in slices so that `interrupted()` (a pause, stop or switch asked for) ends the wait early,
        with `"interrupted": True`: the worker it waits for may be waiting for that control action.
        """
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TrainingError(f"worker {worker} waited {self.timeout_s} s for the slowest worker to reach "
                                    f"clock {clock - max_staleness} (max_staleness {max_staleness})")
            slice_s = min(WAIT_SLICE_S, remaining)
            try:
                # Clocks live on shard 0, the coordinator.
                reply = self._answer(self.actors[0].wait_for_clock(worker, clock, max_staleness, slice_s), slice_s + 5)
                # waited_s: this worker's whole wait; blocked_s: how long the bound actually held it.
                return {**reply, "waited_s": time.perf_counter() - started, "blocked_s": reply["waited_s"],
                        "interrupted": False}
            except TimeoutError:
                if self._abandoned():  # the slowest worker may be the lost one
                    raise TrainingError("the run's group of workers was ended while waiting for the slowest "
                                        "worker") from None
                if interrupted():
                    return {"waited_s": time.perf_counter() - started, "interrupted": True}

    def _answer(self, future: Any, timeout_s: float) -> Any:
        """An actor call's result, ending the wait at once when the group is ended: a shard on a lost
        worker never answers. TimeoutError: the actor's own (its wait ended) or none within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return future.result(min(WAIT_SLICE_S / 5, max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                if future.done() or time.monotonic() >= deadline:
                    raise
                if self._abandoned():
                    raise TrainingError("the run's group of workers was ended while waiting for the slowest "
                                        "worker") from None

    def finish(self, worker: int, world_size: int) -> int:
        """Say this worker is done, then wait until all are (the final weights are complete then)."""
        self.announce_finished(worker)
        waiting = self._call_first(lambda actor: actor.wait_finished(list(range(world_size)), self.timeout_s))
        replies, _ = waiting.result(self.timeout_s + 5)
        return replies[0]

    def announce_finished(self, worker: int) -> None:
        self._call(lambda actor, _: actor.finish(worker)).result(self.timeout_s)

    def weights(self) -> torch.Tensor:
        replies, _ = self._call(lambda actor, _: actor.weights()).result(self.timeout_s)
        return torch.cat(replies)

    def optimizer_state(self) -> dict[str, Any]:
        """The server optimizer's state over all shards, as one flat state (see `flat_optimizer_state`)."""
        replies, _ = self._call(lambda actor, _: actor.optimizer_state()).result(self.timeout_s)
        return join_optimizer_states(replies)

    def stats(self) -> list[dict[str, Any]]:
        replies, _ = self._call(lambda actor, _: actor.stats()).result(self.timeout_s)
        return replies

    def _call_first(self, method: Callable[[Any], Any]) -> Call:
        """A call to shard 0 alone (the coordinator), waited on in slices like every other."""
        return Call([method(self.actors[0])], self._loop, self._abandoned)

    def _call(self, method: Callable[[Any, int], Any]) -> Call:
        return Call([method(actor, index) for index, actor in enumerate(self.actors)], self._loop, self._abandoned)


def merge_replies(replies: list[Reply]) -> Replies:
    """One view of the shards' replies (see `Replies`)."""
    first = replies[0]
    packets = {name: [getattr(r, name) for r in replies] for name in ("weights", "pull")
               if getattr(first, name) is not None}
    return Replies(first.version, max(r.staleness for r in replies), first.clock_gap, first.slowest_clock, **packets)
