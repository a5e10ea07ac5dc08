"""The team dashboard served for real: `workbench dashboard` in its own process against the test cluster,
loaded in headless Chromium (Debian's package, driven by Playwright), while runs train.

Screenshots land in `test-artifacts/` at the repository root.
"""
from __future__ import annotations

import contextlib
import functools
import json
import multiprocessing
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError, expect

import workbench
from workbench.plane.metrics import topic
from workbench.plane.rundir import read_metrics
from workbench.comm.collectives import find_free_port as free_port

from widgets.dashboard.serve import first_page

import helpers
from helpers import chromium, end_processes, load_benchmark

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
COUNT = "() => {{ const s = Bokeh.documents[0].get_model_by_name('{name}'); return s ? s.data['{column}'].length : -1 }}"


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


def served(client, runs_dir, *options):
    """`workbench dashboard` in a child process; yields its URL once it answers; always stopped."""
    port = free_port()
    return serving([sys.executable, "-m", "workbench", "dashboard", "--scheduler", client.scheduler.address,
                    "--port", str(port), "--runs-dir", str(runs_dir), *options], port, "--basic-auth" in options)


@contextlib.contextmanager
def serving(command, port, sign_in=False, path=""):
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/{path}"
    try:
        first_page(url + "login" if sign_in else url, process, describe=process.stdout.read)
        yield Served(url, process)
    finally:
        end_processes([process], timeout_s=15)


def thread_niceness(pid):
    """The niceness of each thread of a process (a thread that ends meanwhile is left out)."""
    values = set()
    for thread in (Path("/proc") / str(pid) / "task").iterdir():
        try:
            values.add(os.getpriority(os.PRIO_PROCESS, int(thread.name)))
        except ProcessLookupError:
            pass
    return values


class Served(str):
    """The URL of a dashboard served by `serving`, with its process."""

    def __new__(cls, url, process):
        served = super().__new__(cls, url)
        served.process = process
        return served


def open_dashboard(browser, url, run_id, user=None, password=None):
    """A page of the dashboard in a fresh browser context (its own cookies: one signed-in user)."""
    page = _blank_page(browser)
    page.goto(url)
    if user:
        page.fill("input[name=username]", user)
        page.fill("input[name=password]", password)
        page.keyboard.press("Enter")
    return shown(page, run_id)


def open_dashboards(browser, url, run_id, viewers):
    """`viewers` pages of the dashboard, each in its own context, loading side by side as a team's would."""
    pages = [_blank_page(browser) for _ in range(viewers)]
    for page in pages:
        page.goto(url, wait_until="commit")
    return [shown(page, run_id) for page in pages]


def _blank_page(browser):
    return browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()


def shown(page, run_id):
    """`page`, once its dashboard is drawn with `run_id` chosen."""
    page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0", timeout=30_000)
    # Panel renders into shadow roots: Playwright's locators look inside them, document.body.innerText does not.
    expect(page.get_by_role("combobox", name="Run", exact=True)).to_have_value(run_id, timeout=30_000)
    return page


def open_tab(page, title):
    """Only the open tab is in the page (the dashboard's tabs are dynamic)."""
    page.locator(".bk-tab", has_text=re.compile(rf"^\s*{re.escape(title)}\s*$")).first.click()  # "Run", not "Runs"


def count(page, name, column):
    return page.evaluate(COUNT.format(name=name, column=column))


def _paced_loss(outputs, targets):
    # A live run for the dashboard to follow, paced so that it leaves the two cores mostly to the
    # dashboard's server and Chromium (at full speed, loading one page took 9 s); changes no number.
    time.sleep(PACE_S)
    return torch.nn.functional.cross_entropy(outputs, targets)


PACE_S = 0.01  # per step and worker: at most 100 steps/s each
long_job = functools.partial(helpers.digits_job, lr=0.05, momentum=0.7, batch_size=8, epochs=1000, eval_every=100,
                             loss=_paced_loss)


def test_dashboard_follows_a_training_run_live_with_one_subscription(client, run_dir, browser):
    run = workbench.train(long_job(), "async", client=client, run_dir=run_dir, owner="olivia")
    try:
        run.wait_for_step(20)
        with served(client, run_dir) as url:
            page = open_dashboard(browser, url, run.run_id)
            # The plots hold data points, and more arrive while the run trains.
            page.wait_for_function(f"() => ({COUNT.format(name='throughput', column='time')}) () >= 2"
                                   f" && ({COUNT.format(name='staleness', column='time')}) () >= 2", timeout=30_000)
            before = (count(page, "throughput", "time"), count(page, "staleness", "time"))
            page.wait_for_function(
                f"() => ({COUNT.format(name='throughput', column='time')}) () > {before[0]}"
                f" && ({COUNT.format(name='staleness', column='time')}) () > {before[1]}", timeout=30_000)
            assert count(page, "staleness-histogram", "pushes") >= 1
            # The worker table lists every worker of the run, with its address.
            rows = page.locator(".worker-table table tbody tr")
            assert rows.count() == 2
            for address in run.worker_addresses:
                expect(page.locator(".worker-table table")).to_contain_text(address)
            # What the link alone would allow the run, and the share of it the run reaches (plane/link.py).
            expect(page.locator(".link-limit")).to_contain_text(re.compile(r"link: about .* of the link's limit"))
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            # The Workers tab says which run holds each of the cluster's workers (its lease), and who waits.
            open_tab(page, "Workers")
            for address in run.worker_addresses:
                expect(page.locator(".workers-table table tr", has_text=address)).to_contain_text(run.run_id,
                                                                                                  timeout=30_000)
            expect(page.get_by_text("0 of 2 workers free")).to_be_visible()
            open_tab(page, "Run")

            # More viewers share the dashboard's one subscription to the run.
            others = open_dashboards(browser, url, run.run_id, 3)
            subscribers = client.run_on_scheduler(
                lambda dask_scheduler, name=topic(run.run_id): len(dask_scheduler._broker._topics[name].subscribers))
            assert subscribers == 2  # this test's client (the run's owner) and the dashboard's
            for other in others + [page]:
                other.context.close()
    finally:
        run.stop()
        run.wait(120)


VIEWERS = Path(__file__).resolve().parents[2] / "benchmarks" / "dashboard_cost.py"


def test_websocket_sessions_that_draw_nothing_receive_the_live_run(client, run_dir, tmp_path):
    # Viewers on their own machines, as the dashboard's server sees them: Bokeh client sessions that get
    # every update of their page over the websocket and apply it to their own document (the benchmark's).
    run = workbench.train(long_job(), "allreduce", client=client, run_dir=run_dir)
    out = tmp_path / "viewers.json"
    viewers = None
    try:
        run.wait_for_step(5)
        with served(client, run_dir) as url:
            # The command yields the CPU to training (`--nice`, default 10), every thread of it.
            assert thread_niceness(url.process.pid) == {min(19, os.nice(0) + 10)}
            viewers = subprocess.Popen([sys.executable, str(VIEWERS), "--viewer-process", url, "3", str(out), "normal"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert viewers.stdout.readline().strip() == "ready"
            # Steps made 3 s after the sessions opened: some 3 redraws at the default 1000 ms (a session draws
            # only what changed, so a count of steps, 100 of which take about a second, gave one session 3
            # updates).
            ready_at = time.time()
            run._wait_for(lambda: max(r["time"] for r in run.table.last_steps().values()) >= ready_at + 3, 60,
                          "steps 3 s after the sessions opened")
            # The sessions end once each one's own copy of the page shows a step this recent (60 s at most).
            newest_step_time = max(r["time"] for r in run.table.last_steps().values())
            viewers.stdin.write(f"{newest_step_time}\n")
            viewers.stdin.flush()
            assert viewers.wait(timeout=90) == 0
        report = json.loads(out.read_text())
        assert report["connected"] == [True, True, True]
        assert min(report["received"]) >= 4  # updates kept coming while the run trained
        # A redraw's changes (the plots' sources, the clock, the status line) arrive as one message.
        assert sum(report["received"]) >= 2 * sum(report["messages"]), report
        # Each session's page shows the run's newest steps, as a browser would.
        assert all(newest >= newest_step_time for newest in report["newest"]), (report, newest_step_time)
    finally:
        if viewers is not None:
            end_processes([viewers])
        run.stop()
        run.wait(120)


def login_failed_or_blocked(url):
    """What an anonymous client gets: the status of `/` without following redirects, and the final body."""
    class NoRedirect(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args, **kwargs):
            return None

    try:
        status = urllib.request.build_opener(NoRedirect).open(url, timeout=10).status
    except urllib.error.HTTPError as error:
        status = error.code
    body = urllib.request.urlopen(url, timeout=10).read().decode()
    return status, body


def test_sign_in_lets_viewers_watch_and_only_owners_and_admins_act(client, run_dir, browser, tmp_path):
    credentials = tmp_path / "credentials.json"
    credentials.write_text(json.dumps({"admin": "admin-pass", "victor": "viewer-pass", "olivia": "owner-pass"}))
    run = workbench.train(long_job(), "average", client=client, run_dir=run_dir, owner="olivia", period=4)
    try:
        run.wait_for_step(10)
        with served(client, run_dir, "--basic-auth", str(credentials), "--admins", "admin",
                    "--cookie-secret", "test-secret") as url:
            status, body = login_failed_or_blocked(url)
            assert status in (302, 303, 401, 403)
            assert run.run_id not in body and "Bokeh.documents" not in body and "password" in body.lower()

            page = open_dashboard(browser, url, run.run_id, "victor", "viewer-pass")
            expect(page.get_by_text("your role: viewer")).to_be_visible()
            stop = page.locator("button", has_text="Stop")
            expect(stop).to_be_disabled()
            stop.click(force=True)  # a disabled button: the browser sends nothing
            # A crafted request: the page's own model made clickable again, then clicked. The server refuses.
            page.evaluate("""() => { const doc = Bokeh.documents[0];
                for (const model of doc.all_models) { if (model.label === 'Stop') model.disabled = false; } }""")
            expect(stop).to_be_enabled()
            stop.click()
            expect(page.get_by_text("refused: stop needs")).to_be_visible(timeout=15_000)
            step = run.table.last_steps()[0]["step"]
            run.wait_for_step(step + 20)  # the run goes on
            assert run.status == "running" and run.events("control-request") == []
            page.context.close()

            page = open_dashboard(browser, url, run.run_id, "admin", "admin-pass")
            expect(page.get_by_text("your role: admin")).to_be_visible()
            page.locator("button", has_text="Stop").click()
            assert run.wait(60) == "stopped"
            (request,) = run.events("control-request")
            assert (request["action"], request["by"], request["ok"]) == ("stop", "admin", True)
            open_tab(page, "Run details")
            expect(page.locator(".requests-table table")).to_contain_text("admin", timeout=15_000)
            page.context.close()
    finally:
        run.stop()
        run.wait(120)


def test_restarted_dashboard_shows_the_finished_runs_full_history(client, run_dir, browser):
    run = workbench.train(long_job(epochs=2, eval_every=50), "allreduce", client=client, run_dir=run_dir)
    run.wait(120)
    steps_on_disk = sum(1 for record in read_metrics(run.directory.path) if record.get("kind") == "step")
    assert steps_on_disk == 2 * run.total_steps
    for _ in range(2):  # the second time, a new process with nothing but the run directory and the cluster
        with served(client, run_dir) as url:
            page = open_dashboard(browser, url, run.run_id)
            page.wait_for_function("() => (Bokeh.documents[0].get_model_by_name('clock').data.steps[0] || 0)"
                                   f" === {steps_on_disk}", timeout=30_000)
            assert count(page, "loss", "step") == run.total_steps  # every step, fewer than 400
            open_tab(page, "Run details")
            page.wait_for_function(f"() => ({COUNT.format(name='evaluations', column='step')}) ()"
                                   f" === {len(run.evaluations)}", timeout=15_000)
            open_tab(page, "Runs")
            expect(page.locator(".runs-table table")).to_contain_text("finished")
            page.context.close()


def test_another_client_controls_a_run_through_requests_and_bad_ones_are_answered(client, run_dir):
    from distributed import Client

    from workbench.cluster.announcements import send_control_request

    run = workbench.train(long_job(), "average", client=client, run_dir=run_dir, owner="olivia", period=4)
    other = Client(client.scheduler.address, timeout=30)
    try:
        run.wait_for_step(10)
        since = time.time()
        send_control_request(other, run.run_id, "set_lr", "admin", lr=0.01)
        (changed, _) = run.wait_for_event("changed", since, timeout=60)
        assert changed["lr"] == 0.01
        send_control_request(other, run.run_id, "set_lr", "admin", lr=-1.0)
        send_control_request(other, run.run_id, "stop", "admin")
        assert run.wait(60) == "stopped"
        answers = run.events("control-request")
        assert [(a["action"], a["by"], a["ok"]) for a in answers] == [
            ("set_lr", "admin", True), ("set_lr", "admin", False), ("stop", "admin", True)]
        assert "lr=-1.0" in answers[1]["error"]
        # The answers are in the run directory too.
        on_disk = [r for r in read_metrics(run.directory.path) if r.get("kind") == "control-request"]
        assert [r["ok"] for r in on_disk] == [True, False, True]
    finally:
        other.close()
        run.stop()
        run.wait(120)


def test_panel_serve_entry_point_serves_the_same_app(client, run_dir, browser):
    run = workbench.train(long_job(epochs=1), "average", client=client, run_dir=run_dir, period=2)
    run.wait(120)
    app = subprocess.run([sys.executable, "-m", "widgets.dashboard", "--app-path"], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    port = free_port()
    command = [sys.executable, "-m", "panel", "serve", app, "--port", str(port), "--address", "127.0.0.1",
               "--allow-websocket-origin", f"127.0.0.1:{port}", "--args", "--scheduler", client.scheduler.address,
               "--runs-dir", str(run_dir)]
    with serving(command, port, path="panel_app") as url:
        page = open_dashboard(browser, url, run.run_id)
        page.wait_for_function("() => (Bokeh.documents[0].get_model_by_name('clock').data.steps[0] || 0)"
                               f" === {2 * run.total_steps}", timeout=30_000)
        expect(page.get_by_text("view only")).to_be_visible()  # no sign-in and no --open-control
        page.context.close()


def test_dashboard_served_from_the_notebook_leaves_the_notebooks_runs_their_metrics(client, run_dir):
    from widgets.dashboard import serve_dashboard

    run = workbench.train(long_job(), "average", client=client, run_dir=run_dir, period=4)
    server = serve_dashboard(client, runs_dir=run_dir)
    try:
        assert urllib.request.urlopen(server.url, timeout=30).status == 200
        run.wait_for_step(10)
        feed = server.hub.feed(run.run_id)
        assert feed is not None and feed.live
        step = run.table.last_steps()[0]["step"]
        run.wait_for_step(step + 50)  # the run's own client still gets every record
    finally:
        server.stop()
        run.stop()
        run.wait(120)


def test_a_256_worker_run_shows_its_spread_and_its_slowest_workers_not_256_lines(client, run_dir, browser):
    # 256 workers emulated as the scale benchmark does (a connection each to the test cluster's scheduler,
    # step batches 4 times a second); worker 17 at a quarter of the others' samples/s.
    from workbench.plane import kinds
    from workbench.run.feed import announce

    scale = load_benchmark("scale")
    run_id, workers, seconds = "emulated-256", 256, 25.0
    announce(client, {"kind": kinds.RUN_REGISTERED, "run_id": run_id, "status": "running", "strategy": "allreduce",
                      "world_size": workers, "owner": "olivia", "started": time.time()})
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + 5.0
    emulators = [context.Process(target=scale.emulate, args=(client.scheduler.address, topic(run_id), ranks, 2,
                                                           start_at, seconds, results, frozenset({17})))
                 for ranks in (list(range(workers))[0::2], list(range(workers))[1::2])]
    try:
        for emulator in emulators:
            emulator.start()
        with served(client, run_dir) as url:
            page = open_dashboard(browser, url, run_id)
            open_tab(page, "Run")
            slowest = page.locator(".slowest-workers")
            expect(slowest).to_contain_text("slowest: worker 17 (", timeout=30_000)
            page.wait_for_function("() => Bokeh.documents[0].get_model_by_name('throughput-spread')"
                                   ".data['median'].length > 2", timeout=30_000)
            assert count(page, "throughput-workers", "xs") == 0  # no line per worker
            # The band holds the workers' rates: a positive median, the 10th percentile not above it.
            spread = page.evaluate("() => { const d = Bokeh.documents[0].get_model_by_name('throughput-spread').data;"
                                   " return [Array.from(d.p10), Array.from(d.median)] }")
            assert spread[1][-1] > 0 and spread[0][-1] <= spread[1][-1]
            table = page.locator(".worker-table table tbody tr")
            expect(table).to_have_count(25)
            assert table.first.locator("td").first.inner_text() == "17"
            expect(page.locator(".worker-table")).to_contain_text("the 25 slowest of 256 workers")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard-256-workers.png"), full_page=True)
            page.context.close()
    finally:
        # Their records were seen: the emulators are not waited for to the end of their `seconds`.
        for emulator in emulators:
            emulator.terminate()
            emulator.join(timeout=30)
            if emulator.is_alive():
                emulator.kill()
                emulator.join(timeout=30)
        # Ended, so that no later dashboard on this cluster follows it as its newest run.
        announce(client, {"kind": kinds.RUN_STATUS, "run_id": run_id, "status": "stopped"})


def test_a_history_of_200_finished_runs_is_listed_opened_and_compared(client, browser, tmp_path):
    # A team's runs directory after months: 200 finished runs (generated as the workbench writes them,
    # by the runs-history benchmark, which times the same steps).
    history = load_benchmark("runs_history")
    ids = history.make_runs(tmp_path, 200, steps_range=(40, 120))
    with served(client, tmp_path) as url:
        # The cluster's own runs (earlier tests') are newer than the generated ones and listed too.
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.goto(url)
        page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0", timeout=30_000)
        open_tab(page, "Runs")
        rows = page.locator(".runs-table table tbody tr")
        expect(rows.nth(199)).to_be_attached(timeout=30_000)
        listed = [cell.strip() for cell in rows.locator("td:first-child").all_inner_texts()]
        generated = set(ids)
        assert [run_id for run_id in listed if run_id in generated] == ids[::-1]  # every one, newest first
        # The oldest run, picked: its loss curve (one point per step, the mean over workers).
        open_tab(page, "Run")
        page.get_by_role("combobox", name="Run", exact=True).select_option(ids[0])
        steps = sum(1 for line in (tmp_path / ids[0] / "metrics.jsonl").read_text().splitlines()
                    if '"worker": 0, "step"' in line)
        try:
            page.wait_for_function(f"() => ({COUNT.format(name='loss', column='step')})() === {steps}", timeout=30_000)
        except PlaywrightTimeoutError:
            picked = page.get_by_role("combobox", name="Run", exact=True).input_value()
            raise AssertionError(f"{count(page, 'loss', 'step')} loss points, {steps} wanted; {picked} picked, "
                                 f"{ids[0]} chosen") from None
        # Three runs compared: a line each on one time axis, a row each in the table.
        open_tab(page, "Compare")
        history.compare_runs(page, ids[:3], timeout_ms=30_000)
        expect(page.locator(".compare-table table tbody tr")).to_have_count(3)
        # The runs chosen, in the order chosen (typed into the search box, not the list's first three).
        assert page.locator(".compare-table table tbody tr td:first-child").all_inner_texts() == ids[:3]
        page.context.close()
