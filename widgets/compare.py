"""Side-by-side views of several runs: loss against wall time, throughput and staleness, and a table.

Built from each run's public metrics (`Run.metrics`, `Run.summary()`), so it works on live and on
finished runs alike.
"""
from __future__ import annotations

from typing import Any

import bqplot
import ipywidgets as ipw
import pandas as pd

COLOURS = ["#0969da", "#cf222e", "#1a7f37", "#9a6700", "#8250df", "#bf3989", "#555555"]


def comparison_table(runs: list[Any]) -> pd.DataFrame:
    """One row per run: strategy, samples/s, final loss, held-out accuracy, staleness, time split."""
    rows = []
    for run in runs:
        summary = run.summary()
        evaluations = run.evaluations
        final = evaluations[evaluations["final"]] if "final" in evaluations else evaluations
        staleness = summary.get("staleness", {})
        split = summary.get("time_split", {})
        rows.append({
            "run": run.run_id, "strategy": run.strategy, "samples/s": summary.get("samples_per_s"),
            "final loss": summary.get("final_loss"),
            "accuracy": float(final["accuracy"].iloc[-1]) if "accuracy" in final and len(final) else None,
            "staleness mean": staleness.get("mean"), "staleness max": staleness.get("max"),
            "compute": split.get("compute"), "comm": split.get("comm"), "wait": split.get("wait"),
        })
    return pd.DataFrame(rows).set_index("run")


def loss_against_time(run: Any, bin_s: float = 0.5) -> tuple[list[float], list[float]]:
    """Mean loss of all workers in each `bin_s` of wall time since the run's first step."""
    frame = run.metrics
    if frame.empty:
        return [], []
    seconds = frame["time"] - frame["time"].min()
    binned = frame.groupby((seconds // bin_s) * bin_s)["loss"].mean()
    return binned.index.tolist(), binned.tolist()


def compare_runs(runs: list[Any], labels: list[str] | None = None) -> ipw.VBox:
    """Loss against wall time, throughput and staleness of `runs`, side by side, above a summary table."""
    strategies = [run.strategy for run in runs]
    # Bars sit on categories: runs of the same strategy need labels of their own.
    labels = labels or [s if strategies.count(s) == 1 else f"{s} {i + 1}" for i, s in enumerate(strategies)]
    colours = [COLOURS[i % len(COLOURS)] for i in range(len(runs))]
    table = comparison_table(runs)
    layout = {"width": "380px", "height": "280px"}
    margin = {"top": 30, "bottom": 45, "left": 55, "right": 10}

    x, y = bqplot.LinearScale(), bqplot.LogScale()
    # One mark per run: runs have curves of different lengths.
    loss = [bqplot.Lines(x=steps, y=values, labels=[label], colors=[colour], display_legend=True,
                         scales={"x": x, "y": y})
            for (steps, values), label, colour in zip(map(loss_against_time, runs), labels, colours)]
    loss_figure = bqplot.Figure(marks=loss, title="loss against wall time", layout=layout, fig_margin=margin,
                                axes=[bqplot.Axis(scale=x, label="seconds"),
                                      bqplot.Axis(scale=y, side="left", label="loss")])

    def bars(column: str, title: str) -> bqplot.Figure:
        x, y = bqplot.OrdinalScale(), bqplot.LinearScale(min=0)
        values = [0.0 if pd.isna(v) else float(v) for v in table[column]]
        mark = bqplot.Bars(x=labels, y=values, colors=colours, scales={"x": x, "y": y})
        return bqplot.Figure(marks=[mark], title=title, layout=layout, fig_margin=margin,
                             axes=[bqplot.Axis(scale=x), bqplot.Axis(scale=y, side="left")])

    figures = ipw.HBox([loss_figure, bars("samples/s", "throughput (samples/s)"),
                        bars("staleness mean", "mean staleness (versions)")])
    rendered = table.to_html(float_format=lambda v: f"{v:,.3g}", na_rep="-")
    return ipw.VBox([figures, ipw.HTML(f"<div style='font-size:90%'>{rendered}</div>")])
