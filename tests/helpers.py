"""Helpers shared by the tests."""
import contextlib
import importlib
import json
import multiprocessing
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def cli_in_process(argv, capsys):
    """`workbench ARGV` run by its `main` in this process: (exit code, stderr lines). What a bad argument
    gets is the same code path as from the installed command, without a new interpreter importing torch
    (2.5-3.5 s each on 2 cores); tests/cluster/test_existing_cluster_and_cli.py runs the command itself too."""
    from workbench.cli.main import main

    niceness = os.nice(0)
    try:
        code = main(list(argv))
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    # Refused input changes nothing of the process (`workbench dashboard` renices itself once it serves).
    assert os.nice(0) == niceness, f"workbench {' '.join(argv)} changed the process's niceness"
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


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
        # Workers first, then the scheduler, as LocalCluster closes: a worker that has run a task holds a
        # worker client (get_client), which, with the scheduler gone first, keeps the worker process alive
        # until its nanny kills it 8 s later (measured: 8.2 s against 0.8 s for the whole cluster).
        end_processes(processes[1:])
        end_processes(processes[:1])


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


def digits_job(strategy=None, **fields):
    """A `workbench.Job` of `mlp(64, 10)` on the `digits` dataset: the suggested SGD (lr, momentum) of
    `strategy` where one is named, then `fields`, any of the Job's. A module's own defaults are a partial
    of it, `functools.partial(digits_job, lr=0.05, ...)`, whose keywords a call still overrides."""
    import workbench
    from workbench.strategies import suggested_sgd

    sgd = suggested_sgd(strategy) if strategy is not None else {}
    return workbench.Job(**{"model": workbench.mlp(64, 10), "data": "digits", **sgd, **fields})


TEXT_SLICE = 2_000_000  # bytes of the standard library's source that `text_job` trains on


def text_job(**fields):
    """The real workload at test size: a `workbench.Job` of `gpt-test` on a `TEXT_SLICE` slice of the standard
    library's source, AdamW with a cosine schedule; `fields` set or override any of the Job's."""
    import workbench

    defaults = dict(model=workbench.gpt("gpt-test"),
                    data=workbench.stdlib_text(context=64, eval_windows=64, limit_bytes=TEXT_SLICE),
                    optimizer="adamw", lr=3e-3, batch_size=32, steps=120, lr_schedule="cosine", warmup_steps=12,
                    eval_every=60)
    return workbench.Job(**{**defaults, **fields})


def certificate_files(directory: Path) -> dict[str, str]:
    """A throwaway CA certificate, certificate and key as PEM files (one self-signed pair for every role)."""
    from distributed import Security

    security = Security.temporary()
    files = {"ca": security.tls_ca_file, "cert": security.tls_client_cert, "key": security.tls_client_key}
    paths = {}
    for name, text in files.items():
        path = directory / f"{name}.pem"
        path.write_text(text)
        paths[name] = str(path)
    return paths


def notebook_expectations():
    """The example notebooks (paths, sorted) and what each must have printed or shown, beyond running
    without an error: tests/cluster/test_notebooks_cluster.py executes them, tests/unit/test_notebooks.py
    checks that every one is covered here and stored executed."""
    from testbed import lab as labs

    notebooks = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
    expected = {
        "01-quickstart": ["held-out accuracy", "application/vnd.jupyter.widget-view+json"],
        "02-compare-strategies": ["Fastest:", "staleness mean", "application/vnd.jupyter.widget-view+json"],
        "03-live-control": ["paused at steps", "average -> async", "back to async at step"],
        "04-existing-cluster": ["held-out accuracy", "tcp://127.0.0.1"],
        "05-bring-your-own-model": ["on shifted images", "parameters"],
        "06-team-dashboard": ["Dashboard at", "samples/s", "application/vnd.holoviews_exec.v0+json"],
        # Emulated hosts need root and iproute2: without them the notebook says why and skips its lab cells.
        "07-slow-network": (["keeps", "of its 1gbit throughput at 100mbit", "application/vnd.jupyter.widget-view+json"]
                            if labs.available() is None else ["No emulated hosts here"]),
        "08-capacity-planning": ["calibration", "measured lab points from", "max throughput error", "image/png"],
    }
    return notebooks, expected


def mark_tier(items, folder, marker):
    """Add `marker` to the items collected under `folder` (a tier's conftest.py calls this from its
    `pytest_collection_modifyitems`, which pytest calls with every item of the session, not only its folder's)."""
    folder = Path(folder).resolve()
    for item in items:
        if item.path.resolve().is_relative_to(folder):
            item.add_marker(marker)


def ctrl_c_at_default() -> None:
    """A child's `preexec_fn`: Ctrl-C reaches it as a terminal delivers it, whatever this process inherited
    (a suite run in a shell's background starts with SIGINT ignored, and a Python started so keeps it)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn_ranks(target, world_size, *arguments, timeout_s=120):
    """{rank: what `target(rank, *arguments, results)` put on the queue}, from `world_size` spawned processes,
    each joined (or killed) before returning."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(rank, *arguments, results), daemon=True)
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        found = dict(results.get(timeout=timeout_s) for _ in processes)
        for process in processes:
            process.join(timeout=30)
            assert process.exitcode == 0
    except queue.Empty:
        pytest.fail(f"the ranks did not report within {timeout_s} s")
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    return found


def sum_through_channel(vector, channel):
    """Sum `vector` in place through `collectives.start_all_reduce` on `channel` (in a rank process of a
    group); returns (the work's kind, its sum as gloo computes it from the vector as it was, whether the
    completion callback ran)."""
    import threading

    import torch

    from workbench.comm import collectives

    reference = vector.clone()
    done = threading.Event()
    work = collectives.start_all_reduce(vector, channel=channel)
    collectives.when_done(work, lambda _future: done.set())
    collectives.wait(work)
    torch.distributed.all_reduce(reference)  # gloo's own sum, in one call
    return work, reference, done.wait(timeout=30)
