"""The dashboard's views: a runs list, one run in detail, a compare view, and role-checked controls.

One `DashboardSession` per browser session (or notebook display) draws from the shared `Hub`. A
periodic callback redraws what changed a few times a second; the plots are Bokeh figures over named
`ColumnDataSource`s, so a redraw sends numbers, not pictures. Control buttons send requests to the run's
owner only after `Access.may_control` allows the signed-in user, whatever the browser sent.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import time
from typing import Any

import pandas as pd
import panel as pn
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from workbench.job import check_lr
from workbench.strategies import STRATEGIES, make_settings

from .access import Access
from .hub import ENDED, Hub

logger = logging.getLogger("workbench.dashboard")

COLOURS = Category10_10
MARKER_COLOUR = "#9a6700"
PLOT_HEIGHT = 230


def _figure(title: str, x_label: str, y_label: str, **options: Any) -> Any:
    plot = figure(title=title, height=PLOT_HEIGHT, sizing_mode="stretch_width", tools="pan,wheel_zoom,reset,save",
                  toolbar_location="above", **options)
    plot.xaxis.axis_label, plot.yaxis.axis_label = x_label, y_label
    return plot


class DashboardSession:
    """What one viewer sees: runs list, the selected run, the compare view, and (if allowed) controls."""

    def __init__(self, hub: Hub, access: Access, user: str | None = None, title: str = "Training workbench") -> None:
        self.hub = hub
        self.access = access
        self.user = user
        self.title = title
        self._shown: dict[str, Any] = {}  # what was last drawn, to send only changes
        self._following_newest = True  # until the viewer picks a run, show the newest one
        self._selecting = False  # the selection being changed by `refresh`, not by the viewer
        self._sent: dict[str, Any] = {}  # per source or pane: what the browser has now
        self._build()
        self.refresh()

    # --- layout ---------------------------------------------------------------------------------------

    def _build(self) -> None:
        self.header = pn.pane.Markdown(self._header_text(), sizing_mode="stretch_width")
        self.runs_table = pn.pane.DataFrame(pd.DataFrame(), index=False, sizing_mode="stretch_width",
                                            css_classes=["runs-table"], max_rows=50)
        self.run_select = pn.widgets.Select(label="Run", options=[], width=420)
        self.run_select.param.watch(self._on_pick, "value")
        self.status = pn.pane.Markdown("", sizing_mode="stretch_width")
        self._build_run_views()
        self._build_controls()
        self._build_compare()
        overview = pn.Column(
            pn.Row(self.throughput_plot, self.loss_step_plot, sizing_mode="stretch_width"),
            pn.Row(self.staleness_now, self.staleness_plot, self.histogram_plot, sizing_mode="stretch_width"),
            pn.pane.Markdown("#### Workers"), self.worker_table,
            sizing_mode="stretch_width")
        details = pn.Column(
            pn.Row(self.loss_time_plot, self.evaluation_plot, self.evaluation_time_plot, sizing_mode="stretch_width"),
            pn.Row(self.split_plot, self.divergence_plot, sizing_mode="stretch_width"),
            pn.pane.Markdown("#### Control requests"), self.requests_table,
            pn.pane.Markdown("#### Config"), self.config_view,
            sizing_mode="stretch_width")
        # Only the open tab is rendered in the browser (dynamic): every plot on screen is redrawn at each
        # update, and with many viewers those redraws are the dashboard's main cost.
        self.tabs = pn.Tabs(("Runs", pn.Column(self.runs_table, sizing_mode="stretch_width")),
                            ("Run", overview), ("Run details", details), ("Compare", self.compare_view),
                            active=1, dynamic=True, sizing_mode="stretch_width")
        self.layout = pn.Column(self.header, pn.Row(self.run_select, self.status, sizing_mode="stretch_width"),
                                self.controls, self.tabs, sizing_mode="stretch_width")

    def _build_run_views(self) -> None:
        self.sources = {name: ColumnDataSource(columns, name=name) for name, columns in {
            "throughput": {"time": [], "total": []},
            "throughput-workers": {"xs": [], "ys": [], "worker": [], "colour": []},
            "loss": {"step": [], "loss": []},
            "loss-time": {"time": [], "loss": []},
            "markers": {"step": [], "elapsed": [], "label": []},
            "evaluations": {"step": [], "elapsed": [], "value": []},
            "staleness": {"time": [], "staleness": []},
            "staleness-histogram": {"staleness": [], "pushes": []},
            "divergence": {"step": [], "divergence": []},
            "time-split": {"worker": [], "compute": [], "comm": [], "wait": []},
            "clock": {"newest": [], "steps": []},  # newest step time: browsers measure their latency on it
        }.items()}
        s = self.sources
        throughput = _figure("Throughput (samples/s)", "seconds since start", "samples/s")
        throughput.multi_line("xs", "ys", source=s["throughput-workers"], line_color="colour", line_alpha=0.6,
                              legend_field="worker")
        throughput.line("time", "total", source=s["throughput"], line_width=2, color="black", legend_label="total")
        throughput.legend.location = "top_left"
        throughput.tags = [s["clock"]]  # drawn by nothing, so referenced here to reach the browser
        loss_step = _figure("Training loss by step", "step", "loss")
        loss_step.line("step", "loss", source=s["loss"], line_width=2)
        loss_step.vspan(x="step", source=s["markers"], line_color=MARKER_COLOUR, line_dash="dashed")
        loss_step.add_tools(HoverTool(tooltips=[("step", "@step"), ("", "@label")], mode="mouse"))
        loss_time = _figure("Training loss by wall time", "seconds since start", "loss")
        loss_time.line("time", "loss", source=s["loss-time"], line_width=2)
        loss_time.vspan(x="elapsed", source=s["markers"], line_color=MARKER_COLOUR, line_dash="dashed")
        evaluation = _figure("Held-out metric by step", "step", "metric")
        evaluation.line("step", "value", source=s["evaluations"], line_width=2, color="green")
        evaluation.scatter("step", "value", source=s["evaluations"], size=6, color="green")
        evaluation.vspan(x="step", source=s["markers"], line_color=MARKER_COLOUR, line_dash="dashed")
        evaluation_time = _figure("Held-out metric by wall time", "seconds since start", "metric")
        evaluation_time.line("elapsed", "value", source=s["evaluations"], line_width=2, color="green")
        evaluation_time.scatter("elapsed", "value", source=s["evaluations"], size=6, color="green")
        evaluation_time.vspan(x="elapsed", source=s["markers"], line_color=MARKER_COLOUR, line_dash="dashed")
        self.evaluation_time_plot = pn.pane.Bokeh(evaluation_time, sizing_mode="stretch_width")
        staleness = _figure("Staleness (server versions, mean per second)", "seconds since start", "staleness")
        staleness.line("time", "staleness", source=s["staleness"], line_width=2, color="purple")
        histogram = _figure("Staleness histogram", "staleness", "pushes")
        histogram.vbar(x="staleness", top="pushes", width=0.8, source=s["staleness-histogram"], color="purple")
        divergence = _figure("Divergence from the average at each sync (relative L2)", "step", "divergence")
        divergence.line("step", "divergence", source=s["divergence"], line_width=2, color="firebrick")
        split = _figure("Step time split", "worker", "share of step time", x_range=[])
        split.vbar_stack(["compute", "comm", "wait"], x="worker", width=0.6, source=s["time-split"],
                         color=["#4c72b0", "#dd8452", "#c44e52"], legend_label=["compute", "communication", "wait"])
        self.split_x_range = split.x_range
        self.throughput_plot, self.loss_step_plot, self.loss_time_plot = (
            pn.pane.Bokeh(p, sizing_mode="stretch_width") for p in (throughput, loss_step, loss_time))
        self.evaluation_plot, self.staleness_plot, self.histogram_plot = (
            pn.pane.Bokeh(p, sizing_mode="stretch_width") for p in (evaluation, staleness, histogram))
        self.divergence_plot, self.split_plot = (pn.pane.Bokeh(p, sizing_mode="stretch_width")
                                                 for p in (divergence, split))
        self.staleness_now = pn.indicators.Number(name="Staleness now", value=0, format="{value:.2f}",
                                                  font_size="28pt", title_size="11pt", width=160)
        self.worker_table = pn.pane.DataFrame(pd.DataFrame(), index=False, sizing_mode="stretch_width",
                                              css_classes=["worker-table"])
        self.requests_table = pn.pane.DataFrame(pd.DataFrame(), index=False, sizing_mode="stretch_width",
                                                css_classes=["requests-table"], max_rows=10)
        self.config_view = pn.pane.JSON({}, depth=2, sizing_mode="stretch_width")

    def _build_controls(self) -> None:
        self.pause_button = pn.widgets.Button(label="Pause", color="warning", width=90)
        self.resume_button = pn.widgets.Button(label="Resume", color="success", width=90)
        self.stop_button = pn.widgets.Button(label="Stop", color="danger", width=90)
        self.lr_input = pn.widgets.FloatInput(label="Learning rate", value=0.01, step=0.001, start=0, width=130)
        self.lr_button = pn.widgets.Button(label="Set learning rate", width=140)
        self.strategy_select = pn.widgets.Select(label="Strategy", options=list(STRATEGIES), width=120)
        self.settings_input = pn.widgets.TextInput(label="Settings (JSON)", value=settings_json(next(iter(STRATEGIES))),
                                                   width=260)
        self.strategy_select.param.watch(lambda event: setattr(self.settings_input, "value", settings_json(event.new)),
                                         "value")
        self.switch_button = pn.widgets.Button(label="Switch strategy", color="primary", width=140)
        self.control_message = pn.pane.Markdown("", css_classes=["control-message"])
        self.pause_button.on_click(lambda _: self.act("pause"))
        self.resume_button.on_click(lambda _: self.act("resume"))
        self.stop_button.on_click(lambda _: self.act("stop"))
        self.lr_button.on_click(lambda _: self.act("set_lr", lr=self.lr_input.value))
        self.switch_button.on_click(lambda _: self.act("switch", strategy=self.strategy_select.value,
                                                       settings=self.settings_input.value))
        self.buttons = (self.pause_button, self.resume_button, self.stop_button, self.lr_button, self.switch_button)
        self.controls = pn.Column(
            pn.Row(self.pause_button, self.resume_button, self.stop_button, self.lr_input, self.lr_button,
                   self.strategy_select, self.settings_input, self.switch_button),
            self.control_message, sizing_mode="stretch_width")

    def _build_compare(self) -> None:
        self.compare_select = pn.widgets.MultiChoice(label="Runs to compare", options=[], sizing_mode="stretch_width")
        self.compare_select.param.watch(lambda _: self._draw_compare(force=True), "value")
        self.compare_sources = {name: ColumnDataSource({"xs": [], "ys": [], "run": [], "colour": []}, name=name)
                                for name in ("compare-loss", "compare-throughput")}
        loss = _figure("Training loss against wall time", "seconds since start", "loss")
        loss.multi_line("xs", "ys", source=self.compare_sources["compare-loss"], line_color="colour", line_width=2,
                        legend_field="run")
        rate = _figure("Throughput against wall time", "seconds since start", "samples/s")
        rate.multi_line("xs", "ys", source=self.compare_sources["compare-throughput"], line_color="colour",
                        line_width=2, legend_field="run")
        self.compare_table = pn.pane.DataFrame(pd.DataFrame(), index=False, sizing_mode="stretch_width",
                                               css_classes=["compare-table"])
        self.compare_view = pn.Column(self.compare_select, pn.Row(pn.pane.Bokeh(loss, sizing_mode="stretch_width"),
                                                                  pn.pane.Bokeh(rate, sizing_mode="stretch_width"),
                                                                  sizing_mode="stretch_width"),
                                      self.compare_table, sizing_mode="stretch_width")

    def _header_text(self) -> str:
        who = f"signed in as **{self.user}**" if self.user else "not signed in"
        if self.access.sign_in:
            who += " · [sign out](/logout)" if self.user else ""
        elif self.access.open_control:
            who = "open dashboard on this machine: anyone here may control runs"
        else:
            who = "view only (no sign-in configured)"
        return f"## {self.title}\n{who}"

    # --- drawing --------------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Redraw what changed (called a few times a second by the session's periodic callback)."""
        rows = self.hub.runs()
        self._draw_runs(rows)
        ids = [row["run"] for row in rows]
        if ids != self._shown.get("ids"):
            self._shown["ids"] = ids
            self._selecting = True  # new options may move the selection: that is not the viewer's pick
            try:
                self.run_select.options = ids
                self.compare_select.options = ids
                if ids and (self._following_newest or self.run_select.value not in ids):
                    self.run_select.value = ids[0]
            finally:
                self._selecting = False
        self._draw_run()
        self._draw_compare()

    def _on_pick(self, _event: Any) -> None:
        if not self._selecting:
            self._following_newest = False
        self._draw_run(force=True)

    def _draw_runs(self, rows: list[dict[str, Any]]) -> None:
        # Rates of live runs change with every step: the list is redrawn at most once a second, and
        # at once when a run comes or goes.
        ids = [row["run"] for row in rows]
        if not self._due("runs_table", 1.0, ids != self._shown.get("ids")):
            return
        frame = pd.DataFrame([{
            "run": r["run"], "owner": r["owner"], "strategy": r["strategy"], "state": r["state"],
            "workers": r["workers"], "started": _when(r["started"]),
            "samples/s": round(r["samples_per_s"]) if r["samples_per_s"] is not None else None,
            "best metric": f"{r['metric']} {r['best_metric']:.4f}" if r["best_metric"] is not None else "",
        } for r in rows])
        self._show("runs_table", frame)

    def _draw_run(self, force: bool = False) -> None:
        feed = self.hub.feed(self.run_select.value) if self.run_select.value else None
        if feed is None:
            return
        view = feed.view()
        if not force and view is self._shown.get("view"):
            return
        if force:
            self._sent.clear()
        self._shown["view"] = view
        throughput = view["throughput"]
        self._send("throughput", {"time": throughput["time"], "total": throughput["total"]})
        workers = sorted(throughput["per_worker"])
        self._send("throughput-workers", {
            "xs": [throughput["time"]] * len(workers), "ys": [throughput["per_worker"][w] for w in workers],
            "worker": [f"worker {w}" for w in workers], "colour": [COLOURS[w % len(COLOURS)] for w in workers]})
        self._send("loss", dict(view["loss"]))
        self._send("loss-time", dict(view["loss_time"]))
        markers = view["markers"]
        self._send("markers", {
            "step": [m["step"] for m in markers], "label": [m["label"] for m in markers],
            "elapsed": [m["elapsed"] if m["elapsed"] is not None else float("nan") for m in markers]})
        evaluations = [e for e in view["evaluations"] if e.get("step") is not None]
        metric = "accuracy" if any(e.get("accuracy") is not None for e in evaluations) else "loss"
        origin = view["origin"] or 0
        self._send("evaluations", {"step": [e["step"] for e in evaluations], "value": [e.get(metric) for e in evaluations],
                                   "elapsed": [e["time"] - origin if e.get("time") else float("nan")
                                               for e in evaluations]})
        staleness = view["staleness"]
        self._send("staleness", dict(staleness["over_time"]))
        self._send("staleness-histogram", {"staleness": list(staleness["histogram"]),
                                           "pushes": list(staleness["histogram"].values())})
        if staleness["recent_mean"] is not None and staleness["recent_mean"] != self.staleness_now.value:
            self.staleness_now.value = staleness["recent_mean"]
        self._send("divergence", dict(view["divergence"]))
        split = view["time_split"]
        names = [f"worker {w}" for w in sorted(split)]
        if list(self.split_x_range.factors) != names:
            self.split_x_range.factors = names
        # Shares rounded to 1%: a bar chart need not move for every step.
        self._send("time-split", {"worker": names, **{part: [round(split[w][part], 2) for w in sorted(split)]
                                                      for part in ("compute", "comm", "wait")}})
        self._send("clock", {"newest": [view["newest_time"] or 0.0], "steps": [view["steps_received"]]})
        # The worker table (steps, rates, last seen) changes with every step: redrawn at most once a second,
        # at once when a worker's state changes.
        states = [row["state"] for row in view["workers"]]
        if self._due("worker_table", 1.0, force or states != self._shown.get("states")):
            self._shown["states"] = states
            self._show("worker_table", _worker_frame(view["workers"], view["staleness"]["per_worker"]))
        self._show("requests_table", pd.DataFrame([{
            "when": _when(r["time"]), "by": r["by"], "action": r["action"],
            "arguments": json.dumps(r["arguments"]) if r["arguments"] else "",
            "result": "done" if r["ok"] else f"refused by the run: {r['error']}"} for r in reversed(view["requests"])]))
        info = view["info"]
        self._show("config_view", {k: v for k, v in info.items() if k not in ("kind", "time")})
        role = self.access.role(self.user, info.get("owner"))
        allowed = self.access.may_control(self.user, info.get("owner")) and view["status"] not in ENDED
        for button in self.buttons:
            if button.disabled == allowed:
                button.disabled = not allowed
        warnings = view.get("warnings") or []
        if self._due("status", 1.0, force or (view["status"], len(warnings)) != self._shown.get("status")):
            self._shown["status"] = (view["status"], len(warnings))
            self._show("status", f"**{view['status']}** · {info.get('strategy', '')} · owner {info.get('owner', '?')} · "
                                 f"{view['samples_per_s']:,.0f} samples/s · your role: {role}"
                                 + "".join(f"\n\n⚠ {text}" for text in warnings))

    def _due(self, name: str, period_s: float, now: bool = False) -> bool:
        """Whether `name` may be redrawn: `now`, or at least `period_s` after its last redraw."""
        last = self._shown.get(f"{name}_at", float("-inf"))
        if now or time.monotonic() - last >= period_s:
            self._shown[f"{name}_at"] = time.monotonic()
            return True
        return False

    def _send(self, name: str, data: dict[str, list[Any]]) -> None:
        """Give a plot's source new data, unless it is what the browser already has: every update costs
        the browser a redraw, and with many viewers that is what training pays for."""
        if self._sent.get(name) != data:
            self._sent[name] = data
            self.sources[name].data = data

    def _show(self, pane: str, value: Any) -> None:
        """Set a pane's content when it changed (tables and text are re-rendered whole)."""
        key = value.to_json() if isinstance(value, pd.DataFrame) else value
        if self._sent.get(pane) != key:
            self._sent[pane] = key
            getattr(self, pane).object = value

    def _draw_compare(self, force: bool = False) -> None:
        chosen = list(self.compare_select.value)
        views = [(run_id, feed.view()) for run_id in chosen if (feed := self.hub.feed(run_id)) is not None]
        key = [id(view) for _, view in views]
        if not force and key == self._shown.get("compare"):
            return
        self._shown["compare"] = key
        colours = [COLOURS[i % len(COLOURS)] for i in range(len(views))]
        # One time axis: seconds since each run's first step, so runs of different days overlay.
        self.compare_sources["compare-loss"].data = {
            "xs": [v["loss_time"]["time"] for _, v in views], "ys": [v["loss_time"]["loss"] for _, v in views],
            "run": [run_id for run_id, _ in views], "colour": colours}
        self.compare_sources["compare-throughput"].data = {
            "xs": [v["throughput"]["time"] for _, v in views], "ys": [v["throughput"]["total"] for _, v in views],
            "run": [run_id for run_id, _ in views], "colour": colours}
        self.compare_table.object = pd.DataFrame([
            {"run": run_id, "strategy": v["info"].get("strategy"), "state": v["status"],
             "final loss": v["loss"]["loss"][-1] if v["loss"]["loss"] else None,
             "mean samples/s": (sum(v["throughput"]["total"]) / len(v["throughput"]["total"])
                                if v["throughput"]["total"] else None),
             "staleness max": v["staleness"]["max"]} for run_id, v in views])

    # --- acting ---------------------------------------------------------------------------------------

    def act(self, action: str, **arguments: Any) -> bool:
        """Send a control request for the selected run, if this session's user may; True when sent.

        Runs on the server for every click, whatever the browser shows or sends: a disabled button
        made clickable, or a crafted websocket message, ends here and is refused the same way.
        """
        run_id = self.run_select.value
        feed = self.hub.feed(run_id) if run_id else None
        if feed is None:
            return self._say(f"{action}: no run selected", refused=True)
        owner = feed.info.get("owner")
        if not self.access.may_control(self.user, owner):
            logger.warning("refused %s on run %s for %s (role %s)", action, run_id, self.user or "anonymous",
                           self.access.role(self.user, owner))
            return self._say(f"refused: {action} needs the run's owner ({owner}) or an admin; you are "
                             f"{self.user or 'not signed in'} ({self.access.role(self.user, owner)})", refused=True)
        if feed.status in ENDED:
            return self._say(f"refused: run {run_id} has ended ({feed.status})", refused=True)
        try:
            arguments = self._checked(action, arguments)
        except (ValueError, TypeError) as error:
            return self._say(f"{action}: {error}", refused=True)
        self.hub.request(run_id, action, self.user, **arguments)
        return self._say(f"sent {action} to run {run_id}; its answer appears under Control requests")

    @staticmethod
    def _checked(action: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """Refuse bad values here, with the engine's own messages, before bothering the run."""
        if action == "set_lr":
            return {"lr": check_lr(arguments["lr"])}
        if action == "switch":
            text = arguments.get("settings") or "{}"
            try:
                settings = json.loads(text) if isinstance(text, str) else dict(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"settings={text!r} is not allowed: expected a JSON object ({error})") from None
            if not isinstance(settings, dict):
                raise ValueError(f"settings={text!r} is not allowed: expected a JSON object")
            make_settings(arguments["strategy"], settings)
            return {"strategy": arguments["strategy"], "settings": settings}
        return {}

    def _say(self, text: str, refused: bool = False) -> bool:
        self.control_message.object = ("⛔ " if refused else "✔ ") + text
        return not refused


def _worker_frame(workers: list[dict[str, Any]], staleness: dict[int, dict[str, Any]]) -> pd.DataFrame:
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
            "divergence": row.get("divergence"), "GPU memory (MB)": row.get("gpu_memory_mb"),
            "GPU use (%)": row.get("gpu_utilization"),
        })
    frame = pd.DataFrame(rows)
    # Columns that no worker reports (GPU on CPU machines, staleness under averaging) are left out.
    return frame.dropna(axis=1, how="all") if not frame.empty else frame


def _when(timestamp: float | None) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S") if timestamp else ""


def session_factory(hub: Hub, access: Access, refresh_ms: int = 500, title: str = "Training workbench"):
    """The Panel app: each browser session gets its own views over the shared hub."""
    def make() -> Any:
        session = DashboardSession(hub, access, user=pn.state.user, title=title)
        callback = pn.state.add_periodic_callback(session.refresh, period=refresh_ms)
        pn.state.on_session_destroyed(lambda _context: callback.stop())
        return session.layout

    return make


def settings_json(strategy: str) -> str:
    """A strategy's default settings as JSON, to start the switch form from."""
    return json.dumps(dataclasses.asdict(make_settings(strategy, {})))
