"""Many workers on one screen: per-worker series become a distribution, and per-worker rows are ordered by
who is slowest, past the number of workers a person can tell apart.

With 2-8 workers the panel and the dashboard draw one throughput line and one table row per worker. At 64
or 1,024, lines are an unreadable smear and a table of every worker is pages of rows that change at each
redraw (and cost every viewer's browser as much). Above `PER_WORKER_LINES` workers they show instead the
median with the p10-p90 band over time, the slowest workers named, and the `TABLE_ROWS` slowest rows.
Pure: the views draw what these functions return.
"""
from __future__ import annotations

from typing import Any

import numpy as np

PER_WORKER_LINES = 16  # up to this many workers, one line and one row each
TABLE_ROWS = 25  # past it, the table shows this many rows, the slowest first
NAMED_SLOWEST = 5  # and the summary names this many of them
GONE = ("lost", "failed")  # worker states that come before any rate


def many(workers: int) -> bool:
    """Whether per-worker views give way to distributions."""
    return workers > PER_WORKER_LINES


def spread(per_worker: dict[int, list[float]]) -> dict[str, list[float]]:
    """Per point in time, the median and the 10th and 90th percentiles over the workers' series (all of
    one length); empty lists where there are none."""
    if not per_worker:
        return {"median": [], "p10": [], "p90": []}
    rates = np.asarray(list(per_worker.values()), dtype=float)  # workers x points
    if rates.shape[1] == 0:
        return {"median": [], "p10": [], "p90": []}
    p10, median, p90 = np.percentile(rates, [10, 50, 90], axis=0)
    return {"median": median.tolist(), "p10": p10.tolist(), "p90": p90.tolist()}


def slowest_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Worker rows ordered by who is slowest: workers gone (lost, failed) first, then by their recent
    samples/s, lowest first; ties by worker number."""
    def key(row: dict[str, Any]) -> tuple[int, float, int]:
        return (0 if row.get("state") in GONE else 1, row.get("samples_per_s") or 0.0, row["worker"])
    return sorted(rows, key=key)


def table_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The rows a worker table shows and a line saying which: every row in worker order for a few workers;
    for many, the TABLE_ROWS slowest first."""
    if not many(len(rows)):
        return rows, ""
    return slowest_first(rows)[:TABLE_ROWS], f"the {TABLE_ROWS} slowest of {len(rows)} workers, slowest first"


def slowest_line(rows: list[dict[str, Any]]) -> str:
    """'slowest: worker 17 (812 samples/s), ...' for many workers; empty for a few (every one is drawn)."""
    if not many(len(rows)):
        return ""
    named = slowest_first(rows)[:NAMED_SLOWEST]
    return "slowest: " + ", ".join(
        f"worker {row['worker']} ({row['state']})" if row.get("state") in GONE
        else f"worker {row['worker']} ({row.get('samples_per_s') or 0:,.0f} samples/s)" for row in named)
