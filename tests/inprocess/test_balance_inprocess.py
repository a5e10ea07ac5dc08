"""Balanced `allreduce` and `average` in one process: a rank made slow per sample gets a smaller share of
each global batch, the shares follow its speed, and every update is still the one a single process makes
on the whole global batch (bit for bit up to float rounding; `average` with period 1 and plain SGD)."""
import pytest
import torch

from inprocess.test_inprocess import WORLD, assert_same_weights, job, reference
from workbench.testing import train_in_process

pytestmark = pytest.mark.timeout(120)


def whole_batch_reference(the_job, run) -> dict[str, torch.Tensor]:
    return reference(the_job, run, whole=True)


def shares_by_step(run) -> dict[int, list[int]]:
    shares: dict[int, list[int]] = {}
    for record in run.steps():
        shares.setdefault(record["step"], [0] * WORLD)[record["worker"]] = record["samples"]
    return shares


@pytest.mark.parametrize("wire_dtype", ["float32", "bf16"])
def test_a_slow_rank_gets_a_smaller_share_and_each_update_is_the_whole_batchs(wire_dtype):
    the_job = job(steps=40)
    # Per sample, rank 0 takes 1 ms more and rank 1 3 ms (a CPU three times slower): 8 of 32 is its share.
    run = train_in_process(the_job, "allreduce", WORLD, sample_delays={0: 0.001, 1: 0.003}, balance=True,
                           rebalance_every=5, bucket_mb=0.001, wire_dtype=wire_dtype)
    shares = shares_by_step(run)
    assert all(sum(cut) == 2 * the_job.batch_size for cut in shares.values()), "every step trains the global batch"
    # Equal until the first cut: the first step is not measured, the next 3 are.
    assert shares[0] == [16, 16] and shares[3] == [16, 16]
    assert all(6 <= shares[step][1] <= 10 for step in range(4, 40)), "the slow rank's share follows its speed"
    if wire_dtype == "float32":
        assert_same_weights(run.results[0]["state_dict"], whole_batch_reference(the_job, run))
    else:  # bf16 on the wire: the same update up to its rounding
        expected = whole_batch_reference(the_job, run)
        for name, value in run.results[0]["state_dict"].items():
            torch.testing.assert_close(value, expected[name], rtol=0.05, atol=0.01)


def test_balanced_updates_under_adamw_are_the_whole_batchs_up_to_rounding():
    # AdamW scales each coordinate by its own running magnitude, so it amplifies what the cut changes in
    # the gradients' rounding more than SGD: still the same updates (the GPT over gloo, 12 steps with a
    # cut of 22-24 of 64: 1e-6 of the weights' norm apart from plain allreduce's).
    the_job = job(steps=20, optimizer="adamw", lr=3e-3, momentum=0.0)
    run = train_in_process(the_job, "allreduce", WORLD, sample_delays={1: 0.003}, balance=True, rebalance_every=5)
    assert max(cut[1] for step, cut in shares_by_step(run).items() if step >= 4) < 16
    expected = whole_batch_reference(the_job, run)
    for name, value in run.results[0]["state_dict"].items():
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_balance_turned_off_live_gives_equal_parts_from_the_agreed_step():
    the_job = job(steps=40)

    def turn_off(record, control):
        if record.get("kind") == "step" and record["step"] == 20 and record["worker"] == 0:
            control.update(settings={"balance": False})

    run = train_in_process(the_job, "allreduce", WORLD, on_record=turn_off, sample_delays={1: 0.003}, balance=True,
                           rebalance_every=5)
    shares = shares_by_step(run)
    assert shares[19][1] < 16
    changed = min(step for step, cut in shares.items() if step > 20 and cut == [16, 16])
    assert all(shares[step] == [16, 16] for step in range(changed, 40))
    assert_same_weights(run.results[0]["state_dict"], whole_batch_reference(the_job, run))


@pytest.mark.parametrize("overlap", [False, True])
def test_balanced_averaging_weights_each_change_by_its_samples(overlap):
    # Every step, plain SGD: the sample-weighted mean of the workers' steps is one step on the global batch.
    # Overlapped, each average lands one period late: the same weights at the end only without it.
    the_job = job(steps=40, momentum=0.0)
    run = train_in_process(the_job, "average", WORLD, sample_delays={0: 0.001, 1: 0.003}, balance=True,
                           rebalance_every=5, period=1, overlap=overlap)
    shares = shares_by_step(run)
    assert all(sum(cut) == 32 for cut in shares.values()) and shares[0] == [16, 16]
    assert all(6 <= shares[step][1] <= 10 for step in range(4, 40)), "the slow rank's share follows its speed"
    if not overlap:
        assert_same_weights(run.results[0]["state_dict"], whole_batch_reference(the_job, run))


def test_balanced_averaging_with_a_longer_period_cuts_anew_at_syncs():
    run = train_in_process(job(steps=48), "average", WORLD, sample_delays={0: 0.001, 1: 0.003}, balance=True,
                           rebalance_every=8, period=8)
    shares = shares_by_step(run)
    changes = [step for step in range(1, 48) if shares[step] != shares[step - 1]]
    assert changes and all(step % 8 == 0 for step in changes), "the cut changes only after a sync"
    assert shares[47][1] <= 10
