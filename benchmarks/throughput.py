"""Throughput of the workbench against a plain PyTorch loop and PyTorch DDP, measured side by side.

Same model (MLP 784-1024-1024-10), same synthetic data, same per-worker batch (128), one thread per
process. Each repetition runs, in order: the plain loop in a process of its own (no cluster alive),
DDP over gloo launched with torch.multiprocessing, then on one Dask cluster the workbench with one
worker and with N workers under each strategy setting. Repetitions interleave; medians are reported.
The last line printed is one JSON object with the ratios.

    python benchmarks/throughput.py [--workers 2] [--repeats 3] [--steps 150]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import workbench
from workbench.data import synthetic

BATCH = 128
HIDDEN = (1024, 1024)
WARMUP_STEPS = 20


def model_factory():
    return workbench.mlp(784, 10, HIDDEN)


def _data():
    return synthetic(n_samples=8192, n_features=784).train.load()


def _timed_loop(model, optimizer, data, indices_for_step, steps, before_timing=None):
    loss_fn = torch.nn.functional.cross_entropy
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            if before_timing:
                before_timing()
            started = time.perf_counter()
        inputs, targets = data.batch(indices_for_step(step))
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        float(loss.detach())
    return steps * BATCH / (time.perf_counter() - started)


def _plain_process(steps, results):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    data = _data()
    model = model_factory()()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    order = torch.randperm(len(data))
    n_batches = len(data) // BATCH
    results.put(_timed_loop(model, optimizer, data,
                            lambda s: order[(s % n_batches) * BATCH:(s % n_batches + 1) * BATCH], steps))


def _ddp_process(rank, world_size, port, steps, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        data = _data()
        model = torch.nn.parallel.DistributedDataParallel(model_factory()())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        shard = torch.randperm(len(data))[rank::world_size]
        n_batches = len(shard) // BATCH
        rate = _timed_loop(model, optimizer, data,
                           lambda s: shard[(s % n_batches) * BATCH:(s % n_batches + 1) * BATCH], steps, dist.barrier)
        results.put(rate)
    finally:
        dist.destroy_process_group()


def measure_plain(steps):
    context = mp.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_plain_process, args=(steps, results))
    process.start()
    rate = results.get(timeout=600)
    process.join(60)
    return rate


def measure_ddp(steps, world_size):
    from workbench.collectives import find_free_port

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = find_free_port()
    processes = [context.Process(target=_ddp_process, args=(r, world_size, port, steps, results))
                 for r in range(world_size)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(600)
    return sum(results.get() for _ in range(world_size))


def measure_workbench(client, steps, workers, strategy, **settings):
    job = workbench.Job(model=model_factory(), data=synthetic(n_samples=8192, n_features=784).train,
                        batch_size=BATCH, steps=WARMUP_STEPS + steps, lr=0.01)
    run = workbench.train(job, strategy, client=client, workers=workers, run_dir="/tmp/workbench-benchmark-runs",
                          **settings)
    run.wait(timeout=600)
    frame = run.metrics
    steady = frame[frame["step"] >= WARMUP_STEPS - 1]  # the first steady record marks the start time
    total = 0.0
    for _, rows in steady.groupby("worker"):
        span = rows["time"].max() - rows["time"].min()
        total += rows["samples"].iloc[1:].sum() / span
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per measurement (after warm-up)")
    arguments = parser.parse_args()
    n = arguments.workers
    configs = [("workbench 1 worker", 1, "allreduce", {}), (f"allreduce x{n}", n, "allreduce", {})]
    configs += [(f"average p{p} x{n}", n, "average", {"period": p}) for p in (1, 4, 16)]
    samples: dict[str, list[float]] = {"plain": [], f"ddp x{n}": []}
    for name, *_ in configs:
        samples[name] = []
    for repeat in range(arguments.repeats):
        samples["plain"].append(measure_plain(arguments.steps))
        samples[f"ddp x{n}"].append(measure_ddp(arguments.steps, n))
        with workbench.client_session(workers=n, dashboard_address=":0") as client:
            for name, workers, strategy, settings in configs:
                samples[name].append(measure_workbench(client, arguments.steps, workers, strategy, **settings))
        print(f"repeat {repeat + 1}/{arguments.repeats}: " +
              ", ".join(f"{k} {v[-1]:,.0f}" for k, v in samples.items()), flush=True)

    medians = {name: statistics.median(values) for name, values in samples.items()}
    plain = medians["plain"]
    print(f"\nMLP 784-1024-1024-10, batch {BATCH}/worker, {n} workers, {arguments.repeats} repeats "
          f"(medians), {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'configuration':<22}{'samples/s':>12}{'vs plain':>10}")
    for name, value in medians.items():
        print(f"{name:<22}{value:>12,.0f}{value / plain:>10.2f}")
    average_best = max(medians[f"average p{p} x{n}"] for p in (1, 4, 16))
    result = {
        "machine": f"{os.cpu_count()} cores, {platform.machine()}",
        "date": datetime.date.today().isoformat(),
        "workers": n,
        "one_worker_vs_plain": medians["workbench 1 worker"] / plain,
        "allreduce_vs_ddp": medians[f"allreduce x{n}"] / medians[f"ddp x{n}"],
        "average_vs_plain": average_best / plain,
        "ddp_vs_plain": medians[f"ddp x{n}"] / plain,
        "allreduce_vs_plain": medians[f"allreduce x{n}"] / plain,
        **{f"average_p{p}_vs_plain": medians[f"average p{p} x{n}"] / plain for p in (1, 4, 16)},
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
