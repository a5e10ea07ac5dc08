"""What a user changes on a running run: pause, resume, stop, the learning rate, live settings, a switch of
strategy (or `auto` on and off), a checkpoint now, more workers. Each is refused at once where the run is
not training, and said to the workers through the run's control state (`plane/control.py`), recorded in
the run directory and announced. `RunControls` gives `Run` these methods."""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from workbench.errors import ConfigError, TrainingError
from workbench.job import check_lr
from workbench.plane import kinds
from workbench.run.autopilot import AUTO, AutoPilot, check_no_settings
from workbench.run.launcher import check_can_balance
from workbench.strategies import get_strategy, make_settings


class RunControls:
    """The acting side of `Run` (its state and parts are the handle's: control, directory, lifecycle)."""

    def _require_running(self) -> None:
        """Refuse a control action on a run that has not started or has ended."""
        if self.status == "created":
            raise TrainingError("the run has not started yet: call start() first (or train() without start=False)")
        if self.status == "queued":
            raise TrainingError(f"run {self.run_id} {self.waiting()}: it can be stopped, and changed once it trains")
        if self.done:
            raise TrainingError(f"run {self.run_id} has already ended ({self.status})")

    def pause(self) -> None:
        """Workers stop after their current step (at the next agreed step) until `resume()`."""
        self._set_paused(True)

    def resume(self) -> None:
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        if self.status in ("created", "queued"):
            self._require_running()
        if not self.done:
            self.control.update(paused=paused)
            if self.lifecycle.move("paused" if paused else "running", only_from=("running", "paused")):
                self.announce(kinds.RUN_STATUS)

    def stop(self) -> None:
        """End the run cleanly: workers finish their step, synchronise, and the final weights are kept.
        A run waiting in the queue leaves it."""
        if self.status != "created" and not self.done:
            self.stop_requested = True  # also when the workers are being regrouped right now
            if self.status == "queued" or self.control is None:
                self.placement.wake()  # the queued run's supervisor gives its place up
            else:
                self.control.update(stop=True)

    def set_lr(self, lr: float) -> None:
        """Change the learning rate on every worker while the run trains."""
        lr = check_lr(lr)
        self._require_running()
        self.control.update(lr=lr)
        self.directory.append([{"kind": kinds.CONTROL, "time": time.time(), "lr": lr}])

    def update(self, **settings: Any) -> None:
        """Change strategy settings that may change live (e.g. `period` for 'average')."""
        live = get_strategy(self.strategy).settings_class.live
        for key in settings:
            if key not in live:
                raise ConfigError(key, settings[key], f"a live setting of '{self.strategy}' ({', '.join(live) or 'none'}); "
                                  f"other settings change with switch('{self.strategy}', {key}=...)")
        self._require_running()
        make_settings(self.strategy, {**self.control.state.settings, **settings})  # validates values
        if settings.get("balance"):
            check_can_balance(self.prepared)
        self.control.update(settings=settings)
        self.directory.append([{"kind": kinds.CONTROL, "time": time.time(), **settings}])

    def switch(self, strategy: str, by_auto: bool = False, **settings: Any) -> None:
        """Switch every worker to `strategy` (with `settings`, defaults for the rest) while the run trains.

        All workers change at one step: the largest any of them has reached when they meet (the others
        train up to it first). The weights and the optimizer state carry over: a parameter server starts
        from the averaged weights and optimizer state; workers leaving a parameter server take its
        weights and its optimizer state. Each worker records a 'switched' event. A paused run makes the
        switch and stays paused. A run started with strategy='auto' is pinned to what is asked here.
        `switch('auto')` turns `auto` on (again): it chooses from the strategy the run has now.
        """
        if strategy == AUTO:
            check_no_settings(settings)
            self._require_running()
            if self.auto_pilot is None:
                self.auto_pilot = AutoPilot(len(self.worker_addresses))
            self.auto_pilot.turn_on(self)
            self.config["auto"] = True
            self.directory.append([{"kind": kinds.CONTROL, "time": time.time(), "strategy": AUTO}])
            self.announce(kinds.RUN_STATUS, auto=True)
            return
        strategy_class = get_strategy(strategy)
        validated = make_settings(strategy, settings)
        self._require_running()
        strategy_class.check_world(validated, len(self.worker_addresses))
        state = self.control.switch(strategy, dataclasses.asdict(validated))
        self.strategy = strategy
        if self.auto_pilot is not None and not by_auto:
            self.auto_pilot.pin(self, f"switch('{strategy}') asked for by hand")
        self.directory.append([{"kind": kinds.CONTROL, "time": time.time(), "switch_id": state.switch_id,
                                "strategy": strategy, "settings": dataclasses.asdict(validated)}])
        self.announce(kinds.RUN_STATUS, settings=dataclasses.asdict(validated))

    def pin(self) -> None:
        """Keep the current strategy: turn `auto` off for the rest of the run (a switch by hand does too)."""
        if self.auto_pilot is None:
            raise TrainingError(f"run {getattr(self, 'run_id', '?')} was not started with strategy='auto': "
                                "its strategy changes only when you switch it")
        self.auto_pilot.pin(self, "pinned by hand")

    def checkpoint(self, timeout: float = 60.0) -> dict[str, Any]:
        """Take a checkpoint now (all workers at one step) and return where it was written."""
        self._require_running()
        if self.status == "paused":
            raise TrainingError("the run is paused: workers take a checkpoint when they go on; resume() first")
        before = self.checkpoint_info["written"] if self.checkpoint_info else 0.0
        self.control.update(checkpoint_id=self.control.state.checkpoint_id + 1)
        self._wait_for(lambda: self.checkpoint_info is not None and self.checkpoint_info["written"] > before,
                       timeout, "a new checkpoint")
        return dict(self.checkpoint_info)

    def add_workers(self, addresses: list[str] | None = None) -> list[str]:
        """Add workers that joined the cluster (default: all not training in this run). The run takes a
        checkpoint at one step, ends the current group and goes on with the larger one: the new workers
        get the current weights and their shard of the data. Returns the workers the run goes on with."""
        self._require_running()
        return self.supervisor.members.add_workers(addresses, automatic=False)
