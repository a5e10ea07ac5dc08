"""`auto`'s decisions: which strategy fits what the run measures, pure and apart from any I/O.

From the step records the workers already send, `measure` makes a `Window`: each worker's compute time
and rate, and what one exchange of the model costs (the exposed all-reduce under `allreduce`, the whole
averaging exchange under `average`, the round trip of a push under the parameter-server strategies).
`Chooser.observe` turns a stream of windows into at most one decision per condition: a `Choice` with the
strategy, its settings, the factor for the learning rate (README: the lr means something else after a
switch) and a one-line reason with the measurements. Hysteresis: the thresholds to enter and to leave a
choice differ, a choice must be seen in `confirm` windows in a row, and switches are `min_interval_s`
apart (a link reading far past its threshold, `clear`, needs one window fewer and is not held back; the
first move away from the start also needs one fewer, and a first move from allreduce to averaging one).
An overlapped exchange already hidden in half its period does not raise the period.
The supervisor applies a choice with the live switch; tests/unit/test_auto.py holds the table.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

SYNCHRONOUS = ("allreduce", "average")
PUSHES_IN_FULL = ("async", "ssp")  # every worker's push applied at the full lr (README)
# What a straggler gets under a synchronous strategy first: its share of each global batch cut to its speed
# (`balance`), the cluster's summed speed with nobody waiting. Where that does not even the steps: elastic
# averaging, where each worker exchanges with the center on its own every
# `period` steps, so nobody waits. Measured on the lab with one host at 30% of a core (benchmarks/auto.py,
# MLP 64-1024-1024-10): easgd period 16 reached the target in 105 s at 7,300 samples/s, average p16 (in
# lockstep with the straggler) in 157 s at 3,300, and async push_every 4 in 204-227 s at 3,100: its
# server serves a push of the whole model every 4 steps from each worker, on the same shared cores.
STRAGGLER_STRATEGY = "easgd"
STRAGGLER_MIN_PERIOD = 16
# The workers that wait for the last one wait this share of an exchange's cycle or more: a straggler,
# whatever the compute times say. A host whose CPU comes in bursts (a quota over 100 ms: full-speed steps
# and stalls) reads near its peers' compute time, and a slow host pays its part of the exchange at its own
# CPU's speed, which a balanced cut of the batch cannot shrink. Measured on the lab (MLP 784-1024-1024-10,
# host 2 at half a core over 100 ms, 8 s windows): under allreduce the fast worker waited 0.45 of the cycle
# at a compute spread of 0.59-0.61 (so `auto` stayed on allreduce, 4,467 samples/s, in one run of two),
# balanced 0.41 (4,887), where easgd p16 made 10,055; unlimited, with no slow host, 0.02.
WAIT_ABOVE = 0.3
# Balanced, the steps end together, but a straggler (slower per sample) still takes its part in every
# exchange at its own CPU's speed, which no cut of the batch shrinks. Where the workers then spend this share
# of their cycle or more exchanging and waiting, elastic averaging: nobody waits, each at its own speed. A
# third is the cost at which a link alone moves `allreduce` to averaging (an exchange of AVERAGE_ABOVE steps).
# Measured on the lab (MLP 784-1024-1024-10, host 2 at half a core over 100 ms): balanced `allreduce` spent
# 40-45% of its steps so (4,862 samples/s) where easgd p16 made 9,155; the exposed exchange alone read
# 0.26-0.62 steps, window by window, on both sides of the link's threshold, and `auto` stayed balanced
# (network benchmark, every repeat). The fidelity benchmark's GPT on such hosts (3.4 MB exchanged every
# 0.27 s step, host 2 at half a core over 10 ms) spends 4-7%: it stays balanced.
PACED_ABOVE = 1 / 3
# What a link too slow for any averaging gets: the same elastic averaging, period 16. Where even bf16 at
# MAX_PERIOD cannot hide an exchange, a synchronous strategy waits on the link at every exchange; under
# easgd only the workers behind the slow link wait, each on its own, and the center keeps moving with the
# others. Measured on the lab (benchmarks/auto.py, link 20 Mbit/s, a bf16 exchange 490 steps of compute):
# easgd period 16 reached the target in 108 s, average period 64 in bf16 in 224 s.
LINK_BOUND_STRATEGY, LINK_BOUND_PERIOD = "easgd", 16

# Thresholds, as fractions: one exchange's cost against one step's compute, and the slowest worker's speed
# against the fastest's. Entering and leaving a choice use different ones, so a condition at the edge
# does not flap.
AVERAGE_ABOVE = 0.5  # an exchange costs half a step or more: average
ALLREDUCE_BELOW = 0.15  # it costs under 15% of a step: allreduce, exact
STRAGGLER_BELOW = 0.6  # the slowest worker at under 60% of the fastest's speed: asynchronous
STRAGGLER_GONE_ABOVE = 0.8  # back over 80%: synchronous again
HIDDEN_SHARE = 0.1  # the period makes the exchange about this share of the compute it overlaps
# A link-driven move whose reading is this far past its threshold (an exchange of 2 steps or more under
# allreduce; a bf16 one past twice MAX_PERIOD) is confirmed one window sooner: at the edge three windows
# keep a wavering link from flapping, but a link that fell from unlimited to 20 Mbit/s read 446 steps
# against 64, and each window more is 2 s more of waiting on it (benchmarks/auto.py, changing link).
CLEAR = 2.0
# An overlapped exchange that lands within this share of its period is hidden already: the period is not
# raised for it. Its reading is its whole time beside the steps (under allreduce: the exposed all-reduce,
# HIDDEN_SHARE rules), and a longer period buys throughput only at a cost in learning per sample. Measured
# on the lab, links unlimited (benchmarks/auto.py, four runs each): average p64 at 10% more samples/s than
# p16 but 53.4 s to the target against 49.3; `auto` raised 16 -> 64 there on readings of 3.9-5.7 steps.
OVERLAP_FITS = 0.5
MAX_PERIOD = 64  # also the link-bound threshold (`fitting`): entered at a bf16 exchange over this many steps,
# left at a float32 one under it (half that in bf16), a band of 2x so a link at the edge does not flap


@dataclasses.dataclass(frozen=True)
class Window:
    """What the run measured over a few seconds under its current strategy."""

    strategy: str
    compute_s: dict[int, float]  # per worker: mean compute per step
    samples_per_s: dict[int, float]  # per worker
    exchange_s: float | None  # one exchange of the model, whole; None when none was seen in the window
    samples: dict[int, float] = dataclasses.field(default_factory=dict)  # per worker: mean samples a step
    # Synchronous: what the workers that wait for the last arrival wait at an exchange beyond the exchange
    # itself (the median over them of their median exchange, less the least one's); None otherwise.
    waiting_s: float | None = None
    # The workers' share of their time spent exchanging or waiting, not computing (the median worker's, over
    # the window's steps); None where not measured.
    idle_share: float | None = None

    @property
    def exchange_in_steps(self) -> float | None:
        """One exchange's cost in steps of compute (the median worker's)."""
        if self.exchange_s is None or not self.compute_s:
            return None
        return self.exchange_s / max(1e-9, statistics.median(self.compute_s.values()))

    @property
    def speed_spread(self) -> float:
        """The slowest worker's speed against the others' (their median; 1: all equal), from compute time
        per step: under a synchronous strategy every worker's rate is the slowest's, so rates cannot tell.
        Against the median, not the fastest: on shared cores one worker often runs ahead for a while."""
        if len(self.compute_s) < 2:
            return 1.0
        slowest = self.compute_s[self.slowest]
        others = [t for w, t in self.compute_s.items() if w != self.slowest]
        return statistics.median(others) / slowest if slowest > 0 else 1.0

    @property
    def slowest(self) -> int:
        return max(self.compute_s, key=self.compute_s.get) if self.compute_s else 0

    def per_sample(self) -> dict[int, float]:
        """Each worker's compute per sample (per step where the window has no sample counts): under a
        balanced cut the steps are even by design, and only this tells the slow host."""
        return {w: t / self.samples[w] if self.samples.get(w) else t for w, t in self.compute_s.items()}

    def per_sample_spread(self) -> float:
        """`speed_spread` by compute per sample: under a balanced cut the steps are even by design, and the
        straggler shows only here."""
        per_sample = self.per_sample()
        if len(per_sample) < 2:
            return 1.0
        return Window(self.strategy, per_sample, {}, None).speed_spread

    def waiting_share(self, period: int = 1) -> float | None:
        """The share of an exchange's cycle (`period` steps of compute and the exchange) that the workers
        waiting for the last arrival spend waiting: `waiting_s` against the median worker's compute. 0: the
        steps end together; None: not measured (asynchronous, or too few exchanges)."""
        if self.waiting_s is None or self.exchange_s is None or not self.compute_s:
            return None
        cycle = period * statistics.median(self.compute_s.values()) + self.exchange_s + self.waiting_s
        return self.waiting_s / cycle if cycle > 0 else None

    def straggler_reference(self) -> tuple[int, float]:
        """The slowest worker per sample, and the others' median compute per step at an equal part of the
        batch (the mean part): what its own compute time is judged against once nobody waits."""
        per_sample = self.per_sample()
        slowest = max(per_sample, key=per_sample.get)
        batch = statistics.fmean(self.samples.values()) if self.samples else 1.0  # per step without counts
        others = [t * batch for w, t in per_sample.items() if w != slowest]
        return slowest, statistics.median(others)


@dataclasses.dataclass(frozen=True)
class Choice:
    strategy: str
    settings: dict[str, Any]
    lr_factor: float  # multiply the learning rate by this as the switch is made
    reason: str


def measure(records: list[dict[str, Any]], strategy: str, since: dict[int, float] | None = None,
            workers: int | None = None) -> Window | None:
    """A window from step records (all workers, a few seconds of them); None when too few to judge.
    `since`: per worker, the time of the newest record an earlier window judged its exchange by; only
    exchanges that landed after it count, so each exchange is evidence once (see `AutoPilot`).
    `workers`: the run's; a synchronous window without records from each of them is not judged. Every
    worker takes every step there, so a missing one's records are late (over a link that just fell they
    queue behind the exchange), and it is the one the window most needs: on the lab at 2 Mbit/s a window
    of two workers in three read 187 steps, not the 400-550 of the complete windows around it, and began
    the count of windows confirming the move again (8 windows to the move, against 2-4 in other runs)."""
    by_worker: dict[int, list[dict[str, Any]]] = {}
    for record in records:
        by_worker.setdefault(record["worker"], []).append(record)
    if len(by_worker) < 2 or min(len(steps) for steps in by_worker.values()) < 3:
        return None
    if strategy in SYNCHRONOUS and workers is not None and len(by_worker) < workers:
        return None
    compute = {w: statistics.fmean(r["compute_s"] for r in steps) for w, steps in by_worker.items()}
    samples = {w: statistics.fmean(r["samples"] for r in steps) for w, steps in by_worker.items()}
    rates = {}
    for worker, steps in by_worker.items():
        span = max(r["time"] for r in steps) - min(r["time"] for r in steps)
        rates[worker] = sum(r["samples"] for r in steps[1:]) / span if span > 0 else 0.0
    # The exchanges seen (every all-reduce; averaging syncs, pushes answered), per worker. Asynchronous:
    # the slowest worker's decides (under easgd, workers behind a slow link exchange rarely, and a median
    # over all exchanges would be the fast ones'). Synchronous: every worker times the same collective, and
    # what one times beyond another's is waiting for a later arrival: the one that waited least (the
    # straggler, which arrives last) times the exchange itself. Read as the slowest, a worker at 40% of
    # the others' CPU (lab) made averaging's syncs read 307 steps of compute, a link too slow for bf16
    # period 64, and `auto` moved for the link instead of the straggler (the full suite, once).
    # A worker with none in the window: its exchange is not known yet.
    field = "comm_s" if strategy == "allreduce" else "comm_total_s"
    since = since or {}
    landed = {w: [r for r in steps if r.get(field) is not None and r["time"] > since.get(w, -math.inf)]
              for w, steps in by_worker.items()}
    if strategy in SYNCHRONOUS:
        landed = _same_exchanges(landed)
    costs = {w: [r[field] for r in steps] for w, steps in landed.items()}
    pick = min if strategy in SYNCHRONOUS else max
    medians = {w: statistics.median(c) for w, c in costs.items()} if all(costs.values()) else {}
    exchange = pick(medians.values()) if medians else None
    # What the others wait for the last arrival, by medians too: a held-out evaluation on worker 0 or a
    # one-off stall holds them back at one exchange in many, which the medians leave out. Waited is what
    # blocked the step (`comm_s`), not the exchange's whole time: an overlapped exchange is in flight beside
    # the steps, and the fast workers start theirs up to a period before the straggler starts its own, so
    # theirs read a period longer than its however little slower it is. On the lab (average p64 overlapped,
    # balanced, steps within 15% of each other) the others read as waiting 46% of their steps, and `auto`
    # left the balanced cut for easgd; they blocked for the difference of the periods only.
    waiting = None
    if strategy in SYNCHRONOUS and exchange is not None:
        last = min(medians, key=medians.get)
        blocked = medians if field == "comm_s" else {  # under allreduce the exchange is all blocking
            w: statistics.median(r.get("comm_s", 0.0) for r in steps) for w, steps in landed.items()}
        waiting = max(0.0, statistics.median(c for w, c in blocked.items() if w != last) - blocked[last])
    idle = [sum(r.get("comm_s", 0.0) + r.get("wait_s", 0.0) for r in steps) /
            sum(r["compute_s"] + r.get("comm_s", 0.0) + r.get("wait_s", 0.0) for r in steps)
            for steps in by_worker.values() if sum(r["compute_s"] for r in steps) > 0]
    return Window(strategy, compute, rates, exchange, samples, waiting, statistics.median(idle) if idle else None)


def _same_exchanges(landed: dict[int, list[dict[str, Any]]]) -> dict[int, list[dict[str, Any]]]:
    """Synchronous: only the exchanges every worker has a new record of, by step (each step's exchange is
    one collective on all of them). A worker whose records come late (over a link that just fell they queue
    behind the exchange) brings exchanges the others' were judged on a window before: read beside the
    others' later, slower ones, its earlier fast one made it the last arrival and the others looked as if
    waiting for it (on the lab at 2 Mbit/s, a straggler read in the window after the fall, and the count of
    windows confirming the move began again). None in common: no exchange is known yet (all kept, a late
    worker's fast exchange from before the fall read beside the others' slow ones as the exchange, the others
    as waiting for it, and a straggler's move began its count in the middle of the link's). Records without
    steps: all kept."""
    if not landed or any(r.get("step") is None for records in landed.values() for r in records):
        return landed
    common = set.intersection(*({r["step"] for r in records} for records in landed.values()))
    return {w: [r for r in records if r["step"] in common] for w, records in landed.items()}


def _period(exchange_in_steps: float) -> int:
    """A power of two that makes one exchange about HIDDEN_SHARE of the steps it overlaps."""
    wanted = max(2.0, exchange_in_steps / HIDDEN_SHARE)
    return int(min(MAX_PERIOD, 2 ** math.ceil(math.log2(wanted))))


def _averaging(exchange_in_steps: float, settings: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """`average`'s settings for an exchange of that cost, and their words: overlapped, the period that
    hides it, and bf16 on the wire (half the bytes) once even MAX_PERIOD steps cannot hide a float32
    exchange. bf16 stays on while averaging goes on: the exchange it measures is then half of what turned
    it on, and turning it off on that reading would flap."""
    period = _period(exchange_in_steps)
    bf16 = settings.get("wire_dtype") == "bf16" or exchange_in_steps / HIDDEN_SHARE > MAX_PERIOD
    chosen = {"period": period, "overlap": True, **({"wire_dtype": "bf16"} if bf16 else {})}
    return chosen, f"average, period {period}, overlapped" + (", bf16 on the wire" if bf16 else "")


def _in_bf16(steps: float, settings: dict[str, Any]) -> float:
    """An exchange's cost in steps as it would be in bf16 on the wire (half a float32 one's bytes)."""
    return steps if settings.get("wire_dtype") == "bf16" else steps / 2


def _lr_factor(current: str, chosen: str, workers: int) -> float:
    """Under `async` and `ssp` every push is applied in full: about `workers` times the step of a
    synchronous strategy at the same lr (measured, README); the lr follows a move to them, and back (`auto`
    comes from them when a user pinned one and turned `auto` on again). Elastic averaging's workers take
    their own steps at the job's lr: nothing to change."""
    if chosen in PUSHES_IN_FULL and current not in PUSHES_IN_FULL:
        return 1.0 / workers
    if current in PUSHES_IN_FULL and chosen not in PUSHES_IN_FULL:
        return float(workers)
    return 1.0


def fitting(window: Window, settings: dict[str, Any], spread: float | None = None,
            for_link: bool = False, can_balance: bool = True,
            idle: float | None = None) -> tuple[str, dict[str, Any], str] | None:
    """The strategy and settings the window calls for, with the reason; None: the current one fits.
    `spread`: the speed spread to judge by (default the window's; the chooser passes a smoothed one).
    `for_link`: the run is asynchronous because the link was too slow, not for a straggler: the way back
    is the link's alone. Under easgd the worker that holds the center serves every push on its own host's
    CPU and reads slower than the others (measured on the lab, three hosts at half a core: 2.5-3.5 ms a
    step against 1.8-2.0, a spread of 0.6-0.7 for a minute after the link came back, never "even"): the
    spread then reads the strategy, not the hosts. A straggler that is real shows once synchronous again.
    `can_balance`: every worker indexes the whole dataset, so `allreduce` can share a batch out by speed.
    `idle`: the share of their cycle the workers spend exchanging and waiting (default the window's; the
    chooser passes the mean over its recent windows)."""
    spread = window.speed_spread if spread is None else spread
    idle = window.idle_share if idle is None else idle
    steps = window.exchange_in_steps
    current, asynchronous = window.strategy, window.strategy not in SYNCHRONOUS
    # The link first: no cut of the batch hides an exchange that bf16 at MAX_PERIOD cannot, and elastic
    # averaging is also the answer to a straggler. On a link that slow the compute times swing besides (on
    # the lab at 2 Mbit/s a window read a spread of 0.51 between two of 554 and 486 steps an exchange), and
    # read first they began a straggler's count in the middle of the link's.
    if link_bound(window, settings):
        return (LINK_BOUND_STRATEGY, {"period": LINK_BOUND_PERIOD},
                f"an exchange costs {steps:.0f} steps of compute, more than period {MAX_PERIOD} hides even in bf16: "
                f"{LINK_BOUND_STRATEGY}, period {LINK_BOUND_PERIOD} (only the workers behind the slow link wait, each on its own)")
    if straggling(window, settings, spread):
        waiting = waiting_for_the_last(window, settings)
        slow = (f"worker {window.slowest} computes at {spread:.0%} of the others' speed" if spread < STRAGGLER_BELOW
                else f"the workers wait {waiting:.0%} of their steps for worker {window.straggler_reference()[0]}")
        if can_balance and not settings.get("balance"):
            # First the move that keeps training synchronous: the straggler takes a smaller share of each
            # global batch (a live setting of both synchronous strategies). Where that cannot even the steps
            # (a delay that is not per sample, a CPU in bursts), the next windows leave for elastic averaging.
            return (current, {"balance": True},
                    f"{slow}: {current}, balanced (each worker's share of the global batch follows its speed)")
        # The period that hides the exchange, at least 16: each exchange is also served by the center.
        period = max(STRAGGLER_MIN_PERIOD, _period(steps)) if steps is not None else STRAGGLER_MIN_PERIOD
        return (STRAGGLER_STRATEGY, {"period": period},
                f"{slow}: {STRAGGLER_STRATEGY}, period {period} "
                f"(nobody waits: each worker exchanges with the center on its own)")
    if paced_by_a_straggler(window, settings, idle):
        period = max(STRAGGLER_MIN_PERIOD, _period(steps)) if steps is not None else STRAGGLER_MIN_PERIOD
        return (STRAGGLER_STRATEGY, {"period": period},
                f"worker {window.straggler_reference()[0]} computes at {window.per_sample_spread():.0%} of the "
                f"others' speed per sample, and the balanced steps spend {idle:.0%} of their time exchanging and "
                f"waiting: {STRAGGLER_STRATEGY}, period {period} (nobody waits: each worker exchanges with the center on its own)")
    if asynchronous and spread < STRAGGLER_GONE_ABOVE and not for_link:
        return None  # still uneven: stay asynchronous
    if steps is None:
        return None
    if asynchronous and steps >= MAX_PERIOD:
        return None  # the link is still too slow for averaging: stay
    if asynchronous:  # even again, or the link back: the link decides between the synchronous strategies
        why = f"the link is back ({steps:.1f} steps an exchange)" if for_link else f"workers even again ({spread:.0%})"
        if steps >= AVERAGE_ABOVE:
            chosen, words = _averaging(steps, {})
            return ("average", chosen, f"{why}, an exchange costs {steps:.1f} steps: {words}")
        return ("allreduce", {}, f"{why}, an exchange costs {steps:.2f} steps: allreduce (exact)")
    if current == "allreduce" and steps >= AVERAGE_ABOVE:
        chosen, words = _averaging(steps, {})
        return ("average", chosen, f"an exchange costs {steps:.1f} steps of compute: {words}")
    if current == "average" and steps <= ALLREDUCE_BELOW:
        return ("allreduce", {}, f"an exchange costs {steps:.2f} steps of compute: allreduce (exact)")
    if current == "average" and steps >= AVERAGE_ABOVE:
        chosen, _ = _averaging(steps, settings)
        period = settings.get("period", 0)
        if settings.get("overlap") and steps <= OVERLAP_FITS * period and chosen["period"] >= period:
            return None  # hidden behind the steps already: nothing to raise
        # A run's settings name every field ("float32" too); a choice names bf16 only.
        wire_changes = chosen.get("wire_dtype", "float32") != settings.get("wire_dtype", "float32")
        if chosen["period"] != settings.get("period") or wire_changes:
            change = f"period {settings.get('period')} -> {chosen['period']}" + (", bf16 on the wire" if wire_changes else "")
            return ("average", chosen, f"an exchange costs {steps:.1f} steps of compute: {change}")
    return None


def link_bound(window: Window, settings: dict[str, Any]) -> bool:
    """Whether a synchronous window's exchange costs more steps than MAX_PERIOD hides even in bf16."""
    steps = window.exchange_in_steps
    return window.strategy in SYNCHRONOUS and steps is not None and _in_bf16(steps, settings) > MAX_PERIOD


def straggling(window: Window, settings: dict[str, Any], spread: float | None) -> bool:
    """Whether a synchronous window shows a straggler: the slowest worker under STRAGGLER_BELOW of the
    others' speed, or the others waiting for the last one WAIT_ABOVE of their steps or more."""
    return window.strategy in SYNCHRONOUS and (
        (spread is not None and spread < STRAGGLER_BELOW) or waiting_for_the_last(window, settings) is not None)


def paced_by_a_straggler(window: Window, settings: dict[str, Any], idle: float | None) -> bool:
    """Whether a balanced synchronous window still has a straggler by compute per sample, and its workers
    spend PACED_ABOVE of their cycle or more exchanging and waiting (`idle`)."""
    return (window.strategy in SYNCHRONOUS and bool(settings.get("balance")) and idle is not None
            and idle >= PACED_ABOVE and window.per_sample_spread() < STRAGGLER_BELOW)


def waiting_for_the_last(window: Window, settings: dict[str, Any]) -> float | None:
    """Under a synchronous strategy, the share of their steps the workers wait for the last one, where it is
    WAIT_ABOVE or more (a straggler); None otherwise or where not measured."""
    if window.strategy not in SYNCHRONOUS:
        return None
    period = settings.get("period", 1) if window.strategy == "average" else 1
    waiting = window.waiting_share(period)
    return waiting if waiting is not None and waiting >= WAIT_ABOVE else None


def clear(window: Window, settings: dict[str, Any], strategy: str) -> bool:
    """Whether a synchronous window's move to `strategy` is called for by a link reading CLEAR times past
    the threshold that calls for it (the chooser then confirms it one window sooner, and does not hold
    it back for the last switch)."""
    steps = window.exchange_in_steps
    if steps is None or window.strategy not in SYNCHRONOUS:
        return False
    if strategy == LINK_BOUND_STRATEGY:
        return _in_bf16(steps, settings) > CLEAR * MAX_PERIOD
    return window.strategy == "allreduce" and strategy == "average" and steps >= CLEAR * AVERAGE_ABOVE


def recovered_spread(recent: list[dict[int, float]], straggler: tuple[int, float] | None) -> float:
    """How even the workers are again, judged while asynchronous over the `recent` windows' compute times
    per step (oldest first): the better of two readings, each robust to the seconds-long swings of
    workers sharing cores (measured: 50-100% of each other's speed from one window to the next).

    - Each worker's median over the windows, slowest against the others' median (as `speed_spread`).
    - The straggler's own median against the compute time the others had when it was called a
      straggler (`straggler`: its rank and that reference): its own speed back, whatever the others do
      now that nobody waits for anyone and they run flat out.
    """
    workers = set().union(*recent) if recent else set()
    medians = {w: statistics.median(c[w] for c in recent if w in c) for w in workers}
    spread = Window("async", medians, {}, None).speed_spread if len(medians) >= 2 else 1.0
    if straggler is not None and straggler[0] in medians and medians[straggler[0]] > 0:
        spread = max(spread, straggler[1] / medians[straggler[0]])
    return spread


class Chooser:
    """Decides from a stream of windows; at most one choice per `min_interval_s`, each seen `confirm`
    times in a row first (where the link reading is `clear`, and for the first choice: one fewer)."""

    RECENT = 3  # windows whose medians judge a recovery

    def __init__(self, workers: int, confirm: int = 3, min_interval_s: float = 8.0) -> None:
        self.workers, self.confirm, self.min_interval_s = workers, confirm, min_interval_s
        self._candidate: tuple[str, tuple[tuple[str, Any], ...]] | None = None
        self._seen = 0
        self._last_choice_at = -math.inf  # none yet: the next choice is the run's first
        self.spread: float | None = None  # what the last decision was judged by
        self._recent: list[dict[int, float]] = []  # compute times per worker, the last RECENT windows
        self._recent_idle: list[float] = []  # the workers' idle shares, the last RECENT windows
        self.straggler: tuple[int, float] | None = None  # rank, and the others' compute time at the time
        self.for_link = False  # asynchronous because the link was too slow (`fitting`)
        self.can_balance = True  # the run's data can be shared out by speed (`fitting`)

    @property
    def pending(self) -> bool:
        """Whether a choice has been seen and waits to be confirmed."""
        return self._seen > 0

    def observe(self, window: Window | None, settings: dict[str, Any], now: float) -> Choice | None:
        if window is not None:
            self._recent = (self._recent + [window.compute_s])[-self.RECENT:]
            if window.idle_share is not None:
                self._recent_idle = (self._recent_idle + [window.idle_share])[-self.RECENT:]
            # Slowing down counts at once (a straggler must not be waited for); a recovery is judged
            # over the recent windows (`recovered_spread`).
            asynchronous = window.strategy not in SYNCHRONOUS
            self.spread = recovered_spread(self._recent, self.straggler) if asynchronous else window.speed_spread
        # The idle share by the mean of the recent windows: one window's reading moves by a tenth with the
        # slow host's bursts, and near PACED_ABOVE a window below it began the count again.
        idle = statistics.fmean(self._recent_idle) if self._recent_idle else None
        found = fitting(window, settings, self.spread, self.for_link, self.can_balance, idle) if window is not None else None
        if found is None and (window is None or window.exchange_s is None):
            # Too few steps or no exchange landed in the window (a slow link, a switch being made):
            # neither for nor against a candidate.
            return None
        if found is None:
            self._candidate, self._seen = None, 0
            return None
        strategy, chosen, reason = found
        # A move to another strategy is confirmed by the strategy alone, with the settings of the window
        # that confirms it: the period that fits wavers with the measured exchange from window to window
        # (measured: 32 and 64 in turn), and keyed on it a move back from async was never confirmed.
        key = (strategy,) if strategy != window.strategy else (strategy, tuple(sorted(chosen.items())))
        self._seen = self._seen + 1 if key == self._candidate else 1
        self._candidate = key
        # A clear link reading is also not held back by the last switch: it moves away from the link
        # (averaging, easgd), and the way back is still confirmed and spaced as usual, so it cannot flap.
        # Measured: a move to period 64 (unlimited) held the move to easgd after the link fell for 8 s.
        obvious = clear(window, settings, strategy)
        # The first move away from the start is also confirmed one window sooner: there is no earlier
        # choice to flap back to, and each window more is 2 s more under allreduce while it does not fit
        # (measured: a third of the time `auto` lost to the best fixed strategy, unlimited and straggler).
        # A first move from allreduce to averaging, one more sooner: one window decides it. Made wrongly, it
        # costs little (averaging keeps pace with allreduce where the link is fast, and the way back is
        # confirmed as usual); a first move to easgd still waits for two (speeds on shared cores swing).
        first = self._last_choice_at == -math.inf
        if first and window.strategy == "allreduce" and strategy == "average":
            needed = max(1, self.confirm - 2)
        elif first or obvious:
            needed = max(1, self.confirm - 1)
        else:
            needed = self.confirm
        if self._seen < needed or (now - self._last_choice_at < self.min_interval_s and not obvious):
            return None
        self._candidate, self._seen, self._last_choice_at = None, 0, now
        if strategy not in SYNCHRONOUS and window.strategy in SYNCHRONOUS:  # for judging its recovery
            self.for_link = link_bound(window, settings)  # as `fitting` judges: the link first
            # Per sample: a balanced cut has evened the steps, and the slow host has the smaller share.
            self.straggler = None if self.for_link else window.straggler_reference()
        elif strategy in SYNCHRONOUS:
            self.straggler, self.for_link = None, False
        self._recent, self._recent_idle = [], []  # a new strategy (or setting): measure afresh
        return Choice(strategy, chosen, _lr_factor(window.strategy, strategy, self.workers), reason)
