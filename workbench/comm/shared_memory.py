"""Same-host all-reduce through shared memory: when every rank of the group runs on one machine, a bucket's
sum is read from the others' copies in `/dev/shm` instead of travelling through gloo's loopback sockets.

gloo's ring on one machine still pushes every byte through the kernel's TCP stack twice and reduces it in
its own threads, which on a machine with few cores compete with the training for the CPU: on the 2-core
benchmark machine that exchange, not the arithmetic, is what kept PyTorch DDP at about 0.6 of N plain
processes side by side. Here each rank copies its buffer into its own slot (a file in `/dev/shm` mapped
by every rank), a one-element gloo all-reduce says that every rank has written, and each rank sums all
the slots in rank order into its buffer: every rank computes the same sum in the same order, so the
replicas stay bit-identical, as with gloo (and for two ranks the sum is gloo's, bit for bit).

A slot is reused two uses later (two parities per channel), which is safe because a channel has at most
one sum in flight and a rank only starts the next use of a channel after waiting for the previous one: a
rank writing use n+2 has seen every rank start use n+1, which each did only after reading use n. A slot's
file is unlinked as soon as every rank has mapped it (after the following use's signal), so a process
that dies leaves nothing in `/dev/shm` once the run has made two steps; `close` removes the rest. A rank
that leaves (after a failure) may remove a slot a slower peer has not read yet: the peer then sees a peer
lost, as it would over gloo.

Used only where it is sure to be right: CPU tensors, every rank advertising the same network address
(so the lab's emulated hosts, which share the VM's `/dev/shm`, still talk over their links) and seeing
every other rank's probe file. `WORKBENCH_SHARED_MEMORY=0` on the workers turns it off.

A `/dev/shm` too small for a channel's slots (Docker gives a container 64 MB unless told `--shm-size`,
and two parities of every rank's bucket must fit) does not fail the run: the signal carries each rank's
word on whether its slot could be made, and when one could not, every rank sums that use through gloo
and the channel goes through gloo from then on, its slots freed; the others keep shared memory.
"""
from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import uuid
from typing import Any

import torch
import torch.distributed as dist

SHM_DIRECTORY = "/dev/shm"
SWITCH_VARIABLE = "WORKBENCH_SHARED_MEMORY"  # "0" on a worker: every all-reduce goes through gloo
PREFIX = "workbench-"

logger = logging.getLogger(__name__)


def enabled_here() -> bool:
    return os.environ.get(SWITCH_VARIABLE, "1") != "0" and os.path.isdir(SHM_DIRECTORY)


def agree_on_shared_memory(store: Any, rank: int, world_size: int, address: str) -> str | None:
    """Run on every rank while the group forms: the group's token when all ranks may sum through shared
    memory (same advertised address, each sees every other's probe), else None, the same on every rank."""
    if world_size < 2:
        return None
    probe, nonce = None, uuid.uuid4().hex
    if enabled_here():
        probe = os.path.join(SHM_DIRECTORY, f"{PREFIX}probe-{nonce}")
        try:
            with open(probe, "w") as handle:
                handle.write(nonce)
        except OSError:
            probe = None
    record = {"address": address, "probe": probe, "nonce": nonce, "token": uuid.uuid4().hex[:16]}
    store.set(f"workbench/shm/{rank}", json.dumps(record))
    peers = [json.loads(store.get(f"workbench/shm/{other}")) for other in range(world_size)]
    sees_all = probe is not None and all(_reads(peer["probe"], peer["nonce"]) for peer in peers)
    store.set(f"workbench/shm-ok/{rank}", "1" if sees_all and len({p["address"] for p in peers}) == 1 else "0")
    verdicts = [store.get(f"workbench/shm-ok/{other}").decode() for other in range(world_size)]
    if probe is not None:  # every rank has given its verdict: nobody reads the probes any more
        os.unlink(probe)
    return peers[0]["token"] if all(verdict == "1" for verdict in verdicts) else None


def _reads(path: str | None, nonce: str) -> bool:
    try:
        with open(path) as handle:
            return handle.read() == nonce
    except (OSError, TypeError):
        return False


class _Slots:
    """One channel's buffers of one parity: this rank's (created here) and every rank's (mapped)."""

    def __init__(self, stem: str, rank: int, world_size: int, numel: int, dtype: torch.dtype) -> None:
        self.paths = [f"{stem}-{other}" for other in range(world_size)]
        self.rank, self.numel, self.dtype = rank, numel, dtype
        self.nbytes = numel * dtype.itemsize
        self.views: list[torch.Tensor | None] = [None] * world_size
        self.views[rank] = self._map(self.paths[rank], create=True)
        self.linked = True  # this rank's file still has a name in /dev/shm

    def _map(self, path: str, create: bool) -> torch.Tensor:
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        descriptor = os.open(path, flags, 0o600)
        try:
            if create:  # real pages now: a full /dev/shm fails here with ENOSPC, not later with SIGBUS
                os.posix_fallocate(descriptor, 0, self.nbytes)
            mapped = mmap.mmap(descriptor, self.nbytes)
        except OSError:
            if create:  # no empty file left behind in /dev/shm
                os.unlink(path)
            raise
        finally:
            os.close(descriptor)
        return torch.frombuffer(mapped, dtype=self.dtype, count=self.numel)

    def all(self) -> list[torch.Tensor]:
        """Every rank's slot, mapping the others' on first use (they exist once every rank has signalled).

        A slot gone by then was removed by its rank leaving the group (`close`, on its way out after a
        failure): it signalled this use, read the others' slots and left before this rank came to read its
        one. That is a peer lost, said as one (a ConnectionError), so this rank leaves too instead of
        reporting a failure of its own ahead of the peer's (seen once in the suite: `average`, a data error
        on one rank right after a sync)."""
        for other, view in enumerate(self.views):
            if view is None:
                try:
                    self.views[other] = self._map(self.paths[other], create=False)
                except FileNotFoundError:
                    raise ConnectionError(f"rank {other} left the group: its shared-memory slot "
                                          f"{self.paths[other]} was removed before this rank read it") from None
        return self.views  # type: ignore[return-value]

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.paths[self.rank])
            except FileNotFoundError:
                pass


class SharedMemoryReducer:
    """Sums over the ranks of one machine's group; one per process group (`collectives`)."""

    def __init__(self, token: str, rank: int, world_size: int) -> None:
        self.token, self.rank, self.world_size = token, rank, world_size
        self.slots: dict[tuple[Any, ...], _Slots] = {}
        self.uses: dict[tuple[Any, ...], int] = {}
        self.through_gloo: set[tuple[Any, ...]] = set()  # channels some rank could not make slots for

    def start(self, vector: torch.Tensor, channel: int) -> Any:
        key = (channel, vector.numel(), vector.dtype)
        if key in self.through_gloo:
            return dist.all_reduce(vector, async_op=True)
        use = self.uses.get(key, 0)
        self.uses[key] = use + 1
        try:
            slots = self._slots(key, use % 2)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise
            logger.warning("no room in %s for a %d-byte slot (%s): this channel's sums go through gloo",
                           SHM_DIRECTORY, vector.numel() * vector.element_size(), error)
            slots = None
        else:
            slots.views[self.rank].copy_(vector.reshape(-1))
        # Its completion says every rank has written this use (and so has read its use n-1); its sum counts
        # the ranks that could not make their slot.
        missing = torch.tensor([0.0 if slots is not None else 1.0])
        signal = dist.all_reduce(missing, async_op=True)
        previous = self.slots.get((*key, (use - 1) % 2)) if use else None
        return LocalSum(self, key, vector, slots, signal, missing, previous)

    def give_up(self, key: tuple[Any, ...]) -> None:
        """Every rank, at the same use: the channel goes through gloo from now on, its slots freed (nobody
        reads them any more: every rank has signalled this use, so it has read the one before)."""
        self.through_gloo.add(key)
        for parity in (0, 1):
            slots = self.slots.pop((*key, parity), None)
            if slots is not None:
                slots.unlink()

    def _slots(self, key: tuple[Any, ...], parity: int) -> _Slots:
        found = self.slots.get((*key, parity))
        if found is None:
            channel, numel, dtype = key
            stem = os.path.join(SHM_DIRECTORY, f"{PREFIX}{self.token}-{channel}-{numel}-{str(dtype)[6:]}-{parity}")
            found = self.slots[(*key, parity)] = _Slots(stem, self.rank, self.world_size, numel, dtype)
        return found

    def close(self) -> None:
        for slots in self.slots.values():
            slots.unlink()
        self.slots.clear()


class LocalSum:
    """One sum in flight: `wait` ends it with the sum of every rank's vector in `vector`."""

    def __init__(self, reducer: SharedMemoryReducer, key: tuple[Any, ...], vector: torch.Tensor,
                 slots: _Slots | None, signal: Any, missing: torch.Tensor, previous: _Slots | None) -> None:
        self.reducer, self.key, self.vector = reducer, key, vector
        self.slots, self.signal, self.missing, self.previous = slots, signal, missing, previous

    def wait(self) -> None:
        self.signal.wait()
        if self.missing.item() > 0:  # a rank had no slot: every rank sums this use through gloo
            self.reducer.give_up(self.key)
            dist.all_reduce(self.vector)
            return
        if self.previous is not None:  # every rank has read the previous use: its file may lose its name
            self.previous.unlink()
        views = self.slots.all()
        flat = self.vector.view(-1)
        torch.add(views[0], views[1], out=flat)
        for view in views[2:]:
            flat.add_(view)
