"""The phases of each recovery from lost workers, timed from a run's own records (pure: no cluster here).

A regroup after a loss goes through five moments, each a record the run keeps anyway:

- `fault`: the lost worker's last sign of life (`last_seen` of `worker-lost`: its last step's record);
- `detected`: the client declared it lost (`worker-lost`: the scheduler removed it, or it was stuck);
- `agreed`: the survivors ended their group and the client chose who goes on (`regrouped`);
- `restored`: every rank of the new group holds the checkpoint's state (`restored`: process group
  formed, shard loaded, weights, optimizer and strategy state restored, server shards started);
- `first step`: every rank of the new group has made its first step.

`recoveries(records)` gives, for every regroup that followed a loss, those moments and the four phases
between them (seconds), and the total from fault to first step after: what a user asks after a fault
("how long did it take, and where did the time go"), as SageMaker HyperPod reports its restart phases.
A recovery whose new group has not stepped yet is left out until it has.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from workbench.plane import kinds

PHASES = ("detected", "agreed", "restored", "first_step")  # each phase is named by the moment that ends it
PHASE_LABELS = {"detected": "fault to detected", "agreed": "detected to survivors agreed",
                "restored": "agreed to state restored", "first_step": "restored to first step after"}


def recoveries(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per regroup after lost workers, in order: `lost` (addresses), `generation` (the new
    group's), `from_step`, `moments` (kind -> time), `phases_s` (phase -> seconds) and `total_s`."""
    records = sorted(records, key=lambda record: record.get("time", 0.0))
    regroups = [r for r in records if r.get("kind") == kinds.REGROUPED and r.get("lost")]
    found = []
    for regroup in regroups:
        entry = _recovery(records, regroup)
        if entry is not None:
            found.append(entry)
    return found


def _recovery(records: list[dict[str, Any]], regroup: dict[str, Any]) -> dict[str, Any] | None:
    generation, agreed = regroup["generation"], regroup["time"]
    lost = [r for r in records if r.get("kind") == kinds.WORKER_LOST and r.get("generation") == generation - 1
            and r["time"] <= agreed]
    if not lost:
        return None
    detected = min(r["time"] for r in lost)
    # The first lost worker's last sign of life (a worker lost before its first step: when it was found).
    fault = min(min(r.get("last_seen") or r["time"], r["time"]) for r in lost)
    ranks = len(regroup["workers"])
    restored = [r["time"] for r in records if r.get("kind") == kinds.RESTORED and r.get("generation") == generation]
    if len(restored) < ranks:
        return None
    first_steps: dict[int, float] = {}
    for record in records:
        if record.get("kind") == kinds.STEP and record["time"] > agreed and record["worker"] not in first_steps:
            first_steps[record["worker"]] = record["time"]
    if len(first_steps) < ranks:
        return None
    moments = {"fault": fault, "detected": detected, "agreed": agreed, "restored": max(restored),
               "first_step": max(first_steps.values())}
    order = ("fault", *PHASES)
    phases = {phase: round(max(0.0, moments[phase] - moments[before]), 3) for before, phase in zip(order, order[1:])}
    return {"lost": sorted(r["address"] for r in lost), "generation": generation, "from_step": regroup.get("from_step"),
            "moments": moments, "phases_s": phases, "total_s": round(moments["first_step"] - fault, 3)}


def describe(recovery: dict[str, Any]) -> str:
    """One line for a person: total, then where the time went."""
    parts = ", ".join(f"{PHASE_LABELS[phase]} {recovery['phases_s'][phase]:.1f} s" for phase in PHASES)
    lost = ", ".join(recovery["lost"])
    return f"recovered from losing {lost} in {recovery['total_s']:.1f} s ({parts})"
