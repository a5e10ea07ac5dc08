"""The notebook control panel of a run: buttons, sliders, a strategy switcher and live views.

It renders `Run.snapshot()` and acts only through the run's public methods. A daemon thread refreshes
it at most `1 / refresh_s` times a second while the run lives; updating widgets from a thread is
ipywidgets' documented pattern for background work, and it keeps the kernel free: the buttons answer
while the run trains. Plots are bqplot widgets, so a refresh sends only numbers to the browser.
"""
from __future__ import annotations

import html
import threading
from typing import Any

import bqplot
import ipywidgets as ipw

import workbench
from workbench.cli.setting_flags import FormField, form_fields, parse_optional
from workbench.evaluation import held_out_text
from workbench.plane import deadline
from workbench.plane.link import limit_text
from workbench.plane import worker_spread
from workbench.run import recovery
from workbench.run.autopilot import AUTO, SUMMARY as AUTO_SUMMARY
from workbench.run.lifecycle import FINISHED_STATES
from workbench.strategies import STRATEGIES, get_strategy

# The live setting the period slider moves, per strategy: steps between synchronisations or pushes.
PERIOD_SETTINGS = {"average": "period", "easgd": "period", "async": "push_every", "ssp": "push_every"}
STATUS_COLOURS = {"created": "#777", "queued": "#8250df", "running": "#1a7f37", "paused": "#9a6700", "stopped": "#555",
                  "finished": "#0969da", "failed": "#cf222e"}
MIN_REFRESH_S = 0.2


class ControlPanel:
    """Control and live views of one run; display it (or the run itself) in a notebook cell."""

    def __init__(self, run: Any, refresh_s: float = 0.5) -> None:
        if not isinstance(refresh_s, (int, float)) or refresh_s < MIN_REFRESH_S:
            raise workbench.ConfigError("refresh_s", refresh_s, f"a number of seconds >= {MIN_REFRESH_S}")
        self.run = run
        self.refresh_s = float(refresh_s)
        # Drawing happens on the refresh thread and after every action on the kernel's thread: one at a
        # time. A widget value set while drawing is not a user's action: flagged per thread, so a slider
        # the user moves while the other thread draws still counts.
        self._drawing = threading.RLock()
        self._in_draw = threading.local()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._build()
        self.refresh()
        self.start_refreshing()

    # --- layout ---------------------------------------------------------------------------------------

    def _build(self) -> None:
        self.title = ipw.HTML()
        self.start_button = ipw.Button(description="Start", icon="play", button_style="success")
        self.pause_button = ipw.Button(description="Pause", icon="pause")
        self.resume_button = ipw.Button(description="Resume", icon="play")
        self.stop_button = ipw.Button(description="Stop", icon="stop", button_style="danger")
        self.start_button.on_click(self._guarded("start", self._on_start))
        self.pause_button.on_click(self._guarded("pause", lambda _: self.run.pause()))
        self.resume_button.on_click(self._guarded("resume", lambda _: self.run.resume()))
        self.stop_button.on_click(self._guarded("stop", lambda _: self.run.stop()))

        self.lr_slider = ipw.FloatLogSlider(value=self.run.lr, base=10, min=-5, max=0, step=0.05,
                                            description="learning rate", continuous_update=False,
                                            readout_format=".2g", style={"description_width": "initial"})
        self.lr_slider.observe(self._guarded("learning rate", self._on_lr), names="value")
        self.period_slider = ipw.IntSlider(value=1, min=1, max=64, description="period", continuous_update=False,
                                           style={"description_width": "initial"})
        self.period_slider.observe(self._guarded("period", self._on_period), names="value")

        # 'auto' too: switching to it lets `auto` choose (again, after a pin).
        self.strategy_dropdown = ipw.Dropdown(options=sorted(STRATEGIES) + [AUTO], value=self.run.strategy,
                                              description="strategy")
        self.strategy_help = ipw.HTML()
        self.settings_box = ipw.VBox()
        self.setting_widgets: dict[str, ipw.Widget] = {}
        self.switch_button = ipw.Button(description="Switch", icon="exchange", button_style="warning",
                                        tooltip="switch the running run to this strategy at one step")
        self.switch_button.on_click(self._guarded("switch", self._on_switch))
        # strategy='auto' changes strategy by itself; Pin keeps the current one (so does a Switch).
        self.pin_button = ipw.Button(description="Pin", icon="thumb-tack", tooltip="auto: keep the current strategy")
        self.pin_button.on_click(self._guarded("pin", lambda _: self.run.pin()))
        self.strategy_dropdown.observe(lambda change: self._show_settings(change["new"]), names="value")
        self._show_settings(self.run.strategy)

        self.progress = ipw.FloatProgress(min=0, max=1, description="progress")
        self.progress_text = ipw.Label()
        self.message = ipw.HTML()
        self.links = ipw.HTML()
        self.worker_table = ipw.HTML()
        self.staleness_text = ipw.HTML()
        self.held_out_text = ipw.HTML()  # the newest held-out evaluation, as fits the task
        self.recovery_text = ipw.HTML()  # each recovery from lost workers: where its time went
        self.link_text = ipw.HTML()  # what the link alone would allow, and the share of it the run reaches
        self._build_plots()

        controls = ipw.VBox([
            ipw.HBox([self.start_button, self.pause_button, self.resume_button, self.stop_button]),
            ipw.HBox([self.lr_slider, self.period_slider]),
            ipw.HBox([self.strategy_dropdown, self.switch_button, self.pin_button]), self.strategy_help,
            self.settings_box,
        ])
        plots = ipw.HBox([self.loss_figure, self.throughput_figure,
                          ipw.VBox([self.staleness_figure, self.staleness_text])])
        self.widget = ipw.VBox([self.title, ipw.HBox([self.progress, self.progress_text]), controls, plots,
                                self.held_out_text, self.link_text, self.recovery_text, self.worker_table, self.links,
                                self.message])

    def _build_plots(self) -> None:
        layout = {"width": "360px", "height": "260px"}
        margin = {"top": 30, "bottom": 40, "left": 55, "right": 10}
        x, y = bqplot.LinearScale(), bqplot.LinearScale()
        self.loss_line = bqplot.Lines(x=[], y=[], scales={"x": x, "y": y}, colors=["#0969da"])
        self.change_marks = bqplot.Scatter(x=[], y=[], names=[], display_names=True, marker="triangle-down",
                                           colors=["#cf222e"], scales={"x": x, "y": y})
        self.loss_figure = bqplot.Figure(
            marks=[self.loss_line, self.change_marks], title="loss (mean of workers)", layout=layout, fig_margin=margin,
            axes=[bqplot.Axis(scale=x, label="step"), bqplot.Axis(scale=y, side="left")])
        x, y = bqplot.LinearScale(), bqplot.LinearScale(min=0)
        self.throughput_lines = bqplot.Lines(x=[], y=[], scales={"x": x, "y": y}, display_legend=True, labels=["total"])
        self.throughput_figure = bqplot.Figure(
            marks=[self.throughput_lines], title="samples/s", layout=layout, fig_margin=margin, legend_location="top-left",
            axes=[bqplot.Axis(scale=x, label="seconds"), bqplot.Axis(scale=y, side="left")])
        x, y = bqplot.OrdinalScale(), bqplot.LinearScale(min=0)
        self.staleness_bars = bqplot.Bars(x=[], y=[], scales={"x": x, "y": y}, colors=["#9a6700"])
        self.staleness_figure = bqplot.Figure(
            marks=[self.staleness_bars], title="staleness (pushes)", layout={"width": "300px", "height": "230px"},
            fig_margin=margin, axes=[bqplot.Axis(scale=x, label="versions behind"),
                                     bqplot.Axis(scale=y, side="left")])

    def _show_settings(self, strategy: str) -> None:
        """The chosen strategy's settings as form fields (its current values when it is the run's)."""
        if strategy == AUTO:
            self.setting_widgets, self.settings_box.children = {}, []
            self.strategy_help.value = f"<small>{html.escape(AUTO_SUMMARY)}</small>"
            return
        strategy_class = get_strategy(strategy)
        current = self.run.settings if strategy == self.run.strategy else {}
        self.setting_widgets = {field.name: _setting_widget(field, current.get(field.name, field.value))
                                for field in form_fields(strategy)}
        self.settings_box.children = list(self.setting_widgets.values())
        self.strategy_help.value = f"<small>{html.escape(strategy_class.traits.summary)}</small>"

    # --- actions ----------------------------------------------------------------------------------------

    def _guarded(self, action: str, handler: Any) -> Any:
        """Show a handler's error in the panel: in JupyterLab a callback's exception is otherwise lost."""
        def call(argument: Any) -> None:
            if getattr(self._in_draw, "active", False):  # drawing moved a slider, not the user
                return
            try:
                handler(argument)
                self.message.value = ""
            except Exception as error:
                self.message.value = (f"<span style='color:#cf222e'><b>{html.escape(action)}</b>: "
                                      f"{html.escape(str(error))}</span>")
            self.refresh()

        return call

    def _on_start(self, _: Any) -> None:
        if self.run.status == "created":
            self.run.start()
        elif self.run.done:  # a new run of the same job, with the strategy and settings chosen here
            self.follow(self.run.rerun(self.strategy_dropdown.value, **self.chosen_settings()))
        self.start_refreshing()

    def _on_lr(self, change: dict[str, Any]) -> None:
        if float(change["new"]) != self.run.lr:
            self.run.set_lr(float(change["new"]))

    def _on_period(self, change: dict[str, Any]) -> None:
        setting = PERIOD_SETTINGS.get(self.run.strategy)
        if setting is None:
            raise workbench.ConfigError("period", change["new"], f"a strategy with a period ({', '.join(PERIOD_SETTINGS)})")
        if self.run.settings.get(setting) != int(change["new"]):
            self.run.update(**{setting: int(change["new"])})

    def _on_switch(self, _: Any) -> None:
        self.run.switch(self.strategy_dropdown.value, **self.chosen_settings())

    def chosen_settings(self) -> dict[str, Any]:
        """The settings form's values, as the strategy takes them."""
        return {name: _setting_value(widget) for name, widget in self.setting_widgets.items()}

    def follow(self, run: Any) -> None:
        """Show and control another run from now on (e.g. the one 'Start' began after the last ended)."""
        self.run = run
        self.refresh()

    # --- refreshing -------------------------------------------------------------------------------------

    def start_refreshing(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stop.clear()
            self._thread = threading.Thread(target=self._refresh_loop, name="workbench-panel", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop refreshing and close the widgets."""
        self._stop.set()
        self.widget.close()

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            run = self.run
            try:
                self.refresh()
            except Exception as error:  # keep refreshing; say what went wrong where the user looks
                self.message.value = f"<pre>refreshing the panel failed: {html.escape(repr(error))}</pre>"
            if run.done and run is self.run:  # one last refresh shows the end; nothing changes after it
                return

    def refresh(self) -> None:
        """Draw the run's current snapshot."""
        with self._drawing:
            snapshot = self.run.snapshot()
            self._in_draw.active = True
            try:
                self._draw(snapshot)
            finally:
                self._in_draw.active = False

    def _draw(self, s: dict[str, Any]) -> None:
        status = s["status"]
        colour = STATUS_COLOURS.get(status, "#555")
        self.title.value = (f"<b>{html.escape(str(s['run_id'] or 'new run'))}</b> &nbsp; strategy "
                            f"<b>{html.escape(s['strategy'])}</b> &nbsp; <span style='color:{colour}'><b>{status}</b>"
                            f"</span> &nbsp; {s['samples_per_s']:,.0f} samples/s")
        self.start_button.disabled = not (status == "created" or status in FINISHED_STATES)
        self.start_button.description = "Start" if status == "created" else "New run"
        self.pause_button.disabled = status != "running"
        self.resume_button.disabled = status != "paused"
        self.stop_button.disabled = status not in ("running", "paused", "queued")  # a queued run leaves the queue
        self.switch_button.disabled = status not in ("running", "paused")
        pilot = getattr(self.run, "auto_pilot", None)
        self.pin_button.disabled = pilot is None or not pilot.on or status not in ("running", "paused")
        self.lr_slider.disabled = status not in ("running", "paused")
        self.lr_slider.value = s["lr"]
        setting = PERIOD_SETTINGS.get(s["strategy"])
        self.period_slider.disabled = setting is None or status not in ("running", "paused")
        self.period_slider.description = setting or "period"
        if setting is not None:
            self.period_slider.value = int(s["settings"].get(setting, 1))
        self.progress.value = s["progress"]
        self.progress_text.value = (s["waiting"] if s.get("waiting")
                                    else f"{s['progress']:.0%} of {s['total_steps']} steps"
                                    + (f" · {s['auto']}" if s.get("auto") else ""))

        loss = s["loss"]
        with self.loss_line.hold_sync():
            self.loss_line.x, self.loss_line.y = loss["step"], loss["loss"]
        marks = [m for m in s["markers"] if loss["step"]]
        with self.change_marks.hold_sync():
            self.change_marks.x = [m["step"] for m in marks]
            self.change_marks.y = [_value_at(loss["step"], loss["loss"], m["step"]) for m in marks]
            self.change_marks.names = [m["label"] for m in marks]

        throughput = s["throughput"]
        workers = sorted(throughput["per_worker"])
        spread = throughput.get("spread")  # many workers: their median and p10-p90, not a line each
        lines = ({f"worker {w}": throughput["per_worker"][w] for w in workers} if spread is None
                 else {"worker median": spread["median"], "worker p10": spread["p10"], "worker p90": spread["p90"]})
        with self.throughput_lines.hold_sync():
            self.throughput_lines.x = throughput["time"]
            self.throughput_lines.y = [throughput["total"], *lines.values()]
            self.throughput_lines.labels = ["total", *lines]

        staleness = s["staleness"]
        with self.staleness_bars.hold_sync():
            self.staleness_bars.x = [str(k) for k in staleness["histogram"]]
            self.staleness_bars.y = list(staleness["histogram"].values())
        if staleness["recent_mean"] is None:
            self.staleness_text.value = "<small>staleness: none yet (synchronous strategies have none)</small>"
        else:
            self.staleness_text.value = (f"staleness now <b>{staleness['recent_mean']:.2f}</b>, "
                                         f"max {staleness['max']}")
        evaluations = s.get("evaluations") or []
        if evaluations:
            self.held_out_text.value = f"<small>{html.escape(held_out_text(evaluations[-1]))}</small>"
        lines = [limit_text(s.get("link")), deadline.describe(s["deadline"]) if s.get("deadline") else ""]
        self.link_text.value = "".join(f"<div><small>{html.escape(line)}</small></div>" for line in lines if line)
        self.recovery_text.value = "".join(f"<div><small>{html.escape(recovery.describe(entry))}</small></div>"
                                           for entry in s.get("recoveries") or [])
        self.worker_table.value = _worker_table(s["workers"])
        links = []
        if s["dashboard"]:
            links.append(f"<a href='{html.escape(s['dashboard'])}' target='_blank'>Dask dashboard</a>")
        if s["directory"]:
            links.append(f"run directory <code>{html.escape(s['directory'])}</code>")
        self.links.value = " &nbsp;|&nbsp; ".join(links)
        if s["error"]:
            self.message.value = f"<pre style='color:#cf222e'>{html.escape(s['error'])}</pre>"
        elif s.get("warnings"):  # the loss watch's: the run trains, but is not learning
            self.message.value = "".join(f"<div style='color:#9a6700'>&#9888; {html.escape(text)}</div>"
                                         for text in s["warnings"])

    # --- notebook display -------------------------------------------------------------------------------

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def _setting_widget(field: FormField, value: Any) -> ipw.Widget:
    """The widget for one setting, of the kind `form_fields` says (the dashboard's form follows the same)."""
    style = {"description_width": "initial"}
    if field.kind == "bool":
        return ipw.Checkbox(value=bool(value), description=field.name, style=style, indent=False)
    if field.kind == "choice":
        return ipw.Dropdown(options=list(field.options), value=value, description=field.name, style=style)
    if field.kind == "int":
        return ipw.IntText(value=value, description=field.name, style=style)
    if field.kind == "float":
        return ipw.FloatText(value=value, description=field.name, style=style)
    # Optional numbers: empty means "the default behaviour" (None).
    return ipw.Text(value="" if value is None else str(value), description=field.name, style=style,
                    placeholder="default")


def _setting_value(widget: ipw.Widget) -> Any:
    return parse_optional(widget.value) if isinstance(widget, ipw.Text) else widget.value


def _value_at(steps: list[float], values: list[float], step: float) -> float:
    """The curve's value at the point nearest `step` (where a marker sits on the loss curve)."""
    nearest = min(range(len(steps)), key=lambda i: abs(steps[i] - step))
    return values[nearest]


def _worker_table(rows: list[dict[str, Any]]) -> str:
    """Every worker in order for a few; for many, the slowest named and the slowest rows first."""
    slowest = worker_spread.slowest_line(rows)
    rows, which = worker_spread.table_rows(rows)
    caption = f"<div><small>{html.escape(slowest)}<br>{html.escape(which)}</small></div>" if which else ""
    # GPU columns only where a worker reports them (CUDA workers, NVML for the utilisation).
    gpu = [(key, label) for key, label in GPU_COLUMNS if any(row.get(key) is not None for row in rows)]
    header = ("<tr><th>worker</th><th>state</th><th>step</th><th>samples/s</th><th>last seen</th>"
              + "".join(f"<th>{label}</th>" for _, label in gpu) + "<th>address</th></tr>")
    body = []
    for row in rows:
        seen = "" if row["last_seen_s"] is None else f"{row['last_seen_s']:.1f} s ago"
        gauges = "".join(f"<td>{'' if row.get(key) is None else f'{row[key]:,.0f}'}</td>" for key, _ in gpu)
        body.append(f"<tr><td>{row['worker']}</td><td>{html.escape(row['state'])}</td>"
                    f"<td>{'' if row['step'] is None else row['step']}</td><td>{row['samples_per_s']:,.0f}</td>"
                    f"<td>{seen}</td>{gauges}<td><code>{html.escape(row['address'] or '')}</code></td></tr>")
    return f"{caption}<table style='font-size:90%'>{header}{''.join(body)}</table>"


GPU_COLUMNS = (("gpu_memory_mb", "GPU memory (MB)"), ("gpu_utilization", "GPU use (%)"))
