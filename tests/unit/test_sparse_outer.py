"""The sparse, low-bit outer exchange's arithmetic (comm/sparse_outer.py): top-k per chunk, b-bit codes, the
bytes on the wire, and error feedback that delivers every worker's whole change over exchanges."""
from __future__ import annotations

import pytest
import torch

from workbench.comm import sparse_outer as so
from workbench.errors import ConfigError


def _vector(numel, seed=0):
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("numel", [100, so.CHUNK, 3 * so.CHUNK + 904])
@pytest.mark.parametrize("bits", so.BITS)
@pytest.mark.parametrize("density", [1 / 64, 1 / so.CHUNK, 1.0])  # one value a chunk: rows of odd length
def test_a_packet_travels_as_bytes_of_a_fixed_size_and_comes_back_unchanged(numel, bits, density):
    packet = so.encode(_vector(numel), density=density, bits=bits)
    wire = so.to_wire(packet)
    assert wire.dtype == torch.uint8 and wire.numel() == so.wire_size(numel, density, bits)
    back = so.from_wire(wire, numel, density, bits)
    assert torch.equal(back.indices, packet.indices) and torch.equal(back.codes, packet.codes)
    assert torch.equal(back.scales, packet.scales) and torch.equal(so.decode(back), so.decode(packet))


def test_each_chunk_sends_its_largest_values_and_at_2_bits_110x_fewer_bytes_than_float32():
    vector = torch.full((2 * so.CHUNK,), 0.01)
    vector[[5, 77, 4100]] = torch.tensor([3.0, -2.0, 1.0])
    decoded = so.decode(so.encode(vector, density=1 / so.CHUNK, bits=2))  # one value per chunk
    assert decoded.nonzero().reshape(-1).tolist() == [5, 4100]
    assert decoded[5] == 3.0 and decoded[4100] == 1.0  # the chunk's largest is its scale, exactly
    # The target: at least 100x fewer bytes than the dense float32 change.
    numel = 1_860_000  # the benchmark MLP
    assert 4 * numel / so.wire_size(numel, 1 / 64, 2) > 110
    assert 4 * numel / so.wire_size(numel, 0.01, 2) > 160


@pytest.mark.parametrize("bits", so.BITS)
def test_a_sent_value_is_within_half_a_level_of_what_it_was(bits):
    vector = _vector(so.CHUNK)
    packet = so.encode(vector, density=0.25, bits=bits)
    sent = torch.zeros(so.CHUNK, dtype=torch.bool)
    sent[packet.indices.long().reshape(-1)] = True
    scale = vector[sent].abs().max()
    step = 2 * scale / ((1 << bits) - 1)
    assert (so.decode(packet)[sent] - vector[sent]).abs().max() <= step / 2 + 1e-6
    assert (so.decode(packet)[~sent] == 0).all()


def test_error_feedback_loses_nothing_over_exchanges_and_delivers_every_coordinate():
    feedback = so.OuterFeedback(so.CHUNK + 10, density=1 / 64, bits=2)
    changes = [_vector(so.CHUNK + 10, seed) * 0.01 for seed in range(200)]
    for change in changes:
        change[7] = 1e-3  # a coordinate that moves little, always the same way: never among the largest
    delivered = torch.zeros(so.CHUNK + 10)
    for change in changes:
        delivered += so.decode(feedback.encode(change))
    # What was sent plus what is still held is what the worker changed, every coordinate of it.
    assert torch.allclose(delivered + feedback.residual, torch.stack(changes).sum(0), atol=1e-4)
    # The small one accumulates until it is sent: most of its 0.2 arrived.
    assert delivered[7] > 0.1
    # The residual stays bounded (what is large is sent): far below the changes' summed magnitudes (about 1.6).
    assert feedback.residual.abs().max() < 0.1 * torch.stack(changes).abs().sum(0).median()


def test_the_mean_of_the_workers_packets_is_the_mean_of_what_each_sent():
    packets = [so.encode(_vector(5000, seed), density=0.05, bits=4) for seed in range(3)]
    mean = so.mean_of_wires([so.to_wire(p) for p in packets], 5000, 0.05, 4)
    assert torch.allclose(mean, torch.stack([so.decode(p) for p in packets]).mean(0), atol=1e-7)


@pytest.mark.parametrize("density,bits,named", [(0, 2, "sparse_density"), (1.5, 2, "sparse_density"),
                                                (True, 2, "sparse_density"), (0.01, 3, "sparse_bits"),
                                                (0.01, 32, "sparse_bits")])
def test_bad_options_are_refused_naming_the_setting(density, bits, named):
    with pytest.raises(ConfigError, match=named):
        so.OuterFeedback(100, density, bits)
