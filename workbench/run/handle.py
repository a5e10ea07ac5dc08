"""The run handle: what `train()` returns and a user calls, over the pieces that each do one job.

`train()` / `resume()` check the job and options on the client and start a `Run`. The handle validates,
takes workers (`run/placement.py`: free workers, or a place in the cluster's queue), writes the run
directory, and hands on: `run/launcher.py` starts each group of workers, `run/supervisor.py` watches them (its
decisions are `run/regroup.py`'s), `run/feed.py` takes the metrics in, `run/checkpoints.py` keeps checkpoints,
`run/requests.py` serves other clients' requests, `run/lifecycle.py` owns the status and `run/views.py`
renders summary and snapshot, `run/controls.py` what a user changes (pause, resume, stop, learning rate,
settings, switch, checkpoint, add workers). What stays here: starting, waiting, a rerun.
"""
from __future__ import annotations

import dataclasses
import datetime
import getpass
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import cloudpickle
import torch
from distributed import Client

from workbench.checks import check_run_options
from workbench.cluster import membership
from workbench.data import DaskArrayData
from workbench.errors import ConfigError, DivergenceError, ResumeError, TrainingError
from workbench.job import Job, PreparedJob
from workbench.plane import checkpoint_format as checkpoints, deadline, kinds
from workbench.plane.control import ControlState, ControlWriter
from workbench.plane.metrics import MetricsTable, topic
from workbench.plane.rundir import CONFIG_FILE, RunDirectory, atomic_write, read_metrics
from workbench.run.autopilot import AUTO, START as AUTO_START, AutoPilot, check_no_settings
from workbench.run.checkpoints import CheckpointStore
from workbench.run.controls import RunControls
from workbench.run.export import Exports, check_export_options
from workbench.run.feed import RunFeed, announce
from workbench.run.health import LinkWatch, LossWatch
from workbench.run.launcher import check_world, resolve_client, wanted_workers
from workbench.run.lifecycle import Lifecycle
from workbench.run.placement import Placement
from workbench.run.requests import RequestServer
from workbench.run.supervisor import Supervisor
from workbench.run.views import RunViews, paced_by_slowest
from workbench.strategies import get_strategy, make_settings
from workbench.worker.host import describe_device

MAX_SAVED_JOB_BYTES = 64 * 2**20  # a job (with its data) larger than this is not saved for resume()

def train(job: Job, strategy: str = "allreduce", *, client: Client | None = None, workers: int | None = None,
          run_dir: str | Path = "runs", name: str | None = None, collective_timeout_s: float | None = None,
          start: bool = True, owner: str | None = None, checkpoint_every_steps: int | None = None,
          checkpoint_every_s: float | None = 60.0, min_workers: int = 1, auto_join: bool = False,
          queue: bool = False, tensorboard: bool | str = False, mlflow: bool | str = False,
          **settings: Any) -> Run:
    """Start training `job` on the cluster behind `client` and return its `Run` at once (non-blocking).

    strategy: a name from `workbench.STRATEGIES`; `settings` are that strategy's settings (e.g. period=4).
    workers: how many of the cluster's workers train (default: all). On a shared cluster a run takes
    free workers only (those no other run holds); when too few are free it is refused at once, naming
    who holds the others, unless `queue`.
    queue: wait for enough free workers instead, first come first served: the run returns at once with
    status 'queued' (its place in `run.queue_position`) and starts when its workers are free.
    run_dir: parent directory of the run's own directory (config, metrics, checkpoint, weights).
    collective_timeout_s: the longest any wait on another worker may take; a worker silent for longer is
    treated as lost. None (the default): measured, ten times the longest step or exchange of the running
    strategy within 15 s and 30 min (60 s until measured, and again after a switch or a regroup); the
    timeout in force is `run.timeout_in_force_s`, and each change is a 'deadline' event.
    checkpoint_every_steps / checkpoint_every_s: how often a checkpoint is written (None: never by that
    rule); a run also keeps one when it ends. `workbench.resume(run_directory)` goes on from it.
    min_workers: a run that loses workers goes on with the survivors from its last checkpoint, unless
    fewer than this many are left.
    auto_join: workers joining the cluster during the run are added to it (else: `run.add_workers()`).
    start: False returns the run unstarted, for `run.start()` later (or the panel's Start button).
    tensorboard: export live to TensorBoard event files: True puts them in the run's directory
    (`tensorboard --logdir runs` compares runs), a directory puts them in a subdirectory per run there.
    mlflow: export live to MLflow: True uses `MLFLOW_TRACKING_URI`, else MLflow's own local default
    (`sqlite:///mlflow.db` in the working directory); a string is the tracking URI. The experiment is
    `MLFLOW_EXPERIMENT_NAME` (default "workbench").
    owner: who the run belongs to (default: the operating-system user); on a team dashboard with
    authentication, this user and the listed admins may control the run.
    In a notebook the run displays as its control panel.
    """
    run = Run(job, strategy, client=client, workers=workers, run_dir=run_dir, name=name,
              collective_timeout_s=collective_timeout_s, settings=settings, owner=owner,
              checkpoint_every_steps=checkpoint_every_steps, checkpoint_every_s=checkpoint_every_s,
              min_workers=min_workers, auto_join=auto_join, queue=queue, tensorboard=tensorboard,
              mlflow=mlflow)
    if start:
        run.start()
    return run


def resume(run_dir: str | Path, *, client: Client | None = None, workers: int | None = None,
           job: Job | None = None, start: bool = True, **options: Any) -> Run:
    """Go on with a stopped or crashed run from the checkpoint in its directory, on `workers` workers
    (default: all of the cluster's; the same number or another). Its metrics continue in that directory.

    job: the run's job, when the directory holds none (jobs whose data could not be saved with it).
    options: train() options to change (collective_timeout_s, checkpoint_every_steps, min_workers, ...).
    A run exported to TensorBoard or MLflow goes on in the same event directory and MLflow run.
    """
    path = Path(run_dir) if isinstance(run_dir, (str, Path)) else None
    if path is None or not path.is_dir():
        raise ResumeError("run_dir", run_dir, "the directory of an earlier run (holding config.json)")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError) as error:
        raise ResumeError("run_dir", str(run_dir), f"a run directory with a readable {CONFIG_FILE}",
                          f"{type(error).__name__}: {error}") from None
    saved = checkpoints.load(path)
    if job is None:
        try:
            job = cloudpickle.loads((path / checkpoints.JOB_FILE).read_bytes())
        except Exception as error:
            raise ResumeError("job", None, f"the run's job, saved as {checkpoints.JOB_FILE} or passed as job=",
                              f"Reading {path / checkpoints.JOB_FILE} failed ({type(error).__name__}); pass the "
                              "Job that started the run") from None
    if not isinstance(job, Job):
        raise ConfigError("job", job, "a workbench.Job")
    job.prepare()
    torch.manual_seed(job.seed)
    checkpoints.check_matches_model(saved, job.model(), str(path / checkpoints.CHECKPOINT_FILE))
    known = {"collective_timeout_s", "checkpoint_every_steps", "checkpoint_every_s", "min_workers", "auto_join",
             "owner", "queue", "tensorboard", "mlflow"}
    for key in options:
        if key not in known:
            raise ConfigError(key, options[key], f"one of {', '.join(sorted(known))}",
                              "The strategy and its settings are the checkpoint's; switch() after resuming")
    previous = config.get("fault_tolerance", {})
    merged = {"collective_timeout_s": config.get("collective_timeout_s", 60.0),
              "checkpoint_every_steps": previous.get("checkpoint_every_steps"),
              "checkpoint_every_s": previous.get("checkpoint_every_s", 60.0),
              "min_workers": previous.get("min_workers", 1), "auto_join": previous.get("auto_join", False),
              "owner": config.get("owner"),
              "tensorboard": bool(config.get("export", {}).get("tensorboard")),
              "mlflow": bool(config.get("export", {}).get("mlflow")), **options}
    run = Run(job, saved["strategy"], client=client, workers=workers, run_dir=path.parent, name=path.name,
              settings=dict(saved["settings"]), resume_from=saved, exported=config.get("export"), **merged)
    if start:
        run.start()
    return run


class Run(RunControls, RunViews):
    """A training run: status, live metrics, control, checkpoints, and the trained model.

    Its attributes are the run's record, which the pieces it hands on to read and write: the current
    `group` of workers, `error`, `final_weights`, the `feed` of metrics, the `checkpoints`.
    """

    def __init__(self, job: Job, strategy: str, *, client: Client | None, workers: int | None,
                 run_dir: str | Path, name: str | None, collective_timeout_s: float | None,
                 settings: dict[str, Any], step_delays: dict[int, float] | None = None,
                 sample_delays: dict[int, float] | None = None,
                 owner: str | None = None, checkpoint_every_steps: int | None = None,
                 checkpoint_every_s: float | None = 60.0, min_workers: int = 1, auto_join: bool = False,
                 resume_from: dict[str, Any] | None = None, queue: bool = False, tensorboard: bool | str = False,
                 mlflow: bool | str = False, exported: dict[str, Any] | None = None) -> None:
        if owner is not None and (not isinstance(owner, str) or not owner.strip()):
            raise ConfigError("owner", owner, "a non-empty user name, or None for the operating-system user")
        self.owner = owner or _system_user()
        self.job = job
        self.strategy = strategy
        self.client = client
        self._requested_workers = workers
        self._settings_values = dict(settings)
        self._run_root = run_dir
        self._name = name
        self.collective_timeout_s = collective_timeout_s  # the user's; None: measured (`timeout_in_force_s`)
        self.step_delays = step_delays or {}  # test hooks: ranks made slow per step, or per sample
        self.sample_delays = sample_delays or {}
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_s = checkpoint_every_s
        self.min_workers = min_workers
        self.auto_join = auto_join
        self.queue = queue
        check_export_options(tensorboard, mlflow)
        self.tensorboard, self.mlflow = tensorboard, mlflow  # exports, opened once the run has its directory
        self._exported = exported  # where a resumed run's exports went
        self.exports: Exports | None = None
        self._resume_from = resume_from
        self.lifecycle = Lifecycle()
        self.table = MetricsTable()
        self.feed = RunFeed(self.table)
        self.checkpoints = CheckpointStore(resume_from, checkpoint_every_s)
        self.remote_control = RequestServer(self)
        self.supervisor = Supervisor(self)
        # Groups are counted on from a resumed run's (after a loss or a join the workers regroup).
        self._generation_before = resume_from.get("generation", 0) if resume_from else -1
        self.ended = threading.Event()  # set once the run has ended and everything is written
        self.directory: RunDirectory | None = None
        self.config: dict[str, Any] = {}
        self.prepared: PreparedJob | None = None
        self.placement: Placement | None = None  # the workers this run holds on the cluster
        self.control: ControlWriter | None = None
        self.stop_watching: Any = None
        self.stop_requested = False
        self.auto_pilot: AutoPilot | None = None  # strategy='auto': chooses and switches while the run trains
        self._panel: Any = None  # the notebook control panel, made when the run is first displayed

    # --- starting -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Validate everything, then start the workers; returns at once."""
        if self.status != "created":
            raise TrainingError(f"run {self.run_id} was started already ({self.status}); use rerun() for another")
        prepared = self.prepared = self.job.prepare()
        if self.strategy == AUTO:  # starts with allreduce; the autopilot switches from there
            check_no_settings(self._settings_values)
            self.strategy, self.auto_pilot = AUTO_START, AutoPilot(0)
        strategy_class = get_strategy(self.strategy)
        settings = self._start_settings = make_settings(self.strategy, self._settings_values)
        check_run_options(self.collective_timeout_s, self.checkpoint_every_steps, self.checkpoint_every_s,
                          self.min_workers, self.auto_join, self.queue)
        client = self.client = resolve_client(self.client)
        wanted = wanted_workers(client, self._requested_workers)
        # Everything the number of workers decides is checked now, not after a wait in the queue.
        check_world(prepared, strategy_class, settings, wanted, self.min_workers)
        if self.auto_pilot is not None:
            self.auto_pilot.chooser.workers = wanted
            self.auto_pilot.chooser.can_balance = not isinstance(prepared.train, DaskArrayData)
        self.run_id = self._name or (f"{self.strategy}-{datetime.datetime.now():%Y%m%d-%H%M%S}-"
                                     f"{uuid.uuid4().hex[:6]}")
        self.placement = Placement(client, self.run_id, self.owner)
        self._requested_at = time.time()
        addresses = self.placement.request(wanted, self.queue)
        if addresses is None:  # waits in the queue: the supervisor starts it when its workers are free
            self.lifecycle.move("queued")
            self.announce(kinds.RUN_QUEUED, owner=self.owner, world_size=wanted, queued=self._requested_at,
                          position=self.placement.position, waiting=self.waiting())
        else:
            try:
                self.begin(addresses)
            except BaseException:
                self.placement.give_back()
                raise
        self.supervisor.start()

    def begin(self, addresses: list[str]) -> None:
        """Start training on `addresses`, the workers the run holds: run directory, topics, control, tasks."""
        client, prepared, settings = self.client, self.prepared, self._start_settings
        resumed = self._resume_from is not None
        self.directory = RunDirectory(Path(self._run_root) / self.run_id)
        if resumed:  # the earlier history first, so that views of this run show all of it
            self.table.add(read_metrics(self.directory.path))
        described = client.run(describe_device, prepared.job.device, workers=addresses)
        self.config = {
            "run_id": self.run_id, "strategy": self.strategy, "settings": dataclasses.asdict(settings),
            "job": prepared.job.describe(), "workers": addresses, "world_size": len(addresses),
            "parameters": prepared.n_parameters, "data": prepared.data_info, "scheduler": client.scheduler.address,
            "started": time.time(), "owner": self.owner, "directory": str(self.directory.path.resolve()),
            "collective_timeout_s": self.collective_timeout_s,  # None: measured, `deadline` below
            "deadline": deadline.policy(self.collective_timeout_s),
            "fault_tolerance": {"checkpoint_every_steps": self.checkpoint_every_steps,
                                "checkpoint_every_s": self.checkpoint_every_s, "min_workers": self.min_workers,
                                "auto_join": self.auto_join},
            "queued_s": round(time.time() - self._requested_at, 3),  # waiting for free workers
            "auto": self.auto_pilot is not None,
            # What each worker trains on, by rank (the GPU's name as CUDA reports it).
            "devices": [described.get(address) for address in addresses],
        }
        if resumed:
            self.config["resumed_from_step"] = self._resume_from["step"]
        self.exports = self.feed.exports = Exports.open(self.tensorboard, self.mlflow, self.config,
                                                        self.directory.path, self._exported)
        self.checkpoints.open(self.directory.path, self.feed.publish)
        self.directory.write_json(CONFIG_FILE, self.config)
        if not resumed:
            self._save_job()
        beginning = [{"kind": kinds.RUN_RESUMED if resumed else kinds.RUN_STARTED, "time": time.time(),
                      "strategy": self.strategy, "settings": dataclasses.asdict(settings),
                      **({"from_step": self._resume_from["step"]} if resumed else {})}]
        self.directory.append(beginning)
        self.table.add(beginning)  # run.events() shows what the run directory holds
        if self.exports is not None:
            self.exports.put(beginning)

        self.feed.open(client, self.run_id, self.directory)
        self.feed.on_checkpoint_ready = self.checkpoints.ready
        client.subscribe_topic(topic(self.run_id), self.feed.on_message)
        self.remote_control.start(client, self.run_id)
        lr = self._resume_from["lr"] if resumed else self.job.lr
        self.control = ControlWriter(client, self.run_id, ControlState(
            lr=lr, strategy=self.strategy, settings=dataclasses.asdict(settings)))
        self.stop_watching = membership.watch(client, self.supervisor.members.roster.heard)
        self.supervisor.start_group(addresses, self._resume_from)
        self.config.update(shard_samples=self.group.shard_samples, total_steps=self.total_steps)
        # A dense float32 gradient: what allreduce would send (the link watch's yardstick).
        self.feed.link_watch = LinkWatch(model_bytes=4 * prepared.n_parameters, batch=self.job.batch_size,
                                         limit=lambda fewest: self.table.link_limit(paced_by_slowest, fewest))
        self.feed.loss_watch = LossWatch(self.total_steps, first_step=self._resume_from["step"] if resumed else 0,
                                         strategy=self.strategy, momentum=self.job.momentum)
        self.directory.write_json(CONFIG_FILE, self.config)
        self.lifecycle.move("running")
        self.announce(kinds.RUN_REGISTERED, **json.loads(json.dumps(self.config, default=str)))
        threading.Thread(target=self.checkpoints.write_ready, name=f"workbench-checkpoints-{self.run_id}",
                         args=(client, self.run_id, self.timeout_in_force_s, self._group_now), daemon=True).start()

    def _group_now(self) -> tuple[int, list[str]]:
        """The group training now and its workers' addresses, rank 0 first (none before any)."""
        return self.generation, list(self.worker_addresses) if self.group and self.group.futures else []

    def _save_job(self) -> None:
        """The job beside its checkpoint, so that `resume(run_dir)` needs nothing else (when it fits)."""
        try:
            pickled = cloudpickle.dumps(self.job)
        except Exception:
            return  # resume() then asks for job=
        if len(pickled) <= MAX_SAVED_JOB_BYTES:
            atomic_write(self.directory.path / checkpoints.JOB_FILE, lambda handle: handle.write(pickled))

    def announce(self, kind: str, **fields: Any) -> None:
        """Tell every client on the cluster (the team dashboard) about this run: registered, or a new status."""
        announce(self.client, {"kind": kind, "run_id": self.run_id, "status": self.status, "strategy": self.strategy,
                               "time": time.time(), **fields})

    # --- waiting --------------------------------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends (or `timeout` seconds pass: TimeoutError); raise TrainingError if it failed."""
        if self.supervisor.thread is None:
            raise TrainingError("the run was never started")
        try:
            # An Event, not Thread.join: a join interrupted by Ctrl-C can leave the thread looking ended.
            self.ended.wait(timeout)
        except KeyboardInterrupt:
            # Interrupting the wait (Ctrl-C, the notebook's stop button) ends the run: workers stop
            # cleanly if they can, else leave at once; nothing keeps training behind the user's back.
            self.interrupt()
            raise
        if not self.ended.is_set():
            raise TimeoutError(f"run {self.run_id} still {self.status} after {timeout} s")
        if self.status == "failed":
            error_type = DivergenceError if self.diverged else TrainingError
            raise error_type(f"run {self.run_id} failed:\n{self.error}")
        return self.status

    def interrupt(self, grace_s: float | None = None) -> str:
        """Stop the run now: cleanly within `grace_s` (default: the collective timeout), else end the
        workers' tasks at once. Returns the final status."""
        if self.supervisor.thread is None or self.done:
            return self.status
        grace_s = self.timeout_in_force_s if grace_s is None else grace_s
        self.stop()
        if not self.ended.wait(grace_s):
            self.supervisor.members.regroup_to = None
            self.supervisor.end_group()
            self.ended.wait(self.timeout_in_force_s + 35)
        return self.status

    def rerun(self, strategy: str | None = None, **settings: Any) -> Run:
        """Start a new run of the same job on the same cluster (this run's strategy and settings unless
        given), in the same parent run directory."""
        if strategy is None and self.auto_pilot is not None:
            strategy = AUTO
        elif strategy is None:
            strategy, settings = self.strategy, {**self.settings, **settings}
        return train(self.job, strategy, client=self.client, workers=self._requested_workers,
                     run_dir=self._run_root, collective_timeout_s=self.collective_timeout_s,
                     checkpoint_every_steps=self.checkpoint_every_steps, checkpoint_every_s=self.checkpoint_every_s,
                     min_workers=self.min_workers, auto_join=self.auto_join, queue=self.queue,
                     tensorboard=self.tensorboard, mlflow=self.mlflow, **settings)

    def __repr__(self) -> str:
        return (f"<Run {getattr(self, 'run_id', '?')} strategy={self.strategy} status={self.status} "
                f"workers={len(self.worker_addresses)} progress={self.progress():.0%}>")


def _system_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in the environment (some containers)
        return "unknown"
