"""What the parameter server sends back, compressed (pure tensor logic, no I/O; `server/shards.py` is the shell).

Pushes are compressed on the workers (`compression.ErrorFeedback`). Replies carry weights (`async`,
`ssp`) or elastic pulls (`easgd`), and with a compression other than "none" they are compressed too,
against a mirror: a copy, kept on both ends, of what one side knows of the other.

* `WeightMirrors`, on a server shard (`async`, `ssp`): per worker, the shard's weights as that worker
  knows them. A reply encodes `current - mirror`, adds the decoded packet to the mirror and sends the
  packet; the worker adds the same packet to its own copy (`KnownWeights`). Both add the same packets in
  the same order, so the mirror and the worker's copy stay equal bit for bit.
* `ElasticMirrors`, on a server shard (`easgd`): per worker, that worker's weights as the server knows
  them (the worker keeps the same mirror: its pushes are compressed against it). An exchange adds the
  worker's packet, computes the elastic pull, moves the center by all of it, and sends the pull
  compressed; mirror and worker subtract the same decoded pull.

Error feedback needs no residual of its own here: a mirror advances only by what was sent, so what was
not sent stays in the next difference and goes out once it is large enough (top-k: among the largest;
threshold: beyond tau; fp16: its rounding error, sent with the next reply).

A packet of kind "none" carries full float32 weights (or a dense pull) and replaces what the receiver
holds: the first reply to a worker the shard has no mirror of (a new server after a start, a switch or a
resume, or a worker that asks afresh), and every reply when replies are not compressed.

Memory: a shard keeps one float32 mirror of its range per worker, so a server of K shards and N workers
holds N extra copies of the model in all, spread over its shards (`WeightMirrors` keeps none when
replies are not compressed; `ElasticMirrors` always keeps them, as the pushes are compressed against them).
"""
from __future__ import annotations

import torch

from workbench.comm.averaging import elastic_pull
from workbench.server.compression import Packet, add_decoded, decode, encode

FULL = "none"  # the packet kind that carries full weights, not a change


class WeightMirrors:
    """Server side, one shard: replies that carry the shard's weights as compressed deltas."""

    def __init__(self, kind: str = "none", topk_ratio: float = 0.01, threshold_tau: float = 1e-3) -> None:
        self.kind, self.topk_ratio, self.threshold_tau = kind, topk_ratio, threshold_tau
        self.mirrors: dict[int, torch.Tensor] = {}  # worker -> the weights it holds (see the module)

    def reply(self, worker: int, current: torch.Tensor, full: bool = False) -> Packet:
        """What to send `worker` so that it holds `current` (or comes closer to it); `full`: the worker
        holds nothing yet. The packet is new memory, safe to serialise after the caller returns."""
        if self.kind == FULL:
            return encode(current, FULL)  # a copy
        mirror = None if full else self.mirrors.get(worker)
        if mirror is None:
            self.mirrors[worker] = current.detach().clone()
            return encode(current, FULL)
        packet = encode(current - mirror, self.kind, self.topk_ratio, self.threshold_tau)
        # The mirror advances by what was sent only: the rest stays in the next reply's difference.
        add_decoded(mirror, packet)
        return packet

    def forget(self, worker: int) -> None:
        """A worker that is done needs no mirror (its next reply, if any, would be full weights)."""
        self.mirrors.pop(worker, None)


class KnownWeights:
    """Worker side: the server's weights as this worker knows them, one part per shard. Each part equals
    the shard's mirror of this worker once the same replies were applied, in order."""

    def __init__(self, shards: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * shards

    def apply(self, packets: list[Packet]) -> None:
        """Take one reply's packets (one per shard, in range order)."""
        for index, packet in enumerate(packets):
            part = self.parts[index]
            if packet.kind == FULL:
                # Full weights replace the copy; the packet is this worker's own memory (deserialised).
                self.parts[index] = decode(packet)
            elif part is None:
                raise ValueError(f"shard {index} sent a change ('{packet.kind}') to a worker that holds no "
                                 f"weights of it yet")
            else:
                add_decoded(part, packet)

    def vector(self) -> torch.Tensor:
        """The known weights as one flat vector (no copy when there is one shard)."""
        if any(part is None for part in self.parts):
            raise ValueError("the server's weights are not known yet: the first reply must carry them in full")
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)


class ElasticMirrors:
    """Server side, one shard: elastic averaging's exchanges, each worker's weights mirrored.

    The center takes the whole pull `alpha * (mirror - center)`, as uncompressed EASGD computes it from
    what the server knows; the worker gets the pull compressed and moves by that much, and so does its
    mirror. What it was not sent is not lost: it stays in the distance between the worker and the
    center, which the next exchange's pull is computed from.
    """

    def __init__(self, kind: str = "none", topk_ratio: float = 0.01, threshold_tau: float = 1e-3,
                 start: torch.Tensor | None = None, workers: int = 0) -> None:
        self.kind, self.topk_ratio, self.threshold_tau = kind, topk_ratio, threshold_tau
        self.mirrors: dict[int, torch.Tensor] = {}  # worker -> its weights, as the server knows them
        # The weights the server was made of, which every worker holds at its start (`setup` checks):
        # a worker's mirror until it fetches, so it need not fetch them (on a slow link, seconds). Let go
        # once each of the `workers` has a mirror of its own.
        self.start = None if start is None else start.detach().clone()
        self.workers = workers

    def reply(self, worker: int, current: torch.Tensor, full: bool = True) -> Packet:
        """A fetch: the worker takes the center as its own weights (always in full: elastic averaging
        fetches only to start), so its mirror starts there too."""
        self.mirrors[worker] = current.detach().clone()
        self._forget_start_when_all_mirrored()
        return encode(current, FULL)

    def _forget_start_when_all_mirrored(self) -> None:
        if len(self.mirrors) >= self.workers:
            self.start = None  # a copy of the shard nobody needs any more

    def exchange(self, worker: int, center: torch.Tensor, packet: Packet, alpha: float) -> Packet:
        """Add the worker's progress `packet` to its mirror, move `center` (in place) by the elastic pull,
        and return the pull the worker subtracts from its weights."""
        # A worker that never fetched holds the weights the server was made of (`start`; without one, the
        # center, which is only right before the first exchange moves it).
        mirror = self.mirrors.get(worker)
        if mirror is None:  # not setdefault: its default (a clone of the whole shard) would be made every call
            mirror = self.mirrors[worker] = (self.start if self.start is not None else center).clone()
            self._forget_start_when_all_mirrored()
        add_decoded(mirror, packet)
        pull = elastic_pull(mirror, center, alpha)
        center += pull
        sent = encode(pull, self.kind, self.topk_ratio, self.threshold_tau, copy=False)
        add_decoded(mirror, sent, alpha=-1.0)  # the worker subtracts the same decoded pull
        return sent

    def forget(self, worker: int) -> None:
        self.mirrors.pop(worker, None)
