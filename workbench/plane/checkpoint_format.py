"""Checkpoints: what one holds, where the data position is, and checking one against a model.

A checkpoint is a plain dict, taken on the workers at one agreed step and written by the client into the
run directory atomically (temporary file, then rename):

- `step`: optimizer steps every worker had made (the data position: epoch and batch follow from it and
  the shard size, since shards are a pure function of seed, epoch, rank and world size);
- `weights`: the model's state dict, common to all workers (the average, or the parameter server's);
- `optimizer`: the job optimizer's state as `averaging.flat_optimizer_state` (the workers' mean, or the
  server's); `strategy`, `settings`, `lr`: what was training, as last switched or changed;
- `strategy_state`: e.g. the parameter server's version, steps since the last average, `average`'s
  global weights and outer momentum (with an exchange in flight: as once it is applied);
- `ranks`: per worker, its random-number state and its compression residual and momentum, used when the
  run resumes on as many workers as it had;
- `world_size`, `generation` (how many times the workers were regrouped), `time`.

Pure functions here are unit-tested; the snapshot store below is the worker-side hand-over point, and
what a worker keeps of the last one the client took or sent it (`KeptCheckpoint`).
"""
from __future__ import annotations

import copy
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from workbench.errors import ResumeError, WorkbenchError
from workbench.plane.rundir import atomic_write

CHECKPOINT_FILE = "checkpoint.pt"
JOB_FILE = "job.pkl"


def age(checkpoint: dict[str, Any]) -> tuple[int, int, bool]:
    """Orders checkpoints of one run: later groups, then later steps, then a group's final one."""
    return checkpoint.get("generation", -1), checkpoint["step"], bool(checkpoint.get("final"))


def data_position(step: int, steps_per_epoch: int) -> tuple[int, int]:
    """(epoch, batches of that epoch already trained) after `step` steps."""
    if steps_per_epoch < 1:
        raise ValueError(f"steps_per_epoch must be >= 1, got {steps_per_epoch}")
    return divmod(step, steps_per_epoch)


def all_finite(tensors: Any) -> bool:
    """Whether every floating-point tensor in a (nested) dict or list is free of NaN and infinity."""
    if isinstance(tensors, torch.Tensor):
        return not tensors.is_floating_point() or bool(torch.isfinite(tensors).all())
    if isinstance(tensors, dict):
        return all(all_finite(value) for value in tensors.values())
    if isinstance(tensors, (list, tuple)):
        return all(all_finite(value) for value in tensors)
    if isinstance(tensors, float):
        return math.isfinite(tensors)
    return True


def check_matches_model(checkpoint: dict[str, Any], model: torch.nn.Module, path: str) -> None:
    """Refuse a checkpoint whose weights do not fit `model` (another architecture), naming the difference."""
    expected = {name: tuple(value.shape) for name, value in model.state_dict().items()}
    found = {name: tuple(value.shape) for name, value in checkpoint["weights"].items()}
    if expected == found:
        return
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    shapes = [f"{name} {found[name]} vs {expected[name]}" for name in sorted(set(found) & set(expected))
              if found[name] != expected[name]]
    difference = "; ".join(part for part in (
        f"missing {', '.join(missing[:3])}" if missing else "",
        f"unexpected {', '.join(extra[:3])}" if extra else "",
        f"shapes differ: {', '.join(shapes[:3])}" if shapes else "") if part)
    raise ResumeError("checkpoint", path, "a checkpoint of the job's model",
                      f"It was saved from another model ({difference}). Resume with the job that wrote it")


def save(path: str | os.PathLike[str], checkpoint: dict[str, Any]) -> None:
    """Write atomically: a reader sees the previous checkpoint or this one, never a torn file."""
    atomic_write(Path(path), lambda handle: torch.save(checkpoint, handle))


def load(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint of a run directory, or `ResumeError` saying what is missing."""
    directory = Path(run_dir)
    if not directory.exists():
        raise ResumeError("run_dir", str(run_dir), "an existing run directory", "No such directory")
    if not directory.is_dir():
        raise ResumeError("run_dir", str(run_dir), "a run directory", "It is a file")
    if not any(directory.iterdir()):
        raise ResumeError("run_dir", str(run_dir), "a run directory", "It is empty: no run was ever started there")
    path = directory / CHECKPOINT_FILE
    if not path.is_file():
        raise ResumeError("run_dir", str(run_dir), f"a run directory holding {CHECKPOINT_FILE}",
                          "The run ended before its first checkpoint; set checkpoint_every_steps or "
                          "checkpoint_every_s so that runs keep one")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        raise ResumeError("run_dir", str(run_dir), f"a readable {CHECKPOINT_FILE}",
                          f"Loading it failed with {type(error).__name__}: {error}") from None
    if not isinstance(checkpoint, dict) or "weights" not in checkpoint or "step" not in checkpoint:
        raise ResumeError("run_dir", str(run_dir), f"a {CHECKPOINT_FILE} written by the workbench")
    return checkpoint


# --- worker side: rank 0 leaves each checkpoint here for the client to fetch -----------------------------

_snapshots: dict[str, dict[str, Any]] = {}
_snapshots_lock = threading.Lock()
_fetched = threading.Condition(_snapshots_lock)  # notified when the client takes one
# Per run, the last checkpoint the client took from this worker or sent it (`keep_copy`), kept: if this
# worker survives a loss, the next group's rank here starts from it without the checkpoint crossing the link
# again (on the lab at 100 Mbit/s, sending gpt-mini's weights and AdamW state was 0.9-1.2 s of a 1.6-2.2 s
# recovery).
_kept: dict[str, dict[str, Any]] = {}


def identity(checkpoint: dict[str, Any]) -> tuple[Any, ...]:
    """What tells one checkpoint of a run from every other: its group, step and the time it was taken."""
    return checkpoint.get("generation"), checkpoint["step"], checkpoint.get("time")


@dataclasses.dataclass(frozen=True)
class KeptCheckpoint:
    """Sent to a worker in place of a checkpoint it holds already (`holds`): the run and its identity."""

    run_id: str
    identity: tuple[Any, ...]

    def resolve(self) -> dict[str, Any]:
        """A copy of the kept checkpoint: the optimizer's loaded state aliases the tensors it is given, and
        training must not change what a later regroup may start from again."""
        with _snapshots_lock:
            kept = _kept.get(self.run_id)
        if kept is None or identity(kept) != self.identity:
            raise WorkbenchError(f"the checkpoint of run {self.run_id} at step {self.identity[1]} that this worker "
                                 "kept is gone (the worker was restarted?)")
        return copy.deepcopy(kept)


def holds(run_id: str, wanted: tuple[Any, ...]) -> bool:
    """Whether this worker keeps the checkpoint of `run_id` with identity `wanted` (run on the worker)."""
    with _snapshots_lock:
        kept = _kept.get(run_id)
    return kept is not None and identity(kept) == wanted


def keep_copy(run_id: str, checkpoint: dict[str, Any]) -> bool:
    """A Dask task the client runs on the group's other workers once it has a checkpoint: keep it here too
    (unless this worker keeps a newer one), so that if rank 0's worker is lost the survivors start the next
    group from their own memory. True when it is kept."""
    with _snapshots_lock:
        kept = _kept.get(run_id)
        if kept is not None and age(kept) > age(checkpoint):
            return False
        _kept[run_id] = checkpoint
        return True


def forget(run_id: str) -> None:
    """The run has ended: the checkpoint kept for it goes (run on every worker)."""
    with _snapshots_lock:
        _kept.pop(run_id, None)


def leave_snapshot(run_id: str, checkpoint: dict[str, Any]) -> None:
    """Keep the newest checkpoint of `run_id` in this worker process (an older one not yet fetched goes)."""
    with _snapshots_lock:
        _snapshots[run_id] = checkpoint


def take_snapshot(run_id: str) -> dict[str, Any] | None:
    """A Dask task the client runs on rank 0's worker: the newest checkpoint left there (None when an
    earlier fetch took it already); kept here too, for a next group that starts on this worker."""
    with _fetched:
        snapshot = _snapshots.pop(run_id, None)
        if snapshot is not None:
            _kept[run_id] = snapshot
        _fetched.notify_all()
        return snapshot


def wait_fetched(run_id: str, checkpoint: dict[str, Any], timeout_s: float, interrupted: Callable[[], bool]) -> bool:
    """Until the client has taken `checkpoint` (left for `run_id`): True; False when `timeout_s` passed
    or `interrupted()` first (checked every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    with _fetched:
        while _snapshots.get(run_id) is checkpoint:
            left = deadline - time.monotonic()
            if left <= 0 or interrupted():
                return False
            _fetched.wait(min(left, 0.05))
    return True
