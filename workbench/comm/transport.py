"""How a rank talks to the other ranks and reaches the run's services, passed in rather than ambient.

The loop, the strategies and the control point call `context.comm` (a `Transport`), never
torch.distributed or Dask's `get_client()` / `get_worker()` themselves. On a cluster that is
`ProcessGroupTransport`: torch.distributed's default group (`comm/collectives.py`) and the Dask worker the
rank runs on. In one process, `inprocess.ThreadTransport` gives N ranks as threads the same calls, so
the loop, every strategy, switches and checkpoints can be checked without a cluster
(tests/inprocess/test_inprocess.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from workbench.comm import collectives


class Transport(Protocol):
    """What a rank may ask of the others (collectives, in the same order on every rank) and of the run's
    services. `start_all_reduce` begins a sum (given a `channel`, the caller's fixed number for a buffer it
    waits for before reusing, through shared memory when every rank is on one machine), `start_all_gather`
    a gathering; `wait` ends either;
    `all_reduce_mean` is in place."""

    def broadcast_json(self, value: Any, source_rank: int = 0) -> Any: ...
    def all_gather_json(self, value: Any) -> list[Any]: ...
    def broadcast_object(self, value: Any, source_rank: int = 0) -> Any: ...
    def all_gather_objects(self, value: Any) -> list[Any]: ...
    def barrier(self) -> None: ...
    def set_timeout(self, timeout_s: float) -> None: ...
    def meet(self, point: int, give_up: Callable[[], bool]) -> bool: ...
    def broadcast_tensors(self, tensors: Sequence[torch.Tensor], source_rank: int = 0) -> None: ...
    def all_reduce_mean(self, vector: torch.Tensor) -> None: ...
    def start_all_reduce(self, vector: torch.Tensor, channel: int | None = None) -> Any: ...
    def start_all_gather(self, part: torch.Tensor) -> tuple[Any, list[torch.Tensor]]: ...
    def wait(self, work: Any) -> None: ...
    def when_done(self, work: Any, callback: Callable[[Any], Any]) -> None: ...
    def start_parameter_server(self, *arguments: Any) -> Any: ...
    def event_loop(self) -> asyncio.AbstractEventLoop | None: ...


class ProcessGroupTransport:
    """The real one: torch.distributed's default group, and the Dask cluster the rank's task runs on."""

    broadcast_json = staticmethod(collectives.broadcast_json)
    all_gather_json = staticmethod(collectives.all_gather_json)
    broadcast_object = staticmethod(collectives.broadcast_object)
    all_gather_objects = staticmethod(collectives.all_gather_objects)
    barrier = staticmethod(collectives.barrier)
    set_timeout = staticmethod(collectives.set_timeout)
    meet = staticmethod(collectives.meet)
    broadcast_tensors = staticmethod(collectives.broadcast_tensors)
    all_reduce_mean = staticmethod(collectives.all_reduce_mean)
    start_all_reduce = staticmethod(collectives.start_all_reduce)
    start_all_gather = staticmethod(collectives.start_all_gather)
    wait = staticmethod(collectives.wait)
    when_done = staticmethod(collectives.when_done)

    def start_parameter_server(self, *arguments: Any) -> Any:
        """The server's shards as Dask actors on the run's workers (`server.start_parameter_server`)."""
        from distributed import get_client

        from workbench.server.shards import start_parameter_server

        return start_parameter_server(get_client(), *arguments)

    def event_loop(self) -> asyncio.AbstractEventLoop | None:
        """The worker's event loop, where replies from the server's actors are awaited."""
        from distributed import get_worker

        return get_worker().loop.asyncio_loop
