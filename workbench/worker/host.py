"""The worker machine made ready for training: the device, the thread count, the allocator and the
worker's own housekeeping (the profiler, the event loop's timers), and GPU gauges for the step records. Nothing
here knows about runs or strategies."""
from __future__ import annotations

import ctypes
import gc
import os
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from workbench.errors import TrainingError


def resolve_device(requested: str) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise TrainingError("device='cuda' was asked for, but this worker sees no CUDA device")
    return torch.device("cuda", 0)  # dask-cuda gives each worker its own GPU as cuda:0


def describe_device(requested: str) -> dict[str, Any]:
    """What this worker trains on, for the run's config: the device and its name as the driver reports it
    (run on each worker through `client.run` before training; never raises, the loop checks the request)."""
    if requested == "cpu" or not torch.cuda.is_available():
        return {"device": "cpu", "name": _cpu_model() or platform.processor() or platform.machine()}
    properties = torch.cuda.get_device_properties(0)
    return {"device": "cuda:0", "name": properties.name, "memory_mb": properties.total_memory // 2**20,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _cpu_model() -> str | None:
    """The processor's model name on Linux (`platform.processor()` is empty there)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    except OSError:
        return None


# The worker's event-loop housekeeping on a timer, at the intervals it keeps while a rank trains: those of
# the clusters the workbench starts (cluster/connection.py). Dask's defaults wake the loop every 20 ms only to
# warn when it was blocked, check memory every 100 ms and sample the system every 500 ms; in a worker idle
# but for a training thread that cost 2.0% of a core (1.25 for the tick alone), 0.25% at these intervals,
# measured (distributed 2026.7.1, 2-core VM). On the lab's host at half a core (`allreduce` balanced, the GPT)
# the worker's event-loop thread took 0.43 s of CPU in 20 s of training, 0.19 s quieted, and the training
# thread 3.5% more: a `dask worker` started from the command line keeps Dask's defaults.
HOUSEKEEPING_MS = {"tick": 500, "memory_monitor": 1000, "monitor": 2000}
PROFILER = ("profile", "profile-cycle")  # the statistical profiler samples every thread every 10 ms


def configure_worker_for_training(worker: Any) -> tuple[bool, Callable[[], None]]:
    """Quiet the worker's own housekeeping that competes with training for the CPU: the profiler stopped,
    the timed housekeeping slowed to HOUSEKEEPING_MS (design.md section 5). Clusters the workbench starts are
    configured this way already; this also covers existing clusters (`dask worker` from the command line).
    Returns whether the allocator was tuned, and what puts the housekeeping back as it was (call it once
    the rank is done): a shared cluster's workers keep their diagnostics for the work that follows.
    """
    torch.set_num_threads(max(1, int(getattr(worker.state, "nthreads", 1))))
    tuned = keep_freed_memory()
    freeze_what_is_loaded()
    changed: dict[str, float | None] = {}  # callback: its interval before (None: it ran and was stopped)

    def quiet() -> None:  # on the worker's event loop, which owns its periodic callbacks
        for name in PROFILER:
            callback = worker.periodic_callbacks.get(name)
            if callback is not None and callback.is_running():
                callback.stop()
                changed[name] = None
        for name, interval_ms in HOUSEKEEPING_MS.items():
            callback = worker.periodic_callbacks.get(name)
            if callback is not None and callback.callback_time < interval_ms:  # never quickens one
                changed[name], callback.callback_time = callback.callback_time, interval_ms

    def restore() -> None:
        for name, interval_ms in changed.items():
            callback = worker.periodic_callbacks.get(name)
            if callback is None:
                continue
            if interval_ms is None:
                callback.start()
            else:
                callback.callback_time = interval_ms
        changed.clear()

    worker.loop.add_callback(quiet)
    return tuned, lambda: worker.loop.add_callback(restore)


_frozen = False


def freeze_what_is_loaded() -> None:
    """Leave the objects alive before this process's first run (torch's, Dask's, the worker's: several
    hundred thousand) out of the cyclic garbage collector's full scans, once per process.

    A rank leaving its group runs a full collection so that its process group's sockets and a parameter
    server's handles go at once (`worker/loop.py`), on the path of every run's end and every regroup: it
    scanned all of them each time, 0.19-0.24 s here, against 0.07-0.08 s frozen (measured). Full scans
    during training get as much shorter. What is frozen is never collected as a cycle: the first run's own
    arguments may be among it; anything not in a cycle is still freed by its reference count."""
    global _frozen
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen = True


# glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# The largest threshold glibc's own dynamic adjustment reaches on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
MMAP_THRESHOLD_BYTES = 32 << 20


def keep_freed_memory() -> bool:
    """Let this worker's allocator reuse freed tensor memory instead of handing it back to the OS at once.

    A Dask nanny starts its worker with `MALLOC_TRIM_THRESHOLD_=65536`, which also switches off glibc's
    dynamic mmap threshold: every tensor over 128 KiB was then mapped and unmapped each step. Measured on
    the benchmark's MLP (784-1024-1024-10, batch 128): 4,657 page faults a step with the variable set, 1,333
    without it, 1 after this call; about 25% of step time. The environment cannot be changed after
    start-up (glibc reads it once), but `mallopt` can, so this works on any cluster, however started.
    Measured in a worker thread on the same MLP: 8,146 page faults and 83-88 ms a step with the variable,
    852-912 and 38-43 ms without it, 53-2,598 and 32-34 ms with it and this call. Returns whether it
    applied (glibc only)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                    and libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): nothing of this applies


class GpuGauge:
    """GPU memory and utilisation for the step records, read at most once a second (NVML is not free)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        self._interval_s = interval_s
        self._next = 0.0
        self._last: dict[str, float] = {}

    def sample(self, device: torch.device) -> dict[str, float]:
        now = time.monotonic()
        if now >= self._next:
            self._next = now + self._interval_s
            self._last = {"gpu_memory_mb": torch.cuda.memory_allocated(device) / 2**20}
            try:
                self._last["gpu_utilization"] = float(torch.cuda.utilization(device))
            except Exception:  # no NVML binding on this machine: memory only
                pass
        return dict(self._last)
