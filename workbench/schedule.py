"""The learning-rate schedule of a job: a factor on the learning rate at each step, pure arithmetic.

`lr_factor` gives linear warm-up over `warmup_steps`, then either a constant rate or a cosine decay to
`min_lr_fraction` of it at the run's last step (as nanoGPT and most language-model recipes). The worker
loop multiplies the run's learning rate (the job's, or the one set while it runs) by it before each step, so
the same schedule holds under every strategy: the parameter-server strategies send the scheduled rate with
each push and the server's optimizer applies it.
"""
from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, total_steps: int, schedule: str = "constant", warmup_steps: int = 0,
              min_lr_fraction: float = 0.1) -> float:
    """The factor on the learning rate at `step` (0-based) of a run of `total_steps` steps."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    decay_steps = max(total_steps - warmup_steps - 1, 1)
    progress = min(max(step - warmup_steps, 0) / decay_steps, 1.0)
    return min_lr_fraction + (1.0 - min_lr_fraction) * 0.5 * (1.0 + math.cos(math.pi * progress))
