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
import datetime
import json
import platform
import statistics
import tempfile
from pathlib import Path

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
    parser.add_argument("--out", default=None, help="write the result JSON here too")
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
    result = {"date": datetime.date.today().isoformat(), "machine": f"{platform.machine()} {platform.node()}",
              "workers": arguments.workers, "steps": arguments.steps, "repeats": arguments.repeats, "ratios": {}}
    for strategy in arguments.strategies:
        base = statistics.median(rates[(strategy, None)])
        for every in arguments.every:
            key = f"{strategy}_every_{every}_vs_none"
            result["ratios"][key] = round(statistics.median(rates[(strategy, every)]) / base, 3)
            result["ratios"][f"{strategy}_every_{every}_checkpoints"] = written[(strategy, every)]
    if arguments.out:
        Path(arguments.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
