"""A team's runs history in the dashboard: N finished runs in the runs directory, how long the served
dashboard takes to start, to show the runs list in a browser, to draw the oldest run and to compare five.

Issue 17, item 4. The runs are generated (`make_runs`): run directories as the workbench leaves them
(config.json, metrics.jsonl with every step record of every worker, held-out evaluations, the end record,
summary.json), of 2-4 workers and 300-2,000 steps each, strategies in turn. Then `workbench dashboard`
is started against a `dask scheduler` of its own with `--runs-dir` on them, and a headless Chromium
(Debian's, driven by Playwright) opens it:

- start: from launching the dashboard process to its first answer over HTTP (it reads the runs then);
- list: from asking for the page to the Runs tab holding a row per run;
- open: from picking the oldest run to its loss plot holding its points;
- compare: from choosing five runs in the Compare tab to both plots holding five lines.

    python benchmarks/runs_history.py [--runs 200] [--repeats 3] [--out FILE]

The last line printed is one JSON object with the medians (`list_s`, `open_s`, `compare_s`, `start_s`); the
result file (`resultfile.path_for("runs-history")`, or `--out`) holds them with every repeat.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import resultfile

CHROMIUM = os.environ.get("WORKBENCH_CHROMIUM", "/usr/bin/chromium")
STRATEGIES = ["allreduce", "average", "async", "ssp", "easgd"]
LINES = "() => {{ const s = Bokeh.documents[0].get_model_by_name('{name}'); return s ? s.data['{column}'].length : -1 }}"


def compare_runs(page: Any, run_ids: list[str], timeout_ms: float) -> None:
    """Chooses `run_ids` in the Compare tab as a user does, one after the other, each once the plots show
    the one before. The run is typed key by key: the MultiChoice (Choices.js) filters its list on key-up,
    so a value set at once (Playwright's `fill`) leaves the list unfiltered and Enter takes whichever run
    is highlighted at the top. A choice made while the server has not answered the one before can also
    be lost when the widget redraws."""
    chooser = page.locator(".choices input[type=search]").first  # the MultiChoice's search box
    for count, run_id in enumerate(run_ids, start=1):
        chooser.click()
        chooser.press_sequentially(run_id)
        page.locator(f'.choices__list--dropdown .is-highlighted[data-value="{run_id}"]').wait_for(timeout=timeout_ms)
        page.keyboard.press("Enter")
        page.wait_for_function(f"() => ({LINES.format(name='compare-loss', column='xs')})() === {count}",
                               timeout=timeout_ms)


def make_runs(directory: Path, runs: int, seed: int = 0, steps_range: tuple[int, int] = (300, 2000)) -> list[str]:
    """`runs` finished run directories under `directory`, oldest first, of `steps_range` steps each;
    returns their ids."""
    rng = random.Random(seed)
    ids = []
    began = time.time() - runs * 600.0
    for index in range(runs):
        strategy = STRATEGIES[index % len(STRATEGIES)]
        workers, steps = rng.choice([2, 2, 4]), rng.randrange(*steps_range)
        run_id = f"{strategy}-history-{index:04d}"
        path = directory / run_id
        path.mkdir(parents=True)
        started = began + index * 600.0
        (path / "config.json").write_text(json.dumps({
            "run_id": run_id, "owner": rng.choice(["olivia", "oscar", "victor"]), "strategy": strategy,
            "settings": {"period": 16} if strategy in ("average", "easgd") else {}, "world_size": workers,
            "started": started, "workers": [f"tcp://10.0.0.{w}:4000{w}" for w in range(workers)]}))
        lines = []
        for step in range(steps):
            for worker in range(workers):
                made = started + step * 0.05 + worker * 0.001
                record = {"kind": "step", "worker": worker, "step": step, "epoch": step // 100, "time": made,
                          "loss": 2.3 / (1 + step / 200) + rng.random() * 0.05, "samples": 32, "compute_s": 0.011,
                          "comm_s": 0.002, "wait_s": 0.0003, "lr": 0.1, "strategy": strategy, "bytes_sent": 1_114_112}
                if strategy in ("async", "ssp"):
                    record["staleness"] = rng.randrange(0, workers)
                lines.append(json.dumps(record))
            if step % 100 == 99:
                lines.append(json.dumps({"kind": "eval", "worker": 0, "step": step, "time": made + 0.01,
                                         "loss": 2.0 / (1 + step / 200), "accuracy": min(0.97, 0.5 + step / 4000)}))
        ended = started + steps * 0.05
        lines.append(json.dumps({"kind": "run-finished", "time": ended}))
        (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (path / "summary.json").write_text(json.dumps({
            "run_id": run_id, "status": "finished", "strategy": strategy, "total_steps": steps, "workers": workers,
            "steps_done": steps, "samples_per_s": 32 * workers / 0.05, "final_loss": 2.3 / (1 + steps / 200),
            "best_metric": ["accuracy", min(0.97, 0.5 + (steps // 100 * 100 - 1) / 4000)] if steps >= 100 else None}))
        ids.append(run_id)
    return ids


def start_dashboard(address: str, runs_dir: Path, port: int) -> tuple[subprocess.Popen, float]:
    """`workbench dashboard` on the runs; returns the process and the seconds to its first HTTP answer."""
    from widgets.dashboard.serve import first_page

    began = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "workbench", "dashboard", "--scheduler", address,
                                "--port", str(port), "--runs-dir", str(runs_dir)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        first_page(f"http://127.0.0.1:{port}/", process, timeout_s=300)
    except RuntimeError:
        process.kill()
        raise
    return process, time.monotonic() - began


def open_tab(page: Any, title: str) -> None:
    page.locator(".bk-tab", has_text=re.compile(rf"^\s*{re.escape(title)}\s*$")).first.click()  # "Run", not "Runs"


def records_of(runs_dir: Path, run_id: str) -> int:
    """How many step records a generated run holds."""
    return sum(1 for line in (runs_dir / run_id / "metrics.jsonl").read_text().splitlines()
               if line.startswith('{"kind": "step"'))


def measure_page(browser: Any, url: str, ids: list[str], runs_dir: Path) -> dict[str, float]:
    """One browser page: the runs list, the oldest run, a comparison of five; seconds each."""
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    try:
        began = time.monotonic()
        page.goto(url)
        open_tab(page, "Runs")
        page.locator(".runs-table table tbody tr").nth(len(ids) - 1).wait_for(timeout=120_000)
        list_s = time.monotonic() - began
        rows = page.locator(".runs-table table tbody tr").count()
        open_tab(page, "Run")
        began = time.monotonic()
        page.get_by_role("combobox", name="Run", exact=True).select_option(ids[0])
        # The Run tab's clock counts the shown run's step records: the newest run's, shown before, differ.
        page.wait_for_function("() => { const s = Bokeh.documents[0].get_model_by_name('clock');"
                               f" return s && s.data['steps'][0] === {records_of(runs_dir, ids[0])} }}", timeout=120_000)
        open_s = time.monotonic() - began
        open_tab(page, "Compare")
        began = time.monotonic()
        compare_runs(page, ids[-5:], timeout_ms=120_000)
        compare_s = time.monotonic() - began
        return {"list_s": round(list_s, 3), "rows": rows, "open_s": round(open_s, 3), "compare_s": round(compare_s, 3)}
    finally:
        page.context.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/runs-history.json)")
    arguments = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from workbench.comm.collectives import find_free_port

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scale import start_scheduler

    with tempfile.TemporaryDirectory() as scratch:
        runs_dir = Path(scratch) / "runs"
        made = time.monotonic()
        ids = make_runs(runs_dir, arguments.runs)
        size_mb = sum(f.stat().st_size for f in runs_dir.rglob("*") if f.is_file()) / 1e6
        print(f"{len(ids)} runs, {size_mb:.0f} MB, made in {time.monotonic() - made:.1f} s", flush=True)
        scheduler, address = start_scheduler(Path(scratch))
        repeats = []
        try:
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
                for repeat in range(arguments.repeats):
                    port = find_free_port()
                    dashboard, start_s = start_dashboard(address, runs_dir, port)
                    try:
                        result = {"start_s": round(start_s, 3), **measure_page(browser, f"http://127.0.0.1:{port}/", ids, runs_dir)}
                    finally:
                        dashboard.terminate()
                        dashboard.wait(timeout=30)
                    print(f"repeat {repeat + 1}: {result}", flush=True)
                    repeats.append(result)
                browser.close()
        finally:
            scheduler.terminate()
            scheduler.wait(timeout=30)
    medians = {key: statistics.median(r[key] for r in repeats) for key in ("start_s", "list_s", "open_s", "compare_s")}
    result = resultfile.document("runs-history", {"runs": arguments.runs, "repeats": arguments.repeats,
                                                  "browser": "Debian's chromium, headless, driven by Playwright"})
    result.update(size_mb=round(size_mb), rows_shown=repeats[-1]["rows"], **medians, repeats=repeats)
    resultfile.write(arguments.out or resultfile.path_for("runs-history"), result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("repeats", "machine", "settings")}))


if __name__ == "__main__":
    main()
