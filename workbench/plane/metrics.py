"""The metrics plane: per-step records batched on workers, streamed through Dask's event log, and kept
on the client as a bounded table.

Workers call `MetricsSender.record()` every step; records leave in batches a few times a second with
`log_event` on the run's topic. Any client subscribes to that topic. Pure helpers here compute
throughput and summaries from records, so they are tested without a cluster.
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from workbench.plane import kinds
from workbench.plane.link import LinkBook
from workbench.plane.deadline import WaitBook
from workbench.plane import worker_spread

if TYPE_CHECKING:  # pandas is imported where a table is made: a worker process never needs it (0.3 s)
    import pandas as pd

STEP_FIELDS = tuple(kinds.STEP_FIELDS)  # the loop's own fields of every step record


def topic(run_id: str) -> str:
    """The Dask event topic a run's metrics travel on."""
    return f"workbench-{run_id}"


def wire_form(value: Any) -> Any:
    """`value` as a Dask event carries it (msgpack): mapping keys as strings, numpy scalars as Python
    numbers, containers walked. The scheduler refuses anything else with a TypeError, and a record of
    the client's own (an auto decision, keyed by worker) then reached no other viewer."""
    if isinstance(value, dict):
        return {key if isinstance(key, str) else str(key): wire_form(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [wire_form(item) for item in value]
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a numpy or torch scalar
        return value.item()
    return value


class MetricsSender:
    """Worker side: collects step records and sends them in batches through `send` (injected)."""

    def __init__(self, send: Callable[[dict[str, Any]], None], worker: int, flush_interval_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._send = send
        self._worker = worker
        self._interval = flush_interval_s
        self._clock = clock
        self._pending: list[dict[str, Any]] = []
        self._last_flush = clock()

    def record(self, record: dict[str, Any]) -> None:
        self._pending.append(record)
        if self._clock() - self._last_flush >= self._interval:
            self.flush()

    def event(self, kind: str, **fields: Any) -> None:
        """Send a one-off record (lifecycle, evaluation) at once, after any pending steps to keep order."""
        self.flush()
        # Top-level "worker" is taken by Dask (it writes the worker's address there), hence "rank".
        self._send({"kind": kind, "rank": self._worker, "time": time.time(), **fields})

    def flush(self) -> None:
        self._last_flush = self._clock()
        if self._pending:
            records, self._pending = self._pending, []
            self._send({"kind": kinds.STEPS, "rank": self._worker, "records": records})


def messages_in(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The workers' own messages in one event-log message: itself, or those a `batches` message carries
    (several workers' messages forwarded together, so that the scheduler handles one message for them)."""
    return message["messages"] if message.get("kind") == kinds.BATCHES else [message]


def expand(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One event-log message to flat records, each with a `kind` ('step', 'eval', lifecycle kinds)."""
    if message.get("kind") == kinds.BATCHES:
        return [record for inner in message["messages"] for record in expand(inner)]
    if message.get("kind") == kinds.STEPS:
        return [{"kind": kinds.STEP, **record} for record in message["records"]]
    record = {key: value for key, value in message.items() if key != "rank"}
    if "worker" in record:
        record["address"] = record["worker"]
    record["worker"] = message.get("rank")
    return [record]


class MetricsTable:
    """Client side: thread-safe, bounded store of the records a run has sent."""

    def __init__(self, max_steps: int = 200_000) -> None:
        self._lock = threading.Lock()
        self._steps: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_steps)
        self._other: list[dict[str, Any]] = []
        self._latest: dict[int, dict[str, Any]] = {}
        self.steps_received = 0
        # Running aggregates for live views, so a refresh costs nothing however long the run is.
        self._loss_by_step: dict[int, list[float]] = {}  # step -> [loss sum, workers]
        self._samples_by_second: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self._staleness_counts: collections.Counter = collections.Counter()
        self._recent_staleness: collections.deque[int] = collections.deque(maxlen=64)
        self._worker_state: dict[int, dict[str, Any]] = {}
        self._loss_by_second: dict[int, list[float]] = {}  # second -> [loss sum, records]
        self._staleness_by_second: dict[int, list[float]] = {}  # second -> [staleness sum, pushes]
        self._divergence_by_step: dict[int, list[float]] = {}  # step -> [divergence sum, workers]
        self._per_worker: dict[int, dict[str, Any]] = collections.defaultdict(_worker_totals)
        self._link = LinkBook()  # what the link allows the running strategy (plane/link.py)
        self._waits = WaitBook()  # the longest waits a peer sees, for the run's timeout (plane/deadline.py)
        self.version = 0  # grows with every add, so a viewer can tell whether anything changed

    def add(self, records: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            self.version += 1
            for record in records:
                if record.get("kind") == kinds.STEP:
                    self._steps.append(record)
                    self._latest[record["worker"]] = record
                    self.steps_received += 1
                    self._aggregate(record)
                    self._link.add(record)
                    self._waits.add(record)
                else:
                    self._other.append(record)
                    self._follow_worker(record)
                    if record.get("kind") == kinds.EVAL:
                        self._waits.add_evaluation(record)

    def _aggregate(self, record: dict[str, Any]) -> None:
        entry = self._loss_by_step.setdefault(record["step"], [0.0, 0])
        entry[0] += record["loss"]
        entry[1] += 1
        second = int(record["time"])
        self._samples_by_second[second][record["worker"]] += record["samples"]
        _accumulate(self._loss_by_second, second, record["loss"])
        totals = self._per_worker[record["worker"]]
        for part in ("compute_s", "comm_s", "wait_s"):
            totals[part] += record.get(part) or 0.0
        staleness = record.get("staleness")
        if staleness is not None:
            self._staleness_counts[int(staleness)] += 1
            self._recent_staleness.append(int(staleness))
            _accumulate(self._staleness_by_second, second, staleness)
            totals["pushes"] += 1
            totals["staleness_sum"] += staleness
            totals["staleness_max"] = max(totals["staleness_max"], int(staleness))
            totals["staleness"] = int(staleness)
        if record.get("divergence") is not None:
            _accumulate(self._divergence_by_step, record["step"], record["divergence"])
            totals["divergence"] = record["divergence"]
        for field in ("steps_since_sync", "gpu_memory_mb", "gpu_utilization"):
            if record.get(field) is not None:
                totals[field] = record[field]

    def _follow_worker(self, record: dict[str, Any]) -> None:
        state = WORKER_STATES.get(record.get("kind"))
        worker = record.get("worker")
        if state is not None and worker is not None:
            entry = self._worker_state.setdefault(worker, {})
            entry["state"] = state
            if record.get("address"):
                entry["address"] = record["address"]

    def live_view(self, max_points: int = 400, history_s: int | None = None) -> dict[str, Any]:
        """What a live view draws, from running aggregates: loss per step (mean over workers, at most
        `max_points` points), samples/s per second of wall time in total and per worker (the last
        `history_s` seconds, default THROUGHPUT_HISTORY_S), staleness
        (recent mean, histogram), and each worker's state, step and last-seen time."""
        history_s = THROUGHPUT_HISTORY_S if history_s is None else history_s
        with self._lock:
            steps = sorted(self._loss_by_step)
            losses = [self._loss_by_step[s][0] / self._loss_by_step[s][1] for s in steps]
            # The last `history_s` seconds; the newest one is still filling up.
            seconds = sorted(self._samples_by_second)[-history_s - 1:-1]
            origin = min(self._samples_by_second, default=0)  # times count from the run's first step
            workers = sorted({w for c in self._samples_by_second.values() for w in c} | set(self._worker_state))
            per_worker = {w: [self._samples_by_second[t][w] for t in seconds] for w in workers}
            histogram = dict(sorted(self._staleness_counts.items()))
            recent = list(self._recent_staleness)
            latest = dict(self._latest)
            states = {w: dict(v) for w, v in self._worker_state.items()}
            totals = {w: dict(v) for w, v in self._per_worker.items()}
            loss_time = _means(self._loss_by_second)
            staleness_time = _means(self._staleness_by_second)
            divergence = _means(self._divergence_by_step)
            evaluations = [{key: r.get(key) for key in ("step", "time", "loss", "accuracy", "bits_per_char", "token_accuracy", "final")}
                           for r in self._other if r.get("kind") == kinds.EVAL]
            warnings = [r["message"] for r in self._other if r.get("kind") == kinds.TRAINING_WARNING]
            recoveries = [{key: r.get(key) for key in ("lost", "generation", "phases_s", "total_s")}
                          for r in self._other if r.get("kind") == kinds.RECOVERED]
            auto = [r for r in self._other if r.get("kind") in (kinds.AUTO_DECISION, kinds.AUTO_PINNED, kinds.AUTO_ON)]
        step_axis, loss_axis = downsample(steps, losses, max_points)
        now = time.time()
        table = []
        for worker in workers:
            last = latest.get(worker, {})
            own = totals.get(worker, {})
            table.append({"worker": worker, "state": states.get(worker, {}).get("state", "starting"),
                          "step": last.get("step"), "address": states.get(worker, {}).get("address", ""),
                          "last_seen_s": now - last["time"] if last else None,
                          **{field: own.get(field) for field in WORKER_GAUGES}})
        total = [sum(values) for values in zip(*per_worker.values())] if per_worker else []
        time_axis = [t - origin for t in seconds]
        if len(time_axis) > max_points:  # long histories (dashboards ask for the whole run) are thinned
            per_worker = {w: downsample(time_axis, values, max_points)[1] for w, values in per_worker.items()}
            time_axis, total = downsample(time_axis, total, max_points)
        return {
            "origin": origin,
            "loss": {"step": step_axis, "loss": loss_axis},
            "loss_time": _axis(loss_time, origin, max_points, "loss"),
            "evaluations": evaluations,
            # Past PER_WORKER_LINES workers, views draw the distribution over workers instead of a line each.
            "throughput": {"time": time_axis, "total": total, "per_worker": per_worker,
                           "spread": worker_spread.spread(per_worker) if worker_spread.many(len(per_worker)) else None},
            "staleness": {"recent_mean": sum(recent) / len(recent) if recent else None,
                          "max": max(histogram) if histogram else None, "histogram": histogram,
                          "over_time": _axis(staleness_time, origin, max_points, "staleness"),
                          "per_worker": {w: {"pushes": t["pushes"], "last": t.get("staleness"),
                                             "mean": t["staleness_sum"] / t["pushes"], "max": t["staleness_max"]}
                                         for w, t in totals.items() if t["pushes"]}},
            "divergence": dict(zip(("step", "divergence"), downsample(*zip(*divergence), max_points)))
            if divergence else {"step": [], "divergence": []},
            "time_split": {w: _fractions(t) for w, t in totals.items()},
            "workers": table,
            "warnings": warnings,
            "recoveries": recoveries,  # each regroup after lost workers, timed by phase (run/recovery.py)
            "auto": auto_line(auto[-1]) if auto else None,
        }

    def steps(self) -> pd.DataFrame:
        """Per-step records, one row per worker step."""
        with self._lock:
            rows = list(self._steps)
        import pandas as pd

        frame = pd.DataFrame(rows)
        return frame.drop(columns=["kind"]) if "kind" in frame else frame

    def first_steps_since(self, since: float) -> list[dict[str, Any]]:
        """Each worker's first step record made after `since` (a time), as records: a regroup's end."""
        first: dict[int, dict[str, Any]] = {}
        with self._lock:
            for record in reversed(self._steps):  # the newest first: a regroup is recent
                if record["time"] <= since:
                    break
                first[record["worker"]] = record
        return list(first.values())

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [r for r in self._other if kind is None or r.get("kind") == kind]

    def evaluations(self) -> pd.DataFrame:
        import pandas as pd

        return pd.DataFrame(self.events(kinds.EVAL))

    def last_steps(self) -> dict[int, dict[str, Any]]:
        """The latest step record of each worker."""
        with self._lock:
            return dict(self._latest)

    def link_limit(self, paced: Callable[[str | None], bool], min_records: int = 2) -> dict[str, Any] | None:
        """The link's rate and what it allows the running strategy, against compute's limit and the run's
        rate (`plane/link.py`; None until every worker has `min_records` step records under it);
        `paced(strategy)`: whether its ranks go at the slowest one's pace."""
        with self._lock:
            return self._link.limit(paced(self._link.strategy), min_records)

    def deadline_proposal(self, in_force_s: float, strategy: str,
                          evaluates: bool = False) -> tuple[float | None, float | None]:
        """(the timeout the measured waits of `strategy` call for instead of `in_force_s`, or None to keep
        it; the longest wait measured, None before enough records). `evaluates`: the run evaluates on
        held-out data (WaitBook.propose)."""
        with self._lock:
            return self._waits.propose(in_force_s, strategy, evaluates), self._waits.longest_wait_s()

    def longest_wait_s(self) -> float | None:
        """The longest wait on a peer measured under the running strategy (None before enough records)."""
        with self._lock:
            return self._waits.longest_wait_s()

    def restart_waits(self) -> None:
        """A new group of workers: its waits are measured afresh."""
        with self._lock:
            self._waits.restart(self._waits.strategy)

    def staleness(self) -> dict[int, dict[str, Any]]:
        """Per worker: pushes, staleness mean and max, and a histogram {staleness: pushes}."""
        return staleness_summary(self.steps())

    def recent_steps(self, window_s: float) -> list[dict[str, Any]]:
        """The step records of the last `window_s` seconds (by the newest record's time), newest first."""
        with self._lock:
            return _recent(self._steps, window_s)

    def throughput(self, window_s: float | None = 5.0) -> dict[str, Any]:
        """Rates over the last `window_s` seconds, or over every kept record when None."""
        with self._lock:
            records = list(self._steps) if window_s is None else _recent(self._steps, window_s)
        return throughput(records)


THROUGHPUT_HISTORY_S = 300  # seconds of throughput history a live view shows by default

# The latest value of these per-worker fields is shown in worker tables (averaging and GPU gauges).
WORKER_GAUGES = ("staleness", "steps_since_sync", "divergence", "gpu_memory_mb", "gpu_utilization")


def _worker_totals() -> dict[str, Any]:
    return {"compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "pushes": 0, "staleness_sum": 0.0, "staleness_max": 0}


def _accumulate(buckets: dict[int, list[float]], key: int, value: float) -> None:
    entry = buckets.setdefault(key, [0.0, 0])
    entry[0] += value
    entry[1] += 1


def _means(buckets: dict[int, list[float]]) -> list[tuple[int, float]]:
    return [(key, buckets[key][0] / buckets[key][1]) for key in sorted(buckets)]


def _axis(points: list[tuple[int, float]], origin: float, max_points: int, name: str) -> dict[str, list[float]]:
    """Per-second means as {'time': seconds since `origin`, name: values}, at most `max_points` points."""
    if not points:
        return {"time": [], name: []}
    times, values = downsample([t - origin for t, _ in points], [v for _, v in points], max_points)
    return {"time": times, name: values}


def _fractions(totals: dict[str, Any]) -> dict[str, float]:
    whole = (totals["compute_s"] + totals["comm_s"] + totals["wait_s"]) or 1.0
    return {part: totals[f"{part}_s"] / whole for part in ("compute", "comm", "wait")}

# Worker lifecycle events and the state each leaves the worker in.
WORKER_STATES = {kinds.WORKER_STARTED: "running", kinds.PAUSED: "paused", kinds.RESUMED: "running",
                 kinds.WORKER_FINISHED: "finished", kinds.WORKER_FAILED: "failed", kinds.WORKER_LOST: "lost",
                 kinds.WORKER_LEFT: "left"}


def best_metric(evaluations: list[dict[str, Any]]) -> tuple[str, float] | None:
    """The best held-out accuracy (a language model's: the fewest bits per character; without either, the
    lowest held-out loss) of a run's evaluations."""
    accuracies = [e["accuracy"] for e in evaluations if e.get("accuracy") is not None]
    if accuracies:
        return "accuracy", max(accuracies)
    bits = [e["bits_per_char"] for e in evaluations if e.get("bits_per_char") is not None]
    if bits:
        return "bits/char", min(bits)
    losses = [e["loss"] for e in evaluations if e.get("loss") is not None]
    return ("held-out loss", min(losses)) if losses else None


def downsample(xs: list[float], ys: list[float], max_points: int) -> tuple[list[float], list[float]]:
    """At most `max_points` points: consecutive points grouped and each group replaced by its mean."""
    if len(xs) <= max_points:
        return list(xs), list(ys)
    size = -(-len(xs) // max_points)
    groups = range(0, len(xs), size)
    return ([sum(xs[i:i + size]) / len(xs[i:i + size]) for i in groups],
            [sum(ys[i:i + size]) / len(ys[i:i + size]) for i in groups])


def control_markers(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One marker per control action (a switch, an lr or setting change, a pause, a resume) at the step
    where worker 0 applied it; every worker applies each action (asynchronous ones at their own step)."""
    markers = []
    for event in events:
        kind = event.get("kind")
        if kind == kinds.TRAINING_WARNING:  # the loss watch's (run/health.py)
            markers.append({"kind": kind, "step": event["step"], "time": event.get("time"),
                            "label": f"warning: {event['reason']}"})
            continue
        if kind == kinds.AUTO_DECISION:  # `auto` chose: at the step the slowest worker had reached
            markers.append({"kind": kind, "step": event["step"], "time": event.get("time"),
                            "label": f"auto: {event['reason']}"})
            continue
        if kind in (kinds.WORKER_LOST, kinds.REGROUPED):  # the run's own events: lost workers and regroups
            marker = _membership_marker(event)
            if marker is not None:
                markers.append(marker)
            continue
        if event.get("worker") != 0 or kind not in (kinds.SWITCHED, kinds.CHANGED, kinds.PAUSED, kinds.RESUMED):
            continue
        if kind == kinds.SWITCHED:
            label = f"{event['from']} -> {event['to']}"
        elif kind == kinds.CHANGED:
            parts = [f"lr {event['lr']:g}"] if "lr" in event else []
            label = ", ".join(parts + [f"{key} {value}" for key, value in (event.get("settings") or {}).items()])
        else:
            label = kind
        markers.append({"kind": kind, "step": event["step"], "time": event.get("time"), "label": label})
    return sorted(markers, key=lambda m: (m["step"], m["time"] or 0))


def auto_line(record: dict[str, Any]) -> str:
    """What `auto` last did, in one line: its choice and why, or that it was turned off."""
    if record["kind"] == kinds.AUTO_PINNED:
        return f"auto off ({record['why']}): {record['strategy']} stays"
    if record["kind"] == kinds.AUTO_ON:
        return f"auto on again: from {record['strategy']}"
    return f"auto: {record['reason']}"


def _membership_marker(event: dict[str, Any]) -> dict[str, Any] | None:
    if event["kind"] == kinds.WORKER_LOST:
        step, label = event.get("step"), f"lost {event.get('address', 'a worker')}"
    else:
        step = event.get("from_step")
        label = f"{len(event.get('workers') or ())} workers from step {step} ({event.get('reason', 'regrouped')})"
    if step is None:
        return None
    return {"kind": event["kind"], "step": step, "time": event.get("time"), "label": label}


def _recent(records: collections.deque, window_s: float) -> list[dict[str, Any]]:
    if not records:
        return []
    newest = records[-1]["time"]
    out = []
    for record in reversed(records):
        if record["time"] < newest - window_s:
            break
        out.append(record)
    out.reverse()
    return out


def throughput(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples/s per worker and in total, and steps/s, over the records' time span.

    A worker's rate is the samples of its records after the first one, divided by the time between its
    first and last record: wall-clock, so waiting and overheads count against it.
    """
    by_worker: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for record in records:
        by_worker[record["worker"]].append(record)
    per_worker: dict[int, float] = {}
    steps_per_s: dict[int, float] = {}
    for worker, rows in by_worker.items():
        rows.sort(key=lambda r: r["time"])
        span = rows[-1]["time"] - rows[0]["time"]
        if len(rows) < 2 or span <= 0:
            continue
        per_worker[worker] = sum(r["samples"] for r in rows[1:]) / span
        steps_per_s[worker] = (len(rows) - 1) / span
    return {
        "samples_per_s": sum(per_worker.values()),
        "per_worker": per_worker,
        "steps_per_s": sum(steps_per_s.values()) / len(steps_per_s) if steps_per_s else 0.0,
    }


def time_split(frame: pd.DataFrame) -> dict[str, float]:
    """Fractions of step time spent computing, communicating and waiting, over all recorded steps."""
    if frame.empty:
        return {"compute": 0.0, "comm": 0.0, "wait": 0.0}
    return _fractions({f"{name}_s": float(frame[f"{name}_s"].sum()) for name in ("compute", "comm", "wait")})


def staleness_summary(frame: pd.DataFrame) -> dict[int, dict[str, Any]]:
    """Per worker: pushes, staleness mean and max, and a histogram {staleness: pushes} (empty when the
    strategy does not push to a parameter server)."""
    if frame.empty or "staleness" not in frame:
        return {}
    pushes = frame.dropna(subset=["staleness"])
    summary = {}
    for worker, rows in pushes.groupby("worker"):
        values = rows["staleness"].astype(int)
        summary[int(worker)] = {"pushes": len(values), "mean": float(values.mean()), "max": int(values.max()),
                                "histogram": {int(k): int(v) for k, v in values.value_counts().sort_index().items()}}
    return summary


def communication_summary(frame: pd.DataFrame) -> dict[str, Any]:
    """Bytes sent and received per step (in all and per worker: across a slow link the worker beside the
    parameter server and the one across it differ), the share of communication time hidden behind
    computation, and the server's versions per second (for strategies that report them)."""
    if frame.empty or "bytes_sent" not in frame:
        return {}
    steps = len(frame)
    import pandas as pd

    received = frame["bytes_received"].fillna(0) if "bytes_received" in frame else pd.Series(0.0, index=frame.index)
    summary: dict[str, Any] = {"bytes_sent_per_step": float(frame["bytes_sent"].fillna(0).sum()) / steps,
                               "bytes_received_per_step": float(received.sum()) / steps}
    by_worker = frame.assign(_received=received).groupby("worker")
    summary["bytes_per_worker"] = {
        int(worker): {"sent_per_step": float(rows["bytes_sent"].fillna(0).mean()),
                      "received_per_step": float(rows["_received"].mean())}
        for worker, rows in by_worker}
    if "comm_total_s" in frame:
        total = float(frame["comm_total_s"].fillna(0).sum())
        exposed = float(frame["comm_s"].sum())
        summary["comm_hidden_fraction"] = max(0.0, 1 - exposed / total) if total > 0 else 0.0
    if "server_version" in frame:
        versions = frame.dropna(subset=["server_version"])
        span = versions["time"].max() - versions["time"].min()
        if len(versions) > 1 and span > 0:
            summary["server_versions_per_s"] = float(versions["server_version"].max()
                                                     - versions["server_version"].min()) / span
    return summary
