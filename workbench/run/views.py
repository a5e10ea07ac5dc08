"""What a run shows: metrics, staleness, throughput, progress, the trained model and its evaluation,
the summary (written at the end, printed by the CLI) and the live snapshot the control panel renders,
all read from the metrics table and the run's record. `RunViews` gives `Run` these methods."""
from __future__ import annotations

import time
from typing import Any

import torch

from workbench.data import as_source
from workbench.errors import ConfigError, TrainingError
from workbench.evaluation import evaluate
from workbench.job import loss_function
from workbench.plane import kinds
from workbench.run.timeouts import in_force
from workbench.strategies import STRATEGIES
from workbench.plane.metrics import best_metric, communication_summary, control_markers, staleness_summary, time_split


def live_view(table: Any, **options: Any) -> dict[str, Any]:
    """The live view of a run's metrics table, the one the notebook panel (through `snapshot`) and the
    team dashboard (its hub) both draw: the curves (thinned, `options` as `MetricsTable.live_view` takes
    them), each worker's row with its rate over the last 5 s, the total rate and the control markers.
    Cheap at any run length: built from running aggregates."""
    view = table.live_view(**options)
    rate = table.throughput(5.0)
    for row in view["workers"]:
        row["samples_per_s"] = rate["per_worker"].get(row["worker"], 0.0)
    deadlines = table.events(kinds.DEADLINE)
    return {**view, "samples_per_s": rate["samples_per_s"], "markers": control_markers(table.events()),
            "link": table.link_limit(paced_by_slowest), "deadline": deadlines[-1] if deadlines else None}


def paced_by_slowest(strategy: str | None) -> bool:
    """Whether a strategy's ranks go at the slowest one's pace (in step, or within a bound of it)."""
    known = STRATEGIES.get(strategy or "")
    # One this client does not know: the cautious reading, at the slowest worker's pace.
    return known.traits.paced_by_slowest if known is not None else True


def snapshot(run: Any) -> dict[str, Any]:
    """Everything a live view of the run shows in a notebook: the live view and the run's own state."""
    view = live_view(run.table)
    try:
        dashboard = run.client.dashboard_link if run.client is not None else None
    except Exception:  # a scheduler without a dashboard
        dashboard = None
    return {**view, "run_id": getattr(run, "run_id", None), "status": run.status, "strategy": run.strategy,
            "settings": run.settings, "lr": run.lr, "error": run.error, "progress": run.progress(),
            "total_steps": run.total_steps, "dashboard": dashboard, "waiting": run.waiting(),
            "directory": str(run.directory.path) if run.directory is not None else None}


def summary(run: Any) -> dict[str, Any]:
    """Status, steps done, throughput (total, per worker, the slowest), loss, time split, staleness,
    communication, warnings and error."""
    frame = run.table.steps()
    workers = len(run.worker_addresses)
    result: dict[str, Any] = {"run_id": run.run_id, "status": run.status, "strategy": run.strategy,
                              "total_steps": run.total_steps, "workers": workers}
    if not frame.empty:
        rate = run.table.throughput(None)
        # The current group's ranks: a lost worker's rank may have stopped far earlier.
        current = frame[frame["worker"] < max(1, workers)]
        result.update(steps_done=int(current.groupby("worker")["step"].max().min()) + 1,
                      samples_per_s=rate["samples_per_s"], final_loss=float(frame["loss"].tail(20).mean()),
                      time_split=time_split(frame))
        per_worker = {w: r for w, r in rate["per_worker"].items() if w < max(1, workers)}
        if per_worker:
            # The total hides a worker starved by a slow link or host (asynchronous strategies let the
            # others run on): the slowest worker says what the run gets out of each machine.
            slowest = min(per_worker, key=per_worker.get)
            result.update(samples_per_s_per_worker={int(w): float(r) for w, r in sorted(per_worker.items())},
                          slowest_worker=int(slowest), slowest_worker_samples_per_s=float(per_worker[slowest]))
        staleness = staleness_summary(frame)
        if staleness:
            pushes = sum(s["pushes"] for s in staleness.values())
            result["staleness"] = {"mean": sum(s["mean"] * s["pushes"] for s in staleness.values()) / pushes,
                                   "max": max(s["max"] for s in staleness.values()), "per_worker": staleness}
        result.update(communication_summary(frame))
        link = run.table.link_limit(paced_by_slowest)
        if link is not None:  # what the link alone would allow, and the share of it the run reaches
            result["link"] = link
    # Always present (None without evaluations): the dashboard lists an ended run from its summary alone
    # and reads its metrics only when someone opens it.
    result["best_metric"] = best_metric(run.table.events(kinds.EVAL))
    warnings = run.warnings()
    if warnings:
        result["warnings"] = warnings
    deadlines = run.table.events(kinds.DEADLINE)
    if deadlines:  # the timeout in force at the end, and where it came from (plane/deadline.py)
        result["deadline"] = {k: deadlines[-1].get(k) for k in ("timeout_s", "how", "longest_wait_s", "strategy")}
    recovered = run.table.events(kinds.RECOVERED)
    if recovered:  # each regroup after lost workers: its phases (run/recovery.py)
        result["recoveries"] = [{k: e[k] for k in ("lost", "generation", "from_step", "phases_s", "total_s")}
                                for e in recovered]
    if getattr(run, "exports", None) is not None and run.exports.error:  # training went on without it
        result["export_error"] = run.exports.error
    if getattr(run, "auto_pilot", None) is not None:  # strategy='auto': what it chose, and why
        result["auto"] = {"on": run.auto_pilot.on, "decisions": [
            {k: e.get(k) for k in ("step", "from", "to", "settings", "lr", "reason")}
            for e in run.table.events(kinds.AUTO_DECISION)]}
    if run.error:
        result["error"] = run.error
    return result


class RunViews:
    """The read-only side of `Run`: what a user or a view asks a run to show."""

    @property
    def timeout_in_force_s(self) -> float:
        """The longest a wait on another worker may take now: the user's `collective_timeout_s`, or the one
        measured for the running strategy (plane/deadline.py; held in the run's control state)."""
        return in_force(self.control.state.timeout_s if self.control is not None else None, self.collective_timeout_s)

    table: Any
    control: Any
    job: Any
    feed: Any
    placement: Any
    _panel: Any
    lifecycle: Any
    supervisor: Any
    checkpoints: Any
    _generation_before: int

    # --- the run's record -----------------------------------------------------------------------------

    @property
    def status(self) -> str:
        """created, queued, running, paused, finished, stopped or failed (see `run/lifecycle.py`)."""
        return self.lifecycle.status

    @property
    def done(self) -> bool:
        return self.lifecycle.ended

    @property
    def error(self) -> str | None:
        """Why the run failed, or None."""
        return self.lifecycle.error

    @property
    def diverged(self) -> bool:
        return self.lifecycle.diverged

    @property
    def final_weights(self) -> dict[str, Any] | None:
        return self.lifecycle.final_weights

    @property
    def group(self) -> Any:
        """The workers training now (the supervisor starts and watches each group)."""
        return self.supervisor.group

    @property
    def generation(self) -> int:
        return self.group.generation if self.group else self._generation_before

    @property
    def worker_addresses(self) -> list[str]:
        return self.group.addresses if self.group else []

    @property
    def total_steps(self) -> int:
        return self.group.total_steps if self.group else 0

    @property
    def checkpoint_info(self) -> dict[str, Any] | None:
        """The newest checkpoint written: step, path, time, generation, and the workers that keep it in
        memory (`kept_on`: a regroup starts there without sending it)."""
        return self.checkpoints.info

    @property
    def settings(self) -> dict[str, Any]:
        """The current strategy's settings as last set (by `train`, `update` or `switch`)."""
        return dict(self.control.state.settings) if self.control is not None else dict(self._settings_values)

    @property
    def lr(self) -> float:
        """The learning rate as last set."""
        state = self.control.state if self.control is not None else None
        return state.lr if state is not None and state.lr is not None else self.job.lr

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
        return [event["message"] for event in self.table.events(kinds.TRAINING_WARNING)]

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
        if self.final_weights is None:
            raise TrainingError(f"run {self.run_id} has no final weights (status {self.status}); wait() for it first")
        model = self.job.model()
        model.load_state_dict(self.final_weights)
        return model

    def evaluate(self, data: Any = None) -> dict[str, Any]:
        """Loss (and accuracy) of the trained model on held-out data (default: the job's)."""
        source = as_source(data, "data") if data is not None else self.prepared.evaluation
        if source is None:
            raise ConfigError("data", None, "held-out data: pass data= or set Job.eval_data")
        return evaluate(self.model(), source.load(), loss_function(self.job))

    def snapshot(self) -> dict[str, Any]:
        """Everything a live view of the run shows, as plain data (what the control panel renders)."""
        return snapshot(self)

    def summary(self) -> dict[str, Any]:
        """Status, steps, throughput (total, per worker, slowest), loss, time split, staleness, traffic."""
        return summary(self)

    def _current_last_steps(self) -> dict[int, dict[str, Any]]:
        """The latest step record of each rank of the current group of workers."""
        return {rank: record for rank, record in self.table.last_steps().items()
                if rank is not None and rank < len(self.worker_addresses)}

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
        with self.feed.changed:
            while not condition():
                if self.done:
                    raise TrainingError(f"run {self.run_id} ended ({self.status}) before {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"run {self.run_id}: still waiting for {what} after {timeout} s")
                self.feed.changed.wait(min(remaining, 0.5))

    @property
    def queue_position(self) -> int | None:
        """While the run waits for workers: its place in the cluster's queue (1: next); else None."""
        return self.placement.position if self.status == "queued" and self.placement else None

    def waiting(self) -> str | None:
        """While the run waits for workers, what for and behind whom (one line); else None."""
        placement = self.placement
        if self.status != "queued" or placement is None:
            return None
        return (f"waits for {placement.wanted} free workers (place {placement.position} in the queue; "
                f"{placement.holders})")

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """In a notebook a run shows as what the UI registers under the `workbench.display` entry point
        (its control panel), made on the first display and kept, so that every display is the same live
        view; plain text where no UI is installed or ipywidgets are missing. The engine names no UI."""
        from workbench.extensions import DISPLAY, load

        if self._panel is None:
            try:
                make = load(DISPLAY, "run")
            except ImportError:
                make = None
            if make is None:
                return {"text/plain": repr(self)}
            self._panel = make(self)
        return self._panel._repr_mimebundle_(include=include, exclude=exclude)
