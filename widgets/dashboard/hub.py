"""The dashboard's one connection to a cluster: every run it knows of, and one subscription per run.

A dashboard process holds one `Hub`, shared by every browser session: it follows the cluster-wide run
registry, subscribes once to each live run's metrics topic, and rebuilds finished runs from their run
directories, so sessions only read from it and their number costs the cluster nothing. A live run's
history is stitched from its run directory (when this process can read it) and the scheduler's recent
events, then continued from the subscription, without gaps or repeats. Workers the scheduler removes
are marked lost in the runs they trained.

Handlers of Dask events run on the client's event-loop thread and only store; anything slower (reading
files, asking the scheduler) runs on the hub's own thread.
"""
from __future__ import annotations

import json
import math
import queue
import threading
import time
from pathlib import Path
from typing import Any

from workbench.cluster import leases, membership
from workbench.cluster.announcements import RUNS_TOPIC, send_control_request
from workbench.plane import kinds
from workbench.plane.metrics import MetricsTable, best_metric, expand, topic
from workbench.plane.rundir import CONFIG_FILE, METRICS_FILE, SUMMARY_FILE, read_metrics
from workbench.run.views import live_view

ENDED = ("finished", "stopped", "failed")
WHOLE_RUN_S = 10**9  # the dashboard shows a run's whole history (thinned), not the last minutes
RUNS_LIST_S = 0.25  # how stale the runs list may be
LEASES_S = 1.0  # how stale the workers view (who holds which worker) may be
MEMBERSHIP_TOPIC = membership.MEMBERSHIP_TOPIC  # add-worker and remove-worker (see workbench.cluster.membership)


class FollowedRun:
    """What the dashboard knows of one run: its description, status and metrics table."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.info: dict[str, Any] = {"run_id": run_id}
        self.status = "unknown"
        self.summary: dict[str, Any] = {}
        self.table = MetricsTable()
        self.live = False  # subscribed to the run's metrics topic
        self.registered = False  # announced on this cluster's registry
        self.lost: dict[str, float] = {}  # worker address -> when the scheduler removed it
        self._lock = threading.Lock()
        self._buffering = False
        self._pending: list[dict[str, Any]] = []
        self._view: tuple[tuple[int, ...], dict[str, Any]] | None = None
        self._info_version = 0
        # An ended run listed from its summary: its metrics file, read when the run is first drawn.
        self._unread: Path | None = None
        self._reading = threading.Lock()

    # --- filling --------------------------------------------------------------------------------------

    def describe(self, info: dict[str, Any], status: str | None = None) -> None:
        with self._lock:
            self.info.update({k: v for k, v in info.items() if k != "kind"})
            if status and not (self.status in ENDED and status not in ENDED):  # an ended run stays ended
                self.status = status
            self._info_version += 1

    def on_message(self, event: tuple[float, dict[str, Any]]) -> None:
        """Subscription handler (client event-loop thread): store only."""
        records = expand(event[1])
        with self._lock:
            if self._buffering:
                self._pending.extend(records)
                return
        self.table.add(records)

    def defer(self, directory: Path) -> None:
        """List the run from its summary now; read its metrics file when it is first drawn."""
        self._unread = directory

    def _read_deferred(self) -> None:
        if self._unread is None:
            return
        with self._reading:  # sessions may open the run at once: one reads, the others wait for it
            if self._unread is not None:
                self.table.add(read_metrics(self._unread))
                self._unread = None

    def start_buffering(self) -> None:
        """Hold what the subscription brings until the history is in; the history rebuilds the table."""
        with self._lock:
            self._unread = None  # the history read from the directory replaces it
            self._buffering = True
            self.table = MetricsTable()
            self._view = None

    def replay(self, records: list[dict[str, Any]]) -> None:
        """Add the history (file and scheduler backlog, in order), then what arrived meanwhile, each
        record once."""
        seen = set()
        history = []
        for record in records:
            key = _record_key(record)
            if key not in seen:
                seen.add(key)
                history.append(record)
        self.table.add(history)
        with self._lock:
            pending, self._pending, self._buffering = self._pending, [], False
            self.table.add([r for r in pending if _record_key(r) not in seen])

    def mark_lost(self, address: str, when: float) -> bool:
        """Mark a worker of this run lost; True when it was one of this run's (and not yet ended)."""
        if address not in self.info.get("workers", []) or self.status in ENDED:
            return False
        with self._lock:
            self.lost[address] = when
            self._info_version += 1
        return True

    # --- reading --------------------------------------------------------------------------------------

    def row(self) -> dict[str, Any]:
        """The run's line in the runs list."""
        best = self.best_metric()
        rate = self.table.throughput(5.0)["samples_per_s"] if self.status not in ENDED else None
        if rate is None:
            rate = self.summary.get("samples_per_s")
        return {"run": self.run_id, "owner": self.info.get("owner", ""), "strategy": self.info.get("strategy", ""),
                "state": self.status, "workers": self.info.get("world_size"),
                "started": self.info.get("started") or self.info.get("queued"),
                "samples_per_s": rate, "best_metric": best[1] if best else None,
                "metric": best[0] if best else ""}

    def best_metric(self) -> tuple[str, float] | None:
        """The best held-out accuracy (or, without one, the lowest held-out loss)."""
        if self._unread is not None:  # listed from its summary, which says
            best = self.summary["best_metric"]
            return (best[0], best[1]) if best else None
        return best_metric(self.table.events(kinds.EVAL))

    def view(self) -> dict[str, Any]:
        """Everything the run's views draw, recomputed only when something arrived (shared by sessions)."""
        self._read_deferred()
        key = (self.table.version, self._info_version)
        cached = self._view
        if cached is not None and cached[0] == key:
            return cached[1]
        live = live_view(self.table, max_points=400, history_s=WHOLE_RUN_S)  # the notebook panel's too
        origin = live["origin"]
        for marker in live["markers"]:
            marker["elapsed"] = (marker["time"] - origin) if marker.get("time") and origin else None
        for row in live["workers"]:
            if row["address"] in self.lost:
                row["state"] = "lost"
        requests = [{k: r.get(k) for k in ("time", "action", "arguments", "by", "ok", "error", "request_id")}
                    for r in self.table.events(kinds.CONTROL_REQUEST)]
        view = {**live, "run_id": self.run_id, "status": self.status, "info": dict(self.info), "requests": requests,
                "steps_received": self.table.steps_received, "newest_time": _newest_time(self.table)}
        self._view = (key, view)
        return view


class Hub:
    """Every run on one cluster (and in one runs directory), shared by all of a dashboard's sessions."""

    def __init__(self, client: Any, runs_dir: str | Path | None = None, owns_client: bool = False) -> None:
        """client: this process's own Dask client (not one whose runs it should follow: one handler per
        topic and client); owns_client: close it with the hub."""
        self.client = client
        self._owns_client = owns_client
        self.runs_dir = Path(runs_dir) if runs_dir is not None else None
        self.feeds: dict[str, FollowedRun] = {}
        self.subscriptions: set[str] = set()  # topics this process subscribes to: one per live run
        self._lock = threading.Lock()
        self._runs: tuple[float, list[dict[str, Any]]] | None = None
        self._leases: dict[str, Any] = {"workers": {}, "free": [], "runs": {}, "queue": []}
        self._leases_asked = -math.inf
        self._work: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="workbench-dashboard-hub", daemon=True)

    def start(self) -> Hub:
        """Rebuild from the run directories, catch up with the registry, then follow it."""
        if self.runs_dir is not None and self.runs_dir.is_dir():
            for config in sorted(self.runs_dir.glob(f"*/{CONFIG_FILE}")):
                self._load_directory(config.parent)
        if self.client is not None:
            self._subscribe(RUNS_TOPIC, lambda event: self._work.put(("registry", event[1])))
            membership.install(self.client)
            self._subscribe(MEMBERSHIP_TOPIC, lambda event: self._work.put(("membership", event)))
            # The scheduler's recent registry messages: runs started before this process. Fold them
            # first, so that only runs still live are followed.
            for _, message in self.client.get_events(RUNS_TOPIC):
                self._on_registry(message, follow=False)
            with self._lock:
                feeds = list(self.feeds.values())
            for feed in feeds:
                if feed.registered and feed.status not in ENDED:
                    self._follow(feed)
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        self._work.put(("close", None))
        if self.client is not None:
            for name in list(self.subscriptions):
                try:
                    self.client.unsubscribe_topic(name)
                except Exception:
                    pass
            if self._owns_client:
                self.client.close()
        self.subscriptions.clear()

    # --- reading --------------------------------------------------------------------------------------

    def runs(self) -> list[dict[str, Any]]:
        """The runs list, newest first; computed at most every RUNS_LIST_S for all sessions together."""
        cached = self._runs
        if cached is not None and time.monotonic() - cached[0] < RUNS_LIST_S and len(cached[1]) == len(self.feeds):
            return cached[1]
        with self._lock:
            feeds = list(self.feeds.values())
        rows = sorted((feed.row() for feed in feeds), key=lambda row: row["started"] or 0, reverse=True)
        self._runs = (time.monotonic(), rows)
        return rows

    def feed(self, run_id: str) -> FollowedRun | None:
        with self._lock:
            return self.feeds.get(run_id)

    def request(self, run_id: str, action: str, by: str | None, **arguments: Any) -> str:
        """Send a control request to the run's owner. The caller has checked that `by` may."""
        return send_control_request(self.client, run_id, action, by, **arguments)

    # --- following ------------------------------------------------------------------------------------

    def _subscribe(self, name: str, handler: Any) -> None:
        self.client.subscribe_topic(name, handler)
        self.subscriptions.add(name)

    def workers(self) -> dict[str, Any]:
        """Who holds which worker, what is free and who waits (`workbench.cluster.leases.view`), as last asked."""
        return self._leases

    def _refresh_leases(self) -> None:
        if self.client is not None and time.monotonic() - self._leases_asked >= LEASES_S:
            self._leases_asked = time.monotonic()
            asked = time.time()
            try:
                self._leases = leases.view(self.client)
            except Exception:  # the scheduler may be gone for a moment: keep what was last known
                return
            self._end_abandoned_places(self._leases, asked)

    def _end_abandoned_places(self, view: dict[str, Any], asked: float) -> None:
        """A queued run that neither waits nor holds workers any more, and never started, lost its place
        with its client (a closed notebook says nothing on its way out)."""
        known = {w["run_id"] for w in view["queue"]} | set(view["runs"])
        with self._lock:
            feeds = list(self.feeds.values())
        for feed in feeds:
            if feed.status == "queued" and not feed.registered and feed.run_id not in known \
                    and asked > (feed.info.get("queued") or 0) + LEASES_S:
                feed.describe({"error": "left the queue: its client is gone"}, "failed")

    def _serve(self) -> None:
        while not self._closed.is_set():
            self._refresh_leases()
            try:
                kind, payload = self._work.get(timeout=LEASES_S)
            except queue.Empty:
                continue
            try:
                if kind == "registry":
                    self._on_registry(payload)
                elif kind == "membership":
                    self._on_membership(*payload)
            except Exception:  # one bad message must not stop the dashboard following the cluster
                continue

    def _feed_for(self, run_id: str) -> FollowedRun:
        with self._lock:
            feed = self.feeds.get(run_id)
            if feed is None:
                feed = self.feeds[run_id] = FollowedRun(run_id)
            return feed

    def _on_registry(self, message: dict[str, Any], follow: bool = True) -> None:
        run_id = message.get("run_id")
        if not run_id:
            return
        feed = self._feed_for(run_id)
        if message.get("kind") == kinds.RUN_QUEUED:  # waits for free workers: listed, not followed yet
            feed.describe(message, "queued")
        elif message.get("kind") == kinds.RUN_REGISTERED:
            feed.registered = True
            feed.describe(message, message.get("status"))
            if follow and feed.status not in ENDED:
                self._follow(feed)
        else:
            fields = {k: message[k] for k in ("strategy", "settings") if k in message}
            feed.describe(fields, message.get("status"))
            if message.get("samples_per_s") is not None:
                feed.summary.setdefault("samples_per_s", message["samples_per_s"])
            if message.get("status") in ENDED:
                self._unfollow(feed)

    def _follow(self, feed: FollowedRun) -> None:
        """Subscribe once to a live run, then fill in its history (directory, then scheduler backlog)."""
        name = topic(feed.run_id)
        if feed.live or self.client is None:
            return
        feed.live = True
        feed.start_buffering()
        self._subscribe(name, feed.on_message)
        history: list[dict[str, Any]] = []
        directory = Path(feed.info.get("directory") or "")
        if feed.info.get("directory") and (directory / CONFIG_FILE).is_file():
            history.extend(read_metrics(directory))
        for _, message in self.client.get_events(name):
            history.extend(expand(message))
        feed.replay(history)

    def _unfollow(self, feed: FollowedRun) -> None:
        name = topic(feed.run_id)
        if name in self.subscriptions:
            try:
                self.client.unsubscribe_topic(name)
            except Exception:
                pass
            self.subscriptions.discard(name)
        feed.live = False

    def _on_membership(self, _when: float, message: dict[str, Any]) -> None:
        if message.get("action") == "remove-worker" and message.get("worker"):
            with self._lock:
                feeds = list(self.feeds.values())
            for feed in feeds:
                feed.mark_lost(message["worker"], time.time())

    def _load_directory(self, path: Path) -> None:
        """A run from its directory: config, the summary when it ended, and every metrics record; those
        only when the run is first drawn, where the summary says all that the runs list shows (a team's
        history is hundreds of runs and most are never opened again: measured, 200 runs took the
        dashboard 9 s to start when it read them all)."""
        try:
            config = json.loads((path / CONFIG_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            return  # not a run directory, or one being written: the registry will bring it if live
        summary: dict[str, Any] = {}
        if (path / SUMMARY_FILE).is_file():
            try:
                summary = json.loads((path / SUMMARY_FILE).read_text())
            except (OSError, json.JSONDecodeError):
                summary = {}
        listed_from_summary = (summary.get("status") in ENDED and "best_metric" in summary
                               and (path / METRICS_FILE).is_file())
        records: list[dict[str, Any]] = []
        status = summary.get("status")
        if not listed_from_summary:
            try:
                records = read_metrics(path)
            except OSError:
                return
            ends = [name for r in records for name, kind in kinds.RUN_ENDED_AS.items() if r.get("kind") == kind]
            status = status or (ends[-1] if ends else "incomplete")
        feed = self._feed_for(config.get("run_id", path.name))
        feed.describe({**config, "directory": str(path.resolve())}, status)
        feed.summary = summary
        if listed_from_summary:
            feed.defer(path)
        else:
            feed.table.add(records)


def _record_key(record: dict[str, Any]) -> str:
    return json.dumps(record, sort_keys=True, default=str)


def _newest_time(table: MetricsTable) -> float | None:
    latest = table.last_steps()
    return max((r["time"] for r in latest.values()), default=None)
