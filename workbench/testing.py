"""A run in one process: N ranks as threads, each running the real training loop, strategy, control
point and checkpoints, with the transport, the control state and the parameter server in memory.

The same code as on a cluster down to the calls a rank makes: only what is behind `context.comm`
(`ThreadTransport` instead of torch.distributed and Dask) and the control state (`LocalControl`
instead of a Dask `Variable`) differ. For tests that check every strategy against a single-process
reference in seconds (tests/inprocess/test_inprocess.py), and for trying a strategy without starting a cluster.
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from workbench.comm.averaging import flatten, slice_optimizer_state, unflatten_into
from workbench.job import Job
from workbench.plane import kinds
from workbench.plane.control import ControlState
from workbench.plane.metrics import MetricsSender, expand
from workbench.server.shards import ParameterShard, ServerHandle
from workbench.sharding import shard_size, split_ranges
from workbench.strategies import get_strategy, make_settings
from workbench.worker.loop import WorkerTask, _Loop

DONE = object()  # the work handle of a collective already complete


class ThreadGroup:
    """The ranks' meeting point: each collective is one exchange, every rank putting in its value and
    taking all of them, in rank order."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.timeout_s = timeout_s  # the longest a rank waits for the others (`set_timeout`, as the group's)
        self._barrier = threading.Barrier(world_size, timeout=timeout_s)
        self._slots: list[Any] = [None] * world_size
        self._met: dict[int, set[int]] = {}  # meeting point -> ranks come to it (`meet`)
        self._meeting = threading.Condition()

    def exchange(self, rank: int, value: Any) -> list[Any]:
        self._slots[rank] = value
        self._barrier.wait(self.timeout_s)
        gathered = list(self._slots)
        self._barrier.wait(self.timeout_s)  # no rank overwrites its slot before every rank has read them all
        return gathered

    def meet(self, rank: int, point: int, give_up: Callable[[], bool]) -> bool:
        """As `collectives.meet`: no deadline of its own; a failed rank (`abort`) fails the wait."""
        with self._meeting:
            self._met.setdefault(point, set()).add(rank)
            self._meeting.notify_all()
            while len(self._met[point]) < self.world_size:
                if self._barrier.broken:
                    raise threading.BrokenBarrierError
                if give_up():
                    return False
                self._meeting.wait(0.05)
        return True

    def abort(self) -> None:
        """A rank failed: every rank waiting in a collective fails too (BrokenBarrierError), as on a cluster."""
        self._barrier.abort()


class _Reply:
    """An actor call's answer as a Dask actor call gives it: `result(timeout)`, `done()`, awaitable."""

    def __init__(self, future: Future) -> None:
        self._future = future

    def result(self, timeout: float | None = None) -> Any:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


class LocalActor:
    """An object called as a Dask actor is: plain methods one at a time on its own thread, coroutines on
    the event loop; every call returns a `_Reply`."""

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._target, self._loop = target, loop
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="workbench-actor")

    def __getattr__(self, name: str) -> Callable[..., _Reply]:
        method = getattr(self._target, name)
        if inspect.iscoroutinefunction(method):
            return lambda *a, **k: _Reply(asyncio.run_coroutine_threadsafe(method(*a, **k), self._loop))
        return lambda *a, **k: _Reply(self._thread.submit(method, *a, **k))

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False)


class LocalServices:
    """The run's services in this process: an event loop on a thread (where a Dask worker's would be)
    and the parameter server's shards as `LocalActor`s."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="workbench-inprocess-loop", daemon=True)
        self._thread.start()
        self.actors: list[LocalActor] = []

    def start_parameter_server(self, run_id: str, addresses: list[str], weights: torch.Tensor, job: Job,
                               shards: int, world_size: int, staleness_aware_lr: bool,
                               optimizer_state: dict[str, Any] | None = None, version: int = 0,
                               replies: tuple[str, float, float] = ("none", 0.01, 1e-3),
                               elastic: bool = False) -> ServerHandle:
        ranges = split_ranges(weights.numel(), shards)
        state = optimizer_state or {}
        actors = [LocalActor(ParameterShard(index, weights[start:stop].clone(), job, list(range(world_size)),
                                            staleness_aware_lr, slice_optimizer_state(state, start, stop), version,
                                            tuple(replies), elastic), self.loop)
                  for index, (start, stop) in enumerate(ranges)]
        self.actors.extend(actors)
        return ServerHandle(actors, ranges)

    def close(self) -> None:
        for actor in self.actors:
            actor.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


class ThreadTransport:
    """One rank's `transport.Transport` in this process. Values that would travel are copied (JSON
    through JSON, objects as a worker's copy), so no rank changes another's."""

    def __init__(self, group: ThreadGroup, rank: int, services: LocalServices) -> None:
        self.group, self.rank, self.services = group, rank, services
        # Every collective of the rank runs in order on its own thread, as a process group's do: one started
        # in the background (`start_all_reduce`) lets the rank compute on while the others catch up, so a
        # rank's compute time is its own (a balanced batch is cut by it), not its wait for the slowest.
        self._queue = ThreadPoolExecutor(1, thread_name_prefix=f"workbench-collectives-{rank}")

    def _exchange(self, value: Any) -> list[Any]:
        return self.group.exchange(self.rank, value)

    def _all(self, value: Any) -> list[Any]:
        return self._queue.submit(self._exchange, value).result()

    def close(self) -> None:
        self._queue.shutdown(wait=False, cancel_futures=True)

    def broadcast_json(self, value: Any, source_rank: int = 0) -> Any:
        return json.loads(json.dumps(self._all(value)[source_rank]))

    def all_gather_json(self, value: Any) -> list[Any]:
        return [json.loads(json.dumps(part)) for part in self._all(value)]

    def broadcast_object(self, value: Any, source_rank: int = 0) -> Any:
        sent = self._all(value)[source_rank]
        return sent if self.rank == source_rank else copy.copy(sent)

    def all_gather_objects(self, value: Any) -> list[Any]:
        return [part if rank == self.rank else copy.deepcopy(part) for rank, part in enumerate(self._all(value))]

    def barrier(self) -> None:
        self._all(None)

    def set_timeout(self, timeout_s: float) -> None:
        self.group.timeout_s = timeout_s  # one group for every rank in process: the last to set it wins

    def meet(self, point: int, give_up: Callable[[], bool]) -> bool:
        return self.group.meet(self.rank, point, give_up)

    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], source_rank: int = 0) -> None:
        if tensors:
            unflatten_into(self._all(flatten(tensors))[source_rank], list(tensors))

    def _sum(self, vector: torch.Tensor) -> torch.Tensor:
        """On the rank's collective thread. Summed in rank order on every rank: every rank gets the same
        bits, as from an all-reduce."""
        parts = self._exchange(vector.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return total

    def all_reduce_mean(self, vector: torch.Tensor) -> None:
        vector.copy_(self._queue.submit(self._sum, vector).result().div_(self.group.world_size))

    def start_all_reduce(self, vector: torch.Tensor, channel: int | None = None) -> Any:
        # A handle, never None (strategies take None for "not started"); `vector` holds the sum once done.
        return self._queue.submit(lambda: vector.copy_(self._sum(vector)))

    def start_all_gather(self, part: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
        return DONE, [other.clone() for other in self._all(part)]

    def wait(self, work: Any) -> None:
        if work is not DONE:
            work.result()

    def when_done(self, work: Any, callback: Callable[[Any], Any]) -> None:
        if work is DONE:
            callback(work)
        else:
            work.add_done_callback(callback)

    def start_parameter_server(self, *arguments: Any) -> Any:
        return self.services.start_parameter_server(*arguments)

    def event_loop(self) -> asyncio.AbstractEventLoop:
        return self.services.loop


class LocalControl:
    """The run's control state in memory: the client's writer (`update`, `switch`) and every rank's
    poller (`latest`, `wait_for_change`) in one."""

    def __init__(self, initial: ControlState) -> None:
        self.state = initial
        self._changed = threading.Condition()

    def update(self, **changes: Any) -> ControlState:
        with self._changed:
            settings = {**self.state.settings, **changes.pop("settings", {})}
            self.state = dataclasses.replace(self.state, version=self.state.version + 1, settings=settings, **changes)
            self._changed.notify_all()
            return self.state

    def switch(self, strategy: str, settings: dict[str, Any]) -> ControlState:
        validated = dataclasses.asdict(make_settings(strategy, settings))
        with self._changed:
            self.state = dataclasses.replace(self.state, version=self.state.version + 1, strategy=strategy,
                                             settings=validated, switch_id=self.state.switch_id + 1, timeout_s=None)
            self._changed.notify_all()
            return self.state

    def latest(self) -> ControlState:
        return self.state

    def released(self) -> bool:
        return False

    def wait_for_change(self, version: int, timeout_s: float) -> ControlState:
        with self._changed:
            self._changed.wait_for(lambda: self.state.version > version, timeout=timeout_s)
            return self.state


@dataclasses.dataclass
class InProcessRun:
    """What an in-process run left: each rank's result (rank 0's with the final weights and checkpoint)
    and every record the ranks sent, in arrival order."""

    results: list[dict[str, Any]]
    records: list[dict[str, Any]]
    total_steps: int
    shard_samples: int

    def steps(self, rank: int | None = None) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == kinds.STEP and rank in (None, r["worker"])]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == kind]


def train_in_process(job: Job, strategy: str = "allreduce", world_size: int = 2, timeout_s: float = 60.0,
                     on_record: Callable[[dict[str, Any], LocalControl], None] | None = None,
                     sample_delays: dict[int, float] | None = None, **settings: Any) -> InProcessRun:
    """Train `job` with `strategy` on `world_size` ranks as threads of this process; returns when every
    rank has ended. `on_record(record, control)` sees each record as it is sent (a test acts there:
    a switch, a pause). A rank's error is raised here once all have ended."""
    prepared = job.prepare()
    validated = make_settings(strategy, settings)
    get_strategy(strategy).check_world(validated, world_size)
    shard_samples = shard_size(len(prepared.train), world_size)
    total_steps = prepared.total_steps(shard_samples)
    control = LocalControl(ControlState(lr=job.lr, strategy=strategy, settings=dataclasses.asdict(validated)))
    group, services = ThreadGroup(world_size, timeout_s), LocalServices()
    records: list[dict[str, Any]] = []
    results: list[dict[str, Any] | None] = [None] * world_size
    errors: list[BaseException] = []
    lock = threading.Lock()

    def send(message: dict[str, Any]) -> None:
        expanded = expand(message)
        with lock:
            records.extend(expanded)
        if on_record is not None:
            for record in expanded:
                on_record(record, control)

    def rank_main(rank: int) -> None:
        task = WorkerTask(run_id="in-process", rank=rank, world_size=world_size, job=job, strategy=strategy,
                          settings=validated, shard_samples=shard_samples, total_steps=total_steps, local_data=False,
                          master_host="", master_port=0, collective_timeout_s=timeout_s,
                          addresses=[f"inprocess://{r}" for r in range(world_size)], metrics_interval_s=0.0,
                          sample_delay_s=(sample_delays or {}).get(rank, 0.0))
        transport = ThreadTransport(group, rank, services)
        loop = _Loop(task, get_strategy(strategy)(validated), control, MetricsSender(send, rank, 0.0),
                     transport, agreement_s=0.0)  # agree at every step
        try:
            results[rank] = loop.run(prepared.train, prepared.evaluation if rank == 0 else None, torch.device("cpu"))
            loop.sender.flush()
            loop.strategy.close()
        except BaseException as error:  # noqa: BLE001 - said below, once every rank has ended
            errors.append(error)
            group.abort()
        finally:
            transport.close()

    threads = [threading.Thread(target=rank_main, args=(rank,), name=f"workbench-rank-{rank}", daemon=True)
               for rank in range(world_size)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout_s * 4)
        if any(thread.is_alive() for thread in threads):
            group.abort()
            raise TimeoutError(f"in-process run of '{strategy}' on {world_size} ranks did not end in {timeout_s * 4} s")
    finally:
        services.close()
    if errors:
        raise errors[0]
    return InProcessRun(list(results), records, total_steps, shard_samples)
