"""The metrics plane at scale: N emulated workers send step-record batches through a real scheduler to a
real run's client and a dashboard hub; the scheduler's CPU, the delay to the client and records lost.

Issue 17, item 1. A real worker sends its step records with `log_event` on the run's topic about 4 times
a second (`MetricsSender`, flush every 0.25 s), over its own connection to the scheduler. Here a few
processes (`--emulators`) open one connection to the scheduler per emulated worker and send, on each, a
batch of `--steps-per-s / 4` records of the real shape every 0.25 s, the ticks of the workers spread
over the interval as independent workers' are. Each batch is a `log_event` message that asks no reply
(a worker's goes on its batched stream and asks none either).

On the other side:
- the run's client: the workbench's own `RunFeed` (run/feed.py) subscribed to the topic, so every record
  goes into the run's `MetricsTable` and is appended to the run directory's metrics file as it comes;
  the delay of a record is its arrival there against the time it was made (one machine, one clock);
- a dashboard: the dashboard's `Hub` (widgets/dashboard/hub.py) in a process of its own, following the
  run from its registration on the runs topic as the served dashboard does;
- the scheduler: `dask scheduler` in a process of its own, with the workbench's event-log length; its
  CPU is measured from the first batch to the last, the emulators', the client's and the hub's apart.

A record is lost when it was sent and is missing from the client's table, the run directory or the
hub's table after the last batch (a few seconds are allowed for the tail to arrive).

    python benchmarks/scale.py [--workers 64,256,1024] [--seconds 20] [--steps-per-s 8] [--group 1] [--out FILE]

`--group G` sends every G workers' batches as one `batches` message, what a relay of G workers sends the
scheduler (`workbench/plane/relay.py`; the relays' own work, on the workers' hosts, is not emulated).

The last line printed is one JSON object with `records_lost_<N>`, `median_delay_s_<N>`, `p99_delay_s_<N>`
and `scheduler_cores_<N>` for every N; the result file (`resultfile.path_for("scale")`, `scale-relayed` with
`--group` above 1, or `--out`) holds them with every row.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import cloudpickle

import resultfile

FLUSH_INTERVAL_S = 0.25  # MetricsSender's default: a worker's batches a second are 4
# What runs on the scheduler goes by value: the scheduler cannot import this script (imported as a module
# by the tests, not only run as __main__).
cloudpickle.register_pickle_by_value(sys.modules[__name__])
DRAIN_S = 15.0  # how long the tail of the records may take to arrive after the last batch was sent


def step_record(rank: int, step: int, made: float, samples: int = 32) -> dict[str, Any]:
    """A step record of the shape and size the training loop sends (worker/loop.py `_train_step`)."""
    return {"worker": rank, "step": step, "epoch": step // 1000, "time": made, "loss": 0.5 + (step % 7) * 0.01,
            "samples": samples, "compute_s": 0.011, "comm_s": 0.0021, "wait_s": 0.0003, "lr": 0.1,
            "strategy": "allreduce", "bytes_sent": 1_114_112}


# --- the emulators: each a process with many connections ------------------------------------------------

async def _emulate(address: str, topic_name: str, ranks: list[int], records_per_batch: int, start_at: float,
                   seconds: float, slow: frozenset[int] = frozenset(), group: int = 1) -> dict[int, int]:
    from distributed.comm import connect

    from workbench.plane import kinds

    # With `group` > 1, every `group` workers' batches reach the scheduler as one `batches` message, as a
    # relay in front of the scheduler would forward them: one connection and one message a tick per group,
    # each worker's batch made at its own phase of the interval before (its wait in the relay counts in
    # the delay).
    teams = [ranks[i:i + group] for i in range(0, len(ranks), group)]
    comms = [await connect(address) for _ in teams]
    sent = dict.fromkeys(ranks, 0)

    def batch(rank: int, step: int, made: float) -> dict[str, Any]:
        # A slow worker's steps carry a quarter of the samples: its samples/s is a quarter of the others'.
        records = [step_record(rank, step + i, made, 8 if rank in slow else 32) for i in range(records_per_batch)]
        sent[rank] += records_per_batch
        return {"kind": kinds.STEPS, "rank": rank, "records": records,
                "worker": f"tcp://10.0.{rank // 256}.{rank % 256}:40000"}

    async def team(members: list[int], comm: Any) -> None:
        # Independent workers (or relays) tick at their own phase within the interval.
        tick = start_at + (members[0] % 97) / 97 * FLUSH_INTERVAL_S
        step = 0
        while tick < start_at + seconds:
            await asyncio.sleep(max(0.0, tick - time.time()))
            now = time.time()
            if len(members) == 1:
                message = batch(members[0], step, now)
            else:
                made = [now - (1 + i) / len(members) * FLUSH_INTERVAL_S for i in range(len(members))]
                message = {"kind": kinds.BATCHES, "messages": [batch(r, step, t) for r, t in zip(members, made)]}
            await comm.write({"op": "log_event", "topic": topic_name, "reply": False, "msg": message})
            step += records_per_batch
            tick += FLUSH_INTERVAL_S

    await asyncio.gather(*(team(members, comm) for members, comm in zip(teams, comms)))
    for comm in comms:
        await comm.close()
    return sent


def emulate(address: str, topic_name: str, ranks: list[int], records_per_batch: int, start_at: float,
            seconds: float, results: Any, slow: frozenset[int] = frozenset(), group: int = 1) -> None:
    """One emulator process: `ranks` workers, a connection each (or each `group` of them); puts {rank:
    records sent} on `results`. `slow`: ranks whose steps carry a quarter of the samples (a straggler, for
    views of many workers)."""
    results.put(asyncio.run(_emulate(address, topic_name, ranks, records_per_batch, start_at, seconds, slow,
                                     group)))


# --- the dashboard's hub, in its own process ------------------------------------------------------------

def hub_process(address: str, run_id: str, ready: Any, expected: Any, results: Any) -> None:
    """The hub follows the run until told how many records were sent, then until it has them all or
    DRAIN_S more have passed (it lags the client a little: 2 of 1,536 once on CI when it was not let)."""
    from distributed import Client

    from widgets.dashboard.hub import Hub

    hub = Hub(Client(address), owns_client=True).start()
    ready.set()
    total = expected.get()
    deadline = time.monotonic() + DRAIN_S
    feed = hub.feed(run_id)
    while feed is not None and feed.table.steps_received < total and time.monotonic() < deadline:
        time.sleep(0.1)
    results.put({"steps": feed.table.steps_received if feed is not None else 0})
    hub.close()


# --- one measurement ------------------------------------------------------------------------------------

def start_scheduler(scratch: Path) -> tuple[subprocess.Popen, str]:
    """`dask scheduler` in its own process, with the event-log length the workbench sets."""
    from workbench.cluster.connection import TRAINING_CONFIG

    file = scratch / "scheduler.json"
    env = {**os.environ, "DASK_DISTRIBUTED__ADMIN__LOW_LEVEL_LOG_LENGTH":
           str(TRAINING_CONFIG["distributed.admin.low-level-log-length"])}
    process = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                "--port", "0", "--no-dashboard", "--scheduler-file", str(file)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if file.is_file():
            try:
                return process, json.loads(file.read_text())["address"]
            except (ValueError, KeyError):
                pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError("the scheduler did not start within 60 s")


def _subscribers(name: str, dask_scheduler: Any = None) -> int:
    topic = dask_scheduler._broker._topics.get(name)
    return len(topic.subscribers) if topic is not None else 0


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        try:
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def measure(workers: int, seconds: float, steps_per_s: float, emulators: int, scratch: Path,
            group: int = 1) -> dict[str, Any]:
    """N emulated workers for `seconds` (every `group` of them forwarded as one message); what the scheduler,
    the client and the hub made of it."""
    from distributed import Client

    from workbench.plane import kinds
    from workbench.run.feed import RunFeed, announce
    from workbench.plane.metrics import MetricsTable, messages_in, topic
    from workbench.plane.rundir import RunDirectory, read_metrics

    records_per_batch = max(1, round(steps_per_s * FLUSH_INTERVAL_S))
    run_id = f"scale-{workers}-{int(time.time())}"
    scheduler, address = start_scheduler(scratch)
    context = multiprocessing.get_context("spawn")
    processes: list[Any] = []
    client = None
    try:
        client = Client(address)
        directory = RunDirectory(scratch / run_id)
        feed = RunFeed(MetricsTable(max_steps=10_000_000))
        feed.open(client, run_id, directory)
        delays: list[float] = []
        received: set[tuple[int, int]] = set()

        def on_message(event: tuple[float, dict[str, Any]]) -> None:
            arrived = time.time()
            feed.on_message(event)
            for message in messages_in(event[1]):
                if message.get("kind") == kinds.STEPS:
                    for record in message["records"]:
                        delays.append(arrived - record["time"])
                        received.add((record["worker"], record["step"]))

        client.subscribe_topic(topic(run_id), on_message)
        hub_ready, hub_expected, hub_results = context.Event(), context.Queue(), context.Queue()
        hub = context.Process(target=hub_process, args=(address, run_id, hub_ready, hub_expected, hub_results))
        hub.start()
        processes.append(hub)
        if not hub_ready.wait(120):
            raise RuntimeError("the dashboard hub did not start within 120 s")
        # What a run announces as it starts: the hub follows it from here (RUNS_TOPIC).
        announce(client, {"kind": kinds.RUN_REGISTERED, "run_id": run_id, "status": "running",
                          "strategy": "allreduce", "workers": workers, "directory": str(scratch / run_id)})
        # The hub subscribes on its own thread, on hearing the registration: wait until the scheduler
        # counts both subscribers of the run's topic.
        deadline = time.monotonic() + 60
        while client.run_on_scheduler(_subscribers, topic(run_id)) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the dashboard hub did not follow the run within 60 s")
            time.sleep(0.1)

        results = context.Queue()
        start_at = time.time() + 3.0 + workers / 200  # every emulator connected by then
        groups = [list(range(workers))[i::emulators] for i in range(emulators)]
        for ranks in groups:
            process = context.Process(target=emulate, args=(address, topic(run_id), ranks, records_per_batch,
                                                            start_at, seconds, results, frozenset(), group))
            process.start()
            processes.append(process)
        own = os.getpid()
        time.sleep(max(0.0, start_at - time.time()))
        pids = {"scheduler": [scheduler.pid], "emulators": [p.pid for p in processes[1:]], "hub": [hub.pid],
                "client": [own]}
        before = {name: cpu_seconds(ids) for name, ids in pids.items()}
        began = time.monotonic()
        sent: dict[int, int] = {}
        for _ in groups:
            sent.update(results.get(timeout=seconds + 120))
        wall = time.monotonic() - began
        cores = {name: round((cpu_seconds(ids) - before[name]) / wall, 3) for name, ids in pids.items()}
        total = sum(sent.values())
        deadline = time.monotonic() + DRAIN_S
        while len(received) < total and time.monotonic() < deadline:
            time.sleep(0.1)
        drained_s = round(time.monotonic() - began - wall, 2)
        hub_expected.put(total)
        hub_steps = hub_results.get(timeout=60 + DRAIN_S)["steps"]
        directory.close()
        on_disk = {(r["worker"], r["step"]) for r in read_metrics(scratch / run_id) if r.get("kind") == kinds.STEP}
        delays.sort()
        return {"workers": workers, "group": group, "seconds": round(wall, 1),
                "batches_per_s": round(workers / FLUSH_INTERVAL_S),
                "messages_per_s": round(sum(-(-len(ranks) // group) for ranks in groups) / FLUSH_INTERVAL_S),
                "records_per_batch": records_per_batch, "records_sent": total,
                "records_lost": total - len(received), "records_lost_on_disk": total - len(on_disk),
                "records_lost_hub": total - hub_steps, "drain_s": drained_s,
                "median_delay_s": round(statistics.median(delays), 4) if delays else None,
                "p99_delay_s": round(delays[int(0.99 * (len(delays) - 1))], 4) if delays else None,
                "max_delay_s": round(delays[-1], 4) if delays else None,
                "cores": cores}
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        if client is not None:
            client.close()
        scheduler.terminate()
        try:
            scheduler.wait(timeout=20)
        except subprocess.TimeoutExpired:
            scheduler.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="64,256,1024", help="emulated workers, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--steps-per-s", type=float, default=8.0, help="each emulated worker's steps a second")
    parser.add_argument("--emulators", type=int, default=4, help="processes the emulated workers share")
    parser.add_argument("--group", type=int, default=1,
                        help="workers whose batches reach the scheduler as one message (1: each its own)")
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/scale.json, "
                                                  "scale-relayed.json with --group above 1)")
    arguments = parser.parse_args()
    if arguments.group < 1:
        parser.error(f"--group {arguments.group} is not allowed: expected 1 or more workers a message")
    counts = [int(n) for n in arguments.workers.split(",") if n]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for workers in counts:
            row = measure(workers, arguments.seconds, arguments.steps_per_s, arguments.emulators, Path(scratch),
                          arguments.group)
            rows.append(row)
            print(json.dumps(row), flush=True)
    name = "scale" if arguments.group == 1 else "scale-relayed"
    result = resultfile.document(name, {"workers": counts, "steps_per_s": arguments.steps_per_s,
                                        "seconds": arguments.seconds, "emulators": arguments.emulators,
                                        "group": arguments.group})
    result["rows"] = rows
    for row in rows:
        n = row["workers"]
        result[f"records_lost_{n}"] = max(row["records_lost"], row["records_lost_on_disk"], row["records_lost_hub"])
        result[f"median_delay_s_{n}"] = row["median_delay_s"]
        result[f"p99_delay_s_{n}"] = row["p99_delay_s"]
        result[f"scheduler_cores_{n}"] = row["cores"]["scheduler"]
    resultfile.write(arguments.out or resultfile.path_for(name), result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "machine", "settings")}))


if __name__ == "__main__":
    main()
