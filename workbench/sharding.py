"""Pure data-sharding arithmetic: which sample indices each worker trains on, per epoch.

Every worker computes its own shard from (seed, epoch, rank), so no index lists travel. Shards are
disjoint, of equal size (the remainder is dropped, as `DistributedSampler(drop_last=True)` does), and
reshuffled every epoch. A step's global batch is every rank's batch of that step, in rank order
(`global_batches`); a balanced strategy cuts it into unequal shares instead (`balanced_shares`), so the
samples a step trains on are the same whoever takes which of them.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def shard_size(n_samples: int, world_size: int) -> int:
    """Samples each of `world_size` workers gets from a dataset of `n_samples`."""
    return n_samples // world_size


def shard_indices(n_samples: int, world_size: int, rank: int, epoch: int, seed: int) -> torch.Tensor:
    """Indices of rank `rank`'s shard for `epoch`: a slice of one seeded permutation of all samples."""
    generator = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    permutation = torch.randperm(n_samples, generator=generator)
    size = shard_size(n_samples, world_size)
    return permutation[rank * size : (rank + 1) * size]


def global_batches(n_samples: int, world_size: int, epoch: int, seed: int, batch_size: int) -> list[torch.Tensor]:
    """Per step of `epoch`, the group's whole batch: rank 0's batch of that step, then rank 1's, ...
    (`world_size * batch_size` indices). Rank r's slice [r * batch_size, (r + 1) * batch_size) of it is
    exactly its batch from `shard_indices`, so equal shares train on what unbalanced strategies do."""
    generator = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
    permutation = torch.randperm(n_samples, generator=generator)
    size = shard_size(n_samples, world_size)
    steps = size // batch_size
    shards = permutation[: world_size * size].view(world_size, size)[:, : steps * batch_size]
    rows = shards.reshape(world_size, steps, batch_size).transpose(0, 1).reshape(steps, world_size * batch_size)
    return list(rows)


def balanced_shares(rates: Sequence[float], total: int, minimum: int = 1, current: Sequence[int] | None = None,
                    step: float = 1.0, fixed_s: Sequence[float] | None = None) -> list[int]:
    """Samples of a global batch of `total` for each rank, as whole numbers summing to `total`, none under
    `minimum`, so that every rank's step takes as long: rank r computes `rates[r]` samples/s on top of
    `fixed_s[r]` seconds a step that no share changes (its optimizer step; none by default, which makes
    the shares proportional to the rates).

    With `current` shares, the result moves `step` of the way from them toward those (measurements are
    noisy; half steps settle instead of swinging). The same inputs give the same shares on every rank, so
    ranks that share their measurements agree on the cut without another exchange.
    """
    fixed = [0.0] * len(rates) if fixed_s is None else list(fixed_s)
    if not rates or any(not (math.isfinite(rate) and rate > 0) for rate in rates):
        raise ValueError(f"rates must be positive and finite, got {list(rates)}")
    if len(fixed) != len(rates) or any(not (math.isfinite(f) and f >= 0) for f in fixed):
        raise ValueError(f"fixed_s must be one time >= 0 per rate, got {fixed}")
    if minimum * len(rates) > total:
        raise ValueError(f"{len(rates)} shares of at least {minimum} do not fit in {total}")
    # Equal step times: fixed[r] + share[r] / rates[r] = T for every rank, the shares summing to `total`;
    # a rank whose fixed time alone exceeds T is held at the minimum and the others share the rest.
    held: set[int] = set()
    while True:
        free = [r for r in range(len(rates)) if r not in held]
        room = total - minimum * len(held)
        step_s = (room + sum(rates[r] * fixed[r] for r in free)) / sum(rates[r] for r in free)
        ideal = [float(minimum) if r in held else rates[r] * (step_s - fixed[r]) for r in range(len(rates))]
        below = [r for r in free if ideal[r] < minimum * (1 - 1e-9)]  # float rounding is not below
        if not below or len(below) == len(free):
            break  # (all of them below: only where `total` is the minimums' sum, each holds its minimum)
        held.update(below)
    if current is not None:
        ideal = [old + step * (new - old) for old, new in zip(current, ideal)]
    return _apportion(ideal, total, minimum)


def _apportion(ideal: list[float], total: int, minimum: int) -> list[int]:
    """Whole numbers summing to `total`, none under `minimum`, closest to `ideal` (largest remainders)."""
    floor_at = [False] * len(ideal)
    while True:  # a share held at the minimum frees the rest for the others, in proportion
        free = [value for value, held in zip(ideal, floor_at) if not held]
        room = total - minimum * sum(floor_at)
        scale = room / sum(free) if sum(free) > 0 else 0.0
        scaled = [minimum if held else value * scale for value, held in zip(ideal, floor_at)]
        below = [i for i, value in enumerate(scaled) if not floor_at[i] and value < minimum]
        if not below:
            break
        for i in below:
            floor_at[i] = True
    shares = [int(value) for value in scaled]
    order = sorted(range(len(scaled)), key=lambda i: (-(scaled[i] - shares[i]), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares


def share_range(shares: Sequence[int], rank: int) -> tuple[int, int]:
    """Where rank `rank`'s share lies in the global batch: shares are laid out in rank order."""
    start = sum(shares[:rank])
    return start, start + shares[rank]


def local_shuffle(n_local: int, keep: int, rank: int, epoch: int, seed: int) -> torch.Tensor:
    """Shuffle of a worker's own local samples (Dask-array blocks it holds), truncated to `keep`."""
    generator = torch.Generator().manual_seed(_epoch_seed(seed, epoch) + 7919 * (rank + 1))
    return torch.randperm(n_local, generator=generator)[:keep]


def batches(indices: torch.Tensor, batch_size: int) -> list[torch.Tensor]:
    """Consecutive full batches of `indices`; an incomplete last batch is dropped so all workers step alike."""
    n_full = len(indices) // batch_size
    return [indices[i * batch_size : (i + 1) * batch_size] for i in range(n_full)]


def _epoch_seed(seed: int, epoch: int) -> int:
    # A large odd multiplier keeps (seed, epoch) pairs from colliding for small values of both.
    return (seed * 1_000_003 + epoch) % (2**63)


def assign_blocks(block_rows: list[int], holders: list[set[str]], workers: list[str]) -> dict[str, list[int]]:
    """Give each Dask-array block to one of `workers`, preferring a worker that already holds it.

    First every block goes to its least-loaded holder (or the least-loaded worker when no holder
    trains); then blocks move from the heaviest to the lightest worker while that narrows the gap,
    since shards are cut to the smallest one and rows beyond it would go unused.
    """
    load = {worker: 0 for worker in workers}
    assignment: dict[str, list[int]] = {worker: [] for worker in workers}
    for index in sorted(range(len(block_rows)), key=lambda i: -block_rows[i]):
        candidates = [w for w in workers if w in holders[index]] or workers
        chosen = min(candidates, key=lambda w: (load[w], workers.index(w)))
        assignment[chosen].append(index)
        load[chosen] += block_rows[index]
    while True:
        heaviest = max(workers, key=lambda w: load[w])
        lightest = min(workers, key=lambda w: load[w])
        gap = load[heaviest] - load[lightest]
        movable = [i for i in assignment[heaviest] if 0 < block_rows[i] < gap]
        if not movable:
            break
        moved = min(movable, key=lambda i: abs(gap - 2 * block_rows[i]))
        assignment[heaviest].remove(moved)
        assignment[lightest].append(moved)
        load[heaviest] -= block_rows[moved]
        load[lightest] += block_rows[moved]
    for blocks in assignment.values():
        blocks.sort()
    return assignment


def split_ranges(n_items: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous (start, stop) ranges covering `n_items`, sizes differing by at most one.

    How a parameter vector is cut over parameter-server shards.
    """
    if parts < 1 or parts > max(1, n_items):
        raise ValueError(f"cannot split {n_items} items into {parts} parts")
    base, extra = divmod(n_items, parts)
    ranges, start = [], 0
    for part in range(parts):
        stop = start + base + (1 if part < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges
