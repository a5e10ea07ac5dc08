"""The GPU half of benchmarks/throughput.py (`--device cuda`): a transformer in bf16 autocast on one GPU.

Model: token embedding (vocabulary 8192), 8 pre-norm transformer encoder blocks (width 512, 8 heads,
feed-forward 2048), mean pool, a 10-way head: 29M parameters. Batch 128 sequences of 256 tokens per
worker, AdamW, the data on the GPU once. Each repetition measures, in order: the plain single-process
CUDA loop; PyTorch DDP with one process (NCCL); on `dask_cuda.LocalCUDACluster` (one worker per GPU)
the workbench with one CUDA worker; then two plain loops side by side on the GPU (the machine's own limit
for two workers), DDP with two processes sharing the GPU (gloo: NCCL refuses two ranks on one GPU), and
on a cluster of two workers sharing the GPU each strategy. Every loop reads its loss every step, as
the workbench does for its metrics. Medians over repetitions; ratios to the plain loop and to the limit.
The workbench's cost per step is the difference of the step times, 1/rate.

    python -m benchmarks run --only gpu-throughput   # benchmarks/results/gpu-<model>/gpu-throughput.json
    python benchmarks/throughput.py --device cuda [--repeats 2] [--steps 100] [--out FILE]
"""
from __future__ import annotations

import datetime
import json
import statistics
import sys
import time

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import resultfile
import workbench
from throughput import spawn_and_sum, steady_rate

VOCAB, WIDTH, BLOCKS, HEADS, SEQUENCE, CLASSES = 8192, 512, 8, 8, 256, 10
BATCH, WARMUP, SAMPLES, LR = 128, 10, 128 * 16, 1e-4

# The workers cannot import this file: the model travels by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class TokenClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        block = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, BLOCKS, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQUENCE), generator=generator)
    return tokens, tokens[:, 0] % CLASSES  # learnable: the class is in the first token


def _timed_loop(model, steps, rank=0, world_size=1, before_timing=None):
    tokens, targets = (t.cuda() for t in data())  # on the GPU once, as the workbench does per shard
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    shard = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(rank))[rank::world_size]
    batches = len(shard) // BATCH
    for step in range(WARMUP + steps):
        if step == WARMUP:
            if before_timing:
                before_timing()
            torch.cuda.synchronize()
            started = time.perf_counter()
        index = shard[(step % batches) * BATCH:(step % batches + 1) * BATCH].cuda()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(tokens[index]), targets[index])
        loss.backward()
        optimizer.step()
        float(loss.detach())
    torch.cuda.synchronize()
    return steps * BATCH / (time.perf_counter() - started)


def _plain_process(steps, rank, start, results):
    torch.manual_seed(0)
    model = TokenClassifier().cuda()
    # Side by side, every process is timed over the same moments: from when all have warmed up (the
    # first steps initialise cuBLAS and take seconds, longer than a short timed window).
    results.put(_timed_loop(model, steps, rank, before_timing=start.wait))


def _ddp_process(rank, world_size, port, backend, steps, results):
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(TokenClassifier().cuda(), device_ids=[0])
        results.put(_timed_loop(model, steps, rank, world_size, dist.barrier))
    finally:
        dist.destroy_process_group()


def measure_plain(steps, processes=1):
    context = mp.get_context("spawn")
    start = context.Barrier(processes)
    return spawn_and_sum(_plain_process, [(steps, rank, start) for rank in range(processes)], context)


def measure_ddp(steps, world_size, backend):
    from workbench.comm.collectives import find_free_port

    port = find_free_port()
    return spawn_and_sum(_ddp_process, [(r, world_size, port, backend, steps) for r in range(world_size)])


def measure_workbench(client, steps, strategy, **settings):
    job = workbench.Job(model=TokenClassifier, data=data(), batch_size=BATCH, steps=WARMUP + steps, lr=LR,
                        optimizer="adamw", device="cuda", precision="bf16")
    run = workbench.train(job, strategy, client=client, run_dir="/tmp/workbench-gpu-benchmark-runs", **settings)
    status = run.wait(timeout=600)
    assert status == "finished", f"{strategy} {settings}: {status}"
    rate, extras = steady_rate(run, WARMUP)
    steps_frame = run.metrics[run.metrics["step"] >= WARMUP]
    extras.update(compute_ms=1e3 * steps_frame["compute_s"].median(), comm_ms=1e3 * steps_frame["comm_s"].median(),
                  gpu_utilization=steps_frame.get("gpu_utilization", steps_frame["step"] * float("nan")).median(),
                  gpu_memory_mb=steps_frame.get("gpu_memory_mb", steps_frame["step"] * float("nan")).max(),
                  device=run.config["devices"][0]["name"])
    return rate, extras


SHARED = [("allreduce x2", "allreduce", {}), ("average p16 x2", "average", {"period": 16}),
          ("async p16 x2", "async", {"push_every": 16}), ("ssp p16 x2", "ssp", {"push_every": 16}),
          ("easgd p16 x2", "easgd", {"period": 16})]


def main(arguments) -> None:
    # The one-worker comparison gets the long measurement (its ratio is the target); configurations of
    # two workers sharing the GPU a shorter one (all-reduce over gloo moves the whole model every step).
    steps = 100 if arguments.steps == 150 else arguments.steps  # 150 is the CPU default
    short = max(10, steps // 4)
    shared = [c for c in SHARED if not arguments.only or arguments.only in c[0]]
    samples: dict[str, list[float]] = {}
    extras: dict[str, dict] = {}
    began = time.monotonic()
    out = arguments.out or resultfile.path_for("gpu-throughput")
    base = resultfile.document("gpu-throughput", {"repeats": arguments.repeats, "steps": steps, "only": arguments.only})

    def record(name, value):
        samples.setdefault(name, []).append(value)
        print(f"[{time.monotonic() - began:5.0f} s] {name}: {value:,.0f} samples/s", flush=True)
        # whatever was measured survives a run cut short
        resultfile.write(out, {**base, **report(samples, extras, arguments.repeats, steps)})

    for repeat in range(arguments.repeats):
        record("plain", measure_plain(steps))
        with workbench.client_session(kind="cuda", dashboard_address=":0") as client:
            rate, extras["workbench 1 worker"] = measure_workbench(client, steps, "allreduce")
            record("workbench 1 worker", rate)
        record("ddp x1 nccl", measure_ddp(steps, 1, "nccl"))
        record("plain x2 side by side", measure_plain(2 * short, 2))
        with workbench.client_session(kind="cuda", workers=2, dashboard_address=":0") as client:
            for name, strategy, settings in shared:
                rate, extras[name] = measure_workbench(client, short, strategy, **settings)
                record(name, rate)
        record("ddp x2 gloo", measure_ddp(short, 2, "gloo"))
    result = {**base, **report(samples, extras, arguments.repeats, steps)}
    resultfile.write(out, result)
    print_table(result)
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()
                      if not isinstance(v, (dict, list))}))


def report(samples: dict[str, list[float]], extras: dict[str, dict], repeats: int, steps: int) -> dict:
    """The measurements so far: medians, a row per configuration (`cells`), and the ratios whose
    configurations were measured."""
    medians = {name: statistics.median(values) for name, values in samples.items()}
    parameters = sum(p.numel() for p in TokenClassifier().parameters())
    result = {
        "model": f"transformer {BLOCKS}x{WIDTH}, {parameters} parameters, bf16 autocast, AdamW",
        "batch": f"{BATCH}x{SEQUENCE} tokens per worker", "repeats": repeats, "steps": steps,
    }
    limit_rate = medians.get("plain x2 side by side")
    result["cells"] = {name: {"samples_per_s": value, "each": samples[name],
                              "vs_plain": value / medians["plain"] if "plain" in medians else None,
                              "vs_limit": value / limit_rate if limit_rate and "x2" in name else None,
                              **{key: extras.get(name, {}).get(key)
                                 for key in ("compute_ms", "comm_ms", "gpu_utilization")}}
                       for name, value in medians.items()}
    ratio = lambda a, b: medians[a] / medians[b] if a in medians and b in medians else None  # noqa: E731
    limit = "plain x2 side by side"
    result.update({
        "one_worker_vs_plain": ratio("workbench 1 worker", "plain"),
        "ddp_x1_vs_plain": ratio("ddp x1 nccl", "plain"),
        "one_worker_vs_ddp_x1": ratio("workbench 1 worker", "ddp x1 nccl"),
        "limit_x2_vs_plain": ratio(limit, "plain"),
        "ddp_x2_gloo_vs_limit": ratio("ddp x2 gloo", limit),
        **{"_".join(name.split()[:-1]) + "_x2_vs_limit": ratio(name, limit) for name, *_ in SHARED},
    })
    if "workbench 1 worker" in medians:
        plain_ms, worker_ms = (1e3 * BATCH / medians[name] for name in ("plain", "workbench 1 worker"))
        result.update(plain_ms_per_step=plain_ms, workbench_overhead_ms_per_step=worker_ms - plain_ms)
    result = {k: v for k, v in result.items() if v is not None}
    result["details"] = extras
    return result


def print_table(result):
    print(f"\n{result['machine']['gpu']}: {result['model']}, batch {result['batch']}, {result['repeats']} repeats "
          f"(medians), torch {result['machine']['torch']}")
    print(f"{'configuration':<26}{'samples/s':>11}{'ms/step':>9}{'vs plain':>10}{'vs limit':>10}{'compute ms':>12}"
          f"{'comm ms':>9}{'GPU %':>7}")
    shown = lambda value, form: "" if value is None else format(value, form)  # noqa: E731
    for name, row in result["cells"].items():
        workers = 2 if "x2" in name else 1
        print(f"{name:<26}{row['samples_per_s']:>11,.0f}{1e3 * BATCH * workers / row['samples_per_s']:>9.1f}"
              f"{shown(row['vs_plain'], '.3f'):>10}{shown(row['vs_limit'], '.3f'):>10}"
              f"{shown(row['compute_ms'], '.1f'):>12}{shown(row['comm_ms'], '.1f'):>9}"
              f"{shown(row['gpu_utilization'], '.0f'):>7}")
