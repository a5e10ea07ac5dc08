"""What watching costs: training throughput with no dashboard, and with the team dashboard served and
10 headless browser sessions open, in one run; plus the worker-to-browser latency of a metric.

Same job both ways (MLP 784-1024-1024-10 on synthetic data, batch 128 per worker, a fixed number of
steps), on one Dask cluster; the two conditions alternate over the repetitions and medians are reported.
The dashboard runs as `workbench dashboard` in its own process; the viewers are pages of Debian's
chromium driven by Playwright, each following the newest run. Latency: every page notes, each time the
newest step time it shows changes, how old that step is (worker clock to browser clock, same machine).
The last line printed is one JSON object with the ratio and the latencies.

    python benchmarks/dashboard_cost.py [--workers 2] [--viewers 10] [--repeats 3] [--steps 300]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import workbench
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


def start_dashboard(client, run_dir: str, port: int, refresh_ms: int = 500) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, "-m", "workbench", "dashboard", "--scheduler",
                                client.scheduler.address, "--port", str(port), "--runs-dir", run_dir,
                                "--refresh-ms", str(refresh_ms)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
            return process
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError("the dashboard did not start")
            time.sleep(0.2)


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
    parser.add_argument("--viewers", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--strategy", default="allreduce")
    parser.add_argument("--refresh-ms", type=int, default=500, help="how often dashboard sessions redraw")
    arguments = parser.parse_args()

    from playwright.sync_api import sync_playwright

    from workbench.collectives import find_free_port as free_port

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
    result = {
        "benchmark": "dashboard_cost", "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "strategy": arguments.strategy, "workers": arguments.workers, "viewers": arguments.viewers,
        "steps": arguments.steps, "repeats": arguments.repeats, "refresh_ms": arguments.refresh_ms,
        "samples_per_s_alone": statistics.median(alone), "samples_per_s_watched": statistics.median(watched),
        "watched_vs_alone": statistics.median(watched) / statistics.median(alone),
        "latency_median_s": statistics.median(latencies) if latencies else None,
        "latency_p95_s": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "latency_samples": len(latencies),
        "cpu_seconds_while_watched": {kind: round(seconds, 1) for kind, seconds in cpu_watched.items()},
        "watched_seconds": sum(arguments.steps * 128 * arguments.workers / rate for rate in watched),
    }
    print(f"throughput with {arguments.viewers} viewers vs none: {result['watched_vs_alone']:.3f}x (target >= 0.97)")
    if latencies:
        print(f"worker-to-browser latency: median {result['latency_median_s']:.3f} s, "
              f"p95 {result['latency_p95_s']:.3f} s (target: median < 1 s)")
    out = Path(__file__).resolve().parent / "results" / f"cpu-2core-dashboard-cost-{arguments.viewers}-viewers-{arguments.refresh_ms}ms.json"
    if os.environ.get("WORKBENCH_SAVE_RESULTS") == "1":
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
