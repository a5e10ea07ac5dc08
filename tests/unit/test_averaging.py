"""Unit tests of the averaging arithmetic: buckets, divergence, flatten/unflatten, optimizer state, and the
slow-link rules (wire payloads, the outer optimizer, delayed averaging)."""
import torch

from workbench.comm.averaging import (WIRE_DTYPES, all_reduce_bytes_sent, assign_buckets, decode_average, delayed_apply,
                                 encode_weights, flatten, optimizer_state_tensors, outer_step, relative_divergence,
                                 scale_for_wire, unflatten_into)


def test_buckets_follow_backward_order_and_close_at_the_cap():
    assert assign_buckets([4, 4, 4, 4], cap_bytes=8) == [[3, 2], [1, 0]]
    # As DDP: a bucket closes once it reaches its cap, so a large tensor joins the small ones before it.
    assert assign_buckets([4, 100, 4], cap_bytes=8) == [[2, 1], [0]]
    assert assign_buckets([100, 4, 4], cap_bytes=8) == [[2, 1], [0]]
    assert assign_buckets([1, 2, 3], cap_bytes=1000) == [[2, 1, 0]]
    # The first bucket smaller, as DDP's: its all-reduce starts while backward still runs.
    assert assign_buckets([4, 4, 4, 4], cap_bytes=1000, first_cap_bytes=4) == [[3], [2, 1, 0]]
    assert assign_buckets([4, 4, 4, 4], cap_bytes=8, first_cap_bytes=100) == [[3, 2], [1, 0]]  # the first's cap never over the others'


def test_buckets_are_the_ones_pytorch_ddp_makes():
    # DDP's own assignment (the function its reducer calls), on the benchmark MLP and on tensors of random
    # sizes, in backward order, with DDP's caps: 1 MiB for the first bucket, then the given cap.
    import random

    import torch.distributed as dist

    mib = 1024 * 1024
    mlp = [784 * 1024, 1024, 1024 * 1024, 1024, 1024 * 10, 10]
    rng = random.Random(0)
    shapes = [mlp] + [[rng.choice([10, 1000, 60_000, 300_000, 2_000_000]) for _ in range(rng.randint(1, 40))]
                      for _ in range(30)]
    for numels in shapes:
        for cap_mb in (1, 4, 25):
            tensors = [torch.empty(n) for n in numels]
            order = list(reversed(range(len(tensors))))
            ddp, _ = dist._compute_bucket_assignment_by_size([tensors[i] for i in order], [mib, cap_mb * mib],
                                                             [False] * len(tensors), order)
            assert assign_buckets([4 * n for n in numels], cap_mb * mib, mib) == ddp, (numels, cap_mb)


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


# --- slow links: wire payloads, the outer optimizer, delayed averaging ------------------------------------

def sum_all_reduce(payloads):
    """What a sum all-reduce hands every rank, summed in the wire's own dtype as gloo does."""
    total = payloads[0].clone()
    for payload in payloads[1:]:
        total += payload
    return total


def test_plain_outer_step_returns_the_mean_itself_and_keeps_no_momentum():
    global_weights = torch.randn(100)
    average = torch.randn(100)
    new_global, buffer = outer_step(global_weights, average, None, lr=1.0, momentum=0.0)
    assert torch.equal(new_global, average) and buffer is None
    # A buffer left from an earlier momentum is dropped, as SGD keeps none without momentum.
    assert outer_step(global_weights, average, torch.ones(100), lr=1.0, momentum=0.0)[1] is None


def test_outer_step_without_momentum_moves_lr_of_the_way_to_the_mean():
    new_global, buffer = outer_step(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0]), None, lr=0.5, momentum=0.0)
    assert new_global.tolist() == [0.5, 3.0] and buffer is None


def test_nesterov_outer_steps_by_hand():
    global_weights, average = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 1.0])
    before = (global_weights.clone(), average.clone())
    # Outer gradient [0.5, 1]; buffer = gradient; step = gradient + 0.9 * buffer = [0.95, 1.9].
    new_global, buffer = outer_step(global_weights, average, None, lr=0.7, momentum=0.9)
    torch.testing.assert_close(buffer, torch.tensor([0.5, 1.0]))
    torch.testing.assert_close(new_global, torch.tensor([1 - 0.7 * 0.95, 2 - 0.7 * 1.9]))
    assert torch.equal(global_weights, before[0]) and torch.equal(average, before[1])  # inputs unchanged
    # Second step: gradient [0.1, -0.2]; buffer = 0.9 * [0.5, 1] + gradient = [0.55, 0.7];
    # step = gradient + 0.9 * buffer = [0.595, 0.43].
    second, buffer = outer_step(new_global, new_global - torch.tensor([0.1, -0.2]), buffer, lr=0.7, momentum=0.9)
    torch.testing.assert_close(buffer, torch.tensor([0.55, 0.7]))
    torch.testing.assert_close(second, new_global - 0.7 * torch.tensor([0.595, 0.43]))


def test_outer_step_is_torch_sgd_with_nesterov_on_the_outer_gradient():
    global_weights = torch.randn(50)
    parameter = torch.nn.Parameter(global_weights.clone())
    sgd = torch.optim.SGD([parameter], lr=0.7, momentum=0.9, nesterov=True)
    buffer = None
    for _ in range(4):
        average = global_weights + 0.1 * torch.randn(50)
        global_weights, buffer = outer_step(global_weights, average, buffer, lr=0.7, momentum=0.9)
        parameter.grad = parameter.detach() - average
        sgd.step()
        torch.testing.assert_close(global_weights, parameter.detach())


def test_float32_wire_averages_exactly_and_half_wire_sends_the_change():
    base = torch.randn(1000)
    locals_ = [base + 0.01 * torch.randn(1000) for _ in range(2)]
    exact = sum_all_reduce([encode_weights(w, base, torch.float32, 2) for w in locals_])
    assert torch.equal(decode_average(exact, base, 2), (locals_[0] + locals_[1]) / 2)
    for name in ("fp16", "bf16"):
        payloads = [encode_weights(w, base, WIRE_DTYPES[name], 2) for w in locals_]
        assert payloads[0].dtype == WIRE_DTYPES[name] and payloads[0].element_size() == 2
        average = decode_average(sum_all_reduce(payloads), base, 2)
        # The change since the base keeps its own relative precision (fp16 11 bits, bf16 8 bits): the
        # error is far below what casting the weights themselves would cost.
        error = (average - (locals_[0] + locals_[1]) / 2).abs().max().item()
        assert error < (2e-5 if name == "fp16" else 2e-4), (name, error)
        assert error < (base.half().float() - base).abs().max().item() / 4


def test_scaling_for_fp16_divides_first_and_keeps_the_sum_finite():
    vector = torch.tensor([1.0, -3.0, 1e6, -1e6])
    scaled = scale_for_wire(vector, torch.float16, 2)
    assert scaled is vector  # in place
    limit = torch.finfo(torch.float16).max / 2
    assert vector.tolist() == [0.5, -1.5, limit, -limit]
    summed = vector.half() + vector.half()
    assert torch.isfinite(summed).all()
    # bf16 has float32's range: divided, not clamped.
    assert scale_for_wire(torch.tensor([1e6]), torch.bfloat16, 2).tolist() == [5e5]


def test_ring_all_reduce_bytes_per_worker():
    assert all_reduce_bytes_sent(1000, 1) == 0
    assert all_reduce_bytes_sent(1000, 2) == 1000
    assert all_reduce_bytes_sent(1000, 4) == 1500


def test_delayed_apply_keeps_the_progress_made_while_the_exchange_travelled():
    snapshot = torch.tensor([1.0, 2.0])
    local = torch.tensor([1.5, 1.0])  # trained on after the exchange started
    new_global = torch.tensor([0.0, 3.0])
    assert delayed_apply(local, snapshot, new_global).tolist() == [0.5, 2.0]
    assert torch.equal(delayed_apply(snapshot, snapshot, new_global), new_global)  # nothing since: the global


def test_delayed_averaging_loses_and_doubles_no_progress():
    """Two workers, three overlapped periods with plain averaging: at the end, after the last exchange is
    applied and a final average taken, the common weights are the start plus the mean of all progress."""
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(6, generator=generator)
    global_weights = start.clone()
    workers = [start.clone(), start.clone()]
    progress = [torch.zeros(6), torch.zeros(6)]
    in_flight = None  # (snapshots, average)
    for _ in range(3):
        for rank in range(2):  # one period of "training": a random step each
            step = torch.randn(6, generator=generator)
            workers[rank] += step
            progress[rank] += step
        if in_flight is not None:  # the exchange started one period ago lands now
            snapshots, average = in_flight
            global_weights, _ = outer_step(global_weights, average, None, 1.0, 0.0)
            workers = [delayed_apply(w, s, global_weights) for w, s in zip(workers, snapshots)]
        snapshots = [w.clone() for w in workers]
        in_flight = (snapshots, (snapshots[0] + snapshots[1]) / 2)
    snapshots, average = in_flight
    global_weights, _ = outer_step(global_weights, average, None, 1.0, 0.0)
    workers = [delayed_apply(w, s, global_weights) for w, s in zip(workers, snapshots)]
    assert torch.equal(workers[0], workers[1])  # nothing trained since the last start: all equal the global
    torch.testing.assert_close(workers[0], start + (progress[0] + progress[1]) / 2)
