"""Views of many workers (workbench/plane/worker_spread.py): the distribution over workers, the slowest first,
and the dashboard session drawing a 256-worker run with as much data per redraw as a 4-worker one."""
import json

import numpy as np
import pytest

from widgets.dashboard.access import Access
from widgets.dashboard.app import DashboardSession
from widgets.dashboard.hub import Hub
from workbench.plane import worker_spread
from workbench.plane.metrics import MetricsTable


def rows(rates, states=None):
    states = states or {}
    return [{"worker": w, "state": states.get(w, "running"), "samples_per_s": rate} for w, rate in rates.items()]


def test_the_spread_is_the_median_and_p10_p90_over_workers_at_each_point():
    per_worker = {w: [float(w), 100.0 + w] for w in range(11)}  # 0..10 and 100..110
    found = worker_spread.spread(per_worker)
    assert found["median"] == [5.0, 105.0] and found["p10"] == [1.0, 101.0] and found["p90"] == [9.0, 109.0]
    assert worker_spread.spread({}) == {"median": [], "p10": [], "p90": []}
    assert worker_spread.spread({0: [], 1: []}) == {"median": [], "p10": [], "p90": []}


def test_a_few_workers_keep_their_own_rows_and_many_show_the_slowest_first():
    few = rows({w: 100.0 - w for w in range(worker_spread.PER_WORKER_LINES)})
    assert worker_spread.table_rows(few) == (few, "") and worker_spread.slowest_line(few) == ""
    rates = {w: 1000.0 + w for w in range(40)}
    rates[17], rates[3] = 250.0, 500.0
    many = rows(rates, states={33: "lost"})
    shown, which = worker_spread.table_rows(many)
    assert len(shown) == worker_spread.TABLE_ROWS and which == "the 25 slowest of 40 workers, slowest first"
    # A worker not training comes first, then the lowest rates; the rest in order of rate.
    assert [row["worker"] for row in shown[:5]] == [33, 17, 3, 0, 1]
    assert worker_spread.slowest_line(many) == ("slowest: worker 33 (lost), worker 17 (250 samples/s), "
                                                "worker 3 (500 samples/s), worker 0 (1,000 samples/s), "
                                                "worker 1 (1,001 samples/s)")


def test_live_view_gives_a_spread_only_for_many_workers():
    def table(workers):
        t = MetricsTable()
        t.add([{"kind": "step", "worker": w, "step": s, "time": 1000.0 + s, "samples": 8 * (w + 1), "loss": 1.0}
               for s in range(5) for w in range(workers)])
        return t.live_view()

    assert table(4)["throughput"]["spread"] is None
    view = table(40)["throughput"]
    rates = np.array([view["per_worker"][w] for w in range(40)])
    assert view["spread"]["median"] == pytest.approx(np.median(rates, axis=0).tolist())
    assert len(view["spread"]["p90"]) == len(view["time"]) > 0


def _numbers_sent(session):
    """How many values the Run tab's throughput plot holds: what each redraw sends each browser."""
    total = 0
    for name in ("throughput", "throughput-workers", "throughput-spread"):
        for column in session.screen.sources[name].data.values():
            total += sum(len(c) for c in column) if len(column) and hasattr(column[0], "__len__") else len(column)
    return total


def _run_dir(directory, workers, slow=17):
    """A run directory as a run of `workers` leaves it: 30 s of steps, worker `slow` at a quarter speed."""
    path = directory / f"run-{workers}"
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"run_id": path.name, "owner": "olivia", "strategy": "allreduce",
                                                  "world_size": workers, "started": 5.0}))
    records = [{"kind": "step", "worker": w, "step": s, "time": 1000.0 + s / 4, "samples": 8 if w == slow else 32,
                "loss": 1.0, "compute_s": 0.01, "comm_s": 0.0, "wait_s": 0.0}
               for s in range(120) for w in range(workers)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path.name


def test_a_256_worker_run_draws_a_band_the_slowest_and_no_more_data_than_4_workers(tmp_path):
    few, many = _run_dir(tmp_path, 4, slow=None), _run_dir(tmp_path, 256)
    hub = Hub(None, tmp_path).start()
    try:
        session = DashboardSession(hub, Access(sign_in=False))
        session.run_select.value = few
        session.refresh()
        sent_for_few = _numbers_sent(session)
        assert len(session.screen.sources["throughput-workers"].data["xs"]) == 4
        session.run_select.value = many
        session.refresh()
        overview = session.tab_views["Run"]
        band = session.screen.sources["throughput-spread"].data
        assert len(session.screen.sources["throughput-workers"].data["xs"]) == 0  # no line per worker
        assert len(band["median"]) == len(band["time"]) > 0
        assert all(lo <= mid <= hi for lo, mid, hi in zip(band["p10"], band["median"], band["p90"]))
        assert 0 < _numbers_sent(session) <= sent_for_few
        # 25 rows of 256, the slowest first.
        assert overview.worker_table.object.count("<tr") == worker_spread.TABLE_ROWS + 1
        assert "the 25 slowest of 256 workers" in overview.worker_table.object
        assert overview.slowest.object.startswith("slowest: worker 17 (32 samples/s), worker 0 (128 samples/s)")
        assert overview.worker_table.object.index("<td>17</td>") < overview.worker_table.object.index("<td>0</td>")
    finally:
        hub.close()
