"""The simulator (`planner/simulate.py`) against the lab: calibrated from one short real run, its
predictions for every strategy at 2, 3 and 4 emulated worker hosts, three link rates and a straggler,
beside what the lab measures.

Runs on the lab (`testbed/lab.py`: needs root, `ip` and `tc`): host 0 holds the scheduler and the
client, every other host one `dask worker`; all hosts share the machine's cores. The job is the network
benchmark's (MLP 784-1024-1024-10, synthetic data, batch 128 per worker, SGD lr 0.01). Each cell is a
time-boxed run measured as `benchmarks/network.py` does (`Cells.workbench`: warm-up under the condition,
then a window of at least `--window-s` seconds and `--min-cycles` exchange cycles of every worker;
throughput from the step records covering the window); mean staleness is taken over every worker's
pushes answered in one interval covering the window (`network.window_staleness`). The grid runs
`--repeats` times, interleaved (every other repetition backwards); points are medians.

The simulator is calibrated from ONE run measured the same way (by default `average` p4, 2 worker hosts,
unlimited link; `--calibrate-with`): its steps between syncs time the compute alone, its syncs the
all-reduce alone (`exchange_s`) and the sync's own copies. From `allreduce` the compute has to be told
apart from the copies that share backward's core, a modelled split (`simulate.calibrate`): on the
2026-11-25 grid it put one step's compute at 17.2 ms where the grid's `average` steps between syncs took
18.1-19.4, and the median prediction came out 7.5% high. Such a run is measured in every repetition and
the one of median throughput used. The simulator sees nothing of the grid's results (only how long each
cell's run had trained at the middle of its window: SSP's bound takes time to bind). The result,
`benchmarks/results/<machine class>/simulator.json` (or `--out`), keeps the calibration runs' step records
and every point, so the predictions can be made again without the lab (`--from FILE`, e.g. after a change
to the model; written back into FILE unless `--out`, and the document then says `predicted_again`).

    python benchmarks/simulator.py [--hosts 2,3,4] [--rates unlimited,1gbit,100mbit] [--no-straggler] [--only ssp]
                                   [--repeats 3] [--window-s 8] [--quick] [--calibrate-with 'average p4']
                                   [--from benchmarks/results/cpu-2core/simulator.json] [--out FILE]
"""
from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))  # the network benchmark's measuring code, beside this file

import network  # noqa: E402
import resultfile  # noqa: E402

STRAGGLER = "straggler"  # the condition's name: the last worker host at STRAGGLER_SHARE of a core
STRAGGLER_SHARE = 0.5
RATES = ("unlimited", "1gbit", "100mbit")
# One configuration per strategy, the network benchmark's plain forms.
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("allreduce", "allreduce", {}),
    ("average p16", "average", {"period": 16}),
    ("async p4", "async", {"push_every": 4}),
    ("ssp p4", "ssp", {"push_every": 4}),
    ("easgd p16", "easgd", {"period": 16}),
]
# Short runs measured before the grid, on 2 worker hosts at the unlimited link; the simulator is
# calibrated from one of them (the first unless --calibrate-with).
CALIBRATION_RUNS: list[tuple[str, str, dict[str, Any]]] = [
    ("average p4", "average", {"period": 4}),
    ("allreduce", "allreduce", {}),
]
QUICK = {"hosts": "2", "rates": "unlimited,100mbit", "configs": ("allreduce", "async p4")}


# --- measuring -----------------------------------------------------------------------------------------------


class _Kept:
    """Wraps `network.window_steps` to keep the step records of the last window it counted."""

    def __init__(self) -> None:
        self.original = network.window_steps
        self.inside: Any = None
        network.window_steps = self

    def __call__(self, frame: Any, started: float, ended: float, cycle: int = 1) -> Any:
        rates, inside = self.original(frame, started, ended, cycle)
        self.frame, self.started, self.inside = frame, started, inside
        return rates, inside


def set_condition(lab: Any, condition: str) -> None:
    last = lab.size - 1
    for host in range(1, lab.size):
        lab.set_cpu(host, STRAGGLER_SHARE if condition == STRAGGLER and host == last else None)
    lab.set_rate(None if condition in ("unlimited", STRAGGLER) else condition)


def measure_cell(bench: Any, kept: _Kept, strategy: str, settings: dict[str, Any]) -> dict[str, Any]:
    record = bench.workbench(strategy, settings)
    if "error" in record:
        return record
    inside = kept.inside
    staleness = network.window_staleness(kept.frame, kept.started, inside)
    if staleness is not None:
        record["staleness_mean"] = staleness
    record["records"] = len(inside)
    return record


def measure(arguments: argparse.Namespace) -> dict[str, Any]:
    from testbed import lab as labs

    reason = labs.available()
    if reason:
        sys.exit(f"benchmarks/simulator.py needs the emulated-host lab: {reason}")
    kept = _Kept()
    hosts = [int(h) for h in arguments.hosts.split(",")]
    rates = [r.strip() for r in arguments.rates.split(",") if r.strip()]
    conditions = rates + ([] if arguments.no_straggler else [STRAGGLER])
    configs = [c for c in CONFIGS if (not arguments.quick or c[0] in QUICK["configs"])
               and (not arguments.only or any(word in c[0] for word in arguments.only.split(",")))]
    scratch = Path(tempfile.mkdtemp(prefix="workbench-simulator-"))
    cells: list[dict[str, Any]] = []
    calibration_runs: dict[str, Any] = {}
    crowding: list[dict[str, Any]] = []
    started = time.time()
    try:
        for size in hosts:
            with labs.Lab(hosts=size + 1) as lab:
                lab.start_cluster()
                client = lab.connect(workers=size)
                bench = network.Cells(lab, client, arguments, scratch)
                # Every host's condition is set by this script's set_condition, not network.py's (which
                # knows two worker hosts only): the Cells call network.set_condition, so point it here.
                network.set_condition = set_condition
                if size == hosts[0]:
                    warm_up(bench, lab, arguments.warmup_lab_s)
                for repeat in range(arguments.repeats):
                    measure_calibration_runs(bench, kept, lab, calibration_runs, repeat)
                    crowding.append(measure_crowding(lab, scratch, arguments, repeat))
                    # Interleaved: every other repetition runs the conditions and configurations backwards.
                    forward = repeat % 2 == 0
                    for condition in conditions if forward else conditions[::-1]:
                        for name, strategy, settings in configs if forward else configs[::-1]:
                            bench.condition = condition
                            set_condition(lab, condition)
                            restarts = len(bench.restarted)
                            record = network.measured(
                                lambda s=strategy, k=settings: measure_cell(bench, kept, s, k), config=name,
                                strategy=strategy, settings=settings, condition=condition, workers=size,
                                repeat=repeat)
                            if len(bench.restarted) > restarts:  # a worker started just before this cell
                                record["workers_restarted_before"] = [r["host"] for r in bench.restarted[restarts:]]
                            cells.append(record)
                            shown = record.get("error") or (
                                f"{record['samples_per_s']:,.0f} samples/s, staleness "
                                f"{network._fmt(record.get('staleness_mean'), 2)}")
                            print(f"repeat {repeat + 1} {size} workers {condition:>9} {name:<12} {shown}  "
                                  f"[load {record['loadavg_before'][0]:.1f}, {record['cell_s']:.0f} s]", flush=True)
                set_condition(lab, "unlimited")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {**resultfile.document("simulator", {"hosts": hosts, "conditions": conditions, "repeats": arguments.repeats,
                         "window_s": arguments.window_s,
                         "warmup_s": arguments.warmup_s, "warmup_steps": arguments.warmup_steps,
                         "max_window_s": arguments.max_window_s, "min_cycles": arguments.min_cycles,
                         "warmup_lab_s": arguments.warmup_lab_s,
                         "straggler": f"the last worker host at "
                         f"{STRAGGLER_SHARE} core, unlimited link", "batch_per_worker": network.BATCH,
                         "model": "MLP 784-1024-1024-10", "quick": arguments.quick, "only": arguments.only,
                         "calibration_runs": "2 worker hosts, unlimited link, once per repetition in every lab",
                         "crowding_probes": f"{arguments.crowding_processes} plain training processes side by "
                         f"side, {arguments.crowding_window_s:g} s, once per repetition in every lab"},
                                  network.LAB_DESCRIPTION),
            "measured_minutes": round((time.time() - started) / 60, 1),
            "calibration_runs": calibration_runs, "crowding_probes": [p for p in crowding if p], "cells": cells}


def warm_up(bench: Any, lab: Any, seconds: float) -> None:
    """Train for `seconds`, measuring nothing, before the grid's first cell. The first minutes on a machine
    idle before measured slow: on the second grid of 2026-11-25 most of the first repetition's 2-worker
    cells ran 9-34% below the later two (`average` p16, unlimited: 8,691 against 10,182 and 13,231; the
    `average` p4 calibration run 7,341 against 9,875 and 10,484), on the first grid up to 17% (`ssp`)."""
    if seconds <= 0:
        return
    import workbench

    set_condition(lab, "unlimited")
    bench.ensure_workers()
    run = workbench.train(network.lab_job(), "allreduce", client=bench.client, run_dir=bench.scratch / "runs",
                          checkpoint_every_s=None)
    try:
        run.wait_for_step(0, timeout=bench.arguments.start_timeout_s)
        time.sleep(seconds)  # a span of training, not a synchronisation: nothing waits on what it reaches
    finally:
        bench._finish(run)
    print(f"warmed up: {seconds:g} s of allreduce, not measured", flush=True)


def measure_calibration_runs(bench: Any, kept: _Kept, lab: Any, runs: dict[str, list[dict[str, Any]]],
                             repeat: int) -> None:
    """The candidate calibration runs (2 of the lab's worker hosts, unlimited link), once per repetition
    in every lab: each lab's points are predicted from its own runs, the one of median throughput (one real
    run, but not one the lab's noise singled out: the first run after the lab started measured 8% below
    every later run of the same condition, 2026-11-24). The machine's speed drifts within a grid: on
    2026-11-25-d the 2-host lab's calibration runs read 11,429-11,680 samples/s and its `average` p16 cells
    13,070-13,654, the 4-host lab's `average` p16 cells 20 minutes later 10,877-11,764, and predictions from
    the 2-host lab's calibration put 7 of its 4-worker points 15-21% high. Each run is alone enough to
    calibrate from."""
    bench.condition = "unlimited"
    bench.workers = 2
    try:
        for name, strategy, settings in CALIBRATION_RUNS:
            set_condition(lab, "unlimited")
            record = network.measured(lambda s=strategy, k=settings: measure_cell(bench, kept, s, k),
                                      config=name, condition="unlimited", workers=2)
            if "error" in record:
                print(f"calibration run {name} failed: {record['error']}", flush=True)
                continue
            runs.setdefault(name, []).append({"strategy": strategy, "settings": settings, "repeat": repeat,
                                              "lab_workers": lab.size - 1, "records": _plain_records(kept.inside),
                                              "samples_per_s": record["samples_per_s"],
                                              "loadavg_before": record["loadavg_before"]})
            print(f"repeat {repeat + 1} calibration run: {name}, 2 of {lab.size - 1} worker hosts, unlimited: "
                  f"{record['samples_per_s']:,.0f} samples/s, {len(kept.inside)} step records", flush=True)
    finally:
        bench.workers = None


def measure_crowding(lab: Any, scratch: Path, arguments: argparse.Namespace, repeat: int) -> dict[str, Any] | None:
    """A probe of the machine, no Dask in it: k plain training loops (one thread each) side by side over
    one wall-clock window, for each k of `--crowding-processes`, their samples/s together. What k
    processes on the cores do against one a core is `Calibration.crowding_loss`
    (`simulate.crowding_loss_from`). They run on the lab's worker hosts in turn (the namespaces change
    nothing for the CPU), beside the lab's idle Dask processes, as the cells do."""
    totals, each = {}, {}
    counts = [int(v) for v in arguments.crowding_processes.split(",")]
    # Every other repetition backwards, so the machine's drift over a probe does not favour one count.
    for k in counts if repeat % 2 == 0 else counts[::-1]:
        barrier = scratch / f"crowding-{lab.size - 1}-{repeat}-{k}"
        specs = [{"mode": "plain", "rank": rank, "processes": k, "barrier": str(barrier),
                  "window_s": arguments.crowding_window_s, "ready_timeout_s": arguments.crowding_ready_timeout_s,
                  "out": f"{barrier}-{rank}.json"} for rank in range(k)]
        hosts = [1 + rank % (lab.size - 1) for rank in range(k)]
        results = network.spawn_and_wait(lab, hosts, specs, f"crowding-{k}",
                                         arguments.crowding_ready_timeout_s + arguments.crowding_window_s + 60,
                                         {"OMP_NUM_THREADS": "1"})
        if any(r is None for r in results):
            print(f"crowding probe with {k} processes failed: left out", flush=True)
            return None
        each[k] = [r["samples_per_s"] for r in results]
        totals[k] = sum(each[k])
    print(f"repeat {repeat + 1} crowding probe, {lab.size - 1} worker hosts: "
          + ", ".join(f"{k} processes {t:,.0f}" for k, t in totals.items()) + " samples/s", flush=True)
    return {"lab_workers": lab.size - 1, "repeat": repeat, "totals": totals, "per_process": each}


def crowding_loss(document: dict[str, Any]) -> float | None:
    """The `Calibration.crowding_loss` the grid's own probes read (None: it has none). The predictions
    use the default, measured before the grid; these give a second set beside them."""
    from planner import simulate

    probes = document.get("crowding_probes")
    if not probes:
        return None
    return simulate.crowding_loss_from([p["totals"] for p in probes], document["machine"]["cores"])


def calibration_run(document: dict[str, Any], name: str, lab_workers: int | None = None) -> dict[str, Any]:
    """The named calibration run of median throughput measured in the lab of `lab_workers` worker hosts,
    or (None, or none measured there) in the smallest lab measured: 2 hosts in a whole grid, and the only
    one in a document from before 2026-11-26; one from before 2026-11-25 holds one run."""
    runs = document["calibration_runs"][name]
    if isinstance(runs, dict):
        return runs
    labs = {run.get("lab_workers", 2) for run in runs}
    chosen = lab_workers if lab_workers in labs else min(labs)
    ordered = sorted((run for run in runs if run.get("lab_workers", 2) == chosen), key=lambda run: run["samples_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def median_points(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One point per (workers, condition, configuration): the median of its repetitions' throughput and
    staleness (a failed repetition is left out, and one marked `disturbed`, with why: what it measured was
    not the lab's condition; a point all of whose repetitions failed keeps an error)."""
    points: dict[tuple, dict[str, Any]] = {}
    for cell in cells:
        key = (cell["workers"], cell["condition"], cell["config"])
        points.setdefault(key, {k: cell[k] for k in ("workers", "condition", "config", "strategy", "settings")})
        points[key].setdefault("cells", []).append(cell)
    for point in points.values():
        good = [c for c in point.pop("cells") if "error" not in c and "disturbed" not in c]
        if not good:
            point["error"] = "every repetition failed"
            continue
        point["runs"] = [round(c["samples_per_s"]) for c in good]
        point["samples_per_s"] = statistics.median(c["samples_per_s"] for c in good)
        stale = [c["staleness_mean"] for c in good if c.get("staleness_mean") is not None]
        if stale:
            point["staleness_mean"] = statistics.median(stale)
        split = [c["time_split"] for c in good if c.get("time_split")]
        if split:
            point["time_split"] = {k: statistics.median(s[k] for s in split) for k in split[0]}
        point["loadavg_before"] = [max(c["loadavg_before"][0] for c in good)]
        # How long each run had trained at the middle of its window (SSP's bound takes time to bind).
        middles = [c["start_s"] + max(c["span_s"].values()) / 2 for c in good if c.get("span_s")]
        if middles:
            point["window_middle_s"] = statistics.median(middles)
            point["window_s"] = statistics.median(max(c["span_s"].values()) for c in good if c.get("span_s"))
    return list(points.values())


def _plain_records(frame: Any) -> list[dict[str, Any]]:
    """Step records as JSON-ready dicts: Python numbers, no missing fields (NaN where a strategy has none)."""
    records = []
    for record in frame.to_dict("records"):
        plain = {}
        for key, value in record.items():
            if hasattr(value, "item"):
                value = value.item()
            if value is None or (isinstance(value, float) and value != value):
                continue
            plain[key] = value
        records.append(plain)
    return records


# --- predicting -----------------------------------------------------------------------------------------------


def predict_points(document: dict[str, Any], calibrate_with: str, per_lab: bool = True,
                   crowding: float | None = None) -> dict[str, Any]:
    """Calibrate from the document's calibration records, predict every measured point, and the errors.
    `per_lab`: each lab's points from the calibration runs measured in it (where the document has them);
    otherwise every point from the 2-host lab's. `crowding`: `Calibration.crowding_loss` (None: its
    default, measured before the grid)."""
    from planner import simulate
    from testbed.lab import burst_bytes

    calibrations: dict[int | None, Any] = {}  # None: the smallest lab's
    runs: dict[int | None, dict[str, Any]] = {}
    measured = {} if crowding is None else {"crowding_loss": crowding}

    def calibrated(lab_workers: int | None) -> Any:
        if lab_workers not in calibrations:
            runs[lab_workers] = calibration_run(document, calibrate_with, lab_workers if per_lab else None)
            calibrations[lab_workers] = simulate.calibrate(runs[lab_workers]["records"], model_bytes=MODEL_BYTES,
                                                           link_rate=None, workers=2,
                                                           cores=document["machine"]["cores"], **measured)
        return calibrations[lab_workers]

    calibration = calibrated(None)
    rows = []
    points = median_points(document["cells"]) if "cells" in document else document["points"]
    for point in points:
        if "error" in point:
            rows.append({k: point[k] for k in ("config", "condition", "workers", "error")})
            continue
        condition = point["condition"]
        link = None if condition in ("unlimited", STRAGGLER) else _rate(condition)
        straggler = STRAGGLER_SHARE if condition == STRAGGLER else None
        predicted = simulate.predict(calibrated(point["workers"]), point["strategy"], point["settings"], point["workers"], link,
                                     straggler=straggler, cores=document["machine"]["cores"],
                                     elapsed_s=point.get("window_middle_s"), window_s=point.get("window_s", 0.0),
                                     link_burst=0.0 if link is None else burst_bytes(link))
        row = {"config": point["config"], "strategy": point["strategy"], "condition": condition,
               "workers": point["workers"], "measured_samples_per_s": point["samples_per_s"],
               "predicted_samples_per_s": predicted.samples_per_s,
               "throughput_error": abs(predicted.samples_per_s - point["samples_per_s"]) / point["samples_per_s"],
               "predicted_comm_share": predicted.comm_share,
               "measured_comm_share": point.get("time_split", {}).get("comm"),
               "loadavg_1min": point["loadavg_before"][0]}
        if predicted.staleness is not None or point.get("staleness_mean") is not None:
            row.update(measured_staleness=point.get("staleness_mean"), predicted_staleness=predicted.staleness)
            if predicted.staleness is not None and point.get("staleness_mean") is not None:
                row["staleness_error"] = abs(predicted.staleness - point["staleness_mean"])
        rows.append(row)
    good = [r for r in rows if "throughput_error" in r]
    worst = max(good, key=lambda r: r["throughput_error"]) if good else None
    stale = [r for r in rows if "staleness_error" in r]
    worst_stale = max(stale, key=lambda r: r["staleness_error"]) if stale else None
    run = runs[None]
    measured_in = document["calibration_runs"][calibrate_with]
    own = per_lab and isinstance(measured_in, list) and len({r.get("lab_workers", 2) for r in measured_in}) > 1
    return {"calibrated_with": f"{calibrate_with}, 2 worker hosts, unlimited link"
                               + (f", repetition {run['repeat'] + 1} (median throughput)" if "repeat" in run else "")
                               + (", measured in each lab (its points predicted from its own)" if own else ""),
            "calibration": calibration.as_dict(),
            "crowding_loss": {"value": calibration.crowding_loss,
                              "from": "the default (measured before)" if crowding is None else "given"},
            "calibration_by_lab": ({str(k): c.as_dict() for k, c in sorted(calibrations.items(), key=lambda kc: kc[0] or 0)
                                    if k is not None} if own else None),
            "table": rows,
            "max_throughput_error": worst["throughput_error"] if worst else None,
            "max_throughput_error_at": _where(worst),
            "median_throughput_error": statistics.median(r["throughput_error"] for r in good) if good else None,
            "points_within_15pct": f"{sum(r['throughput_error'] <= 0.15 for r in good)}/{len(good)}",
            "max_staleness_error": worst_stale["staleness_error"] if worst_stale else None,
            "max_staleness_error_at": _where(worst_stale),
            "failed_points": [_where(r) for r in rows if "error" in r]}


MODEL_BYTES = 4 * (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)  # float32 parameters


def _rate(condition: str) -> float:
    from testbed.lab import rate_bytes_per_s

    return rate_bytes_per_s(condition)


def _where(row: dict[str, Any] | None) -> str | None:
    return None if row is None else f"{row['config']}, {row['workers']} workers, {row['condition']}"


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'configuration':<13}{'workers':>8}{'condition':>11}{'measured':>10}{'predicted':>10}{'error':>7}"
          f"{'stale m':>9}{'stale p':>9}")
    for row in result["table"]:
        if "error" in row:
            print(f"{row['config']:<13}{row['workers']:>8}{row['condition']:>11}  failed: {row['error'][:60]}")
            continue
        print(f"{row['config']:<13}{row['workers']:>8}{row['condition']:>11}{row['measured_samples_per_s']:>10,.0f}"
              f"{row['predicted_samples_per_s']:>10,.0f}{row['throughput_error']:>7.0%}"
              f"{network._fmt(row.get('measured_staleness'), 2):>9}"
              f"{network._fmt(row.get('predicted_staleness'), 2):>9}")
    print(f"\nmax throughput error {result['max_throughput_error']:.1%} ({result['max_throughput_error_at']}), "
          f"median {result['median_throughput_error']:.1%}, within 15%: {result['points_within_15pct']}; "
          f"max staleness error {network._fmt(result['max_staleness_error'], 2)} ({result['max_staleness_error_at']})")


def markdown_table(result: dict[str, Any]) -> str:
    """The README's table: per configuration and condition, measured / predicted samples/s and the
    error at each worker count; staleness (measured / predicted) beside the parameter-server rows."""
    rows = [r for r in result["table"] if "error" not in r]
    sizes = sorted({r["workers"] for r in rows})
    conditions = list(dict.fromkeys(r["condition"] for r in rows))
    header = "| configuration | condition | " + " | ".join(f"{n} workers: measured / predicted" for n in sizes)
    lines = [header + " | staleness m / p |", "|---|---|" + "---:|" * len(sizes) + "---|"]
    for name in dict.fromkeys(r["config"] for r in rows):
        for condition in conditions:
            cells, stale = [], []
            for size in sizes:
                row = next((r for r in rows if r["config"] == name and r["condition"] == condition
                            and r["workers"] == size), None)
                if row is None:
                    cells.append("-")
                    continue
                error = row["throughput_error"]
                mark = "**" if error > 0.15 else ""
                cells.append(f"{row['measured_samples_per_s']:,.0f} / {row['predicted_samples_per_s']:,.0f} "
                             f"({mark}{error:.0%}{mark})")
                if row.get("measured_staleness") is not None and row.get("predicted_staleness") is not None:
                    stale.append(f"{row['measured_staleness']:.1f}/{row['predicted_staleness']:.1f}")
            lines.append(f"| {name} | {condition} | " + " | ".join(cells) + f" | {' '.join(stale) or '-'} |")
    return "\n".join(lines)


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", default="2,3,4", help="worker hosts of each lab, comma-separated")
    parser.add_argument("--rates", default=",".join(RATES), help="link rates, comma-separated (tc rates)")
    parser.add_argument("--no-straggler", action="store_true")
    parser.add_argument("--only", help="only the configurations whose name has one of these comma-separated words")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of the grid (interleaved; medians)")
    # 8 s after 3 s of warm-up, not 3 after 1.5: a point's repetitions spread a median 3.2% (2026-11-26-long,
    # 46 minutes) where 3 s windows spread 4.7-6.8% (-b, -c, 35 minutes), and the 4-host lab's calibration
    # runs read 10,877-11,840 samples/s where they had read 7,713-10,969.
    parser.add_argument("--window-s", type=float, default=8.0, help="steady seconds measured per cell")
    # Eight cycles, not the network benchmark's two: a parameter-server worker behind a 100 Mbit/s link
    # pushes every 1-3 s, and its flow falls in and out of turns with the others' over 5-10 cycles. Over
    # four, `ssp` p4's repetitions read 778-1,043 samples/s at 3 workers and 713-887 at 4 (2026-11-25-d),
    # where 60 s read 1,044-1,101 and 779-782; over two, 761-1,234 at 3.
    parser.add_argument("--min-cycles", type=int, default=8, help="the window spans at least this many "
                        "exchange cycles of every worker")
    parser.add_argument("--max-window-s", type=float, default=24.0)
    parser.add_argument("--warmup-lab-s", type=float, default=60.0, help="seconds of unmeasured training "
                        "before the grid's first cell (0: none)")
    parser.add_argument("--crowding-processes", default="2,3,4", help="the crowding probe's process counts, "
                        "comma-separated; the first one a core (the reference)")
    parser.add_argument("--crowding-window-s", type=float, default=6.0)
    parser.add_argument("--crowding-ready-timeout-s", type=float, default=60.0, help="seconds each of the "
                        "probe's processes, its data loaded, waits for all to be ready (the window opens 1 s after the last)")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--warmup-steps", type=int, default=6)
    parser.add_argument("--start-timeout-s", type=float, default=90.0)
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/"
                                                    "simulator.json; with --from the file read; --quick saves "
                                                    "only where --out says)")
    parser.add_argument("--from", dest="source", default=None,
                        help="predict again from a saved result's calibration records and points (no lab)")
    parser.add_argument("--calibrate-with", default=CALIBRATION_RUNS[0][0],
                        help=f"the calibration run: one of {', '.join(n for n, _, _ in CALIBRATION_RUNS)}")
    parser.add_argument("--quick", action="store_true", help="2 worker hosts, unlimited and 100mbit, 2 strategies")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.hosts, arguments.rates, arguments.no_straggler = QUICK["hosts"], QUICK["rates"], True
        arguments.repeats = 1
    return arguments


def main() -> None:
    arguments = parse_arguments()
    if arguments.source:
        document = json.loads(Path(arguments.source).read_text())
        document["predicted_again"] = datetime.date.today().isoformat()
    else:
        document = measure(arguments)
        # The measurements first, so a failure of the model loses no lab time.
        Path("/tmp/simulator-measured.json").write_text(json.dumps(network._rounded(document)))
    document.update(predict_points(document, arguments.calibrate_with))
    if document.get("calibration_by_lab"):
        # The same points, every one from the 2-host lab's calibration: what the machine's drift costs.
        single = predict_points(document, arguments.calibrate_with, per_lab=False)
        document["from_2_host_calibration"] = {k: single[k] for k in (
            "max_throughput_error", "max_throughput_error_at", "median_throughput_error", "points_within_15pct")}
    probed = crowding_loss(document)
    if probed is not None:
        # The same points with the crowding loss the grid's own probes read, beside the default's.
        again = predict_points(document, arguments.calibrate_with, crowding=probed)
        document["with_crowding_probes"] = {"crowding_loss": probed, **{k: again[k] for k in (
            "max_throughput_error", "max_throughput_error_at", "median_throughput_error", "points_within_15pct",
            "max_staleness_error")}}
    print_table(document)
    print("\n" + markdown_table(document))
    older = arguments.source and any(key not in document for key in resultfile.PROVENANCE)
    if older:  # a grid from before the current layout names no commit: predicted again, printed only
        print(f"\n{arguments.source} predates the result layout (no commit in it): printed, not written")
    elif arguments.source or arguments.out or not arguments.quick:
        # Predicted again: back into the file it came from, unless --out names another.
        path = Path(arguments.out or arguments.source or resultfile.path_for("simulator"))
        resultfile.write(path, network._rounded(document))
        print(f"\nwritten to {path}")
    summary = {k: document[k] for k in ("max_throughput_error", "max_throughput_error_at", "median_throughput_error",
                                        "points_within_15pct", "max_staleness_error", "max_staleness_error_at")}
    summary["crowding_loss"] = document["crowding_loss"]["value"]
    if document.get("with_crowding_probes"):
        summary["with_crowding_probes"] = document["with_crowding_probes"]
    if document.get("from_2_host_calibration"):
        summary["from_2_host_calibration"] = document["from_2_host_calibration"]
    print(json.dumps(network._rounded(summary)))


if __name__ == "__main__":
    main()
