"""Training on a real 2-process LocalCluster with gloo: numeric references, accuracy, control, live metrics."""
import functools
import json
import time

import dask.array as da
import numpy as np
import pytest
import torch

import workbench
from workbench.data import digits
from workbench.plane.rundir import read_metrics
from workbench.sharding import batches, shard_indices

import helpers
from helpers import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def reference_sgd(job, world_size, total_steps):
    """One process, plain SGD on the union of the workers' batches, step for step."""
    torch.manual_seed(job.seed)
    model = job.model()
    optimizer = torch.optim.SGD(model.parameters(), lr=job.lr)
    data = digits().train.load()
    step = 0
    for epoch in range(10_000):
        per_rank = [batches(shard_indices(len(data), world_size, r, epoch, job.seed), job.batch_size)
                    for r in range(world_size)]
        for group in zip(*per_rank):
            if step == total_steps:
                return model
            inputs, targets = data.batch(torch.cat(group))
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(inputs), targets).backward()
            optimizer.step()
            step += 1
    return model


# Here for gloo's all-reduce across processes; every strategy's arithmetic (average every step included)
# is checked against the same reference in the in-process tier, tests/inprocess/test_inprocess.py.
@pytest.mark.parametrize("strategy,settings", [("allreduce", {})])
def test_matches_single_process_sgd_on_the_union_batch(client, run_dir, strategy, settings):
    job = workbench.Job(model=workbench.mlp(64, 10, (32,)), data="digits", lr=0.2, batch_size=16, steps=60, seed=5)
    run = workbench.train(job, strategy, client=client, run_dir=run_dir, **settings)
    assert run.wait(timeout=120) == "finished"
    trained = run.model().state_dict()
    expected = reference_sgd(job, 2, 60).state_dict()
    initial = (torch.manual_seed(5), job.model())[1].state_dict()
    for name, value in expected.items():
        assert not torch.allclose(value, initial[name]), "training must have moved the weights"
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5)


def test_balanced_allreduce_gives_a_slow_worker_less_and_still_matches_single_process_sgd(client, run_dir):
    from workbench.run.handle import Run

    job = workbench.Job(model=workbench.mlp(64, 10, (32,)), data="digits", lr=0.2, batch_size=16, steps=60, seed=5)
    # Worker 1 takes 2 ms more per sample: its share of each global batch of 32 shrinks to its speed.
    run = Run(job, "allreduce", client=client, workers=2, run_dir=run_dir, name=None, collective_timeout_s=60,
              settings={"balance": True, "rebalance_every": 5}, sample_delays={1: 0.002})
    run.start()
    assert run.wait(timeout=120) == "finished"
    steps = run.table.steps()
    per_step = steps.groupby("step")["samples"].sum()
    assert len(per_step) == 60 and (per_step == 32).all(), "every step trains the whole global batch"
    slow = steps[steps["worker"] == 1].set_index("step")["samples"]
    assert slow[0] == 16 and slow[59] <= 4, "the slow worker's share follows its speed"
    trained = run.model().state_dict()
    for name, value in reference_sgd(job, 2, 60).state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("strategy,settings", [("allreduce", {}), ("average", {"period": 4})])
def test_reaches_090_heldout_accuracy_on_digits_in_5_epochs(client, run_dir, strategy, settings):
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", lr=0.1, momentum=0.9, batch_size=32, epochs=5)
    run = workbench.train(job, strategy, client=client, run_dir=run_dir, **settings)
    run.wait(timeout=120)
    result = run.evaluate()
    assert result["accuracy"] >= 0.9, result
    # Per-epoch held-out evaluation on worker 0 arrived as records too.
    assert len(run.evaluations) == 5 and run.evaluations["accuracy"].iloc[-1] == pytest.approx(result["accuracy"])


long_job = functools.partial(helpers.digits_job, lr=0.05, batch_size=8, steps=1_000_000)


def steps_done(run):
    frame = run.metrics
    return 0 if frame.empty else int(frame.groupby("worker")["step"].max().min()) + 1


@pytest.mark.parametrize("strategy", ["allreduce", "average"])
def test_pause_stops_progress_resume_continues_and_stop_ends_cleanly(client, run_dir, strategy):
    run = workbench.train(long_job(), strategy, client=client, run_dir=run_dir)
    try:
        wait_until(lambda: steps_done(run) >= 20)
        run.pause()
        wait_until(lambda: len(run.events("paused")) == 2)
        paused_at = run.table.steps_received
        time.sleep(1.0)  # an interval to observe that nothing moves (not a synchronisation)
        assert run.table.steps_received == paused_at
        assert run.status == "paused"
        run.resume()
        wait_until(lambda: len(run.events("resumed")) == 2)
        wait_until(lambda: run.table.steps_received > paused_at + 20)
    finally:
        run.stop()
    assert run.wait(timeout=60) == "stopped"
    frame = run.metrics
    assert 20 < steps_done(run) < run.total_steps
    assert len(run.events("worker-finished")) == 2
    # Records are complete and in order: every worker reported every step it ran, once.
    for _, rows in frame.groupby("worker"):
        assert list(rows["step"]) == list(range(len(rows)))
    # The final weights are the synchronised ones, and were saved atomically in the run directory.
    saved = torch.load(run.directory.path / "model.pt")
    assert all(torch.equal(saved[k], v) for k, v in run.model().state_dict().items())


def test_learning_rate_change_reaches_every_worker(client, run_dir):
    run = workbench.train(long_job(), "average", client=client, run_dir=run_dir, period=2)
    try:
        wait_until(lambda: steps_done(run) >= 10)
        run.set_lr(0.0123)
        wait_until(lambda: set(run.metrics.query("lr == 0.0123")["worker"]) == {0, 1})
        run.update(period=3)
        wait_until(lambda: set(run.metrics.query("steps_since_sync == 2")["worker"]) == {0, 1})
        changed_at = steps_done(run)
        wait_until(lambda: steps_done(run) >= changed_at + 15)
    finally:
        run.stop()
    run.wait(timeout=60)
    frame = run.metrics
    assert set(frame["lr"].unique()) == {0.05, 0.0123}
    # Both workers switched at the same step (the change is agreed among them).
    first = frame[frame["lr"] == 0.0123].groupby("worker")["step"].min()
    assert first[0] == first[1]
    # After the period change, syncs (steps_since_sync == 0) come every 3 steps.
    late = frame[(frame["worker"] == 0) & (frame["step"] >= frame["step"].max() - 12)]
    since = list(late["steps_since_sync"])
    assert max(since) == 2 and since.count(0) >= 3


def test_metrics_arrive_live_and_match_the_steps_run(client, run_dir):
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", lr=0.05, batch_size=8, steps=400)
    run = workbench.train(job, "allreduce", client=client, run_dir=run_dir)
    wait_until(lambda: run.table.steps_received > 0)
    live_count = run.table.steps_received
    assert not run.done and live_count < 2 * 400, "records must arrive while training, not at the end"
    run.wait(timeout=120)
    frame = run.metrics
    assert len(frame) == 2 * 400
    assert sorted(frame.groupby("worker")["step"].apply(list)[0]) == list(range(400))
    assert (frame["samples"] == 8).all() and (frame["compute_s"] > 0).all()
    # The run directory holds every record too, with the config.
    on_disk = [r for r in read_metrics(run.directory.path) if r["kind"] == "step"]
    assert len(on_disk) == 2 * 400
    config = json.loads((run.directory.path / "config.json").read_text())
    assert config["strategy"] == "allreduce" and config["world_size"] == 2 and config["total_steps"] == 400
    assert run.throughput(None)["samples_per_s"] > 0


def test_dask_arrays_train_on_blocks_the_workers_hold(client, run_dir):
    data = digits().train.load()
    inputs = da.from_array(data.inputs.numpy(), chunks=(180, 64))
    targets = da.from_array(data.targets.numpy(), chunks=180)
    job = workbench.Job(model=workbench.mlp(64, 10), data=(inputs, targets), eval_data=digits().eval,
                        lr=0.1, momentum=0.9, batch_size=32, epochs=5)
    run = workbench.train(job, "average", client=client, run_dir=run_dir, period=2)
    run.wait(timeout=120)
    assert run.config["shard_samples"] >= 540  # 1437 rows in 8 blocks: near-equal halves
    assert run.evaluate()["accuracy"] >= 0.9
    # Each worker trains on the blocks it holds: a batch cannot be shared out by speed, and it is said.
    with pytest.raises(workbench.ConfigError, match=r"^balance=True .*blocks"):
        workbench.train(job, "allreduce", client=client, run_dir=run_dir, balance=True)


def test_numpy_data_and_user_errors_surface_with_the_worker_traceback(client, run_dir):
    inputs = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    targets = (inputs[:, 0] > 0).astype("int64")

    def broken_loss(outputs, labels):
        import distributed

        try:
            distributed.get_worker()
        except ValueError:  # on the client, where the job is checked on one batch, it works
            return torch.nn.functional.cross_entropy(outputs, labels)
        raise RuntimeError("loss exploded on purpose")

    job = workbench.Job(model=workbench.mlp(8, 2), data=(inputs, targets), loss=broken_loss, batch_size=16)
    run = workbench.train(job, "allreduce", client=client, run_dir=run_dir, collective_timeout_s=20)
    with pytest.raises(workbench.TrainingError, match="loss exploded on purpose") as caught:
        run.wait(timeout=90)
    assert "broken_loss" in str(caught.value)  # the worker's traceback is in the message
    assert run.status == "failed" and len(run.events("worker-failed")) >= 1
    # The workers are free again: a following run trains on them.
    ok = workbench.train(workbench.Job(model=workbench.mlp(8, 2), data=(inputs, targets), batch_size=16),
                         "allreduce", client=client, run_dir=run_dir)
    assert ok.wait(timeout=60) == "finished"


def test_a_torch_dataset_trains_and_any_client_can_subscribe_to_the_metrics(client, run_dir):
    from distributed import Client

    from workbench.plane.metrics import expand, topic

    data = digits().train.load()
    dataset = torch.utils.data.TensorDataset(data.inputs, data.targets)
    job = workbench.Job(model=workbench.mlp(64, 10), data=dataset, eval_data=digits().eval, lr=0.1, momentum=0.9,
                        batch_size=32, epochs=5)
    run = workbench.train(job, "average", client=client, run_dir=run_dir, period=4)
    received = []
    with Client(client.scheduler.address) as observer:  # e.g. a dashboard process of its own
        observer.subscribe_topic(topic(run.run_id), lambda event: received.extend(expand(event[1])))
        run.wait(timeout=120)
        wait_until(lambda: any(r["kind"] == "worker-finished" for r in received))
        observer.unsubscribe_topic(topic(run.run_id))
    steps = [r for r in received if r["kind"] == "step"]
    assert steps and {r["worker"] for r in steps} == {0, 1}
    assert run.evaluate()["accuracy"] >= 0.9


def _held_results(run_id, dask_scheduler=None):
    """Keys of the run's tasks (its ranks) and checkpoint fetches the scheduler still keeps."""
    return [str(key) for key, task in dask_scheduler.tasks.items()
            if run_id in str(key) or str(key).startswith("take_snapshot-")]


def test_a_finished_run_leaves_no_result_in_the_workers_memory(client, run_dir):
    # Its ranks' results (the final weights, a checkpoint) and the checkpoints fetched while it trained go
    # from the workers once taken: a result still held is computed again when its worker dies, which ran
    # a finished run's rank task again on another worker.
    job = helpers.digits_job(lr=0.05, epochs=2, batch_size=16)
    run = workbench.train(job, "allreduce", client=client, run_dir=run_dir, checkpoint_every_steps=10,
                          checkpoint_every_s=None)
    assert run.wait(timeout=120) == "finished"
    assert [e for e in run.events("checkpoint") if not e.get("final")]  # fetched while it trained
    wait_until(lambda: not client.run_on_scheduler(_held_results, run.run_id), timeout_s=30)
    assert run.evaluate()["accuracy"] > 0.5  # the run itself keeps what it took
