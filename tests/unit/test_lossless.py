"""The lossless coding of float32 vectors (`comm/lossless.py`) and the layout of coded sums
(`comm/coded_sum.py`): pure logic, no process group. Which sums go coded: tests/unit/test_sum_way.py."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.comm import coded_sum, lossless


def _round_trip(vector: torch.Tensor, spare: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    message = lossless.encode_message(vector)
    received = torch.full((message.numel() + spare,), 0xAB, dtype=torch.uint8)  # a longer receive buffer
    received[:message.numel()] = message
    out = torch.full_like(vector, 7.0)
    length = lossless.decode_message(received, out)
    return message, out, length


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=-2**31, max_value=2**31 - 1), min_size=0, max_size=3000),
       st.integers(min_value=0, max_value=100))
def test_any_bit_pattern_comes_back_bit_for_bit(bits, spare):
    vector = torch.tensor(bits, dtype=torch.int32).view(torch.float32)  # NaN payloads, infinities, subnormals
    message, out, length = _round_trip(vector, spare)
    assert length == message.numel()
    assert torch.equal(out.view(torch.int32), vector.view(torch.int32))
    assert message.numel() <= lossless.max_message_bytes(vector.numel())


def test_gradient_like_floats_travel_in_fewer_bytes_and_random_bits_within_the_bound():
    generator = torch.Generator().manual_seed(0)
    gradient = torch.randn(1_000_000, generator=generator) * 1e-3
    message, out, _ = _round_trip(gradient)
    assert torch.equal(out, gradient)
    assert 0.80 < message.numel() / (4 * gradient.numel()) < 0.88  # the top plane to about a third
    noise = torch.randint(-2**31, 2**31 - 1, (300_000,), generator=generator, dtype=torch.int32).view(torch.float32)
    message, out, _ = _round_trip(noise)
    assert torch.equal(out.view(torch.int32), noise.view(torch.int32))
    assert 4 * noise.numel() < message.numel() <= lossless.max_message_bytes(noise.numel())


def test_what_cannot_be_coded_is_refused_by_name():
    with pytest.raises(ValueError, match="contiguous float32 CPU tensor, not torch.float64"):
        lossless.encode_message(torch.zeros(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous: False"):
        lossless.encode_message(torch.zeros(10, 2)[:, 0])
    message = lossless.encode_message(torch.ones(1000))
    with pytest.raises(ValueError, match="cannot hold the low planes of 1000 floats"):
        lossless.decode_message(message[:-1], torch.empty(1000))
    with pytest.raises(ValueError):  # a message for other floats than `out` holds
        lossless.decode_message(message, torch.empty(999))


def test_chunks_spread_over_the_connections_and_tags_never_collide():
    assert coded_sum.chunks_for(1000, 4) == 1  # tiny: one chunk
    assert coded_sum.chunks_for(coded_sum.CHUNK_BYTES, 4) == 4  # as many as connections once large enough
    assert coded_sum.chunks_for(10 * coded_sum.CHUNK_BYTES, 4) == 10
    assert coded_sum.chunks_for(10**12, 4) == coded_sum.MAX_CHUNKS
    tags = [coded_sum.tag_for(channel, parity, phase, chunk)
            for channel, parity, phase, chunk in itertools.product(range(40), (0, 1), (0, 1), range(coded_sum.MAX_CHUNKS))]
    assert len(set(tags)) == len(tags) and all(coded_sum.TAG_BASE <= tag < 2**31 for tag in tags)
    # gloo picks a tag's connection as tag % count: consecutive chunks take consecutive connections.
    assert [coded_sum.tag_for(3, 1, 0, chunk) % 4 for chunk in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
