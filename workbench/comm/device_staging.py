"""Copies between a worker's CUDA device and host memory, for what crosses Dask.

Dask carries CPU tensors only (and no bfloat16), so whatever a CUDA worker sends to a parameter server,
to another rank as an object, or to the client, is brought to the host first. `HostStaging` does the
large, repeated copies of one flat vector through pinned host memory: a device-to-host copy into a
pinned slot (the DMA engine, not a pageable bounce buffer), and a host-to-device copy that the CPU does
not wait for, so it runs while the CPU queues the next step's kernels. On a CPU worker both are the
identity: the loop and the strategies are written once for both.
"""
from __future__ import annotations

from typing import Any

import torch


class HostStaging:
    """Pinned host slots for one flat vector of `numel` floats moved between `device` and the host."""

    def __init__(self, numel: int, device: torch.device, slots: int = 2) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        # Two slots for pushes: a packet sent without a copy refers to its slot until the push's reply is
        # back, while the next window is staged into the other one.
        self._slots = [torch.empty(numel, pin_memory=True) for _ in range(slots)] if self.on_cuda else []
        self._inbound = torch.empty(numel, pin_memory=True) if self.on_cuda else None
        self._inbound_done: Any = None  # the event after which the inbound slot may be written again

    def to_host(self, vector: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """`vector` on the host: itself on a CPU worker, else a copy in pinned slot `slot` (returned view
        is valid until that slot is staged into again)."""
        if not vector.is_cuda:
            return vector
        host = self._slots[slot][:vector.numel()]
        host.copy_(vector, non_blocking=True)
        torch.cuda.current_stream(vector.device).synchronize()  # what follows reads it on the CPU
        return host

    def to_device(self, vector: torch.Tensor) -> torch.Tensor:
        """`vector` (a host tensor) on the worker's device; on CUDA the copy is queued, not waited for."""
        if not self.on_cuda or vector.is_cuda:
            return vector
        if self._inbound_done is not None:
            self._inbound_done.synchronize()  # the last copy out of the slot has been read by the GPU
        inbound = self._inbound[:vector.numel()]
        inbound.copy_(vector)
        on_device = inbound.to(self.device, non_blocking=True)
        self._inbound_done = torch.cuda.Event()
        self._inbound_done.record()
        return on_device


def to_host(value: Any) -> Any:
    """`value` with every tensor in it (nested dicts, lists, tuples) on the CPU: for objects that cross
    Dask or go into a checkpoint a CPU-only client must be able to read."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.is_cuda else value
    if isinstance(value, dict):
        return {key: to_host(item) for key, item in value.items()}
    if isinstance(value, list):
        return [to_host(item) for item in value]
    if isinstance(value, tuple):
        items = [to_host(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # namedtuples too
    return value
