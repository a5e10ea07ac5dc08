"""A run's hold on its workers: asking the scheduler's lease book for free ones (at once, or waiting in
the queue), growing into joining workers, and giving workers back, with messages that say who holds what.

The decisions are the lease book's (`workbench.cluster.leases`, on the scheduler); this is the run's side of it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from workbench.cluster import leases
from workbench.errors import ConfigError

QUEUE_POLL_S = 0.5  # how often a waiting run asks whether its workers are free (a dict from the scheduler)


class Placement:
    """The workers one run holds on a shared cluster."""

    def __init__(self, client: Any, run_id: str, owner: str) -> None:
        self.client, self.run_id, self.owner = client, run_id, owner
        self.position: int | None = None  # the run's place in the queue while it waits (1: next)
        self.wanted = 0
        self.holders = ""  # who holds the workers it waits for, as last heard
        self._woken = threading.Event()

    def request(self, wanted: int, queue: bool) -> list[str] | None:
        """`wanted` free workers for the run, or None when it waits in the queue (`queue`); refused with
        a message naming `workers`, the free count and who holds the rest otherwise."""
        self.wanted = wanted
        answer = leases.acquire(self.client, self.run_id, self.owner, wanted, queue)
        if answer["state"] == "leased":
            return answer["workers"]
        total = len(answer["workers"])
        if answer["state"] == "impossible":
            raise ConfigError("workers", wanted, f"at most {total}, the workers in this cluster",
                              "Start more workers or ask for fewer")
        self._note(answer)
        if answer["state"] == "refused":
            waiting = f"; {len(answer['queue'])} run(s) wait for workers ahead" if answer["queue"] else ""
            raise ConfigError("workers", wanted, f"at most {len(answer['free'])}, the free workers of {total} "
                              f"now{waiting}", f"Held: {leases.describe_holders(answer)}. Pass queue=True "
                              "(workbench train --queue) to wait for them, or ask for fewer")
        return None

    def wait(self, given_up: Callable[[], bool]) -> list[str] | None:
        """Wait in the queue until the run's workers are leased (returned), or until `given_up()` (the
        run was stopped: its place is cancelled) or the place was lost (its client was gone): None."""
        while not given_up():
            answer = leases.poll(self.client, self.run_id)
            if answer["state"] == "leased":
                self.position = None
                return answer["workers"]
            if answer["state"] == "gone":
                return None
            self._note(answer)
            self._woken.wait(QUEUE_POLL_S)
        self.give_back()
        return None

    def wake(self) -> None:
        """Make a waiting `wait` look at `given_up` now."""
        self._woken.set()

    def grow(self, workers: list[str]) -> list[str]:
        """Lease those of `workers` that are free (none while another run waits); returns them."""
        return leases.extend(self.client, self.run_id, workers)

    def free_workers(self) -> list[str]:
        return leases.view(self.client)["free"]

    def held_by_others(self, workers: list[str]) -> str:
        """Who holds `workers` (and who waits), for a refused join."""
        view = leases.view(self.client)
        held = {w: info for w, info in view["workers"].items() if w in workers and info}
        parts = [f"{w} by run {info['run_id']} ({info['owner']})" for w, info in sorted(held.items())]
        if view["queue"]:
            parts.append(f"{len(view['queue'])} run(s) wait for workers, and they come first")
        return "; ".join(parts) or "they are not free"

    def give_back(self, workers: list[str] | None = None) -> None:
        """Release the run's workers (all, or those listed), or its place in the queue; best effort: a
        scheduler that is gone took the lease book with it."""
        try:
            leases.release(self.client, self.run_id, workers)
        except Exception:
            pass

    def _note(self, answer: dict[str, Any]) -> None:
        self.position = answer.get("position")
        self.holders = leases.describe_holders(answer)
