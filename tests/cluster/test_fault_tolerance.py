"""Fault tolerance on a real 3-worker cluster: workers killed mid-run, workers joining, a client killed and
its run resumed, divergence, and interrupts. Each test kills or adds real worker processes.
"""
import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import cloudpickle
import pytest
import torch

import workbench
from workbench.plane import deadline
from workbench.run import recovery
from workbench.run.launcher import present_workers
from workbench.plane import checkpoint_format as checkpoints
from workbench.plane.rundir import read_metrics

from helpers import cli_in_process, ctrl_c_at_default, digits_job, wait_until

TIMEOUT_S = 10.0  # the runs' collective timeout: nothing may wait on a lost worker longer


@pytest.fixture(scope="module")
def _cluster3_holder():
    holder = {"client": workbench.connect(workers=3, dashboard_address=":0")}
    try:
        yield holder
    finally:
        workbench.shutdown(holder["client"])


@pytest.fixture
def cluster3(_cluster3_holder):
    """A 3-worker cluster with all 3 workers running. Tests here kill workers and their nannies start
    them again, every time: a worker killed again while its nanny restarted it once never came back
    (Dask's lost-worker timer of the earlier kill closed the nanny; cluster/restarts.py), and this fixture
    replaced the cluster after 90 s. It now fails instead, as that would be the bug back."""
    _cluster3_holder["client"].wait_for_workers(3, timeout=90)
    return _cluster3_holder["client"]


def _slow_loss(outputs, targets):
    # Slows steps down to a pace where a worker can be killed mid-run; changes no number.
    time.sleep(0.004)
    return torch.nn.functional.cross_entropy(outputs, targets)


_loss_calls = {"count": 0}


def _loss_stalling_on_rank_2(outputs, targets, armed, wake):
    # Rank 2 hangs once, at its first step after the test armed it (`armed` written), for longer than the
    # others' timeout: until the test has seen the run finish without it (`wake` written), or a minute.
    if torch.distributed.is_initialized() and torch.distributed.get_rank() == 2 and os.path.exists(armed) \
            and not _loss_calls.get("stalled"):
        _loss_calls["stalled"] = True
        deadline = time.monotonic() + 60.0
        while not os.path.exists(wake) and time.monotonic() < deadline:
            time.sleep(0.05)  # a file the test writes: nothing to wait on across processes
    return _slow_loss(outputs, targets)


def _count_replications(dask_scheduler, stop=False):
    """Count the scheduler's replications from now on; with `stop`, stop counting and say how many."""
    if stop:
        del dask_scheduler.replicate  # the class's own again
        return dask_scheduler.workbench_replications
    original, dask_scheduler.workbench_replications = dask_scheduler.replicate, 0

    async def replicate(*args, **kwargs):
        dask_scheduler.workbench_replications += 1
        return await original(*args, **kwargs)

    dask_scheduler.replicate = replicate


def _no_process_groups(client):
    flags = client.run(lambda: __import__("torch").distributed.is_initialized())
    return not any(flags.values())


def _pids(client):
    return client.run(os.getpid)


def _digits_job(loss, epochs=6):
    return digits_job(batch_size=16, epochs=epochs, lr=0.1, momentum=0.9, loss=loss)


def _timeline(run, since):
    return [(e["kind"], round(e["time"] - since, 2), e.get("worker"), e.get("reason"), (e.get("error") or "")[:80])
            for e in run.events() if e["kind"] in ("worker-lost", "worker-left", "worker-failed", "regrouped")]


def _accuracy(run):
    return run.evaluate()["accuracy"]


STRATEGY_CASES = [
    # (strategy, settings, job changes, which rank's worker to kill)
    ("allreduce", {}, dict(lr=0.1, momentum=0.9), 1),
    ("average", {"period": 2}, dict(lr=0.1, momentum=0.9), 2),
    # rank 0's worker holds the parameter server's only shard
    ("async", {"push_every": 1}, dict(lr=0.05, momentum=0.7), 0),
    ("ssp", {"push_every": 1}, dict(lr=0.05, momentum=0.7), 0),
    ("easgd", {"period": 2}, dict(lr=0.1, momentum=0.9), 0),
]
# The killed-worker runs wait this long on a peer at most: regrouping must not depend on it.
LONG_TIMEOUT_S = 60.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy,settings,job_changes,victim", STRATEGY_CASES, ids=[c[0] for c in STRATEGY_CASES])
def test_a_killed_worker_costs_at_most_one_checkpoint_interval(cluster3, tmp_path, strategy, settings,
                                                             job_changes, victim):
    every = 40
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=16, epochs=8, loss=_slow_loss,
                        **job_changes)
    cluster3.run_on_scheduler(_count_replications)
    run = workbench.train(job, strategy, client=cluster3, run_dir=tmp_path, collective_timeout_s=LONG_TIMEOUT_S,
                          checkpoint_every_steps=every, checkpoint_every_s=None, min_workers=2, **settings)
    addresses = list(run.worker_addresses)
    assert len(addresses) == 3
    # A checkpoint taken and kept by every worker (rank 0's took it; the client sent it to the others).
    wait_until(lambda: run.checkpoint_info is not None and run.checkpoint_info["step"] >= every
               and run.checkpoint_info["kept_on"] == sorted(addresses), timeout_s=120)
    target = addresses[victim]
    os.kill(_pids(cluster3)[target], signal.SIGKILL)
    killed_at = time.time()

    try:
        run.wait(timeout=200)
    finally:  # shown when the test fails: who was lost, left or failed, and when
        print("membership after the kill:", _timeline(run, killed_at))
    lost = [e for e in run.events("worker-lost") if e["address"] == target]
    assert lost, "the lost worker is recorded in the metrics"
    regrouped = run.events("regrouped")
    assert len(regrouped) == 1 and list(regrouped[0]["lost"]) == [target]
    assert sorted(regrouped[0]["workers"]) == sorted(a for a in addresses if a != target)
    # Noticed at once, and the survivors regrouped soon after, whatever the (long) timeout: nobody waits
    # for a peer or a server shard known to be gone. Bounded by a share of that timeout, not by a second
    # or two: beside the session's other clusters on 2 cores a step alone can take that long, and how
    # long a recovery takes is a benchmark's figure, not a test's.
    assert lost[0]["time"] - killed_at < LONG_TIMEOUT_S / 4
    assert regrouped[0]["time"] - lost[0]["time"] < LONG_TIMEOUT_S / 4
    # The recovery's timed phases, in the records and the summary: from the lost worker's last step to the
    # new group's first, each phase between the records that end it (run/recovery.py).
    (recovered,) = run.events("recovered")
    assert list(recovered["lost"]) == [target] and recovered["generation"] == 1
    moments = recovered["moments"]
    assert moments["fault"] <= killed_at + 1 and moments["detected"] == lost[0]["time"]
    assert moments["agreed"] == regrouped[0]["time"]
    first_after = min(r["time"] for r in run.table.steps().to_dict("records") if r["time"] > regrouped[0]["time"])
    assert moments["agreed"] <= moments["restored"] <= moments["first_step"] and first_after <= moments["first_step"]
    assert sum(recovered["phases_s"].values()) == pytest.approx(recovered["total_s"], abs=0.01)
    assert run.summary()["recoveries"][0]["total_s"] == recovered["total_s"]
    print(f"{strategy}: {recovery.describe(recovered)}")
    # Every copy of a checkpoint went to its worker on its own, never through the scheduler's replication:
    # that holds a lock every broadcast scatter waits on, and retries a copy to a worker that died for
    # ever (a run killed mid-copy never regrouped, its next scatter waiting behind it).
    assert cluster3.run_on_scheduler(_count_replications, stop=True) == 0
    # No checkpoint crossed to the new group: every survivor starts from the copy it kept, whichever rank
    # was lost (rank 0's worker took it; the others were sent it as it was written).
    origins = {e["address"]: e["checkpoint"] for e in run.events("worker-started") if e["generation"] == 1}
    assert origins == {a: "kept" for a in regrouped[0]["workers"]}
    # The survivors left the broken group; none is recorded as failed.
    assert not run.events("worker-failed")
    left = {e["worker"] for e in run.events("worker-left") if e["generation"] == 0}
    assert left <= {r for r in range(3) if r != victim}
    # The run went on from its last checkpoint: what the group lost is at most one interval. In lockstep
    # that is the ranks' step; ranks at their own pace (the parameter-server strategies) are each at their
    # own, and the group's step is their mean, which rank 0 checkpoints by (its own lags: its worker also
    # serves the shard, 80 steps against the others' 185 once).
    first_group = [r for r in run.table.steps().to_dict("records") if r["time"] < regrouped[0]["time"]]
    last = {rank: max(r["step"] for r in first_group if r["worker"] == rank) + 1 for rank in range(3)}
    independent = strategy in ("async", "ssp", "easgd")
    reached = sum(last.values()) / 3 if independent else max(last.values())
    checkpoint_steps = sorted({e["step"] for e in run.events("checkpoint") if e["generation"] == 0})
    assert regrouped[0]["from_step"] == checkpoint_steps[-1]
    intervals = [b - a for a, b in zip([0] + checkpoint_steps, checkpoint_steps)]
    assert reached - regrouped[0]["from_step"] <= max(intervals + [every])
    if not independent:  # process-group strategies checkpoint at exact multiples
        assert all(step % every == 0 for step in checkpoint_steps)
    # The second group of 2 workers trained to the end, and the model is good.
    assert len(run.worker_addresses) == 2 and run.progress() == 1.0
    assert run.summary()["steps_done"] == run.total_steps  # not where the lost worker stopped
    assert _accuracy(run) >= 0.9
    on_disk = read_metrics(run.directory.path)
    assert any(r.get("kind") == "worker-lost" and r.get("address") == target for r in on_disk)
    wait_until(lambda: _no_process_groups(cluster3), timeout_s=30)


@pytest.mark.timeout(240)
def test_a_switch_asked_for_as_a_worker_dies_is_made_and_recorded_at_the_regroup(cluster3, tmp_path):
    cluster3.wait_for_workers(3, timeout=60)
    run = workbench.train(_digits_job(_slow_loss), "allreduce", client=cluster3, run_dir=tmp_path,
                          collective_timeout_s=LONG_TIMEOUT_S,
                          checkpoint_every_steps=20, checkpoint_every_s=None, min_workers=2)
    wait_until(lambda: run.checkpoint_info is not None and run.checkpoint_info["step"] >= 20, timeout_s=120)
    victim = run.worker_addresses[1]
    os.kill(_pids(cluster3)[victim], signal.SIGKILL)
    run.switch("average", period=2)  # the group is breaking up: no all-gather can agree on it any more
    assert run.wait(timeout=200) == "finished"
    switched = run.events("switched")
    assert switched and switched[-1]["to"] == "average" and switched[-1]["worker"] == 0
    assert run.table.steps()["strategy"].iloc[-1] == "average"
    assert not run.events("worker-failed")
    # The killed worker's restart is the `cluster3` fixture's to wait for (or to replace the cluster): a
    # wait here failed this test in CI when the restart took over 60 s (the nanny issue the fixture notes).


@pytest.mark.timeout(240)
def test_a_stuck_worker_is_found_within_the_timeout_measured_for_a_fast_run(cluster3, tmp_path):
    """No timeout given: measured (plane/deadline.py). Steps of a few ms lower it from the unmeasured 60 s
    to its 15 s floor on every rank; a worker that then hangs is lost within about 20 s, where the fixed
    minute took two minutes."""
    cluster3.wait_for_workers(3, timeout=60)
    armed, wake = tmp_path / "armed", tmp_path / "wake"
    job = _digits_job(functools.partial(_loss_stalling_on_rank_2, armed=str(armed), wake=str(wake)), epochs=20)
    run = workbench.train(job, "allreduce", client=cluster3, run_dir=tmp_path, checkpoint_every_steps=20,
                          checkpoint_every_s=None)
    stuck = run.worker_addresses[2]

    def every_rank_applied_a_measured_timeout():
        measured = {e["timeout_s"] for e in run.events("deadline") if e["how"] == "measured"}
        return sorted(e["worker"] for e in run.events("deadline-applied") if e["timeout_s"] in measured) == [0, 1, 2]

    wait_until(every_rank_applied_a_measured_timeout, timeout_s=60)
    in_force = run.timeout_in_force_s
    measured = [e for e in run.events("deadline") if e["how"] == "measured"][-1]
    assert measured["timeout_s"] == in_force == max(deadline.FLOOR_S, 10 * measured["longest_wait_s"]) < 30
    armed.touch()
    assert run.wait(timeout=200) == "finished"
    (lost,) = run.events("worker-lost")
    assert lost["address"] == stuck and lost["reason"] == f"stuck: no answer within {in_force:g} s"
    (regrouped,) = run.events("regrouped")
    stalled_at = max(r["time"] for r in run.table.steps().to_dict("records")
                     if r["worker"] == 2 and r["time"] < regrouped["time"])
    # The others' collective gives up after the timeout; the stuck one then gets a few of its longest
    # measured waits to leave (deadline.leave_within; the timeout is at least HEADROOM of them), not a
    # whole timeout more as it did (two timeouts: 30 s here).
    leave = max(deadline.LEAVE_FLOOR_S, deadline.LEAVE_HEADROOM * in_force / deadline.HEADROOM)
    assert regrouped["time"] - stalled_at < in_force + leave + 5
    assert stuck not in run.worker_addresses and len(run.worker_addresses) == 2
    # The new group starts under the unmeasured timeout, and measures its own.
    after = [e["how"] for e in run.events("deadline") if e["time"] >= regrouped["time"] - 1]
    assert after[:1] == ["unmeasured"] and "measured" in after, after
    assert sorted(e["worker"] for e in run.events("deadline-applied") if e["time"] > regrouped["time"]) == [0, 1]
    assert _accuracy(run) >= 0.9
    # It leaves once it wakes up, seeing its group was ended: the worker is free again.
    wake.touch()
    wait_until(lambda: _no_process_groups(cluster3), timeout_s=60)


@pytest.mark.timeout(240)
def test_workers_joining_mid_run_are_added_and_train(cluster3, tmp_path):
    cluster3.wait_for_workers(3, timeout=60)
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=16, epochs=10, lr=0.1,
                        momentum=0.9, loss=_slow_loss)
    run = workbench.train(job, "allreduce", client=cluster3, workers=2, run_dir=tmp_path, auto_join=True,
                          collective_timeout_s=TIMEOUT_S, checkpoint_every_s=None)
    idle = [a for a in present_workers(cluster3) if a not in run.worker_addresses]
    run.wait_for_step(20, timeout=60)
    cluster3.cluster.scale(4)  # a worker joins the cluster: added automatically
    wait_until(lambda: len(run.events("regrouped")) >= 1, timeout_s=60)
    joined = run.events("regrouped")[0]
    assert joined["reason"] == "workers joined" and len(joined["workers"]) == 3
    assert idle[0] not in joined["workers"], "only workers that joined are added automatically"
    wait_until(lambda: len(run.worker_addresses) == 3 and run.progress() > 0, timeout_s=60)
    added = run.add_workers()  # the idle worker, on request
    assert len(added) == 4 and idle[0] in added
    assert run.wait(timeout=200) == "finished"
    assert len(run.worker_addresses) == 4
    steps = run.table.steps()
    groups = run.events("generation-started")
    assert [len(g["workers"]) for g in groups] == [2, 3, 4]
    # The new ranks trained: their samples show in the throughput of the last group.
    last_start = groups[-1]["time"]
    late = steps[steps["time"] >= last_start]
    assert set(late["worker"]) == {0, 1, 2, 3} and (late.groupby("worker")["samples"].sum() > 0).all()
    rate = run.throughput(None)["per_worker"]
    assert rate.get(3, 0) > 0
    # No progress was lost at a join: each group starts where the previous one stopped.
    ends = [c["step"] for c in run.events("checkpoint") if c["final"]]
    assert [g["from_step"] for g in groups[1:]] == ends[:2]
    assert _accuracy(run) >= 0.9
    cluster3.cluster.scale(3)
    cluster3.wait_for_workers(3, timeout=60)


CRASHING_CLIENT = textwrap.dedent("""
    import sys, time, torch, workbench

    def slow_loss(outputs, targets):
        time.sleep(0.01)
        return torch.nn.functional.cross_entropy(outputs, targets)

    if __name__ == "__main__":
        client = workbench.connect(scheduler=sys.argv[1])
        job = workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=16, steps=300, lr=0.05,
                            loss=slow_loss)
        run = workbench.train(job, "average", client=client, workers=2, run_dir=sys.argv[2], name="crashed",
                              period=1, checkpoint_every_steps=25, checkpoint_every_s=None)
        print("started", flush=True)
        run.wait()
""")


@pytest.mark.timeout(300)
def test_a_run_whose_client_was_killed_resumes_to_the_same_weights(cluster3, tmp_path):
    cluster3.wait_for_workers(3, timeout=60)
    script = tmp_path / "crashing_client.py"
    script.write_text(CRASHING_CLIENT)
    run_dir = tmp_path / "crashed"
    process = subprocess.Popen([sys.executable, str(script), cluster3.scheduler.address, str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def far_enough():
            try:
                return checkpoints.load(run_dir)["step"] >= 100
            except workbench.ResumeError:
                return False

        wait_until(far_enough, timeout_s=120, interval_s=0.2)
    finally:
        process.kill()  # abruptly: no stop, no final checkpoint
        output = process.communicate(timeout=30)[0]
    crashed_at = checkpoints.load(run_dir)["step"]
    assert 100 <= crashed_at < 300, output
    # The orphaned workers notice their client is gone and leave, freeing the workers.
    wait_until(lambda: _no_process_groups(cluster3), timeout_s=30)

    resumed = workbench.resume(run_dir, client=cluster3, workers=2)
    assert resumed.run_id == "crashed" and resumed.wait(timeout=200) == "finished"
    assert resumed.events("generation-started")[-1]["from_step"] == crashed_at
    assert [e["from_step"] for e in resumed.events("run-resumed")] == [crashed_at]  # as the directory says

    job = cloudpickle.loads((run_dir / checkpoints.JOB_FILE).read_bytes())
    reference = workbench.train(job, "average", client=cluster3, workers=2, run_dir=tmp_path, period=1,
                                checkpoint_every_s=None)
    assert reference.wait(timeout=200) == "finished"
    expected, found = reference.model().state_dict(), resumed.model().state_dict()
    assert all(torch.equal(expected[name], found[name]) for name in expected), "weights differ after resume"
    # One metrics history in the run directory: the crashed part, the resume, and the rest.
    records = read_metrics(run_dir)
    kinds = [r.get("kind") for r in records]
    assert kinds.count("run-started") == 1 and kinds.count("run-resumed") == 1
    steps = {r["step"] for r in records if r.get("kind") == "step"}
    assert steps == set(range(300))


@pytest.mark.timeout(240)
def test_a_stopped_run_resumes_on_another_number_of_workers(cluster3, tmp_path):
    cluster3.wait_for_workers(3, timeout=60)
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=16, steps=240, lr=0.1,
                        momentum=0.9, loss=_slow_loss)
    first = workbench.train(job, "average", client=cluster3, workers=2, run_dir=tmp_path, period=2,
                            checkpoint_every_s=None)
    first.wait_for_step(60, timeout=60)
    first.stop()
    assert first.wait(timeout=60) == "stopped"
    stopped_at = checkpoints.load(first.directory.path)["step"]
    assert 60 <= stopped_at < 240
    resumed = workbench.resume(first.directory.path, client=cluster3, workers=3)
    assert resumed.wait(timeout=200) == "finished" and len(resumed.worker_addresses) == 3
    steps = resumed.table.steps()
    later = steps[steps["time"] >= resumed.events("generation-started")[-1]["time"]]
    assert set(later["worker"]) == {0, 1, 2} and later["step"].min() == stopped_at and later["step"].max() == 239
    assert resumed.settings["period"] == 2 and resumed.strategy == "average"
    assert _accuracy(resumed) >= 0.9


@pytest.mark.timeout(180)
def test_an_exploding_learning_rate_stops_the_run_and_keeps_the_last_good_checkpoint(client, tmp_path):
    job = workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=16, steps=5000, lr=0.05,
                        loss=_slow_loss)
    run = workbench.train(job, "allreduce", client=client, run_dir=tmp_path, checkpoint_every_steps=10,
                          checkpoint_every_s=None, collective_timeout_s=TIMEOUT_S)
    wait_until(lambda: run.checkpoint_info is not None and run.checkpoint_info["step"] >= 20, timeout_s=60)
    run.set_lr(1e38)  # the next updates overflow float32: infinite activations, then a NaN loss
    with pytest.raises(workbench.DivergenceError) as caught:
        run.wait(timeout=120)
    message = str(caught.value)
    assert "diverged" in message and "at step" in message and "on worker" in message
    assert "last good checkpoint" in message
    kept = checkpoints.load(run.directory.path)
    assert checkpoints.all_finite(kept["weights"]) and kept["step"] >= 20
    model = job.model()
    model.load_state_dict(kept["weights"])
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert run.status == "failed"
    wait_until(lambda: _no_process_groups(client), timeout_s=30)


INTERRUPTED = textwrap.dedent("""
    import json, os, signal, threading, workbench

    if __name__ == "__main__":
        client = workbench.connect(workers=2, dashboard_address=":0")
        job = workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=16, steps=100000, lr=0.05)
        run = workbench.train(job, "async", client=client, run_dir=os.environ["RUN_DIR"], checkpoint_every_s=None)
        run.wait_for_step(20, timeout=60)
        threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()  # Ctrl-C in the notebook
        try:
            run.wait(timeout=120)
            outcome = "not interrupted"
        except KeyboardInterrupt:
            outcome = "interrupted"
        groups = client.run(lambda: __import__("torch").distributed.is_initialized())
        print(json.dumps({"outcome": outcome, "status": run.status, "process_groups": list(groups.values()),
                          "processing": sum(len(v) for v in client.processing().values()),
                          "checkpoint": run.checkpoint_info is not None}))
        workbench.shutdown(client)
""")


@pytest.mark.timeout(180)
def test_an_interrupted_wait_stops_the_run_and_leaves_nothing_behind(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(INTERRUPTED)
    # The script's Ctrl-C must reach it (ignored, run.wait ran into its timeout and the script printed nothing).
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170,
                            env={**os.environ, "RUN_DIR": str(tmp_path)},
                            preexec_fn=ctrl_c_at_default)
    # What went wrong first is at the head of stderr, what it led to at its tail.
    assert result.stdout.strip(), (f"the script printed nothing (exit {result.returncode}): "
                                   f"{result.stderr[:4000]}\n...\n{result.stderr[-2000:]}")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"outcome": "interrupted", "status": "stopped", "process_groups": [False, False],
                      "processing": 0, "checkpoint": True}, result.stderr[-3000:]


@pytest.mark.timeout(200)
def test_the_command_line_resumes_a_stopped_run(tmp_path, capsys):
    run_dir = tmp_path / "runs"
    command = [sys.executable, "-m", "workbench", "train", "--steps", "40", "--no-progress", "--run-dir",
               str(run_dir), "--strategy", "average", "--checkpoint-every-steps", "10"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=190)
    assert first.returncode == 0, first.stderr[-2000:]
    (directory,) = [d for d in run_dir.iterdir() if d.is_dir()]
    assert checkpoints.load(directory)["step"] == 40
    again = subprocess.run([sys.executable, "-m", "workbench", "train", "--resume", str(directory), "--no-progress"],
                           capture_output=True, text=True, timeout=190)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "finished" in again.stdout
    kinds = [r.get("kind") for r in read_metrics(directory)]
    assert kinds.count("run-resumed") == 1
    # A run directory that is not there: one line, exit code 2 (the command's own main, in this process).
    code, lines = cli_in_process(["train", "--resume", str(tmp_path / "nope")], capsys)
    assert code == 2 and len(lines) == 1 and "run_dir=" in lines[0], lines
