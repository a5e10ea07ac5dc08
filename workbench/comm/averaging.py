"""Pure arithmetic of data-parallel synchronisation: bucketing, averaging, divergence, low-precision wire
payloads, the outer optimizer (DiLoCo) and delayed averaging. No I/O here.

Kept apart from the collectives so it is unit-tested without a process group.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def assign_buckets(sizes_in_bytes: Sequence[int], cap_bytes: int, first_cap_bytes: int | None = None) -> list[list[int]]:
    """Group parameter indices into buckets as PyTorch DDP does (`compute_bucket_assignment_by_size`): a
    bucket takes tensors until it holds `cap_bytes` or more, then closes; the first closes at
    `first_cap_bytes` (DDP's 1 MiB: a model under the cap would otherwise be one bucket, whose all-reduce
    waits for the whole backward).

    Indices are taken in reverse, the order in which backward produces gradients, so the first bucket
    fills (and its all-reduce starts) while the rest of backward still runs. Closing once full, not before
    overflowing, keeps a large tensor with the small ones before it: on the benchmark MLP the first bucket
    then holds the middle layer's weights, whose exchange runs beside the first layer's backward, and the
    step makes two gloo calls, not four (each one a meeting with the peer, which a host short of CPU delays).
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(sizes_in_bytes))):
        current.append(index)
        current_bytes += sizes_in_bytes[index]
        cap = cap_bytes if buckets or first_cap_bytes is None else min(cap_bytes, first_cap_bytes)
        if current_bytes >= cap:
            buckets.append(current)
            current, current_bytes = [], 0
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


def flat_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor | float]:
    """The optimizer's state in a form independent of how the parameters are split: one flat vector per
    per-parameter key (momentum, Adam's moments), in parameter order, and one number per scalar key
    (Adam's step). Empty while any parameter has no state yet (before the first step, or plain SGD).

    This is what carries over a strategy switch: the workers' optimizer has one tensor per layer, the
    parameter server's has one per shard.
    """
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    states = [optimizer.state.get(p, {}) for p in parameters]
    if not parameters or any(not state for state in states):
        return {}
    flat: dict[str, torch.Tensor | float] = {}
    for key, value in states[0].items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if all(isinstance(s.get(key), torch.Tensor) and s[key].shape == p.shape for s, p in zip(states, parameters)):
                flat[key] = torch.cat([s[key].detach().reshape(-1).float().cpu() for s in states])
        elif isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
            flat[key] = float(value)
    return flat


def load_flat_optimizer_state(optimizer: torch.optim.Optimizer, flat: dict[str, torch.Tensor | float]) -> None:
    """Give `optimizer` the state `flat_optimizer_state` described (its parameters in the same order)."""
    if not flat:
        return
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    expected = sum(p.numel() for p in parameters)
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and value.numel() != expected:
            raise ValueError(f"optimizer state '{key}' has {value.numel()} values for {expected} parameters")
    offset = 0
    for parameter in parameters:
        count = parameter.numel()
        state = {}
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                state[key] = value[offset:offset + count].view_as(parameter).to(parameter.device, parameter.dtype).clone()
            else:
                state[key] = torch.tensor(value, dtype=torch.float32)  # Adam keeps `step` as a float tensor
        optimizer.state[parameter] = state
        offset += count


def slice_optimizer_state(flat: dict[str, torch.Tensor | float], start: int, stop: int) -> dict[str, torch.Tensor | float]:
    """The part of a flat optimizer state that belongs to parameters [start, stop) (one server shard)."""
    return {key: value[start:stop].clone() if isinstance(value, torch.Tensor) else value for key, value in flat.items()}


def join_optimizer_states(parts: Sequence[dict[str, torch.Tensor | float]]) -> dict[str, torch.Tensor | float]:
    """The flat optimizer state of consecutive shards, joined back in order."""
    if not parts or any(not part for part in parts):
        return {}
    return {key: torch.cat([part[key] for part in parts]) if isinstance(value, torch.Tensor) else value
            for key, value in parts[0].items()}


def fingerprint(vector: torch.Tensor, probes: int = 3, seed: int = 0) -> list[float]:
    """A few numbers identifying a weight vector: its sum and its projections on fixed random directions.

    Linear in the vector, so the fingerprint of an average is the average of the fingerprints: enough to
    check from metrics alone that workers hold the same (or the averaged) weights.
    """
    generator = torch.Generator().manual_seed(seed)
    values = vector.detach().reshape(-1).cpu().double()
    projections = torch.zeros(probes, dtype=torch.float64)
    # In chunks: the random directions of a large model would not fit in memory at once.
    for chunk in values.split(FINGERPRINT_CHUNK):
        projections += torch.randn(probes, chunk.numel(), generator=generator, dtype=torch.float64) @ chunk
    return [float(values.sum())] + projections.tolist()


FINGERPRINT_CHUNK = 1 << 20


# --- slow links: low precision on the wire, the outer optimizer, delayed (overlapped) averaging ------------

WIRE_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def scale_for_wire(vector: torch.Tensor, dtype: torch.dtype, world_size: int, weight: float | None = None) -> torch.Tensor:
    """In place: `vector` / `world_size` (or times this rank's `weight`, the weights summing to one), ready to
    be cast to `dtype` for a sum all-reduce that yields the (weighted) mean.

    Divided before the sum, as PyTorch DDP's `fp16_compress_hook` does, so that the sum of the ranks'
    values cannot overflow fp16 where the values themselves fit; here divided while still float32 (one
    rounding, not two) and clamped so that `world_size` of them still fit fp16's range (as the `fp16`
    compression of the parameter server clamps). bf16 has float32's range and needs no clamp.
    """
    if weight is None:
        vector.div_(world_size)
    else:
        vector.mul_(weight)
    return clamp_for_wire(vector, dtype, world_size)


def clamp_for_wire(vector: torch.Tensor, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """In place: `vector`, already scaled, clamped so that the sum of `world_size` of them fits `dtype`
    (fp16's range; bf16 has float32's and needs nothing)."""
    if dtype == torch.float16:
        limit = torch.finfo(torch.float16).max / world_size
        vector.clamp_(-limit, limit)
    return vector


def all_reduce_bytes_sent(payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends in a bandwidth-optimal (ring) all-reduce of `payload_bytes`: 2 (N - 1) / N of
    it, half in the reduce-scatter and half in the all-gather; one whole payload with two workers."""
    return 2 * (world_size - 1) * payload_bytes // world_size if world_size > 1 else 0


def all_gather_bytes_sent(payload_bytes: int, world_size: int) -> int:
    """Bytes each rank sends in a ring all-gather of one `payload_bytes` part from every rank: N - 1 parts."""
    return (world_size - 1) * payload_bytes


def encode_weights(local: torch.Tensor, base: torch.Tensor, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """What a worker puts on the wire for a sum all-reduce whose result `decode_average` turns into the
    workers' mean weights.

    float32: the weights themselves (a copy), summed and then divided, exactly today's averaging.
    fp16/bf16: the change from `base` (the last common weights, equal on every worker), pre-divided by
    the world size. Weights cast to half precision would lose what training added since the base
    (fp16 keeps 11 bits: a weight of 0.05 is rounded by 2.4e-5, about what one SGD step moves it); the
    change is small and keeps its own relative precision, as DiLoCo's outer gradients do on the wire.
    """
    if dtype == torch.float32:
        return local.clone()
    return scale_for_wire(base - local, dtype, world_size).to(dtype)


def decode_average(summed: torch.Tensor, base: torch.Tensor, world_size: int) -> torch.Tensor:
    """The workers' mean weights (float32) from the sum all-reduce of `encode_weights`; a float32
    `summed` becomes the mean in place."""
    if summed.dtype == torch.float32:
        return summed.div_(world_size)  # in place: the wire buffer is used once
    return base - summed.float()


def outer_step(global_weights: torch.Tensor, average: torch.Tensor, momentum_buffer: torch.Tensor | None,
               lr: float, momentum: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DiLoCo's outer optimizer (Douillard et al. 2023): SGD with Nesterov momentum whose gradient is the
    outer gradient `global_weights - average` (how far the workers' mean moved back from the last common
    weights). Returns the new global weights and momentum buffer; the inputs are left unchanged.

    As `torch.optim.SGD(nesterov=True, dampening=0)`: buffer = momentum * buffer + gradient (a missing
    buffer counts as zero, which is SGD's first-step rule), step = gradient + momentum * buffer, global =
    global - lr * step. lr 1 and momentum 0 is plain averaging: the mean itself is returned, bit for
    bit. With momentum 0 no buffer is kept (a later momentum starts it afresh, as SGD would).
    """
    if lr == 1 and momentum == 0:
        return average, None
    gradient = global_weights - average
    if momentum == 0:
        return global_weights - lr * gradient, None
    buffer = gradient.clone() if momentum_buffer is None else momentum * momentum_buffer + gradient
    return global_weights - lr * (gradient + momentum * buffer), buffer


def delayed_apply(local: torch.Tensor, snapshot: torch.Tensor, new_global: torch.Tensor) -> torch.Tensor:
    """In place on `local`: delayed averaging: the weights a worker goes on with when an exchange it started at `snapshot`
    arrives one period late, while it trained on to `local`. new global + (local - snapshot).

    Correct because every worker's weights are always the common global weights plus its own progress
    not yet averaged: the exchange replaced each worker's progress up to the snapshot by everyone's mean
    progress (inside `new_global`), and the progress made since the snapshot is the worker's own, kept
    for the next exchange. No step is counted twice or lost; each is only averaged one period late, and
    the progress since the snapshot was computed from the pre-exchange weights: the staleness that
    overlapping pays for its hidden communication. This is the one-step delayed outer update of
    Streaming DiLoCo's overlapped communication (Douillard et al. 2025) and the "naive delayed" variant
    of Kale, Douillard and Donchev 2025, whose "eager updates" refine it.
    """
    return local.sub_(snapshot).add_(new_global)  # in place: callers pass a fresh flatten
