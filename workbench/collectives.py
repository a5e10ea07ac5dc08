"""torch.distributed on Dask workers: forming and tearing down the process group, and the few collectives
the engine uses. gloo on CPU, NCCL on GPU; explicit rank, world size, address and timeout, never env vars.
"""
from __future__ import annotations

import datetime
import functools
import json
import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
import torch.distributed as dist

from .averaging import flatten, unflatten_into
from .errors import TrainingError


def find_free_port(host: str = "") -> int:
    """A TCP port free on this machine right now (run on rank 0's worker through `client.run`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def backend_for(device: torch.device) -> str:
    # On GPUs, NCCL carries CUDA tensors; the small control messages stay on the CPU and go through gloo.
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_process_group(host: str, port: int, rank: int, world_size: int, device: torch.device,
                       timeout_s: float, dask_ports: Sequence[int] = ()) -> None:
    """Join the run's process group; fails after `timeout_s` instead of torch's 30-minute default."""
    if dist.is_initialized():
        raise TrainingError(
            "this worker process already belongs to a torch.distributed process group: another run is "
            "training on it. Wait for that run to end or start this one on other workers."
        )
    before = _tcp_sockets()
    dist.init_process_group(
        backend=backend_for(device),
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    # What the group opened: new sockets, less any Dask opened meanwhile to its servers (`dask_ports`).
    _group_sockets[:] = sorted(set(_tcp_sockets(exclude_ports=set(dask_ports))) - set(before))


def destroy_process_group() -> None:
    _group_sockets.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


# The sockets the process group opened (gloo's connections to its peers and the store's), so that a group
# that was ended can be broken from another thread.
_group_sockets: list[int] = []


def break_process_group() -> bool:
    """Make the training thread's wait on the process group fail at once (from another thread); returns
    whether it broke the group (only while a collective is waited on: shutting gloo's connections down
    while it is idle killed the worker process, measured).

    gloo has no working abort (`ProcessGroupGloo.abort()` and `shutdown()` leave a blocked wait blocked,
    measured), and a rank waiting to receive from a peer that left, or one blocked on a dead peer
    through another, waited out its whole collective timeout. Shutting the group's sockets down makes
    gloo see its connections close, as when the peer dies: the wait raises and the worker leaves.
    """
    if not _waiting:
        return False
    for descriptor in list(_group_sockets):
        try:
            with socket.socket(fileno=os.dup(descriptor)) as connection:
                connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already, or not a connected socket (gloo's listener)
    _group_sockets.clear()
    return True


def _tcp_sockets(exclude_ports: set[int] = frozenset()) -> list[int]:
    try:
        return [c.fd for c in psutil.Process().net_connections(kind="tcp")
                if c.fd >= 0 and not (c.raddr and c.raddr.port in exclude_ports)]
    except psutil.Error:
        return []


_waiting = 0  # the training thread is waiting in a collective (only then is breaking the group safe)


def _blocking(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def waiting(*args: Any, **kwargs: Any) -> Any:
        global _waiting
        _waiting += 1
        try:
            return function(*args, **kwargs)
        finally:
            _waiting -= 1
    return waiting


CONTROL_MESSAGE_BYTES = 2048


def _encode_json(value: Any) -> torch.Tensor:
    buffer = torch.zeros(CONTROL_MESSAGE_BYTES, dtype=torch.uint8)
    encoded = json.dumps(value).encode()
    if len(encoded) > CONTROL_MESSAGE_BYTES:
        raise TrainingError(f"control message of {len(encoded)} bytes exceeds {CONTROL_MESSAGE_BYTES}")
    buffer[: len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    return buffer


def _decode_json(buffer: torch.Tensor) -> Any:
    return json.loads(bytes(buffer[buffer != 0].tolist()).decode())


@_blocking
def broadcast_json(value: Any, source_rank: int = 0) -> Any:
    """Rank `source_rank`'s JSON-able `value` on every rank, in one fixed-size broadcast.

    One collective instead of `broadcast_object_list`'s two (size, then payload) plus pickling: this
    runs every few hundred milliseconds in the training loop.
    """
    if dist.get_rank() == source_rank:
        buffer = _encode_json(value)
    else:
        buffer = torch.zeros(CONTROL_MESSAGE_BYTES, dtype=torch.uint8)
    dist.broadcast(buffer, src=source_rank)
    return _decode_json(buffer)


@_blocking
def all_gather_json(value: Any) -> list[Any]:
    """Every rank's JSON-able `value`, in rank order, on every rank (one fixed-size all-gather)."""
    gathered = [torch.zeros(CONTROL_MESSAGE_BYTES, dtype=torch.uint8) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, _encode_json(value))
    return [_decode_json(part) for part in gathered]


@_blocking
def broadcast_object(value: Any, source_rank: int = 0) -> Any:
    """Rank `source_rank`'s picklable `value` on every rank (rare, larger messages such as actor handles)."""
    holder = [value if dist.get_rank() == source_rank else None]
    dist.broadcast_object_list(holder, src=source_rank)
    return holder[0]


@_blocking
def all_gather_objects(value: Any) -> list[Any]:
    """Every rank's picklable `value`, in rank order, on every rank (checkpoints: tensors and RNG states)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@_blocking
def barrier() -> None:
    """Return once every rank has called it."""
    dist.barrier()


@_blocking
def broadcast_tensors(tensors: Sequence[torch.Tensor], source_rank: int = 0) -> None:
    """Overwrite `tensors` on every rank with rank `source_rank`'s values (one flat broadcast)."""
    if not tensors:
        return
    vector = flatten(tensors)
    dist.broadcast(vector, src=source_rank)
    unflatten_into(vector, tensors)


@_blocking
def all_reduce_mean(vector: torch.Tensor) -> None:
    """In place: `vector` becomes the mean of all ranks' vectors."""
    dist.all_reduce(vector)
    vector.div_(dist.get_world_size())


def start_all_reduce(vector: torch.Tensor) -> Any:
    """Begin a sum all-reduce of `vector` in the background; returns the work handle for `wait`."""
    return dist.all_reduce(vector, async_op=True)


@_blocking
def wait(work: Any) -> None:
    """Wait for a collective started in the background."""
    work.wait()
