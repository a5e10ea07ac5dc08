"""Wall time to reach a held-out accuracy on `digits` with 2 workers: every strategy and PyTorch DDP, in one run.

Same model (MLP 64-128-10), optimizer (SGD, lr 0.05, momentum 0.7), per-worker batch (8) and data split
for all. Worker 0 evaluates the held-out split every `--eval-every` steps; the time counted runs from the
first training step to the first evaluation at or above the target (cluster start-up is not counted, for
DDP neither is process-group set-up). Evaluation time is inside the measurement for all. The last line
is one JSON object.

    python benchmarks/time_to_accuracy.py [--target 0.95] [--repeats 3] [--eval-every 10]
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
from workbench.comm.collectives import find_free_port
from workbench.data import digits
from workbench.evaluation import evaluate
from workbench.sharding import batches, shard_indices

LR, MOMENTUM, BATCH, MAX_EPOCHS = 0.05, 0.7, 8, 40
STRATEGIES = [("allreduce", {}), ("average p4", {"period": 4}), ("async", {}), ("async p4", {"push_every": 4}),
              ("ssp s2", {"max_staleness": 2}), ("easgd p4", {"period": 4}),
              ("async topk1%", {"compression": "topk", "topk_ratio": 0.01})]


def model_factory():
    return workbench.mlp(64, 10)


def measure_workbench(client, strategy, settings, target, eval_every):
    job = workbench.Job(model=model_factory(), data="digits", lr=LR, momentum=MOMENTUM, batch_size=BATCH,
                        epochs=MAX_EPOCHS, eval_every=eval_every, seed=0)
    run = workbench.train(job, strategy.split()[0], client=client, run_dir="/tmp/workbench-benchmark-runs",
                          **settings)
    reached = None
    while not run.done and reached is None:
        evaluations = run.evaluations
        if not evaluations.empty and (evaluations["accuracy"] >= target).any():
            reached = evaluations[evaluations["accuracy"] >= target].iloc[0]
            run.stop()
        time.sleep(0.05)  # polling the client-side table, not synchronising with workers
    run.wait(timeout=600)
    if reached is None:
        evaluations = run.evaluations
        hits = evaluations[evaluations["accuracy"] >= target]
        if hits.empty:
            return None, None
        reached = hits.iloc[0]
    started = run.metrics["time"].min()
    return reached["time"] - started, int(reached["step"])


def _ddp_process(rank, port, target, eval_every, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        torch.manual_seed(0)
        splits = digits()
        data, held_out = splits.train.load(), splits.eval.load()
        model = torch.nn.parallel.DistributedDataParallel(model_factory()())
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        loss_fn = torch.nn.functional.cross_entropy
        dist.barrier()
        started, step, reached = time.perf_counter(), 0, torch.zeros(2)
        for epoch in range(MAX_EPOCHS):
            for indices in batches(shard_indices(len(data), 2, rank, epoch, 0), BATCH):
                inputs, targets = data.batch(indices)
                optimizer.zero_grad(set_to_none=True)
                loss_fn(model(inputs), targets).backward()
                optimizer.step()
                step += 1
                if step % eval_every == 0:
                    if rank == 0 and evaluate(model.module, held_out, loss_fn)["accuracy"] >= target:
                        reached = torch.tensor([1.0, float(step)])
                    dist.broadcast(reached, 0)  # stop together
                    if reached[0]:
                        if rank == 0:
                            results.put((time.perf_counter() - started, int(reached[1])))
                        return
        if rank == 0:
            results.put((None, None))
    finally:
        dist.destroy_process_group()


def measure_ddp(target, eval_every):
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = find_free_port()
    processes = [context.Process(target=_ddp_process, args=(r, port, target, eval_every, results)) for r in (0, 1)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(600)
    return results.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/time-to-accuracy.json)")
    arguments = parser.parse_args()
    seconds: dict[str, list[float]] = {name: [] for name in ["ddp"] + [s for s, _ in STRATEGIES]}
    steps: dict[str, list[int]] = {name: [] for name in seconds}
    for repeat in range(arguments.repeats):
        took, step = measure_ddp(arguments.target, arguments.eval_every)
        if took is not None:
            seconds["ddp"].append(took)
            steps["ddp"].append(step)
        with workbench.client_session(workers=2, dashboard_address=":0") as client:
            for name, settings in STRATEGIES:
                took, step = measure_workbench(client, name, settings, arguments.target, arguments.eval_every)
                if took is not None:
                    seconds[name].append(took)
                    steps[name].append(step)
        print(f"repeat {repeat + 1}/{arguments.repeats}: " +
              ", ".join(f"{k} {v[-1]:.2f}s" if v else f"{k} -" for k, v in seconds.items()), flush=True)
    print(f"\ntime to {arguments.target:.0%} held-out accuracy on digits, 2 workers, MLP 64-128-10, SGD lr {LR} "
          f"momentum {MOMENTUM}, batch {BATCH}/worker, {arguments.repeats} repeats (medians), "
          f"{platform.node()} {os.cpu_count()} cores")
    print(f"{'strategy':<16}{'seconds':>9}{'vs ddp':>8}{'steps':>7}{'reached':>9}")
    medians = {k: statistics.median(v) for k, v in seconds.items() if v}
    for name in seconds:
        if name in medians:
            print(f"{name:<16}{medians[name]:>9.2f}{medians[name] / medians['ddp']:>8.2f}"
                  f"{statistics.median(steps[name]):>7.0f}{len(seconds[name]):>6}/{arguments.repeats}")
        else:
            print(f"{name:<16}{'not reached':>9}")
    result = {**{f"{_key(k)}_s": v for k, v in medians.items()},
              **{f"{_key(k)}_vs_ddp": v / medians["ddp"] for k, v in medians.items() if "ddp" in medians}}
    result["best_vs_ddp"] = min((v for k, v in result.items() if k.endswith("_vs_ddp") and k != "ddp_vs_ddp"),
                                default=None)
    print(json.dumps(result))
    document = resultfile.document("time-to-accuracy", {
        "target_accuracy": arguments.target, "data": "digits", "workers": 2, "model": "MLP 64-128-10",
        "optimizer": f"SGD lr {LR} momentum {MOMENTUM}", "batch_per_worker": BATCH, "repeats": arguments.repeats,
        "eval_every": arguments.eval_every})
    document["cells"] = {name: {"seconds": seconds[name], "steps": steps[name], "median_s": medians.get(name),
                                "reached": f"{len(seconds[name])}/{arguments.repeats}"} for name in seconds}
    document.update(result)
    resultfile.write(arguments.out or resultfile.path_for("time-to-accuracy"), document)


def _key(name: str) -> str:
    """'async topk1%' -> 'async_topk1pct' (a JSON-friendly key per configuration)."""
    return name.replace(" ", "_").replace("%", "pct")


if __name__ == "__main__":
    main()
