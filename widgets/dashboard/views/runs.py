"""The "Runs" tab: one row per run the hub knows, live or replayed from its run directory."""
from __future__ import annotations

from typing import Any

import pandas as pd
import panel as pn

from .common import Context, when


class RunsList:
    """Every run's owner, strategy, state, workers, start, rate and best held-out metric."""

    title = "Runs"
    scope = "runs"  # drawn at every refresh from every run's row

    def __init__(self, context: Context) -> None:
        self.screen = context.screen
        self.table = pn.pane.DataFrame(pd.DataFrame(), index=False, sizing_mode="stretch_width",
                                       css_classes=["runs-table"], max_rows=50)
        self.layout = pn.Column(self.table, sizing_mode="stretch_width")
        self._ids: list[str] | None = None

    def draw(self, rows: list[dict[str, Any]]) -> None:
        # Rates of live runs change with every step: the list is redrawn at most once a second, and
        # at once when a run comes or goes.
        ids = [row["run"] for row in rows]
        changed, self._ids = ids != self._ids, ids
        if not self.screen.due("runs_table", 1.0, changed):
            return
        frame = pd.DataFrame([{
            "run": r["run"], "owner": r["owner"], "strategy": r["strategy"], "state": r["state"],
            "workers": r["workers"], "started": when(r["started"]),
            "samples/s": round(r["samples_per_s"]) if r["samples_per_s"] is not None else None,
            "best metric": f"{r['metric']} {r['best_metric']:.4f}" if r["best_metric"] is not None else "",
        } for r in rows])
        self.screen.show("runs_table", self.table, frame)
