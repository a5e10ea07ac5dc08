"""The real workload on a GPU: the character-level GPT on the standard library's source, compiled, in bf16.

Two parts, each a benchmark with its own result file (`--parts 1,2` by hand writes both into one):

1. **One worker against a plain compiled loop** of the same model (`--size`, default gpt-medium, 86M
   parameters, context 1024), on the same data and batch, AdamW, bf16 autocast, `torch.compile` on the
   forward pass in both. Each loop reads its loss every step, as the workbench does for its metrics. The
   plain loop runs first in a process of its own (it also fills the compile cache the worker then reads);
   the workbench runs one worker on `dask_cuda.LocalCUDACluster`. Throughput is tokens/s after the warm-up
   steps (which include compiling); model FLOPs utilisation is nanoGPT's: the model's training FLOPs per
   token (6 per parameter plus attention, `GPT.flops_per_token`) times tokens/s, over the GPU's dense bf16
   peak. `one_worker_vs_plain` is the ratio of the two rates (target >= 0.97).
2. **Every strategy** for `--strategy-steps` steps on two workers sharing the GPU (`--strategy-size`,
   default gpt-small, not compiled: the compile time of each worker would dwarf the few hundred steps),
   each with its held-out loss curve (every `--eval-every` steps), samples/s, and staleness; the run
   directories are kept (`--runs`) for the dashboard's picture.

    python -m benchmarks run --only gpu-gpt-compiled,gpu-gpt-strategies   # benchmarks/results/gpu-<model>/
    python benchmarks/gpt_gpu.py --parts 1 --out FILE [--runs DIR]        # the same by hand

On a machine without a GPU, `--device cpu --size gpt-test --strategy-size gpt-test` runs the same code
small (how the script is checked before it takes GPU time).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import resultfile  # noqa: E402
import workbench  # noqa: E402
from throughput import spawn_and_sum, steady_rate  # noqa: E402
from workbench.job import cross_entropy  # noqa: E402
from workbench.models import GPT_SIZES  # noqa: E402
from workbench.sharding import shard_indices  # noqa: E402

# Dense bf16 peak (no sparsity) by the name CUDA reports: NVIDIA's data sheets, SXM parts.
BF16_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}

# Every strategy, with settings that a user of each would start from on this model.
STRATEGY_RUNS = [
    ("allreduce", "allreduce", {}),
    ("average p16", "average", {"period": 16}),
    ("average p64 outer nesterov", "average", {"period": 64, "outer_lr": 0.7, "outer_momentum": 0.9}),
    ("async p4", "async", {"push_every": 4}),
    ("ssp p4", "ssp", {"push_every": 4}),
    ("easgd p16", "easgd", {"period": 16}),
    ("auto", "auto", {}),
]


# The result's benchmark name (benchmarks/catalog.py) by the parts measured: each part is a benchmark of its own.
BENCHMARK_NAMES = {"1": "gpu-gpt-compiled", "2": "gpu-gpt-strategies"}


def peak_flops(device_name: str) -> float | None:
    return next((peak for key, peak in BF16_PEAK_FLOPS.items() if key in device_name), None)


def text_job(arguments, size: str, steps: int, compile_: bool, eval_every: int | None, batch: int | None = None,
             **changes) -> workbench.Job:
    fields = dict(model=workbench.gpt(size), data=workbench.stdlib_text(context=arguments.context or
                                                                        GPT_SIZES[size].positions,
                                                                        eval_windows=arguments.eval_windows),
                  optimizer="adamw", lr=arguments.lr, batch_size=batch or arguments.batch, steps=steps,
                  device=arguments.device, precision="bf16" if arguments.device == "cuda" else "float32",
                  compile=compile_, eval_every=eval_every)
    fields.update(changes)
    return workbench.Job(**fields)


# --- part 1: one worker against the plain compiled loop ----------------------------------------------------


def _plain_process(arguments, results):
    """The plain compiled loop: what a user writes by hand for one GPU."""
    job = text_job(arguments, arguments.size, arguments.warmup + arguments.steps, True, None)
    prepared = job.prepare()
    device = torch.device(arguments.device)
    data = prepared.train.load().to(device)
    torch.manual_seed(0)
    model = job.model().to(device)
    forward = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.lr)
    order = shard_indices(len(data), 1, 0, 0, job.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.precision == "bf16")
    for step in range(job.steps):
        if step == arguments.warmup:
            torch.cuda.synchronize() if device.type == "cuda" else None
            started = time.perf_counter()
        inputs, targets = data.batch(order[step * job.batch_size:(step + 1) * job.batch_size])
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = cross_entropy(forward(inputs), targets)
        loss.backward()
        optimizer.step()
        float(loss.detach())
    torch.cuda.synchronize() if device.type == "cuda" else None
    results.put(arguments.steps * job.batch_size / (time.perf_counter() - started))


def compiled_one_worker(arguments, result, save):
    context = arguments.context or GPT_SIZES[arguments.size].positions
    model = workbench.gpt(arguments.size)()
    flops_per_token = model.flops_per_token(context)
    parameters = sum(p.numel() for p in model.parameters())
    kind = "cuda" if arguments.device == "cuda" else "cpu"
    job = text_job(arguments, arguments.size, arguments.warmup + arguments.steps, True, None)
    cell = result["compiled_one_worker"] = {
        "model": arguments.size, "parameters": parameters, "context": context, "batch": arguments.batch,
        "flops_per_token": flops_per_token, "warmup_steps": arguments.warmup, "timed_steps": arguments.steps,
    }
    rows = result["cells"] = []  # one per repetition; the medians and ratios below come from them
    # Interleaved repetitions (plain, workbench, plain, ...): the GPU's clocks drift over minutes.
    for repeat in range(arguments.repeats):
        began = time.monotonic()
        plain = spawn_and_sum(_plain_process, [(arguments,)], mp.get_context("spawn"))
        print(f"[{repeat}] plain compiled loop: {plain:,.1f} samples/s ({time.monotonic() - began:.0f} s with "
              "compiling)", flush=True)
        began = time.monotonic()
        with workbench.client_session(kind=kind, workers=1, dashboard_address=":0") as client:
            run = workbench.train(job, "allreduce", client=client, run_dir=arguments.runs)
            status = run.wait(timeout=arguments.timeout)
            assert status == "finished", status
            rate, _ = steady_rate(run, arguments.warmup)
            steady = run.metrics[run.metrics["step"] >= arguments.warmup]
            cell["device"] = (run.config["devices"][0] or {}).get("name", arguments.device)
            cell["workbench_held_out"] = next((e for e in run.events("eval") if e.get("final")), None)
        rows.append({"repeat": repeat, "plain_samples_per_s": plain, "workbench_samples_per_s": rate,
                     "workbench_compute_ms": 1e3 * steady["compute_s"].median(), "run": run.run_id,
                     "one_worker_vs_plain": rate / plain})
        print(f"[{repeat}] workbench, 1 worker, compiled: {rate:,.1f} samples/s ({time.monotonic() - began:.0f} s)",
              flush=True)
        plain, rate = (statistics.median(row[k] for row in rows) for k in ("plain_samples_per_s",
                                                                           "workbench_samples_per_s"))
        peak = peak_flops(cell["device"])
        mfu = (lambda samples_per_s: flops_per_token * context * samples_per_s / peak) if peak else (lambda _: None)
        cell.update(bf16_peak_flops=peak, repeats_done=repeat + 1,
                    plain_tokens_per_s=plain * context, workbench_tokens_per_s=rate * context,
                    plain_step_ms=1e3 * arguments.batch / plain, workbench_step_ms=1e3 * arguments.batch / rate)
        result.update(one_worker_vs_plain=rate / plain, plain_mfu=mfu(plain), workbench_mfu=mfu(rate))
        save()


# --- part 2: every strategy on workers sharing the GPU -------------------------------------------------------


def every_strategy(arguments, result, save):
    kind = "cuda" if arguments.device == "cuda" else "cpu"
    cells = result.setdefault("strategies", {})
    chosen = [c for c in STRATEGY_RUNS if not arguments.only or any(o in c[0] for o in arguments.only.split(","))]
    with workbench.client_session(kind=kind, workers=arguments.workers, dashboard_address=":0") as client:
        for name, strategy, settings in chosen:
            job = text_job(arguments, arguments.strategy_size, arguments.strategy_steps, False,
                           arguments.eval_every, arguments.strategy_batch, lr=arguments.strategy_lr, lr_schedule="cosine",
                           warmup_steps=max(arguments.strategy_steps // 20, 1))
            began, run = time.monotonic(), None
            try:
                run = workbench.train(job, strategy, client=client, run_dir=arguments.runs, **settings)
                status = run.wait(timeout=arguments.timeout)
            except Exception as error:  # recorded, and the next strategy still measured
                cells[name] = {"strategy": strategy, "settings": settings, "error": f"{type(error).__name__}: {error}"}
                print(f"{name}: failed: {error}", flush=True)
                if run is not None and not run.done:
                    run.stop()
                    run.wait(timeout=60)
                continue
            rate, extras = steady_rate(run, min(20, arguments.strategy_steps // 4))
            origin = run.metrics["time"].min()
            curve = [{"step": e["step"], "seconds": e["time"] - origin, "loss": e["loss"],
                      "bits_per_char": e.get("bits_per_char")} for e in run.events("eval")]
            final = next((e for e in reversed(run.events("eval")) if e.get("final")), curve[-1] if curve else {})
            staleness = run.summary().get("staleness", {})
            cells[name] = {
                "strategy": strategy, "settings": settings, "status": status, "run": run.run_id,
                "samples_per_s": rate, "wall_s": time.monotonic() - began,
                "held_out_loss": final.get("loss"), "bits_per_char": final.get("bits_per_char"),
                "token_accuracy": final.get("token_accuracy"),
                "staleness_mean": staleness.get("mean"), "staleness_max": staleness.get("max"),
                "bytes_sent_per_step": extras.get("bytes_per_step"), "curve": curve,
                "strategies_used": sorted(set(run.metrics["strategy"])),
            }
            save()
            print(f"{name}: {status}, {rate:,.0f} samples/s, held-out loss {final.get('loss', float('nan')):.4f}, "
                  f"staleness {staleness.get('mean')}, {time.monotonic() - began:.0f} s", flush=True)
    result.update(strategy_headline(cells))


def strategy_headline(cells: dict[str, dict]) -> dict:
    """Part 2's headline keys from its cells: how many runs finished, and each held-out loss over
    `allreduce`'s (the worst of them the headline; None without `allreduce`'s held-out loss)."""
    losses = {n: c["held_out_loss"] for n, c in cells.items() if c.get("held_out_loss") is not None}
    versus = {n: loss / losses["allreduce"] for n, loss in losses.items()} if "allreduce" in losses else {}
    finished = sum(cell.get("status") == "finished" for cell in cells.values())
    return {"strategies_run": len(cells), "strategies_finished": finished, "held_out_loss_vs_allreduce": versus,
            "worst_loss_vs_allreduce": max(versus.values()) if versus else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default="gpt-medium", choices=list(GPT_SIZES), help="part 1's model")
    parser.add_argument("--batch", type=int, default=32, help="part 1: sequences per step")
    parser.add_argument("--context", type=int, default=None, help="default: the model's positions")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--warmup", type=int, default=20, help="part 1: untimed steps (compiling included)")
    parser.add_argument("--steps", type=int, default=100, help="part 1: timed steps")
    parser.add_argument("--repeats", type=int, default=2, help="part 1: interleaved repetitions (medians)")
    parser.add_argument("--strategy-size", default="gpt-small", choices=list(GPT_SIZES))
    parser.add_argument("--strategy-steps", type=int, default=300)
    parser.add_argument("--strategy-batch", type=int, default=32, help="part 2: sequences per step per worker")
    parser.add_argument("--strategy-lr", type=float, default=1e-3, help="part 2: AdamW's (nanoGPT's for gpt-small)")
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2, help="part 2: workers sharing the GPU")
    parser.add_argument("--only", default=None, help="part 2: only the strategy runs whose name has one of these")
    parser.add_argument("--parts", default="1,2")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--runs", default="/tmp/gpt-gpu-runs", help="where the runs' directories are written")
    parser.add_argument("--out", required=True)
    arguments = parser.parse_args()
    settings = {k: v for k, v in vars(arguments).items() if k not in ("out", "runs")}
    result = resultfile.document(BENCHMARK_NAMES.get(arguments.parts, "gpu-gpt"), settings)
    save = lambda: resultfile.write(arguments.out, result)  # noqa: E731 - what was measured survives a cut
    parts = {"1": compiled_one_worker, "2": every_strategy}
    for part in arguments.parts.split(","):
        try:
            parts[part](arguments, result, save)
        except Exception as error:  # the other part still runs; the failure is in the result
            result.setdefault("errors", {})[part] = f"{type(error).__name__}: {error}"
            print(f"part {part} failed: {error}", flush=True)
        save()
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (dict, list))}, default=str))
    sys.exit(1 if result.get("errors") else 0)  # `python -m benchmarks run` then reports the benchmark failed


if __name__ == "__main__":
    main()
