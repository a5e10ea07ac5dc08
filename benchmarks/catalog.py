"""Every benchmark by name: its script and arguments, the suites it belongs to, what it needs, and the
headline keys its result file must hold (checked by tests/unit/test_benchmark_pages.py).

Suites: `quick` (minutes, a smoke test of the scripts: written to `benchmarks/scratch/`, never read),
`cpu` (this machine alone), `lab` (emulated hosts: root, `ip` and `tc`), `gpu` (a CUDA device).
"""
from __future__ import annotations

import dataclasses

SUITES = ("quick", "cpu", "lab", "gpu")


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str  # the result file's name: results/<machine class>/<name>.json
    title: str
    script: str  # under benchmarks/
    args: tuple[str, ...] = ()
    suites: tuple[str, ...] = ("cpu",)
    headline: tuple[str, ...] = ()  # keys computed by the script, shown first on the page
    quick_args: tuple[str, ...] | None = None  # the `quick` suite's arguments (None: not in it)
    columns: tuple[str, ...] = ()  # the cells' columns shown on the page (dotted for nested ones)
    rows: str = "cells"  # the result's key whose rows the page shows (a list, or a mapping name -> row)
    needs: str = ""  # "lab" (root, ip, tc) or "gpu"
    # Other scripts under benchmarks/ whose code the result measures (a job or a measuring loop it takes from
    # them): `python -m benchmarks check` counts their changes as it counts its own script's.
    measures: tuple[str, ...] = ()


BENCHMARKS = (
    Benchmark("throughput", "Throughput against a plain loop, PyTorch DDP and the machine's limit",
              "throughput.py", headline=("allreduce_vs_ddp", "ddp_vs_limit", "one_worker_vs_plain",
                                         "average_vs_plain", "async_vs_plain", "compression_bytes_ratio"),
              quick_args=("--repeats", "1", "--steps", "20", "--only", "allreduce"),
              columns=("median", "bytes_per_step", "staleness_mean", "comm_hidden")),
    Benchmark("time-to-accuracy", "Wall time to a held-out accuracy on digits, every strategy and DDP",
              "time_to_accuracy.py", headline=("ddp_s", "allreduce_vs_ddp", "best_vs_ddp"),
              quick_args=("--repeats", "1")),
    Benchmark("checkpoint-cost", "What checkpoints cost in throughput", "checkpoint_cost.py",
              headline=("worst_slowdown", "allreduce_every_10_vs_none", "async_every_10_vs_none"), quick_args=("--repeats", "1", "--steps", "60")),
    Benchmark("network", "Slow links and a slow host: every strategy and auto against PyTorch DDP on the lab",
              "network.py", args=("--all-straggler", "--target-repeats", "3"), suites=("lab",), needs="lab", rows="table",
              headline=("best_config_100mbit", "best_retention_100mbit", "best_vs_ddp_100mbit",
                        "best_time_to_target_vs_ddp_100mbit", "ddp_time_to_target_s", "auto_worst_vs_best_fixed",
                        "auto_worst_condition", "auto_median_vs_best_fixed"),
              quick_args=("--quick",),
              columns=("unlimited.samples_per_s", "1gbit.samples_per_s", "100mbit.samples_per_s",
                       "100mbit.vs_unlimited", "100mbit.vs_ddp", "20mbit.samples_per_s", "half-cpu.samples_per_s")),
    Benchmark("auto", "auto against fixed strategies: time to a held-out target under four conditions",
              "auto.py", suites=("lab",), needs="lab", rows="conditions",
              headline=("worst_time_vs_best_fixed", "changing_link_time_vs_best_fixed",
                        "changing_link_beats_every_fixed"),
              quick_args=("--conditions", "unlimited", "--configs", "average p16,auto", "--max-s", "60"),
              columns=("best_fixed", "auto_vs_best_fixed", "auto_beats_every_fixed", "seconds")),
    Benchmark("fidelity", "Quality on the real workload: the character-level GPT on emulated hosts",
              "fidelity.py", suites=("lab",), needs="lab",
              headline=("sync_gap_p64_outer", "best_at_100mbit", "best_time_to_target_vs_ddp_100mbit",
                        "auto_time_to_target_vs_best_fixed")),
    Benchmark("fidelity-balance", "Uneven workers: balanced synchronous training on a slow host",
              "fidelity.py", args=("--balance",), suites=("lab",), needs="lab",
              headline=("balanced_share_of_capacity", "balanced_share_of_capacity_quarter",
                        "lockstep_share_of_capacity", "ddp_balanced_share_of_capacity")),
    Benchmark("fidelity-thin", "Thin links: the sparse, quantised outer exchange at 20 and 10 Mbit/s",
              "fidelity.py", args=("--thin",), suites=("lab",), needs="lab",
              headline=("best_at_10mbit", "best_retention_10mbit", "sync_gap_10mbit", "sparse_bytes_ratio",
                        "targets_met_10mbit")),
    Benchmark("fidelity-tune", "Quality at each one's own learning rate: DDP and the averaging configurations swept",
              "fidelity_tune.py", suites=("lab",), needs="lab", rows="tuned", measures=("fidelity.py",),
              headline=("ddp_best_lr", "ddp_loss_best_lr", "ddp_default_lr_excess", "tuned_best",
                        "tuned_best_gap_vs_ddp", "tuned_sync_gap_p64_outer", "best_lr_at_edge"),
              quick_args=("--rates", "0.003,0.012", "--seeds", "1", "--steps", "16", "--only", "p4 sparse"),
              columns=("best_lr", "seeds_at_best_lr", "loss_best_lr", "gap_vs_tuned_ddp", "loss_default_lr",
                       "gap_at_default_lr", "best_lr_at_edge")),
    Benchmark("simulator", "The capacity planner's simulator against the lab: every strategy at 2, 3 and 4 hosts",
              "simulator.py", suites=("lab",), needs="lab", measures=("network.py",),
              headline=("max_throughput_error", "max_throughput_error_at", "median_throughput_error",
                        "points_within_15pct", "max_staleness_error"),
              quick_args=("--quick",)),
    Benchmark("chaos", "Chaos: the real workload under auto while faults come at random times",
              "chaos.py", suites=("lab",), needs="lab", measures=("fidelity.py",),
              headline=("faults_injected", "runs_finished", "records_lost", "median_s_lost_per_fault",
                        "worst_s_lost_per_fault", "held_out_loss_vs_undisturbed"),
              rows="faults", columns=("kind", "host", "cpu", "held_s", "pause_s", "rewound_steps", "lost_s")),
    Benchmark("chaos-recovery", "Recovery from a lost worker, phase by phase, under every strategy",
              "chaos.py", args=("--recovery", "--repeats", "2"), suites=("lab",), needs="lab",
              measures=("fidelity.py",),
              headline=("recovery_worst_s", "recovery_median_s", "recovery_target_met", "recoveries_over_target",
                        "recovery_worst_s_last_rank_killed", "recovery_worst_s_first_rank_killed"),
              columns=("place", "strategy", "killed_rank", "repeat", "status", "checkpoint", "total_s", "phases_s.detected",
                       "phases_s.agreed", "phases_s.restored", "phases_s.first_step")),
    Benchmark("scale", "The metrics plane at scale: emulated workers' records through a real scheduler",
              "scale.py", headline=("records_lost_1024", "median_delay_s_1024", "p99_delay_s_1024",
                                    "scheduler_cores_1024"),
              quick_args=("--workers", "64", "--seconds", "5"), rows="rows",
              columns=("workers", "group", "messages_per_s", "records_lost", "median_delay_s", "p99_delay_s",
                       "cores.scheduler")),
    Benchmark("scale-relayed", "The metrics plane at scale, every 8 workers' records relayed as one message",
              "scale.py", args=("--group", "8"), headline=("records_lost_1024", "median_delay_s_1024",
                                                           "p99_delay_s_1024", "scheduler_cores_1024"),
              rows="rows", columns=("workers", "group", "messages_per_s", "records_lost", "median_delay_s",
                                    "p99_delay_s", "cores.scheduler")),
    Benchmark("runs-history", "A team's runs history: the dashboard on 200 finished runs, in a browser",
              "runs_history.py", measures=("scale.py",), headline=("start_s", "list_s", "open_s", "compare_s"),
              quick_args=("--runs", "20", "--repeats", "1"), rows="repeats"),
    Benchmark("dashboard-cost", "What watching costs: training with 10 browser pages of the dashboard open",
              "dashboard_cost.py", headline=("watched_vs_alone", "latency_median_s", "latency_p95_s"),
              quick_args=("--viewers", "1", "--repeats", "1", "--steps", "60")),
    Benchmark("dashboard-cost-websocket", "What viewers on their own machines cost: 0 to 50 websocket sessions",
              "dashboard_cost.py", args=("--kind", "websocket", "--viewers", "0,1,10,50"),
              headline=("vs_none_10", "cores_per_session_10"), rows="table",
              columns=("samples_per_s", "vs_none", "dashboard_cores", "dashboard_cores_per_session",
                       "viewer_cores", "updates_per_session_min")),
    # The GPU suite: each part under its own limit in benchmarks/gpu_check.sh (the device machine is lent
    # for about 15 minutes a session), with the settings that fitted it on an H200 (2026-11-27: one
    # repetition of the compiled comparison in 200 s, the second cut by the limit).
    Benchmark("gpu-gpt-compiled", "The real workload on a GPU: one compiled worker against a plain compiled loop",
              "gpt_gpu.py", args=("--parts", "1", "--warmup", "15", "--steps", "60", "--repeats", "1"),
              suites=("gpu",), needs="gpu", measures=("throughput.py",),
              headline=("one_worker_vs_plain", "plain_mfu", "workbench_mfu"),
              columns=("repeat", "plain_samples_per_s", "workbench_samples_per_s", "workbench_compute_ms")),
    Benchmark("gpu-gpt-strategies", "The real workload on a GPU: every strategy on two workers sharing it",
              "gpt_gpu.py", args=("--parts", "2", "--timeout", "90"), suites=("gpu",), needs="gpu", rows="strategies",
              measures=("throughput.py",),
              headline=("strategies_finished", "strategies_run", "worst_loss_vs_allreduce"),
              columns=("status", "samples_per_s", "held_out_loss", "bits_per_char", "staleness_mean",
                       "bytes_sent_per_step")),
    Benchmark("gpu-throughput", "Throughput on a GPU: a transformer in bf16 against a plain loop, DDP and the limit",
              "throughput.py", args=("--device", "cuda", "--repeats", "1"), suites=("gpu",), needs="gpu",
              measures=("throughput_cuda.py",),
              headline=("one_worker_vs_plain", "one_worker_vs_ddp_x1", "workbench_overhead_ms_per_step",
                        "ddp_x2_gloo_vs_limit", "allreduce_x2_vs_limit"),
              columns=("samples_per_s", "vs_plain", "vs_limit", "compute_ms", "comm_ms", "gpu_utilization")),
)

BY_NAME = {benchmark.name: benchmark for benchmark in BENCHMARKS}


def in_suite(suite: str) -> list[Benchmark]:
    """The benchmarks a suite runs (`quick`: those with quick arguments, on any machine)."""
    if suite not in SUITES:
        raise ValueError(f"suite {suite!r}: one of {', '.join(SUITES)}")
    if suite == "quick":
        return [b for b in BENCHMARKS if b.quick_args is not None]
    return [b for b in BENCHMARKS if suite in b.suites]
