"""What the link allows a run: read from the running strategy's own exchanges, as step records arrive.

Pure (no I/O, no clock): `LinkBook` keeps, per worker, what it needs of the newest step records and
`limit` turns it into figures a user reads to see whether compute, the link or waiting bounds the run:

* the link's rate: each worker's fastest exchange (bytes moved over the time it took) reads its link;
  the others waited longer (in a shard's queue, behind a straggler);
* bytes per step: what the worker moved since the strategy started, over its steps (an exchange every
  64 steps counts as 1/64 of its bytes on each);
* what the link alone would allow: each step costing only its link time (bytes per step over the rate);
  what compute alone would allow: each step costing only its compute time (the median);
* ranks paced by the slowest (allreduce and average in step, ssp within its bound) go at the slowest
  worker's pace, in the limits and in what the run makes; ranks at their own pace (async, easgd) each at
  theirs, their rates summed;
* the bound: the lower of the two limits, or "waiting" when the run makes under `WAITING_SHARE` of what
  computing and then exchanging, one after the other and never overlapped, would make, the exchanges
  taking the time they took over the window (bytes per step at their summed time per byte): an exchange
  queued behind others on a link they share (every rank's push and reply cross the parameter server's
  host) is time on the link, not waiting.

Under a strategy that hides its exchange behind compute (allreduce's buckets), only the exposed part is
timed: the link reads faster than it is and the limit errs high, so "compute" is what it says.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import Any

STEP_WINDOW = 64  # step records per worker the rates are read over (the newest)
EXCHANGE_WINDOW = 16  # exchanges per worker the link is read from (the newest)
WAITING_SHARE = 0.8  # below this share of compute-then-exchange, time goes to neither: waiting
# A worker whose newest record is older than the newest of all by this many of its step intervals (and
# STALE_FLOOR_S) no longer counts: lost, or left in a regroup.
STALE_STEPS, STALE_FLOOR_S = 3, 5.0


@dataclasses.dataclass
class _Worker:
    strategy: str | None
    steps: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=STEP_WINDOW))
    exchanges: collections.deque = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=EXCHANGE_WINDOW))
    moved: float = 0.0  # bytes since the strategy started on this worker
    counted: int = 0  # steps since then


def _number(value: Any) -> float:
    """A record's field as a number: missing, None or NaN count as 0."""
    return float(value) if isinstance(value, (int, float)) and value == value else 0.0


class LinkBook:
    """Per worker, the newest step records' times and the newest exchanges, under the strategy it runs."""

    def __init__(self) -> None:
        self.workers: dict[int, _Worker] = {}
        self.strategy: str | None = None  # the newest record's

    def add(self, record: dict[str, Any]) -> None:
        """One step record (fields as the worker loop writes them)."""
        strategy, worker = record.get("strategy"), record.get("worker")
        if worker is None:
            return
        self.strategy = strategy
        entry = self.workers.get(worker)
        if entry is None or entry.strategy != strategy:  # a switch: the new strategy read on its own
            entry = self.workers[worker] = _Worker(strategy)
        entry.steps.append((_number(record.get("time")), _number(record.get("samples")),
                            _number(record.get("compute_s"))))
        moved = _number(record.get("bytes_sent")) + _number(record.get("bytes_received"))
        took = _number(record.get("comm_total_s")) or _number(record.get("comm_s"))
        entry.moved, entry.counted = entry.moved + moved, entry.counted + 1
        if moved > 0 and took > 0:
            entry.exchanges.append((moved, took))

    def _current(self) -> list[_Worker]:
        """The workers of the newest strategy still reporting."""
        entries = [e for e in self.workers.values() if e.strategy == self.strategy and e.steps]
        if not entries:
            return []
        newest = max(e.steps[-1][0] for e in entries)
        return [e for e in entries if newest - e.steps[-1][0] <= max(STALE_FLOOR_S, STALE_STEPS * _interval(e))]

    def limit(self, paced: bool, min_records: int = 2) -> dict[str, Any] | None:
        """The link's rate and limit, compute's limit, the run's rate and its bound (see the module's
        docstring); None until every current worker has `min_records` step records (at least two) and one
        exchange."""
        entries = self._current()
        if not entries or any(len(e.steps) < max(2, min_records) or not e.exchanges for e in entries):
            return None
        samples = [statistics.median(s for _, s, _ in e.steps) for e in entries]
        compute = [statistics.median(c for _, _, c in e.steps) for e in entries]
        rates = [max(moved / took for moved, took in e.exchanges) for e in entries]
        per_step = [e.moved / e.counted for e in entries]
        link = [moved / rate for moved, rate in zip(per_step, rates)]
        made = _made(entries, samples, paced)

        def rate(step_s: list[float]) -> float:
            """Samples/s when each worker's step takes `step_s`: `paced`, at the slowest one's pace."""
            if paced:
                slowest = max(step_s)
                return sum(samples) / slowest if slowest > 0 else float("inf")
            return sum(s / t if t > 0 else float("inf") for s, t in zip(samples, step_s))

        link_limit, compute_limit = rate(link), rate(compute)
        # The exchanges' own time per byte, summed over the window: where they queue in bursts (three
        # ranks' pushes meeting at the server's host: 1.3-1.5 s alone, 2.0-2.5 s together) a median reads
        # the quiet ones and called a link-bound ssp run "waiting" (54% of the link, in a lab test).
        typical = [moved * sum(took for _, took in e.exchanges) / sum(m for m, _ in e.exchanges)
                   for moved, e in zip(per_step, entries)]
        one_after_other = rate([c + t for c, t in zip(compute, typical)])
        bound = "link" if link_limit < compute_limit else "compute"
        if made < WAITING_SHARE * one_after_other:
            bound = "waiting"
        exchanges = [took for e in entries for _, took in e.exchanges]
        return {"samples_per_s": made, "link_mb_per_s": min(rates) / 1e6, "bytes_per_step": statistics.fmean(per_step),
                "link_samples_per_s": link_limit, "compute_samples_per_s": compute_limit,
                "share_of_link": made / link_limit if link_limit > 0 else 0.0, "bound": bound,
                "exchange_s": statistics.median(exchanges), "compute_s": max(compute),
                "compute_s_per_worker": compute, "steps_per_exchange": _steps_per_exchange(entries),
                "workers": len(entries), "strategy": self.strategy}


def _made(entries: list[_Worker], samples: list[float], paced: bool) -> float:
    """Samples/s the run makes. Ranks paced by the slowest make it at the slowest one's steps/s: under ssp a
    rank may run ahead of the others by up to its staleness bound over the window read (rank 0 with the
    shards on its host did, 7 steps in 23), which a sum of each rank's own rate counts as speed the group
    never sustains (it read 107% of what the link allows in CI)."""
    steps_per_s = [(len(e.steps) - 1) / span if (span := e.steps[-1][0] - e.steps[0][0]) > 0 else 0.0
                   for e in entries]
    if paced:
        return min(steps_per_s) * sum(samples)
    return sum(rate * worker_samples for rate, worker_samples in zip(steps_per_s, samples))


def _interval(entry: _Worker) -> float:
    """A worker's median seconds between step records."""
    times = [t for t, _, _ in entry.steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else 0.0


def _steps_per_exchange(entries: list[_Worker]) -> float:
    """Steps between exchanges, from the bytes: a step's share of the typical exchange."""
    typical = statistics.median(moved for e in entries for moved, _ in e.exchanges)
    per_step = statistics.fmean(e.moved / e.counted for e in entries)
    return typical / per_step if per_step > 0 else 0.0


def limit_text(limit: dict[str, Any] | None) -> str:
    """One line for the CLI's summary, the notebook panel and the dashboard ('' before there is one)."""
    if not limit:
        return ""
    bound = {"link": "bound by the link", "compute": "bound by compute",
             "waiting": "waiting bounds it: neither computing nor exchanging"}[limit["bound"]]
    return (f"link: about {limit['link_mb_per_s']:,.1f} MB/s, {_size(limit['bytes_per_step'])} a step per worker; "
            f"the link alone would allow {_rate(limit['link_samples_per_s'])} samples/s, compute alone "
            f"{_rate(limit['compute_samples_per_s'])}; the run makes {limit['samples_per_s']:,.0f}, "
            f"{limit['share_of_link']:.0%} of the link's limit ({bound})")


def _rate(value: float) -> str:
    return "unbounded" if value == float("inf") else f"{value:,.0f}"


def _size(value: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:,.1f} {unit}"
    return f"{value:,.0f} B"
