"""Errors in user code on a worker (model factory, dataset, loss) reach the client with the worker's
traceback and end the run cleanly: no task still running, no process group left joined, no process
dead or added, no thread or parameter-server actor of the run left, and the next run trains.

The user code below is module-level and pickled by reference: the workers of the `client` fixture
are spawned from the test process with its `sys.path`, so they import this module from `tests/cluster/` as
pytest does. Each callable decides from the worker's address whether it fails there, so one rank or
every rank can be failed (`distributed.get_worker()` raises ValueError on the client, where
`Job.prepare` calls the model factory once to check it).
"""
from __future__ import annotations

import functools
import os
import threading

import distributed
import numpy as np
import psutil
import pytest
import torch

import workbench
from workbench.run.launcher import present_workers
from workbench.plane.rundir import read_metrics

from helpers import wait_until

pytestmark = [pytest.mark.cluster]

STRATEGIES = ["allreduce", "average", "async"]
FAILING_RANKS = {"every-rank": (0, 1), "rank-0": (0,), "rank-1": (1,)}
FAIL_AT_STEP = 5
BATCH_SIZE = 8
# Bounds a rank that waits on a failed peer (a collective, the parameter server): the run must end
# well within `WAIT_S` even when the healthy rank only learns of the failure through a timeout.
COLLECTIVE_TIMEOUT_S = 20
WAIT_S = 120

_rng = np.random.default_rng(0)
INPUTS = _rng.normal(size=(256, 8)).astype("float32")
TARGETS = (INPUTS[:, 0] > 0).astype("int64")


# --- user code that fails on purpose --------------------------------------------------------------


class UserModelError(Exception):
    pass


class UserDataError(Exception):
    pass


class UserLossError(Exception):
    pass


def _this_worker() -> str | None:
    """The address of the worker this runs on; None on the client."""
    try:
        return distributed.get_worker().address
    except ValueError:
        return None


def build_model_or_explode(fail_on: frozenset[str]) -> torch.nn.Module:
    """A model factory that works on the client (where `Job.prepare` tries it) and fails on `fail_on`."""
    where = _this_worker()
    if where in fail_on:
        raise UserModelError(f"weights file for the pretrained backbone is missing on {where}")
    return workbench.mlp(8, 2)()


class FlakyDataset(torch.utils.data.Dataset):
    """A map-style dataset whose reads start failing on `fail_on` after `fail_after_items` items."""

    def __init__(self, fail_on: frozenset[str], fail_after_items: int) -> None:
        self.inputs, self.targets = torch.as_tensor(INPUTS), torch.as_tensor(TARGETS)
        self.fail_on, self.fail_after_items = fail_on, fail_after_items
        self.items_read = 0  # per process: each worker unpickles its own copy

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int):
        self.items_read += 1
        return self.load_sample(index)

    def load_sample(self, index: int):
        if self.items_read > self.fail_after_items and _this_worker() in self.fail_on:
            raise UserDataError(f"sample {index} is corrupt: checksum mismatch")
        return self.inputs[index], self.targets[index]


class ExplodingLoss:
    """Cross-entropy that raises at step `at_step` on `fail_on` (one call per step)."""

    def __init__(self, fail_on: frozenset[str], at_step: int) -> None:
        self.fail_on, self.at_step = fail_on, at_step
        self.calls = 0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        step, self.calls = self.calls, self.calls + 1
        return compute_user_loss(outputs, targets, step, self)

    def __repr__(self) -> str:
        return "ExplodingLoss()"


def compute_user_loss(outputs, targets, step, loss):
    if step == loss.at_step and _this_worker() in loss.fail_on:
        raise UserLossError(f"label smoothing table has no entry for step {step}")
    return torch.nn.functional.cross_entropy(outputs, targets)


# What each kind of failure looks like: the job, then what the worker's traceback must show.
def _model_job(fail_on):
    job = workbench.Job(model=functools.partial(build_model_or_explode, fail_on), data=(INPUTS, TARGETS),
                        batch_size=BATCH_SIZE, steps=100_000)
    return job, UserModelError, "weights file for the pretrained backbone is missing", "build_model_or_explode", 0


def _dataset_job(fail_on):
    dataset = FlakyDataset(fail_on, fail_after_items=FAIL_AT_STEP * BATCH_SIZE)
    job = workbench.Job(model=workbench.mlp(8, 2), data=dataset, batch_size=BATCH_SIZE, steps=100_000)
    return job, UserDataError, "is corrupt: checksum mismatch", "load_sample", FAIL_AT_STEP


def _loss_job(fail_on):
    job = workbench.Job(model=workbench.mlp(8, 2), data=(INPUTS, TARGETS), loss=ExplodingLoss(fail_on, FAIL_AT_STEP),
                        batch_size=BATCH_SIZE, steps=100_000)
    return job, UserLossError, f"label smoothing table has no entry for step {FAIL_AT_STEP}", "compute_user_loss", \
        FAIL_AT_STEP


FAILURES = {"model-factory": _model_job, "dataset": _dataset_job, "loss": _loss_job}


# --- what "nothing left behind" means --------------------------------------------------------------


def _worker_addresses(client) -> list[str]:
    return present_workers(client)  # the ranks' order in a run


def _children() -> list[int]:
    return sorted(p.pid for p in psutil.Process().children(recursive=True))


def _workbench_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("workbench"))


def _worker_state(client):
    """Per worker: pid and child processes, to compare before and after a run."""
    return client.run(lambda: (os.getpid(), _children()))


def _in_process_group(client) -> dict[str, bool]:
    return client.run(lambda: torch.distributed.is_initialized())


def _run_actors(client, run_id: str) -> dict[str, list[str]]:
    return client.run(lambda dask_worker: [str(k) for k in dask_worker.state.actors if run_id in str(k)])


def _run_server_keys_on_scheduler(client, run_id: str) -> list[str]:
    marker = f"workbench-{run_id}-server-"
    return client.run_on_scheduler(lambda dask_scheduler: [str(k) for k in dask_scheduler.tasks if marker in str(k)])


def assert_nothing_left_behind(client, before, run) -> None:
    # No task of this or any run still occupies a worker.
    wait_until(lambda: not any(client.processing().values()), timeout_s=30)
    # No worker process still belongs to a torch.distributed process group (the next run must form one).
    assert not any(_in_process_group(client).values()), _in_process_group(client)
    # The same worker processes, none died or restarted, and no process started by user code is left.
    assert _worker_state(client) == before
    # Worker-side threads of the run (control poller) ended; so did the client's supervisor threads.
    wait_until(lambda: not any(client.run(_workbench_threads).values()), timeout_s=30)
    wait_until(lambda: not [t.name for t in threading.enumerate() if run.run_id in t.name], timeout_s=30)
    # A parameter server (async) was released: no actor of the run on any worker, no key on the scheduler,
    # without waiting for the workers' cyclic garbage collector (the loop breaks its own cycle at the end).
    wait_until(lambda: not any(_run_actors(client, run.run_id).values()), timeout_s=30)
    wait_until(lambda: not _run_server_keys_on_scheduler(client, run.run_id), timeout_s=30)


def assert_a_normal_run_trains(client, run_dir, strategy):
    job = workbench.Job(model=workbench.mlp(8, 2), data=(INPUTS, TARGETS), batch_size=16, steps=30)
    run = workbench.train(job, strategy, client=client, run_dir=run_dir, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    assert run.wait(timeout=WAIT_S) == "finished"
    assert run.error is None
    assert len(run.events("worker-finished")) == 2
    assert sorted(run.metrics.groupby("worker")["step"].max()) == [29, 29]
    return run


# --- the tests -------------------------------------------------------------------------------------


def _leave_process_group() -> bool:
    from workbench.comm import collectives

    left = torch.distributed.is_initialized()
    collectives.destroy_process_group()  # and the process's claim on its one group
    return left


@pytest.fixture
def contained(client):
    """After the test, take any worker out of a process group a failing test left it in, so that one
    such failure fails its own test and not every later run on the shared cluster."""
    yield
    client.run(_leave_process_group)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("failing", list(FAILING_RANKS))
@pytest.mark.parametrize("failure", list(FAILURES))
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_user_error_on_a_worker_reaches_the_client_with_its_traceback_and_ends_the_run_cleanly(
        client, run_dir, contained, strategy, failure, failing):
    addresses = _worker_addresses(client)
    assert len(addresses) == 2
    failing_ranks = FAILING_RANKS[failing]
    fail_on = frozenset(addresses[r] for r in failing_ranks)
    job, error_type, message, user_function, failed_step = FAILURES[failure](fail_on)
    before = _worker_state(client)
    assert not any(_in_process_group(client).values()), "a previous test left a process group"

    run = workbench.train(job, strategy, client=client, run_dir=run_dir, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    with pytest.raises(workbench.TrainingError) as caught:
        run.wait(timeout=WAIT_S)  # a TimeoutError instead would fail the test: the run must end

    # The client's error names the user's exception, its message, and the user's own function from
    # the worker's traceback, with the engine's worker frames around it (it is the worker's traceback).
    text = str(caught.value)
    assert f"{error_type.__name__}: " in text and message in text, text
    assert f"in {user_function}" in text, text
    assert "in train_on_worker" in text, text
    # The first failure ends the group: a failing rank either failed with the user's error or, ended first,
    # left. A rank that fails alone fails first by construction. The user's error comes first; a peer may
    # also list the broken connection it saw before the group was ended.
    failed = [rank for rank in failing_ranks
              if f"worker {rank} ({addresses[rank]}) failed: {error_type.__name__}: " in text]
    assert failed and (len(failing_ranks) > 1 or failed == list(failing_ranks)), text
    first = text.split("\n", 1)[1]
    assert first.startswith("worker ") and f"failed: {error_type.__name__}: " in first.splitlines()[0], text
    assert run.status == "failed" and run.done
    assert run.error is not None and message in run.error and user_function in run.error

    # Each failing rank reported its failure, at the step it failed, with the traceback, live and on disk.
    for records in (run.events("worker-failed"),
                    [r for r in read_metrics(run.directory.path) if r["kind"] == "worker-failed"]):
        by_rank = {r["worker"]: r for r in records}
        assert set(failed) <= set(by_rank), records
        left = {r["worker"] for r in run.events("worker-left")}
        # Every failing rank failed (a record of its own; the client's error may name only the first, the
        # group being ended by it) or left, ended first.
        reported = set(by_rank) & set(failing_ranks)
        assert set(failing_ranks) <= reported | left, (records, left)
        for rank in reported:
            record = by_rank[rank]
            assert record["error"].startswith(f"{error_type.__name__}: ") and message in record["error"], record
            assert record["step"] == failed_step, record
            assert "Traceback" in record["traceback"] and user_function in record["traceback"], record
            assert message in record["traceback"], record
    on_disk = read_metrics(run.directory.path)
    assert on_disk[-1]["kind"] == "run-failed" and message in on_disk[-1]["error"]
    # A failed run saves no final weights.
    assert not (run.directory.path / "model.pt").exists()

    assert_nothing_left_behind(client, before, run)
    following = assert_a_normal_run_trains(client, run_dir, strategy)
    assert_nothing_left_behind(client, before, following)


class LossAfterTheShardIsGone:
    """Cross-entropy that raises at step `at_step` on every worker: at once on `shard_worker` (rank 0, which
    holds the parameter server's one shard and releases it as it fails), elsewhere only once that shard is
    gone from its worker, so that the other rank fails on its own while the server it must tell is gone."""

    def __init__(self, shard_worker: str, at_step: int) -> None:
        self.shard_worker, self.at_step = shard_worker, at_step
        self.calls = 0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        step, self.calls = self.calls, self.calls + 1
        if step == self.at_step:
            if _this_worker() != self.shard_worker:
                _wait_for_no_server_shard()
            raise UserLossError(f"label smoothing table has no entry for step {step}")
        return torch.nn.functional.cross_entropy(outputs, targets)

    def __repr__(self) -> str:
        return "LossAfterTheShardIsGone()"


def _wait_for_no_server_shard() -> None:
    """Until no worker holds a parameter-server shard (tests run one at a time on the shared cluster)."""
    client = distributed.get_client()
    wait_until(lambda: not any(_run_actors(client, "-server-").values()), timeout_s=60, interval_s=0.01)


@pytest.mark.timeout(300)
def test_a_rank_that_fails_after_the_server_is_gone_still_ends_with_the_group(client, run_dir, contained):
    # Rank 0 fails and releases the server; rank 1 then fails on its own and, closing, tells a server that
    # is gone. Dask's call to a vanished actor never answers: only the group's end (the poller) may end
    # that wait. With the poller stopped before the strategy closed, rank 1 waited its whole timeout,
    # the client counted it stuck and regrouped without it, and its thread stayed in the process group.
    addresses = _worker_addresses(client)
    before = _worker_state(client)
    job = workbench.Job(model=workbench.mlp(8, 2), data=(INPUTS, TARGETS), batch_size=BATCH_SIZE, steps=100_000,
                        loss=LossAfterTheShardIsGone(addresses[0], FAIL_AT_STEP))
    run = workbench.train(job, "async", client=client, run_dir=run_dir, collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    with pytest.raises(workbench.TrainingError, match="UserLossError"):
        run.wait(timeout=WAIT_S)
    # One group, both ranks in it to the end: nobody was counted lost, no regroup.
    assert run.events("worker-lost") == [] and run.events("regrouped") == []
    assert len(run.events("generation-started")) == 1 and run.worker_addresses == addresses
    ended = {r["worker"] for r in run.events("worker-failed") + run.events("worker-left")}
    assert ended == {0, 1}, (run.events("worker-failed"), run.events("worker-left"))
    assert_nothing_left_behind(client, before, run)
