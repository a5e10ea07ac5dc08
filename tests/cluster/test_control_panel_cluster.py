"""The notebook control panel driven headlessly (widgets without a browser) against a real cluster run (a
run not started yet and the worker table, without a cluster: tests/unit/test_control_panel.py)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

import workbench
from widgets import ControlPanel, compare_runs
from widgets.compare import comparison_table

import helpers
from helpers import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]

digits_job = functools.partial(helpers.digits_job, lr=0.05, momentum=0.7, batch_size=8, epochs=200)


def events_of_both(run, kind, **match):
    found = [e for e in run.events(kind) if all(e.get(k) == v for k, v in match.items())]
    return sorted(found, key=lambda e: e["worker"]) if {e["worker"] for e in found} == {0, 1} else []


def test_panel_buttons_sliders_and_dropdown_drive_the_run(client, run_dir):
    run = workbench.train(digits_job(), "average", client=client, run_dir=run_dir, period=2, start=False)
    panel = ControlPanel(run, refresh_s=0.2)
    try:
        assert run.status == "created" and not panel.start_button.disabled and panel.pause_button.disabled
        panel.start_button.click()
        assert run.status == "running"
        wait_until(lambda: len(run.table.last_steps()) == 2, timeout_s=60)

        # Learning-rate slider: the workers' own records carry the new rate.
        panel.lr_slider.value = 0.02
        chosen_lr = panel.lr_slider.value
        wait_until(lambda: len(events_of_both(run, "changed", lr=chosen_lr)) == 2, timeout_s=60)
        lr_step = max(e["step"] for e in events_of_both(run, "changed", lr=chosen_lr))
        wait_until(lambda: min(r["step"] for r in run.table.last_steps().values()) > lr_step + 2, timeout_s=60)
        frame = run.metrics
        assert np.allclose(frame[frame["step"] > lr_step]["lr"], chosen_lr)

        # Period slider: syncs now come every 6 steps.
        panel.period_slider.value = 6
        wait_until(lambda: len(events_of_both(run, "changed", settings={"period": 6})) == 2, timeout_s=60)
        period_step = events_of_both(run, "changed", settings={"period": 6})[0]["step"]
        wait_until(lambda: min(r["step"] for r in run.table.last_steps().values()) > period_step + 20, timeout_s=60)
        frame = run.metrics
        syncs = frame[(frame["worker"] == 0) & (frame["step"] >= period_step) & frame["divergence"].notna()]["step"]
        assert set(np.diff(syncs.to_numpy())) == {6}

        # Pause and resume: no worker takes a step in between.
        panel.pause_button.click()
        wait_until(lambda: len(events_of_both(run, "paused")) == 2, timeout_s=60)
        assert run.status == "paused" and panel.resume_button.disabled is False
        panel.resume_button.click()
        wait_until(lambda: len(events_of_both(run, "resumed")) == 2, timeout_s=60)
        for paused, resumed in zip(events_of_both(run, "paused"), events_of_both(run, "resumed")):
            assert paused["step"] == resumed["step"]

        # The strategy dropdown with its settings form switches the run at one step for all workers.
        panel.strategy_dropdown.value = "async"
        assert set(panel.setting_widgets) >= {"push_every", "fetch_every", "compression"}
        panel.setting_widgets["push_every"].value = 2
        panel.switch_button.click()
        assert panel.message.value == ""
        wait_until(lambda: len(events_of_both(run, "switched")) == 2, timeout_s=60)
        switches = events_of_both(run, "switched")
        assert switches[0]["step"] == switches[1]["step"] and switches[0]["to"] == "async"
        assert switches[0]["settings"]["push_every"] == 2
        wait_until(lambda: min(r["step"] for r in run.table.last_steps().values()) > switches[0]["step"] + 5,
                   timeout_s=60)
        assert panel.period_slider.description == "push_every"  # the slider now moves push_every

        # A bad setting is reported in the panel, and nothing is switched.
        panel.strategy_dropdown.value = "ssp"
        panel.setting_widgets["max_staleness"].value = -1
        panel.switch_button.click()
        assert "max_staleness" in panel.message.value and run.strategy == "async"

        panel.stop_button.click()
        assert run.wait(120) == "stopped"
        panel.refresh()
        assert "stopped" in panel.title.value and panel.stop_button.disabled and not panel.start_button.disabled
        assert panel.worker_table.value.count("<tr>") == 3  # header and both workers
        assert len(panel.loss_line.x) > 10 and len(panel.throughput_lines.y) == 3  # total and two workers
        labels = list(panel.change_marks.names)
        assert "average -> async" in labels and "paused" in labels and "period 6" in labels
        assert run.directory.path.as_posix() in panel.links.value and "Dask dashboard" in panel.links.value
        assert sum(panel.staleness_bars.y) > 0  # the async phase pushed
    finally:
        panel.close()
        run.stop()


def test_a_run_displays_as_its_panel_and_compare_builds(client, run_dir):
    runs = []
    for strategy in ("allreduce", "async"):  # one after the other: a worker trains one run at a time
        runs.append(workbench.train(digits_job(epochs=1), strategy, client=client, run_dir=run_dir))
        runs[-1].wait(120)
    bundle = runs[0]._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert runs[0]._panel.run is runs[0]
    table = comparison_table(runs)
    assert list(table["strategy"]) == ["allreduce", "async"]
    assert table["samples/s"].gt(0).all() and table["accuracy"].gt(0.5).all()
    assert np.isnan(table["staleness mean"].iloc[0]) and table["staleness mean"].iloc[1] >= 0
    view = compare_runs(runs)
    loss_lines = view.children[0].children[0].marks
    assert [line.labels[0] for line in loss_lines] == ["allreduce", "async"]
    assert all(len(line.y) > 0 and np.isfinite(line.y).all() for line in loss_lines)
    runs[0]._panel.close()
