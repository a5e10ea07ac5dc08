"""Fidelity at each one's own learning rate: DDP and the averaging configurations on the real workload, each
swept over peak learning rates, so that a gap to DDP is not a gap to an under-tuned DDP.

`benchmarks/fidelity.py` trains every run at one peak rate (`fidelity.LR`). At its rate before, 3e-3, this
sweep found DDP 0.29 above its loss at its best rate (1.5e-3, measured 2026-12-06), so the quality it judged
every strategy against was DDP below its best; its rate is DDP's best since. Here the same job
(`fidelity.job_fields`: the GPT, its data, schedule, batch, budget and evaluations), on the same two lab
hosts with the link unlimited (at equal samples the link changes no loss, only the time), runs DDP and
`TUNED` at each rate of `RATES` (seed 0), then `--seeds` seeds in all at each one's best rate (by its seed-0
loss). Each is judged at its own best rate, as DiLoCo and SparseLoCo tune their baselines. A rate at either
end of the sweep is flagged: the best may lie beyond it. Computed:

- `ddp_best_lr`, `ddp_loss_best_lr` (the median of its seeds there) and `ddp_default_lr_excess` (DDP's
  loss at fidelity.py's rate above its loss at its best, seed 0 both, as a fraction of the latter: 0 where
  fidelity.py's rate is still DDP's best);
- per configuration (`tuned`): its best rate, its loss there, its gap to DDP's at DDP's best
  (`gap_vs_tuned_ddp`), and the gap at fidelity.py's rate for both (`gap_at_default_lr`);
- `tuned_best` and `tuned_best_gap_vs_ddp` (the configuration lowest at its best rate, and its gap),
  `tuned_sync_gap_p64_outer`, `best_lr_at_edge` (configurations whose best rate ends the sweep).

The speeds on thin links (`fidelity.py --thin`) do not depend on the rate: its retentions stand, and its
gaps are read again here. About 45 minutes on the 2-core VM (each run about 50 s); run it where nothing
else runs.

    python benchmarks/fidelity_tune.py [--rates 0.00075,0.0015,0.003,0.006,0.012,0.024] [--seeds 3] [--steps 256]
                                       [--only ddp,sparse] [--out benchmarks/results/cpu-2core/fidelity-tune.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))
import fidelity  # noqa: E402
import resultfile  # noqa: E402

RATES = (7.5e-4, 1.5e-3, 3e-3, 6e-3, 1.2e-2, 2.4e-2)  # fidelity.LR and powers of two about it
# The synchronous averaging configurations whose gap to DDP the docs quote: their losses repeat to the last
# digit on the same code and seed (the timing-dependent ones, async and auto, would need many seeds a rate).
TUNED = ("average p16", "average p64 outer", "average p16 sparse", "average p4 sparse",
         "average p1 overlap sparse")


def condition_of(lr: float) -> str:
    """A cell's condition names its rate: the picture's panels and the table's sections, one per rate."""
    return f"lr {lr:g}"


def plan(rates: tuple[float, ...], names: tuple[str, ...]) -> list[tuple[float, str]]:
    """Seed 0 of every configuration at every rate, rate by rate, DDP first in each."""
    return [(lr, name) for lr in rates for name in ("ddp", *names)]


def best_rates(cells: list[dict[str, Any]]) -> dict[str, float]:
    """Each configuration's best rate: the lowest held-out loss of its seed 0 at the end of the budget."""
    first: dict[str, dict[float, float]] = {}
    for cell in cells:
        if cell["seed"] == 0 and fidelity.final_loss(cell) is not None:
            first.setdefault(cell["config"], {})[cell["lr"]] = fidelity.final_loss(cell)
    return {name: min(losses, key=losses.get) for name, losses in first.items()}


def seeded(cells: list[dict[str, Any]], seeds: int) -> list[tuple[float, str, int]]:
    """Once every rate is measured: seeds 1 to `seeds - 1` of each configuration at its best rate."""
    return [(lr, name, seed) for name, lr in best_rates(cells).items() for seed in range(1, seeds)]


def tune_headline(cells: list[dict[str, Any]], default_lr: float = fidelity.LR) -> dict[str, Any]:
    """The keys above, from the raw cells (each with its `config`, `lr`, `seed` and held-out curve);
    `default_lr`: fidelity.py's rate, the one the excess and the gaps at the default are read at."""
    best = best_rates(cells)
    if "ddp" not in best:
        return {}
    runs = [c for c in cells if fidelity.final_loss(c) is not None]
    swept = sorted({c["lr"] for c in runs})

    def loss(name: str, lr: float | None, seed0: bool = False) -> float | None:
        return fidelity.median_or_none([fidelity.final_loss(c) for c in runs
                                        if c["config"] == name and c["lr"] == lr and (c["seed"] == 0 or not seed0)])

    ddp_best, ddp_default = loss("ddp", best["ddp"]), loss("ddp", default_lr, seed0=True)
    ddp_best_seed0 = loss("ddp", best["ddp"], seed0=True)  # the excess compares seed 0 with seed 0, as chosen
    table: dict[str, dict[str, Any]] = {}
    for name, lr in best.items():
        at_best, at_default = loss(name, lr), loss(name, default_lr, seed0=True)
        rates = sorted({c["lr"] for c in runs if c["config"] == name})
        table[name] = {
            "best_lr": lr, "loss_best_lr": at_best,
            "seeds_at_best_lr": sum(1 for c in runs if c["config"] == name and c["lr"] == lr),
            "gap_vs_tuned_ddp": (at_best - ddp_best) / ddp_best,
            "loss_default_lr": at_default,
            "gap_at_default_lr": (at_default - ddp_default) / ddp_default if None not in (at_default, ddp_default)
            else None,
            "best_lr_at_edge": len(rates) < 2 or lr in (rates[0], rates[-1]),
            "loss_by_lr": {f"{r:g}": loss(name, r, seed0=True) for r in rates}}
    others = [name for name in table if name != "ddp"]
    winner = min(others, key=lambda n: table[n]["loss_best_lr"]) if others else None
    outer = table.get("average p64 outer")
    return {"tuned": table, "rates": swept, "ddp_best_lr": best["ddp"], "ddp_loss_best_lr": ddp_best,
            "ddp_default_lr_excess": (ddp_default - ddp_best_seed0) / ddp_best_seed0 if ddp_default is not None
            else None,
            "tuned_best": winner, "tuned_best_gap_vs_ddp": table[winner]["gap_vs_tuned_ddp"] if winner else None,
            "tuned_sync_gap_p64_outer": outer["gap_vs_tuned_ddp"] if outer else None,
            "best_lr_at_edge": [name for name, row in table.items() if row["best_lr_at_edge"]]}


draw = fidelity.draw  # held-out loss against wall time, a panel per rate (a cell's condition names its rate)


def run_cell(lab: Any, client: Any, scratch: Path, lr: float, name: str, seed: int, steps: int,
             counter: list[int], timeout_s: float) -> dict[str, Any]:
    strategy, settings = ("ddp", {}) if name == "ddp" else next((s, k) for n, s, k in fidelity.CONFIGS if n == name)
    lab.restore_workers(client, [1, 2])
    fidelity.set_condition(lab, "unlimited")
    began = time.time()
    if strategy == "ddp":
        cell = fidelity.run_ddp(lab, scratch, steps, seed, counter, timeout_s, lr=lr)
    else:
        try:
            cell = fidelity.run_workbench(client, scratch, strategy, settings, steps, seed, timeout_s, lr=lr)
        except Exception as error:  # noqa: BLE001 - recorded; the sweep goes on
            cell = {"error": f"{type(error).__name__}: {error}"}
    cell.update(condition=condition_of(lr), lr=lr, link="unlimited", config=name, strategy=strategy,
                settings=settings, seed=seed, cell_s=time.time() - began)
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default=",".join(f"{r:g}" for r in RATES),
                        help="peak learning rates, comma-separated")
    parser.add_argument("--seeds", type=int, default=3, help="seeds in all at each one's best rate")
    parser.add_argument("--steps", type=int, default=256, help="steps per worker, the budget of every run")
    parser.add_argument("--only", default=None, help="comma-separated parts of configuration names (DDP always runs)")
    parser.add_argument("--cell-timeout-s", type=float, default=900)
    parser.add_argument("--out", default=None)
    arguments = parser.parse_args()
    rates = tuple(float(r) for r in arguments.rates.split(",") if r)
    if not rates or min(rates) <= 0 or arguments.seeds < 1 or arguments.steps < 1:
        parser.error(f"--rates {arguments.rates!r}, --seeds {arguments.seeds}, --steps {arguments.steps}: "
                     "positive rates, at least one seed and one step")
    names = tuple(n for n in TUNED if not arguments.only or any(o in n for o in arguments.only.split(",")))
    from network import LAB_DESCRIPTION
    from testbed import lab as labs

    import workbench

    reason = labs.available()
    if reason:
        sys.exit(f"benchmarks/fidelity_tune.py needs the emulated-host lab: {reason}")
    out = Path(arguments.out or resultfile.path_for("fidelity-tune"))
    steps = arguments.steps
    document = resultfile.document("fidelity-tune", {
        "model": fidelity.MODEL, "parameters": sum(p.numel() for p in workbench.gpt(fidelity.MODEL)().parameters()),
        "context": fidelity.CONTEXT, "batch_per_worker": fidelity.BATCH, "rates": list(rates),
        "default_lr": fidelity.LR, "steps": steps, "seeds": arguments.seeds, "configs": list(names),
        "budget": f"{steps} steps per worker ({steps * fidelity.BATCH * 2} samples) for every run, link unlimited",
        "eval_every": fidelity.EVAL_EVERY, "eval_windows": fidelity.EVAL_WINDOWS, "worker_hosts": 2},
        description=LAB_DESCRIPTION)
    document["cells"] = []
    began, counter = time.time(), [0]
    with tempfile.TemporaryDirectory(prefix="workbench-fidelity-tune-") as folder, labs.Lab(hosts=3) as lab:
        scratch = Path(folder)  # the runs' folders and DDP's curves, gone with the lab
        lab.start_cluster()
        client = lab.connect(workers=2)
        document["corpus"] = fidelity.text_data().train.describe()
        queue = [(lr, name, 0) for lr, name in plan(rates, names)]
        while queue:
            lr, name, seed = queue.pop(0)
            cell = run_cell(lab, client, scratch, lr, name, seed, steps, counter, arguments.cell_timeout_s)
            document["cells"].append(cell)
            print(f"[{(time.time() - began) / 60:5.1f} min] lr {lr:<7g} {name:<28} seed {seed}: "
                  f"{fidelity.outcome(cell)}", flush=True)
            if not queue and seed == 0:
                queue = seeded(document["cells"], arguments.seeds)  # every rate measured: the seeds at the best
            document.update(tune_headline(document["cells"], fidelity.LR), minutes=(time.time() - began) / 60)
            resultfile.write(out, document)  # what was measured survives a cut
    print(json.dumps({k: v for k, v in document.items() if k not in ("cells", "machine", "settings", "corpus")},
                     default=str))


if __name__ == "__main__":
    main()
