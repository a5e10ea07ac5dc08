"""Unit tests of compressed replies: the server's mirrors of each worker and the worker's copy stay equal
bit for bit, what was not sent is sent later (error feedback through the mirror), and bytes shrink."""
import math

import pytest
import torch
from distributed.protocol import deserialize, serialize

from workbench.comm.averaging import elastic_pull
from workbench.server.compression import ErrorFeedback, add_decoded, decode, encode
from workbench.server.replies import ElasticMirrors, KnownWeights, WeightMirrors
from workbench.server.shards import Reply, merge_replies

N = 1000


def randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def sparse_update(seed, n=N, fraction=0.05, scale=0.01):
    """A server step that moves a few coordinates, as a top-k push through plain SGD does."""
    update = torch.zeros(n)
    generator = torch.Generator().manual_seed(seed)
    update[torch.randperm(n, generator=generator)[: int(fraction * n)]] = torch.randn(int(fraction * n),
                                                                                   generator=generator) * scale
    return update


@pytest.mark.parametrize("kind", ["none", "fp16", "topk", "threshold"])
def test_add_decoded_equals_adding_the_decoded_vector_bit_for_bit(kind):
    target = randn(N, seed=1)
    packet = encode(randn(N, seed=2, scale=0.01), kind, topk_ratio=0.1, threshold_tau=0.01)
    for alpha in (1.0, -1.0):
        expected = target + alpha * decode(packet)
        result = target.clone()
        add_decoded(result, packet, alpha=alpha)
        assert torch.equal(result, expected)


def test_the_first_reply_is_full_then_changes_keep_mirror_and_worker_copy_equal():
    mirrors, known = WeightMirrors("topk", topk_ratio=0.02), KnownWeights(1)
    server = randn(N, seed=3)
    first = mirrors.reply(0, server)
    assert first.kind == "none" and torch.equal(first.values, server) and first.values is not server
    known.apply([first])
    for step in range(30):
        server += sparse_update(step)  # the server moves between replies (other workers' pushes)
        packet = mirrors.reply(0, server)
        assert packet.kind == "topk" and packet.values.numel() == math.ceil(0.02 * N)
        known.apply([packet])
        assert torch.equal(known.vector(), mirrors.mirrors[0])  # the invariant everything rests on
    assert not torch.equal(known.vector(), server)  # 2% a reply cannot keep up with 5% a step ...
    # ... but nothing is lost: what was not sent is still in the next difference.
    for _ in range(60):
        known.apply([mirrors.reply(0, server)])
    assert torch.equal(known.vector(), server)


# fp16: within its rounding of the last, tiny difference; threshold: within tau (it moves tau a reply).
@pytest.mark.parametrize("kind, tolerance", [("topk", 0.0), ("fp16", 1e-7), ("threshold", 2.0 ** -7)])
def test_repeated_replies_with_no_new_updates_bring_the_worker_to_the_server_weights(kind, tolerance):
    mirrors, known = WeightMirrors(kind, topk_ratio=0.1, threshold_tau=2.0 ** -7), KnownWeights(1)
    server = randn(N, seed=4)
    known.apply([mirrors.reply(0, server)])
    server += randn(N, seed=5, scale=0.02)  # a dense change, larger than one reply carries under top-k/threshold
    gaps = []
    for _ in range(40):
        known.apply([mirrors.reply(0, server)])
        gaps.append(float((server - known.vector()).abs().max()))
    assert gaps[-1] <= tolerance, gaps
    assert gaps[0] > tolerance  # the first change alone was not enough: feedback did the rest
    if kind == "topk":  # every coordinate went out within 1/topk_ratio replies, exactly
        assert gaps[math.ceil(1 / 0.1) + 2] == 0.0


def test_topk_reply_bytes_are_twice_topk_ratio_of_dense_and_full_replies_dense():
    n = 100_000
    mirrors = WeightMirrors("topk", topk_ratio=0.01)
    server = randn(n, seed=6)
    assert mirrors.reply(0, server).nbytes == 4 * n  # the first: full float32
    server += randn(n, seed=7, scale=0.01)
    delta = mirrors.reply(0, server)
    # 1% of the values, float32, plus their int32 indices: 2% of the dense reply.
    assert delta.nbytes == math.ceil(0.01 * n) * 8 == pytest.approx(0.02 * 4 * n)


def test_uncompressed_replies_are_full_weights_and_keep_no_mirror():
    mirrors = WeightMirrors("none")
    server = randn(N, seed=8)
    for _ in range(2):
        packet = mirrors.reply(0, server)
        assert packet.kind == "none" and torch.equal(packet.values, server) and packet.values is not server
    assert mirrors.mirrors == {}


def test_a_full_fetch_or_a_forgotten_worker_starts_again_from_full_weights():
    mirrors = WeightMirrors("fp16")
    server = randn(N, seed=9)
    mirrors.reply(0, server)
    server += 0.5
    assert mirrors.reply(0, server).kind == "fp16"
    assert mirrors.reply(0, server, full=True).kind == "none"
    assert torch.equal(mirrors.mirrors[0], server)
    mirrors.forget(0)
    assert 0 not in mirrors.mirrors and mirrors.reply(0, server).kind == "none"


def test_a_worker_copy_needs_full_weights_first_and_keeps_shards_in_order():
    known = KnownWeights(2)
    with pytest.raises(ValueError, match="in full"):
        known.vector()
    with pytest.raises(ValueError, match="holds no weights"):
        known.apply([encode(torch.ones(3), "none"), encode(torch.ones(2), "fp16")])
    known = KnownWeights(2)
    known.apply([encode(torch.tensor([1.0, 2.0, 3.0]), "none"), encode(torch.tensor([4.0, 5.0]), "none")])
    known.apply([encode(torch.tensor([0.0, 10.0, 0.0]), "topk", topk_ratio=0.3), encode(torch.zeros(2), "fp16")])
    assert torch.equal(known.vector(), torch.tensor([1.0, 12.0, 3.0, 4.0, 5.0]))


@pytest.mark.parametrize("kind", ["none", "topk", "fp16"])
def test_elastic_exchange_moves_the_center_by_the_whole_pull_and_the_worker_by_what_was_sent(kind):
    alpha = 0.5
    server = ElasticMirrors(kind, topk_ratio=0.1)
    center = randn(N, seed=10)
    worker = server.reply(0, center).values.clone()  # the worker starts from the center, as its mirror
    worker_mirror = worker.clone()
    for exchange in range(50):
        if exchange < 20:
            worker += randn(N, seed=100 + exchange, scale=0.01)  # local training
        progress = encode(worker - worker_mirror, kind, topk_ratio=0.1)
        add_decoded(worker_mirror, progress)
        before = center.clone()
        expected_pull = elastic_pull(server.mirrors[0] + decode(progress), before, alpha)
        pull = server.exchange(0, center, progress, alpha)
        assert torch.equal(center, before + expected_pull)  # the center takes all of it
        add_decoded(worker_mirror, pull, alpha=-1.0)
        worker -= decode(pull)
        assert torch.equal(server.mirrors[0], worker_mirror)  # mirrors equal bit for bit
        if kind == "topk":
            assert pull.nbytes == math.ceil(0.1 * N) * 8
    # Once the worker stops moving, worker and center meet: nothing of the pull was lost for good.
    assert float((worker - center).abs().max()) < 1e-3


def test_a_push_residual_on_top_of_the_easgd_mirror_sends_the_unsent_part_twice():
    """Why `easgd` compresses its pushes against the mirror alone (no `ErrorFeedback` residual)."""
    def gap_after(use_residual):
        weights, mirror = torch.zeros(N), torch.zeros(N)
        feedback = ErrorFeedback("topk", N, topk_ratio=0.1)
        for exchange in range(40):
            if exchange < 20:
                weights += randn(N, seed=200 + exchange, scale=0.01)
            difference = weights - mirror
            packet = feedback.encode(difference) if use_residual else encode(difference, "topk", topk_ratio=0.1)
            mirror += decode(packet)
        return float((weights - mirror).abs().max())

    assert gap_after(use_residual=False) == 0.0  # the mirror alone delivers everything
    assert gap_after(use_residual=True) > 1.0  # double counting grows without bound


def test_replies_travel_as_raw_tensor_frames_through_dask_serialisation():
    delta = encode(randn(N, seed=11), "topk", topk_ratio=0.05)
    header, frames = serialize(Reply(7, staleness=2, weights=delta), serializers=("dask",))
    assert "pickle" not in str(header)  # no pickled tensors: values and indices are frames of their own
    assert sum(memoryview(frame).nbytes for frame in frames) == delta.nbytes
    back = deserialize(header, frames)
    merged = merge_replies([back, Reply(7, staleness=3, weights=encode(torch.ones(4), "none"))])
    assert merged.version == 7 and merged.staleness == 3
    assert torch.equal(decode(merged.weights[0]), decode(delta)) and merged.nbytes == delta.nbytes + 16


def test_replies_are_compressed_as_pushes_unless_reply_compression_says_otherwise():
    from workbench.strategies import make_settings

    assert make_settings("async", {"compression": "topk", "topk_ratio": 0.05}).replies() == ("topk", 0.05, 1e-3)
    assert make_settings("ssp", {"compression": "topk", "reply_compression": "none"}).replies()[0] == "none"
    assert make_settings("easgd", {"reply_compression": "fp16"}).replies()[0] == "fp16"
    assert make_settings("async", {}).replies()[0] == "none"


def test_an_elastic_worker_that_never_fetched_is_mirrored_from_the_start_not_the_moved_center():
    # A new shard's workers all hold the weights it was made of and skip the fetch (setup checks they
    # do): one worker's exchanges move the center before the other's first, which must still be judged
    # from where that worker really is.
    start = randn(N, seed=1)
    server, center = ElasticMirrors("none", start=start, workers=2), start.clone()
    for exchange in range(3):
        server.exchange(0, center, encode(randn(N, seed=2 + exchange, scale=0.1), "none"), 0.5)
    assert not torch.allclose(center, start)
    before = center.clone()
    progress = randn(N, seed=9, scale=0.01)
    pull = decode(server.exchange(1, center, encode(progress, "none"), 0.5))
    torch.testing.assert_close(pull, elastic_pull(start + progress, before, 0.5))
    torch.testing.assert_close(center, before + pull)
    assert server.start is None  # both workers mirrored: the start weights are let go
