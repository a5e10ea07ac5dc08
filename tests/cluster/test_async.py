"""The parameter-server strategies on a real 2-process cluster: actors, staleness, SSP, compression."""
from __future__ import annotations

import functools

import pytest
import torch

import workbench
from workbench.run.launcher import present_workers
from workbench.server.compression import encode
from workbench.run.handle import Run
from workbench.server.shards import ServerClient, merge_replies, start_parameter_server

import helpers
from helpers import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


# Asynchronous updates act like extra momentum (Mitliagkas et al. 2016): 0.7 rather than 0.9.
digits_job = functools.partial(helpers.digits_job, lr=0.05, momentum=0.7, batch_size=8, epochs=5)


def scripted_schedule(client, shards, job, weights):
    """Drive a server from the client with a fixed interleaving of fetches and pushes."""
    addresses = present_workers(client)
    handle = start_parameter_server(client, f"script-{shards}", addresses, weights, job, shards, 2,
                                    staleness_aware_lr=True)
    server = ServerClient(handle, timeout_s=30)
    generator = torch.Generator().manual_seed(1)
    staleness = []
    try:
        for worker in (0, 1):
            server.fetch(worker)
        for worker, fetch in [(0, False), (1, True), (0, True), (0, False), (1, False), (1, True), (0, False)]:
            gradient = torch.randn(weights.numel(), generator=generator)
            packets = [encode(part, "none") for part in server.split(gradient)]
            replies, _ = server.push(worker, packets, 0.1, None, fetch).result(30)
            staleness.append(merge_replies(replies).staleness)
        return server.weights(), staleness, server.stats()
    finally:
        handle.release()


def test_sharded_server_gives_the_same_result_as_one_shard(client):
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", optimizer="adam", lr=0.01)
    weights = torch.randn(4810)
    one, staleness_one, stats_one = scripted_schedule(client, 1, job, weights)
    two, staleness_two, stats_two = scripted_schedule(client, 2, job, weights)
    assert staleness_one == staleness_two == [0, 1, 2, 0, 2, 3, 3]
    assert len(stats_two) == 2 and all(s["version"] == 7 for s in stats_two)
    assert torch.equal(one, two)
    assert not torch.equal(one, weights)


def _held_actors(prefix, dask_worker=None):
    return [str(key) for key in dask_worker.state.actors if prefix in str(key)]


def test_a_released_server_goes_even_while_a_handle_to_it_is_still_held(client):
    # A handle caught elsewhere (a call's closure, a traceback) holds a claim of its own on its shard's
    # key; released, the server's handles let go of it too, so the shard goes at once, not at the next
    # full garbage collection of whoever still holds the handle.
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", lr=0.1)
    handle = start_parameter_server(client, "held-handle", present_workers(client), torch.randn(4810), job, 2, 2,
                                    staleness_aware_lr=False)
    held = list(handle.actors)
    server = ServerClient(handle, timeout_s=30)
    assert server.stats()[0]["version"] == 0
    assert sum(len(keys) for keys in client.run(_held_actors, "held-handle").values()) == 2
    handle.release()
    wait_until(lambda: not any(client.run(_held_actors, "held-handle").values()), timeout_s=30)
    assert len(held) == 2 and handle.actors == []


def test_server_applies_the_optimizer_exactly_with_staleness_aware_lr(client):
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", lr=0.1, momentum=0.9)
    weights = torch.randn(4810)
    result, staleness, _ = scripted_schedule(client, 2, job, weights)
    # The same schedule by hand: SGD with momentum, each step's lr divided by its staleness.
    reference = torch.nn.Parameter(weights.clone())
    optimizer = torch.optim.SGD([reference], lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    for stale in staleness:
        reference.grad = torch.randn(weights.numel(), generator=generator)
        optimizer.param_groups[0]["lr"] = 0.1 / max(1, stale)
        optimizer.step()
    assert torch.equal(result, reference.data)


def test_ssp_wait_runs_on_the_event_loop_and_releases_when_the_slowest_catches_up(client):
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits")
    addresses = present_workers(client)
    handle = start_parameter_server(client, "ssp-wait", addresses, torch.zeros(10), job, 1, 2, False)
    shard = handle.actors[0]
    try:
        nothing = encode(torch.zeros(10), "none")
        for clock in (1, 2, 3):
            shard.push(0, nothing, 0.1, clock).result(10)
        waiting = shard.wait_for_clock(0, 3, 1, 30)  # worker 1 is at clock 0: 3 - 0 > 1
        # The actor thread stays free while worker 0 waits: plain calls are answered meanwhile.
        wait_until(lambda: shard.stats().result(10)["waiting"] == 1, timeout_s=10)
        assert not waiting.done()
        shard.push(1, nothing, 0.1, 1).result(10)
        assert not waiting.done() and shard.stats().result(10)["waiting"] == 1  # 3 - 1 > 1 still
        shard.push(1, nothing, 0.1, 2).result(10)
        reply = waiting.result(10)
        assert reply["clock_gap"] == 1 and reply["slowest_clock"] == 2
    finally:
        handle.release()


# With compression: tests/cluster/test_compressed_replies.py.
@pytest.mark.parametrize("strategy,settings", [
    ("async", {}), ("ssp", {"max_staleness": 2}), ("easgd", {"period": 4}),
])
def test_reaches_090_heldout_accuracy_on_digits(client, run_dir, strategy, settings):
    run = workbench.train(digits_job(), strategy, client=client, run_dir=run_dir, **settings)
    assert run.wait(timeout=150) == "finished"
    result = run.evaluate()
    assert result["accuracy"] >= 0.9, result
    summary = run.summary()
    staleness = run.staleness()
    assert set(staleness) == {0, 1} and all(s["pushes"] > 10 for s in staleness.values())
    assert summary["staleness"]["max"] == max(s["max"] for s in staleness.values())
    assert all(sum(s["histogram"].values()) == s["pushes"] for s in staleness.values())
    frame = run.metrics
    pushes = frame.dropna(subset=["bytes_sent"])
    n = run.config["parameters"]
    assert (pushes["bytes_sent"] == n * 4).all()
    # Uncompressed replies carry the dense weights (or pull); an SSP refresh adds a second reply.
    replies = frame[frame["bytes_received"].fillna(0) > 0]
    assert len(replies) > 10 and set(replies["bytes_received"]) <= {n * 4, n * 8}
    assert 0 <= summary["comm_hidden_fraction"] <= 1 and summary["server_versions_per_s"] > 0


def run_with_slow_worker(client, run_dir, strategy, **settings):
    job = digits_job(steps=80, epochs=None)
    run = Run(job, strategy, client=client, workers=2, run_dir=run_dir, name=None, collective_timeout_s=60,
              settings=settings, step_delays={1: 0.02})
    run.start()
    assert run.wait(timeout=150) == "finished"
    return run


def test_ssp_holds_a_fast_worker_within_the_bound_and_async_lets_it_run_ahead(client, run_dir):
    ssp = run_with_slow_worker(client, run_dir, "ssp", max_staleness=2)
    fast = ssp.metrics[ssp.metrics["worker"] == 0].dropna(subset=["clock_gap"])
    assert len(fast) > 50
    assert fast["clock_gap"].max() == 2  # it reached the bound and was held there
    assert fast["wait_s"].sum() > 0.5  # ... by waiting for the slow worker

    free = run_with_slow_worker(client, run_dir, "async")
    fast_free = free.metrics[free.metrics["worker"] == 0].dropna(subset=["clock_gap"])
    assert fast_free["clock_gap"].max() > 10  # nothing held it back
    # The slow worker's pushes saw many more of the fast worker's updates without the bound.
    # (The mean is no discriminator: the slow worker's staleness always sums to the fast worker's pushes.)
    assert free.staleness()[1]["max"] > ssp.staleness()[1]["max"] >= 2
