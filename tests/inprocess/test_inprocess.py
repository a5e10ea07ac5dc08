"""The fast tier: N ranks as threads of one process (`workbench.testing`), running the real loop,
strategies, control point and parameter server, with only the transport in memory. Every registered
strategy is checked here in about a second: the synchronous ones against a plain single-process PyTorch
loop on the same batches, bit for bit up to float rounding; the asynchronous ones for training, equal
final weights, and their staleness. The real-cluster tier (test_training, test_switch, ...) keeps what
needs processes: gloo, Dask actors, lost workers."""
import threading
import time

import pytest
import torch

import workbench
from workbench.plane import kinds
from workbench.comm.averaging import flatten, fingerprint
from workbench.data import Shard
from workbench.testing import train_in_process
from workbench.job import loss_function, make_optimizer
from workbench.strategies import STRATEGIES, get_strategy, suggested_sgd

pytestmark = pytest.mark.timeout(120)
WORLD = 2


def fixed_mlp() -> torch.nn.Module:
    """An MLP whose initial weights come from its own generator: the same in every rank's thread and in
    the reference, whatever else uses torch's global generator meanwhile."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model


def job(**changes) -> workbench.Job:
    fields = dict(model=fixed_mlp, data="digits", batch_size=16, steps=30, lr=0.1, momentum=0.9, eval_every=None)
    fields.update(changes)
    return workbench.Job(**fields)


def reference(the_job: workbench.Job, run, world: int = WORLD, whole: bool = False) -> dict[str, torch.Tensor]:
    """A plain PyTorch loop, one process: at each step, the mean of the ranks' losses on the batches
    each rank took at that step (`whole`: the loss on the step's whole global batch, whatever the ranks'
    shares of it, which is what a balanced cut weighted by samples must give)."""
    prepared = the_job.prepare()
    data = prepared.train.load()
    shards = [Shard(data, world, rank, the_job.seed, run.shard_samples, False) for rank in range(world)]
    per_epoch = run.shard_samples // the_job.batch_size
    model = the_job.model()
    optimizer = make_optimizer(the_job, model.parameters())
    loss_fn = loss_function(the_job)
    for step in range(run.total_steps):
        epoch, index = divmod(step, per_epoch)
        optimizer.zero_grad()
        if whole:
            inputs, targets = data.batch(shards[0].epoch_rows(epoch, the_job.batch_size)[index])
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
            continue
        losses = []
        for shard in shards:
            inputs, targets = data.batch(shard.epoch_batches(epoch, the_job.batch_size)[index])
            losses.append(loss_fn(model(inputs), targets))
        (sum(losses) / world).backward()
        optimizer.step()
    return model.state_dict()


def assert_same_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-5, atol=1e-6, msg=name)


def test_allreduce_on_two_ranks_is_one_process_on_their_joint_batches():
    the_job = job()
    run = train_in_process(the_job, "allreduce", WORLD, bucket_mb=0.001)  # several buckets, in flight together
    assert [len(run.steps(rank)) for rank in range(WORLD)] == [run.total_steps] * WORLD == [30, 30]
    assert_same_weights(run.results[0]["state_dict"], reference(the_job, run))


class _WithAnUnusedLayer(torch.nn.Module):
    """`fixed_mlp` and a layer the forward pass never uses: autograd gives that layer no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.body = fixed_mlp()
        self.unused = torch.nn.Linear(4, 4)
        torch.nn.init.constant_(self.unused.weight, 0.5)
        torch.nn.init.constant_(self.unused.bias, 0.5)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs)


@pytest.mark.parametrize("bucket_mb", [0.001, 4.0], ids=["a-bucket-of-its-own", "sharing-a-bucket"])
def test_allreduce_counts_a_parameter_without_gradient_as_zeros(bucket_mb):
    the_job = job(model=_WithAnUnusedLayer)
    run = train_in_process(the_job, "allreduce", WORLD, bucket_mb=bucket_mb)
    final = run.results[0]["state_dict"]
    assert_same_weights(final, reference(the_job, run))
    assert torch.equal(final["unused.weight"], torch.full((4, 4), 0.5))


def test_averaging_every_step_without_momentum_is_the_same_sgd():
    # Local SGD steps averaged every step: mean(w - lr g_r) = w - lr mean(g_r), plain SGD on the joint batch.
    the_job = job(momentum=0.0)
    run = train_in_process(the_job, "average", WORLD, period=1)
    assert_same_weights(run.results[0]["state_dict"], reference(the_job, run))
    # With a longer period the ranks drift apart between syncs, and are averaged again at the end.
    drifted = train_in_process(the_job, "average", WORLD, period=5)
    assert any(r.get("divergence", 0) > 0 for r in drifted.steps())
    assert len({tuple(result["weights"]) for result in drifted.results}) == 1
    # Each blocking sync times its all-reduce apart from its own copies (`exchange_s`, read by the
    # simulator's calibration): inside the sync's communication time, and only at syncs.
    syncs = [r for r in drifted.steps() if r.get("bytes_sent")]
    assert len(syncs) == WORLD * (drifted.total_steps // 5)
    assert all(0 < r["exchange_s"] <= r["comm_s"] for r in syncs), syncs
    assert not any("exchange_s" in r for r in drifted.steps() if not r.get("bytes_sent"))


VARIANTS = [(name, {}) for name in sorted(STRATEGIES)] + [
    ("average", {"overlap": True, "period": 2}), ("async", {"compression": "topk", "topk_ratio": 0.1})]


@pytest.mark.parametrize("strategy", ["async", "ssp"])
def test_the_parameter_server_with_one_worker_is_the_plain_loop(strategy):
    # One worker pushing every step and waiting for each reply: the server's optimizer (the job's SGD with
    # momentum) sees exactly the plain loop's gradients, at staleness 0.
    the_job = job()
    run = train_in_process(the_job, strategy, 1, overlap=False)
    assert {r["staleness"] for r in run.steps() if r.get("staleness") is not None} == {0}
    assert_same_weights(run.results[0]["state_dict"], reference(the_job, run, world=1))


@pytest.mark.parametrize("strategy,settings", VARIANTS, ids=[f"{n}{'-' if s else ''}{'-'.join(s)}" for n, s in VARIANTS])
def test_every_strategy_trains_in_process_and_ends_with_common_weights(strategy, settings):
    run = train_in_process(job(steps=60, **suggested_sgd(strategy)), strategy, WORLD, **settings)
    steps = run.steps()
    # Every field a step record carries is in the vocabulary (plane/kinds.py), the loop's own on every step.
    assert all(set(kinds.STEP_FIELDS) <= set(r) <= {"kind", *kinds.STEP_FIELDS, *kinds.STRATEGY_FIELDS}
               for r in steps)
    assert [len(run.steps(rank)) for rank in range(WORLD)] == [60] * WORLD
    first = sum(r["loss"] for r in steps[:2 * WORLD * 5]) / (2 * WORLD * 5)
    last = sum(r["loss"] for r in steps[-2 * WORLD * 5:]) / (2 * WORLD * 5)
    assert last < 0.5 * first, (strategy, first, last)
    assert len({tuple(result["weights"]) for result in run.results}) == 1  # every rank ended equal
    if not get_strategy(strategy).traits.uses_process_group:
        staleness = [r["staleness"] for r in steps if r.get("staleness") is not None]
        # Replies are taken as they come back (overlapped with the next steps): most are counted, and
        # with two ranks pushing, some push finds the other's in between.
        assert len(staleness) >= 20 and max(staleness) >= 1 and min(staleness) >= 0
        if strategy == "ssp":
            bound = get_strategy("ssp").settings_class().max_staleness
            assert max(r["clock_gap"] for r in steps if r.get("clock_gap") is not None) <= bound


def switch_at_step(step, strategy, settings):
    """An `on_record` that asks for a switch once a worker reports `step`; and where it noted the step."""
    switched_at = {}

    def on_record(record, control):
        if record.get("kind") == kinds.STEP and record["step"] == step and not switched_at:
            switched_at["asked"] = record["step"]
            control.switch(strategy, settings)

    return switched_at, on_record


def test_a_live_switch_in_process_carries_the_weights_to_the_server_and_back():
    switched_at, on_record = switch_at_step(10, "async", {"push_every": 2})

    run = train_in_process(job(steps=60, lr=0.05, momentum=0.4), "allreduce", WORLD, on_record=on_record)
    switched = [e for e in run.events(kinds.SWITCHED)]
    assert sorted(e["worker"] for e in switched) == list(range(WORLD))
    assert len({e["step"] for e in switched}) == 1 and switched[0]["step"] >= switched_at["asked"]
    assert len({tuple(e["weights_before"]) for e in switched}) == 1  # the same weights go to the server
    after = [r for r in run.steps() if r["step"] >= switched[0]["step"]]
    assert {r["strategy"] for r in after} == {"async"} and any(r.get("staleness") is not None for r in after)
    assert len({tuple(result["weights"]) for result in run.results}) == 1


def test_a_switch_from_averaging_to_easgd_keeps_each_workers_own_progress():
    # Averaging never within the run: at the switch each worker holds the start weights (the global
    # weights) plus progress of its own, which goes on under easgd instead of being averaged away.
    _, on_record = switch_at_step(10, "easgd", {"period": 2})

    run = train_in_process(job(steps=60), "average", WORLD, on_record=on_record, period=100_000)
    switched = sorted(run.events(kinds.SWITCHED), key=lambda e: e["worker"])
    assert [e["worker"] for e in switched] == list(range(WORLD))
    start = fingerprint(flatten(list(fixed_mlp().parameters())))
    for event in switched:
        assert event["weights_after"] == event["weights_before"]  # its own weights, not the mean
        assert event["common_weights"] == pytest.approx(start)  # over the base they agree on
    assert switched[0]["weights_after"] != switched[1]["weights_after"]
    steps = run.steps()
    after = [r for r in steps if r["step"] >= switched[0]["step"]]
    assert {r["strategy"] for r in after} == {"easgd"}
    assert sum(r["loss"] for r in steps[-20:]) < 0.5 * sum(r["loss"] for r in steps[:20])  # and it trains on
    assert len({tuple(result["weights"]) for result in run.results}) == 1  # the center, on every rank


def test_a_switch_to_a_strategy_of_common_weights_averages_first():
    _, on_record = switch_at_step(10, "allreduce", {})

    run = train_in_process(job(steps=30, lr=0.05, momentum=0.0), "average", WORLD, on_record=on_record, period=100_000)
    switched = run.events(kinds.SWITCHED)
    assert len({tuple(e["weights_after"]) for e in switched}) == 1 and switched[0]["common_weights"] is None
    # The mean of the workers' weights (fingerprints are linear).
    mean = [sum(values) / WORLD for values in zip(*(e["weights_before"] for e in switched))]
    assert switched[0]["weights_after"] == pytest.approx(mean, rel=1e-5)


def test_an_overlapped_exchange_that_ended_behind_the_steps_counts_all_its_time_once():
    # In process the ranks agree at every step, so an exchange started at a sync has ended by the next:
    # each sync after the first reports it whole (`exchange_s`), in `comm_total_s` once; as hidden all
    # but what the control point just before the sync waited for it (`settle`: microseconds here), which
    # the step paid. (On a cluster how many end in time depends on the load:
    # tests/cluster/test_slow_sync_cluster.py.)
    run = train_in_process(job(steps=40), "average", WORLD, period=4, overlap=True)
    for rank in range(WORLD):
        syncs = [r for r in run.steps(rank) if r.get("bytes_sent")]
        assert [r["step"] for r in syncs] == list(range(3, 40, 4))
        assert syncs[0].get("exchange_s") is None  # the first sync only starts one
        for record in syncs[1:]:
            assert record["exchange_s"] > 0
            hidden, beyond = record["comm_total_s"] - record["comm_s"], record["comm_total_s"] - record["exchange_s"]
            assert 0 <= hidden <= record["exchange_s"] + 1e-9 and 0 <= beyond <= record["comm_s"] + 1e-9


class _SlowOnRankOne(torch.nn.Module):
    """The fixed MLP, 30 ms slower a step on rank 1's thread: a worker behind another on a thin link."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = fixed_mlp()

    def forward(self, inputs):
        if threading.current_thread().name == "workbench-rank-1":
            time.sleep(0.03)
        return self.inner(inputs)


def test_an_asynchronous_worker_far_behind_is_waited_for_at_the_end_not_timed_out():
    # Rank 1 ends at least 100 x 30 ms = 3 s after rank 0, more than the 2 s collective timeout: the
    # end-of-run rendezvous used to be a collective that waited out that timeout and failed the run.
    run = train_in_process(job(model=_SlowOnRankOne, steps=100, **suggested_sgd("async")), "async", WORLD,
                           timeout_s=2.0, push_every=4)
    assert [len(run.steps(rank)) for rank in range(WORLD)] == [100] * WORLD
    assert len({tuple(result["weights"]) for result in run.results}) == 1  # both ended on the server's weights


def _stall_rank_1_at(step: int, stall_s: float, timeout_s: float | None):
    """on_record: the run's timeout set to `timeout_s` at rank 0's step 3 (as the client sets a measured
    one), and rank 1 held `stall_s` after its step `step` (on_record runs in the rank's own thread)."""
    def on_record(record, control):
        if record.get("kind") != kinds.STEP:
            return
        if record["worker"] == 0 and record["step"] == 3 and timeout_s is not None:
            control.update(timeout_s=timeout_s)
        if record["worker"] == 1 and record["step"] == step:
            time.sleep(stall_s)

    return on_record


def test_a_timeout_set_while_the_run_trains_is_the_one_every_ranks_waits_have():
    run = train_in_process(job(), "allreduce", WORLD, on_record=_stall_rank_1_at(12, 0.0, 0.75))
    applied = run.events(kinds.DEADLINE_APPLIED)
    assert sorted(e["worker"] for e in applied) == [0, 1] and {e["timeout_s"] for e in applied} == {0.75}
    assert all(3 <= e["step"] <= 6 for e in applied)  # at the next steps, not at the next agreement
    # In force: rank 1 held 1.5 s (twice the timeout) now makes rank 0's collective give up after 0.75 s ...
    with pytest.raises(threading.BrokenBarrierError):
        train_in_process(job(), "allreduce", WORLD, on_record=_stall_rank_1_at(12, 1.5, 0.75))
    # ... where the timeout the run started with (60 s) waits for it.
    held = train_in_process(job(), "allreduce", WORLD, on_record=_stall_rank_1_at(12, 1.5, None))
    assert [len(held.steps(rank)) for rank in range(WORLD)] == [30, 30]


def test_a_parameter_server_strategy_takes_the_timeout_for_its_own_waits(monkeypatch):
    from workbench.strategies import parameter_server

    seen = []
    original = parameter_server._ServerStrategy.follow_timeout

    def noting(self, timeout_s):  # what each rank's strategy holds once it has taken the timeout
        original(self, timeout_s)
        seen.append((self.timeout_s, self.server.timeout_s))

    monkeypatch.setattr(parameter_server._ServerStrategy, "follow_timeout", noting)
    train_in_process(job(), "async", WORLD, on_record=_stall_rank_1_at(12, 0.0, 9.0))
    assert seen == [(9.0, 9.0), (9.0, 9.0)]
