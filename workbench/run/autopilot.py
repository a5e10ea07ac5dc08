"""`auto` on the client: every few seconds the last window of step records goes to the chooser
(`run/auto_policy.py`, pure); a choice is carried out with the live switch, and the learning rate it calls for, and
recorded as an `auto-decision` event with its reason and measurements. A switch asked for by hand pins
the strategy: `auto` is off from then on, and an `auto-pinned` event says so; `switch('auto')` turns it
on again (`auto-on`), on any run.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

from workbench.errors import ConfigError, WorkbenchError
from workbench.plane import kinds
from workbench.run.auto_policy import SYNCHRONOUS, Chooser, measure
from workbench.strategies import get_strategy

AUTO = "auto"
SUMMARY = ("auto: the workbench picks the strategy and its settings from what the run measures (link, "
           "stragglers) and says why at each switch; a switch by hand or Pin turns it off")
START = "allreduce"  # exact, and the fastest where the link is fast: what `auto` starts with
WINDOW_S = 2.0  # seconds of step records one judgement looks at
# ... or this many, where those hold too few steps or no exchange: on a slow link a worker averaging every
# 16 steps waits seconds per exchange (measured at 20 Mbit/s: 3-4 s), and a short window holds none.
WIDE_WINDOW_S = 8.0
EARLIEST_S = 0.5  # a judgement on a newly landed exchange comes at least this long after the last one
# The run's first judgement comes as soon as every worker has this many steps past its first WARMUP_STEPS
# (which allocate and connect, and read slow), not at the first 2 s tick: under `allreduce` every step
# is an exchange, and on the lab's unlimited link the first move took effect 88-177 steps in, each at a third
# of averaging's throughput (1-2 s of a run that averaging finishes in about 50).
FIRST_STEPS = 24
WARMUP_STEPS = 8
log = logging.getLogger(__name__)


def check_no_settings(settings: dict[str, Any]) -> None:
    """`auto` picks the settings itself: any given is refused, naming the first."""
    if settings:
        name = next(iter(settings))
        raise ConfigError(name, settings[name], "no settings with strategy='auto' (it picks them)")


class AutoPilot:
    """Watches one run (ticked by its supervisor) and switches it when the chooser decides."""

    def __init__(self, workers: int, confirm: int = 3, min_interval_s: float = 8.0, window_s: float = WINDOW_S) -> None:
        self.chooser = Chooser(workers, confirm, min_interval_s)
        self.window_s = window_s
        self.on = True
        self.decisions = 0
        self.judged = 0  # windows judged so far that held enough steps to measure (a test waits on it)
        self.last_window: Any = None  # what the last judgement saw
        self._next = self._judged_at = 0.0
        # Per worker, the newest record whose exchanges were judged. An exchange counts as evidence once:
        # on a slow link one lands every few seconds, and an 8 s window that still held the fast ones
        # from before the link fell read as fast and cleared the choice the slow one had begun to
        # confirm; counted twice, a single slow exchange could confirm a move on its own.
        self._since: dict[int, float] = {}
        # When the last choice was made: later windows judge only what came after it. A setting changed
        # live (balance) keeps the strategy, and the records from before it would still read the straggler
        # it was made for, confirming a move away before the change could show.
        self._applied_at = 0.0
        # Held from a judgement to its decision's event: the supervisor's thread ticks, and a reader between
        # the chooser's reset and the decision's count saw no choice pending and no new decision.
        self._lock = threading.Lock()

    def progress(self) -> tuple[int, int, bool]:
        """Windows judged, decisions made, and whether a choice waits to be confirmed, read together."""
        with self._lock:
            return self.judged, self.decisions, self.chooser.pending

    def tick(self, run: Any, now: float) -> None:
        """Judge the last window when one is due, or sooner when the exchange it waits on has landed;
        switch the run if the chooser says so."""
        if not self.on or run.status != "running":
            return
        first = self._first_steps(run) if self.judged == 0 else None
        if now < self._next and first is None and not self._evidence_landed(run, now):
            return
        with self._lock:
            choice, decision = self._judge(run, now, first)
        if choice is None:
            return
        # Published outside the lock: a reader of `progress` may hold the feed's condition, which the
        # feed takes to store the event (both locks, taken in opposite orders, hung a lab test).
        run.feed.publish(decision)
        try:
            if choice.lr_factor != 1.0:
                run.set_lr(run.lr * choice.lr_factor)
            live = get_strategy(run.strategy).settings_class.live
            if choice.strategy == run.strategy and set(choice.settings) <= set(live):
                run.update(**choice.settings)  # a live setting (balance): no switch to make
            else:
                run.switch(choice.strategy, by_auto=True, **choice.settings)
            self._applied_at = time.time()
        except WorkbenchError as error:  # the run ended meanwhile, or the choice does not fit it
            self.pin(run, f"the switch was refused: {error}")

    def _judge(self, run: Any, now: float, first: list[dict[str, Any]] | None) -> tuple[Any, dict[str, Any] | None]:
        """Measure the window due and let the chooser judge it: its choice (or None) and the event that
        tells it."""
        window, newest = (measure(first, run.strategy), _newest(first)) if first is not None else \
            self._measure(run, self.window_s)
        if window is None or window.exchange_s is None:
            wide, wide_newest = self._measure(run, max(self.window_s, WIDE_WINDOW_S))
            if wide is not None:
                window, newest = wide, wide_newest
        # Synchronous, no exchange new since the last judgement: a slow link's next one is still on its way,
        # and the link is what such a window would be judged on. Checked again at each tick until it lands,
        # or judged on the steps alone once WIDE_WINDOW_S have passed (a straggler shows there too). Judged
        # at once, such windows took their turns between the slow readings: on the lab at 2 Mbit/s (records
        # come late behind the exchange), the move came on the sixth window after the fall, three of them
        # empty, where other runs took three.
        if (first is None and run.strategy in SYNCHRONOUS and window is not None and window.exchange_s is None
                and now - self._judged_at < WIDE_WINDOW_S):
            return None, None
        self._next, self._judged_at = now + self.window_s, now
        if window is not None and window.exchange_s is not None:
            # The exchanges judged now are not evidence again; a worker without records in the window (under
            # an asynchronous strategy) keeps its mark, or its exchanges judged before would count again.
            self._since = {**self._since, **newest}
        choice = self.chooser.observe(window, run.settings, now)
        self.judged, self.last_window = self.judged + (window is not None), window
        if window is not None and log.isEnabledFor(logging.DEBUG):  # what each judgement saw, to tune by
            log.debug("auto %s: spread %.2f (window %.2f), exchange %s steps, compute %s, seen %d of %s",
                      window.strategy, self.chooser.spread or 0, window.speed_spread, window.exchange_in_steps,
                      {w: round(t * 1000, 2) for w, t in window.compute_s.items()}, self.chooser._seen, self.chooser._candidate)
        if choice is None:
            return None, None
        lr = run.lr * choice.lr_factor
        self.decisions += 1
        steps = [r["step"] for r in run.table.last_steps().values()]
        return choice, {
            "kind": kinds.AUTO_DECISION, "time": time.time(), "step": min(steps) if steps else 0,
            "from": run.strategy, "to": choice.strategy,
            "settings": choice.settings, "lr": lr, "reason": choice.reason,
            "window": self.judged,  # the judgement that decided it, counted as `judged` counts
            "measured": {"exchange_in_steps": window.exchange_in_steps, "speed_spread": window.speed_spread,
                         "compute_s": window.compute_s, "samples_per_s": window.samples_per_s}}

    def _evidence_landed(self, run: Any, now: float) -> bool:
        """Whether a judgement waiting on the link may be made before its tick: the last one saw no new
        exchange, or saw slow ones and began to confirm a choice, and now every worker has a new one.
        On a slow link an exchange lands every few seconds, and the tick after it came up to a window
        later (measured: a fall to 20 Mbit/s decided 6.2-6.3 s after, two exchanges of about 2.4 s)."""
        last = self.last_window
        waiting = last is not None and (last.exchange_s is None or
                                        (self.chooser.pending and last.exchange_s >= self.window_s / 2))
        if not waiting or now - self._judged_at < EARLIEST_S:
            return False
        # Only the records since the last judgement: an exchange not judged yet landed after it, and a
        # slow link's run may wait like this for every tick it trains (0.25 s apart).
        window, _ = self._measure(run, now - self._judged_at)
        return window is not None and window.exchange_s is not None

    def _first_steps(self, run: Any) -> list[dict[str, Any]] | None:
        """Before the first judgement: every worker's steps past its warm-up, once each has FIRST_STEPS
        of them (None before that)."""
        workers = len(run.worker_addresses)
        if workers < 2:  # nothing to choose between (the chooser judges nothing either)
            return None
        by_worker: dict[int, list[dict[str, Any]]] = {w: [] for w in range(workers)}
        for record in run.table.recent_steps(WIDE_WINDOW_S):
            if record.get("strategy") == run.strategy and record["worker"] < workers:
                by_worker[record["worker"]].append(record)
        kept = [sorted(steps, key=lambda r: r["step"])[WARMUP_STEPS:] for steps in by_worker.values()]
        if min(len(steps) for steps in kept) < FIRST_STEPS:
            return None
        return [record for steps in kept for record in steps]

    def _measure(self, run: Any, seconds: float) -> tuple[Any, dict[int, float]]:
        """The window of the last `seconds`, counting only exchanges not judged before, and each worker's
        newest record in it."""
        workers = len(run.worker_addresses)
        records = [r for r in run.table.recent_steps(seconds) if r.get("strategy") == run.strategy
                   and r["worker"] < workers and r["time"] > self._applied_at]
        return measure(records, run.strategy, self._since, workers), _newest(records)

    def turn_on(self, run: Any) -> None:
        """Choose again from now on, judging afresh (what was measured before the pin is history)."""
        self.chooser = Chooser(len(run.worker_addresses), self.chooser.confirm, self.chooser.min_interval_s)
        self.on, self._next = True, 0.0
        run.feed.publish({"kind": kinds.AUTO_ON, "time": time.time(), "strategy": run.strategy})

    def pin(self, run: Any, why: str) -> None:
        """Turn `auto` off for good (a strategy chosen by hand), saying so once."""
        if self.on:
            self.on = False
            run.feed.publish({"kind": kinds.AUTO_PINNED, "time": time.time(), "strategy": run.strategy, "why": why})


def _newest(records: list[dict[str, Any]]) -> dict[int, float]:
    """Each worker's newest record time."""
    newest: dict[int, float] = {}
    for record in records:
        newest[record["worker"]] = max(newest.get(record["worker"], record["time"]), record["time"])
    return newest
