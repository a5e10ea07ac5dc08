"""The "Runs" tab: one row per run the hub knows, live or replayed from its run directory, newest first;
every run, however many (a team's history is hundreds)."""
from __future__ import annotations

from typing import Any

import pandas as pd
import panel as pn

from .common import Context, HtmlBlock, SharedRender, when


def runs_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Every run's owner, strategy, state, workers, start, rate and best held-out metric."""
    return pd.DataFrame([{
        "run": r["run"], "owner": r["owner"], "strategy": r["strategy"], "state": r["state"],
        "workers": r["workers"], "started": when(r["started"]),
        "samples/s": round(r["samples_per_s"]) if r["samples_per_s"] is not None else None,
        "best metric": f"{r['metric']} {r['best_metric']:.4f}" if r["best_metric"] is not None else "",
    } for r in rows])


# HTML made once per runs list (the hub's list object, remade at most every RUNS_LIST_S) for every
# session, as the worker table is: a DataFrame pane renders it again in each session.
RUNS_TABLE = SharedRender(lambda rows: runs_frame(rows).to_html(index=False, border=0, classes="panel-df", na_rep="")
                          if rows else "", keep=2)


class RunsList:
    """The runs table."""

    title = "Runs"
    scope = "runs"  # drawn at every refresh from every run's row

    def __init__(self, context: Context) -> None:
        self.screen = context.screen
        self.table = HtmlBlock("runs-table")
        self.layout = pn.Column(self.table.layout, sizing_mode="stretch_width")
        self._ids: list[str] | None = None

    def draw(self, rows: list[dict[str, Any]]) -> None:
        # Rates of live runs change with every step: the list is redrawn at most once a second, and
        # at once when a run comes or goes.
        ids = [row["run"] for row in rows]
        changed, self._ids = ids != self._ids, ids
        if self.screen.due("runs_table", 1.0, changed):
            self.screen.show("runs_table", self.table, RUNS_TABLE(rows))
