"""The notebook control panel without a cluster: a run not started yet, and the worker table (the panel
driving a real run: tests/cluster/test_control_panel_cluster.py)."""
from __future__ import annotations

import functools

import pytest

import workbench
from widgets import ControlPanel

import helpers

pytestmark = [pytest.mark.timeout(240)]

digits_job = functools.partial(helpers.digits_job, lr=0.05, momentum=0.7, batch_size=8, epochs=200)


def test_a_panel_of_an_unstarted_run_offers_only_start_and_refuses_a_too_fast_refresh():
    run = workbench.train(digits_job(), "ssp", max_staleness=1, start=False)  # no cluster needed yet
    with pytest.raises(workbench.ConfigError, match="refresh_s"):
        ControlPanel(run, refresh_s=0.05)
    panel = ControlPanel(run)
    try:
        assert not panel.start_button.disabled and panel.start_button.description == "Start"
        assert all(w.disabled for w in (panel.pause_button, panel.resume_button, panel.stop_button,
                                        panel.switch_button, panel.lr_slider, panel.period_slider))
        assert panel.strategy_dropdown.value == "ssp" and panel.setting_widgets["max_staleness"].value == 1
        assert panel.period_slider.description == "push_every"
        assert "new run" in panel.title.value and "created" in panel.title.value
        assert sorted(panel.strategy_dropdown.options) == sorted([*workbench.STRATEGIES, "auto"])
    finally:
        panel.close()


def test_the_worker_table_shows_gpu_memory_and_use_only_where_workers_report_them():
    from widgets.control_panel import _worker_table

    row = {"worker": 0, "state": "training", "step": 7, "samples_per_s": 1200.0, "last_seen_s": 0.2,
           "address": "tcp://10.0.0.1:4000"}
    cpu = _worker_table([row, {**row, "worker": 1}])
    assert "GPU" not in cpu
    gpu = _worker_table([{**row, "gpu_memory_mb": 2048.4, "gpu_utilization": 97.0},
                         {**row, "worker": 1, "gpu_memory_mb": 1024.0}])
    assert "<th>GPU memory (MB)</th><th>GPU use (%)</th>" in gpu
    assert "<td>2,048</td><td>97</td>" in gpu and "<td>1,024</td><td></td>" in gpu


def test_the_panel_says_where_each_recoverys_time_went():
    run = workbench.train(digits_job(), "allreduce", start=False)
    panel = ControlPanel(run)
    try:
        snapshot = run.snapshot()
        assert snapshot["recoveries"] == [] and panel.recovery_text.value == ""
        lost = {"lost": ["tcp://10.0.0.3:4000"], "generation": 1, "total_s": 3.7,
                "phases_s": {"detected": 1.5, "agreed": 0.5, "restored": 0.9, "first_step": 0.8}}
        panel._draw({**snapshot, "recoveries": [lost]})
        assert ("recovered from losing tcp://10.0.0.3:4000 in 3.7 s (fault to detected 1.5 s, detected to survivors "
                "agreed 0.5 s, agreed to state restored 0.9 s, restored to first step after 0.8 s)") in panel.recovery_text.value
    finally:
        panel.close()


def test_the_panel_says_what_the_link_alone_would_allow_and_the_share_the_run_reaches():
    from workbench.plane.link import LinkBook

    book = LinkBook()
    for step in range(16):
        for worker in range(2):  # ssp at 100 Mbit/s: the whole model (7.45 MB) each way, a round trip of 1.2 s
            book.add({"worker": worker, "step": step, "time": 100 + 1.27 * step, "samples": 128, "compute_s": 0.07,
                      "strategy": "ssp", "bytes_sent": 7_450_000, "bytes_received": 7_450_000, "comm_total_s": 1.2})
    run = workbench.train(digits_job(), "ssp", start=False)
    panel = ControlPanel(run)
    try:
        snapshot = run.snapshot()
        assert snapshot["link"] is None and panel.link_text.value == ""
        panel._draw({**snapshot, "link": book.limit(paced=True)})
        assert ("the link alone would allow 213 samples/s, compute alone 3,657; the run makes 202, 94% of the "
                "link&#x27;s limit (bound by the link)") in panel.link_text.value
    finally:
        panel.close()
