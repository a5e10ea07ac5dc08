"""Compression of what travels to and from the parameter server (pure tensor logic, no I/O): fp16, top-k
and Strom's threshold quantization, the latter two with error feedback so nothing that was not sent is
lost.

A `Packet` is what travels; `decode` rebuilds the dense vector on the receiving side, `add_decoded` adds
it into a vector in place. `ErrorFeedback` keeps the residual (accumulated minus sent) and adds it to the
next update, as in Strom (2015) and Seide et al. (2014): over time every coordinate's full update is
delivered. The server's replies get their error feedback from a mirror instead (see `server/replies.py`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from workbench.errors import ConfigError

COMPRESSIONS = ("none", "fp16", "topk", "threshold")
# Compressions that send only some coordinates and keep the rest in a residual.
SPARSE_COMPRESSIONS = ("topk", "threshold")


@dataclasses.dataclass
class Packet:
    """A compressed vector of `numel` float32 values.

    dense (none, fp16): `values` holds every coordinate. sparse (topk): `indices` and their `values`.
    threshold: `indices` and one sign bit each (`values` int8 +/-1), every value is +/- `scale`.
    """

    kind: str
    numel: int
    values: torch.Tensor
    indices: torch.Tensor | None = None
    scale: float = 1.0

    @property
    def nbytes(self) -> int:
        """Bytes of tensor payload that travel (the small header is not counted)."""
        size = self.values.numel() * self.values.element_size()
        if self.indices is not None:
            size += self.indices.numel() * self.indices.element_size()
        return size


def decode(packet: Packet) -> torch.Tensor:
    """The dense float32 vector a packet stands for."""
    if packet.kind in ("none", "fp16"):
        return packet.values.float()
    dense = torch.zeros(packet.numel, dtype=torch.float32)
    if packet.kind == "topk":
        dense[packet.indices.long()] = packet.values
    else:  # threshold
        dense[packet.indices.long()] = packet.values.float() * packet.scale
    return dense


def add_decoded(target: torch.Tensor, packet: Packet, alpha: float = 1.0) -> None:
    """target += alpha * decode(packet), in place, touching only the coordinates a sparse packet holds.

    Deterministic: two copies of one vector that add the same packets in the same order stay equal bit
    for bit (what the server's mirrors and the workers' copies rely on, see `server/replies.py`).
    """
    if packet.kind in ("none", "fp16"):
        target.add_(packet.values.float(), alpha=alpha)
        return
    values = packet.values if packet.kind == "topk" else packet.values.float() * packet.scale
    # top-k and threshold indices are distinct, so index_add_ adds each value once.
    target.index_add_(0, packet.indices.long(), values, alpha=alpha)


def encode(vector: torch.Tensor, kind: str, topk_ratio: float = 0.01, threshold_tau: float = 1e-3,
           copy: bool = True) -> Packet:
    """Compress a flat float32 vector (no error feedback: see `ErrorFeedback`).

    copy=False lets an uncompressed packet share `vector`'s memory (the caller keeps it unchanged until sent).
    """
    vector = vector.detach().reshape(-1).float()
    numel = vector.numel()
    if kind == "none":
        return Packet("none", numel, vector.clone() if copy else vector)
    if kind == "fp16":
        limit = torch.finfo(torch.float16).max  # clamp instead of overflowing to inf
        return Packet("fp16", numel, vector.clamp(-limit, limit).half())
    if kind == "topk":
        k = max(1, math.ceil(topk_ratio * numel))
        indices = largest_magnitudes(vector, k)
        return Packet("topk", numel, vector[indices], indices.int())  # advanced indexing copies already
    if kind == "threshold":
        tau = power_of_two(threshold_tau)
        indices = torch.nonzero(vector.abs() >= tau).reshape(-1)
        signs = torch.sign(vector[indices]).to(torch.int8)
        return Packet("threshold", numel, signs, indices.int(), tau)
    raise ConfigError("compression", kind, f"one of {list(COMPRESSIONS)}")


TOPK_SAMPLE = 20_000  # values sampled to find a cut below the k-th largest magnitude


def largest_magnitudes(vector: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the `k` largest |values| (any order): the same as `torch.topk(vector.abs(), k)`.

    `torch.topk` over 1.86M values took about 30 ms on one core, twice a training step of the benchmark
    MLP, paid for every push and every compressed reply. A strided sample gives a cut that about 2k
    values pass; the exact top-k of those is the top-k of all whenever at least k pass (else the plain
    top-k is taken): about 5 ms for the same result.
    """
    magnitudes = vector.abs()
    n = magnitudes.numel()
    if n < 10 * TOPK_SAMPLE or 4 * k > n:
        return torch.topk(magnitudes, k, sorted=False).indices
    sample = magnitudes[:: n // TOPK_SAMPLE]
    cut = torch.kthvalue(sample, max(1, int(sample.numel() * (1.0 - 2.0 * k / n)))).values
    candidates = torch.nonzero(magnitudes >= cut).reshape(-1) if cut > 0 else None
    if candidates is None or candidates.numel() < k:
        return torch.topk(magnitudes, k, sorted=False).indices
    return candidates[torch.topk(magnitudes[candidates], k, sorted=False).indices]


def power_of_two(tau: float) -> float:
    """`tau` rounded to the nearest power of two.

    Subtracting a power of two 2^k from a float32 x with |x| >= 2^k and the same sign is exact, so the
    threshold residual x - tau loses nothing to rounding: sent + residual equals the update bit for bit.
    """
    return 2.0 ** round(math.log2(tau))


class ErrorFeedback:
    """Compression with a residual: encodes update + residual, keeps what was not sent for next time.

    fp16 and none keep no residual (fp16's rounding error is below the gradient noise); topk and
    threshold would otherwise drop most of every update.
    """

    def __init__(self, kind: str, numel: int, topk_ratio: float = 0.01, threshold_tau: float = 1e-3) -> None:
        self.kind, self.topk_ratio, self.threshold_tau = kind, topk_ratio, threshold_tau
        self.keeps_residual = kind in SPARSE_COMPRESSIONS
        self.residual = torch.zeros(numel, dtype=torch.float32) if self.keeps_residual else None

    def encode(self, update: torch.Tensor, copy: bool = True) -> Packet:
        if not self.keeps_residual:
            return encode(update, self.kind, copy=copy)
        accumulated = self.residual + update.reshape(-1)
        packet = encode(accumulated, self.kind, self.topk_ratio, self.threshold_tau)
        self.residual = accumulated - decode(packet)
        return packet


def validate_compression(compression: Any, topk_ratio: Any, threshold_tau: Any) -> None:
    """Raise `ConfigError` naming the setting when a compression option is not allowed."""
    if compression not in COMPRESSIONS:
        raise ConfigError("compression", compression, f"one of {list(COMPRESSIONS)}")
    if (isinstance(topk_ratio, bool) or not isinstance(topk_ratio, (int, float)) or not math.isfinite(topk_ratio)
            or not 0 < topk_ratio <= 1):
        raise ConfigError("topk_ratio", topk_ratio, "a fraction in (0, 1], e.g. 0.01 to send 1% of the values")
    if (isinstance(threshold_tau, bool) or not isinstance(threshold_tau, (int, float))
            or not math.isfinite(threshold_tau) or threshold_tau <= 0):
        raise ConfigError("threshold_tau", threshold_tau, "a finite number > 0 (values beyond +/- tau are sent)")
