"""What checkpoints cost: training throughput with no checkpoint during the run, and with one every N
steps, for a synchronous and an asynchronous strategy, in one run.

Same job every time (MLP 784-1024-1024-10, 1.9 M parameters, 7.6 MB of weights, on synthetic data, batch
128 per worker, a fixed number of steps) on one Dask cluster; the conditions alternate over the
repetitions and medians are reported. Every run also keeps a checkpoint when it ends, in all conditions.
The last line printed is one JSON object with the ratios (throughput with checkpoints / without).

    python benchmarks/checkpoint_cost.py [--workers 2] [--repeats 3] [--steps 300] [--every 50 10]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from typing import Any

import resultfile
import workbench
from workbench.data import synthetic


def job(steps: int) -> workbench.Job:
    data = synthetic(n_samples=8192, n_features=784)
    return workbench.Job(model=workbench.mlp(784, 10, (1024, 1024)), data=data, batch_size=128, steps=steps,
                         lr=0.05, momentum=0.7)


def train_once(client, steps: int, strategy: str, every: int | None, run_dir: str) -> tuple[float, int]:
    run = workbench.train(job(steps), strategy, client=client, run_dir=run_dir, checkpoint_every_steps=every,
                          checkpoint_every_s=None)
    run.wait()
    written = len([e for e in run.events("checkpoint") if not e.get("final")])
    return run.summary()["samples_per_s"], written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, nargs="+", default=[50, 10])
    parser.add_argument("--strategies", nargs="+", default=["allreduce", "async"])
    parser.add_argument("--out", default=None, help="the result file (default: results/<machine class>/checkpoint-cost.json)")
    arguments = parser.parse_args()
    client = workbench.connect(workers=arguments.workers, dashboard_address=":0")
    conditions = [None, *arguments.every]
    rates: dict[tuple[str, int | None], list[float]] = {}
    written: dict[tuple[str, int | None], int] = {}
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            train_once(client, 50, "allreduce", None, run_dir)  # warm-up: imports, first data generation
            for _ in range(arguments.repeats):
                for strategy in arguments.strategies:
                    for every in conditions:
                        rate, count = train_once(client, arguments.steps, strategy, every, run_dir)
                        rates.setdefault((strategy, every), []).append(rate)
                        written[(strategy, every)] = count
                        print(f"{strategy} every={every}: {rate:,.0f} samples/s, {count} checkpoints", flush=True)
    finally:
        workbench.shutdown(client)
    result: dict[str, Any] = {}
    for strategy in arguments.strategies:
        base = statistics.median(rates[(strategy, None)])
        for every in arguments.every:
            result[f"{strategy}_every_{every}_vs_none"] = statistics.median(rates[(strategy, every)]) / base
    result["worst_slowdown"] = 1 - min(result.values())
    print(json.dumps(result))
    document = resultfile.document("checkpoint-cost", {
        "workers": arguments.workers, "steps": arguments.steps, "repeats": arguments.repeats,
        "every": arguments.every, "strategies": arguments.strategies,
        "job": "MLP 784-1024-1024-10 on synthetic data (8,192 samples), batch 128 per worker"})
    document["cells"] = [{"strategy": strategy, "every": every, "samples_per_s": values,
                          "median": statistics.median(values), "checkpoints": written[(strategy, every)]}
                         for (strategy, every), values in rates.items()]
    document.update(result)
    resultfile.write(arguments.out or resultfile.path_for("checkpoint-cost"), document)

if __name__ == "__main__":
    main()
