"""Static pictures of runs (matplotlib PNGs), for where the live widgets do not render: a notebook read on
a code host, the README, a report.

The same numbers as the live views (`compare.comparison_table`, `compare.loss_against_time`, the run's
step records and markers), drawn once. Each function returns a `StaticFigure`, which a notebook shows as
an image (it has `_repr_png_`, so no pyplot and no backend state is involved) and `save()` writes.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure

from workbench.plane.metrics import control_markers

from .compare import COLOURS, comparison_table, loss_against_time


class StaticFigure:
    """A matplotlib figure that displays as a PNG in a notebook and saves to a file."""

    def __init__(self, figure: Figure) -> None:
        self.figure = figure

    def png(self) -> bytes:
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
        return buffer.getvalue()

    def _repr_png_(self) -> bytes:
        return self.png()

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_bytes(self.png())
        return path


def _labels(runs: list[Any], labels: list[str] | None) -> list[str]:
    strategies = [run.strategy for run in runs]
    return labels or [s if strategies.count(s) == 1 else f"{s} {i + 1}" for i, s in enumerate(strategies)]


def comparison_figure(runs: list[Any], labels: list[str] | None = None, title: str | None = None) -> StaticFigure:
    """Loss against wall time, throughput and mean staleness of `runs`, side by side (the picture of
    `compare.compare_runs`)."""
    labels = _labels(runs, labels)
    colours = [COLOURS[i % len(COLOURS)] for i in range(len(runs))]
    table = comparison_table(runs)
    figure = Figure(figsize=(13, 3.8), layout="constrained")
    loss, throughput, staleness = figure.subplots(1, 3, width_ratios=(1.4, 1, 1))
    longest = max((float(run.metrics["time"].max() - run.metrics["time"].min()) for run in runs
                   if not run.metrics.empty), default=0.0)
    bin_s = max(0.05, longest / 60)  # about 60 points across the longest run, however long it was
    for run, label, colour in zip(runs, labels, colours):
        seconds, values = loss_against_time(run, bin_s)
        loss.plot(seconds, values, label=label, color=colour, linewidth=1.4)
    loss.set(yscale="log", xlabel="seconds since the first step", ylabel="training loss (mean of workers)",
             title="loss against wall time")
    loss.legend(fontsize=8)
    for axes, column, name in ((throughput, "samples/s", "throughput (samples/s)"),
                               (staleness, "staleness mean", "mean staleness (server versions)")):
        values = [0.0 if pd.isna(v) else float(v) for v in table[column]]
        axes.bar(labels, values, color=colours)
        axes.set_title(name)
        axes.tick_params(axis="x", labelrotation=30, labelsize=8)
    if title:
        figure.suptitle(title)
    return StaticFigure(figure)


def run_figure(run: Any, title: str | None = None) -> StaticFigure:
    """One run: each worker's loss against its step with a line at each switch, regroup or warning, and
    each worker's throughput over wall time (the picture of the control panel's charts)."""
    frame = run.metrics
    figure = Figure(figsize=(12, 3.6), layout="constrained")
    loss, rate = figure.subplots(1, 2)
    if not frame.empty:
        start = frame["time"].min()
        bin_s = max(0.1, float(frame["time"].max() - start) / 40)  # about 40 points, however long the run
        for worker, rows in frame.groupby("worker"):
            colour = COLOURS[int(worker) % len(COLOURS)]
            loss.plot(rows["step"], rows["loss"].rolling(10, min_periods=1).mean(), color=colour, linewidth=1.2,
                      label=f"worker {worker}")
            binned = rows.groupby(((rows["time"] - start) // bin_s).astype(int))["samples"].sum().iloc[:-1]
            rate.plot(binned.index * bin_s, binned.values / bin_s, color=colour, linewidth=1.2,
                      label=f"worker {worker}")  # the last, partial bin left out
        for marker in control_markers(run.events()):
            loss.axvline(marker["step"], color="#888888", linestyle=":", linewidth=1)
            loss.annotate(marker["label"], (marker["step"], 1), xycoords=("data", "axes fraction"),
                          fontsize=7, rotation=90, va="top", ha="right", color="#555555")
    loss.set(yscale="log", xlabel="step", ylabel="training loss (10-step mean)", title="loss per worker")
    rate.set(xlabel="seconds since the first step", ylabel="samples/s", title="throughput per worker")
    loss.legend(fontsize=8)
    figure.suptitle(title or f"{run.run_id} ({run.strategy}, {run.status})")
    return StaticFigure(figure)


def held_out_figure(result: dict[str, Any], against: str = "seconds", title: str | None = None) -> StaticFigure:
    """Held-out loss of every configuration against wall time (`against="seconds"`) or samples seen
    (`"samples"`), one panel per condition: the picture of a fidelity result (`benchmarks/fidelity.py`),
    read from its cells. Seeds of one configuration are drawn alike; DDP, the reference, in black."""
    cells = [c for c in result["cells"] if c.get("curve")]
    conditions = list(dict.fromkeys(c["condition"] for c in cells))
    configs = list(dict.fromkeys(c["config"] for c in cells))
    colours = {name: "#000000" if name == "ddp" else COLOURS[i % len(COLOURS)]
               for i, name in enumerate(n for n in configs if n != "ddp")} | {"ddp": "#000000"}
    styles = {name: ("-" if i < len(COLOURS) else "--") for i, name in enumerate(n for n in configs if n != "ddp")}
    # Two panels a row: four conditions read as a square, not a strip too wide for a page.
    columns = min(max(len(conditions), 1), 2)
    rows = max(1, -(-len(conditions) // columns))
    figure = Figure(figsize=(5.6 * columns, 4.2 * rows), layout="constrained")
    panels = figure.subplots(rows, columns, squeeze=False).ravel()
    for unused in panels[len(conditions):]:
        unused.set_visible(False)
    target = result.get("target_loss")
    for axes, condition in zip(panels, conditions):
        for name in configs:
            for index, cell in enumerate(c for c in cells if c["config"] == name and c["condition"] == condition):
                xs = [p[against] if against == "seconds" else p["step"] * cell["samples_per_step"]
                      for p in cell["curve"]]
                axes.plot(xs, [p["loss"] for p in cell["curve"]], color=colours[name], marker=".",
                          linestyle=styles.get(name, "-"), linewidth=1.6 if name == "ddp" else 1.2,
                          label=name if index == 0 else None)
        if target is not None:
            axes.axhline(target, color="#888888", linestyle=":", linewidth=1)
        axes.set(title=condition, xlabel="seconds since the first step" if against == "seconds" else "samples seen",
                 ylabel="held-out loss (nats per byte)")
    handles, labels = panels[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside right center", fontsize=8)  # beside the panels, over no curve
    if title:
        figure.suptitle(title)
    return StaticFigure(figure)
