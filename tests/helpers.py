"""Helpers shared by the tests."""
import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

DASK = str(Path(sys.executable).with_name("dask"))


def wait_until(condition, timeout_s=30.0, interval_s=0.02):
    """Poll `condition` until true; fail the test if it is not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s} s")


def end_processes(processes, timeout_s=20):
    """Terminate `processes`, killing any that do not exit within `timeout_s`."""
    for process in reversed(processes):
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def dask_cluster_on_loopback(directory, workers=2, flags=()):
    """`dask scheduler` and `dask worker` processes on 127.0.0.1 (with extra `flags`, e.g. TLS files);
    yields the scheduler address; all ended on exit."""
    scheduler_file = Path(directory) / "scheduler.json"
    environment = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False"}
    processes = [subprocess.Popen(
        [DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--dashboard-address", ":0",
         "--scheduler-file", str(scheduler_file), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.exists() or not scheduler_file.read_text().strip():
            assert time.monotonic() < deadline, "dask scheduler did not start"
            assert processes[0].poll() is None, "dask scheduler exited"
            time.sleep(0.1)  # nothing to wait on but the file
        address = json.loads(scheduler_file.read_text())["address"]
        processes.append(subprocess.Popen(
            [DASK, "worker", address, "--nworkers", str(workers), "--nthreads", "1", "--host", "127.0.0.1",
             "--dashboard-address", ":0", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=environment))
        yield address
    finally:
        end_processes(processes)


CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")


@contextlib.contextmanager
def chromium():
    """Debian's headless chromium driven by Playwright (nothing downloaded); closed on exit."""
    import pytest
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (or set WORKBENCH_CHROMIUM)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield browser
        finally:
            browser.close()


def load_benchmark(name):
    """A script of `benchmarks/` as a module (they are scripts, not a package), e.g. the scale emulator.
    Imported by its own name from the benchmarks directory put on the path, so that processes it spawns
    (which import their target by module name) find it too."""
    folder = str(Path(__file__).resolve().parent.parent / "benchmarks")
    if folder not in sys.path:
        sys.path.append(folder)
    return importlib.import_module(name)
