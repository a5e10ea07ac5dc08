"""Training across emulated hosts on slow links and with a slow host: every strategy against PyTorch DDP.

Runs on the lab (`testbed/lab.py`: needs root, `ip` and `tc`): host 0 holds the scheduler and the
client, hosts 1 and 2 one `dask worker` each, started as a user would. The job is the throughput
benchmark's (MLP 784-1024-1024-10, 1.86M parameters, synthetic data, batch 128 per worker, SGD lr 0.01,
one thread per process). Conditions: the link of every host unlimited, 1 Gbit/s, 100 Mbit/s and 20
Mbit/s (`tbf` both ways, no added delay), and a straggler case (unlimited link, host 2 at half the CPU
of host 1). PyTorch DDP runs on the same two worker hosts (one process each, gloo with
GLOO_SOCKET_IFNAME=eth0, rank 0's address as MASTER_ADDR); the plain single-process loop runs alone on
host 1 for reference.

Every cell is time-boxed, not a fixed number of steps: the run starts on the full link, the condition's
rate is set once every worker has stepped, then a warm-up (at least one exchange cycle of every worker,
and `--warmup-steps` steps or `--warmup-s` seconds), then a window of `--window-s` seconds (longer
where needed to hold `--min-cycles` exchange cycles of every worker, at most `--max-window-s`), then `run.stop()`.
Throughput counts step records only (`window_steps`): per worker, the samples of the whole exchange
cycles that cover the window over their span, from its last step ending before the window to the first
ending after it a whole number of cycles later; the total is the sum over workers and the slowest
worker is reported beside it (with one parameter-server shard the worker beside it runs nearly alone
while the one across the link starves).
Once measured, a cell lifts the link limit before `run.stop()`, so the end of the run (final exchange,
weights and checkpoint) does not cost minutes at 20 Mbit/s. Repetitions interleave
(conditions and configurations in reverse order on every other repetition); tables show medians.

Then the time to a held-out accuracy target on `digits` with an MLP 64-1024-1024-10 (1.13M parameters,
batch 128 per worker, eval every 5 steps on worker 0) at 100 Mbit/s: PyTorch DDP and, per strategy, the
configuration with the highest median throughput at 100 Mbit/s in the grid (the first listed when the
grid did not run at that rate), each with its strategy's suggested SGD settings.

`auto` is a row of the grid too, judged against every fixed row: its warm-up lasts until it has settled
under the condition (`AutoSettled`: three windows judged in a row without a move), and its window then
measures what it settled on (moves inside the window count against it). Per condition, its median rate
over the best fixed row's median, the same ratio repeat by repeat (the spread), and what it chose
(`auto_vs_best_fixed`; headline: the worst condition's ratio). The catalog runs every row under the
straggler too (`--all-straggler`), so that auto meets the whole fixed set in every condition.

Configurations are a table of (name, strategy, settings); one whose settings this version of the
workbench rejects (a ConfigError naming a setting of the table) is skipped with a note, so the same
script measures options added later. The last line printed is one JSON object; the full result goes to
`benchmarks/results/<machine class>/network.json` (or `--out`) with its commit and the machine.

    python benchmarks/network.py [--repeats 2] [--window-s 8] [--rates unlimited,1gbit,100mbit,20mbit]
                                 [--only async] [--no-straggler] [--no-time-to-target] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

import resultfile

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results"
BATCH = 128
HIDDEN = (1024, 1024)
LR = 0.01
N_SAMPLES = 8192
RATES = ("unlimited", "1gbit", "100mbit", "20mbit")
STRAGGLER = "half-cpu"  # the straggler condition's column
STRAGGLER_HOST, STRAGGLER_SHARE, OTHER_SHARE = 2, 0.5, 1.0
TARGET_RATE = "100mbit"
TARGET_MODEL = (64, 10, HIDDEN)
EVAL_EVERY = 5
DDP_PORT = 29500

# (name, strategy, settings). Names say the settings ("p16": period or push_every 16, "fetch16":
# fetch_every 16, "diloco": the outer Nesterov optimizer over the averaged change, DiLoCo's 0.7 and 0.9).
# Rows with settings this version does not have are skipped; the parameter-server rows with compression
# compress the server's replies too where the version does.
CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("allreduce", "allreduce", {}),
    ("allreduce bf16", "allreduce", {"wire_dtype": "bf16"}),
    # Each step's global batch cut to the workers' measured speeds: for the slow host.
    ("allreduce balanced", "allreduce", {"balance": True}),
    ("average p16", "average", {"period": 16}),
    ("average p64", "average", {"period": 64}),
    ("average p16 bf16", "average", {"period": 16, "wire_dtype": "bf16"}),
    ("average p16 overlap", "average", {"period": 16, "overlap": True}),
    ("average p64 overlap bf16", "average", {"period": 64, "overlap": True, "wire_dtype": "bf16"}),
    ("average p64 overlap bf16 diloco", "average", {"period": 64, "overlap": True, "wire_dtype": "bf16",
                                                     "outer_lr": 0.7, "outer_momentum": 0.9}),
    ("async p4", "async", {"push_every": 4}),
    ("async topk1% p4", "async", {"push_every": 4, "compression": "topk", "topk_ratio": 0.01}),
    ("async topk1% p4 fetch16", "async", {"push_every": 4, "fetch_every": 16, "compression": "topk",
                                          "topk_ratio": 0.01}),
    ("ssp p4", "ssp", {"push_every": 4}),
    ("easgd p16", "easgd", {"period": 16}),
    # Not fixed: it measures, chooses among the rows above and switches as the condition changes. Judged
    # against the best of the fixed rows in each condition (`auto_against_fixed`), on its settled speed.
    ("auto", "auto", {}),
]
QUICK_CONFIGS = ("allreduce", "average p16", "async p4", "async topk1% p4", "ssp p4", "easgd p16", "auto")
AUTO = "auto"
AUTO_SETTLED_WINDOWS = 3  # windows judged in a row under the condition, none moving, before auto is measured


# --- the processes on the worker hosts (plain loop, PyTorch DDP) --------------------------------------------


def _benchmark_model() -> torch.nn.Module:
    import workbench

    return workbench.mlp(784, 10, HIDDEN)()


def _standalone(spec: dict[str, Any]) -> None:
    """Entry point of a process spawned on a lab host: the plain loop, or one DDP rank (throughput or
    time to target). Writes its result as JSON to spec['out']."""
    torch.set_num_threads(1)
    if spec["mode"] == "plain":
        result = _plain_loop(spec)
    else:
        import torch.distributed as dist

        # A DDP user on several hosts sets these (torchrun does the same): rank 0's address and port, and
        # the interface gloo binds (else it takes the address the hostname resolves to).
        dist.init_process_group("gloo", init_method="env://", rank=spec["rank"], world_size=spec["world_size"],
                                timeout=datetime.timedelta(seconds=120))
        try:
            if spec["mode"] == "ddp-target":
                result = _ddp_to_target(spec)
            else:
                _serve_ddp_windows(spec)
                return
        finally:
            dist.destroy_process_group()
    Path(spec["out"]).write_text(json.dumps(result))


def _serve_ddp_windows(spec: dict[str, Any]) -> None:
    """Keep the DDP group (and the model) for the whole benchmark: measure one time-boxed window for
    every order file `orders/NNNN.json` the benchmark writes (a condition's link rate or CPU share is
    set from outside meanwhile), until an order says stop. Saves a process start per cell."""
    orders = Path(spec["orders"])
    state = _DDPState(spec["rank"], spec["world_size"])
    (orders / f"ready.{spec['rank']}").write_text("")
    number = 0
    idle_since = time.monotonic()
    while time.monotonic() - idle_since < spec["idle_timeout_s"]:
        path = orders / f"{number:04d}.json"
        if not path.exists():
            time.sleep(0.05)
            continue
        order = json.loads(path.read_text())
        if order.get("stop"):
            return
        result = _ddp_window(state, order)
        out, partial = Path(f"{order['out']}.{spec['rank']}"), Path(f"{order['out']}.{spec['rank']}.partial")
        partial.write_text(json.dumps(result))
        partial.rename(out)  # the benchmark never reads a half-written result
        number += 1
        idle_since = time.monotonic()


def _plain_loop(spec: dict[str, Any]) -> dict[str, Any]:
    from workbench.data import synthetic

    torch.manual_seed(0)
    data = synthetic(n_samples=N_SAMPLES, n_features=784).train.load()
    model = _benchmark_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    order = torch.randperm(len(data))
    n_batches = len(data) // BATCH
    if "barrier" in spec:
        return _side_by_side(spec, model, optimizer, data, order, n_batches)
    first = time.perf_counter()
    step, started, start_step = 0, None, 0
    while True:
        i = step % n_batches
        _train_step(model, optimizer, *data.batch(order[i * BATCH:(i + 1) * BATCH]))
        step += 1
        now = time.perf_counter()
        if started is None and (step >= spec["warmup_steps"] or now - first >= spec["warmup_s"]):
            started, start_step = now, step
        elif started is not None and now - started >= spec["window_s"]:
            return {"samples_per_s": (step - start_step) * BATCH / (now - started), "steps": step - start_step}


SIDE_BY_SIDE_WARM_STEPS = 3  # steps before a process says it is ready: its first ones allocate and warm up


def _side_by_side(spec: dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: Any,
                  order: torch.Tensor, n_batches: int) -> dict[str, Any]:
    """The plain loop over one wall-clock window shared with `processes` such processes: each trains a
    few steps, writes `{barrier}-ready-{rank}` (its epoch seconds) and trains on until every process has
    written one; the window opens 1 s after the last was ready and lasts `window_s`, the same for all,
    and the steps that end inside it are counted. Steps are short (20-80 ms), so the window's edges cost
    a step each. Waiting for the others rather than a fixed start: loading data and importing torch in
    four processes on two cores took longer than 6 s on a loaded lab."""
    from workbench.plane.rundir import atomic_write

    ready = Path(f"{spec['barrier']}-ready-{spec['rank']}")
    deadline = time.time() + spec["ready_timeout_s"]
    step, counted, first, last, window = 0, 0, None, None, None
    while True:
        i = step % n_batches
        _train_step(model, optimizer, *data.batch(order[i * BATCH:(i + 1) * BATCH]))
        step += 1
        now = time.time()
        if window is None:
            if step == SIDE_BY_SIDE_WARM_STEPS:
                # The others poll for it: atomic, never seen half written.
                atomic_write(ready, lambda handle: handle.write(str(now).encode()))
            if step >= SIDE_BY_SIDE_WARM_STEPS:
                window = _window_once_ready(spec, now, deadline)
            continue
        if now >= window[1]:
            break
        if now >= window[0]:
            first = now if first is None else first
            counted, last = counted + 1, now
    if first is None or counted < 2:
        raise RuntimeError(f"the window {window[0]:.3f}-{window[1]:.3f} saw {counted} steps")
    return {"samples_per_s": (counted - 1) * BATCH / (last - first), "steps": counted}


def _window_once_ready(spec: dict[str, Any], now: float, deadline: float) -> tuple[float, float] | None:
    """The shared window (start, stop) once every process wrote its ready file, else None."""
    files = [Path(f"{spec['barrier']}-ready-{rank}") for rank in range(spec["processes"])]
    if not all(f.exists() for f in files):
        if now > deadline:
            raise RuntimeError(f"{sum(f.exists() for f in files)} of {spec['processes']} processes were ready "
                               f"after {spec['ready_timeout_s']} s")
        return None
    start = max(float(f.read_text()) for f in files) + 1.0
    return start, start + spec["window_s"]


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
                targets: torch.Tensor) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


class _DDPState:
    """One DDP rank's model, optimizer and data, kept from window to window."""

    def __init__(self, rank: int, world_size: int) -> None:
        from workbench.data import synthetic

        self.rank, self.world_size = rank, world_size
        torch.manual_seed(0)
        self.data = synthetic(n_samples=N_SAMPLES, n_features=784).train.load()
        self.model = torch.nn.parallel.DistributedDataParallel(_benchmark_model())
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.shard = torch.randperm(len(self.data))[rank::world_size]
        self.n_batches = len(self.shard) // BATCH
        self.step = 0

    def train_step(self) -> None:
        i = self.step % self.n_batches
        _train_step(self.model, self.optimizer, *self.data.batch(self.shard[i * BATCH:(i + 1) * BATCH]))
        self.step += 1


def _ddp_window(state: _DDPState, order: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    # Rank 0 decides the phase (0 warm-up, 1 measuring, 2 done) and broadcasts it after every step, so
    # both ranks measure the same steps: one 4-byte broadcast beside a 7.5 MB all-reduce.
    phase = torch.zeros(1)
    dist.barrier()
    first = time.perf_counter()
    steps, started, start_step = 0, None, 0
    while True:
        state.train_step()
        steps += 1
        if state.rank == 0:
            now = time.perf_counter()
            if started is None and (steps >= order["warmup_steps"] or now - first >= order["warmup_s"]):
                phase[0] = 1
            elif started is not None and now - started >= order["window_s"]:
                phase[0] = 2
        dist.broadcast(phase, 0)
        if phase[0] == 1 and started is None:
            started, start_step = time.perf_counter(), steps
        elif phase[0] == 2:
            elapsed = time.perf_counter() - started
            return {"samples_per_s": (steps - start_step) * BATCH / elapsed, "steps": steps - start_step,
                    "seconds": elapsed}


def _ddp_to_target(spec: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    import workbench
    from workbench.data import digits
    from workbench.evaluation import evaluate
    from workbench.sharding import batches, shard_indices

    rank, world_size = spec["rank"], spec["world_size"]
    torch.manual_seed(0)
    splits = digits()
    data, held_out = splits.train.load(), splits.eval.load()
    model = torch.nn.parallel.DistributedDataParallel(workbench.mlp(*TARGET_MODEL)())
    optimizer = torch.optim.SGD(model.parameters(), lr=spec["lr"], momentum=spec["momentum"])
    loss_fn = torch.nn.functional.cross_entropy
    reached = torch.zeros(2)  # [stop, step]
    evaluations = []
    dist.barrier()
    started, step, epoch = time.perf_counter(), 0, 0
    while True:
        for indices in batches(shard_indices(len(data), world_size, rank, epoch, 0), BATCH):
            _train_step(model, optimizer, *data.batch(indices))
            step += 1
            if step % EVAL_EVERY:
                continue
            if rank == 0:
                accuracy = evaluate(model.module, held_out, loss_fn)["accuracy"]
                elapsed = time.perf_counter() - started
                evaluations.append((round(elapsed, 3), step, accuracy))
                if accuracy >= spec["target"] or elapsed >= spec["max_s"]:
                    reached = torch.tensor([1.0, float(step)])
            dist.broadcast(reached, 0)  # stop together
            if reached[0]:
                hit = evaluations and evaluations[-1][2] >= spec["target"]
                return {"seconds": evaluations[-1][0] if hit else None, "steps": step, "evaluations": evaluations}
        epoch += 1


# --- measuring on the lab ------------------------------------------------------------------------------------


def spawn_and_wait(lab: Any, hosts: list[int], specs: list[dict[str, Any]], name: str,
                   timeout_s: float, env: dict[str, str] | None = None) -> list[dict[str, Any] | None]:
    """Run `_standalone(spec)` on each host, wait for all (killing them after `timeout_s`) and return
    their results (None for one that failed: its log is printed)."""
    processes = []
    for host, spec in zip(hosts, specs):
        argv = [sys.executable, str(HERE), "--standalone", json.dumps(spec)]
        processes.append((host, lab.spawn(host, argv, _log_name(name, spec), env=env)))
    deadline = time.monotonic() + timeout_s
    for host, process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for _, other in processes:
                _kill_group(other)
        lab.processes.remove((host, process))  # ended: never signalled again (its id may be reused)
    results = []
    for spec, (host, process) in zip(specs, processes):
        path = Path(spec["out"])
        if process.returncode == 0 and path.exists():
            results.append(json.loads(path.read_text()))
        else:
            print(f"  {name} on host {host} failed (exit {process.returncode}):\n"
                  f"{lab.tail(_log_name(name, spec))}", flush=True)
            results.append(None)
    return results


def _log_name(name: str, spec: dict[str, Any]) -> str:
    return f"{name}-{spec.get('rank', 0)}"


def _kill_group(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=10)


class Cells:
    """Runs the measurements of one lab: each returns a record (a dict) for the table."""

    def __init__(self, lab: Any, client: Any, arguments: argparse.Namespace, scratch: Path) -> None:
        self.lab, self.client, self.arguments, self.scratch = lab, client, arguments, scratch
        self.counter = 0
        self.condition = "unlimited"  # what the next cell measures under
        self.restarted: list[dict[str, Any]] = []  # workers started again after theirs was lost
        worker_hosts = [i for i in range(1, lab.size)]
        self.worker_hosts = worker_hosts
        self.workers: int | None = None  # how many of them a run trains on (None: all)
        self.host_of_address = {}
        for index, address in enumerate(lab.addresses):
            self.host_of_address[address] = index

    def _out(self, name: str) -> str:
        self.counter += 1
        return str(self.scratch / f"{self.counter:04d}-{name.replace(' ', '_').replace('%', 'pct')}.json")

    def _ddp_env(self) -> dict[str, str]:
        self.counter += 1
        return {"GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": self.lab.addresses[self.worker_hosts[0]],
                "MASTER_PORT": str(DDP_PORT + self.counter % 1000), "OMP_NUM_THREADS": "1"}

    def plain(self) -> dict[str, Any]:
        a = self.arguments
        spec = {"mode": "plain", "warmup_steps": a.warmup_steps, "warmup_s": a.warmup_s, "window_s": a.window_s,
                "out": self._out("plain")}
        [result] = spawn_and_wait(self.lab, [self.worker_hosts[0]], [spec], "plain", a.window_s + 120,
                                  {"OMP_NUM_THREADS": "1"})
        if result is None:
            return {"error": "the plain loop failed"}
        return {"samples_per_s": result["samples_per_s"], "steps": result["steps"]}

    def start_ddp(self) -> None:
        """The two DDP ranks, one on each worker host, kept for the whole grid (see _serve_ddp_windows)."""
        world_size = len(self.worker_hosts)
        self.orders = self.scratch / "ddp-orders"
        self.orders.mkdir()
        self.order_number = 0
        env = self._ddp_env()
        self.ddp_processes = []
        for rank, host in enumerate(self.worker_hosts):
            spec = {"mode": "ddp", "rank": rank, "world_size": world_size, "orders": str(self.orders),
                    "idle_timeout_s": 3600, "out": ""}
            argv = [sys.executable, str(HERE), "--standalone", json.dumps(spec)]
            self.ddp_processes.append((host, self.lab.spawn(host, argv, f"ddp-{rank}", env=env)))
        # Started (torch imported, the group formed) before anything is measured beside them.
        self._wait_for_ddp([self.orders / f"ready.{rank}" for rank in range(world_size)],
                           time.monotonic() + self.arguments.start_timeout_s)

    def stop_ddp(self) -> None:
        if not getattr(self, "ddp_processes", None):
            return
        self._order({"stop": True})
        for entry in self.ddp_processes:
            try:
                entry[1].wait(timeout=30)
            except subprocess.TimeoutExpired:
                _kill_group(entry[1])
            self.lab.processes.remove(entry)
        self.ddp_processes = []

    def _order(self, order: dict[str, Any]) -> None:
        path = self.orders / f"{self.order_number:04d}.json"
        path.with_suffix(".tmp").write_text(json.dumps(order))
        path.with_suffix(".tmp").rename(path)
        self.order_number += 1

    def _wait_for_ddp(self, paths: list[Path], deadline: float) -> None:
        while not all(path.exists() for path in paths):
            for rank, (host, process) in enumerate(self.ddp_processes):
                if process.poll() is not None:
                    raise RuntimeError(f"the DDP rank on host {host} exited ({process.returncode}): "
                                       f"{self.lab.tail(f'ddp-{rank}')}")
            if time.monotonic() > deadline:
                raise RuntimeError("the DDP ranks did not report within their deadline")
            time.sleep(0.05)

    def ddp(self) -> dict[str, Any]:
        a = self.arguments
        out = self._out("ddp")
        self._order({"warmup_steps": a.warmup_steps, "warmup_s": a.warmup_s, "window_s": a.window_s, "out": out})
        paths = [Path(f"{out}.{rank}") for rank in range(len(self.worker_hosts))]
        self._wait_for_ddp(paths, time.monotonic() + a.start_timeout_s + a.warmup_s + a.window_s + 120)
        results = [json.loads(path.read_text()) for path in paths]
        per_worker = {rank: r["samples_per_s"] for rank, r in enumerate(results)}
        return {"samples_per_s": sum(per_worker.values()), "per_worker": per_worker,
                "slowest_worker_samples_per_s": min(per_worker.values()), "steps": results[0]["steps"],
                **ddp_bytes(len(results))}

    def workbench(self, strategy: str, settings: dict[str, Any]) -> dict[str, Any]:
        import workbench
        from workbench.plane.metrics import communication_summary, time_split

        job = lab_job()
        self.ensure_workers()
        began = time.time()
        # Started on the full link (the first weights cross it at start-up: seconds at 20 Mbit/s that
        # measure nothing); the condition's rate is set once every worker has stepped, and the warm-up
        # runs under it.
        self.lab.set_rate(None)
        run = workbench.train(job, strategy, client=self.client, run_dir=self.scratch / "runs",
                              checkpoint_every_s=None, workers=self.workers, **settings)
        try:
            # auto's cycle is that of what it settles on, known once the warm-up has let it settle.
            window = self._time_box(run, None if strategy == AUTO else cycle_steps(strategy, settings))
            if "window" in window:
                self._wait_past(run, window["window"][1], window["cycle"])
        finally:
            stopping = time.time()
            self._finish(run)
        trouble = self._trouble(run)
        if "error" in window or trouble:
            return {"error": window.get("error") or trouble}
        overheads = {"start_s": window["window"][0] - began, "stop_s": time.time() - stopping}
        started, ended = window["window"]
        rates, inside = window_steps(run.metrics, started, ended, window["cycle"])
        record: dict[str, Any] = {"samples_per_s": sum(rates.values()), "per_worker": rates,
                                  "slowest_worker_samples_per_s": min(rates.values()) if rates else 0.0,
                                  "steps": {int(w): int(n) for w, n in inside.groupby("worker").size().items()},
                                  "span_s": {int(w): float(rows["time"].max() - started)
                                             for w, rows in inside.groupby("worker")},
                                  "time_split": time_split(inside), "hosts": self._hosts(run), **overheads}
        if "cpu_s" in inside:
            # Each worker process's CPU (every thread: training, Dask's comms, a shard it holds) in cores,
            # and its median compute per step: a worker slowed by a smaller share of the cores reads fewer
            # cores; one slowed inside its process (the GIL, its shard's work) more CPU per step.
            record["cpu_cores"] = {int(w): float(rows["cpu_s"].sum() / max(1e-9, rows["time"].max() - rows["time"].min()))
                                   for w, rows in inside.groupby("worker")}
            record["compute_ms"] = {int(w): 1e3 * float(rows["compute_s"].median()) for w, rows in inside.groupby("worker")}
        communication = communication_summary(inside)
        for key in ("bytes_sent_per_step", "bytes_received_per_step", "bytes_per_worker", "comm_hidden_fraction"):
            if key in communication:
                record[key] = communication[key]
        staleness = run.summary().get("staleness")
        if staleness:
            record["staleness_mean"] = staleness["mean"]
        link = window_link(inside, strategy)
        if link is not None:  # what the link alone allowed in the window, and the share of it reached
            record["link"] = link
        if strategy == AUTO:
            record["auto"] = auto_choices(run.events("auto-decision"), began, window)
        return record

    def _time_box(self, run: Any, cycle: int | None) -> dict[str, Any]:
        """Warm-up, then the window; returns {'window': (start, end)} in wall-clock seconds and the cycle.

        `cycle` None: the run is `auto`'s. Its warm-up lasts until it has settled under the condition
        (`AutoSettled`), at most --auto-settle-s; the cycle is then that of the strategy it settled on.

        A strategy that exchanges every `cycle` steps trains in bursts between exchanges; on a slow link
        one burst and wait can outlast the window. So the warm-up lasts at least two cycles (the first
        exchange under the condition, and the reply that records it, are behind it), and the window at
        least --min-cycles of every worker (a rate taken over a fraction of a cycle says more about where
        it fell than about the strategy), up to --max-window-s."""
        a = self.arguments
        workers = len(run.worker_addresses)
        deadline = time.monotonic() + a.start_timeout_s
        applied, at_apply, settled = None, {}, None
        while True:
            if run.done:
                return {"error": f"the run ended during warm-up ({run.status}): {run.error}"}
            latest = run.table.last_steps()
            if len(latest) == workers and applied is None:
                set_condition(self.lab, self.condition)
                applied, at_apply = time.monotonic(), {w: r["step"] for w, r in latest.items()}
                if cycle is None:
                    settled = AutoSettled(run.auto_pilot, AUTO_SETTLED_WINDOWS)
                    deadline = applied + a.auto_settle_s
            elif settled is not None:
                if settled():  # then the warm-up of what it settled on, as for a fixed configuration
                    cycle, settled = cycle_steps(run.strategy, run.settings), None
                    applied, at_apply = time.monotonic(), {w: r["step"] for w, r in latest.items()}
                    deadline = applied + a.start_timeout_s
                elif time.monotonic() > deadline:
                    return {"error": f"auto did not settle within {a.auto_settle_s:g} s"}
            elif applied is not None:
                done = min(latest[w]["step"] - at_apply[w] for w in at_apply)
                # Two exchanges under the condition: with overlap, the first one's reply (its staleness)
                # is recorded at the second. The first push across a slowed link can carry the catch-up
                # of the change: `ssp` p4 at 100 Mbit/s, 4 workers, its remote workers' first pushes
                # missed 9-11 versions (the shard's local worker ran to the bound meanwhile), every later
                # one 3; one such push in a window of 4-6 read a mean of 3.0-3.3 where the steady state is 2.25.
                if done > 2 * cycle and (done >= a.warmup_steps or time.monotonic() - applied >= a.warmup_s):
                    break
            if time.monotonic() > deadline:
                return {"error": f"the warm-up did not end within {a.start_timeout_s:g} s"}
            time.sleep(0.05)
        started = time.time()
        at_start = {w: r["step"] for w, r in run.table.last_steps().items()}
        while True:
            if run.done:
                return {"error": f"the run ended inside the window ({run.status}): {run.error}"}
            elapsed = time.time() - started
            latest = run.table.last_steps()
            cycles_done = all(latest[w]["step"] - at_start[w] >= a.min_cycles * cycle for w in at_start)
            if elapsed >= a.max_window_s or (elapsed >= a.window_s and cycles_done):
                return {"window": (started, time.time()), "cycle": cycle}
            time.sleep(0.05)

    def ensure_workers(self) -> None:
        """One Dask worker on every worker host before a cell (`Lab.restore_workers`), said so on stdout."""
        for entry in [e for e in self.lab.processes if e[1].poll() is not None]:
            self.lab.processes.remove(entry)  # ended: never signalled again (its id may be reused)
        for host in self.lab.restore_workers(self.client, self.worker_hosts, self.arguments.start_timeout_s):
            print(f"  the worker on host {host} was gone: a new one started (logs in {self.lab.logs})", flush=True)
            self.restarted.append({"host": host, "time": time.time()})

    def _trouble(self, run: Any) -> str | None:
        """Why a run's numbers do not count: it trained on fewer workers than there are worker hosts, or
        lost or regrouped workers (named with what the run recorded)."""
        events = [e for e in run.events() if e.get("kind") in ("worker-lost", "regrouped", "worker-failed")]
        expected = self.workers or len(self.worker_hosts)
        if len(run.worker_addresses) == expected and not events:
            return None
        told = "; ".join(f"{e['kind']}: {e.get('reason') or e.get('error') or e.get('address') or ''}"
                         for e in events)[:600]
        return f"the run had {len(run.worker_addresses)} of {expected} workers ({told or 'no events'})"

    def _wait_past(self, run: Any, moment: float, cycle: int = 1) -> None:
        """Until every worker has recorded a step that ended after `moment` (the window's end), and a
        whole cycle of steps after that one (`window_steps` may end its span up to a cycle later)."""
        deadline = time.monotonic() + self.arguments.start_timeout_s
        workers = len(run.worker_addresses)
        past: dict[int, int] = {}
        while time.monotonic() < deadline and not run.done:
            latest = run.table.last_steps()
            for worker, record in latest.items():
                if record["time"] >= moment:
                    past.setdefault(worker, record["step"])
            if len(past) == workers and all(latest[w]["step"] - past[w] >= cycle - 1 for w in past):
                return
            time.sleep(0.05)

    def _finish(self, run: Any) -> None:
        # Measured already: the end of the run (the final exchange, weights and checkpoint across the
        # link, 10-25 s at 20 Mbit/s) goes at the full rate. The next cell sets its condition again.
        self.lab.set_rate(None)
        run.stop()
        try:
            run.wait(timeout=120)
        except TimeoutError:
            run.interrupt(grace_s=10)
        except Exception as error:  # a failed run is reported by its record, not raised here
            print(f"  run {run.run_id} ended with: {str(error).splitlines()[0]}", flush=True)

    def _hosts(self, run: Any) -> dict[int, int]:
        """Rank -> lab host index (the parameter server's single shard sits beside rank 0)."""
        hosts = {}
        for event in run.events("worker-started"):
            ip = event.get("address", "").split("//")[-1].rsplit(":", 1)[0]
            if ip in self.host_of_address:
                hosts[int(event["worker"])] = self.host_of_address[ip]
        return hosts

    # --- time to target ------------------------------------------------------------------------------------

    def ddp_to_target(self, target: float, max_s: float) -> dict[str, Any]:
        from workbench.strategies import suggested_sgd

        world_size = len(self.worker_hosts)
        sgd = suggested_sgd("allreduce")
        specs = [{"mode": "ddp-target", "rank": rank, "world_size": world_size, "target": target, "max_s": max_s,
                  "out": self._out(f"ddp-target-{rank}"), **sgd} for rank in range(world_size)]
        results = spawn_and_wait(self.lab, self.worker_hosts, specs, "ddp-target", max_s + 180, self._ddp_env())
        if results[0] is None:
            return {"error": "DDP failed"}
        return {**results[0], **sgd}

    def workbench_to_target(self, strategy: str, settings: dict[str, Any], target: float,
                            max_s: float) -> dict[str, Any]:
        import workbench
        from workbench.strategies import suggested_sgd

        from workbench.run.autopilot import START

        sgd = suggested_sgd(START if strategy == AUTO else strategy)  # auto starts with START's
        self.ensure_workers()
        job = workbench.Job(model=workbench.mlp(*TARGET_MODEL), data="digits", batch_size=BATCH, epochs=100_000,
                            eval_every=EVAL_EVERY, seed=0, **sgd)
        run = workbench.train(job, strategy, client=self.client, run_dir=self.scratch / "runs",
                              checkpoint_every_s=None, **settings)
        hit, began = None, time.monotonic()
        try:
            while not run.done and time.monotonic() - began < max_s + self.arguments.start_timeout_s:
                evaluations = _evaluations(run)
                if not evaluations.empty and (evaluations["accuracy"] >= target).any():
                    hit = evaluations[evaluations["accuracy"] >= target].iloc[0]
                    break
                frame = run.metrics
                if not frame.empty and time.time() - frame["time"].min() > max_s:
                    break
                time.sleep(0.05)
        finally:
            self._finish(run)
        frame, evaluations = run.metrics, _evaluations(run)
        trouble = self._trouble(run)
        if trouble:
            return {"error": trouble, **sgd}
        if frame.empty:
            return {"error": f"no step was recorded ({run.status}: {run.error})", **sgd}
        first = frame.loc[frame["time"].idxmin()]
        # From the start of the first step (its record is written when it ends), as for DDP.
        origin = first["time"] - (first["compute_s"] + first["comm_s"] + first["wait_s"])
        trajectory = [(round(float(r["time"] - origin), 3), int(r["step"]), float(r["accuracy"]))
                      for _, r in evaluations.iterrows()] if not evaluations.empty else []
        return {"seconds": float(hit["time"] - origin) if hit is not None else None,
                "steps": int(hit["step"]) if hit is not None else None, "evaluations": trajectory, **sgd}


class AutoSettled:
    """A condition: `auto` has settled under the condition set when this was made. It has judged
    `windows` windows since then, as many since its last move, and holds no choice waiting to be
    confirmed. The first window can straddle the change, and a move begun on the old condition is not
    the answer to the new one (the lab test of auto waits the same way)."""

    def __init__(self, pilot: Any, windows: int) -> None:
        self.pilot, self.windows = pilot, windows
        self.decisions, self.since = pilot.decisions, pilot.judged

    def __call__(self) -> bool:
        if self.pilot.decisions != self.decisions:
            self.decisions, self.since = self.pilot.decisions, self.pilot.judged
        return self.pilot.judged - self.since >= self.windows and not self.pilot.chooser.pending


def auto_choices(decisions: list[dict[str, Any]], began: float, window: dict[str, Any]) -> dict[str, Any]:
    """What `auto` trained with in its cell's window, and the moves it made (seconds from the cell's start;
    `in_window`: moves inside the window, which its rate then includes)."""
    from workbench.run.autopilot import START

    started, ended = window["window"]
    before = [d for d in decisions if d["time"] < started]
    chose = (before[-1]["to"], before[-1].get("settings") or {}) if before else (START, {})
    return {"strategy": chose[0], "settings": chose[1], "name": config_name(*chose),
            "moves": [{"s": round(d["time"] - began, 1), "to": d["to"], "settings": d.get("settings") or {},
                       "reason": d.get("reason", "")[:200]} for d in decisions],
            "in_window": sum(started <= d["time"] <= ended for d in decisions)}


def config_name(strategy: str, settings: dict[str, Any]) -> str:
    """The name of the fixed row with these settings, else the strategy and its settings spelt out."""
    for name, fixed, values in CONFIGS:
        if fixed == strategy and values == settings:
            return name
    return " ".join([strategy] + [f"{k}={v}" for k, v in sorted(settings.items())])


def cycle_steps(strategy: str, settings: dict[str, Any]) -> int:
    """Steps between a worker's exchanges: its period, or the longer of push_every and fetch_every."""
    from workbench.strategies import make_settings

    values = make_settings(strategy, settings)
    push = getattr(values, "push_every", 1)
    fetch = getattr(values, "fetch_every", None) or push
    return max(1, getattr(values, "period", 1), push, fetch)


def ddp_bytes(world_size: int) -> dict[str, Any]:
    """Bytes each DDP rank sends (and receives) per step: a ring all-reduce of the float32 gradients.
    The workbench's strategies report their own."""
    from workbench.comm.averaging import all_reduce_bytes_sent

    parameters = sum(p.numel() for p in _benchmark_model().parameters())
    per_step = all_reduce_bytes_sent(parameters * 4, world_size)
    return {"bytes_sent_per_step": per_step, "bytes_received_per_step": per_step, "bytes_estimated": True}


def _evaluations(run: Any) -> Any:
    evaluations = run.evaluations
    return evaluations() if callable(evaluations) else evaluations


def window_steps(frame: Any, started: float, ended: float, cycle: int = 1) -> tuple[dict[int, float], Any]:
    """Each worker's samples/s over the window [started, ended], from its step records only, and the
    records counted. A worker's span runs from its last step ending at or before `started` to the first
    step ending at or after `ended` a whole number of `cycle`s of steps later (its last one when the run
    stopped first): whole exchange cycles covering the window. A worker that trains in bursts between long
    waits (a parameter-server exchange or an averaging sync across a slow link) is then charged for exactly
    as many waits as bursts, wherever the window's ends fell; with whole steps only, a span could end
    just after a burst or just after a wait, and a rate over 2-3 cycles moved by up to a quarter with
    where they fell (measured: `average` p16's two workers 2,017 and 1,755 samples/s in one window).
    Its samples/s are the samples of the steps after the first over that span."""
    from workbench.plane.metrics import throughput

    rates: dict[int, float] = {}
    counted_rows = []
    for worker, rows in frame.sort_values("time").groupby("worker"):
        times = rows["time"]
        before = rows[times <= started]
        first = before.iloc[-1] if len(before) else rows.iloc[0]
        after = rows[(times >= ended) & ((rows["step"] - first["step"]) % cycle == 0)]
        origin = first["time"]
        until = after["time"].iloc[0] if len(after) else times.iloc[-1]
        span = rows[(times >= origin) & (times <= until)]
        counted_rows.append(span[span["time"] > origin])
        # The samples of the steps after the first over the span: metrics.throughput's own rule.
        rates[int(worker)] = next(iter(throughput(span.to_dict("records"))["per_worker"].values()), 0.0)
    return rates, (pd.concat(counted_rows) if counted_rows else frame.iloc[:0])


def lab_job() -> Any:
    """The job every lab cell trains: MLP 784-1024-1024-10 on synthetic data, batch 128, plain SGD, no end.
    The training split only: no held-out evaluations on worker 0 inside a window."""
    import workbench
    from workbench.data import synthetic

    data = synthetic(n_samples=N_SAMPLES, n_features=784).train
    return workbench.Job(model=workbench.mlp(784, 10, HIDDEN), data=data, batch_size=BATCH, steps=10**7, lr=LR)


def window_link(inside: Any, strategy: str) -> dict[str, Any] | None:
    """The link's limit over a window's step records, read as the run reads it (`plane/link.py`)."""
    from workbench.plane.link import LinkBook
    from workbench.run.views import paced_by_slowest

    book = LinkBook()
    for record in inside.sort_values("time").to_dict("records"):
        book.add(record)
    limit = book.limit(paced_by_slowest(strategy))
    return None if limit is None else {key: limit[key] for key in (
        "link_mb_per_s", "bytes_per_step", "link_samples_per_s", "compute_samples_per_s", "share_of_link", "bound")}


def window_staleness(frame: Any, started: float, inside: Any) -> float | None:
    """Mean staleness of the pushes answered in the window, every worker's over one interval: from
    `started` to the last of the workers' spans (`inside`, from `window_steps`). Each worker's own span
    would weigh pushes unevenly: behind a slow link a worker pushes rarely, each push missing many
    versions, and its whole-cycle span runs seconds past the fast workers'; their pushes in those seconds
    would be left out (and over one interval that tiles every worker's pushes, the push-weighted mean of
    `async` is the workers less one, whatever their rates)."""
    if "staleness" not in frame or not len(inside):
        return None
    rows = frame[(frame["time"] > started) & (frame["time"] <= inside["time"].max())]
    values = rows["staleness"].dropna()
    return float(values.mean()) if len(values) else None


# --- conditions, repetitions, the table -----------------------------------------------------------------------


def set_condition(lab: Any, condition: str) -> None:
    if condition == STRAGGLER:
        lab.set_rate(None)
        lab.set_cpu(1, OTHER_SHARE)
        lab.set_cpu(STRAGGLER_HOST, STRAGGLER_SHARE)
    else:
        for host in range(1, lab.size):
            lab.set_cpu(host, None)
        lab.set_rate(None if condition == "unlimited" else condition)


def runnable_configs(only: str | None, quick: bool) -> tuple[list[tuple[str, str, dict[str, Any]]], list[str]]:
    """The table's configurations this version accepts, and a note for each one it does not."""
    from workbench.errors import ConfigError
    from workbench.strategies import make_settings

    chosen, skipped = [], []
    for name, strategy, settings in CONFIGS:
        if only and not any(word in name for word in only.split(",")):
            continue
        if quick and not only and name not in QUICK_CONFIGS:
            continue
        if strategy == AUTO:  # takes no settings; train() says so if that changes
            chosen.append((name, strategy, settings))
            continue
        try:
            make_settings(strategy, settings)
        except ConfigError as error:
            if error.parameter not in settings:
                raise  # a mistake in the table itself, not a setting this version lacks
            skipped.append(f"{name}: skipped, this version rejects {error.parameter}= ({error})")
            continue
        chosen.append((name, strategy, settings))
    return chosen, skipped


def cpu_steal() -> tuple[float, float]:
    """(steal, total) jiffies of the machine so far, from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [float(v) for v in stat.readline().split()[1:]]
    return (fields[7] if len(fields) > 7 else 0.0), sum(fields)


def measured(cell: Any, **context: Any) -> dict[str, Any]:
    load_before, (steal_0, total_0) = os.getloadavg(), cpu_steal()
    began = time.time()
    try:
        record = cell()
    except Exception as error:  # one broken cell must not lose the others
        record = {"error": f"{type(error).__name__}: {error}"}
    steal_1, total_1 = cpu_steal()
    return {**context, **record, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "steal": (steal_1 - steal_0) / max(1.0, total_1 - total_0),
            "cell_s": round(time.time() - began, 1)}


def median_of(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None and "error" not in r]
    return statistics.median(values) if values else None


def build_table(cells: list[dict[str, Any]], names: list[str], conditions: list[str]) -> dict[str, Any]:
    """Per configuration and condition: medians, the runs, and ratios to the configuration's own
    unlimited-link median (total and slowest worker) and to DDP's median in the same condition."""
    table: dict[str, Any] = {}
    for name in names:
        row: dict[str, Any] = {}
        for condition in conditions:
            records = [c for c in cells if c["config"] == name and c["condition"] == condition]
            if not records:
                continue
            entry: dict[str, Any] = {
                "samples_per_s": median_of(records, "samples_per_s"),
                "slowest_worker_samples_per_s": median_of(records, "slowest_worker_samples_per_s"),
                "runs": [round(r["samples_per_s"]) if "error" not in r else None for r in records],
                "slowest_runs": [round(r["slowest_worker_samples_per_s"]) if "error" not in r and
                                 r.get("slowest_worker_samples_per_s") is not None else None for r in records],
                "loadavg_1min": [round(r["loadavg_before"][0], 2) for r in records],
                "errors": [r["error"] for r in records if "error" in r]}
            for key in ("bytes_sent_per_step", "bytes_received_per_step", "comm_hidden_fraction", "staleness_mean"):
                value = median_of(records, key)
                if value is not None:
                    entry[key] = value
            per_worker = [r["per_worker"] for r in records if "per_worker" in r]
            if per_worker:
                entry["per_worker"] = {str(w): statistics.median(p[w] for p in per_worker if w in p)
                                       for w in sorted({w for p in per_worker for w in p})}
            hosts = [r["hosts"] for r in records if r.get("hosts")]
            if hosts:
                entry["host_of_rank"] = {str(k): v for k, v in hosts[-1].items()}
            if not entry["errors"]:
                del entry["errors"]
            row[condition] = entry
        base = row.get("unlimited", {})
        for condition, entry in row.items():
            if base.get("samples_per_s") and entry.get("samples_per_s") is not None:
                entry["vs_unlimited"] = entry["samples_per_s"] / base["samples_per_s"]
            if base.get("slowest_worker_samples_per_s") and entry.get("slowest_worker_samples_per_s") is not None:
                entry["slowest_vs_unlimited"] = entry["slowest_worker_samples_per_s"] / base["slowest_worker_samples_per_s"]
        table[name] = row
    for name, row in table.items():
        for condition, entry in row.items():
            ddp = table.get("ddp", {}).get(condition, {}).get("samples_per_s")
            if ddp and entry.get("samples_per_s") is not None and name != "ddp":
                entry["vs_ddp"] = entry["samples_per_s"] / ddp
    return table


def headline(table: dict[str, Any], names: list[str], time_to_target: dict[str, Any]) -> dict[str, Any]:
    """The keys the issue asks for, from the table (None where the cells needed did not run)."""
    result: dict[str, Any] = {}
    at = lambda name, key: table.get(name, {}).get(TARGET_RATE, {}).get(key)  # noqa: E731
    candidates = [n for n in names if at(n, "samples_per_s") is not None and at(n, "vs_unlimited") is not None]
    if candidates:
        best = max(candidates, key=lambda n: at(n, "samples_per_s"))
        result.update(best_config_100mbit=best, best_retention_100mbit=at(best, "vs_unlimited"),
                      best_slowest_retention_100mbit=at(best, "slowest_vs_unlimited"),
                      best_vs_ddp_100mbit=at(best, "vs_ddp"),
                      best_samples_per_s_100mbit=at(best, "samples_per_s"),
                      max_retention_100mbit=max(at(n, "vs_unlimited") for n in candidates))
        balanced = max(candidates, key=lambda n: at(n, "slowest_worker_samples_per_s") or 0.0)
        result.update(best_slowest_config_100mbit=balanced,
                      best_slowest_vs_ddp_slowest_100mbit=(at(balanced, "slowest_worker_samples_per_s") /
                                                           at("ddp", "slowest_worker_samples_per_s"))
                      if at("ddp", "slowest_worker_samples_per_s") else None)
        topk = [n for n in candidates if "topk" in n and n.startswith("async")]
        if topk:
            best_topk = max(topk, key=lambda n: at(n, "vs_unlimited"))
            result.update(topk_config_100mbit=best_topk, topk_retention_100mbit=at(best_topk, "vs_unlimited"),
                          topk_slowest_retention_100mbit=at(best_topk, "slowest_vs_unlimited"))
    result["ddp_samples_per_s_100mbit"] = at("ddp", "samples_per_s")
    ddp_seconds = time_to_target.get("ddp", {}).get("seconds")
    reached = {n: r["seconds"] for n, r in time_to_target.items() if n != "ddp" and r.get("seconds") is not None}
    if reached:
        fastest = min(reached, key=reached.get)
        result.update(best_time_to_target_config=fastest, best_time_to_target_s=reached[fastest])
        if ddp_seconds:
            result["best_time_to_target_vs_ddp_100mbit"] = reached[fastest] / ddp_seconds
    result["ddp_time_to_target_s"] = ddp_seconds
    return result


def auto_against_fixed(table: dict[str, Any], cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Per condition: `auto`'s median rate over that of the best fixed configuration there (the highest
    median of every fixed row measured in the condition), the same ratio repeat by repeat (its spread),
    and what auto settled on. Headline: the worst condition's median ratio."""
    per_condition: dict[str, Any] = {}
    for condition, entry in table.get(AUTO, {}).items():
        fixed = {name: row[condition]["samples_per_s"] for name, row in table.items()
                 if name not in (AUTO, "ddp") and row.get(condition, {}).get("samples_per_s") is not None}
        if not fixed or entry.get("samples_per_s") is None:
            continue
        best = max(fixed, key=fixed.get)
        rate = lambda name, repeat: next((c["samples_per_s"] for c in cells  # noqa: E731
                                          if c["config"] == name and c["condition"] == condition
                                          and c["repeat"] == repeat and "error" not in c), None)
        repeats = sorted({c["repeat"] for c in cells if c["config"] == AUTO and c["condition"] == condition})
        ratios = [rate(AUTO, r) / rate(best, r) for r in repeats if rate(AUTO, r) and rate(best, r)]
        chose = [c["auto"]["name"] for c in cells if c["config"] == AUTO and c["condition"] == condition
                 and "auto" in c]
        per_condition[condition] = {
            "best_fixed": best, "best_fixed_samples_per_s": fixed[best], "auto_samples_per_s": entry["samples_per_s"],
            "vs_best_fixed": entry["samples_per_s"] / fixed[best],
            "per_repeat": ratios, "spread": [min(ratios), max(ratios)] if ratios else None,
            "rank": 1 + sum(v > entry["samples_per_s"] for v in fixed.values()), "of": len(fixed), "chose": chose}
    result: dict[str, Any] = {"auto_vs_best_fixed": per_condition}
    if per_condition:
        worst = min(per_condition, key=lambda c: per_condition[c]["vs_best_fixed"])
        result.update(auto_worst_vs_best_fixed=per_condition[worst]["vs_best_fixed"], auto_worst_condition=worst,
                      auto_median_vs_best_fixed=statistics.median(e["vs_best_fixed"] for e in per_condition.values()))
    return result


def auto_table(result: dict[str, Any]) -> str:
    """The page's table of auto against the best fixed configuration, condition by condition."""
    rows = result.get("auto_vs_best_fixed") or {}
    if not rows:
        return ""
    lines = ["`auto` against the best fixed configuration of the condition (medians; the spread is the ratio "
             "repeat by repeat; what auto settled on, each repeat):", "",
             "| condition | best fixed | samples/s | auto samples/s | auto vs best | spread | rank | auto chose |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for condition, e in rows.items():
        spread = "-" if not e["spread"] else f"{e['spread'][0]:.2f}-{e['spread'][1]:.2f}"
        lines.append(f"| {condition} | {e['best_fixed']} | {e['best_fixed_samples_per_s']:,.0f} | "
                     f"{e['auto_samples_per_s']:,.0f} | {e['vs_best_fixed']:.2f} | {spread} | "
                     f"{e['rank']} of {e['of'] + 1} | {', '.join(e['chose'])} |")
    return "\n".join(lines)


LAB_DESCRIPTION = ("shared VM; hosts are network namespaces on one bridge, links shaped by tbf (no added delay), "
                   "the slow host by a cgroup v1 CPU quota")


def machine() -> dict[str, Any]:
    """The machine, as every lab benchmark describes it (resultfile.machine with the lab's conditions)."""
    return resultfile.machine(LAB_DESCRIPTION)


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_table(table: dict[str, Any], conditions: list[str]) -> None:
    width = 33
    for title, key, ratio in (("total samples/s (x its unlimited)", "samples_per_s", "vs_unlimited"),
                              ("slowest worker samples/s (x its unlimited)", "slowest_worker_samples_per_s",
                               "slowest_vs_unlimited")):
        print(f"\n{title}, medians")
        print(f"{'configuration':<{width}}" + "".join(f"{c:>17}" for c in conditions))
        for name, row in table.items():
            cells = []
            for condition in conditions:
                entry = row.get(condition, {})
                value = entry.get(key)
                shown = _fmt(value) + (f" ({entry[ratio]:.2f})" if entry.get(ratio) is not None else "")
                cells.append(f"{shown:>17}")
            print(f"{name:<{width}}" + "".join(cells))
    print(f"\nat {TARGET_RATE}: {'vs DDP':>8}{'sent/step':>12}{'recv/step':>12}{'hidden':>8}{'staleness':>10}")
    for name, row in table.items():
        entry = row.get(TARGET_RATE, {})
        if not entry:
            continue
        kib = lambda k: f"{entry[k] / 1024:,.0f} KiB" if entry.get(k) is not None else "-"  # noqa: E731
        print(f"{name:<{width}}{_fmt(entry.get('vs_ddp'), 2):>8}{kib('bytes_sent_per_step'):>12}"
              f"{kib('bytes_received_per_step'):>12}"
              f"{(format(entry['comm_hidden_fraction'], '.0%') if entry.get('comm_hidden_fraction') is not None else '-'):>8}"
              f"{_fmt(entry.get('staleness_mean'), 2):>10}")


# --- main --------------------------------------------------------------------------------------------------------


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of the grid (interleaved)")
    parser.add_argument("--window-s", type=float, default=8.0, help="steady seconds measured per cell")
    parser.add_argument("--min-cycles", type=int, default=2, help="the window spans at least this many exchange "
                        "cycles of every worker")
    parser.add_argument("--max-window-s", type=float, default=40.0,
                        help="a window lasts at least --min-cycles exchange cycles of every worker, at most this long")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="warm-up ends after this long ...")
    parser.add_argument("--warmup-steps", type=int, default=10, help="... or when every worker did this many steps")
    parser.add_argument("--rates", default=",".join(RATES),
                        help=f"link rates, comma-separated, from {', '.join(RATES)} (or any tc rate, e.g. 50mbit)")
    parser.add_argument("--no-straggler", action="store_true", help=f"skip the '{STRAGGLER}' condition")
    parser.add_argument("--all-straggler", action="store_true",
                        help=f"every configuration under '{STRAGGLER}' (default: the first of each strategy)")
    parser.add_argument("--only", default=None, help="only the configurations whose name has one of these "
                                                     "comma-separated words (DDP and the plain loop always run)")
    parser.add_argument("--target", type=float, default=0.95, help="held-out accuracy target on digits")
    parser.add_argument("--target-max-s", type=float, default=150.0, help="give up on the target after this long")
    parser.add_argument("--target-repeats", type=int, default=1)
    parser.add_argument("--no-time-to-target", action="store_true")
    parser.add_argument("--start-timeout-s", type=float, default=90.0)
    parser.add_argument("--auto-settle-s", type=float, default=120.0,
                        help="auto's cell fails when it has not settled this long after its condition was set")
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/network.json; "
                                                    "--quick saves only where --out says)")
    parser.add_argument("--no-save", action="store_true", help="print only")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: 1 repeat, 2 s windows, "
                        "unlimited and 100mbit, a few configurations, a low target")
    parser.add_argument("--standalone", default=None, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.quick:
        defaults = {"repeats": 1, "window_s": 2.0, "warmup_s": 1.0, "warmup_steps": 3, "target": 0.8,
                    "target_max_s": 40.0}
        for key, value in defaults.items():
            if getattr(arguments, key) == parser.get_default(key):
                setattr(arguments, key, value)
        if arguments.rates == parser.get_default("rates"):
            arguments.rates = f"unlimited,{TARGET_RATE}"
    return arguments


def main() -> None:
    arguments = parse_arguments()
    if arguments.standalone is not None:
        _standalone(json.loads(arguments.standalone))
        return
    from testbed import lab as labs

    reason = labs.available()
    if reason:
        sys.exit(f"benchmarks/network.py needs the emulated-host lab: {reason}")
    rates = [r.strip() for r in arguments.rates.split(",") if r.strip()]
    for rate in rates:
        if rate != "unlimited":
            labs.rate_bytes_per_s(rate)  # a bad rate fails here, naming it
    conditions = rates + ([] if arguments.no_straggler else [STRAGGLER])
    configs, skipped = runnable_configs(arguments.only, arguments.quick)
    for note in skipped:
        print(note, flush=True)
    names = ["ddp"] + [name for name, _, _ in configs]
    # The straggler case asks how each strategy copes with a slow host: the first configuration listed
    # of each strategy (its plain form) is enough, unless --all-straggler.
    straggler_configs = {next(n for n, s, _ in configs if s == strategy) for strategy in {s for _, s, _ in configs}}
    print(f"{len(configs)} configurations + DDP under {', '.join(conditions)}; {arguments.repeats} repeats of "
          f"{arguments.window_s:g} s windows", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="workbench-network-"))
    cells: list[dict[str, Any]] = []
    plain: list[dict[str, Any]] = []
    time_to_target: dict[str, Any] = {}
    target_runs: list[dict[str, Any]] = []
    restarted: list[dict[str, Any]] = []
    lab_logs = None
    started = time.time()
    try:
        with labs.Lab(hosts=3) as lab:
            lab.start_cluster()
            client = lab.connect(workers=2)
            bench = Cells(lab, client, arguments, scratch)
            restarted, lab_logs = bench.restarted, str(lab.logs)  # the list fills as the cells go
            bench.start_ddp()
            for repeat in range(arguments.repeats):
                forward = repeat % 2 == 0
                set_condition(lab, "unlimited")
                plain.append(measured(bench.plain, repeat=repeat, config="plain", condition="unlimited"))
                print(f"repeat {repeat + 1}: plain loop {_fmt(plain[-1].get('samples_per_s'))} samples/s", flush=True)
                for condition in conditions if forward else conditions[::-1]:
                    order = [("ddp", "ddp", {})] + [c for c in configs if condition != STRAGGLER
                                                     or arguments.all_straggler or c[0] in straggler_configs]
                    for name, strategy, settings in order if forward else order[::-1]:
                        cell = bench.ddp if strategy == "ddp" else (
                            lambda s=strategy, k=settings: bench.workbench(s, k))
                        set_condition(lab, condition)
                        bench.condition = condition
                        record = measured(cell, repeat=repeat, config=name, condition=condition)
                        cells.append(record)
                        shown = record.get("error") or (
                            f"{record['samples_per_s']:,.0f} samples/s (slowest worker "
                            f"{record['slowest_worker_samples_per_s']:,.0f})")
                        overhead = (f", started in {record['start_s']:.1f} s, stopped in {record['stop_s']:.1f} s"
                                    if "start_s" in record else "")
                        print(f"repeat {repeat + 1} {condition:>9} {name:<32} {shown}  "
                              f"[load {record['loadavg_before'][0]:.1f}, {record['cell_s']:.0f} s{overhead}]",
                              flush=True)
            bench.stop_ddp()
            set_condition(lab, "unlimited")
            table = build_table(cells, names, conditions)
            if not arguments.no_time_to_target:
                time_to_target, target_runs = measure_time_to_target(lab, bench, configs, table, arguments)
            set_condition(lab, "unlimited")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    elapsed = time.time() - started
    table = build_table(cells, names, conditions)
    plain_median = median_of(plain, "samples_per_s")
    print(f"\nMLP 784-1024-1024-10, batch {BATCH}/worker, 2 worker hosts, {arguments.repeats} repeats of "
          f"{arguments.window_s:g} s (medians); plain loop alone on one host: {_fmt(plain_median)} samples/s")
    print_table(table, conditions)
    if time_to_target:
        print_time_to_target(time_to_target, arguments.target)
    result = headline(table, [n for n in names if n not in ("ddp", AUTO)], time_to_target)
    result.update(auto_against_fixed(table, cells))
    loads = [c["loadavg_before"][0] for c in cells]
    result.update(plain_samples_per_s=plain_median, minutes=round(elapsed / 60, 1),
                  loadavg_1min_median=statistics.median(loads) if loads else None,
                  skipped=[s.split(":")[0] for s in skipped])
    document = {**resultfile.document("network", {}, LAB_DESCRIPTION),
                "settings": {"repeats": arguments.repeats, "window_s": arguments.window_s,
                             "max_window_s": arguments.max_window_s, "warmup_s": arguments.warmup_s,
                             "warmup_steps": arguments.warmup_steps,
                             "conditions": conditions, "straggler": f"host {STRAGGLER_HOST} at {STRAGGLER_SHARE} core, "
                             f"host 1 at {OTHER_SHARE}, unlimited link", "batch_per_worker": BATCH, "lr": LR,
                             "model": "MLP 784-1024-1024-10", "target": arguments.target,
                             "target_task": "digits, MLP 64-1024-1024-10, eval every 5 steps on worker 0",
                             "target_rate": TARGET_RATE, "quick": arguments.quick},
                **result, "skipped_notes": skipped, "configs": {n: {"strategy": s, "settings": k} for n, s, k in configs},
                "workers_restarted": restarted, "lab_logs": lab_logs,
                "table": table, "time_to_target": time_to_target, "plain": plain, "cells": cells,
                "time_to_target_runs": target_runs}
    # A quick smoke run is kept only when told where (`python -m benchmarks run --suite quick` does).
    if not arguments.no_save and not (arguments.quick and arguments.out is None):
        path = Path(arguments.out or resultfile.path_for("network"))
        resultfile.write(path, _rounded(document))
        print(f"\nwritten to {path}")
    print(json.dumps(_rounded({k: v for k, v in result.items()})))


def measure_time_to_target(lab: Any, bench: Cells, configs: list[tuple[str, str, dict[str, Any]]],
                           table: dict[str, Any], arguments: argparse.Namespace) -> tuple[dict[str, Any], list]:
    """DDP and each strategy's best configuration at TARGET_RATE, to the held-out target."""
    chosen: dict[str, tuple[str, dict[str, Any], float | None]] = {}
    for name, strategy, settings in configs:
        rate = table.get(name, {}).get(TARGET_RATE, {}).get("samples_per_s")
        if strategy not in chosen:
            chosen[strategy] = (name, settings, rate)
        elif rate is not None and (chosen[strategy][2] is None or rate > chosen[strategy][2]):
            chosen[strategy] = (name, settings, rate)
    runs: list[dict[str, Any]] = []
    order = [("ddp", "ddp", {})] + [(name, strategy, settings) for strategy, (name, settings, _) in chosen.items()]
    for repeat in range(arguments.target_repeats):
        for name, strategy, settings in order if repeat % 2 == 0 else order[::-1]:
            if strategy == "ddp":
                cell = lambda: bench.ddp_to_target(arguments.target, arguments.target_max_s)  # noqa: E731
            else:
                cell = lambda s=strategy, k=settings: bench.workbench_to_target(  # noqa: E731
                    s, k, arguments.target, arguments.target_max_s)
            set_condition(lab, TARGET_RATE)
            record = measured(cell, repeat=repeat, config=name, condition=TARGET_RATE)
            runs.append(record)
            shown = record.get("error") or (f"{record['seconds']:.1f} s, {record['steps']} steps"
                                            if record.get("seconds") is not None else
                                            f"not reached in {arguments.target_max_s:g} s")
            print(f"to {arguments.target:.0%} at {TARGET_RATE}: {name:<32} {shown}  "
                  f"[load {record['loadavg_before'][0]:.1f}]", flush=True)
    summary: dict[str, Any] = {}
    for name, _, _ in order:
        records = [r for r in runs if r["config"] == name]
        seconds = [r["seconds"] for r in records if r.get("seconds") is not None]
        steps = [r["steps"] for r in records if r.get("seconds") is not None]
        summary[name] = {"seconds": statistics.median(seconds) if seconds else None,
                         "steps": statistics.median(steps) if steps else None,
                         "reached": f"{len(seconds)}/{len(records)}", "runs": [r.get("seconds") for r in records],
                         "lr": records[0].get("lr"), "momentum": records[0].get("momentum")}
    ddp = summary["ddp"]["seconds"]
    for entry in summary.values():
        entry["vs_ddp"] = entry["seconds"] / ddp if ddp and entry["seconds"] is not None else None
    return summary, runs


def print_time_to_target(summary: dict[str, Any], target: float) -> None:
    print(f"\ntime to {target:.0%} held-out accuracy on digits at {TARGET_RATE} (MLP 64-1024-1024-10, "
          f"batch {BATCH}/worker)")
    print(f"{'configuration':<33}{'seconds':>9}{'vs DDP':>8}{'steps':>7}{'reached':>9}")
    for name, entry in summary.items():
        print(f"{name:<33}{_fmt(entry['seconds'], 1):>9}{_fmt(entry['vs_ddp'], 2):>8}"
              f"{_fmt(entry['steps']):>7}{entry['reached']:>9}")


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {str(k): _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":
    main()
