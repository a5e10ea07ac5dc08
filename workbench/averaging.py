"""Pure arithmetic of data-parallel synchronisation: bucketing, averaging, divergence. No I/O here.

Kept apart from the collectives so it is unit-tested without a process group.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def assign_buckets(sizes_in_bytes: Sequence[int], cap_bytes: int) -> list[list[int]]:
    """Group parameter indices into buckets of at most `cap_bytes` (a larger single tensor gets its own).

    Indices are taken in reverse, the order in which backward produces gradients, so the first bucket
    fills (and its all-reduce starts) while the rest of backward still runs.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(sizes_in_bytes))):
        size = sizes_in_bytes[index]
        if current and current_bytes + size > cap_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def relative_divergence(local: torch.Tensor, average: torch.Tensor) -> float:
    """||local - average|| / ||average||: how far one worker's weights drifted from the consensus."""
    denominator = torch.linalg.vector_norm(average).item()
    distance = torch.linalg.vector_norm(local - average).item()
    return distance / denominator if denominator > 0 else distance


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous float vector holding all `tensors` (a copy), for a single collective."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def unflatten_into(vector: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of `vector` back into `tensors`, in place."""
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(vector[offset : offset + count].view_as(tensor))
        offset += count


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The floating-point state tensors of `optimizer` (momentum, Adam moments) in a stable order."""
    tensors = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter, {})
            for key in sorted(state):
                value = state[key]
                # Step counters are scalars identical on all workers; averaging them is harmless but
                # pointless, and Adam keeps them as 0-dim tensors that may be integers on some versions.
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0:
                    tensors.append(value)
    return tensors


def elastic_pull(local: torch.Tensor, center: torch.Tensor, alpha: float) -> torch.Tensor:
    """Elastic averaging's exchange term alpha * (local - center) (Zhang, Choromanska, LeCun 2015).

    The worker subtracts it from its weights and the center adds it: both move towards each other.
    """
    return alpha * (local - center)
