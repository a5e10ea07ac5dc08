"""A cluster a team shares: runs hold their workers by lease, so that no run ever starts on another's.

A cluster started with the `dask` commands (3 workers) and teammates as their own client processes
(tests/cluster/teammate.py), started at the same moment through a Dask Event, round after round (races hide);
runs side by side, the queue, and a lease that ends with its SIGKILLed client.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from distributed import Event, Queue, Variable

import workbench
from widgets.control_panel import ControlPanel
from workbench.cluster import leases

from helpers import dask_cluster_on_loopback, end_processes, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

TEAMMATE = str(Path(__file__).with_name("teammate.py"))
# The scheduler of the last test cannot import this file: its functions travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
ROUNDS = 6  # the last one queues instead of refusing


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory):
    with dask_cluster_on_loopback(tmp_path_factory.mktemp("shared"), workers=3) as address:
        yield address


@pytest.fixture(scope="module")
def client(scheduler):
    client = workbench.connect(scheduler=scheduler)
    client.wait_for_workers(3, timeout=60)
    yield client
    client.close()


@pytest.fixture
def free_cluster(client):
    """Every worker present and free before and after the test (a failed test releases its leases)."""
    client.wait_for_workers(3, timeout=60)
    wait_until(lambda: len(leases.view(client)["free"]) == 3, timeout_s=60, interval_s=0.2)
    yield client


def teammates(scheduler, names, rounds, run_dir, tag):
    return [subprocess.Popen([sys.executable, TEAMMATE, scheduler, name, str(rounds), str(run_dir), tag],
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            for name in names]


class Outcomes:
    """What the teammates report on their Dask Queue, taken by kind (in the order they came)."""

    def __init__(self, client, tag):
        self.queue, self.pending = Queue(f"{tag}-outcomes", client=client), []

    def take(self, kind, count):
        got = [item for item in self.pending if item["kind"] == kind][:count]
        self.pending = [item for item in self.pending if not any(item is g for g in got)]
        while len(got) < count:
            item = self.queue.get(timeout=180)
            (got if item["kind"] == kind else self.pending).append(item)
        return got


def short_job(epochs=1):
    return workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=8, epochs=epochs)


def test_teammates_starting_at_the_same_moment_never_collide(free_cluster, scheduler, tmp_path):
    client = free_cluster
    outcomes = Outcomes(client, "race")
    processes = teammates(scheduler, ["alice", "bob"], ROUNDS, tmp_path, "race")
    try:
        outcomes.take("ready", 2)
        for index in range(ROUNDS):
            last = index == ROUNDS - 1
            Variable(f"race-round-{index}", client=client).set({"workers": 2, "queue": last, "epochs": 1,
                                                                "last": last})
            Event(f"race-go-{index}", client=client).set()
            starts = {o["name"]: o for o in outcomes.take("start", 2)}
            winners = [o for o in starts.values() if o["outcome"] == "running"]
            assert len(winners) == 1, starts  # exactly one holds the two workers
            (loser,) = [o for o in starts.values() if o is not winners[0]]
            if not last:
                # Refused at once, naming `workers`, the free count and who holds the others.
                assert loser["outcome"] == "refused", starts
                assert loser["error"].startswith("workers=2 is not allowed: expected at most 1, the free workers")
                assert f"run {winners[0]['run_id']} ({winners[0]['name']}) holds" in loser["error"]
                ends = outcomes.take("end", 1)
            else:
                assert loser["outcome"] == "queued" and loser["position"] == 1, starts
                ends = outcomes.take("end", 2)
            # The run that was there first was not harmed: it trained every step on its two workers.
            for end in ends:
                assert end["status"] == "finished" and len(end["workers"]) == 2, end
                assert end["steps"] == end["total_steps"]
        first, second = sorted(ends, key=lambda end: end["queued_s"])
        # The queued one waited for the first to end (seconds of training), then started on its own.
        assert second["queued_s"] > 0.5 and first["queued_s"] < second["queued_s"] / 2
        assert min(first["accuracy"], second["accuracy"]) >= 0.8
        for process in processes:
            assert process.wait(timeout=60) == 0
    finally:
        end_processes(processes)


def test_runs_side_by_side_and_joins_and_resumes_take_only_free_workers(free_cluster, tmp_path):
    client = free_cluster
    two = workbench.train(short_job(epochs=20), "allreduce", client=client, workers=2, run_dir=tmp_path)
    two.pause()  # holds its two workers, paused, while the checks below run: nothing depends on timing
    one = workbench.train(short_job(epochs=3), "allreduce", client=client, workers=1, run_dir=tmp_path)
    (other,) = one.config["workers"]
    resumed = None
    try:
        # Growing into workers: none is free, and the one asked for by name is another run's.
        assert two.add_workers() == two.config["workers"] and not two.events("regrouped")
        with pytest.raises(workbench.ConfigError, match=f"Held: {other} by run {one.run_id}"):
            two.add_workers([other])
        assert one.wait(120) == "finished" and one.summary()["steps_done"] == one.total_steps
        assert not set(two.config["workers"]) & set(one.config["workers"])
        # A resume asks for free workers like any run: refused while they are held, or queued.
        with pytest.raises(workbench.ConfigError, match=f"run {two.run_id} .* holds"):
            workbench.resume(one.directory.path, client=client, workers=2)
        resumed = workbench.resume(one.directory.path, client=client, workers=2, queue=True)
        assert resumed.status == "queued"
        # Both side-by-side runs finish, every step done; the queued resume then starts on freed workers.
        two.resume()
        assert two.wait(120) == "finished" and two.summary()["steps_done"] == two.total_steps
        assert not two.events("regrouped")
        assert resumed.wait(120) == "finished" and resumed.events("run-resumed")
    finally:
        two.interrupt(5)
        if resumed is not None:
            resumed.interrupt(5)
    assert len(leases.view(client)["free"]) == 3  # every run gave its workers back as it ended


def test_the_queue_keeps_its_order_shows_places_and_starts_runs_as_workers_free(free_cluster, scheduler, tmp_path):
    client = free_cluster
    first = workbench.train(short_job(epochs=400), "allreduce", client=client, workers=3, run_dir=tmp_path)
    command = None
    try:
        waiting = workbench.train(short_job(), "allreduce", client=client, workers=2, queue=True, run_dir=tmp_path)
        later = workbench.train(short_job(), "allreduce", client=client, workers=1, queue=True, run_dir=tmp_path)
        assert (waiting.status, waiting.queue_position, later.status, later.queue_position) == \
            ("queued", 1, "queued", 2)
        # A teammate's command line joins the queue too, and says where it stands.
        command = subprocess.Popen(
            [sys.executable, "-m", "workbench", "train", "--scheduler", scheduler, "--workers", "1", "--queue",
             "--dataset", "digits", "--epochs", "1", "--no-progress", "--run-dir", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        said = []  # the command's lines on stderr, as it says them
        reader = threading.Thread(target=lambda: said.extend(command.stderr), daemon=True)
        reader.start()
        wait_until(lambda: len(leases.view(client)["queue"]) == 3, timeout_s=60, interval_s=0.1)
        view = leases.view(client)
        assert [w["run_id"] for w in view["queue"]][:2] == [waiting.run_id, later.run_id]
        assert set(view["runs"][first.run_id]["workers"]) == set(first.config["workers"])
        with pytest.raises(workbench.TrainingError, match="waits for 2 free workers .place 1 in the queue"):
            waiting.set_lr(0.01)
        # The notebook panel says where the run stands, and offers only to leave the queue.
        panel = ControlPanel(waiting)
        try:
            assert panel.progress_text.value.startswith("waits for 2 free workers (place 1 in the queue; run ")
            assert "queued" in panel.title.value and not panel.stop_button.disabled
            assert all(w.disabled for w in (panel.pause_button, panel.switch_button, panel.lr_slider))
        finally:
            panel.close()
        with pytest.raises(workbench.ConfigError, match=r"3 run\(s\) wait for workers ahead"):
            workbench.train(short_job(), "allreduce", client=client, workers=1, run_dir=tmp_path)
        later.stop()  # leaves the queue without ever starting
        assert later.wait(30) == "stopped" and later.directory is None
        assert [w["run_id"] for w in leases.view(client)["queue"]][:1] == [waiting.run_id]
        # The command line says it moved up (it asks twice a second) before the workers free.
        wait_until(lambda: any("(place 2 in the queue" in line for line in said), timeout_s=30, interval_s=0.1)
        first.wait_for_step(5)
        stopping = time.time()
        first.stop()
        assert first.wait(60) == "stopped"
        # The two waiting runs (two workers, then one) start on the three freed workers, side by side.
        assert waiting.wait(120) == "finished"
        assert waiting.events("run-started")[0]["time"] >= stopping and waiting.config["queued_s"] > 0
        command.wait(timeout=180)  # what it prints on stdout is a few lines: no pipe fills up
        out = command.stdout.read()
        reader.join(timeout=30)
        err = "".join(said)
        assert command.returncode == 0, err
        assert "waits for 1 free workers (place 3 in the queue; run " in err and "finished" in out
    finally:
        first.interrupt(5)
        if command is not None:
            end_processes([command])


def test_a_lease_ends_with_its_sigkilled_client_and_the_workers_train_the_next_run(free_cluster, scheduler,
                                                                                       tmp_path):
    client = free_cluster
    outcomes = Outcomes(client, "kill")
    (process,) = teammates(scheduler, ["mallory"], 1, tmp_path, "kill")
    try:
        outcomes.take("ready", 1)
        Variable("kill-round-0", client=client).set({"workers": 3, "queue": False, "epochs": 400, "last": False})
        Event("kill-go-0", client=client).set()
        (started,) = outcomes.take("start", 1)
        assert started["outcome"] == "running"
        wait_until(lambda: started["run_id"] in leases.view(client)["runs"], timeout_s=10, interval_s=0.1)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        # The scheduler notices the closed connection: the lease ends, and the workers leave that run.
        wait_until(lambda: len(leases.view(client)["free"]) == 3, timeout_s=30, interval_s=0.1)
        run = workbench.train(short_job(), "allreduce", client=client, workers=3, run_dir=tmp_path)
        assert run.wait(120) == "finished" and run.summary()["steps_done"] == run.total_steps
    finally:
        end_processes([process])


def test_a_scheduler_that_cannot_import_the_workbench_still_keeps_the_leases(tmp_path):
    # A stock scheduler image: `import workbench` fails there. The lease book travels by value.
    scheduler_file = tmp_path / "scheduler.json"
    code = ("import sys; sys.modules['workbench'] = None; sys.argv = ['dask-scheduler', '--host', '127.0.0.1', "
            f"'--port', '0', '--dashboard-address', ':0', '--scheduler-file', {str(scheduler_file)!r}]; "
            "from distributed.cli.dask_scheduler import main; main()")
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: scheduler_file.exists() and scheduler_file.read_text().strip(), timeout_s=60, interval_s=0.1)
        client = workbench.connect(scheduler=json.loads(scheduler_file.read_text())["address"])
        try:
            assert client.run_on_scheduler(_imports_workbench) is False
            assert leases.acquire(client, "r", "alice", 1, True)["state"] == "impossible"  # no workers yet
            assert leases.view(client) == {"workers": {}, "free": [], "runs": {}, "queue": []}
        finally:
            client.close()
    finally:
        end_processes([process])


def _imports_workbench(dask_scheduler=None):
    try:
        import workbench  # noqa: F401
        return True
    except ImportError:
        return False
