"""The "Run" tab: the picked run at a glance. Throughput per worker and in total, the loss by step with
control markers, staleness now, over time and as a histogram, and the table of workers. Past a few workers
(`workbench.plane.worker_spread`) the per-worker lines give way to the median and the p10-p90 band, the slowest
workers are named, and the table shows the slowest first."""
from __future__ import annotations

from html import escape
from typing import Any

import pandas as pd
import panel as pn
from bokeh.models import HoverTool

from workbench.plane import deadline
from workbench.plane.link import limit_text
from workbench.plane import worker_spread

from .common import COLOURS, MARKER_COLOUR, MARKER_COLUMNS, Context, HtmlBlock, SharedRender, figure, send_markers


class RunOverview:
    """The picked run's throughput, loss, staleness and workers."""

    title = "Run"
    scope = "run"  # drawn when the picked run's view changed

    def __init__(self, context: Context) -> None:
        self.screen = screen = context.screen
        workers = screen.source("throughput-workers", {"xs": [], "ys": [], "worker": [], "colour": []})
        total = screen.source("throughput", {"time": [], "total": []})
        band = screen.source("throughput-spread", {"time": [], "median": [], "p10": [], "p90": []})
        loss = screen.source("loss", {"step": [], "loss": []})
        markers = screen.source("markers", MARKER_COLUMNS)
        staleness = screen.source("staleness", {"time": [], "staleness": []})
        pushes = screen.source("staleness-histogram", {"staleness": [], "pushes": []})
        clock = screen.source("clock", {"newest": [], "steps": []})  # browsers measure their latency on it
        throughput = figure("Throughput (samples/s)", "seconds since start", "samples/s")
        throughput.multi_line("xs", "ys", source=workers, line_color="colour", line_alpha=0.6, legend_field="worker")
        throughput.line("time", "total", source=total, line_width=2, color="black", legend_label="total")
        # Many workers: one band and one line whatever their number (empty with a few).
        throughput.varea("time", "p10", "p90", source=band, fill_color=COLOURS[0], fill_alpha=0.25,
                         legend_label="workers p10-p90")
        throughput.line("time", "median", source=band, line_width=2, color=COLOURS[0], legend_label="worker median")
        throughput.legend.location = "top_left"
        throughput.tags = [clock]  # drawn by nothing, so referenced here to reach the browser
        loss_step = figure("Training loss by step", "step", "loss")
        loss_step.line("step", "loss", source=loss, line_width=2)
        loss_step.vspan(x="step", source=markers, line_color=MARKER_COLOUR, line_dash="dashed")
        loss_step.add_tools(HoverTool(tooltips=[("step", "@step"), ("", "@label")], mode="mouse"))
        over_time = figure("Staleness (server versions, mean per second)", "seconds since start", "staleness")
        over_time.line("time", "staleness", source=staleness, line_width=2, color="purple")
        histogram = figure("Staleness histogram", "staleness", "pushes")
        histogram.vbar(x="staleness", top="pushes", width=0.8, source=pushes, color="purple")
        self.staleness_now = pn.indicators.Number(name="Staleness now", value=0, format="{value:.2f}",
                                                  font_size="28pt", title_size="11pt", width=160)
        # HTML made once per run view for every session (`WORKER_TABLE`), not a DataFrame pane that each
        # session renders again: that was a third of a session's redraw (measured with py-spy, 10 sessions).
        self.worker_table = HtmlBlock("worker-table")
        self.slowest = HtmlBlock("slowest-workers")
        # What the link alone would allow, the share the run reaches, and the timeout in force.
        self.link = HtmlBlock("link-limit")
        plots = [pn.pane.Bokeh(p, sizing_mode="stretch_width") for p in (throughput, loss_step, over_time, histogram)]
        self.layout = pn.Column(
            self.link.layout,
            pn.Row(plots[0], plots[1], sizing_mode="stretch_width"),
            pn.Row(self.staleness_now, plots[2], plots[3], sizing_mode="stretch_width"),
            pn.pane.Markdown("#### Workers"), self.slowest.layout, self.worker_table.layout,
            sizing_mode="stretch_width")
        self._states: list[str] | None = None  # the workers' states last drawn

    def draw(self, view: dict[str, Any], force: bool) -> None:
        send = self.screen.send
        throughput = view["throughput"]
        send("throughput", {"time": throughput["time"], "total": throughput["total"]})
        workers = sorted(throughput["per_worker"]) if throughput.get("spread") is None else []
        spread = throughput.get("spread") or {"median": [], "p10": [], "p90": []}
        send("throughput-spread", {"time": throughput["time"] if spread["median"] else [], **spread})
        send("throughput-workers", {
            "xs": [throughput["time"]] * len(workers), "ys": [throughput["per_worker"][w] for w in workers],
            "worker": [f"worker {w}" for w in workers], "colour": [COLOURS[w % len(COLOURS)] for w in workers]})
        send("loss", dict(view["loss"]))
        send_markers(self.screen, view)
        staleness = view["staleness"]
        send("staleness", dict(staleness["over_time"]))
        send("staleness-histogram", {"staleness": list(staleness["histogram"]),
                                     "pushes": list(staleness["histogram"].values())})
        if staleness["recent_mean"] is not None and staleness["recent_mean"] != self.staleness_now.value:
            self.staleness_now.value = staleness["recent_mean"]
        send("clock", {"newest": [view["newest_time"] or 0.0], "steps": [view["steps_received"]]})
        # The worker table (steps, rates, last seen) changes with every step: redrawn at most once a second,
        # at once when a worker's state changes.
        states = [row["state"] for row in view["workers"]]
        if self.screen.due("worker_table", 1.0, force or states != self._states):
            self._states = states
            self.screen.show("worker_table", self.worker_table, WORKER_TABLE(view))
            self.screen.show("slowest", self.slowest, SLOWEST(view))
            self.screen.show("link", self.link, LINK(view))


def _worker_table_html(view: dict[str, Any]) -> str:
    rows, which = worker_spread.table_rows(view["workers"])
    frame = worker_frame(rows, view["staleness"]["per_worker"])
    table = frame.to_html(index=False, border=0, classes="panel-df", na_rep="") if not frame.empty else ""
    return f"<p><small>{which}</small></p>{table}" if which and table else table


WORKER_TABLE = SharedRender(_worker_table_html)
SLOWEST = SharedRender(lambda view: escape(worker_spread.slowest_line(view["workers"])))
def _link_html(view: dict[str, Any]) -> str:
    """What the link alone would allow (and the share the run reaches), and the timeout in force."""
    lines = [limit_text(view["link"]) if view.get("link") else "",
             deadline.describe(view["deadline"]) if view.get("deadline") else ""]
    return "".join(f"<div><small>{escape(line)}</small></div>" for line in lines if line)


LINK = SharedRender(_link_html)


def worker_frame(workers: list[dict[str, Any]], staleness: dict[int, dict[str, Any]]) -> pd.DataFrame:
    """One row per worker: state, step, rate, last seen, staleness, divergence and GPU use."""
    rows = []
    for row in workers:
        pushes = staleness.get(row["worker"], {})
        rows.append({
            "worker": row["worker"], "address": row["address"], "state": row["state"], "step": row["step"],
            "samples/s": round(row.get("samples_per_s") or 0.0),
            "last seen": f"{row['last_seen_s']:.0f} s ago" if row["last_seen_s"] is not None else "",
            "staleness": row.get("staleness"),
            "staleness mean": round(pushes["mean"], 2) if pushes else None,
            "staleness max": pushes.get("max"), "steps since sync": row.get("steps_since_sync"),
            "divergence": row.get("divergence"), "GPU memory (MB)": _rounded(row.get("gpu_memory_mb")),
            "GPU use (%)": _rounded(row.get("gpu_utilization")),
        })
    frame = pd.DataFrame(rows)
    # Columns that no worker reports (GPU on CPU machines, staleness under averaging) are left out.
    return frame.dropna(axis=1, how="all") if not frame.empty else frame


def _rounded(value: float | None) -> float | None:
    """A gauge as the table shows it: whole megabytes and percent (None stays empty)."""
    return None if value is None else round(value)
