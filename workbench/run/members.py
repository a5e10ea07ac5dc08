"""One run's workers coming and going, as its supervisor acts on them: the roster of workers lost and
joined (`roster`, fed by the scheduler's membership events), each loss published with the lost rank's last
step, and a join asked for (`add_workers`, by hand or automatically), whose larger group the supervisor
starts once the current one has stopped (`regroup_to`)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from workbench.cluster.membership import Roster
from workbench.errors import ConfigError
from workbench.plane import kinds
from workbench.run.launcher import check_batch_fits, present_workers
from workbench.strategies import get_strategy, make_settings

if TYPE_CHECKING:  # the handle imports the supervisor, which imports this module
    from workbench.run.handle import Run


class Members:
    """The membership of `run`'s group as the supervisor sees it; the supervisor's thread and the user's
    `run.add_workers()` call it."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.roster = Roster()
        self.regroup_to: list[str] | None = None  # the workers to go on with once this group has stopped

    def take_changes(self) -> None:
        """Note the workers the scheduler removed (published as lost) and those that joined."""
        run = self.run

        def lost(address: str, when: float) -> None:
            self.publish_lost(address, when, "the scheduler removed the worker")

        def joined(address: str, when: float) -> None:
            run.feed.publish({"kind": kinds.WORKER_JOINED, "time": when, "address": address, "added": run.auto_join})

        self.roster.take(run.worker_addresses, lost, joined)

    def record_lost(self, address: str, when: float, reason: str) -> None:
        self.roster.lost.add(address)
        self.publish_lost(address, when, reason)

    def publish_lost(self, address: str, when: float, reason: str) -> None:
        run = self.run
        rank = run.worker_addresses.index(address)
        last = run.table.last_steps().get(rank, {})
        run.feed.publish({"kind": kinds.WORKER_LOST, "time": when, "rank": rank, "address": address,
                          "generation": run.generation, "step": last.get("step"), "last_seen": last.get("time"),
                          "reason": reason})

    def add_workers(self, addresses: list[str] | None, automatic: bool) -> list[str]:
        """Ask the group to stop at one step and go on with `addresses` added (default: every free
        worker); refused (automatic: published as 'join-refused') when they are held or do not fit."""
        run = self.run
        present = present_workers(run.client)
        if addresses is None:  # every free worker (those no other run holds)
            addresses = run.placement.free_workers()
        unknown = [a for a in addresses if a not in present]
        if unknown and automatic:  # joined and left again
            addresses = [a for a in addresses if a in present]
        elif unknown:
            raise ConfigError("addresses", unknown, "addresses of workers in the cluster", f"It has {present}")
        new = [a for a in addresses if a not in run.worker_addresses]
        self.roster.joined = [a for a in self.roster.joined if a not in addresses]
        if not new:
            return list(run.worker_addresses)
        added = run.placement.grow(new)  # only workers no other run holds, and none while runs wait
        try:
            if len(added) < len(new):
                held = [a for a in new if a not in added]
                raise ConfigError("addresses", held, "free workers (no other run holds them)",
                                  f"Held: {run.placement.held_by_others(held)}")
            following = list(run.worker_addresses) + new
            state = run.control.state
            get_strategy(state.strategy).check_world(make_settings(state.strategy, state.settings), len(following))
            check_batch_fits(run.prepared, len(following))
        except ConfigError as error:
            run.placement.give_back(added)
            if not automatic:
                raise
            run.feed.publish({"kind": kinds.JOIN_REFUSED, "time": time.time(), "workers": new, "reason": str(error)})
            return list(run.worker_addresses)
        self.regroup_to = following
        run.control.update(stop=True, regroup=True)
        return following
