"""Chaos: the real workload trained under `auto` on the lab while faults come at random times.

The job is the fidelity benchmark's (the character-level GPT, gpt-mini, on the standard library's source,
AdamW with warm-up and cosine decay, a held-out evaluation every 64 steps), on two worker hosts of the lab
(`testbed/lab.py`; host 0 the scheduler and client), under `auto`, with checkpoints every 64 steps,
`auto_join` and the timeout measured (nothing set by hand). First one undisturbed run of the budget; then
runs of the same budget one after another for `--minutes`, while one thread injects faults, one at a
time, at gaps drawn from an exponential distribution (`--mean-gap-s`) with a recorded seed:

- `kill`: a training worker's process killed (SIGKILL); its nanny starts it again and `auto_join` adds it;
- `cut`: a worker host's cable pulled for 5-25 s, then plugged back in; a worker the run left behind is
  added back with `run.add_workers()` as the next `join`;
- `rate`: a worker host's link at 100 or 20 Mbit/s for 20-60 s;
- `cpu`: a worker host at half a core for 20-60 s;
- `join`: `run.add_workers()` when a worker of the cluster is not training (else another fault).

Reported, computed in code: `faults_injected`; `runs_started` and `runs_finished`; `records_lost` (step
records missing inside a worker's run of steps within one group, in the run directory, plus any step
record the client kept that the run directory lacks, or the reverse: target 0); per fault, the time lost
(`lost_s`): the longest pause of every worker's step records that overlaps the fault's span, less the
run's median pause, plus the steps a regroup rewound to its checkpoint at the median step time;
`median_s_lost_per_fault` and `worst_s_lost_per_fault`; `held_out_loss_vs_undisturbed`: the median over
the finished chaos runs of their final held-out loss over the undisturbed run's. Each recovery's phases
(the `recovered` events, run/recovery.py) are kept in the file too.

    sudo python benchmarks/chaos.py [--minutes 20] [--seed 0] [--steps 1024] [--mean-gap-s 40]

`--recovery` (issue 46, item 1: a lost worker costs at most 2 s from the fault to the first step after,
under every strategy): the same job, one run per strategy with its defaults, on the embedded cluster (two
local workers) and on the lab with its links at 100 Mbit/s; once every worker keeps the run's checkpoint
in memory (rank 0's took it, the others were sent it), the worker of its last rank is killed (in a second
run, its first rank's: the one the checkpoints are taken from), and the run's `recovered` event says the
recovery's phases; `--repeats N` measures every strategy and rank N times in each place, the whole set
round again each time. Computed: `recovery_worst_s` (the longest over every strategy, both places, both
ranks and every repeat), the same per rank killed, `recovery_target_met` (<= 2 s, every recovery), and
`recoveries` with `recoveries_over_target`; written to `chaos-recovery.json`.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import resultfile  # noqa: E402

FAULTS = ("kill", "cut", "rate", "cpu", "join")
WORKER_HOSTS = (1, 2)
CHECKPOINT_EVERY = 64
MIN_GAP_S = 5.0


# --- the figures, computed (pure) ----------------------------------------------------------------------------


def median_pause(times: list[float]) -> float:
    """The median interval between consecutive step records of every worker, merged in time."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else 0.0


def pause_over(times: list[float], start: float, end: float) -> float:
    """The longest interval between consecutive step records (every worker, merged, sorted) that ends
    within (start, end]: how long the run made no step at all after a fault, before the next one (a pause
    that ends after `end` is the next fault's)."""
    longest = 0.0
    for a, b in zip(times, times[1:]):
        if start < b <= end:
            longest = max(longest, b - a)
    return longest


def rewound_steps(regroups: list[dict[str, Any]], steps: list[dict[str, Any]], start: float, end: float) -> int:
    """Steps a regroup within [start, end] threw away: the furthest step its group made (since the
    regroup before it), less the checkpoint step it went on from."""
    lost = 0
    times = sorted(event["time"] for event in regroups)
    for event in regroups:
        if start <= event["time"] <= end and event.get("from_step") is not None:
            since = max((t for t in times if t < event["time"]), default=float("-inf"))
            before = [r["step"] for r in steps if since < r["time"] < event["time"]]
            if before:
                lost += max(0, max(before) + 1 - event["from_step"])
    return lost


def records_missing(steps: list[dict[str, Any]], group_starts: list[float]) -> int:
    """Step records missing inside each worker's run of steps within one group (a group: from one
    'generation-started' to the next), by the records' own times."""
    bounds = sorted(group_starts) + [float("inf")]
    missing = 0
    for begin, end in zip(bounds, bounds[1:]):
        per_worker: dict[int, list[int]] = {}
        for record in steps:
            if begin <= record["time"] < end:
                per_worker.setdefault(record["worker"], []).append(record["step"])
        for numbers in per_worker.values():
            numbers.sort()
            missing += sum(max(0, b - a - 1) for a, b in zip(numbers, numbers[1:]))
    return missing


def headline(undisturbed: dict[str, Any], runs: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, Any]:
    lost = [f["lost_s"] for f in faults if f.get("lost_s") is not None]
    finished = [r for r in runs if r["status"] == "finished"]
    ratios = [r["final_loss"] / undisturbed["final_loss"] for r in finished
              if r.get("final_loss") is not None and undisturbed.get("final_loss")]
    return {"faults_injected": len(faults), "runs_started": len(runs), "runs_finished": len(finished),
            "records_lost": sum(r["records_lost"] for r in runs),
            "median_s_lost_per_fault": statistics.median(lost) if lost else None,
            "worst_s_lost_per_fault": max(lost) if lost else None,
            "lost_s_by_kind": {kind: statistics.median(v) for kind in FAULTS
                               if (v := [f["lost_s"] for f in faults if f["kind"] == kind and f.get("lost_s") is not None])},
            "held_out_loss_vs_undisturbed": statistics.median(ratios) if ratios else None}


# --- faults on the lab -----------------------------------------------------------------------------------------


class Injector:
    """Injects faults into whatever run is `current`, one at a time, until `stop` is set."""

    def __init__(self, lab: Any, client: Any, seed: int, mean_gap_s: float, kinds: tuple[str, ...] = FAULTS) -> None:
        self.lab, self.client, self.rng, self.mean_gap_s = lab, client, random.Random(seed), mean_gap_s
        self.kinds = kinds
        self.current: Any = None
        self.faults: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._inject, name="chaos", daemon=True)

    def _inject(self) -> None:
        while not self.stop.wait(max(MIN_GAP_S, self.rng.expovariate(1 / self.mean_gap_s))):
            run = self.current
            if run is None or run.status != "running":
                continue
            kinds = [k for k in self.kinds if k != "join" or self._idle_workers(run)] or ["kill"]
            kind = self.rng.choice(kinds)
            host = self.rng.choice(WORKER_HOSTS)
            fault = {"kind": kind, "host": host, "run": run.run_id, "start": time.time()}
            try:
                fault.update(self._do(run, kind, host))
            except Exception as error:  # noqa: BLE001 - recorded; the chaos goes on
                fault["error"] = f"{type(error).__name__}: {error}"
            fault["end"] = time.time()
            self.faults.append(fault)
            print(f"  fault {len(self.faults)}: {kind} host {host} "
                  f"{ {k: v for k, v in fault.items() if k not in ('kind', 'host', 'run', 'start', 'end')} }", flush=True)

    def _idle_workers(self, run: Any) -> list[str]:
        from workbench.run.launcher import present_workers

        return [a for a in present_workers(self.client) if a not in run.worker_addresses]

    def _do(self, run: Any, kind: str, host: int) -> dict[str, Any]:
        lab, rng = self.lab, self.rng
        if kind == "kill":
            on_host = [a for a in run.worker_addresses if lab.addresses[host] in a] or list(run.worker_addresses)
            victim = on_host[0]
            os.kill(self.client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
            return {"worker": victim}
        if kind == "join":
            return {"workers": run.add_workers()}
        held = rng.uniform(5, 25) if kind == "cut" else rng.uniform(20, 60)
        if kind == "cut":
            lab.set_link(host, up=False)
            held = self._hold(run, held)
            lab.set_link(host, up=True)
            return {"held_s": held}
        if kind == "rate":
            rate = rng.choice(["100mbit", "20mbit"])
            lab.set_rate(rate, host)
            held = self._hold(run, held)
            lab.set_rate(None, host)
            return {"rate": rate, "held_s": held}
        lab.set_cpu(host, 0.5)
        held = self._hold(run, held)
        lab.set_cpu(host, None)
        return {"cpu": 0.5, "held_s": held}

    def _hold(self, run: Any, seconds: float) -> float:
        """Keep a condition for `seconds`, or until the run ends or the chaos stops; returns how long."""
        began = time.monotonic()
        while time.monotonic() - began < seconds and not run.done and not self.stop.wait(0.2):
            pass
        return time.monotonic() - began


# --- runs ----------------------------------------------------------------------------------------------------


def train_one(client: Any, scratch: Path, steps: int, seed: int, injector: Injector | None,
              timeout_s: float) -> dict[str, Any]:
    import workbench
    from fidelity import MODEL, job_fields, text_data
    from workbench.plane.rundir import read_metrics

    job = workbench.Job(model=workbench.gpt(MODEL), data=text_data(), **job_fields(steps, seed))
    run = workbench.train(job, "auto", client=client, run_dir=scratch / "runs", checkpoint_every_s=None,
                          checkpoint_every_steps=CHECKPOINT_EVERY, auto_join=True)
    if injector is not None:
        injector.current = run
    began = time.time()
    try:
        status = run.wait(timeout=timeout_s)
    except Exception as error:  # noqa: BLE001 - over its time or failed: recorded
        status = f"{type(error).__name__}: {str(error)[:300]}"
        with contextlib.suppress(Exception):  # a failed run has ended already
            run.stop()
            run.wait(timeout=300)
    finally:
        if injector is not None:
            injector.current = None
    kept = [r for r in read_metrics(run.directory.path) if r.get("kind") == "step"]
    seen = run.table.steps().to_dict("records")
    group_starts = [e["time"] for e in run.events("generation-started")]
    finals = [e for e in run.events("eval") if e.get("final")]
    return {"run_id": run.run_id, "status": status, "seconds": time.time() - began,
            "final_loss": finals[-1]["loss"] if finals else None,
            "records_lost": records_missing(kept, group_starts) + abs(len(seen) - len(kept)),
            "step_records": len(kept), "regroups": run.events("regrouped"),
            "recoveries": [{k: e.get(k) for k in ("lost", "phases_s", "total_s")} for e in run.events("recovered")],
            "auto": [{k: e.get(k) for k in ("step", "to", "settings", "reason")} for e in run.events("auto-decision")],
            "checkpoints": [{k: e.get(k) for k in ("time", "step")} for e in run.events("checkpoint")],
            "deadlines": [{k: e.get(k) for k in ("time", "timeout_s", "how")} for e in run.events("deadline")],
            "_steps": sorted(seen, key=lambda r: r["time"])}


def raw_steps(records: list[dict[str, Any]]) -> list[list[float]]:
    """[time, worker, step] of every step record: what the time lost is computed from, kept in the file."""
    return [[round(r["time"], 4), r["worker"], r["step"]] for r in records]


def time_lost(faults: list[dict[str, Any]], runs: list[dict[str, Any]]) -> None:
    """Each fault's `lost_s`, from the run it hit (in place)."""
    by_id = {r["run_id"]: r for r in runs}
    for index, fault in enumerate(faults):
        run = by_id.get(fault["run"])
        if run is None or not run["_steps"]:
            continue
        times = [r["time"] for r in run["_steps"]]
        following = [f["start"] for f in faults[index + 1:] if f["run"] == fault["run"]]
        horizon = min(following + [fault["end"] + 120.0])
        pause = max(0.0, pause_over(times, fault["start"], horizon) - median_pause(times))
        per_worker_step = median_pause(times) * max(1, len({r["worker"] for r in run["_steps"]}))
        rewound = rewound_steps(run["regroups"], run["_steps"], fault["start"], horizon)
        fault.update(pause_s=pause, rewound_steps=rewound, lost_s=pause + rewound * per_worker_step)


RECOVERY_STRATEGIES = ("allreduce", "average", "async", "ssp", "easgd")
RECOVERY_TARGET_S = 2.0


def recovery_headline(cells: list[dict[str, Any]]) -> dict[str, Any]:
    totals = [c["total_s"] for c in cells if c.get("total_s") is not None]
    complete = bool(cells) and len(totals) == len(cells)
    headline = {"recovery_worst_s": max(totals) if totals else None,
                "recovery_median_s": statistics.median(totals) if totals else None,
                "recovery_target_met": complete and max(totals) <= RECOVERY_TARGET_S,
                # every recovery, repeats included; one without a `recovered` event (a run that never
                # regrouped) counts as over the target
                "recoveries": len(cells),
                "recoveries_over_target": len(cells) - sum(t <= RECOVERY_TARGET_S for t in totals)}
    # Which rank was lost may matter: checkpoints are taken on rank 0's worker, and the others keep the copy
    # the client sends them, so a loss during that sending meets a survivor without it.
    for killed in sorted({c["killed_rank"] for c in cells if "killed_rank" in c}):
        mine = [c["total_s"] for c in cells if c.get("killed_rank") == killed and c.get("total_s") is not None]
        headline[f"recovery_worst_s_{killed}_rank_killed"] = max(mine) if mine else None
    return headline


VICTIMS = {"last": -1, "first": 0}  # which rank's worker a --recovery run loses


def recover_once(client: Any, scratch: Path, strategy: str, steps: int, killed_rank: str) -> dict[str, Any]:
    """One run of `strategy`, its first or last rank's worker killed once the run has a checkpoint that every
    worker keeps (the client sends each to the others as it is written: the state a fault meets between
    checkpoints)."""
    import workbench
    from fidelity import MODEL, job_fields, text_data

    job = workbench.Job(model=workbench.gpt(MODEL), data=text_data(), **job_fields(steps, 0))
    run = workbench.train(job, strategy, client=client, run_dir=scratch / "runs", checkpoint_every_s=None,
                          checkpoint_every_steps=CHECKPOINT_EVERY // 2)
    deadline = time.monotonic() + 600
    def kept_everywhere() -> bool:
        info = run.checkpoint_info
        return info is not None and len(info.get("kept_on", ())) == len(run.worker_addresses)

    while not kept_everywhere() and not run.done and time.monotonic() < deadline:
        time.sleep(0.2)
    victim = run.worker_addresses[VICTIMS[killed_rank]]
    killed = time.time()
    os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
    try:
        status = run.wait(timeout=900)
    except Exception as error:  # noqa: BLE001 - recorded
        status = f"{type(error).__name__}: {str(error)[:300]}"
    recovered = run.events("recovered")
    cell = {"strategy": strategy, "status": status, "killed": killed, "victim": victim, "killed_rank": killed_rank,
            # where each rank of the group after the loss got its checkpoint: kept in memory, or sent
            "checkpoint": [e.get("checkpoint") for e in run.events("worker-started") if e.get("generation") == 1]}
    if recovered:
        cell.update(total_s=recovered[0]["total_s"], phases_s=recovered[0]["phases_s"])
    return cell


def recovery(arguments: argparse.Namespace, out: Path, document: dict[str, Any]) -> None:
    import workbench
    from testbed import lab as labs

    scratch = Path(tempfile.mkdtemp(prefix="workbench-recovery-"))
    cells: list[dict[str, Any]] = []

    began = time.time()

    def measure(place: str, client: Any, restore: Any) -> None:
        # Repeats round the whole set, not cell by cell: what changes over time on the machine falls on
        # every strategy alike.
        for repeat, strategy, killed_rank in itertools.product(range(arguments.repeats), RECOVERY_STRATEGIES, VICTIMS):
            restore()
            cell = {"place": place, "repeat": repeat,
                    **recover_once(client, scratch, strategy, arguments.recovery_steps, killed_rank)}
            cells.append(cell)
            print(f"{place:>12} {strategy:<10} {killed_rank:<5} #{repeat} {cell['status']}: recovered in "
                  f"{cell.get('total_s')} s {cell.get('phases_s')} checkpoint {cell['checkpoint']}", flush=True)
            document.update(recovery_headline(cells), cells=cells, minutes=(time.time() - began) / 60)
            out.write_text(json.dumps(document, indent=1, default=str) + "\n")

    with workbench.client_session(workers=2, dashboard_address=":0") as client:
        measure("embedded", client, lambda: client.wait_for_workers(2, timeout=120))
    with labs.Lab(hosts=1 + len(WORKER_HOSTS)) as lab:
        lab.start_cluster()
        client = lab.connect(workers=len(WORKER_HOSTS))
        lab.set_rate("100mbit")
        measure("lab-100mbit", client, lambda: lab.restore_workers(client, list(WORKER_HOSTS)))
    print(json.dumps(recovery_headline(cells)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="how long faults are injected (runs go on to their end)")
    parser.add_argument("--seed", type=int, default=0, help="the faults' random seed (recorded)")
    parser.add_argument("--steps", type=int, default=1024, help="steps per worker of every run")
    parser.add_argument("--mean-gap-s", type=float, default=40.0, help="mean seconds between two faults")
    parser.add_argument("--faults", default=",".join(FAULTS), help="the kinds of fault drawn from, comma-separated")
    parser.add_argument("--run-timeout-s", type=float, default=1800.0)
    parser.add_argument("--recovery", action="store_true", help="a lost worker's recovery under every strategy")
    parser.add_argument("--recovery-steps", type=int, default=192, help="steps per worker of each --recovery run")
    parser.add_argument("--repeats", type=int, default=1,
                        help="--recovery: how many times every strategy and rank is measured in each place")
    parser.add_argument("--out", default=None)
    arguments = parser.parse_args()
    from network import machine
    from testbed import lab as labs

    reason = labs.available()
    if reason:
        sys.exit(f"benchmarks/chaos.py needs the emulated-host lab: {reason}")
    name = "chaos-recovery.json" if arguments.recovery else "chaos.json"
    out = Path(arguments.out or resultfile.path_for(name.removesuffix(".json")))
    out.parent.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "benchmark": "chaos", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **resultfile.commit(), "machine": machine(),
        "settings": {"job": "fidelity's (gpt-mini on stdlib-text)", "steps": arguments.steps, "strategy": "auto",
                     "checkpoint_every_steps": CHECKPOINT_EVERY, "auto_join": True, "minutes": arguments.minutes,
                     "seed": arguments.seed, "mean_gap_s": arguments.mean_gap_s, "faults": arguments.faults,
                     "worker_hosts": len(WORKER_HOSTS)},
    }
    if arguments.recovery:
        document["settings"] = {"job": "fidelity's (gpt-mini on stdlib-text)", "steps": arguments.recovery_steps,
                                "strategies": RECOVERY_STRATEGIES, "checkpoint_every_steps": CHECKPOINT_EVERY // 2,
                                "killed": "the last rank's worker, then (another run) the first's, once every "
                                          "worker keeps a checkpoint",
                                "places": ["embedded: 2 local workers", "lab: 2 worker hosts, links at 100 Mbit/s"],
                                "target_s": RECOVERY_TARGET_S, "repeats": arguments.repeats}
        recovery(arguments, out, document)
        return
    scratch = Path(tempfile.mkdtemp(prefix="workbench-chaos-"))
    began = time.time()
    with labs.Lab(hosts=1 + len(WORKER_HOSTS)) as lab:
        lab.start_cluster()
        client = lab.connect(workers=len(WORKER_HOSTS))
        undisturbed = train_one(client, scratch, arguments.steps, 0, None, arguments.run_timeout_s)
        print(f"[{(time.time() - began) / 60:5.1f} min] undisturbed: {undisturbed['status']}, held-out loss "
              f"{undisturbed['final_loss']}, {undisturbed['seconds']:.0f} s", flush=True)
        kinds = tuple(arguments.faults.split(","))
        unknown = sorted(set(kinds) - set(FAULTS))
        if unknown:
            sys.exit(f"--faults: {', '.join(unknown)} not known; the kinds are {', '.join(FAULTS)}")
        injector = Injector(lab, client, arguments.seed, arguments.mean_gap_s, kinds)
        injector.thread.start()
        chaos_began, runs = time.time(), []
        while time.time() - chaos_began < arguments.minutes * 60:
            lab.restore_workers(client, list(WORKER_HOSTS))
            # Every run the undisturbed one's seed: the same start and data order, what differs is the faults.
            runs.append(train_one(client, scratch, arguments.steps, 0, injector, arguments.run_timeout_s))
            last = runs[-1]
            print(f"[{(time.time() - began) / 60:5.1f} min] run {len(runs)}: {last['status']}, held-out loss "
                  f"{last['final_loss']}, {len(last['regroups'])} regroups, records lost {last['records_lost']}",
                  flush=True)
        injector.stop.set()
        injector.thread.join(timeout=120)
        for host in WORKER_HOSTS:  # whatever the last fault left
            lab.set_link(host, up=True)
            lab.set_rate(None, host)
            lab.set_cpu(host, None)
    time_lost(injector.faults, runs)
    document.update(headline(undisturbed, runs, injector.faults), minutes_total=(time.time() - began) / 60,
                    undisturbed={k: v for k, v in undisturbed.items() if k != "_steps"},
                    runs=[{**{k: v for k, v in r.items() if k != "_steps"}, "steps": raw_steps(r["_steps"])}
                          for r in runs], faults=injector.faults)
    out.write_text(json.dumps(document, indent=1, default=str) + "\n")
    print(json.dumps({k: v for k, v in document.items()
                      if k not in ("runs", "faults", "machine", "settings", "undisturbed")}, default=str))


if __name__ == "__main__":
    main()
