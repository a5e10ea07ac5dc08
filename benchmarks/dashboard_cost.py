"""What watching costs: training throughput with no dashboard, and with the team dashboard served and
10 headless browser sessions open, in one run; plus the worker-to-browser latency of a metric.

Same job both ways (MLP 784-1024-1024-10 on synthetic data, batch 128 per worker, a fixed number of
steps), on one Dask cluster; the two conditions alternate over the repetitions and medians are reported.
The dashboard runs as `workbench dashboard` in its own process; the viewers are pages of Debian's
chromium driven by Playwright, each following the newest run. Latency: every page notes, each time the
newest step time it shows changes, how old that step is (worker clock to browser clock, same machine).
The last line printed is one JSON object with the ratio and the latencies.

With `--kind websocket` the viewers are Bokeh client sessions instead (`bokeh.client.pull_session`, in
a process of their own): each receives every update of its page over the websocket and applies it to
its own copy of the document, but draws nothing, as a viewer on their own machine costs the server. For
each number of sessions in `--viewers` (e.g. 0,1,10,50) it reports the training throughput against no
sessions, the dashboard process's CPU (cores, and cores per session above none) and the updates each
session received. The viewers' process runs under SCHED_IDLE by default (`--viewer-priority idle`): it
gets only the CPU that training and the dashboard leave, as viewers on machines of their own take none of
the training box's; its CPU is measured and reported apart (`viewer_cores`). After each cell with viewers
the benchmark waits until the server has destroyed their sessions (Bokeh's unused-session check, some 35
s), so that this cost does not land on the next cell; each cell also reports the websocket messages a
session received (`messages_median`) beside the document changes they carried. The dashboard runs at
the command's default niceness (`--nice`); a comma list (`--nice 0,10`) compares niceness in one run,
each cell setting every thread of the one dashboard process to its value.

    python benchmarks/dashboard_cost.py [--workers 2] [--viewers 10] [--repeats 3] [--steps 300]
    python benchmarks/dashboard_cost.py --kind websocket --viewers 0,1,10,50 [--repeats 3] [--steps 600] [--nice 0,10]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bokeh.server.tornado import DEFAULT_CHECK_UNUSED_MS, DEFAULT_UNUSED_LIFETIME_MS

import resultfile
import workbench
from widgets.dashboard.app import REFRESH_MS
from widgets.dashboard.serve import DEFAULT_NICE, first_page
from workbench.data import synthetic

CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")
# Runs in every page: note the age of each new newest-step time the dashboard delivers.
WATCH_LATENCY = """() => {
  window.latencies = [];
  let last = null;
  setInterval(() => {
    const clock = Bokeh.documents[0].get_model_by_name('clock');
    const newest = clock && clock.data.newest.length ? clock.data.newest[0] : null;
    if (newest && newest !== last) { last = newest; window.latencies.push(Date.now() / 1000 - newest); }
  }, 20);
}"""


def job(steps: int) -> workbench.Job:
    data = synthetic(n_samples=8192, n_features=784)
    return workbench.Job(model=workbench.mlp(784, 10, (1024, 1024)), data=data, batch_size=128, steps=steps,
                         lr=0.05, momentum=0.9)


def train_once(client, steps: int, strategy: str, run_dir: str) -> float:
    run = workbench.train(job(steps), strategy, client=client, run_dir=run_dir)
    run.wait()
    return run.summary()["samples_per_s"]


def start_dashboard(client, run_dir: str, port: int, refresh_ms: int = REFRESH_MS,
                    nice: int = DEFAULT_NICE) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "workbench", "dashboard", "--scheduler",
                                client.scheduler.address, "--port", str(port), "--runs-dir", run_dir,
                                "--refresh-ms", str(refresh_ms), "--nice", str(nice)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first_page(f"http://127.0.0.1:{port}/", process)
    except RuntimeError:
        process.kill()
        raise
    return process


def _cpu_seconds() -> dict[str, float]:
    """CPU time used so far by process kind on this machine (browsers, dashboard, Dask, other)."""
    import psutil

    totals: dict[str, float] = {}
    for process in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        try:
            command = " ".join(process.info["cmdline"] or [])
            times = process.info["cpu_times"]
        except (psutil.Error, TypeError):
            continue
        if times is None:
            continue
        kind = ("browser" if "chrom" in (process.info["name"] or "") else "dashboard" if "dashboard" in command
                else "dask" if "python" in command else "other")
        totals[kind] = totals.get(kind, 0.0) + times.user + times.system
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--kind", choices=("browser", "websocket"), default="browser",
                        help="viewers as headless browser pages, or as Bokeh websocket sessions that do not draw")
    parser.add_argument("--viewers", default="10", help="how many viewers (websocket: a comma list, 0 first)")
    parser.add_argument("--viewer-process", nargs=4, metavar=("URL", "COUNT", "OUT", "PRIORITY"), help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--strategy", default="allreduce")
    parser.add_argument("--refresh-ms", type=int, default=REFRESH_MS, help="how often dashboard sessions redraw")
    parser.add_argument("--nice", default=str(DEFAULT_NICE),
                        help="websocket: the dashboard process's niceness, or a comma list to compare in one run "
                             f"(e.g. 0,{DEFAULT_NICE}; the command's default is {DEFAULT_NICE})")
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/"
                                                  "dashboard-cost.json, or dashboard-cost-websocket.json)")
    parser.add_argument("--viewer-priority", choices=("idle", "normal"), default="idle",
                        help="websocket: the viewers' process runs only on CPU nothing else wants (idle: as on "
                             "machines of their own) or as any process (normal: they compete with training)")
    arguments = parser.parse_args()
    if arguments.viewer_process:
        url, count, out, priority = arguments.viewer_process
        if priority == "idle":
            # SCHED_IDLE: the viewers' machine stands apart from the training box; this process gets only
            # the CPU that training and the dashboard leave (its own use is measured and reported apart).
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return run_viewer_sessions(url, int(count), Path(out))
    if arguments.kind == "websocket":
        return websocket_main(arguments)
    arguments.viewers = int(arguments.viewers)

    from playwright.sync_api import sync_playwright

    from workbench.comm.collectives import find_free_port as free_port

    client = workbench.connect(workers=arguments.workers, dashboard_address=":0")
    run_dir = tempfile.mkdtemp(prefix="dashboard-cost-")
    port = free_port()
    dashboard = start_dashboard(client, run_dir, port, arguments.refresh_ms)
    watched: list[float] = []
    alone: list[float] = []
    latencies: list[float] = []
    cpu_watched: dict[str, float] = {}  # CPU seconds by process kind during the watched runs
    try:
        train_once(client, 30, arguments.strategy, run_dir)  # warm up the workers and the dashboard
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                                 args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
            pages = []
            for repeat in range(arguments.repeats):
                # Alternate the order, so that drift on a shared machine does not favour one condition.
                for condition in (("alone", "watched") if repeat % 2 == 0 else ("watched", "alone")):
                    if condition == "watched":  # with --viewers 0: the dashboard serves and follows, nobody looks
                        pages = [browser.new_page() for _ in range(arguments.viewers)]
                        for page in pages:
                            page.goto(f"http://127.0.0.1:{port}/")
                            page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0",
                                                   timeout=60_000)
                            page.evaluate(WATCH_LATENCY)
                        cpu_before = _cpu_seconds()
                        watched.append(train_once(client, arguments.steps, arguments.strategy, run_dir))
                        cpu_spent = {k: v - cpu_before.get(k, 0.0) for k, v in _cpu_seconds().items()}
                        for kind, seconds in cpu_spent.items():
                            cpu_watched[kind] = cpu_watched.get(kind, 0.0) + seconds
                        for page in pages:
                            latencies.extend(page.evaluate("() => window.latencies"))
                            page.close()
                    else:
                        alone.append(train_once(client, arguments.steps, arguments.strategy, run_dir))
                    print(f"repeat {repeat + 1} {condition:8s} {(watched if condition == 'watched' else alone)[-1]:9.0f}"
                          " samples/s", flush=True)
            browser.close()
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=30)
        workbench.shutdown(client)

    latencies.sort()
    result = resultfile.document("dashboard-cost", {
        "strategy": arguments.strategy, "workers": arguments.workers, "viewers": arguments.viewers,
        "steps": arguments.steps, "repeats": arguments.repeats, "refresh_ms": arguments.refresh_ms,
        "model": "MLP 784-1024-1024-10, synthetic data, batch 128 per worker",
        "viewer": "a page of Debian's chromium, headless, driven by Playwright"})
    result.update({
        "samples_per_s_alone": statistics.median(alone), "samples_per_s_watched": statistics.median(watched),
        "watched_vs_alone": statistics.median(watched) / statistics.median(alone),
        "latency_median_s": statistics.median(latencies) if latencies else None,
        "latency_p95_s": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "latency_samples": len(latencies),
        "cpu_seconds_while_watched": {kind: round(seconds, 1) for kind, seconds in cpu_watched.items()},
        "watched_seconds": sum(arguments.steps * 128 * arguments.workers / rate for rate in watched),
    })
    print(f"throughput with {arguments.viewers} viewers vs none: {result['watched_vs_alone']:.3f}x (target >= 0.97)")
    if latencies:
        print(f"worker-to-browser latency: median {result['latency_median_s']:.3f} s, "
              f"p95 {result['latency_p95_s']:.3f} s (target: median < 1 s)")
    resultfile.write(arguments.out or resultfile.path_for("dashboard-cost"), result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "settings")}))


# --- viewers on their own machines: websocket sessions that receive every update and draw nothing -------


def run_viewer_sessions(url: str, count: int, out: Path) -> None:
    """In a process of its own: open `count` Bokeh client sessions of the dashboard and keep them until
    SIGTERM, or until a line on stdin gives a step time (s) that every session's page shows (at most
    60 s more); then write how many document changes each received and the newest step time each shows.
    Prints 'ready' once all are open."""
    import signal as signals
    import threading

    import panel  # noqa: F401  (the dashboard's document holds Panel's models: the client must know them)
    from bokeh.client import pull_session
    from bokeh.document.events import MessageSentEvent
    from bokeh.events import DocumentReady
    from tornado.ioloop import IOLoop, PeriodicCallback

    def newest(session: Any) -> float | None:  # the newest step time the session's page shows
        clock = session.document.get_model_by_name("clock")
        return clock.data["newest"][0] if clock is not None and len(clock.data.get("newest", [])) else None

    loop = IOLoop.current()
    received = [0] * count  # document changes applied, per session
    messages = [0] * count  # websocket messages they came in (a redraw's changes go as one)
    sessions = []
    for index in range(count):
        session = pull_session(url=url, io_loop=loop)
        session.document.on_change(lambda event, index=index: received.__setitem__(index, received[index] + 1))
        # What a browser says once it has drawn the page: Panel starts a session's periodic callbacks
        # (the dashboard's redraw) only then.
        session.document.callbacks.trigger_on_change(
            MessageSentEvent(session.document, "bokeh_event", DocumentReady()))
        sessions.append(session)

    async def keep_reading(connection: Any, index: int) -> None:
        # A Python client session reads its websocket only inside its blocking calls; this keeps every
        # session's connection reading and applying patches on the one loop. Its own reader (`_next`)
        # recurses once per message and hit Python's recursion limit after some hundreds of messages.
        while (message := await connection._pop_message()) is not None:
            if message.msgtype == "PATCH-DOC":
                connection._session._handle_patch(message)
                messages[index] += 1

    for index, session in enumerate(sessions):
        loop.spawn_callback(keep_reading, session._connection, index)
    signals.signal(signals.SIGTERM, lambda *_: loop.add_callback_from_signal(loop.stop))

    def wait_for(line: str) -> None:  # on the loop: stop once every page shows the step time asked for
        target, deadline = float(line), time.monotonic() + 60

        def check() -> None:
            if all((newest(s) or 0.0) >= target for s in sessions) or time.monotonic() > deadline:
                loop.stop()
        PeriodicCallback(check, 50).start()

    def read_stdin() -> None:
        line = sys.stdin.readline()
        if line.strip():
            loop.add_callback(wait_for, line)
    threading.Thread(target=read_stdin, daemon=True).start()
    print("ready", flush=True)
    loop.start()
    out.write_text(json.dumps({"received": received, "messages": messages, "connected": [s.connected for s in sessions],
                               "newest": [newest(s) for s in sessions]}))


# Bokeh's unused-session lifetime and check period, and a margin.
SESSION_CLEANUP_S = (DEFAULT_UNUSED_LIFETIME_MS + DEFAULT_CHECK_UNUSED_MS) / 1000 + 3


def settle(process: Any, idle_cores: float = 0.05, longest_s: float = 60.0) -> None:
    """Wait out the server's unused-session check, then until `process` uses under `idle_cores` over a
    second (at most `longest_s` in all)."""
    deadline = time.monotonic() + longest_s
    time.sleep(SESSION_CLEANUP_S)
    while time.monotonic() < deadline and process.cpu_percent(interval=1.0) / 100 >= idle_cores:
        pass


def renice(pid: int, niceness: int) -> None:
    """Set every thread of a process to `niceness` (on Linux each thread has its own; root may lower it)."""
    for thread in (Path("/proc") / str(pid) / "task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(thread.name), niceness)
        except ProcessLookupError:
            pass  # ended meanwhile


def websocket_main(arguments: argparse.Namespace) -> None:
    import psutil

    from workbench.comm.collectives import find_free_port as free_port

    counts = [int(n) for n in arguments.viewers.split(",")]
    if counts[0] != 0:
        counts.insert(0, 0)
    nices = [int(n) for n in arguments.nice.split(",")]
    # Each cell: a number of sessions at a niceness of the dashboard, all compared in one run.
    conditions = [(nice, count) for nice in nices for count in counts]
    client = workbench.connect(workers=arguments.workers, dashboard_address=":0")
    run_dir = tempfile.mkdtemp(prefix="dashboard-cost-")
    port = free_port()
    dashboard = start_dashboard(client, run_dir, port, arguments.refresh_ms, nices[0])
    dashboard_process = psutil.Process(dashboard.pid)
    cells: dict[tuple[int, int], list[dict[str, float]]] = {c: [] for c in conditions}
    try:
        train_once(client, 30, arguments.strategy, run_dir)  # warm up the workers and the dashboard
        for repeat in range(arguments.repeats):
            for nice, count in (conditions if repeat % 2 == 0 else list(reversed(conditions))):
                renice(dashboard.pid, nice)
                viewers, out = None, Path(run_dir) / f"viewers-{repeat}-{nice}-{count}.json"
                if count:
                    viewers = subprocess.Popen([sys.executable, __file__, "--viewer-process",
                                                f"http://127.0.0.1:{port}/", str(count), str(out),
                                                arguments.viewer_priority],
                                               stdout=subprocess.PIPE, text=True)
                    if viewers.stdout.readline().strip() != "ready":
                        raise RuntimeError(f"the {count} viewer sessions did not open")
                watched = [dashboard_process] + ([psutil.Process(viewers.pid)] if viewers is not None else [])
                before, started = [p.cpu_times() for p in watched], time.monotonic()
                rate = train_once(client, arguments.steps, arguments.strategy, run_dir)
                after, elapsed = [p.cpu_times() for p in watched], time.monotonic() - started
                used = [(a.user + a.system - b.user - b.system) / elapsed for a, b in zip(after, before)]
                cores = used[0]
                cell = {"samples_per_s": rate, "dashboard_cores": cores, "viewer_cores": used[1] if viewers else 0.0,
                        "seconds": elapsed}
                if viewers is not None:
                    viewers.terminate()
                    viewers.wait(timeout=60)
                    # The server destroys a gone session's document only at its unused-session check
                    # (`SESSION_CLEANUP_S`): that cost (measured: 0.1 core through the
                    # next cell after 50 sessions) is this cell's, not the next one's; left out of both.
                    settle(dashboard_process)
                    report = json.loads(out.read_text())
                    cell.update(updates_min=min(report["received"]), updates_median=statistics.median(report["received"]),
                                messages_median=statistics.median(report["messages"]), all_connected=all(report["connected"]))
                cells[nice, count].append(cell)
                print(f"repeat {repeat + 1} {count:3d} sessions, dashboard at nice {nice:2d}: {rate:9.0f} samples/s, "
                      f"dashboard {cores:.3f} cores, "
                      f"viewers {cell['viewer_cores']:.3f} cores"
                      + (f", updates per session >= {cell['updates_min']}" if count else ""), flush=True)
    finally:
        dashboard.terminate()
        dashboard.wait(timeout=30)
        workbench.shutdown(client)

    def table_at(nice: int) -> dict[int, dict[str, Any]]:
        median = lambda n, key: statistics.median(c[key] for c in cells[nice, n])  # noqa: E731
        none_rate, none_cores = median(0, "samples_per_s"), median(0, "dashboard_cores")
        return {n: {"samples_per_s": median(n, "samples_per_s"), "vs_none": median(n, "samples_per_s") / none_rate,
                    "dashboard_cores": median(n, "dashboard_cores"), "viewer_cores": median(n, "viewer_cores"),
                    "dashboard_cores_per_session": (median(n, "dashboard_cores") - none_cores) / n if n else None,
                    "updates_per_session_min": min(c["updates_min"] for c in cells[nice, n]) if n else None}
                for n in counts}

    tables = {nice: table_at(nice) for nice in nices}
    table = tables[nices[-1]]  # the last niceness named (the command's default where it is the only one)
    result = resultfile.document("dashboard-cost-websocket", {
        "strategy": arguments.strategy, "workers": arguments.workers, "steps": arguments.steps, "sessions": counts,
        "repeats": arguments.repeats, "refresh_ms": arguments.refresh_ms, "viewer_priority": arguments.viewer_priority,
        "dashboard_nice": nices, "model": "MLP 784-1024-1024-10, synthetic data, batch 128 per worker",
        "viewer": "Bokeh client sessions (bokeh.client.pull_session) that draw nothing"})
    result.update({
        "table": table, "tables_by_nice": tables,
        "cells": {f"nice {nice}, {count} sessions": runs for (nice, count), runs in cells.items()},
        **({"vs_none_10": table[10]["vs_none"], "cores_per_session_10": table[10]["dashboard_cores_per_session"]}
           if 10 in table else {}),
    })
    print(f"{'nice':>4} {'sessions':>8} {'samples/s':>10} {'vs none':>8} {'dashboard cores':>16} {'per session':>12} "
          f"{'viewer cores':>13}")
    for nice, rows in tables.items():
        for n, row in rows.items():
            per = f"{row['dashboard_cores_per_session']:.4f}" if n else "-"
            print(f"{nice:>4} {n:>8} {row['samples_per_s']:>10,.0f} {row['vs_none']:>8.3f} {row['dashboard_cores']:>16.3f}"
                  f" {per:>12} {row['viewer_cores']:>13.3f}")
    resultfile.write(arguments.out or resultfile.path_for("dashboard-cost-websocket"), result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "settings", "cells")}))


if __name__ == "__main__":
    main()
