"""The client-side run handle: starts a job on the cluster without blocking, and controls and observes it.

`train()` validates everything on the client, writes the run directory, subscribes to the run's metrics
topic, publishes the control state and submits one long-lived task per worker. A supervisor thread waits
for the tasks, stops the others when one fails, and collects the final weights.
"""
from __future__ import annotations

import dataclasses
import datetime
import getpass
import json
import math
from queue import Empty, SimpleQueue
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import cloudpickle
import torch
from distributed import Client
from distributed.comm import get_address_host
from distributed.scheduler import KilledWorker

from . import checkpoint as checkpoints
from . import collectives, membership
from .control import ControlState, ControlWriter
from .data import BuiltinData, DaskArrayData, DataSource, as_source
from .errors import ClusterError, ConfigError, DivergenceError, ResumeError, TrainingError
from .evaluation import evaluate
from .health import WARNING_KIND, LossWatch
from .job import Job, PreparedJob, check_lr, loss_function
from .metrics import (MetricsTable, communication_summary, control_markers, expand, staleness_summary, time_split,
                      topic)
from .placement import Placement
from .registry import CONTROL_ACTIONS, RUNS_TOPIC, requests_topic
from .rundir import CONFIG_FILE, SUMMARY_FILE, RunDirectory, atomic_write, read_metrics
from .sharding import assign_blocks, shard_size
from .strategies import get_strategy, make_settings
from .worker import WorkerTask, train_on_worker

FINISHED_STATES = ("finished", "stopped", "failed")
SUPERVISION_TICK_S = 0.25  # how often the supervisor looks at membership, checkpoints due and joins
SCHEDULER_LOST_AFTER_S = 3.0  # cut off from the scheduler this long, the run is over (its state is gone)


class SchedulerLost(Exception):
    """The client lost its scheduler while supervising the run."""
MAX_SAVED_JOB_BYTES = 64 * 2**20  # a job (with its data) larger than this is not saved for resume()


class FutureWatch:
    """Waits on Dask futures through their own client's done-callbacks.

    `distributed.wait` would use the process's *default* client, which is whichever client was created
    last (a dashboard's, another notebook cell's) and may run on another event loop.
    """

    def __init__(self, futures: list[Any]) -> None:
        self._futures = futures
        self._changed = threading.Condition()
        for future in futures:
            future.add_done_callback(self._notify)

    def _notify(self, _future: Any) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait(self, until_first_error: bool = False, timeout: float | None = None) -> bool:
        """True when all futures are done (or, with `until_first_error`, one has failed) in time."""
        def settled() -> bool:
            if until_first_error and any(f.status == "error" for f in self._futures):
                return True
            return all(f.done() for f in self._futures)

        with self._changed:
            return self._changed.wait_for(settled, timeout=timeout)


def train(job: Job, strategy: str = "allreduce", *, client: Client | None = None, workers: int | None = None,
          run_dir: str | Path = "runs", name: str | None = None, collective_timeout_s: float = 60.0,
          start: bool = True, owner: str | None = None, checkpoint_every_steps: int | None = None,
          checkpoint_every_s: float | None = 60.0, min_workers: int = 1, auto_join: bool = False,
          queue: bool = False, **settings: Any) -> Run:
    """Start training `job` on the cluster behind `client` and return its `Run` at once (non-blocking).

    strategy: a name from `workbench.STRATEGIES`; `settings` are that strategy's settings (e.g. period=4).
    workers: how many of the cluster's workers train (default: all). On a shared cluster a run takes
    free workers only (those no other run holds); when too few are free it is refused at once, naming
    who holds the others, unless `queue`.
    queue: wait for enough free workers instead, first come first served: the run returns at once with
    status 'queued' (its place in `run.queue_position`) and starts when its workers are free.
    run_dir: parent directory of the run's own directory (config, metrics, checkpoint, weights).
    collective_timeout_s: the longest any wait on another worker may take; a worker silent for longer is
    treated as lost.
    checkpoint_every_steps / checkpoint_every_s: how often a checkpoint is written (None: never by that
    rule); a run also keeps one when it ends. `workbench.resume(run_directory)` goes on from it.
    min_workers: a run that loses workers goes on with the survivors from its last checkpoint, unless
    fewer than this many are left.
    auto_join: workers joining the cluster during the run are added to it (else: `run.add_workers()`).
    start: False returns the run unstarted, for `run.start()` later (or the panel's Start button).
    owner: who the run belongs to (default: the operating-system user); on a team dashboard with
    authentication, this user and the listed admins may control the run.
    In a notebook the run displays as its control panel.
    """
    run = Run(job, strategy, client=client, workers=workers, run_dir=run_dir, name=name,
              collective_timeout_s=collective_timeout_s, settings=settings, owner=owner,
              checkpoint_every_steps=checkpoint_every_steps, checkpoint_every_s=checkpoint_every_s,
              min_workers=min_workers, auto_join=auto_join, queue=queue)
    if start:
        run.start()
    return run


def resume(run_dir: str | Path, *, client: Client | None = None, workers: int | None = None,
           job: Job | None = None, start: bool = True, **options: Any) -> Run:
    """Go on with a stopped or crashed run from the checkpoint in its directory, on `workers` workers
    (default: all of the cluster's; the same number or another). Its metrics continue in that directory.

    job: the run's job, when the directory holds none (jobs whose data could not be saved with it).
    options: train() options to change (collective_timeout_s, checkpoint_every_steps, min_workers, ...).
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
             "owner", "queue"}
    for key in options:
        if key not in known:
            raise ConfigError(key, options[key], f"one of {', '.join(sorted(known))}",
                              "The strategy and its settings are the checkpoint's; switch() after resuming")
    previous = config.get("fault_tolerance", {})
    merged = {"collective_timeout_s": config.get("collective_timeout_s", 60.0),
              "checkpoint_every_steps": previous.get("checkpoint_every_steps"),
              "checkpoint_every_s": previous.get("checkpoint_every_s", 60.0),
              "min_workers": previous.get("min_workers", 1), "auto_join": previous.get("auto_join", False),
              "owner": config.get("owner"), **options}
    run = Run(job, saved["strategy"], client=client, workers=workers, run_dir=path.parent, name=path.name,
              settings=dict(saved["settings"]), resume_from=saved, **merged)
    if start:
        run.start()
    return run


class Run:
    """A training run: status, live metrics, control, checkpoints, and the trained model."""

    def __init__(self, job: Job, strategy: str, *, client: Client | None, workers: int | None,
                 run_dir: str | Path, name: str | None, collective_timeout_s: float,
                 settings: dict[str, Any], step_delays: dict[int, float] | None = None,
                 owner: str | None = None, checkpoint_every_steps: int | None = None,
                 checkpoint_every_s: float | None = 60.0, min_workers: int = 1, auto_join: bool = False,
                 resume_from: dict[str, Any] | None = None, queue: bool = False) -> None:
        if owner is not None and (not isinstance(owner, str) or not owner.strip()):
            raise ConfigError("owner", owner, "a non-empty user name, or None for the operating-system user")
        self.owner = owner or _system_user()
        self.job = job
        self.strategy = strategy
        self._requested_workers = workers
        self._settings_values = dict(settings)
        self._run_root = run_dir
        self._name = name
        self._collective_timeout_s = collective_timeout_s
        self._step_delays = step_delays or {}
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_s = checkpoint_every_s
        self.min_workers = min_workers
        self.auto_join = auto_join
        self.queue = queue
        self._placement: Placement | None = None  # the workers this run holds on the cluster
        self._resume_from = resume_from
        self.client = client
        self.table = MetricsTable()
        self.status = "created"
        self.error: str | None = None
        self.diverged = False
        self.total_steps = 0
        # How many times the workers were regrouped (after a loss or a join); a resumed run counts on.
        self.generation = resume_from.get("generation", 0) if resume_from else -1
        self.worker_addresses: list[str] = []
        self._futures: list[Any] = []
        self._state_dict: dict[str, torch.Tensor] | None = None
        self._finished_workers: set[int] = set()
        self._events = threading.Condition()
        self._supervisor: threading.Thread | None = None
        self._ended = threading.Event()  # set once the run has ended and everything is written
        self._prepared: PreparedJob | None = None
        self._panel: Any = None  # the notebook control panel, made when the run is first displayed
        self._requests: SimpleQueue = SimpleQueue()  # control requests from other clients
        self._ready_checkpoints: SimpleQueue = SimpleQueue()  # rank 0 has one to fetch
        self._membership_changes: SimpleQueue = SimpleQueue()  # from the scheduler
        self._loss_watch: LossWatch | None = None  # made once the run's length is known
        self._warnings: SimpleQueue = SimpleQueue()  # the loss watch's, for the supervisor to publish
        self.checkpoint_info: dict[str, Any] | None = None  # the newest checkpoint written: step, path, time
        self._latest_checkpoint: dict[str, Any] | None = resume_from
        self._lost: set[str] = set()  # addresses of the run's workers the scheduler removed
        self._joined: list[str] = []  # workers that joined the cluster during the run
        self._regroup_to: list[str] | None = None  # the workers to go on with once this group has stopped
        self._stop_watching: Any = None
        self._stop_requested = False
        self._checkpoint_lock = threading.Lock()  # the writer thread and the supervisor both store them
        self._disconnected_since: float | None = None  # since when the client has been cut off from the scheduler

    # --- starting -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Validate everything, then start the workers; returns at once."""
        if self.status != "created":
            raise TrainingError(f"run {self.run_id} was started already ({self.status}); use rerun() for another")
        prepared = self._prepared = self.job.prepare()
        strategy_class = get_strategy(self.strategy)
        settings = make_settings(self.strategy, self._settings_values)
        self._check_fault_tolerance_options()
        if not isinstance(self.queue, bool):
            raise ConfigError("queue", self.queue, "True (wait for free workers) or False (refuse at once)")
        client = self.client = self._resolve_client(self.client)
        wanted = self._wanted_workers(client)
        # Everything the number of workers decides is checked now, not after a wait in the queue.
        if self.min_workers > wanted:
            raise ConfigError("min_workers", self.min_workers, f"at most {wanted}, the run's workers")
        strategy_class.check_world(settings, wanted)
        self._check_batch_fits(prepared, wanted)
        self.run_id = self._name or (f"{self.strategy}-{datetime.datetime.now():%Y%m%d-%H%M%S}-"
                                     f"{uuid.uuid4().hex[:6]}")
        self._placement = Placement(client, self.run_id, self.owner)
        self._start_settings = settings
        self._requested_at = time.time()
        addresses = self._placement.request(wanted, self.queue)
        if addresses is None:  # waits in the queue: the supervisor starts it when its workers are free
            self.status = "queued"
            self._announce("run-queued", owner=self.owner, world_size=wanted, queued=self._requested_at,
                           position=self._placement.position, waiting=self.waiting())
        else:
            try:
                self._begin(addresses, settings)
            except BaseException:
                self._placement.give_back()
                raise
        self._supervisor = threading.Thread(target=self._supervise, name=f"workbench-{self.run_id}", daemon=True)
        self._supervisor.start()

    @property
    def queue_position(self) -> int | None:
        """While the run waits for workers: its place in the cluster's queue (1: next); else None."""
        return self._placement.position if self.status == "queued" and self._placement else None

    def waiting(self) -> str | None:
        """While the run waits for workers, what for and behind whom (one line); else None."""
        placement = self._placement
        if self.status != "queued" or placement is None:
            return None
        return (f"waits for {placement.wanted} free workers (place {placement.position} in the queue; "
                f"{placement.holders})")

    def _begin(self, addresses: list[str], settings: Any) -> None:
        """Start training on `addresses`, the workers the run holds: run directory, topics, control, tasks."""
        client, prepared = self.client, self._prepared
        resumed = self._resume_from is not None
        self.directory = RunDirectory(Path(self._run_root) / self.run_id)
        if resumed:  # the earlier history first, so that views of this run show all of it
            self.table.add(read_metrics(self.directory.path))
        self.config = {
            "run_id": self.run_id, "strategy": self.strategy, "settings": dataclasses.asdict(settings),
            "job": prepared.job.describe(), "workers": addresses, "world_size": len(addresses),
            "parameters": prepared.n_parameters, "scheduler": client.scheduler.address,
            "started": time.time(), "owner": self.owner, "directory": str(self.directory.path.resolve()),
            "collective_timeout_s": self._collective_timeout_s,
            "fault_tolerance": {"checkpoint_every_steps": self.checkpoint_every_steps,
                                "checkpoint_every_s": self.checkpoint_every_s, "min_workers": self.min_workers,
                                "auto_join": self.auto_join},
            "queued_s": round(time.time() - self._requested_at, 3),  # waiting for free workers
        }
        if resumed:
            self.config["resumed_from_step"] = self._resume_from["step"]
            self.checkpoint_info = {"step": self._resume_from["step"], "written": 0.0, "generation": None,
                                    "path": str(self.directory.path / checkpoints.CHECKPOINT_FILE)}
        self.directory.write_json(CONFIG_FILE, self.config)
        if not resumed:
            self._save_job()
        beginning = [{"kind": "run-resumed" if resumed else "run-started", "time": time.time(),
                      "strategy": self.strategy, "settings": dataclasses.asdict(settings),
                      **({"from_step": self._resume_from["step"]} if resumed else {})}]
        self.directory.append(beginning)
        self.table.add(beginning)  # run.events() shows what the run directory holds

        client.subscribe_topic(topic(self.run_id), self._on_message)
        client.subscribe_topic(requests_topic(self.run_id), self._on_request)
        lr = self._resume_from["lr"] if resumed else self.job.lr
        self._control = ControlWriter(client, self.run_id, ControlState(
            lr=lr, strategy=self.strategy, settings=dataclasses.asdict(settings)))
        self._stop_watching = membership.watch(client, self._on_membership)
        self._launch(addresses, self._resume_from)
        self.config.update(shard_samples=self.shard_samples, total_steps=self.total_steps)
        self._loss_watch = LossWatch(self.total_steps, first_step=self._resume_from["step"] if resumed else 0,
                                     strategy=self.strategy, momentum=self.job.momentum)
        self.directory.write_json(CONFIG_FILE, self.config)
        self.status = "running"
        self._announce("run-registered", **json.loads(json.dumps(self.config, default=str)))
        for target, purpose in ((self._serve_requests, "requests"), (self._write_checkpoints, "checkpoints")):
            threading.Thread(target=target, name=f"workbench-{purpose}-{self.run_id}", daemon=True).start()

    def _check_fault_tolerance_options(self) -> None:
        if not isinstance(self._collective_timeout_s, (int, float)) or isinstance(self._collective_timeout_s, bool) \
                or not math.isfinite(self._collective_timeout_s) or not self._collective_timeout_s > 0:
            raise ConfigError("collective_timeout_s", self._collective_timeout_s, "a finite number of seconds > 0")
        steps = self.checkpoint_every_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ConfigError("checkpoint_every_steps", steps, "an integer >= 1, or None for no step-based checkpoints")
        seconds = self.checkpoint_every_s
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not math.isfinite(seconds) or seconds <= 0):
            raise ConfigError("checkpoint_every_s", seconds, "a finite number of seconds > 0, or None")
        if isinstance(self.min_workers, bool) or not isinstance(self.min_workers, int) or self.min_workers < 1:
            raise ConfigError("min_workers", self.min_workers, "an integer >= 1")
        if not isinstance(self.auto_join, bool):
            raise ConfigError("auto_join", self.auto_join, "True or False")

    def _check_batch_fits(self, prepared: PreparedJob, world_size: int) -> None:
        if isinstance(prepared.train, DaskArrayData):
            return  # shards follow where the blocks are; checked when they are placed
        _check_batch_fits_shard(prepared.job.batch_size, shard_size(len(prepared.train), world_size), world_size)

    def _save_job(self) -> None:
        """The job beside its checkpoint, so that `resume(run_dir)` needs nothing else (when it fits)."""
        try:
            pickled = cloudpickle.dumps(self.job)
        except Exception:
            return  # resume() then asks for job=
        if len(pickled) <= MAX_SAVED_JOB_BYTES:
            atomic_write(self.directory.path / checkpoints.JOB_FILE, lambda handle: handle.write(pickled))

    def _launch(self, addresses: list[str], checkpoint: dict[str, Any] | None) -> None:
        """Start one group of workers (a generation) from `checkpoint`, or from the job's initial weights."""
        client, prepared = self.client, self._prepared
        self.generation += 1
        self._finished_workers = set()
        world_size = len(addresses)
        train_payload, shard_samples, local = self._place_training_data(client, prepared.train, addresses)
        _check_batch_fits_shard(prepared.job.batch_size, shard_samples, world_size)
        self.total_steps, self.shard_samples = prepared.total_steps(shard_samples), shard_samples
        state = self._control.state
        settings = make_settings(state.strategy, state.settings)
        # A new group starts with the run's current learning rate, strategy and settings.
        job = dataclasses.replace(self.job, lr=state.lr if state.lr is not None else self.job.lr)
        ranks = (checkpoint or {}).get("ranks") or []
        same_world = len(ranks) == world_size
        steps_per_epoch = shard_samples // prepared.job.batch_size
        saved = client.scatter(checkpoint, workers=addresses, broadcast=True, hash=False) if checkpoint else None
        # Every run has a process group (see worker.py), on a port free on rank 0's machine.
        host = get_address_host(addresses[0])
        port = client.run(collectives.find_free_port, workers=[addresses[0]])[addresses[0]]
        eval_payload = self._scatter(client, prepared.evaluation, addresses[:1])
        launch = uuid.uuid4().hex[:6]  # task keys never repeat, even for a run resumed under its old id
        futures, starts = [], []
        for rank, address in enumerate(addresses):
            start_step = (ranks[rank]["step"] if same_world else
                          _rescaled_step(checkpoint, world_size, steps_per_epoch, prepared.job)) if checkpoint else 0
            task = WorkerTask(
                run_id=self.run_id, rank=rank, world_size=world_size, job=job, strategy=state.strategy,
                settings=settings, shard_samples=shard_samples, total_steps=self.total_steps,
                local_data=local, master_host=host, master_port=port,
                collective_timeout_s=self._collective_timeout_s, addresses=addresses,
                step_delay_s=self._step_delays.get(rank, 0.0), generation=self.generation,
                start_step=start_step, checkpoint_every_steps=self.checkpoint_every_steps,
                applied_switch=state.switch_id, known_checkpoint=state.checkpoint_id,
            )
            data = train_payload[address] if local else train_payload
            starts.append(start_step)
            futures.append(client.submit(
                train_on_worker, task, data, eval_payload if rank == 0 else None, saved,
                key=f"workbench-{self.run_id}-g{self.generation}-{launch}-rank-{rank}", workers=[address],
                allow_other_workers=False, pure=False, retries=0,
            ))
        self._futures, self.worker_addresses = futures, list(addresses)
        self._next_checkpoint_time = time.monotonic() + (self.checkpoint_every_s or math.inf)
        self._publish({"kind": "generation-started", "time": time.time(), "generation": self.generation,
                       "workers": addresses, "from_step": checkpoint["step"] if checkpoint else 0,
                       "start_step": min(starts), "total_steps": self.total_steps})
        if checkpoint is not None and checkpoint.get("strategy") not in (None, state.strategy):
            # A switch asked for while the old group broke up is made as the new group starts: recorded
            # as rank 0's, as a switch made by the workers is, so that every view marks it.
            self._publish({"kind": "switched", "rank": 0, "time": time.time(), "step": min(starts),
                           "from": checkpoint["strategy"], "to": state.strategy, "settings": state.settings,
                           "generation": self.generation, "at_regroup": True})

    def _resolve_client(self, client: Client | None) -> Client:
        if client is not None:
            if not isinstance(client, Client):
                raise ConfigError("client", client, "a distributed.Client, e.g. from workbench.connect()")
            return client
        try:
            from distributed import get_client

            return get_client()
        except ValueError:
            raise ConfigError("client", None, "a Dask client",
                              "Start one with client = workbench.connect() and pass client=client") from None

    def _wanted_workers(self, client: Client) -> int:
        """How many workers the run asks for: `workers`, or as many as the cluster has."""
        present = len(client.scheduler_info(n_workers=-1)["workers"])
        requested = self._requested_workers
        if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
            raise ConfigError("workers", requested, "an integer >= 1")
        if not present:
            raise ClusterError("the cluster has no workers; start some (dask worker ADDRESS) and try again")
        if requested is not None and requested > present:
            raise ConfigError("workers", requested, f"at most {present}, the workers in this cluster",
                              "Start more workers or ask for fewer")
        return present if requested is None else requested

    def _place_training_data(self, client: Client, source: DataSource, addresses: list[str]):
        """Where the training data goes: (payload, common shard size, whether shards are worker-local)."""
        if isinstance(source, DaskArrayData):
            return self._assign_dask_blocks(client, source, addresses)
        return self._scatter(client, source, addresses), shard_size(len(source), len(addresses)), False

    @staticmethod
    def _scatter(client: Client, source: DataSource | None, addresses: list[str]) -> Any:
        # Built-in data is generated on the workers; only user data travels, once per worker.
        if source is None or isinstance(source, BuiltinData):
            return source
        return client.scatter(source, workers=addresses, broadcast=True, hash=False)

    @staticmethod
    def _assign_dask_blocks(client: Client, source: DaskArrayData, addresses: list[str]):
        inputs = source.inputs
        targets = source.targets.rechunk((inputs.chunks[0],) + source.targets.chunks[1:])
        input_blocks = client.compute(list(inputs.to_delayed().ravel()))
        target_blocks = client.compute(list(targets.to_delayed().ravel()))
        FutureWatch(input_blocks + target_blocks).wait()
        holders = client.who_has(input_blocks)
        block_rows = list(inputs.chunks[0])
        assignment = assign_blocks(block_rows, [set(holders.get(f.key, ())) for f in input_blocks], addresses)
        shard_samples = min(sum(block_rows[i] for i in blocks) for blocks in assignment.values())
        payload = {address: ([input_blocks[i] for i in blocks], [target_blocks[i] for i in blocks])
                   for address, blocks in assignment.items()}
        return payload, shard_samples, True

    # --- metrics and supervision ----------------------------------------------------------------------

    def _on_message(self, event: tuple[float, dict[str, Any]]) -> None:
        # Runs on the client's IO-loop thread: store and append, nothing blocking.
        _, message = event
        records = expand(message)
        self.table.add(records)
        self.directory.append(records)
        kind = message.get("kind")
        if kind == "steps" and self._loss_watch is not None:
            for record in records:
                warning = self._loss_watch.observe(record)
                if warning is not None:  # published by the supervisor: no blocking calls on this thread
                    self._warnings.put({**warning, "time": time.time(), "strategy": record.get("strategy")})
        if kind == "checkpoint-ready":
            self._ready_checkpoints.put(message)
        with self._events:  # wakes `wait_for_step`, `wait_for_event` and the supervisor
            if kind in ("worker-finished", "worker-failed", "worker-left") \
                    and message.get("generation", self.generation) == self.generation:
                self._finished_workers.add(message["rank"])
            self._events.notify_all()

    def _publish(self, message: dict[str, Any]) -> None:
        """A record of the client's own (a lost worker, a regroup, a checkpoint) on the run's topic, so that
        the run directory and every viewer get it; kept here directly when the scheduler is unreachable."""
        try:
            self.client.log_event(topic(self.run_id), message)
        except Exception:
            self._on_message((time.time(), message))

    def _on_membership(self, action: str, address: str) -> None:
        # On the client's event loop, where the blocking client calls of publishing cannot run: the
        # supervisor takes the change at its next tick.
        self._membership_changes.put((action, address, time.time()))

    def _take_membership_changes(self) -> None:
        """Note workers the scheduler removed (lost, if they were training) or added (joined)."""
        while True:
            try:
                action, address, when = self._membership_changes.get_nowait()
            except Empty:
                return
            if action == "remove-worker":
                self._joined = [a for a in self._joined if a != address]
                if address in self.worker_addresses and address not in self._lost:
                    self._record_lost(address, when, "the scheduler removed the worker")
            elif action == "add-worker" and address not in self.worker_addresses:
                self._lost.discard(address)  # a worker back on the same address is a new one
                self._joined.append(address)
                self._publish({"kind": "worker-joined", "time": when, "address": address, "added": self.auto_join})

    def _queued_warnings(self) -> list[dict[str, Any]]:
        taken = []
        while True:
            try:
                taken.append(self._warnings.get_nowait())
            except Empty:
                return taken

    def _publish_warnings(self) -> None:
        for warning in self._queued_warnings():
            self._publish(warning)

    def _publish_leftover_warnings(self) -> None:
        """Warnings from the last records, once this client no longer hears its own topic: kept here
        directly, and sent for the other viewers."""
        for warning in self._queued_warnings():
            self._on_message((time.time(), warning))
            try:
                self.client.log_event(topic(self.run_id), warning)
            except Exception:
                pass

    def _record_lost(self, address: str, when: float, reason: str) -> None:
        self._lost.add(address)
        rank = self.worker_addresses.index(address)
        last = self.table.last_steps().get(rank, {})
        self._publish({"kind": "worker-lost", "time": when, "rank": rank, "address": address,
                       "generation": self.generation, "step": last.get("step"), "reason": reason})

    def _supervise(self) -> None:
        try:
            if self.status == "queued" and not self._start_when_workers_are_free():
                return
            self._supervise_tasks()
        except BaseException as error:  # never leave the run looking alive when supervision itself broke
            if not hasattr(self, "directory"):  # it never started: nothing was written
                self.error = f"starting the run failed: {type(error).__name__}: {error}"
                self.status = "failed"
                self._announce("run-status", error=self.error)
            elif self._scheduler_lost(error):
                self.error = self._scheduler_lost_message()
            else:
                self.error = f"supervising the run failed: {type(error).__name__}: {error}"
                self._end_group()
            try:
                self._end_run("failed")
            except Exception:
                self.status = "failed"
            # Said through the run's error (wait(), the panel, the CLI); re-raised only if not an Exception,
            # so that no thread traceback is printed beside it.
            if not isinstance(error, Exception):
                raise
        finally:
            self._requests.put(None)  # ends the thread serving other clients' control requests
            self._ready_checkpoints.put(None)  # and the one writing checkpoints
            if self._stop_watching is not None:
                self._stop_watching()
            # However the run ended, its workers are free for the next run (before wait() returns).
            if getattr(self.client, "status", None) == "running":
                self._placement.give_back()
            self._ended.set()

    def _start_when_workers_are_free(self) -> bool:
        """Wait in the queue, then start; False when the run ended there (stopped, or its place lost)."""
        addresses = self._placement.wait(lambda: self._stop_requested)
        if addresses is None:
            stopped = self._stop_requested
            self.status = "stopped" if stopped else "failed"
            if not stopped:
                self.error = "the run lost its place in the queue (its client's connection to the scheduler ended)"
            self._announce("run-status", error=self.error)
            return False
        self._begin(addresses, self._start_settings)
        if self._stop_requested:  # stopped while it was being started
            self._control.update(stop=True)
        return True

    def _scheduler_lost(self, error: BaseException) -> bool:
        return isinstance(error, SchedulerLost) or getattr(self.client, "status", "running") != "running" \
            or "scheduler-connection-lost" in str(error)

    def _scheduler_lost_message(self) -> str:
        directory = str(self.directory.path)
        info = self.checkpoint_info
        kept = (f"its last checkpoint (step {info['step']} of {self.total_steps}) is kept in {directory}"
                if info else f"no checkpoint was written yet, so nothing can be resumed from {directory}")
        message = f"lost the connection to the Dask scheduler at {self.config['scheduler']}: the run ended; {kept}."
        if info:
            message += (f" Once a scheduler and workers are up again, go on with workbench.resume({directory!r}, "
                        f"client=workbench.connect(scheduler=...)) or: workbench train --resume {directory} "
                        "--scheduler ADDRESS")
        return message

    def _check_scheduler(self) -> None:
        """Raise `SchedulerLost` once the client has been cut off from the scheduler for a while: the
        run's tasks, control state and actors went with it, and Dask alone would wait 30 s to say so."""
        if getattr(self.client, "status", "running") == "running":
            self._disconnected_since = None
            return
        if self._disconnected_since is None:
            self._disconnected_since = time.monotonic()
        elif time.monotonic() - self._disconnected_since >= SCHEDULER_LOST_AFTER_S:
            raise SchedulerLost(self.client.status)

    def _supervise_tasks(self) -> None:
        """Watch one group of workers after another until the run ends."""
        while True:
            following = self._watch_group()
            if following is None:
                return
            addresses, checkpoint = following
            self._launch(addresses, checkpoint)

    def _watch_group(self) -> tuple[list[str], dict[str, Any] | None] | None:
        """Wait for the current group of workers; returns the workers and checkpoint to go on with, or
        None once the run has ended (its status set)."""
        futures, addresses = self._futures, list(self.worker_addresses)
        watch = FutureWatch(futures)
        while not watch.wait(until_first_error=True, timeout=SUPERVISION_TICK_S):
            self._check_scheduler()
            self._take_membership_changes()
            if self._lost & set(addresses):
                break
            self._publish_warnings()
            self._request_checkpoint_when_due()
            if self.auto_join and self._joined and self._regroup_to is None and self.status == "running":
                self._try_add_workers(list(self._joined), automatic=True)
        failed = any(f.status == "error" for f in futures) or bool(self._lost & set(addresses))
        if failed:
            return self._after_failure(futures, addresses)
        results = [f.result() for f in futures]
        with self._events:  # the workers' last metrics may trail their results by a moment
            self._events.wait_for(lambda: len(self._finished_workers) >= len(futures), timeout=5)
        final = results[0].get("checkpoint")
        if final is not None:
            self._store_checkpoint(final)
        if self._regroup_to is not None and any(r["stopped"] for r in results) and not self._stop_requested:
            following, self._regroup_to = self._regroup_to, None
            self._control.update(stop=False, regroup=False)
            self._publish({"kind": "regrouped", "time": time.time(), "generation": self.generation + 1,
                           "workers": following, "reason": "workers joined", "from_step": final["step"]})
            return following, final
        self._state_dict = results[0]["state_dict"]
        stopped = any(r["stopped"] for r in results)
        self._end_run("stopped" if stopped else "finished")
        return None

    def _after_failure(self, futures: list[Any], addresses: list[str]) -> tuple[list[str], dict[str, Any]] | None:
        """A worker failed or was lost: end the group; go on with the survivors if workers were lost."""
        self._end_group()
        # Workers leave at their next step or as their peers' connections close; one still busy after a
        # whole timeout more is stuck (in user code, say) and counts as lost.
        self._wait_for_survivors(futures, addresses)
        present = set(self.client.scheduler_info(n_workers=-1)["workers"])
        lost = set()
        for future, address in zip(futures, addresses):
            if address in self._lost:
                lost.add(address)
            elif address not in present or (future.status == "error"
                                             and isinstance(future.exception(), KilledWorker)):
                lost.add(address)
                self._record_lost(address, time.time(), "its worker process died")
            elif not future.done():  # stuck past every timeout: treated as lost
                lost.add(address)
                self._record_lost(address, time.time(), f"stuck: no answer within {self._collective_timeout_s:g} s")
        unfinished = [f for f in futures if not f.done()]
        if unfinished:  # the lost workers' tasks (a nanny's restarted worker would wait for them), the stuck
            self.client.cancel(unfinished, force=True)
        if not lost:
            self._fail(futures, addresses)
            return None
        # A lost worker (back under the same address it is a new one) and a join under way are given
        # back: the survivors go on (add workers again).
        self._placement.give_back(sorted(lost | set(self._regroup_to or []) - set(addresses)))
        self._regroup_to = None
        survivors = [a for a in addresses if a not in lost and a in present]
        checkpoint = self._latest_checkpoint
        from_step = checkpoint["step"] if checkpoint else 0
        where = (f"the last checkpoint (step {from_step}) is kept at {self.checkpoint_info['path']}"
                 if self.checkpoint_info else "no checkpoint was written yet")
        if self._stop_requested:  # stopped while the loss was being handled: keep the last checkpoint
            self._state_dict = checkpoint["weights"] if checkpoint else None
            self._end_run("stopped")
            return None
        if len(survivors) < self.min_workers:
            self.error = (f"lost worker(s) {', '.join(sorted(lost))}; {len(survivors)} left, fewer than "
                          f"min_workers={self.min_workers}, so the run stopped; {where}. Resume it with "
                          f"workbench.resume({str(self.directory.path)!r}) once workers are back")
            self._end_run("failed")
            return None
        self._control.update(stop=False, regroup=False)
        self._publish({"kind": "regrouped", "time": time.time(), "generation": self.generation + 1,
                       "workers": survivors, "lost": sorted(lost), "from_step": from_step,
                       "reason": "workers lost"})
        return survivors, checkpoint

    def _wait_for_survivors(self, futures: list[Any], addresses: list[str]) -> None:
        """Wait until every worker not known lost has left (at most one collective timeout).

        Not for the lost ones: their tasks may never end (a `dask worker` nanny restarts the process under
        a new address, and the scheduler keeps the task for the old one), and waiting for them held every
        regroup back by the whole timeout.
        """
        deadline = time.monotonic() + self._collective_timeout_s
        while True:
            self._take_membership_changes()
            waiting = [f for f, a in zip(futures, addresses) if a not in self._lost and not f.done()]
            if not waiting or time.monotonic() >= deadline:
                return
            FutureWatch(waiting).wait(timeout=min(SUPERVISION_TICK_S, max(0.0, deadline - time.monotonic())))

    def _end_group(self) -> None:
        """Tell every worker of the current group to leave at once (no final synchronisation)."""
        try:
            self._control.update(generation=self.generation + 1)
        except Exception:  # the scheduler may be gone; the workers then leave as their tasks are released
            pass

    def _fail(self, futures: list[Any], addresses: list[str]) -> None:
        errors, diverged, seen = [], None, set()
        for rank, future in enumerate(futures):
            if future.status != "error":
                continue
            exception, tb = future.exception(), future.traceback()
            if isinstance(exception, DivergenceError) and diverged is None:
                diverged = str(exception)
            text = f"{type(exception).__name__}: {exception}"
            if text in seen:  # the same error on several ranks (a group that cannot form): its text once
                errors.append(f"worker {rank} ({addresses[rank]}) failed: {type(exception).__name__}: the same "
                              f"error\n")
                continue
            seen.add(text)
            errors.append(f"worker {rank} ({addresses[rank]}) failed: {type(exception).__name__}: {exception}\n"
                          + ("".join(traceback.format_tb(tb)) if tb else ""))
        # The first worker to fail says why; the others mostly failed because it left.
        errors.sort(key=lambda text: "Connection closed by peer" in text or "Connection reset" in text)
        if diverged is not None:
            self.diverged = True
            kept = (f" The last good checkpoint (step {self.checkpoint_info['step']}) is kept at "
                    f"{self.checkpoint_info['path']}." if self.checkpoint_info else " No checkpoint was written before.")
            self.error = diverged + kept
        else:
            self.error = "\n".join(errors) or "the workers ended without a result"
        self._end_run("failed")

    def _end_run(self, status: str) -> None:
        # Without a scheduler every call to it would wait out Dask's connect timeout: only the files then.
        connected = getattr(self.client, "status", "running") == "running"
        if connected:
            with self._events:  # the workers' last metrics may trail their results by a moment
                self._events.wait_for(lambda: len(self._finished_workers) >= len(self._futures), timeout=2)
            for name in (topic(self.run_id), requests_topic(self.run_id)):
                try:
                    self.client.unsubscribe_topic(name)
                except Exception:
                    pass
            self._publish_leftover_warnings()
            self._control.delete()
        self.status = status
        if status != "failed" and self._state_dict is not None:
            self.directory.save_model(self._state_dict)
        self.directory.append([{"kind": f"run-{self.status}", "time": time.time(), "error": self.error}])
        summary = self.summary()
        self.directory.write_json(SUMMARY_FILE, summary)
        self.directory.close()
        if connected:
            self._announce("run-status", samples_per_s=summary.get("samples_per_s"), error=self.error)

    # --- checkpoints ----------------------------------------------------------------------------------

    def _request_checkpoint_when_due(self) -> None:
        """Ask the workers for a checkpoint every `checkpoint_every_s` seconds (those every
        `checkpoint_every_steps` steps they take on their own, at exactly those steps)."""
        if self.status != "running" or self._regroup_to is not None:
            return
        if time.monotonic() >= self._next_checkpoint_time:
            self._next_checkpoint_time = time.monotonic() + (self.checkpoint_every_s or math.inf)
            self._control.update(checkpoint_id=self._control.state.checkpoint_id + 1)

    def checkpoint(self, timeout: float = 60.0) -> dict[str, Any]:
        """Take a checkpoint now (all workers at one step) and return where it was written."""
        self._require_running()
        if self.status == "paused":
            raise TrainingError("the run is paused: workers take a checkpoint when they go on; resume() first")
        before = self.checkpoint_info["written"] if self.checkpoint_info else 0.0
        self._control.update(checkpoint_id=self._control.state.checkpoint_id + 1)
        self._wait_for(lambda: self.checkpoint_info is not None and self.checkpoint_info["written"] > before,
                       timeout, "a new checkpoint")
        return dict(self.checkpoint_info)

    def _write_checkpoints(self) -> None:
        """Fetch each checkpoint rank 0 has left and write it; a thread, since fetching waits on a worker."""
        while (message := self._ready_checkpoints.get()) is not None:
            if message.get("generation") != self.generation or not self._futures:
                continue
            address = self.worker_addresses[0]
            try:
                fetched = self.client.submit(checkpoints.take_snapshot, self.run_id, workers=[address],
                                             allow_other_workers=False, pure=False)
                checkpoint = fetched.result(timeout=self._collective_timeout_s)
            except Exception:
                continue  # rank 0 was lost with it: the previous checkpoint stands
            if checkpoint is not None:
                self._store_checkpoint(checkpoint)

    def _store_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Write a checkpoint atomically unless it holds NaN or infinity (the last good one is kept)."""
        if not checkpoints.all_finite(checkpoint["weights"]):
            self._publish({"kind": "checkpoint-refused", "time": time.time(), "step": checkpoint["step"],
                           "reason": "non-finite weights"})
            return
        path = self.directory.path / checkpoints.CHECKPOINT_FILE
        with self._checkpoint_lock:
            current = self._latest_checkpoint
            if current is not None and current is not checkpoint and _age(current) > _age(checkpoint):
                return  # an older one fetched late
            checkpoints.save(path, checkpoint)
            self._latest_checkpoint = checkpoint
            self.checkpoint_info = {"step": checkpoint["step"], "path": str(path), "written": time.time(),
                                    "generation": checkpoint.get("generation")}
        self._publish({"kind": "checkpoint", "time": time.time(), "step": checkpoint["step"], "path": str(path),
                       "generation": checkpoint.get("generation"), "final": checkpoint.get("final", False)})

    # --- joining workers ------------------------------------------------------------------------------

    def add_workers(self, addresses: list[str] | None = None) -> list[str]:
        """Add workers that joined the cluster (default: all not training in this run). The run takes a
        checkpoint at one step, ends the current group and goes on with the larger one: the new workers
        get the current weights and their shard of the data. Returns the workers the run goes on with."""
        self._require_running()
        return self._try_add_workers(addresses, automatic=False)

    def _try_add_workers(self, addresses: list[str] | None, automatic: bool) -> list[str]:
        present = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
        if addresses is None:  # every free worker (those no other run holds)
            addresses = self._placement.free_workers()
        unknown = [a for a in addresses if a not in present]
        if unknown and automatic:  # joined and left again
            addresses = [a for a in addresses if a in present]
        elif unknown:
            raise ConfigError("addresses", unknown, "addresses of workers in the cluster", f"It has {present}")
        new = [a for a in addresses if a not in self.worker_addresses]
        self._joined = [a for a in self._joined if a not in addresses]
        if not new:
            return list(self.worker_addresses)
        added = self._placement.grow(new)  # only workers no other run holds, and none while runs wait
        try:
            if len(added) < len(new):
                held = [a for a in new if a not in added]
                raise ConfigError("addresses", held, "free workers (no other run holds them)",
                                  f"Held: {self._placement.held_by_others(held)}")
            following = list(self.worker_addresses) + new
            settings = make_settings(self._control.state.strategy, self._control.state.settings)
            get_strategy(self._control.state.strategy).check_world(settings, len(following))
            self._check_batch_fits(self._prepared, len(following))
        except ConfigError as error:
            self._placement.give_back(added)
            if not automatic:
                raise
            self._publish({"kind": "join-refused", "time": time.time(), "workers": new, "reason": str(error)})
            return list(self.worker_addresses)
        self._regroup_to = following
        self._control.update(stop=True, regroup=True)
        return following

    # --- the cluster-wide registry and requests from other clients ------------------------------------

    def _announce(self, kind: str, **fields: Any) -> None:
        """Tell every client on the cluster (the team dashboard) about this run: registered, or a new status."""
        message = {"kind": kind, "run_id": self.run_id, "status": self.status, "strategy": self.strategy,
                   "time": time.time(), **fields}
        try:
            self.client.log_event(RUNS_TOPIC, message)
        except Exception:  # the scheduler may be gone at shutdown; the run directory still has everything
            pass

    def _on_request(self, event: tuple[float, dict[str, Any]]) -> None:
        # On the client's IO-loop thread, where the blocking control calls must not run: one thread
        # carries requests out in the order they came.
        self._requests.put(event[1])

    def _serve_requests(self) -> None:
        while (request := self._requests.get()) is not None:
            self._carry_out(request)

    def _carry_out(self, request: dict[str, Any]) -> None:
        """Carry out another client's control request with the public methods, and publish the outcome
        (on the run's metrics topic, so it lands in the run directory and in every viewer)."""
        action, arguments = request.get("action"), dict(request.get("arguments") or {})
        try:
            if action in ("pause", "resume", "stop"):
                getattr(self, action)()
            elif action == "set_lr":
                self.set_lr(arguments.get("lr"))
            elif action == "switch":
                self.switch(arguments.get("strategy"), **(arguments.get("settings") or {}))
            else:
                raise ConfigError("action", action, f"one of {', '.join(CONTROL_ACTIONS)}")
            outcome: dict[str, Any] = {"ok": True, "error": None}
        except Exception as error:
            outcome = {"ok": False, "error": f"{type(error).__name__}: {error}".splitlines()[0]}
        message = {"kind": "control-request", "time": time.time(), "action": action, "arguments": arguments,
                   "by": request.get("by"), "request_id": request.get("request_id"), **outcome}
        try:
            self.client.log_event(topic(self.run_id), message)
        except Exception:
            self._on_message((time.time(), message))

    # --- public API -----------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.status in FINISHED_STATES

    def wait(self, timeout: float | None = None) -> str:
        """Block until the run ends (or `timeout` seconds pass: TimeoutError); raise TrainingError if it failed."""
        if self._supervisor is None:
            raise TrainingError("the run was never started")
        try:
            # An Event, not Thread.join: a join interrupted by Ctrl-C can leave the thread looking ended.
            self._ended.wait(timeout)
        except KeyboardInterrupt:
            # Interrupting the wait (Ctrl-C, the notebook's stop button) ends the run: workers stop
            # cleanly if they can, else leave at once; nothing keeps training behind the user's back.
            self.interrupt()
            raise
        if not self._ended.is_set():
            raise TimeoutError(f"run {self.run_id} still {self.status} after {timeout} s")
        if self.status == "failed":
            error_type = DivergenceError if self.diverged else TrainingError
            raise error_type(f"run {self.run_id} failed:\n{self.error}")
        return self.status

    def interrupt(self, grace_s: float | None = None) -> str:
        """Stop the run now: cleanly within `grace_s` (default: the collective timeout), else end the
        workers' tasks at once. Returns the final status."""
        if self._supervisor is None or self.done:
            return self.status
        grace_s = self._collective_timeout_s if grace_s is None else grace_s
        self.stop()
        if not self._ended.wait(grace_s):
            self._regroup_to = None
            self._end_group()
            self._ended.wait(self._collective_timeout_s + 35)
        return self.status

    def wait_for_step(self, step: int, timeout: float = 60.0) -> None:
        """Block until every worker has trained past `step` (or the run ended: TrainingError)."""
        def reached() -> bool:
            latest = self._current_last_steps()
            return len(latest) == len(self.worker_addresses) and min(r["step"] for r in latest.values()) >= step

        self._wait_for(reached, timeout, f"every worker past step {step}")

    def wait_for_event(self, kind: str, since: float, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Block until every worker has reported a `kind` event ('switched', 'changed', 'paused',
        'resumed', ...) timed after `since` (a `time.time()`); returns those events, by worker."""
        def found() -> list[dict[str, Any]]:
            events = {e["worker"]: e for e in self.table.events(kind) if e["time"] >= since}
            return [events[w] for w in sorted(events)] if len(events) == len(self.worker_addresses) else []

        self._wait_for(lambda: bool(found()), timeout, f"a '{kind}' event from every worker")
        return found()

    def _wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._events:
            while not condition():
                if self.done:
                    raise TrainingError(f"run {self.run_id} ended ({self.status}) before {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"run {self.run_id}: still waiting for {what} after {timeout} s")
                self._events.wait(min(remaining, 0.5))

    def _current_last_steps(self) -> dict[int, dict[str, Any]]:
        """The latest step record of each rank of the current group of workers."""
        return {rank: record for rank, record in self.table.last_steps().items()
                if rank is not None and rank < len(self.worker_addresses)}

    def _require_running(self) -> None:
        """Refuse a control action on a run that has not started or has ended."""
        if self.status == "created":
            raise TrainingError("the run has not started yet: call start() first (or train() without start=False)")
        if self.status == "queued":
            raise TrainingError(f"run {self.run_id} {self.waiting()}: it can be stopped, and changed once it trains")
        if self.done:
            raise TrainingError(f"run {self.run_id} has already ended ({self.status})")

    def pause(self) -> None:
        """Workers stop after their current step (at the next agreed step) until `resume()`."""
        if self.status in ("created", "queued"):
            self._require_running()
        if not self.done:
            self._control.update(paused=True)
            self.status = "paused"
            self._announce("run-status")

    def resume(self) -> None:
        if self.status in ("created", "queued"):
            self._require_running()
        if not self.done:
            self._control.update(paused=False)
            self.status = "running"
            self._announce("run-status")

    def stop(self) -> None:
        """End the run cleanly: workers finish their step, synchronise, and the final weights are kept.
        A run waiting in the queue leaves it."""
        if self.status != "created" and not self.done:
            self._stop_requested = True  # also when the workers are being regrouped right now
            if self.status == "queued" or not hasattr(self, "_control"):
                self._placement.wake()  # the queued run's supervisor gives its place up
            else:
                self._control.update(stop=True)

    def set_lr(self, lr: float) -> None:
        """Change the learning rate on every worker while the run trains."""
        lr = check_lr(lr)
        self._require_running()
        self._control.update(lr=lr)
        self.directory.append([{"kind": "control", "time": time.time(), "lr": lr}])

    def update(self, **settings: Any) -> None:
        """Change strategy settings that may change live (e.g. `period` for 'average')."""
        strategy_class = get_strategy(self.strategy)
        live = strategy_class.settings_class.live
        for key in settings:
            if key not in live:
                raise ConfigError(key, settings[key], f"a live setting of '{self.strategy}' ({', '.join(live) or 'none'}); "
                                  f"other settings change with switch('{self.strategy}', {key}=...)")
        self._require_running()
        merged = {**self._control.state.settings, **settings}
        make_settings(self.strategy, merged)  # validates values
        self._control.update(settings=settings)
        self.directory.append([{"kind": "control", "time": time.time(), **settings}])

    def switch(self, strategy: str, **settings: Any) -> None:
        """Switch every worker to `strategy` (with `settings`, defaults for the rest) while the run trains.

        All workers change at one step: the largest any of them has reached when they meet (the others
        train up to it first). The weights and the optimizer state carry over: a parameter server starts
        from the averaged weights and optimizer state; workers leaving a parameter server take its
        weights and its optimizer state. Each worker records a 'switched' event. A paused run makes the
        switch and stays paused.
        """
        strategy_class = get_strategy(strategy)
        validated = make_settings(strategy, settings)
        self._require_running()
        strategy_class.check_world(validated, len(self.worker_addresses))
        state = self._control.switch(strategy, dataclasses.asdict(validated))
        self.strategy = strategy
        self.directory.append([{"kind": "control", "time": time.time(), "switch_id": state.switch_id,
                                "strategy": strategy, "settings": dataclasses.asdict(validated)}])
        self._announce("run-status", settings=dataclasses.asdict(validated))

    @property
    def settings(self) -> dict[str, Any]:
        """The current strategy's settings as last set (by `train`, `update` or `switch`)."""
        return dict(self._control.state.settings) if hasattr(self, "_control") else dict(self._settings_values)

    @property
    def lr(self) -> float:
        """The learning rate as last set."""
        state = getattr(self, "_control", None)
        return state.state.lr if state is not None and state.state.lr is not None else self.job.lr

    @property
    def metrics(self) -> Any:
        """Per-step records of all workers as a pandas DataFrame."""
        return self.table.steps()

    @property
    def evaluations(self) -> Any:
        """Held-out evaluations made during training, as a DataFrame."""
        return self.table.evaluations()

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        return self.table.events(kind)

    def warnings(self) -> list[str]:
        """What the loss watch said about this run (not learning, loss climbing), oldest first."""
        return [event["message"] for event in self.table.events(WARNING_KIND)]

    def staleness(self) -> dict[int, dict[str, Any]]:
        """Per worker: pushes, staleness mean and max, histogram (parameter-server strategies)."""
        return self.table.staleness()

    def throughput(self, window_s: float | None = 5.0) -> dict[str, Any]:
        """Samples/s in total and per worker over the last `window_s` seconds (None: whole run)."""
        return self.table.throughput(window_s)

    def progress(self) -> float:
        """Fraction of the planned steps done by the slowest worker."""
        latest = self._current_last_steps()
        if not latest or not self.total_steps:
            return 0.0
        done = min(r["step"] + 1 for r in latest.values()) if len(latest) == len(self.worker_addresses) else 0
        return min(1.0, done / self.total_steps)

    def model(self) -> torch.nn.Module:
        """The trained model: the job's architecture with the final (synchronised) weights."""
        if self._state_dict is None:
            raise TrainingError(f"run {self.run_id} has no final weights (status {self.status}); wait() for it first")
        model = self.job.model()
        model.load_state_dict(self._state_dict)
        return model

    def evaluate(self, data: Any = None) -> dict[str, Any]:
        """Loss (and accuracy) of the trained model on held-out data (default: the job's)."""
        source = as_source(data, "data") if data is not None else self._prepared.evaluation
        if source is None:
            raise ConfigError("data", None, "held-out data: pass data= or set Job.eval_data")
        return evaluate(self.model(), source.load(), loss_function(self.job))

    def snapshot(self) -> dict[str, Any]:
        """Everything a live view of the run shows, as plain data (what the control panel renders).

        Cheap at any run length: built from running aggregates, with the loss curve at most 400 points.
        """
        view = self.table.live_view()
        rate = self.table.throughput(5.0)
        for row in view["workers"]:
            row["samples_per_s"] = rate["per_worker"].get(row["worker"], 0.0)
        try:
            dashboard = self.client.dashboard_link if self.client is not None else None
        except Exception:  # a scheduler without a dashboard
            dashboard = None
        directory = getattr(self, "directory", None)
        return {**view, "run_id": getattr(self, "run_id", None), "status": self.status, "strategy": self.strategy,
                "settings": self.settings, "lr": self.lr, "error": self.error, "progress": self.progress(),
                "total_steps": self.total_steps, "samples_per_s": rate["samples_per_s"],
                "markers": control_markers(self.table.events()), "dashboard": dashboard, "waiting": self.waiting(),
                "directory": str(directory.path) if directory is not None else None}

    def summary(self) -> dict[str, Any]:
        frame = self.table.steps()
        summary: dict[str, Any] = {"run_id": self.run_id, "status": self.status, "strategy": self.strategy,
                                   "total_steps": self.total_steps, "workers": len(self.worker_addresses)}
        if not frame.empty:
            rate = self.table.throughput(None)
            # The current group's ranks: a lost worker's rank may have stopped far earlier.
            current = frame[frame["worker"] < max(1, len(self.worker_addresses))]
            summary.update(steps_done=int(current.groupby("worker")["step"].max().min()) + 1,
                           samples_per_s=rate["samples_per_s"], final_loss=float(frame["loss"].tail(20).mean()),
                           time_split=time_split(frame))
            per_worker = {w: r for w, r in rate["per_worker"].items() if w < max(1, len(self.worker_addresses))}
            if per_worker:
                # The total hides a worker starved by a slow link or host (asynchronous strategies let
                # the others run on): the slowest worker says what the run gets out of each machine.
                slowest = min(per_worker, key=per_worker.get)
                summary.update(samples_per_s_per_worker={int(w): float(r) for w, r in sorted(per_worker.items())},
                               slowest_worker=int(slowest), slowest_worker_samples_per_s=float(per_worker[slowest]))
            staleness = staleness_summary(frame)
            if staleness:
                pushes = sum(s["pushes"] for s in staleness.values())
                summary["staleness"] = {
                    "mean": sum(s["mean"] * s["pushes"] for s in staleness.values()) / pushes,
                    "max": max(s["max"] for s in staleness.values()),
                    "per_worker": staleness}
            summary.update(communication_summary(frame))
        warnings = self.warnings()
        if warnings:
            summary["warnings"] = warnings
        if self.error:
            summary["error"] = self.error
        return summary

    def rerun(self, strategy: str | None = None, **settings: Any) -> Run:
        """Start a new run of the same job on the same cluster (this run's strategy and settings unless
        given), in the same parent run directory."""
        if strategy is None:
            strategy, settings = self.strategy, {**self.settings, **settings}
        return train(self.job, strategy, client=self.client, workers=self._requested_workers,
                     run_dir=self._run_root, collective_timeout_s=self._collective_timeout_s,
                     checkpoint_every_steps=self.checkpoint_every_steps, checkpoint_every_s=self.checkpoint_every_s,
                     min_workers=self.min_workers, auto_join=self.auto_join, queue=self.queue, **settings)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """In a notebook a run shows as what the UI registers under the `workbench.display` entry point
        (its control panel), made on the first display and kept, so that every display is the same live
        view; plain text where no UI is installed or ipywidgets are missing. The engine names no UI."""
        from .extensions import DISPLAY, load

        if self._panel is None:
            try:
                make = load(DISPLAY, "run")
            except ImportError:
                make = None
            if make is None:
                return {"text/plain": repr(self)}
            self._panel = make(self)
        return self._panel._repr_mimebundle_(include=include, exclude=exclude)

    def __repr__(self) -> str:
        return (f"<Run {getattr(self, 'run_id', '?')} strategy={self.strategy} status={self.status} "
                f"workers={len(self.worker_addresses)} progress={self.progress():.0%}>")


def _check_batch_fits_shard(batch_size: int, shard_samples: int, world_size: int) -> None:
    if batch_size > shard_samples:
        raise ConfigError("batch_size", batch_size,
                          f"at most {shard_samples}, the samples in each of the {world_size} workers' shards",
                          "Lower batch_size or use fewer workers")


def _age(checkpoint: dict[str, Any]) -> tuple[int, int, bool]:
    """Orders checkpoints of one run: later groups, then later steps, then a group's final one."""
    return checkpoint.get("generation", -1), checkpoint["step"], bool(checkpoint.get("final"))


def _rescaled_step(checkpoint: dict[str, Any], world_size: int, steps_per_epoch: int, job: Job) -> int:
    """Where a group of another size starts: at the same share of the data seen (epochs of the run),
    unless the job counts steps per worker (`steps=`), which it keeps."""
    old_steps_per_epoch, old_world = checkpoint.get("steps_per_epoch"), checkpoint.get("world_size")
    if job.steps is not None or not old_steps_per_epoch or not old_world:
        return checkpoint["step"]
    epoch, batch = checkpoints.data_position(checkpoint["step"], old_steps_per_epoch)
    return epoch * steps_per_epoch + min(steps_per_epoch - 1, batch * old_world // world_size)


def _system_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in the environment (some containers)
        return "unknown"
