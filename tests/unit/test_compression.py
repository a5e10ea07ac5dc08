"""Unit tests of compression: what is sent plus the residual is exactly the accumulated update."""
import pytest
import torch

from workbench.server.compression import ErrorFeedback, decode, encode, largest_magnitudes, validate_compression
from workbench.errors import ConfigError


def updates(n=1000, count=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) * 0.01 for _ in range(count)]


@pytest.mark.parametrize("kind, options", [("topk", {"topk_ratio": 0.01}), ("topk", {"topk_ratio": 0.3}),
                                           ("threshold", {"threshold_tau": 0.005}), ("threshold", {"threshold_tau": 0.001})])
def test_sent_plus_residual_equals_accumulated_exactly_and_residual_carries_over(kind, options):
    feedback = ErrorFeedback(kind, 1000, **options)
    total_sent = torch.zeros(1000)
    total_update = torch.zeros(1000)
    for update in updates():
        accumulated = feedback.residual + update  # what this push stands for
        packet = feedback.encode(update)
        sent = decode(packet)
        assert torch.equal(sent + feedback.residual, accumulated)  # exact in fp32
        total_sent += sent
        total_update += update
    # Nothing is lost: every update is either sent or still waiting in the residual.
    assert torch.allclose(total_sent + feedback.residual, total_update, atol=1e-6)
    assert feedback.residual.abs().sum() > 0


def test_topk_sends_the_largest_values_and_counts_bytes():
    vector = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 0.05, 1.0, 0.0, 0.0])
    packet = encode(vector, "topk", topk_ratio=0.2)
    assert sorted(packet.indices.tolist()) == [1, 3]
    assert torch.equal(decode(packet), torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0, 0, 0]))
    assert packet.nbytes == 2 * 4 + 2 * 4  # float32 values + int32 indices


def test_threshold_sends_plus_minus_tau_rounded_to_a_power_of_two():
    vector = torch.tensor([0.5, -0.05, 0.2, -0.3, 0.01])
    packet = encode(vector, "threshold", threshold_tau=0.13)  # used as 2^-3 = 0.125
    assert packet.scale == 0.125
    assert torch.equal(decode(packet), torch.tensor([0.125, 0.0, 0.125, -0.125, 0.0]))
    assert packet.nbytes == 3 * 1 + 3 * 4  # one int8 sign + one int32 index per value sent


def test_topk_one_percent_is_at_least_ten_times_smaller():
    dense = encode(torch.randn(100_000), "none").nbytes
    sparse = encode(torch.randn(100_000), "topk", topk_ratio=0.01).nbytes
    assert dense / sparse >= 10


def test_fp16_halves_bytes_keeps_no_residual_and_clamps():
    feedback = ErrorFeedback("fp16", 4)
    packet = feedback.encode(torch.tensor([1.0, -2.5, 1e6, 3e-3]))
    assert packet.values.dtype == torch.float16 and packet.nbytes == 8 and feedback.residual is None
    decoded = decode(packet)
    assert torch.isfinite(decoded).all() and decoded[2] == torch.finfo(torch.float16).max
    assert decoded[1] == -2.5


@pytest.mark.parametrize("values, parameter", [
    (("gzip", 0.01, 1e-3), "compression"), (("topk", 0.0, 1e-3), "topk_ratio"), (("topk", 1.5, 1e-3), "topk_ratio"),
    (("threshold", 0.01, -1.0), "threshold_tau"), (("threshold", 0.01, float("nan")), "threshold_tau"),
])
def test_bad_compression_options_are_named(values, parameter):
    with pytest.raises(ConfigError) as error:
        validate_compression(*values)
    assert error.value.parameter == parameter


@pytest.mark.parametrize("case", ["normal", "layers of different scales", "mostly zeros", "ties", "sorted"])
def test_largest_magnitudes_selects_what_torch_topk_selects(case):
    generator = torch.Generator().manual_seed(3)
    n, k = 400_000, 4_000
    vector = torch.randn(n, generator=generator)
    if case == "layers of different scales":  # the sample must not miss a small layer of large values
        vector[: n // 10] *= 1e-4
        vector[-n // 100:] *= 100
    elif case == "mostly zeros":  # fewer non-zeros than k: the cut is 0, the plain top-k is taken
        vector[torch.randperm(n, generator=generator)[k // 2:]] = 0
    elif case == "ties":
        vector = torch.randint(-3, 4, (n,), generator=generator).float()
    elif case == "sorted":  # a strided sample of a sorted vector still gives the right cut
        vector = torch.linspace(-1, 1, n)
    indices = largest_magnitudes(vector, k)
    expected = torch.topk(vector.abs(), k).values
    assert indices.numel() == k and indices.unique().numel() == k
    assert torch.equal(vector[indices].abs().sort(descending=True).values, expected)
