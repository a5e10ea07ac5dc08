"""The "Compare" tab: runs the viewer chooses, overlaid on one time axis (seconds since each run's first
step), with a table of their strategy, state, final loss, mean rate and worst staleness."""
from __future__ import annotations

from typing import Any

import pandas as pd
import panel as pn

from .common import COLOURS, Context, figure


class CompareView:
    """Loss and throughput of several runs against wall time, and one row per run."""

    title = "Compare"
    scope = "runs"  # drawn at every refresh from every run's row

    def __init__(self, context: Context) -> None:
        self.hub = context.hub
        self.select = pn.widgets.MultiChoice(label="Runs to compare", options=[], sizing_mode="stretch_width")
        self.select.param.watch(lambda _: self._draw_chosen(force=True), "value")
        self.sources = {name: context.screen.source(name, {"xs": [], "ys": [], "run": [], "colour": []})
                        for name in ("compare-loss", "compare-throughput")}
        loss = figure("Training loss against wall time", "seconds since start", "loss")
        loss.multi_line("xs", "ys", source=self.sources["compare-loss"], line_color="colour", line_width=2,
                        legend_field="run")
        rate = figure("Throughput against wall time", "seconds since start", "samples/s")
        rate.multi_line("xs", "ys", source=self.sources["compare-throughput"], line_color="colour",
                        line_width=2, legend_field="run")
        self.table = pn.pane.DataFrame(pd.DataFrame(), index=False, sizing_mode="stretch_width",
                                       css_classes=["compare-table"])
        self.layout = pn.Column(self.select, pn.Row(pn.pane.Bokeh(loss, sizing_mode="stretch_width"),
                                                    pn.pane.Bokeh(rate, sizing_mode="stretch_width"),
                                                    sizing_mode="stretch_width"),
                                self.table, sizing_mode="stretch_width")
        self._ids: list[str] | None = None
        self._drawn: list[int] | None = None  # which views of the chosen runs are on screen

    def draw(self, rows: list[dict[str, Any]]) -> None:
        ids = [row["run"] for row in rows]
        if ids != self._ids:
            self._ids = ids
            self.select.options = ids
        self._draw_chosen()

    def _draw_chosen(self, force: bool = False) -> None:
        views = [(run_id, feed.view()) for run_id in self.select.value if (feed := self.hub.feed(run_id)) is not None]
        # A feed's view is the same object until new records arrive: unchanged objects, nothing to send.
        key = [id(view) for _, view in views]
        if not force and key == self._drawn:
            return
        self._drawn = key
        colours = [COLOURS[i % len(COLOURS)] for i in range(len(views))]
        # One time axis: seconds since each run's first step, so runs of different days overlay.
        self.sources["compare-loss"].data = {
            "xs": [v["loss_time"]["time"] for _, v in views], "ys": [v["loss_time"]["loss"] for _, v in views],
            "run": [run_id for run_id, _ in views], "colour": colours}
        self.sources["compare-throughput"].data = {
            "xs": [v["throughput"]["time"] for _, v in views], "ys": [v["throughput"]["total"] for _, v in views],
            "run": [run_id for run_id, _ in views], "colour": colours}
        self.table.object = pd.DataFrame([
            {"run": run_id, "strategy": v["info"].get("strategy"), "state": v["status"],
             "final loss": v["loss"]["loss"][-1] if v["loss"]["loss"] else None,
             "mean samples/s": (sum(v["throughput"]["total"]) / len(v["throughput"]["total"])
                                if v["throughput"]["total"] else None),
             "staleness max": v["staleness"]["max"]} for run_id, v in views])
