"""The dashboard's pure parts: roles, history stitching, rebuilding from run directories, the views'
aggregates and control requests. No cluster, no browser (the command's argument checks, each in a process
of its own: tests/cluster/test_dashboard_logic_cluster.py)."""
from __future__ import annotations

import json

import pytest

from widgets.dashboard.access import Access, is_loopback, load_credentials, policy
from widgets.dashboard.app import DashboardSession
from widgets.dashboard.hub import Hub, FollowedRun
from workbench.errors import ConfigError
from workbench.plane.metrics import MetricsTable
from workbench.cluster.announcements import control_request


def test_roles_without_sign_in_depend_on_the_listening_address():
    local, public = policy(False, [], None), policy(False, [], "0.0.0.0")
    assert local.role(None, "olivia") == "operator" and local.may_control(None, "olivia")
    assert public.role(None, "olivia") == "viewer" and not public.may_control(None, "olivia")
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("dashboard.example.org")


def test_roles_with_sign_in_owner_admin_viewer_anonymous():
    access = policy(True, ["admin", " root "], "0.0.0.0")
    assert access.admins == frozenset({"admin", "root"})
    assert access.role(None, "olivia") == "anonymous" and not access.may_control(None, "olivia")
    assert access.role("victor", "olivia") == "viewer" and not access.may_control("victor", "olivia")
    assert access.role("olivia", "olivia") == "owner" and access.may_control("olivia", "olivia")
    assert access.role("admin", "olivia") == "admin" and access.may_control("admin", "olivia")
    # Owning one run gives no say over another.
    assert not access.may_control("olivia", "oscar")


def test_credentials_file_is_checked(tmp_path):
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"admin": "secret"}))
    assert load_credentials(good) == {"admin": "secret"}
    for name, text in [("list.json", "[1]"), ("empty.json", "{}"), ("blank.json", '{"admin": ""}'),
                       ("broken.json", "{")]:
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match="--basic-auth"):
            load_credentials(tmp_path / name)
    with pytest.raises(ConfigError, match="readable"):
        load_credentials(tmp_path / "missing.json")


def test_control_requests_have_a_checked_shape():
    request = control_request("set_lr", "olivia", lr=0.1)
    assert request["action"] == "set_lr" and request["by"] == "olivia" and request["arguments"] == {"lr": 0.1}
    assert len(request["request_id"]) == 32
    assert control_request("pause", None)["by"] == "anonymous"
    with pytest.raises(ConfigError, match="action"):
        control_request("delete", "olivia")
    with pytest.raises(ConfigError, match="arguments"):
        control_request("set_lr", "olivia", learning_rate=0.1)


def _steps(worker, steps, start=1000.0):
    return [{"kind": "step", "worker": worker, "step": s, "time": start + s, "samples": 8, "loss": 1.0 / (s + 1),
             "compute_s": 0.01, "comm_s": 0.0, "wait_s": 0.0} for s in steps]


def test_replay_stitches_history_and_live_records_without_gaps_or_repeats():
    feed = FollowedRun("r")
    feed.start_buffering()
    live = _steps(0, range(8, 12))
    for record in live:  # arrive on the subscription while the history is read
        feed.on_message((0.0, {"kind": "steps", "rank": 0, "records": [{k: v for k, v in record.items()
                                                                         if k != "kind"}]}))
    history = _steps(0, range(0, 10)) + _steps(0, range(5, 10))  # file, then an overlapping scheduler backlog
    feed.replay(history)
    steps = feed.table.steps()
    assert list(steps["step"]) == list(range(12))
    assert feed.table.steps_received == 12
    # After the replay, messages go straight to the table.
    feed.on_message((0.0, {"kind": "steps", "rank": 0, "records": [
        {k: v for k, v in _steps(0, [12])[0].items() if k != "kind"}]}))
    assert feed.table.steps_received == 13


def test_views_aggregate_time_split_staleness_per_worker_and_divergence_exactly():
    table = MetricsTable()
    table.add([{"kind": "step", "worker": 0, "step": 0, "time": 10.0, "samples": 4, "loss": 2.0, "compute_s": 3.0,
                "comm_s": 1.0, "wait_s": 0.0, "staleness": 1},
               {"kind": "step", "worker": 0, "step": 1, "time": 11.0, "samples": 4, "loss": 1.0, "compute_s": 1.0,
                "comm_s": 1.0, "wait_s": 2.0, "staleness": 3},
               {"kind": "step", "worker": 1, "step": 0, "time": 10.5, "samples": 4, "loss": 4.0, "compute_s": 1.0,
                "comm_s": 0.0, "wait_s": 0.0, "divergence": 0.5, "steps_since_sync": 0, "gpu_memory_mb": 12.5},
               {"kind": "eval", "worker": 0, "step": 1, "time": 11.5, "loss": 0.7, "accuracy": 0.8}])
    view = table.live_view(history_s=10**9)
    assert view["time_split"][0] == {"compute": 4 / 8, "comm": 2 / 8, "wait": 2 / 8}
    assert view["time_split"][1] == {"compute": 1.0, "comm": 0.0, "wait": 0.0}
    assert view["staleness"]["per_worker"] == {0: {"pushes": 2, "last": 3, "mean": 2.0, "max": 3}}
    assert view["staleness"]["over_time"] == {"time": [0, 1], "staleness": [1.0, 3.0]}
    assert view["loss_time"] == {"time": [0, 1], "loss": [3.0, 1.0]}  # second 10: mean of 2.0 and 4.0
    assert view["divergence"] == {"step": [0], "divergence": [0.5]}
    rows = {row["worker"]: row for row in view["workers"]}
    assert rows[1]["gpu_memory_mb"] == 12.5 and rows[1]["divergence"] == 0.5 and rows[0]["staleness"] == 3
    assert view["evaluations"] == [{"step": 1, "time": 11.5, "loss": 0.7, "accuracy": 0.8, "bits_per_char": None,
                                    "token_accuracy": None, "final": None}]


def _write_run(directory, run_id, owner, records, summary=None):
    path = directory / run_id
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"run_id": run_id, "owner": owner, "strategy": "average",
                                                  "world_size": 2, "started": 5.0, "workers": ["a", "b"]}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"torn')
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_hub_rebuilds_finished_and_crashed_runs_from_run_directories(tmp_path):
    records = _steps(0, range(5)) + _steps(1, range(5)) + [
        {"kind": "eval", "worker": 0, "step": 4, "time": 1004.5, "loss": 0.3, "accuracy": 0.91},
        {"kind": "run-finished", "time": 1005.0}]
    _write_run(tmp_path, "done", "olivia", records, {"status": "finished", "samples_per_s": 123.0})
    _write_run(tmp_path, "crashed", "oscar", _steps(0, range(3)))
    (tmp_path / "not-a-run").mkdir()
    hub = Hub(None, tmp_path).start()
    try:
        assert {row["run"]: row["state"] for row in hub.runs()} == {"done": "finished", "crashed": "incomplete"}
        done = hub.feed("done")
        assert done.table.steps_received == 10  # every record, the torn last line skipped
        row = next(r for r in hub.runs() if r["run"] == "done")
        assert row["best_metric"] == 0.91 and row["samples_per_s"] == 123.0 and row["owner"] == "olivia"
        assert done.view()["loss"]["step"] == [0, 1, 2, 3, 4]
    finally:
        hub.close()


def test_hub_lists_an_ended_run_from_its_summary_and_reads_its_metrics_when_it_is_drawn(tmp_path):
    records = _steps(0, range(5)) + [{"kind": "eval", "worker": 0, "step": 4, "time": 1004.5, "loss": 0.3,
                                      "accuracy": 0.91}, {"kind": "run-finished", "time": 1005.0}]
    # Summaries written since they carry the best metric: the runs list needs nothing else.
    _write_run(tmp_path, "listed", "olivia", records,
               {"status": "finished", "samples_per_s": 123.0, "best_metric": ["accuracy", 0.91]})
    _write_run(tmp_path, "no-eval", "olivia", _steps(0, range(3)), {"status": "stopped", "best_metric": None})
    hub = Hub(None, tmp_path).start()
    try:
        listed = hub.feed("listed")
        assert listed.table.steps_received == 0  # not read at start
        rows = {row["run"]: row for row in hub.runs()}
        assert (rows["listed"]["best_metric"], rows["listed"]["metric"], rows["listed"]["samples_per_s"]) == \
            (0.91, "accuracy", 123.0)
        assert rows["no-eval"]["best_metric"] is None and rows["no-eval"]["state"] == "stopped"
        view = listed.view()  # drawn: read now, in full
        assert listed.table.steps_received == 5 and view["loss"]["step"] == [0, 1, 2, 3, 4]
        assert view["evaluations"][0]["accuracy"] == 0.91 and listed.best_metric() == ("accuracy", 0.91)
        assert listed.view() is view  # and once
    finally:
        hub.close()


class RecordingHub(Hub):
    """A hub that keeps the control requests it would send to runs, instead of sending them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent = []

    def request(self, run_id, action, by, **arguments):
        self.sent.append((run_id, action, by, arguments))
        return "id"


def test_session_refuses_control_on_the_server_for_viewers_and_ended_runs(tmp_path):
    _write_run(tmp_path, "done", "olivia", _steps(0, range(3)), {"status": "finished"})
    _write_run(tmp_path, "live", "olivia", _steps(0, range(3)))

    hub = RecordingHub(None, tmp_path).start()
    hub.feed("live").status = "running"
    viewer = DashboardSession(hub, Access(sign_in=True, admins=frozenset({"admin"})), user="victor")
    viewer.run_select.value = "live"
    viewer.refresh()
    assert viewer.controls.stop_button.disabled
    viewer.controls.stop_button.disabled = False  # what a tampering browser can do
    viewer.controls.stop_button.clicks += 1
    assert hub.sent == [] and "refused" in viewer.controls.message.object
    owner = DashboardSession(hub, Access(sign_in=True), user="olivia")
    owner.run_select.value = "live"
    assert owner.controls.act("set_lr", lr=-1.0) is False and hub.sent == []
    assert owner.controls.act("switch", strategy="average", settings='{"period": 0}') is False and hub.sent == []
    assert owner.controls.act("set_lr", lr=0.02) and owner.controls.act("switch", strategy="average", settings='{"period": 3}')
    assert hub.sent == [("live", "set_lr", "olivia", {"lr": 0.02}),
                        ("live", "switch", "olivia", {"strategy": "average", "settings": {"period": 3}})]
    # Pin is for runs started with strategy='auto' only.
    owner.refresh()
    assert owner.controls.pin_button.disabled and not owner.controls.switch_button.disabled
    hub.feed("live").describe({"auto": True})  # what the run's registration says of a run started as 'auto'
    owner.refresh()
    assert not owner.controls.pin_button.disabled
    owner.controls.pin_button.clicks += 1
    assert hub.sent[-1] == ("live", "pin", "olivia", {})
    owner.run_select.value = "done"
    assert owner.controls.act("stop") is False and "ended" in owner.controls.message.object
    hub.close()


def test_compare_view_overlays_runs_on_one_time_axis(tmp_path):
    _write_run(tmp_path, "a", "olivia", _steps(0, range(4), start=1000.0), {"status": "finished"})
    _write_run(tmp_path, "b", "olivia", _steps(0, range(6), start=5000.0), {"status": "finished"})
    hub = Hub(None, tmp_path).start()
    session = DashboardSession(hub, Access())
    session.tab_views["Compare"].select.value = ["a", "b"]
    data = session.tab_views["Compare"].sources["compare-loss"].data
    assert data["run"] == ["a", "b"]
    # Seconds since each run's first step: both start at 0 although they ran hours apart.
    assert data["xs"] == [[0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]
    assert data["ys"][1] == [1.0, 0.5, 1 / 3, 0.25, 0.2, 1 / 6]
    assert list(session.tab_views["Compare"].table.object["run"]) == ["a", "b"]
    hub.close()


def test_workers_the_scheduler_removes_show_as_lost_in_their_live_runs(tmp_path):
    _write_run(tmp_path, "live", "olivia", [
        {"kind": "worker-started", "worker": 0, "address": "a", "time": 999.0},
        {"kind": "worker-started", "worker": 1, "address": "b", "time": 999.0}] + _steps(0, range(2)) + _steps(1, range(2)))
    _write_run(tmp_path, "done", "olivia", [
        {"kind": "worker-started", "worker": 0, "address": "a", "time": 999.0}], {"status": "finished"})
    hub = Hub(None, tmp_path).start()
    hub.feed("live").status = "running"
    hub._on_membership(0.0, {"action": "remove-worker", "worker": "a"})
    states = {row["address"]: row["state"] for row in hub.feed("live").view()["workers"]}
    assert states == {"a": "lost", "b": "running"}
    # A finished run keeps its workers' last state: losing the machine later is not its news.
    assert [row["state"] for row in hub.feed("done").view()["workers"]] == ["running"]
    hub.close()


def test_session_follows_the_newest_run_until_the_viewer_picks_one(tmp_path):
    _write_run(tmp_path, "first", "olivia", _steps(0, range(2)), {"status": "finished"})
    hub = Hub(None, tmp_path).start()
    session = DashboardSession(hub, Access())
    assert session.run_select.value == "first"
    second = _write_run(tmp_path, "second", "olivia", _steps(0, range(2)))
    (second / "config.json").write_text(json.dumps({"run_id": "second", "owner": "olivia", "started": 6.0}))
    hub._load_directory(second)
    hub._runs = None  # the runs list is cached for a quarter of a second
    session.refresh()
    assert session.run_select.value == "second"
    session.run_select.value = "first"  # the viewer picks
    third = _write_run(tmp_path, "third", "olivia", _steps(0, range(2)))
    (third / "config.json").write_text(json.dumps({"run_id": "third", "owner": "olivia", "started": 7.0}))
    hub._load_directory(third)
    hub._runs = None
    session.refresh()
    assert session.run_select.value == "first" and session.run_select.options[0] == "third"
    hub.close()


def test_a_run_that_is_not_learning_says_so_in_the_status_line_and_on_the_loss_chart(tmp_path):
    warning = {"kind": "training-warning", "reason": "not-learning", "step": 3, "time": 1003.5,
               "message": "the training loss is still 2.3 at step 3, where it started (2.3): the run is not learning"}
    _write_run(tmp_path, "stalled", "olivia", _steps(0, range(6)) + [warning])
    hub = Hub(None, tmp_path).start()
    try:
        session = DashboardSession(hub, Access(sign_in=False), user=None)
        session.run_select.value = "stalled"
        session.refresh()
        assert "⚠ the training loss is still 2.3 at step 3" in session.status_line.pane.object
        assert hub.feed("stalled").view()["markers"][-1]["label"] == "warning: not-learning"
    finally:
        hub.close()


def test_the_switch_settings_are_a_form_made_from_the_strategy_not_a_json_box(tmp_path):
    import panel as pn

    from workbench.cli.setting_flags import form_fields

    _write_run(tmp_path, "live", "olivia", _steps(0, range(3)))

    hub = RecordingHub(None, tmp_path).start()
    try:
        feed = hub.feed("live")
        feed.status = "running"
        feed.describe({"settings": {"period": 16, "overlap": True, "wire_dtype": "bf16", "outer_lr": 1.0,
                                    "outer_momentum": 0.0, "average_optimizer_state": False}})
        owner = DashboardSession(hub, Access(sign_in=True), user="olivia")
        owner.run_select.value = "live"
        owner.refresh()
        controls = owner.controls
        # The picked run's strategy, with its own values, one widget per setting of the kind it takes.
        assert controls.strategy_select.value == "average"
        form = controls.settings_form.widgets
        assert list(form) == [field.name for field in form_fields("average")]
        assert isinstance(form["overlap"], pn.widgets.Checkbox) and form["overlap"].value is True
        assert isinstance(form["wire_dtype"], pn.widgets.Select) and form["wire_dtype"].value == "bf16"
        assert isinstance(form["period"], pn.widgets.IntInput) and form["period"].value == 16
        form["period"].value = 64
        controls.switch_button.clicks += 1
        assert hub.sent[-1] == ("live", "switch", "olivia", {"strategy": "average", "settings": {
            "period": 64, "average_optimizer_state": False, "overlap": True, "wire_dtype": "bf16",
            "outer_lr": 1.0, "outer_momentum": 0.0, "sparse_density": None, "sparse_bits": 2, "balance": False,
            "rebalance_every": 10}})
        # Another strategy: its defaults, an optional number left empty means its default (None).
        controls.strategy_select.value = "async"
        form = controls.settings_form.widgets
        assert isinstance(form["fetch_every"], pn.widgets.TextInput) and form["fetch_every"].value == ""
        assert form["reply_compression"].value is None and form["compression"].value == "none"
        form["compression"].value = "topk"
        form["fetch_every"].value = "16"
        controls.switch_button.clicks += 1
        assert hub.sent[-1][3]["settings"]["compression"] == "topk"
        assert hub.sent[-1][3]["settings"]["fetch_every"] == 16 and hub.sent[-1][3]["settings"]["reply_compression"] is None
        # A bad value is refused on the server with the strategy's own message, and nothing is sent.
        form["push_every"].value = 0
        sent = len(hub.sent)
        controls.switch_button.clicks += 1
        assert len(hub.sent) == sent and "push_every=0 is not allowed" in controls.message.object
    finally:
        hub.close()


def test_sessions_draw_only_their_open_tab_and_share_the_worker_table_they_draw_alike(tmp_path):
    # What a session pays per redraw, times the viewers: the closed tabs are not drawn (they are not in
    # the browser), and the worker table's HTML is made once per run view for every session.
    _write_run(tmp_path, "live", "olivia", _steps(0, range(6)) + _steps(1, range(6)))
    hub = Hub(None, tmp_path).start()
    try:
        sessions = [DashboardSession(hub, Access(sign_in=False)) for _ in range(2)]
        for session in sessions:
            session.run_select.value = "live"
            session.refresh()
        tables = [session.tab_views["Run"].worker_table.object for session in sessions]
        assert tables[0].count("<tr") == 3 and tables[0] is tables[1]  # header and two workers, one string
        details = sessions[0].tab_views["Run details"]
        loss_time = sessions[0].screen.sources["loss-time"]
        assert len(loss_time.data["time"]) == 0  # closed: never drawn
        sessions[0].tabs.active = list(sessions[0].tab_views).index("Run details")
        assert len(loss_time.data["time"]) == len(hub.feed("live").view()["loss_time"]["time"]) > 0
        assert details.screen is sessions[0].screen
    finally:
        hub.close()


def test_the_dashboards_worker_table_shows_gpu_gauges_rounded_and_only_where_reported():
    from widgets.dashboard.views.overview import worker_frame

    row = {"worker": 0, "address": "tcp://a:1", "state": "training", "step": 3, "samples_per_s": 10.4,
           "last_seen_s": 1.0}
    assert "GPU memory (MB)" not in worker_frame([row], {}).columns  # CPU workers: no GPU columns
    frame = worker_frame([{**row, "gpu_memory_mb": 65.482422, "gpu_utilization": 73.0},
                          {**row, "worker": 1, "gpu_memory_mb": 1024.6, "gpu_utilization": None}], {})
    assert list(frame["GPU memory (MB)"]) == [65, 1025] and frame["GPU use (%)"].iloc[0] == 73


def test_run_details_draw_each_recovery_as_a_waterfall_of_its_phases(tmp_path):
    recovered = {"kind": "recovered", "time": 1010.0, "lost": ["tcp://a:3"], "generation": 1, "from_step": 4,
                 "total_s": 3.7, "moments": {}, "phases_s": {"detected": 1.5, "agreed": 0.5, "restored": 0.9,
                                                             "first_step": 0.8}}
    _write_run(tmp_path, "recovered", "olivia", _steps(0, range(6)) + [recovered])
    hub = Hub(None, tmp_path).start()
    try:
        session = DashboardSession(hub, Access(sign_in=False))
        session.run_select.value = "recovered"
        session.tabs.active = list(session.tab_views).index("Run details")
        session.refresh()
        bars = session.screen.sources["recoveries"].data
        assert bars["recovery"] == ["1: lost tcp://a:3, 3.7 s"]
        assert [bars[phase][0] for phase in ("detected", "agreed", "restored", "first_step")] == [1.5, 0.5, 0.9, 0.8]
        assert list(session.tab_views["Run details"].recovery_y_range.factors) == bars["recovery"]
    finally:
        hub.close()
