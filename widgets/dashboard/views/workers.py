"""The "Workers" tab: which run holds each worker of the cluster, and the runs waiting for workers, in
order, from the lease book the hub reads (`workbench.cluster.leases.view`)."""
from __future__ import annotations

import datetime
from typing import Any

import pandas as pd
import panel as pn

from .common import Context

WORKER_COLUMNS = ["worker", "held by", "owner"]
QUEUE_COLUMNS = ["place", "run", "owner", "workers wanted", "waiting since"]


def worker_rows(view: dict[str, Any]) -> pd.DataFrame:
    """One row per worker: the run holding it and its owner, or 'free'."""
    rows = [{"worker": worker, "held by": holder["run_id"] if holder else "free",
             "owner": holder["owner"] if holder else ""}
            for worker, holder in sorted(view.get("workers", {}).items())]
    return pd.DataFrame(rows, columns=WORKER_COLUMNS)


def queue_rows(view: dict[str, Any]) -> pd.DataFrame:
    """The waiting runs, first come first served."""
    rows = [{"place": waiting["position"], "run": waiting["run_id"], "owner": waiting["owner"],
             "workers wanted": waiting["wanted"],
             "waiting since": datetime.datetime.fromtimestamp(waiting["since"]).strftime("%H:%M:%S")}
            for waiting in view.get("queue", [])]
    return pd.DataFrame(rows, columns=QUEUE_COLUMNS)


class WorkersView:
    """Two tables over the hub's lease view; redrawn only when it changed."""

    title = "Workers"
    scope = "runs"  # drawn at every refresh (from the hub's lease view, not the rows)

    def __init__(self, context: Context | None = None) -> None:
        self.hub = context.hub if context is not None else None
        self.workers_table = pn.pane.DataFrame(worker_rows({}), index=False, sizing_mode="stretch_width",
                                               css_classes=["workers-table"])
        self.queue_table = pn.pane.DataFrame(queue_rows({}), index=False, sizing_mode="stretch_width",
                                             css_classes=["queue-table"])
        self.summary = pn.pane.Markdown("", sizing_mode="stretch_width")
        self.layout = pn.Column(self.summary, self.workers_table, pn.pane.Markdown("#### Waiting for workers"),
                                self.queue_table, sizing_mode="stretch_width")
        self._shown: Any = None

    def draw(self, rows: list[dict[str, Any]]) -> None:
        if self.hub is not None:
            self.show(self.hub.workers())

    def show(self, view: dict[str, Any]) -> None:
        if view == self._shown:
            return
        self._shown = view
        workers = view.get("workers", {})
        self.summary.object = (f"**{len(view.get('free', []))} of {len(workers)} workers free**, "
                               f"{len(view.get('runs', {}))} run(s) holding workers, "
                               f"{len(view.get('queue', []))} waiting")
        self.workers_table.object = worker_rows(view)
        self.queue_table.object = queue_rows(view)
