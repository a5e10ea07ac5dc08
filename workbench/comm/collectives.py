"""torch.distributed on Dask workers: forming and tearing down the process group, and the few collectives
the engine uses. gloo on CPU, NCCL on GPU; explicit rank, world size, address and timeout, never env vars.
"""
from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import psutil
import torch
import torch.distributed as dist

from workbench.comm import shared_memory
from workbench.comm.connections import SumCutter, sockets_per_peer, spread_over_sockets
from workbench.comm.averaging import flatten, unflatten_into
from workbench.errors import TrainingError

logger = logging.getLogger(__name__)


def find_free_port(host: str = "") -> int:
    """A TCP port free on this machine right now (run on rank 0's worker through `client.run`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def backend_for(device: torch.device, shares_a_gpu: bool = False) -> str:
    # On GPUs, NCCL carries CUDA tensors; the small control messages stay on the CPU and go through gloo.
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): ranks sharing one use gloo for CUDA
    # tensors too (its all-reduce and broadcast take them, staged through the host).
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:gloo" if shares_a_gpu else "cpu:gloo,cuda:nccl"


def gpu_identity(device: torch.device) -> str:
    """This rank's GPU, the same string on every rank that uses it: its UUID (with the host, in case a
    platform reports none)."""
    try:
        uuid = str(torch.cuda.get_device_properties(device).uuid)
    except Exception:
        uuid = f"index-{device.index or 0}"
    return f"{socket.gethostname()}/{uuid}"


def shares_a_gpu(identities: Sequence[str]) -> bool:
    """Whether any two ranks hold the same GPU (`gpu_identity` of each)."""
    return len(set(identities)) < len(identities)


def _gpus_shared(store: Any, rank: int, world_size: int, device: torch.device) -> bool:
    """Every rank says which GPU it holds through the group's store, before the group forms."""
    if device.type != "cuda":
        return False
    store.set(f"workbench-gpu-{rank}", gpu_identity(device))
    identities = [store.get(f"workbench-gpu-{other}").decode() for other in range(world_size)]
    shared = shares_a_gpu(identities)
    if shared:
        logger.info("ranks share a GPU (%s): CUDA tensors go through gloo, not NCCL", identities)
    return shared


def init_process_group(host: str, port: int, rank: int, world_size: int, device: torch.device,
                       timeout_s: float, dask_ports: Sequence[int] = (), own_host: str | None = None) -> None:
    """Join the run's process group; fails after `timeout_s` instead of torch's 30-minute default.

    `own_host` is the address this worker's Dask connection uses: gloo (and NCCL's bootstrap) are bound to
    the interface holding it, not to whatever the machine's hostname resolves to (loopback on a stock
    Debian, or docker0, a VPN...). Before the group forms, every rank checks that it can reach every other
    rank's advertised address, so a group that cannot form fails at once on every rank with the address
    that could not be reached, instead of one rank waiting out the whole timeout.
    """
    # Leases keep runs apart, but a worker is given back when its run's client is gone, while the
    # worker's task is still leaving (at its next step), or still forming its group: wait for it rather
    # than fail the new run. The process's one group is claimed before forming it, not when formed: a
    # task that found no group and went on while the old one finished forming its own failed with
    # "trying to initialize the default process group twice" (seen once, a client SIGKILLed just after
    # its run started).
    global _claimed
    with _group_ended:
        if not _group_ended.wait_for(lambda: not _claimed and not dist.is_initialized(), timeout=timeout_s):
            raise TrainingError(
                f"this worker process still belongs to another torch.distributed process group after "
                f"{timeout_s:g} s: another run is training on it. Wait for that run to end or start this "
                f"one on other workers."
            )
        _claimed = True
    timeout = datetime.timedelta(seconds=timeout_s)
    bound = bind_to_interface_of(own_host)
    before = _tcp_sockets()
    try:
        try:
            if rank != 0 and not await_listening(host, port, timeout_s):
                raise TimeoutError(f"nothing listened there within {timeout_s:g} s")
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        except Exception as error:
            raise GroupFormationError(
                f"rank {rank} could not reach the process group's store at {host}:{port} (rank 0's Dask host) "
                f"within {timeout_s:g} s: {type(error).__name__}: {error}. A firewall between the workers' "
                f"hosts must let TCP through on any port; the workers' Dask connections alone are not enough"
            ) from error
        check_reachable(store, rank, world_size, advertised_address(), min(timeout_s, PROBE_TIMEOUT_S),
                        bound_here="GLOO_SOCKET_IFNAME" in bound)
        token = shared_memory.agree_on_shared_memory(store, rank, world_size, advertised_address())
        backend = backend_for(device, _gpus_shared(store, rank, world_size, device))
        with spread_over_sockets(sockets_per_peer() if backend == "gloo" and world_size > 1 and not token else 1) as sockets:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        global _store, _reducer, _cutter, _timeout_s
        _store, _timeout_s = store, timeout_s
        # Across hosts on gloo (no shared memory): sums cut over the connections, or coded on thin links.
        _cutter = SumCutter(sockets, lambda: _timeout_s) if backend == "gloo" and world_size > 1 and not token else None
        _reducer = shared_memory.SharedMemoryReducer(token, rank, world_size) if token else None
    except BaseException:
        # torch numbers its groups before building them: a group that failed to form left the counter
        # moved on here and not on the other ranks, and every later run on this worker then waited for
        # keys no other rank writes (`DistStoreError`). Put it back, as a successful destroy would.
        if not dist.is_initialized():
            dist.distributed_c10d._world.group_count = 0
            _release_claim()
        raise
    finally:
        for variable in bound:
            os.environ.pop(variable, None)
    # What the group opened: new sockets, less any Dask opened meanwhile to its servers (`dask_ports`),
    # each with its two ends, so that a descriptor closed and reused by another connection since is
    # never taken for the group's. New by descriptor and ends: a connection open before that closed
    # meanwhile leaves its descriptor free for the group's, which a check by descriptor alone missed.
    _group_sockets.clear()
    _group_sockets.update(opened_since(before, _tcp_sockets(exclude_ports=set(dask_ports))))


STORE_RETRY_S = 0.01  # between connects to rank 0's store while it does not listen yet


def await_listening(host: str, port: int, timeout_s: float) -> bool:
    """Return once something listens at host:port (True), or once `timeout_s` of refused connects have
    passed (False); at once (True) on any other error, which the store's own connect then reports.

    torch's store client, refused, backs off for 0.3-0.5 s before it tries again: a rank that asked a
    moment before rank 0 opened its store paid that in about one group in three here (measured), at every
    run's start and every regroup; probing with a plain connect every 10 ms pays 10 ms at most. The store
    takes the probe's empty connection in stride."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            socket.create_connection((host, port), timeout=min(1.0, left)).close()
            return True
        except ConnectionRefusedError:
            time.sleep(STORE_RETRY_S)  # a port that is not open yet: nothing to wait on
        except OSError:
            return True


class GroupFormationError(TrainingError):
    """The run's process group could not form (a rank cannot reach another): a configuration error of
    the cluster, not the loss of a worker, so the run fails instead of going on without the worker."""


SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
PROBE_TIMEOUT_S = 5.0  # a TCP connect between two hosts that can reach each other takes milliseconds


def interface_holding(address: str) -> str | None:
    """The name of this machine's network interface that holds IPv4 `address` (None when none does)."""
    try:
        address = socket.gethostbyname(address)
    except OSError:
        return None
    for name, entries in psutil.net_if_addrs().items():
        if any(entry.family == socket.AF_INET and entry.address == address for entry in entries):
            return name
    return None


def bind_to_interface_of(own_host: str | None) -> list[str]:
    """Point gloo and NCCL at the interface holding `own_host`, unless the user named one; returns the
    variables it set, to remove once the group is built (they are read then, and the worker outlives the run)."""
    interface = interface_holding(own_host) if own_host else None
    if interface is None:
        return []
    bound = [variable for variable in SOCKET_IFNAME_VARIABLES if variable not in os.environ]
    for variable in bound:
        os.environ[variable] = interface
    return bound


def advertised_address() -> str:
    """The IPv4 address gloo will tell the other ranks to connect to: the one of the interface
    `GLOO_SOCKET_IFNAME` names, else the one this machine's hostname resolves to (gloo's own rule)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        for entry in psutil.net_if_addrs().get(interface, []):
            if entry.family == socket.AF_INET:
                return entry.address
        raise GroupFormationError(f"GLOO_SOCKET_IFNAME={interface!r} names no interface with an IPv4 address "
                                  f"on this worker (interfaces: {', '.join(sorted(psutil.net_if_addrs()))})")
    return socket.gethostbyname(socket.gethostname())


def check_reachable(store: Any, rank: int, world_size: int, address: str, timeout_s: float,
                    bound_here: bool) -> None:
    """Every rank listens on its advertised address and connects to every other's, then all ranks read
    every rank's findings from the store and raise the same error if any pair failed."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind((address, 0))
        listener.listen(world_size)
        store.set(f"workbench/probe/{rank}", f"{address}:{listener.getsockname()[1]}")
        failures = []
        for peer in range(world_size):
            if peer == rank:
                continue
            target = store.get(f"workbench/probe/{peer}").decode()
            peer_host, peer_port = target.rsplit(":", 1)
            try:
                with socket.create_connection((peer_host, int(peer_port)), timeout=timeout_s):
                    pass
            except OSError as error:
                failures.append(f"rank {rank} (advertising {address}) cannot reach rank {peer} at {target}: "
                                f"{error.strerror or error}")
        store.set(f"workbench/reach/{rank}", json.dumps(failures))
        everyone = [json.loads(store.get(f"workbench/reach/{peer}")) for peer in range(world_size)]
    problems = [failure for failures in everyone for failure in failures]
    if problems:
        # Rank 0 hosts the store: it raises last, so no rank loses the store before it has read everything.
        store.set(f"workbench/read/{rank}", "1")
        if rank == 0:
            store.wait([f"workbench/read/{peer}" for peer in range(world_size)])
        interface = os.environ.get("GLOO_SOCKET_IFNAME")
        how = (f"gloo was bound to interface {interface}, the one holding this worker's Dask address"
               if bound_here else f"GLOO_SOCKET_IFNAME={interface} is set on this worker"
               if interface else "gloo advertises the address this machine's hostname resolves to")
        raise GroupFormationError(
            f"the process group cannot form: {'; '.join(problems[:4])}"
            f"{f' (and {len(problems) - 4} more)' if len(problems) > 4 else ''}. {how}. Set GLOO_SOCKET_IFNAME "
            f"(NCCL_SOCKET_IFNAME on GPUs) on every worker to the interface the workers reach each other on, "
            f"or leave it unset so the workbench binds to the interface of each worker's Dask address")


MEET_POLL_S = 0.05  # how often a rank waiting to meet looks whether the others have come (store reads of bytes)


def meet(point: int, give_up: Callable[[], bool]) -> bool:
    """Wait until every rank of the group has come to meeting `point` (numbered alike on every rank), with
    no deadline of its own: a rank of an asynchronous strategy may be minutes behind another on a thin
    link, and a collective waited on meanwhile would time out (`collective_timeout_s`) though nothing is
    wrong. Marks come and go through the group's store. Returns False at once when `give_up()` says so
    (the client ended the group: a lost or failed peer, whose own waits all have deadlines; or the
    client is gone)."""
    store, rank, world_size = _store, dist.get_rank(), dist.get_world_size()
    keys = [f"workbench-meet-{point}-{other}" for other in range(world_size)]
    try:
        store.set(keys[rank], b"1")
        while not store.check(keys):
            if give_up():
                return False
            time.sleep(MEET_POLL_S)
    except Exception:
        if give_up():  # the group was broken under the wait because the client ended it
            return False
        raise
    return True


def destroy_process_group() -> None:
    global _store, _reducer, _cutter
    if _cutter is not None:
        _cutter.close()
    _store, _cutter = None, None
    if _reducer is not None:
        _reducer.close()
        _reducer = None
    with _breaking:
        _group_sockets.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    _release_claim()


def _release_claim() -> None:
    """This process belongs to no group and forms none: the next run's task may form its own."""
    global _claimed
    with _group_ended:
        _claimed = False
        _group_ended.notify_all()


_group_ended = threading.Condition()  # notified when this process leaves its process group
_claimed = False  # a task of this process is forming or holds the process group (`init_process_group`)
_store: Any = None  # the process group's store while this process belongs to one (`meet`)
# Sums through /dev/shm while every rank of the group is on this machine (`start_all_reduce` with a channel).
_reducer: shared_memory.SharedMemoryReducer | None = None
# Across hosts, with several connections per peer: which sums go in pieces (`start_all_reduce` with a channel).
_cutter: SumCutter | None = None
_timeout_s = 0.0  # the group's collective timeout in force (`set_timeout`): coded sums wait as long at most


# The sockets the process group opened (gloo's connections to its peers and the store's): descriptor ->
# (local, remote) address, so that a group that was ended can be broken from another thread.
_group_sockets: dict[int, tuple[Any, Any]] = {}
_breaking = threading.Lock()  # a break and the group's end never interleave


def break_process_group() -> bool:
    """Make the training thread's wait on the process group fail at once (from another thread); returns
    whether it broke the group (only while a collective is waited on: shutting gloo's connections down
    while it is idle killed the worker process, measured).

    gloo has no working abort (`ProcessGroupGloo.abort()` and `shutdown()` leave a blocked wait blocked,
    measured), and a rank waiting to receive from a peer that left, or one blocked on a dead peer
    through another, waited out its whole collective timeout. Shutting the group's sockets down makes
    gloo see its connections close, as when the peer dies: the wait raises and the worker leaves.
    """
    with _breaking:
        if not _waiting or not _group_sockets:
            return False
        for descriptor, ends in list(_group_sockets.items()):
            try:
                with socket.socket(fileno=os.dup(descriptor)) as connection:
                    if _ends(connection) != ends:  # closed by gloo and the number reused by another connection
                        logger.warning("not breaking socket %d: it is %s now, not the group's %s", descriptor,
                                       _ends(connection), ends)
                        continue
                    connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed already, or not a connected socket (gloo's listener)
        _group_sockets.clear()
        return True


def opened_since(before: dict[int, tuple[Any, Any]], now: dict[int, tuple[Any, Any]]) -> dict[int, tuple[Any, Any]]:
    """The sockets in `now` that were not open in `before`: a descriptor counts as the same socket only
    with the same two ends (descriptors are reused as soon as a connection closes)."""
    return {fd: ends for fd, ends in now.items() if before.get(fd) != ends}


def _ends(connection: socket.socket) -> tuple[Any, Any]:
    try:
        return connection.getsockname()[:2], connection.getpeername()[:2]
    except OSError:
        return None, None


def _tcp_sockets(exclude_ports: set[int] = frozenset()) -> dict[int, tuple[Any, Any]]:
    """This process's connected TCP sockets: descriptor -> (local, remote) address."""
    try:
        # Never gloo's listener: shutting it down made gloo's accept fail with EINVAL and terminate the
        # worker process (seen under load while a survivor's group was broken after a kill).
        return {c.fd: ((c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port) if c.raddr else None)
                for c in psutil.Process().net_connections(kind="tcp")
                if c.fd >= 0 and c.status != psutil.CONN_LISTEN and not (c.raddr and c.raddr.port in exclude_ports)}
    except psutil.Error:
        return {}


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


def start_all_reduce(vector: torch.Tensor, channel: int | None = None) -> Any:
    """Begin a sum all-reduce of `vector` in the background; returns the work handle for `wait`.

    `channel` (a number the caller keeps for this buffer, the same on every rank) promises that it has at
    most one sum in flight and is waited for with `wait` before its next use: then, when every rank is on
    this machine, the sum goes through shared memory (`comm/shared_memory.py`) instead of gloo's sockets,
    and across hosts a sum the link makes slow is cut over the group's connections, or coded on a thin link
    (`comm/connections.py`)."""
    if channel is not None and _reducer is not None and vector.device.type == "cpu":
        return _reducer.start(vector, channel)
    if channel is not None and _cutter is not None:  # across hosts: a slow sum over every connection
        return _cutter.start(vector, channel, wait)
    return dist.all_reduce(vector, async_op=True)


def start_all_gather(part: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
    """Begin gathering every rank's `part` (the same shape on every rank) in the background; returns the
    work handle for `wait` and the list the parts land in, in rank order."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    return dist.all_gather(parts, part, async_op=True), parts


def when_done(work: Any, callback: Callable[[Any], Any]) -> None:
    """Call `callback` once the collective `work` (from `start_all_reduce`) has completed."""
    work.get_future().add_done_callback(callback)


def set_timeout(timeout_s: float) -> None:
    """The longest this rank's collectives wait for the others from now on (the run's timeout in force)."""
    global _timeout_s
    if dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))
        _timeout_s = timeout_s


@_blocking
def wait(work: Any) -> None:
    """Wait for a collective started in the background."""
    work.wait()
