"""Throughput of the workbench against a plain PyTorch loop and PyTorch DDP, measured side by side.

Same model (MLP 784-1024-1024-10), same synthetic data, same per-worker batch (128), one thread per
process. Each repetition runs, in order: the plain loop in a process of its own (no cluster alive), N
plain loops in N processes side by side (the machine's own limit for N workers: no communication at
all), DDP over gloo launched with torch.multiprocessing, then on one Dask cluster the workbench with one
worker and with N workers under each strategy setting. Repetitions interleave; medians are reported,
against the plain loop and against the limit (on a 2-core VM whose two-process speed-up moves between
1.6x and 2x from one hour to the next, the ratio to the limit is what stays put). The last line printed
is one JSON object with the ratios; the result file (`resultfile.path_for("throughput")`, or `--out`) holds
every repetition's rate per configuration and the same ratios.

The parameter-server strategies (async with push_every 1 and 4, ssp with max_staleness 2, easgd, and
async with top-k 1% compression both ways, and with dense replies) also report bytes sent and received
per step and staleness.

    python benchmarks/throughput.py [--workers 2] [--repeats 3] [--steps 150] [--only async]

On a GPU machine `--device cuda` measures a transformer in bf16 instead (benchmarks/throughput_cuda.py).
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

import resultfile
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


def spawn_and_sum(target, argument_lists, context=None):
    """One spawned process per argument list, each given the result queue last; the sum of what they put."""
    context = context or mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=target, args=(*arguments, results)) for arguments in argument_lists]
    for process in processes:
        process.start()
    total = sum(results.get(timeout=600) for _ in processes)
    for process in processes:
        process.join(60)
    return total


def measure_plain(steps, processes=1):
    """The plain loop's samples/s, summed over `processes` copies running side by side."""
    return spawn_and_sum(_plain_process, [(steps,)] * processes)


def measure_ddp(steps, world_size):
    from workbench.comm.collectives import find_free_port

    port = find_free_port()
    return spawn_and_sum(_ddp_process, [(r, world_size, port, steps) for r in range(world_size)])


def measure_workbench(client, steps, workers, strategy, **settings):
    job = workbench.Job(model=model_factory(), data=synthetic(n_samples=8192, n_features=784).train,
                        batch_size=BATCH, steps=WARMUP_STEPS + steps, lr=0.01)
    run = workbench.train(job, strategy, client=client, workers=workers, run_dir="/tmp/workbench-benchmark-runs",
                          **settings)
    run.wait(timeout=600)
    return steady_rate(run, WARMUP_STEPS)


def steady_rate(run, warmup_steps):
    """Samples/s summed over the run's workers after `warmup_steps`, from the step records' own times,
    and what the run's summary says of its traffic and staleness."""
    frame = run.metrics
    steady = frame[frame["step"] >= warmup_steps - 1]  # the first steady record marks the start time
    total = 0.0
    for _, rows in steady.groupby("worker"):
        span = rows["time"].max() - rows["time"].min()
        total += rows["samples"].iloc[1:].sum() / span
    summary = run.summary()
    extras = {"bytes_per_step": summary.get("bytes_sent_per_step"),
              "received_per_step": summary.get("bytes_received_per_step"),
              "staleness_mean": summary.get("staleness", {}).get("mean"),
              "comm_hidden": summary.get("comm_hidden_fraction")}
    return total, extras


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150, help="timed steps per measurement (after warm-up)")
    parser.add_argument("--only", default=None, help="run only the workbench configurations whose name has this")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: a transformer in bf16 on the GPU (throughput_cuda.py), else the CPU MLP")
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/throughput.json)")
    arguments = parser.parse_args()
    if arguments.device == "cuda":
        import throughput_cuda

        return throughput_cuda.main(arguments)
    n = arguments.workers
    configs = [("workbench 1 worker", 1, "allreduce", {}), (f"allreduce x{n}", n, "allreduce", {})]
    configs += [(f"average p{p} x{n}", n, "average", {"period": p}) for p in (1, 4, 16)]
    configs += [(f"async p{p} x{n}", n, "async", {"push_every": p}) for p in (1, 4)]
    configs += [(f"ssp s2 p4 x{n}", n, "ssp", {"max_staleness": 2, "push_every": 4}),
                (f"easgd p4 x{n}", n, "easgd", {"period": 4}),
                (f"async topk1% p1 x{n}", n, "async", {"compression": "topk", "topk_ratio": 0.01}),
                (f"async topk1% dense-replies p1 x{n}", n, "async",
                 {"compression": "topk", "topk_ratio": 0.01, "reply_compression": "none"})]
    if arguments.only:
        configs = [c for c in configs if arguments.only in c[0]]
    limit = f"plain x{n} side by side"
    samples: dict[str, list[float]] = {"plain": [], limit: [], f"ddp x{n}": []}
    extras: dict[str, dict] = {}
    for name, *_ in configs:
        samples[name] = []
    for repeat in range(arguments.repeats):
        samples["plain"].append(measure_plain(arguments.steps))
        samples[limit].append(measure_plain(arguments.steps, n))
        samples[f"ddp x{n}"].append(measure_ddp(arguments.steps, n))
        with workbench.client_session(workers=n, dashboard_address=":0") as client:
            for name, workers, strategy, settings in configs:
                rate, extras[name] = measure_workbench(client, arguments.steps, workers, strategy, **settings)
                samples[name].append(rate)
        print(f"repeat {repeat + 1}/{arguments.repeats}: " +
              ", ".join(f"{k} {v[-1]:,.0f}" for k, v in samples.items()), flush=True)

    medians = {name: statistics.median(values) for name, values in samples.items()}
    plain = medians["plain"]
    print(f"\nMLP 784-1024-1024-10, batch {BATCH}/worker, {n} workers, {arguments.repeats} repeats "
          f"(medians), {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'configuration':<36}{'samples/s':>12}{'vs plain':>10}{'vs limit':>10}{'sent KiB':>10}{'recv KiB':>10}"
          f"{'staleness':>10}{'hidden':>8}")
    for name, value in medians.items():
        extra = extras.get(name, {})
        kib = f"{extra['bytes_per_step'] / 1024:,.1f}" if extra.get("bytes_per_step") else ""
        received = f"{extra['received_per_step'] / 1024:,.1f}" if extra.get("received_per_step") else ""
        stale = f"{extra['staleness_mean']:.2f}" if extra.get("staleness_mean") is not None else ""
        hidden = f"{extra['comm_hidden']:.0%}" if extra.get("comm_hidden") is not None else ""
        print(f"{name:<36}{value:>12,.0f}{value / plain:>10.2f}{value / medians[limit]:>10.2f}{kib:>10}{received:>10}{stale:>10}{hidden:>8}")
    result = {
        "ddp_vs_plain": medians[f"ddp x{n}"] / plain,
        "limit_vs_plain": medians[limit] / plain,
        "ddp_vs_limit": medians[f"ddp x{n}"] / medians[limit],
        **{_key(name): value / plain for name, value in medians.items() if name not in ("plain", limit, f"ddp x{n}")},
        **{_key(name).replace("_vs_plain", "_vs_limit"): value / medians[limit] for name, value in medians.items()
           if name not in ("plain", limit, f"ddp x{n}")},
    }
    ratio = lambda a, b: medians[a] / medians[b] if a in medians and b in medians else None  # noqa: E731
    result["one_worker_vs_plain"] = ratio("workbench 1 worker", "plain")
    result["allreduce_vs_ddp"] = ratio(f"allreduce x{n}", f"ddp x{n}")
    best = lambda prefix: max((v for k, v in medians.items() if k.startswith(prefix)), default=None)  # noqa: E731
    if best("average"):
        result["average_vs_plain"] = best("average") / plain
    asyncs = {k: v for k, v in medians.items() if k.startswith("async p")}
    if asyncs:
        best_async = max(asyncs, key=asyncs.get)
        result["async_vs_plain"] = asyncs[best_async] / plain
        result["async_staleness_mean"] = extras[best_async]["staleness_mean"]
    if f"ssp s2 p4 x{n}" in medians:
        result["ssp_vs_plain"] = medians[f"ssp s2 p4 x{n}"] / plain
    dense, sparse = extras.get(f"async p1 x{n}"), extras.get(f"async topk1% p1 x{n}")
    if dense and sparse:
        result["compression_bytes_ratio"] = dense["bytes_per_step"] / sparse["bytes_per_step"]
        if sparse.get("received_per_step"):
            result["compression_received_bytes_ratio"] = dense["received_per_step"] / sparse["received_per_step"]
    result = {k: v for k, v in result.items() if v is not None}
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}))
    document = resultfile.document("throughput", {
        "model": "MLP 784-1024-1024-10", "data": "synthetic", "batch_per_worker": BATCH, "workers": n,
        "repeats": arguments.repeats, "steps": arguments.steps, "only": arguments.only,
        "limit": limit, "plain": "one process, the same loop", "ddp": f"ddp x{n}"})
    document["cells"] = {name: {"samples_per_s": values, "median": medians[name], **extras.get(name, {})}
                         for name, values in samples.items()}
    document.update(result)
    resultfile.write(arguments.out or resultfile.path_for("throughput"), document)


def _key(name: str) -> str:
    """'async topk1% p1 x2' -> 'async_topk1pct_p1_vs_plain' (a JSON-friendly key per configuration)."""
    words = [w for w in name.replace("%", "pct").split() if not w.startswith("x")]
    return "_".join(words).replace("workbench_1_worker", "one_worker") + "_vs_plain"


if __name__ == "__main__":
    main()
