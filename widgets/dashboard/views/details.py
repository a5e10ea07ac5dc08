"""The "Run details" tab: the picked run in depth. Loss by wall time, the held-out metric by step and by
wall time, the step-time split, divergence at each sync, each recovery from lost workers as a waterfall of
its phases, the control requests and the run's config."""
from __future__ import annotations

import json
from typing import Any

import pandas as pd
import panel as pn

from workbench.run.recovery import PHASE_LABELS, PHASES

from .common import MARKER_COLOUR, MARKER_COLUMNS, Context, figure, send_markers, when

SPLIT_PARTS = ("compute", "comm", "wait")
PHASE_COLOURS = ["#c44e52", "#dd8452", "#4c72b0", "#55a868"]  # detected, agreed, restored, first step


class RunDetails:
    """The picked run's curves against wall time, where its step time goes, and who asked it what."""

    title = "Run details"
    scope = "run"  # drawn when the picked run's view changed

    def __init__(self, context: Context) -> None:
        self.screen = screen = context.screen
        loss = screen.source("loss-time", {"time": [], "loss": []})
        evaluations = screen.source("evaluations", {"step": [], "elapsed": [], "value": []})
        divergence = screen.source("divergence", {"step": [], "divergence": []})
        split = screen.source("time-split", {"worker": [], "compute": [], "comm": [], "wait": []})
        markers = screen.source("markers", MARKER_COLUMNS)  # sent by whichever run tab is drawn
        loss_time = figure("Training loss by wall time", "seconds since start", "loss")
        loss_time.line("time", "loss", source=loss, line_width=2)
        loss_time.vspan(x="elapsed", source=markers, line_color=MARKER_COLOUR, line_dash="dashed")
        by_step = figure("Held-out metric by step", "step", "metric")
        by_time = figure("Held-out metric by wall time", "seconds since start", "metric")
        for plot, x, marker_x in ((by_step, "step", "step"), (by_time, "elapsed", "elapsed")):
            plot.line(x, "value", source=evaluations, line_width=2, color="green")
            plot.scatter(x, "value", source=evaluations, size=6, color="green")
            plot.vspan(x=marker_x, source=markers, line_color=MARKER_COLOUR, line_dash="dashed")
        drift = figure("Divergence from the average at each sync (relative L2)", "step", "divergence")
        drift.line("step", "divergence", source=divergence, line_width=2, color="firebrick")
        shares = figure("Step time split", "worker", "share of step time", x_range=[])
        shares.vbar_stack(list(SPLIT_PARTS), x="worker", width=0.6, source=split,
                          color=["#4c72b0", "#dd8452", "#c44e52"], legend_label=["compute", "communication", "wait"])
        self.split_x_range = shares.x_range
        # One bar per recovery from lost workers, its phases end to end: where the time between the fault
        # and the first step after went, at a glance.
        recoveries = screen.source("recoveries", {"recovery": [], **{phase: [] for phase in PHASES}})
        waterfall = figure("Recoveries from lost workers", "seconds from the fault", "recovery", y_range=[])
        waterfall.hbar_stack(list(PHASES), y="recovery", height=0.6, source=recoveries, color=PHASE_COLOURS,
                             legend_label=[PHASE_LABELS[phase] for phase in PHASES])
        self.recovery_y_range = waterfall.y_range
        self.requests_table = pn.pane.DataFrame(pd.DataFrame(), index=False, sizing_mode="stretch_width",
                                                css_classes=["requests-table"], max_rows=10)
        self.config_view = pn.pane.JSON({}, depth=2, sizing_mode="stretch_width")
        plots = [pn.pane.Bokeh(p, sizing_mode="stretch_width")
                 for p in (loss_time, by_step, by_time, shares, drift, waterfall)]
        self.layout = pn.Column(
            pn.Row(*plots[:3], sizing_mode="stretch_width"),
            pn.Row(*plots[3:], sizing_mode="stretch_width"),
            pn.pane.Markdown("#### Control requests"), self.requests_table,
            pn.pane.Markdown("#### Config"), self.config_view,
            sizing_mode="stretch_width")

    def draw(self, view: dict[str, Any], force: bool) -> None:
        send = self.screen.send
        send("loss-time", dict(view["loss_time"]))
        send_markers(self.screen, view)
        evaluations = [e for e in view["evaluations"] if e.get("step") is not None]
        # What fits the task: a classifier's accuracy, a language model's bits per character, else the loss.
        metric = next((name for name in ("accuracy", "bits_per_char")
                       if any(e.get(name) is not None for e in evaluations)), "loss")
        origin = view["origin"] or 0
        send("evaluations", {"step": [e["step"] for e in evaluations], "value": [e.get(metric) for e in evaluations],
                             "elapsed": [e["time"] - origin if e.get("time") else float("nan") for e in evaluations]})
        send("divergence", dict(view["divergence"]))
        split = view["time_split"]
        names = [f"worker {w}" for w in sorted(split)]
        if list(self.split_x_range.factors) != names:
            self.split_x_range.factors = names
        # Shares rounded to 1%: a bar chart need not move for every step.
        send("time-split", {"worker": names, **{part: [round(split[w][part], 2) for w in sorted(split)]
                                                for part in SPLIT_PARTS}})
        recoveries = view.get("recoveries") or []
        labels = [f"{i + 1}: lost {', '.join(r['lost'])}, {r['total_s']:.1f} s" for i, r in enumerate(recoveries)]
        if list(self.recovery_y_range.factors) != labels:
            self.recovery_y_range.factors = labels
        send("recoveries", {"recovery": labels, **{phase: [r["phases_s"][phase] for r in recoveries]
                                                   for phase in PHASES}})
        self.screen.show("requests_table", self.requests_table, pd.DataFrame([{
            "when": when(r["time"]), "by": r["by"], "action": r["action"],
            "arguments": json.dumps(r["arguments"]) if r["arguments"] else "",
            "result": "done" if r["ok"] else f"refused by the run: {r['error']}"} for r in reversed(view["requests"])]))
        info = view["info"]
        self.screen.show("config_view", self.config_view, {k: v for k, v in info.items() if k not in ("kind", "time")})
