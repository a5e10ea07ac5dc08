"""Unit tests of data sharding: disjoint equal shards, reproducible, reshuffled per epoch; block assignment."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.sharding import assign_blocks, batches, local_shuffle, shard_indices, shard_size


@given(n=st.integers(1, 500), world=st.integers(1, 8), epoch=st.integers(0, 5), seed=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_shards_are_disjoint_equal_and_within_range(n, world, epoch, seed):
    shards = [shard_indices(n, world, rank, epoch, seed) for rank in range(world)]
    size = shard_size(n, world)
    assert all(len(s) == size for s in shards)
    joined = torch.cat(shards)
    assert len(set(joined.tolist())) == len(joined) == size * world
    assert joined.numel() == 0 or (joined.min() >= 0 and joined.max() < n)


def test_shards_are_reproducible_and_reshuffled_per_epoch():
    first = shard_indices(1000, 2, 0, epoch=0, seed=3)
    assert torch.equal(first, shard_indices(1000, 2, 0, epoch=0, seed=3))
    assert not torch.equal(first, shard_indices(1000, 2, 0, epoch=1, seed=3))
    assert not torch.equal(first, shard_indices(1000, 2, 0, epoch=0, seed=4))


def test_batches_drop_the_incomplete_tail():
    parts = batches(torch.arange(10), 3)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_local_shuffle_is_a_truncated_permutation():
    order = local_shuffle(50, 40, rank=1, epoch=2, seed=0)
    assert len(order) == 40 and len(set(order.tolist())) == 40 and int(order.max()) < 50
    assert not torch.equal(order, local_shuffle(50, 40, rank=1, epoch=3, seed=0))


def test_assign_blocks_prefers_holders_and_balances():
    workers = ["a", "b"]
    holders = [{"a"}, {"a"}, {"b"}, {"b"}]
    assignment = assign_blocks([10, 10, 10, 10], holders, workers)
    assert assignment == {"a": [0, 1], "b": [2, 3]}


def test_assign_blocks_moves_blocks_when_one_holder_has_everything():
    assignment = assign_blocks([10, 10, 10, 10], [{"a"}] * 4, ["a", "b"])
    rows = {w: 10 * len(blocks) for w, blocks in assignment.items()}
    assert rows == {"a": 20, "b": 20}
    assert sorted(assignment["a"] + assignment["b"]) == [0, 1, 2, 3]
