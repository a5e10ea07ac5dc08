"""`auto` against fixed strategies on the emulated hosts: time to a held-out accuracy target per condition.

Runs on the lab (`testbed/lab.py`: needs root, `ip` and `tc`): host 0 holds the scheduler and the
client, hosts 1 and 2 one `dask worker` each. The job: `digits`, MLP 64-H-H-10 (`--hidden`, 1024), batch
32 per worker, held-out evaluation every 20 steps on worker 0, each strategy's suggested SGD with the lr
times `--lr-scale` (`auto` starts with allreduce's and changes the lr as it switches). Conditions: the
links unlimited, 100 Mbit/s, a straggler (host 2 at 30% of a core), and a link that changes while the run
trains (unlimited, then 20 Mbit/s from `--change-after-s` seconds on). For each, the time from the first
step to `--target` held-out accuracy of `allreduce`, `average` (period 16 and 64, overlapped), `async`
(push_every 4, one server shard per worker), `easgd` (period 16) and `auto`; the best fixed one is chosen
after the fact. Each run also reports its throughput and mean staleness under each strategy it trained
with, which tells a strategy that is slow from one that learns less per sample. A
fixed configuration stops once it has run `--cap` times the best fixed time seen so far in its condition
(it cannot be the best; reported as "over N s"). The last line printed is one JSON object, also written to
`benchmarks/results/<machine class>/auto.json` (or `--out`; rewritten after every run, `complete` false
until the last), with `worst_time_vs_best_fixed` (auto's largest ratio to the best fixed strategy over the
conditions) and `changing_link_time_vs_best_fixed`. A worker host whose worker did not rejoin gets a fresh
one. Its throughput against every fixed configuration of the network benchmark, condition by condition, is
that benchmark's `auto` row.

    python benchmarks/auto.py [--repeats 1] [--target 0.95] [--lr-scale 0.005] [--out FILE]

Why the lr is scaled: at the suggested lr every configuration reaches 0.9-0.97 on `digits` in 1-10 s
(tried 2026-11-24), before `auto` has judged its first three windows (6 s). A smaller lr makes a job of
about a minute, the stand-in for the longer jobs `auto` is for; every configuration gets the same scale.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import cloudpickle

sys.path.insert(0, str(Path(__file__).resolve().parent))
import resultfile  # noqa: E402
from network import LAB_DESCRIPTION  # noqa: E402  (the lab's conditions, as every lab benchmark states them)

log = logging.getLogger("workbench.run.autopilot")  # --verbose: beside auto's judgements, on one clock
CONFIGS = [("allreduce", "allreduce", {}), ("average p16", "average", {"period": 16, "overlap": True}),
           ("average p64", "average", {"period": 64, "overlap": True}),
           ("async p4", "async", {"push_every": 4, "shards": 2}), ("easgd p16", "easgd", {"period": 16}),
           ("auto", "auto", {})]
# The order each condition runs its fixed configurations in, likeliest best first, so the cap cuts most.
LIKELY_BEST = {"unlimited": ["average p16", "allreduce", "average p64", "easgd p16", "async p4"],
               "100mbit": ["average p64", "average p16", "easgd p16", "async p4", "allreduce"],
               "straggler": ["easgd p16", "average p16", "average p64", "async p4", "allreduce"],
               "changing": ["average p64", "average p16", "easgd p16", "async p4", "allreduce"]}
CONDITIONS = ["unlimited", "100mbit", "straggler", "changing"]
STRAGGLER_HOST, STRAGGLER_SHARE = 2, 0.3

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def set_condition(lab: Any, condition: str) -> None:
    lab.set_rate("100mbit" if condition == "100mbit" else None)
    lab.set_cpu(STRAGGLER_HOST, STRAGGLER_SHARE if condition == "straggler" else None)


def ensure_workers(lab: Any, client: Any, hosts: tuple[int, ...] = (1, 2)) -> None:
    """Each worker host's `dask worker` back before the next run: a worker the nanny restarts (after a
    run's stop on a slow link) sometimes never rejoins (seen twice in 2026-11-24's runs), and one cell
    then lost the whole benchmark. Such a host gets a fresh `dask worker` after 60 s (`Lab.restore_workers`),
    said so on stdout."""
    try:
        client.wait_for_workers(len(hosts), timeout=60)
        return
    except TimeoutError:
        pass
    for host in lab.restore_workers(client, list(hosts), timeout_s=120):
        print(f"host {host}'s worker did not come back within 60 s: a fresh one", flush=True)


def to_target(lab: Any, client: Any, strategy: str, settings: dict[str, Any], condition: str,
              arguments: argparse.Namespace, scratch: Path, limit_s: float) -> dict[str, Any]:
    import workbench
    from workbench.plane import kinds
    from workbench.strategies import suggested_sgd

    sgd = suggested_sgd("allreduce" if strategy == "auto" else strategy)
    sgd["lr"] *= arguments.lr_scale
    job = workbench.Job(model=workbench.mlp(64, 10, [arguments.hidden] * 2), data="digits", batch_size=32,
                        epochs=100_000, eval_every=20, seed=0, **sgd)
    set_condition(lab, condition)
    run = workbench.train(job, strategy, client=client, run_dir=scratch, checkpoint_every_s=None, **settings)
    changer, changed = None, []  # when the link fell (wall clock)

    def lower_link() -> None:
        lab.set_rate("20mbit")
        changed.append(time.time())

    if condition == "changing":  # the link slows down halfway, while the run trains
        changer = threading.Timer(arguments.change_after_s, lower_link)
        changer.start()
    hit, began = None, time.monotonic()
    try:
        while not run.done and time.monotonic() - began < limit_s:
            evaluations = run.evaluations
            if not evaluations.empty and (evaluations["accuracy"] >= arguments.target).any():
                hit = evaluations[evaluations["accuracy"] >= arguments.target].iloc[0]
                break
            time.sleep(0.1)
    finally:
        if changer is not None:
            changer.cancel()
        set_condition(lab, "unlimited")  # the end of the run (final exchange) at full speed
        run.stop()
        run.wait(300)
    frame = run.metrics
    first = frame.loc[frame["time"].idxmin()]
    origin = first["time"] - (first["compute_s"] + first["comm_s"] + first["wait_s"])
    # Throughput under each strategy the run trained with (all workers), and its mean staleness: what
    # tells a slow strategy from one that learns less per sample.
    throughput = {}
    for name, part in frame.groupby("strategy"):
        span = part["time"].max() - part["time"].min()
        throughput[name] = {"samples_per_s": round(float(part["samples"].sum() / span), 1) if span > 0 else None,
                            "staleness": round(float(part["staleness"].mean()), 2)
                            if "staleness" in part and part["staleness"].notna().any() else None}
    log.debug("the first step at %.1f", origin)
    return {"seconds": float(hit["time"] - origin) if hit is not None else None, "limit_s": limit_s,
            "throughput": throughput,
            "steps": int(hit["step"]) if hit is not None else None,
            # On the same clock as the decisions (seconds from the first step): the start of a run comes
            # some seconds after `train` returns, and the link falls `--change-after-s` after that.
            "link_changed_after_s": round(changed[0] - origin, 1) if changed else None,
            "decisions": [{"after_s": round(e["time"] - origin, 1), "to": e["to"], "settings": e["settings"],
                           "effective_after_s": _effective_after_s(frame, e, origin),
                           "lr": e["lr"], "reason": e["reason"]} for e in run.events(kinds.AUTO_DECISION)],
            # Each worker's side of each switch: when it was made and how long the worker spent in it.
            "switched": [{"worker": e.get("worker"), "after_s": round(e["time"] - origin, 1), "to": e.get("to"),
                          "took_s": round(e.get("took_s") or 0.0, 2), "parts_s": e.get("parts_s")}
                         for e in run.events(kinds.SWITCHED)],
            **sgd}


def _effective_after_s(frame: Any, decision: dict[str, Any], origin: float) -> float | None:
    """When a decision took effect: every worker's first step under the new strategy after it (seconds
    from the first step; None if a worker never trained under it)."""
    later = frame[(frame["time"] >= decision["time"]) & (frame["strategy"] == decision["to"])]
    firsts = later.groupby("worker")["time"].min()
    if len(firsts) < frame["worker"].nunique():
        return None
    return round(float(firsts.max()) - origin, 1)


def summarize(cells: dict[tuple[str, str], list[dict[str, Any]]], conditions: list[str],
              arguments: argparse.Namespace, complete: bool) -> dict[str, Any]:
    """The result so far: per condition each configuration's median time, the best fixed one and auto's
    ratio to it. Written after every cell (`complete` false until the last), so a run cut short keeps
    what it measured."""
    def median_s(condition: str, name: str) -> float | None:
        runs = cells.get((condition, name), [])
        times = [c["seconds"] for c in runs if c["seconds"] is not None]
        return statistics.median(times) if runs and len(times) == len(runs) else None

    table, ratios = {}, {}
    for condition in conditions:
        fixed = {name: median_s(condition, name) for name, _, _ in CONFIGS if name != "auto"}
        reached = {name: s for name, s in fixed.items() if s is not None}
        best = min(reached, key=reached.get) if reached else None
        auto_s = median_s(condition, "auto")
        ratio = auto_s / reached[best] if best and auto_s is not None else None
        # A capped configuration took longer than its limit: auto beats it if it got there within that.
        beats_all = auto_s is not None and all(
            (s is not None and auto_s < s) or (s is None and auto_s < min(c["limit_s"] for c in cells[(condition, n)]))
            for n, s in fixed.items() if (condition, n) in cells)
        table[condition] = {"seconds": {**fixed, "auto": auto_s}, "best_fixed": best, "auto_vs_best_fixed": ratio,
                            "auto_beats_every_fixed": beats_all,
                            "limits_s": {n: [c["limit_s"] for c in cells.get((condition, n), [])] for n in fixed},
                            "auto_seconds": [c["seconds"] for c in cells.get((condition, "auto"), [])],
                            "auto_decisions": [c["decisions"] for c in cells.get((condition, "auto"), [])],
                            "auto_link_changed_after_s": [c.get("link_changed_after_s") for c in cells.get((condition, "auto"), [])],
                            "throughput": {n: [c["throughput"] for c in cells.get((condition, n), [])]
                                           for n, _, _ in CONFIGS if (condition, n) in cells}}
        ratios[condition] = ratio
    # On the changing link: seconds from the fall to the first decision after it, and to its taking
    # effect on every worker (the target: within 10 s).
    reactions = []
    for run in cells.get(("changing", "auto"), []):
        fell = run.get("link_changed_after_s")
        after = [d for d in run["decisions"] if fell is not None and d["after_s"] >= fell]
        if after:
            effective = after[0].get("effective_after_s")
            reactions.append({"decided_s": round(after[0]["after_s"] - fell, 1),
                              "took_effect_s": round(effective - fell, 1) if effective is not None else None})
    known = [r for r in ratios.values() if r is not None]
    settings = {"target": arguments.target, "repeats": arguments.repeats, "lr_scale": arguments.lr_scale,
                "hidden": arguments.hidden, "max_s": arguments.max_s, "cap": arguments.cap,
                "change_after_s": arguments.change_after_s, "conditions": conditions,
                "configs": [n for n, _, _ in CONFIGS if n in arguments.configs.split(",")]}
    return {**resultfile.document("auto", settings, LAB_DESCRIPTION),
            "complete": complete, "conditions": table,
            "worst_time_vs_best_fixed": max(known) if known and len(known) == len(ratios) else None,
            "changing_link_time_vs_best_fixed": ratios.get("changing"),
            "changing_link_beats_every_fixed": table["changing"]["auto_beats_every_fixed"] if "changing" in table else None,
            "changing_link_reactions": reactions}


def save(result: dict[str, Any], out: str | None) -> None:
    # Atomic (resultfile.write): a run stopped mid-write keeps the last whole file.
    resultfile.write(Path(out or resultfile.path_for("auto")), result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--lr-scale", type=float, default=0.005)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--max-s", type=float, default=300.0)
    parser.add_argument("--cap", type=float, default=1.6)
    parser.add_argument("--change-after-s", type=float, default=20.0)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--configs", default=",".join(name for name, _, _ in CONFIGS),
                        help="which configurations to run (a subset: e.g. auto alone after a change to it)")
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/auto.json)")
    parser.add_argument("--verbose", action="store_true", help="log what each of auto's judgements saw")
    arguments = parser.parse_args()
    if arguments.verbose:
        logging.basicConfig(format="%(created).1f %(message)s")
        logging.getLogger("workbench.run.autopilot").setLevel(logging.DEBUG)
    from testbed import lab as labs

    reason = labs.available()
    if reason is not None:
        sys.exit(f"no emulated hosts here: {reason}")
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    conditions = [c for c in arguments.conditions.split(",") if c]
    wanted = [c for c in arguments.configs.split(",") if c]
    names = [name for name, _, _ in CONFIGS]
    if any(name not in names for name in wanted):
        parser.error(f"--configs: {next(n for n in wanted if n not in names)!r} is not one of {names}")
    unknown = sorted(set(conditions) - set(CONDITIONS))
    if unknown:
        parser.error(f"--conditions: {unknown[0]!r} is not one of {CONDITIONS}")
    with labs.Lab(hosts=3) as lab, tempfile.TemporaryDirectory() as scratch:
        lab.start_cluster()
        client = lab.connect(workers=2)
        configs = {name: (strategy, settings) for name, strategy, settings in CONFIGS}
        for repeat in range(arguments.repeats):
            for condition in (conditions if repeat % 2 == 0 else conditions[::-1]):
                best = math.inf  # the best fixed time so far in this condition and repeat
                for name in [n for n in [*LIKELY_BEST[condition], "auto"] if n in wanted]:
                    strategy, settings = configs[name]
                    limit = arguments.max_s if name == "auto" else min(arguments.max_s, arguments.cap * best)
                    ensure_workers(lab, client)
                    result = to_target(lab, client, strategy, settings, condition, arguments, Path(scratch), limit)
                    cells.setdefault((condition, name), []).append(result)
                    if name != "auto" and result["seconds"] is not None:
                        best = min(best, result["seconds"])
                    shown = f"{result['seconds']:.1f}" if result["seconds"] is not None else f"over {limit:.0f}"
                    print(f"repeat {repeat + 1}: {condition:9s} {name:12s} {shown:>9} s "
                          f"{[(d['after_s'], d['effective_after_s'], d['reason']) for d in result['decisions']]} "
                          f"link fell at {result['link_changed_after_s']} s {result['throughput']}", flush=True)
                    if arguments.verbose:
                        print(f"switched: {result['switched']}", flush=True)
                    save(summarize(cells, conditions, arguments, complete=False), arguments.out)
        client.close()

    result = summarize(cells, conditions, arguments, complete=True)
    save(result, arguments.out)
    print(f"\n{'condition':10s} " + " ".join(f"{name:>12s}" for name, _, _ in CONFIGS) + "   auto/best")
    for condition, row in result["conditions"].items():
        cells_text = " ".join(f"{row['seconds'][name]:12.1f}" if row["seconds"][name] is not None else f"{'-':>12s}"
                              for name, _, _ in CONFIGS)
        ratio = row["auto_vs_best_fixed"]
        print(f"{condition:10s} {cells_text}   {ratio:.2f} ({row['best_fixed']})" if ratio else f"{condition:10s} {cells_text}   -")
    print(json.dumps({k: v for k, v in result.items() if k != "conditions"}))


if __name__ == "__main__":
    main()
