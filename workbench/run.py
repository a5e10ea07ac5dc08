"""The client-side run handle: starts a job on the cluster without blocking, and controls and observes it.

`train()` validates everything on the client, writes the run directory, subscribes to the run's metrics
topic, publishes the control state and submits one long-lived task per worker. A supervisor thread waits
for the tasks, stops the others when one fails, and collects the final weights.
"""
from __future__ import annotations

import dataclasses
import datetime
import getpass
import importlib
import json
import queue
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

import torch
from distributed import Client
from distributed.comm import get_address_host

from . import collectives
from .control import ControlState, ControlWriter
from .data import BuiltinData, DaskArrayData, DataSource, as_source
from .errors import ClusterError, ConfigError, TrainingError
from .evaluation import evaluate
from .job import Job, PreparedJob, check_lr, loss_function
from .metrics import (MetricsTable, communication_summary, control_markers, expand, staleness_summary, time_split,
                      topic)
from .registry import CONTROL_ACTIONS, RUNS_TOPIC, requests_topic
from .rundir import CONFIG_FILE, SUMMARY_FILE, RunDirectory
from .sharding import assign_blocks, shard_size
from .strategies import get_strategy, make_settings
from .worker import WorkerTask, train_on_worker

FINISHED_STATES = ("finished", "stopped", "failed")


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
          start: bool = True, owner: str | None = None, **settings: Any) -> Run:
    """Start training `job` on the cluster behind `client` and return its `Run` at once (non-blocking).

    strategy: a name from `workbench.STRATEGIES`; `settings` are that strategy's settings (e.g. period=4).
    workers: how many of the cluster's workers train (default: all).
    run_dir: parent directory of the run's own directory (config, metrics, weights).
    start: False returns the run unstarted, for `run.start()` later (or the panel's Start button).
    owner: who the run belongs to (default: the operating-system user); on a team dashboard with
    authentication, this user and the listed admins may control the run.
    In a notebook the run displays as its control panel.
    """
    run = Run(job, strategy, client=client, workers=workers, run_dir=run_dir, name=name,
              collective_timeout_s=collective_timeout_s, settings=settings, owner=owner)
    if start:
        run.start()
    return run


class Run:
    """A training run: status, live metrics, control, and the trained model."""

    def __init__(self, job: Job, strategy: str, *, client: Client | None, workers: int | None,
                 run_dir: str | Path, name: str | None, collective_timeout_s: float,
                 settings: dict[str, Any], step_delays: dict[int, float] | None = None,
                 owner: str | None = None) -> None:
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
        self.client = client
        self.table = MetricsTable()
        self.status = "created"
        self.error: str | None = None
        self.total_steps = 0
        self.worker_addresses: list[str] = []
        self._futures: list[Any] = []
        self._state_dict: dict[str, torch.Tensor] | None = None
        self._finished_workers: set[int] = set()
        self._events = threading.Condition()
        self._supervisor: threading.Thread | None = None
        self._prepared: PreparedJob | None = None
        self._panel: Any = None  # the notebook control panel, made when the run is first displayed
        self._requests: queue.SimpleQueue = queue.SimpleQueue()  # control requests from other clients

    # --- starting -------------------------------------------------------------------------------------

    def start(self) -> None:
        """Validate everything, then start the workers; returns at once."""
        if self.status != "created":
            raise TrainingError(f"run {self.run_id} was started already ({self.status}); use rerun() for another")
        prepared = self._prepared = self.job.prepare()
        strategy_class = get_strategy(self.strategy)
        settings = make_settings(self.strategy, self._settings_values)
        if not isinstance(self._collective_timeout_s, (int, float)) or not self._collective_timeout_s > 0:
            raise ConfigError("collective_timeout_s", self._collective_timeout_s, "a number of seconds > 0")
        client = self.client = self._resolve_client(self.client)
        addresses = self.worker_addresses = self._choose_workers(client)
        world_size = len(addresses)
        strategy_class.check_world(settings, world_size)

        train_payload, shard_samples, local = self._place_training_data(client, prepared.train, addresses)
        if prepared.job.batch_size > shard_samples:
            raise ConfigError("batch_size", prepared.job.batch_size,
                              f"at most {shard_samples}, the samples in each of the {world_size} workers' shards",
                              "Lower batch_size or use fewer workers")
        self.total_steps = prepared.total_steps(shard_samples)

        self.run_id = self._name or (f"{self.strategy}-{datetime.datetime.now():%Y%m%d-%H%M%S}-"
                                     f"{uuid.uuid4().hex[:6]}")
        self.directory = RunDirectory(Path(self._run_root) / self.run_id)
        self.config = {
            "run_id": self.run_id, "strategy": self.strategy, "settings": dataclasses.asdict(settings),
            "job": prepared.job.describe(), "workers": addresses, "world_size": world_size,
            "shard_samples": shard_samples, "total_steps": self.total_steps,
            "parameters": prepared.n_parameters, "scheduler": client.scheduler.address,
            "started": time.time(), "owner": self.owner, "directory": str(self.directory.path.resolve()),
        }
        self.directory.write_json(CONFIG_FILE, self.config)
        self.directory.append([{"kind": "run-started", "time": time.time(), "strategy": self.strategy,
                                "settings": dataclasses.asdict(settings)}])

        client.subscribe_topic(topic(self.run_id), self._on_message)
        client.subscribe_topic(requests_topic(self.run_id), self._on_request)
        self._control = ControlWriter(client, self.run_id, ControlState(
            lr=self.job.lr, strategy=self.strategy, settings=dataclasses.asdict(settings)))
        # Every run has a process group (see worker.py), on a port free on rank 0's machine.
        host = get_address_host(addresses[0])
        port = client.run(collectives.find_free_port, workers=[addresses[0]])[addresses[0]]
        eval_payload = self._scatter(client, prepared.evaluation, addresses[:1])
        for rank, address in enumerate(addresses):
            task = WorkerTask(
                run_id=self.run_id, rank=rank, world_size=world_size, job=self.job, strategy=self.strategy,
                settings=settings, shard_samples=shard_samples, total_steps=self.total_steps,
                local_data=local, master_host=host, master_port=port,
                collective_timeout_s=self._collective_timeout_s, addresses=addresses,
                step_delay_s=self._step_delays.get(rank, 0.0),
            )
            data = train_payload[address] if local else train_payload
            self._futures.append(client.submit(
                train_on_worker, task, data, eval_payload if rank == 0 else None,
                key=f"workbench-{self.run_id}-rank-{rank}", workers=[address], allow_other_workers=False,
                pure=False, retries=0,
            ))
        self.status = "running"
        self._announce("run-registered", **json.loads(json.dumps(self.config, default=str)))
        threading.Thread(target=self._serve_requests, name=f"workbench-requests-{self.run_id}", daemon=True).start()
        self._supervisor = threading.Thread(target=self._supervise, name=f"workbench-{self.run_id}", daemon=True)
        self._supervisor.start()

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

    def _choose_workers(self, client: Client) -> list[str]:
        available = sorted(client.scheduler_info(n_workers=-1)["workers"])
        requested = self._requested_workers
        if requested is None:
            requested = len(available)
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ConfigError("workers", requested, "an integer >= 1")
        if not available:
            raise ClusterError("the cluster has no workers; start some (dask worker ADDRESS) and try again")
        if requested > len(available):
            raise ConfigError("workers", requested, f"at most {len(available)}, the workers in this cluster",
                              "Start more workers or ask for fewer")
        return available[:requested]

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
        with self._events:  # wakes `wait_for_step`, `wait_for_event` and the supervisor
            if message.get("kind") in ("worker-finished", "worker-failed"):
                self._finished_workers.add(message["rank"])
            self._events.notify_all()

    def _supervise(self) -> None:
        try:
            self._supervise_tasks()
        except BaseException as error:  # never leave the run looking alive when supervision itself broke
            self.error = f"supervising the run failed: {type(error).__name__}: {error}"
            self.status = "failed"
            raise
        finally:
            self._requests.put(None)  # ends the thread serving other clients' control requests

    def _supervise_tasks(self) -> None:
        futures = self._futures
        FutureWatch(futures).wait(until_first_error=True)
        if any(f.status == "error" for f in futures):
            # Stop the others cooperatively; ones blocked in a collective fail when the peer leaves.
            self._control.update(stop=True)
            FutureWatch(futures).wait(timeout=self._collective_timeout_s + 30)
        errors = []
        for rank, future in enumerate(futures):
            if future.status == "error":
                exception, tb = future.exception(), future.traceback()
                errors.append(f"worker {rank} ({self.worker_addresses[rank]}) failed: "
                              f"{type(exception).__name__}: {exception}\n"
                              + ("".join(traceback.format_tb(tb)) if tb else ""))
            elif future.status == "finished":
                result = future.result()
                if result["state_dict"] is not None:
                    self._state_dict = result["state_dict"]
        with self._events:  # the workers' last metrics may trail their results by a moment
            self._events.wait_for(lambda: len(self._finished_workers) >= len(futures), timeout=5)
        for name in (topic(self.run_id), requests_topic(self.run_id)):
            try:
                self.client.unsubscribe_topic(name)
            except Exception:
                pass
        self._control.delete()
        if errors:
            self.error = "\n".join(errors)
            self.status = "failed"
        else:
            stopped = any(f.result()["stopped"] for f in futures)
            self.status = "stopped" if stopped else "finished"
            if self._state_dict is not None:
                self.directory.save_model(self._state_dict)
        self.directory.append([{"kind": f"run-{self.status}", "time": time.time(), "error": self.error}])
        summary = self.summary()
        self.directory.write_json(SUMMARY_FILE, summary)
        self.directory.close()
        self._announce("run-status", samples_per_s=summary.get("samples_per_s"), error=self.error)

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
        self._supervisor.join(timeout)
        if self._supervisor.is_alive():
            raise TimeoutError(f"run {self.run_id} still {self.status} after {timeout} s")
        if self.status == "failed":
            raise TrainingError(f"run {self.run_id} failed:\n{self.error}")
        return self.status

    def wait_for_step(self, step: int, timeout: float = 60.0) -> None:
        """Block until every worker has trained past `step` (or the run ended: TrainingError)."""
        def reached() -> bool:
            latest = self.table.last_steps()
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

    def _require_running(self) -> None:
        """Refuse a control action on a run that has not started or has ended."""
        if self.status == "created":
            raise TrainingError("the run has not started yet: call start() first (or train() without start=False)")
        if self.done:
            raise TrainingError(f"run {self.run_id} has already ended ({self.status})")

    def pause(self) -> None:
        """Workers stop after their current step (at the next agreed step) until `resume()`."""
        if self.status == "created":
            self._require_running()
        if not self.done:
            self._control.update(paused=True)
            self.status = "paused"
            self._announce("run-status")

    def resume(self) -> None:
        if self.status == "created":
            self._require_running()
        if not self.done:
            self._control.update(paused=False)
            self.status = "running"
            self._announce("run-status")

    def stop(self) -> None:
        """End the run cleanly: workers finish their step, synchronise, and the final weights are kept."""
        if self.status != "created" and not self.done:
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

    def staleness(self) -> dict[int, dict[str, Any]]:
        """Per worker: pushes, staleness mean and max, histogram (parameter-server strategies)."""
        return self.table.staleness()

    def throughput(self, window_s: float | None = 5.0) -> dict[str, Any]:
        """Samples/s in total and per worker over the last `window_s` seconds (None: whole run)."""
        return self.table.throughput(window_s)

    def progress(self) -> float:
        """Fraction of the planned steps done by the slowest worker."""
        latest = self.table.last_steps()
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
                "markers": control_markers(self.table.events()), "dashboard": dashboard,
                "directory": str(directory.path) if directory is not None else None}

    def summary(self) -> dict[str, Any]:
        frame = self.table.steps()
        summary: dict[str, Any] = {"run_id": self.run_id, "status": self.status, "strategy": self.strategy,
                                   "total_steps": self.total_steps, "workers": len(self.worker_addresses)}
        if not frame.empty:
            rate = self.table.throughput(None)
            summary.update(steps_done=int(frame.groupby("worker")["step"].max().min()) + 1,
                           samples_per_s=rate["samples_per_s"], final_loss=float(frame["loss"].tail(20).mean()),
                           time_split=time_split(frame))
            staleness = staleness_summary(frame)
            if staleness:
                pushes = sum(s["pushes"] for s in staleness.values())
                summary["staleness"] = {
                    "mean": sum(s["mean"] * s["pushes"] for s in staleness.values()) / pushes,
                    "max": max(s["max"] for s in staleness.values()),
                    "per_worker": staleness}
            summary.update(communication_summary(frame))
        if self.error:
            summary["error"] = self.error
        return summary

    def rerun(self, strategy: str | None = None, **settings: Any) -> Run:
        """Start a new run of the same job on the same cluster (this run's strategy and settings unless
        given), in the same parent run directory."""
        if strategy is None:
            strategy, settings = self.strategy, {**self.settings, **settings}
        return train(self.job, strategy, client=self.client, workers=self._requested_workers,
                     run_dir=self._run_root, collective_timeout_s=self._collective_timeout_s, **settings)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """In a notebook a run shows as its control panel (`widgets.ControlPanel`), found by name at
        display time so that the engine never imports the UI; plain text where ipywidgets are missing."""
        try:
            control_panel = importlib.import_module("widgets.control_panel")
        except ImportError:
            return {"text/plain": repr(self)}
        if self._panel is None:
            self._panel = control_panel.ControlPanel(self)
        return self._panel._repr_mimebundle_(include=include, exclude=exclude)

    def __repr__(self) -> str:
        return (f"<Run {getattr(self, 'run_id', '?')} strategy={self.strategy} status={self.status} "
                f"workers={len(self.worker_addresses)} progress={self.progress():.0%}>")


def _system_user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user name in the environment (some containers)
        return "unknown"
