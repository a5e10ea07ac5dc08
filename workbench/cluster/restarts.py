"""A cluster the workbench starts keeps the nanny of every worker it restarts.

Dask's `SpecCluster` closes a worker's nanny when, `distributed.deploy.lost-worker-timeout` (15 s) after
the scheduler removed the worker, no worker of that name is registered. The timer is not tied to that
removal: when the same worker dies again while its nanny restarts it (a second fault within 15 s of the
first, as the fault tests and a chaos run make), the first removal's timer fires mid-restart, closes the
nanny, and the worker never comes back (the "Restarting worker" that was a nanny's last word). Measured
by killing a rank's worker of a 3-worker cluster mid-run every ~5 s: a nanny closed 0.8 s into a restart
after 4, 5, 9 and 19 kills in 4 runs; with these timers, 40 kills in a row, each worker back in 1.8-2.6 s.
Here a removal's timer acts only if nothing was heard of that worker's name since.
"""
from __future__ import annotations

import asyncio
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed.deploy.cluster import Cluster


class LostWorkerTimers:
    """Which removal of a worker name is the latest: each add or remove of the name makes the earlier
    removals' timers stale. Pure; one per cluster."""

    def __init__(self) -> None:
        self._heard: dict[Any, int] = {}  # name -> adds and removes heard of

    def heard(self, name: Any) -> int:
        """An add or a remove of `name`; returns the token of this event."""
        self._heard[name] = self._heard.get(name, 0) + 1
        return self._heard[name]

    def still_lost(self, name: Any, token: int) -> bool:
        """Whether the removal with `token` is still the last thing heard of `name`."""
        return self._heard.get(name) == token


def keep_restarting_nannies(cluster: Any) -> None:
    """Give `cluster` (a `SpecCluster`: LocalCluster, LocalCUDACluster, ...) lost-worker timers tied to the
    removal that started them, in place of `SpecCluster._update_worker_status`'s."""
    timers = LostWorkerTimers()

    def update(op: str, msg: Any) -> None:
        if op == "add":
            for info in msg.get("workers", {}).values():
                timers.heard(info.get("name"))
        elif op == "remove":
            name = cluster.scheduler_info["workers"].get(msg, {}).get("name")
            token = timers.heard(name)

            def close_if_still_lost() -> None:
                registered = any(info.get("name") == name for info in cluster.scheduler_info["workers"].values())
                if timers.still_lost(name, token) and not registered and name in cluster.workers:
                    cluster._futures.add(asyncio.ensure_future(cluster.workers[name].close()))
                    del cluster.workers[name]

            delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
            asyncio.get_running_loop().call_later(delay, close_if_still_lost)
        Cluster._update_worker_status(cluster, op, msg)  # the scheduler's view of the workers, kept as Dask keeps it

    cluster._update_worker_status = update
