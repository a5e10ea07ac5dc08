"""Unit tests of the averaging arithmetic: buckets, divergence, flatten/unflatten, optimizer state."""
import torch

from workbench.averaging import assign_buckets, flatten, optimizer_state_tensors, relative_divergence, unflatten_into


def test_buckets_follow_backward_order_and_respect_the_cap():
    assert assign_buckets([4, 4, 4, 4], cap_bytes=8) == [[3, 2], [1, 0]]
    assert assign_buckets([4, 100, 4], cap_bytes=8) == [[2], [1], [0]]  # an oversized tensor stands alone
    assert assign_buckets([1, 2, 3], cap_bytes=1000) == [[2, 1, 0]]


def test_relative_divergence():
    average = torch.tensor([3.0, 4.0])
    assert relative_divergence(average.clone(), average) == 0.0
    assert abs(relative_divergence(torch.tensor([3.0, 5.0]), average) - 0.2) < 1e-7


def test_flatten_then_unflatten_round_trips():
    tensors = [torch.randn(2, 3), torch.randn(4)]
    vector = flatten(tensors)
    assert vector.shape == (10,)
    targets = [torch.zeros(2, 3), torch.zeros(4)]
    unflatten_into(vector * 2, targets)
    assert torch.equal(targets[0], tensors[0] * 2) and torch.equal(targets[1], tensors[1] * 2)


def test_optimizer_state_tensors_lists_momentum_buffers():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert optimizer_state_tensors(optimizer) == []
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state = optimizer_state_tensors(optimizer)
    assert [t.shape for t in state] == [torch.Size([2, 3]), torch.Size([2])]
    adam = torch.optim.Adam(model.parameters())
    adam.step()
    assert len(optimizer_state_tensors(adam)) == 4  # exp_avg and exp_avg_sq per parameter, not the step
