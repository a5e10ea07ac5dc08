"""Live export of a run's records to the tools a team already uses: TensorBoard event files and MLflow.

`train(..., tensorboard=True, mlflow=True)` (CLI: `--tensorboard [DIR]`, `--mlflow [URI]`). Records reach
the client on Dask's IO-loop thread, where nothing may block: `Exports.put` only queues them, and one
thread of the run's writes them out every half second, so TensorBoard and MLflow see a run as it trains
and a slow disk or database never delays the metrics stream.

What is written, the same to both (`SecondTotals`, pure): per wall-clock second, the run's mean loss,
total samples/s, mean staleness and the mean compute, communication and wait time of a step, each at
the newest step of that second; per worker its loss and samples/s; every held-out evaluation at its
step; the run's events (switches, lost workers, `auto`'s decisions, warnings) as text in TensorBoard and
as tags in MLflow. TensorBoard also gets every step's loss per worker. Layout follows each tool's own
conventions: TensorBoard one directory per run (`tensorboard --logdir runs` compares runs), with a
subdirectory per worker so that the workers' curves share one chart; MLflow one run per workbench run in
the experiment `MLFLOW_EXPERIMENT_NAME` (default "workbench"), its parameters the strategy, settings and
job, its status FINISHED, KILLED or FAILED at the end. A resumed run goes on in the same TensorBoard
directory and the same MLflow run.
"""
from __future__ import annotations

import collections
import json
import os
import threading
import time
from pathlib import Path
from queue import Empty, SimpleQueue
from typing import Any

from workbench.errors import ConfigError
from workbench.plane import kinds

WRITE_EVERY_S = 0.5  # how often the export thread writes what arrived
SETTLE_S = 2.0  # a second is complete this long after it ended (workers send their records every 0.25 s)
EVENT_KINDS = (kinds.SWITCHED, kinds.WORKER_LOST, kinds.REGROUPED, kinds.AUTO_DECISION, kinds.AUTO_PINNED,
               kinds.AUTO_ON, kinds.TRAINING_WARNING, kinds.CONTROL, kinds.RUN_RESUMED, kinds.CHECKPOINT)
MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


class SecondTotals:
    """Step records folded into one point per wall-clock second (pure: no I/O).

    `add` takes records in any order within the settle window; `complete(now)` returns the seconds no
    record still on its way can change any more (by the clock, so a paused run's last seconds come out
    too), oldest first, and forgets them; `complete(None)` returns the rest.
    """

    def __init__(self) -> None:
        self._seconds: dict[int, dict[str, Any]] = {}

    def add(self, record: dict[str, Any]) -> None:
        second = int(record["time"])
        bucket = self._seconds.setdefault(second, {"step": 0, "sums": collections.Counter(),
                                                    "counts": collections.Counter(),
                                                    "workers": collections.defaultdict(collections.Counter)})
        bucket["step"] = max(bucket["step"], int(record["step"]))
        for key in ("loss", "staleness", "compute_s", "comm_s", "wait_s"):
            if record.get(key) is not None:
                bucket["sums"][key] += float(record[key])
                bucket["counts"][key] += 1
        bucket["sums"]["samples"] += record.get("samples", 0)
        worker = bucket["workers"][int(record["worker"])]
        worker["loss"] += float(record["loss"])
        worker["records"] += 1
        worker["samples"] += record.get("samples", 0)

    def complete(self, now: float | None) -> list[tuple[int, int, dict[str, float]]]:
        """(second, step, {metric: value}) for each settled second."""
        done = sorted(s for s in self._seconds if now is None or s + 1 + SETTLE_S <= now)
        points = []
        for second in done:
            bucket = self._seconds.pop(second)
            values = {key: bucket["sums"][key] / bucket["counts"][key] for key in bucket["counts"]}
            values["samples_per_s"] = float(bucket["sums"]["samples"])
            for rank, worker in sorted(bucket["workers"].items()):
                values[f"worker_{rank}/loss"] = worker["loss"] / worker["records"]
                values[f"worker_{rank}/samples_per_s"] = float(worker["samples"])
            points.append((second, bucket["step"], values))
        return points


def evaluation_values(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a held-out evaluation record, as `eval/<name>`."""
    return {f"eval/{key}": float(value) for key, value in record.items()
            if key not in ("kind", "worker", "step", "epoch", "samples", "time", "generation", "address", "eval_s")
            and isinstance(value, (int, float)) and not isinstance(value, bool)}


def event_text(record: dict[str, Any]) -> str:
    """One line for a run event: its kind and its fields (time and worker left out)."""
    fields = {k: v for k, v in record.items() if k not in ("kind", "time", "worker") and v is not None}
    return f"{record['kind']}: {json.dumps(fields, default=str, sort_keys=True)}"


class TensorBoardSink:
    """Event files under `logdir` (the run's), one subdirectory per worker for the per-worker curves."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer_type = SummaryWriter
        self.logdir = logdir
        self._main = SummaryWriter(str(logdir))
        self._workers: dict[str, Any] = {}

    def _worker(self, name: str) -> Any:
        if name not in self._workers:
            self._workers[name] = self._writer_type(str(self.logdir / name))
        return self._workers[name]

    def steps(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self._worker(f"worker_{record['worker']}").add_scalar("loss/step", record["loss"], record["step"],
                                                                   walltime=record["time"])

    def point(self, second: int, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            if key.startswith("worker_"):  # worker_3/loss -> the worker's writer, tag loss: one chart, all workers
                name, tag = key.split("/", 1)
                self._worker(name).add_scalar(tag, value, step, walltime=second + 1)
            else:
                self._main.add_scalar(key, value, step, walltime=second + 1)

    def evaluation(self, step: int, when: float, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._main.add_scalar(key, value, step, walltime=when)

    def event(self, step: int, when: float, text: str) -> None:
        self._main.add_text("events", text, step, walltime=when)

    def flush(self) -> None:
        for writer in (self._main, *self._workers.values()):
            writer.flush()

    def close(self, status: str) -> None:
        self._main.add_text("status", status)
        for writer in (self._main, *self._workers.values()):
            writer.close()


class MlflowSink:
    """One MLflow run per workbench run, through `MlflowClient` (no global active run: several runs of
    one process export side by side)."""

    def __init__(self, tracking_uri: str, config: dict[str, Any], directory: Path, mlflow_run_id: str | None) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._tag = Metric, RunTag
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.tracking_uri, self.directory = tracking_uri, directory
        self._events = 0  # events are tags event.0001, event.0002, ...
        if mlflow_run_id is not None:  # a resumed run goes on in its MLflow run, numbering events on
            self.run_id = mlflow_run_id
            self.client.update_run(mlflow_run_id, status="RUNNING")
            self._events = sum(key.startswith("event.") for key in self.client.get_run(mlflow_run_id).data.tags)
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "workbench")
            experiment = self.client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment
                             else self.client.create_experiment(name, artifact_location=_artifacts_beside(tracking_uri)))
            self.run_id = self.client.create_run(experiment_id, run_name=config["run_id"], tags={
                "workbench.run_id": config["run_id"], "workbench.owner": str(config.get("owner")),
                "workbench.directory": str(config.get("directory"))}).info.run_id
            params = {"strategy": config["strategy"], "world_size": config["world_size"],
                      **{f"settings.{k}": v for k, v in config["settings"].items()},
                      **{f"job.{k}": v for k, v in config["job"].items()}}
            self.client.log_batch(self.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
        self._pending: list[Any] = []
        self._tags: list[Any] = []

    def steps(self, records: list[dict[str, Any]]) -> None:
        pass  # MLflow gets the per-second points only: a row per metric and step is what its store costs

    def point(self, second: int, step: int, values: dict[str, float]) -> None:
        self._pending += [self._metric(key, value, (second + 1) * 1000, step) for key, value in values.items()]

    def evaluation(self, step: int, when: float, values: dict[str, float]) -> None:
        self._pending += [self._metric(key, value, int(when * 1000), step) for key, value in values.items()]

    def event(self, step: int, when: float, text: str) -> None:
        self._events += 1
        self._tags.append(self._tag(f"event.{self._events:04d}", f"step {step}: {text}"[:5000]))

    def flush(self) -> None:
        while self._pending or self._tags:  # log_batch takes at most 1000 metrics and 100 tags a call
            metrics, self._pending = self._pending[:1000], self._pending[1000:]
            tags, self._tags = self._tags[:100], self._tags[100:]
            self.client.log_batch(self.run_id, metrics=metrics, tags=tags)

    def close(self, status: str) -> None:
        self.flush()
        for name in ("config.json", "summary.json"):
            if (self.directory / name).exists():
                self.client.log_artifact(self.run_id, str(self.directory / name))
        self.client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FINISHED"))


def _artifacts_beside(tracking_uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: beside a local SQLite store (`<its folder>/mlruns`),
    not MLflow's default of `./mlruns` in whatever directory the process runs in; elsewhere the store's
    own default (None)."""
    prefix = "sqlite:///"
    if not tracking_uri.startswith(prefix):
        return None
    return (Path(tracking_uri[len(prefix):]).resolve().parent / "mlruns").as_uri()


def default_mlflow_uri() -> str:
    """MLflow's own default: `MLFLOW_TRACKING_URI`, else a SQLite store `mlflow.db` in the working
    directory (MLflow 3.7 moved its default there from ./mlruns, whose file store it now refuses)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path('mlflow.db').resolve()}"


def check_export_options(tensorboard: Any, mlflow: Any) -> None:
    """Bad export options are refused before anything starts, naming the option; so is a missing library."""
    for name, value, module, allowed, install in (
            ("tensorboard", tensorboard, "torch.utils.tensorboard",
             "False, True (event files in the run's directory) or a directory (a subdirectory per run)",
             "pip install -e '.[export]' (tensorboard, mlflow-skinny, sqlalchemy, alembic)"),
            ("mlflow", mlflow, "mlflow.tracking",
             "False, True (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db here) or a tracking URI",
             "pip install -e '.[export]' (tensorboard, mlflow-skinny, sqlalchemy, alembic)")):
        if value is False or value is None:
            continue
        if not (value is True or (isinstance(value, (str, os.PathLike)) and str(value).strip())):
            raise ConfigError(name, value, allowed)
        try:
            __import__(module)
        except ImportError as error:
            raise ConfigError(name, value, f"{allowed}, with the library installed",
                              f"{error}: {install}") from None


class Exports:
    """The run's exports: records queued from the IO loop, written by one thread of their own."""

    def __init__(self, sinks: list[Any], first_step: int = 0) -> None:
        self.sinks = sinks
        self._queue: SimpleQueue = SimpleQueue()
        self._totals = SecondTotals()
        # The run's progress (its largest step so far): events are written at it, never at a step behind
        # it, since TensorBoard takes a step going back for a restart and drops what came after.
        self._step = first_step
        self._closed = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="workbench-export", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, tensorboard: Any, mlflow: Any, config: dict[str, Any], directory: Path,
             earlier: dict[str, Any] | None) -> Exports | None:
        """The exports asked for (None when none), and what `config['export']` records of them; `earlier`
        is a resumed run's record, to go on in the same places."""
        earlier = earlier or {}
        sinks: list[Any] = []
        record: dict[str, Any] = {}
        if tensorboard:
            logdir = directory if tensorboard is True else Path(tensorboard) / directory.name
            if tensorboard is True and earlier.get("tensorboard"):
                logdir = Path(earlier["tensorboard"])  # resumed: on in the same event directory
            sinks.append(TensorBoardSink(logdir))
            record["tensorboard"] = str(logdir.resolve())
        if mlflow:
            previous = earlier.get("mlflow") or {}
            uri = default_mlflow_uri() if mlflow is True else str(mlflow)
            if previous and (mlflow is True or uri == previous["tracking_uri"]):
                uri = previous["tracking_uri"]  # resumed: on in the same MLflow run
            else:
                previous = {}
            sink = MlflowSink(uri, config, directory, previous.get("run_id"))
            sinks.append(sink)
            record["mlflow"] = {"tracking_uri": uri, "run_id": sink.run_id}
        config["export"] = record
        return cls(sinks, first_step=int(config.get("resumed_from_step") or 0)) if sinks else None

    def put(self, records: list[dict[str, Any]]) -> None:
        """On the IO loop: queue only."""
        self._queue.put(records)

    def _loop(self) -> None:
        while not self._closed.wait(WRITE_EVERY_S):
            self._write(final=False)

    def _write(self, final: bool) -> None:
        batches = []
        while True:
            try:
                batches.append(self._queue.get_nowait())
            except Empty:
                break
        try:
            for records in batches:
                self._take(records)
            for second, step, values in self._totals.complete(None if final else time.time()):
                for sink in self.sinks:
                    sink.point(second, step, values)
            for sink in self.sinks:
                sink.flush()
        except Exception as error:  # an export must never take the run down: say so once, keep training
            if self.error is None:
                self.error = f"{type(error).__name__}: {error}"

    def _take(self, records: list[dict[str, Any]]) -> None:
        steps = [r for r in records if r.get("kind") == kinds.STEP]
        for record in steps:
            self._totals.add(record)
            self._step = max(self._step, int(record["step"]))
        if steps:
            for sink in self.sinks:
                sink.steps(steps)
        for record in records:
            kind, when = record.get("kind"), record.get("time", 0.0)
            if kind == kinds.EVAL:
                values = evaluation_values(record)
                for sink in self.sinks:
                    sink.evaluation(int(record.get("step", self._step)), when, values)
            elif kind in EVENT_KINDS:  # at the run's progress; the record's own step is in its text
                for sink in self.sinks:
                    sink.event(self._step, when, event_text(record))

    def close(self, status: str) -> None:
        """Write everything left and end each export with the run's final status (after the run
        directory's summary is written: MLflow keeps config.json and summary.json as artifacts)."""
        self._closed.set()
        self._thread.join(timeout=30)
        self._write(final=True)
        for sink in self.sinks:
            try:
                sink.close(status)
            except Exception as error:
                self.error = self.error or f"{type(error).__name__}: {error}"
