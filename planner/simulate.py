"""A capacity-planning simulator of every strategy: calibrated from one real run's step records, it
predicts throughput (samples/s), the share of step time spent communicating and the mean staleness of
pushes for any number of workers, link rate and straggler. Pure arithmetic: no I/O, no Dask, no torch.

The model is a fluid one, in steady state, per class of identical workers (so 1024 workers cost no more
than 4). Each worker's cycle (the steps between its exchanges) is the longest of what bounds it:
- its own compute, at the CPU speed it gets (one training thread: at most one core, at most its host's
  cap, and less when the processes sharing the cores want more than there are);
- its exchange: a ring all-reduce moves 2(N-1)/N of the payload each way per worker, bucketed and
  overlapped with backward for `allreduce`; a parameter-server round trip moves the push up and the
  reply down the worker's link, and the server's link carries every remote worker's traffic;
- the server shard's own service (one actor per shard), and the link of the host holding it; that
  host's training thread gives turns to the pushes that come over a link (`server_turns`).
Moving bytes costs CPU too (serialising, copying, the kernel's veth), measured as the rate `host_rate`
at which one core moves an exchange when the link does not limit it; the wire and those copies overlap
for large messages, so a transfer takes the longer of the two. That time holds the kernel's network
work (charged to no process in particular) and waits for the peers: under a CPU quota on a host's
processes (the lab's straggler, a cgroup), only the part their own CPU time shows (`exchange_cpu_rate`)
counts against it and stretches; on shared cores, or a host's own, all of it does.

CPU is a budget per pool of cores: on the lab every emulated host shares the machine's cores (one pool
of `cores`); on real machines (`cores=None`) each host has `host_cores` of its own. Every runnable
process in a pool progresses at the same speed, found so that the pool's demand fits its cores. That is
the assumption that makes a lab of N hosts on 2 cores predictable: compute time scales with 1/speed
(with 4 workers on 2 cores, each computes at half speed). A process's demand is counted over the time it
has CPU work, not over its whole cycle: synchronous workers (`allreduce`, `average`) are released together
by each exchange, so they compute in lockstep and then wait on the wire together; a slow link leaves the
cores idle during that wait but does not let the computes run faster (the lab's time split: `average`'s 4
workers on 2 cores computed 0.033-0.037 s per step at every link rate, 100 Mbit/s included, against 0.018 s
on a core of their own). A host's cap (the lab's straggler: a cgroup quota; a real host's own cores)
holds all its threads, the shard's actor and the copies included, and its Dask processes' own share
(`host_background_cores`).
Calibration undoes the same sharing: on shared cores the calibration run's backward shared each
worker's core with the all-reduce's copies, so its measured compute holds some copying.

More processes than cores also lose some of the pool's work to taking turns (caches refilled after
every switch: `Calibration.crowding_loss`, measured with plain processes side by side).

What it leaves out: start-up, convergence (staler or rarer exchanges may need more steps to the same
accuracy), compression's CPU cost and per-message latency beyond `latency_s`.

Staleness (versions a push did not see) follows from the push rates: between a worker's fetch and its
next push every other worker pushes at its own rate, so with equal workers it is N-1 per push (and the
push-weighted mean is N-1 whatever the rates); SSP throttles the faster workers to the slowest one's
clock once their gap, growing at the difference of their push rates, reaches the bound, and they fetch
fresh weights after each wait.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

MIB = 1024 * 1024
BACKWARD_SHARE = 2 / 3  # of a step's compute: backward costs about twice the forward pass (dense layers)
SSP_THROTTLE_TOLERANCE = 0.03  # push rates closer than this count as equal: the SSP gap does not grow
COMPRESSED_FRACTION = {"none": 1.0, "fp16": 0.5}  # of float32 bytes; top-k sends values and int32 indices
WIRE_FRACTION = {"float32": 1.0, "fp16": 0.5, "bf16": 0.5}
# Of the gap between request/reply flows taking turns on a shard's link and the same flows at random
# phases, the share they lose on average to what knocks them out of turns. Flows fall into turns and out
# of them over seconds to tens of seconds (the lab, 3 workers, 100 Mbit/s: cycles of exactly the one-flow
# 1.25 s in turns, 1.5-2.4 s for a few cycles after a knock, about 2 s out of turns), and a window of
# 4-20 s sees either: over the lab grids' windows (2026-11-25-c, -d, -e, 2026-11-26, and the `ssp` grid)
# the remote flows lost a median 0.67 of the gap (`async` p4, 24 flows of 12 runs) and 0.83 (`ssp` p4, 15
# runs: 717-1,227 samples/s); two 60 s `ssp` runs lost 0.26 and 0.36.
TURNS_DISRUPTED = 0.75
MIN_CAP = 0.01  # cores: the least a capped host leaves its training once its Dask processes have their share


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What one real run measured, reduced to the few numbers the model needs (seconds, bytes)."""

    compute_s: float
    """One step's forward, backward and optimizer on one whole core, with nothing else running."""
    compute_spread: float
    """Relative spread (robust standard deviation / median) of one step's compute time: a synchronous
    step waits for the slowest of N such draws."""
    model_bytes: float
    """The float32 parameters: what one full exchange of the model carries each way."""
    host_rate: float
    """Bytes per second one core moves through an exchange (each way at once) when the link does not
    limit it: serialisation and copies, measured on the calibration run's link."""
    samples_per_step: int = 128
    step_overhead_s: float = 0.0
    """The training loop's own time per step beyond compute and communication (data, metrics, control
    checks), on one whole core."""
    latency_s: float = 0.0
    """Per message on the wire (the lab adds none: no netem); a ring all-reduce sends 2(N-1) per bucket."""
    server_apply_s: float = 0.0
    """The server's CPU time to apply one push, beyond moving its bytes (measured 0 unless known)."""
    exchange_cpu_rate: float | None = None
    """Bytes per CPU-second of the process itself (every thread) an exchange costs: from its CPU time
    (`cpu_s`), at least `host_rate`, whose time holds the kernel's network work (charged to no one in
    particular) and waits for the peers. What a CPU quota on the process counts (the lab's straggler, a
    cgroup). None: unknown, taken as `host_rate`."""
    sync_local_s: float = 0.0
    """An `average` sync's own work around its all-reduce (flattening the weights, the wire copy, the
    divergence, copying the mean back), on one whole core: measured on an `average` run's syncs, their
    time less the all-reduce's (`exchange_s`); 0 when calibrated from `allreduce`."""
    server_turns: float = 1.0
    """Of a push's and its reply's moving time (at `host_rate`), what the process of a shard's host gives
    each push that comes over a link, at most one core in all: its event loop handles the push taking
    turns with the training thread at the interpreter lock, though a core stands idle. Measured per
    thread on the lab (2 workers, `async` p4): the holder's training thread ran 0.96 of a core beside 0.8
    such pushes a second (100 Mbit/s), 0.78-0.84 beside 5.5-8.6 (1 Gbit/s; the other host at half a
    core), 21-28 ms a push where the moving time is 22 ms; its own pushes, over loopback, took none.
    0: a server whose process holds no worker."""
    host_background_cores: float = 0.04
    """CPU a worker host's Dask processes take beside the training (the nanny; the worker's event loop:
    heartbeats, metrics batches, the control's polls), which comes off a cap on the host (the lab's
    straggler, a cgroup counting all of them). Measured on the lab's host at half a core: the nanny 0.013
    of a core, the worker process 0.028 with no run; under training the cgroup used its whole 0.50. Not
    taken off shared cores: the lab's calibration run (2 of 4 hosts) left 0.12-0.135 cores idle, so its
    compute does not hold it, and where the pool is full (4 workers on 2 cores) that leaves predictions a
    few percent high; taken off there, two grids' 4-worker points fell 7-10% low (open)."""
    paced_cpu_s_per_byte: float = 0.5e-9
    """CPU seconds per byte of a parameter-server exchange (push and reply) that a link paces, at each end,
    beyond `moving_cpu_s`: each end's event loop wakes for every socket buffer's worth of bytes instead of
    a few times a message, and the kernel shapes and acknowledges packet by packet. Taken in full on a
    link far slower than a core's copies, in proportion to how much slower (`paced_share`), none on a
    faster one. Measured per thread on the lab, 1 Gbit/s against unlimited (`async` p4; there the share
    is 0.84): a remote worker's event loop +4.5 ms per exchange of 14.9 MB at 2 workers and +7 ms at 4
    (0.30 and 0.47 ns/byte), the shard holder's +3.0-3.4 ms per remote push (0.20-0.23), the machine's
    softirq +0.02-0.06 cores at 128-174 MB/s of such traffic (0.16-0.30, split between the two ends):
    about 0.5 at a worker's end and 0.33 at the holder's, 0.6 and 0.4 in full. Gloo's collectives
    (`allreduce`, `average`) run in C++ and pay none of it."""
    crowding_loss: float = 0.12
    """Of the work a pool of shared cores does, the share its processes lose once more of them want the
    CPU at once than there are cores (each switch leaves the next process caches to refill): k processes
    on c cores do c * (1 - crowding_loss * (1 - c / k)) cores' worth, nothing lost up to one a core
    (`crowded_cores`). Measured on the lab's VM, 2026-11-26, with k plain training loops side by side
    (MLP 784-1024-1024-10, one thread each, 5-8 s windows) against two: three did 0.95-0.96 of two's
    samples/s and four 0.91-0.95 (3 probes, nothing else running), and through the lab's hosts three
    0.89-1.03, four 0.88-1.16 (5 probes: the machine's speed moves 10% within seconds); each probe's
    fit (`crowding_loss_from`) 0.09-0.28 but for two such jumps, their median 0.13. Before this term the
    model read the lab's 4-worker points a median 4% high over eleven grids (2 workers: 0%).
    `benchmarks/simulator.py` probes it in every lab. Hosts with cores of their own (`cores=None`)
    lose none."""
    link_efficiency: float = 1448 / 1514
    """Goodput as a fraction of a shaped link's nominal rate: a shaper counts whole Ethernet frames, and a
    1500-byte frame carries 1448 bytes of TCP payload (with timestamps) in its 1514 bytes."""
    calibrated_from: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def crowded(self, processes: float, cores: float) -> float:
        """Cores' worth of work `cores` shared cores do for `processes` processes that want them at once."""
        return crowded_cores(processes, cores, self.crowding_loss)

    def moving_s(self, payload: float, speed: float = 1.0, quota: bool = False) -> float:
        """Wall-clock seconds a process moving `payload` bytes through an exchange takes on an unlimited link
        at CPU speed `speed`. On cores it shares (or its host's own), all of it stretches, the kernel's
        network work included; when a CPU quota on the process sets the speed (`quota`), only the
        process's own CPU time does (the quota counts nothing else)."""
        if not quota:
            return payload / (self.host_rate * speed)
        return payload / self.host_rate + self.moving_cpu_s(payload, quota=True) * (1 / speed - 1)

    def paced_share(self, link: float) -> float:
        """How far a link of `link` bytes/s paces an exchange rather than the copies (0: not at all, the
        link at least a core's copy rate; 1: a link far slower)."""
        return max(0.0, 1.0 - link / self.host_rate)

    def paced_cpu_s(self, payload: float, link: float) -> float:
        """CPU seconds one end of a parameter-server exchange spends on `payload` bytes beyond their copies
        because a link of `link` bytes/s paces them (`paced_cpu_s_per_byte`)."""
        return self.paced_share(link) * self.paced_cpu_s_per_byte * payload

    def moving_cpu_s(self, payload: float, quota: bool = False) -> float:
        """CPU seconds (at speed 1) moving `payload` bytes through an exchange costs the cores (the kernel's
        network work included), or with `quota` the process alone."""
        return payload / ((self.exchange_cpu_rate or self.host_rate) if quota else self.host_rate)


@dataclasses.dataclass(frozen=True)
class Prediction:
    samples_per_s: float
    """All workers together."""
    comm_share: float
    """Of the workers' step time, the part spent waiting for communication (step-weighted, as the
    workbench's time split counts it)."""
    staleness: float | None
    """Mean over pushes of the server versions a push did not see (parameter-server strategies only)."""
    per_worker_samples_per_s: tuple[float, ...]
    """By worker class: the server's host first, then the others, then the straggler (if any)."""
    cpu_speed: float
    """The CPU speed the unthrottled workers got (1 = a whole core each)."""


# --- calibration ---------------------------------------------------------------------------------------------


def calibrate(records: Iterable[Mapping[str, Any]], model_bytes: float | None = None, link_rate: float | None = None,
              workers: int | None = None, cores: float | None = None, bucket_mb: float | None = None,
              **known: Any) -> Calibration:
    """A Calibration from the step records of one `allreduce` or `average` run (dicts with `worker`,
    `compute_s`, `comm_s`, `samples`, `bytes_sent`, `strategy`), its float32 model size in bytes (None:
    read from the float32 exchanges' `bytes_sent`, what a ring all-reduce sends per worker), its
    link rate in bytes/s (None: unlimited), its worker count (default: the ranks in the records) and the
    cores those workers shared (None: a host each). `known` sets other fields (latency_s, ...)."""
    if bucket_mb is None:  # the run's buckets: the workbench's default
        bucket_mb = DEFAULTS["allreduce"]["bucket_mb"]
    # A DataFrame's records (`run.metrics.to_dict("records")`) carry NaN for the fields a step lacks (an
    # `average` step between syncs has no bytes_sent): NaN is truthy, so it would count every step a sync.
    records = [{k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))} for r in records]
    records = [r for r in records if r.get("compute_s") is not None]
    if not records:
        raise ValueError("records holds no step records (with compute_s): pass a run's step records")
    strategy = records[0].get("strategy", "allreduce")
    ranks = sorted({r.get("worker", 0) for r in records})
    n = workers or len(ranks)
    batch = int(statistics.median(r.get("samples", 128) for r in records))
    if model_bytes is None:
        sent = [r["bytes_sent"] for r in records if r.get("bytes_sent")]
        if not sent or n < 2:
            raise ValueError("model_bytes=None needs the bytes_sent of a run of 2 or more workers: pass model_bytes")
        model_bytes = statistics.median(sent) * n / (2 * (n - 1))
    spread = _spread(records, ranks)
    efficiency = known.get("link_efficiency", Calibration.__dataclass_fields__["link_efficiency"].default)
    link = math.inf if link_rate is None else link_rate * efficiency
    wire = 2 * (n - 1) / n * model_bytes if n > 1 else 0.0
    # Means, not medians: the occasional slow step (a collection, a metrics flush) costs throughput too.
    overhead = _loop_overhead(records, ranks)
    sync_local, exchange_cpu = 0.0, None
    if strategy == "average":
        # Between syncs a step is compute alone; a sync is a blocking all-reduce of the weights.
        syncs = [r for r in records if r.get("bytes_sent")]
        local = [r for r in records if not r.get("bytes_sent")]
        measured_compute = statistics.fmean(r["compute_s"] for r in local or records)
        sync_s = statistics.fmean(r["comm_s"] for r in syncs) if syncs else 0.0
        # The all-reduce alone where the records time it (runs before 2026-11-25 do not): the sync's
        # copies around it are `sync_local_s`, not the exchange's rate (with them, 430-525 MB/s on the lab's
        # 2026-11-25 grid against 567-613 from its `allreduce` runs, whose predictions then fell 13-27% low).
        timed = [r["exchange_s"] for r in syncs if r.get("exchange_s") is not None]
        exchange = statistics.fmean(timed) if timed and len(timed) == len(syncs) else sync_s
        sync_local = max(0.0, sync_s - exchange)
        # Every worker computes all the time.
        speed = 1.0 if cores is None else min(1.0, crowded_cores(n, cores, _crowding(known)) / n)
        # The process's CPU time where the records have it: a sync's beyond a local step's, less the sync's
        # own copies, is what the exchange cost the process's CPU (the rest of its time: the kernel's network
        # work, and waiting for the peer).
        if syncs and local and all(r.get("cpu_s") is not None for r in records):
            exchange_cpu = (statistics.fmean(r["cpu_s"] for r in syncs) - statistics.fmean(r["cpu_s"] for r in local)
                            - sync_local * speed)
    elif strategy == "allreduce":
        measured_compute = statistics.fmean(r["compute_s"] for r in records)
        measured_comm = statistics.fmean(r["comm_s"] for r in records)
        share = 1.0 if cores is None else min(1.0, crowded_cores(n, cores, _crowding(known)) / n)
        # Each worker had a core at most: once the first bucket is ready its copies and the rest of
        # backward share that core, so the measured compute holds that much copying (and that copy is
        # hidden). With spare cores the copies ran beside backward.
        overlapped = (1 - bucket_sizes(model_bytes, bucket_mb * MIB)[0] / model_bytes) * BACKWARD_SHARE
        saturated = cores is not None and n >= cores
        pure_compute = measured_compute / (1 + overlapped) if saturated else measured_compute
        # The wait for the slower worker (predict's `idle`) is part of the measured exposure, not of the
        # transfer.
        exposed = max(0.0, measured_comm - pure_compute * share * spread * expected_max(n))
        if saturated:
            exchange = exposed + overlapped * pure_compute
        else:
            # Undo the bucket overlap to get the transfer.
            exchange = _invert_overlap(exposed, BACKWARD_SHARE * measured_compute, model_bytes, bucket_mb * MIB)
        measured_compute = pure_compute
        speed = share
    else:
        raise ValueError(f"strategy {strategy!r}: calibrate from an 'allreduce' or 'average' run")
    copy_s = exchange if math.isinf(link) else max(0.0, exchange - wire / link)
    host_rate = wire / (copy_s * speed) if copy_s > 0 and wire > 0 else math.inf
    # CPU time cannot exceed the time at a whole core: a larger measure is noise, and leaves host_rate.
    cpu_rate = wire / exchange_cpu if exchange_cpu is not None and exchange_cpu > 0 and wire > 0 else None
    cpu_rate = max(cpu_rate, host_rate) if cpu_rate is not None else None
    fields = {"compute_s": measured_compute * speed, "compute_spread": spread, "model_bytes": float(model_bytes),
              "host_rate": host_rate, "samples_per_step": batch, "step_overhead_s": overhead * speed,
              "sync_local_s": sync_local * speed, "exchange_cpu_rate": cpu_rate,
              "calibrated_from": f"{strategy}, {n} workers, {len(records)} step records"}
    return Calibration(**{**fields, **known})


def _crowding(known: Mapping[str, Any]) -> float:
    return known.get("crowding_loss", Calibration.__dataclass_fields__["crowding_loss"].default)


def crowded_cores(processes: float, cores: float, loss: float) -> float:
    """Cores' worth of work `cores` shared cores do when `processes` processes want them at once, each
    losing `loss` of its work in the limit of many per core (`Calibration.crowding_loss`)."""
    if processes <= cores:
        return cores
    return cores * (1 - loss * (1 - cores / processes))


def crowding_loss_from(probes: Iterable[Mapping[int, float]], cores: float) -> float:
    """`Calibration.crowding_loss` from probes of the machine: each maps a number k of plain training
    processes run side by side over one window to their samples/s together, and holds k = `cores` (the
    probe's reference: one process a core, nothing lost). Each probe's loss is a least-squares fit over
    its k > `cores` against its own reference; the result is their median: the lab's machine changes
    speed by 10% within seconds now and then (four processes once did 16% more than two just before),
    and a median keeps such a window from moving the loss."""
    losses = []
    for probe in probes:
        totals = {int(k): float(v) for k, v in probe.items()}
        reference = totals.get(int(cores))
        if not reference or reference <= 0:
            raise ValueError(f"probe {totals} has no run of {cores:g} processes (one a core) to compare with")
        pairs = [(1 - cores / k, 1 - total / reference) for k, total in totals.items() if k > cores]
        if pairs:
            losses.append(sum(x * y for x, y in pairs) / sum(x * x for x, _ in pairs))
    if not losses:
        raise ValueError(f"the probes hold no run of more processes than the {cores:g} cores")
    return min(1.0, max(0.0, statistics.median(losses)))


def _loop_overhead(records: list[Mapping[str, Any]], ranks: list[int]) -> float:
    """The loop's own time per step outside compute, communication and waits (data, metrics, control):
    each worker's time from its first to its last step record, less what those steps recorded."""
    gaps = []
    for rank in ranks:
        mine = sorted((r for r in records if r.get("worker", 0) == rank and r.get("time") is not None),
                      key=lambda r: r["time"])
        if len(mine) < 2:
            continue
        between = (mine[-1]["time"] - mine[0]["time"]) / (len(mine) - 1)
        recorded = statistics.fmean(r["compute_s"] + r.get("comm_s", 0.0) + r.get("wait_s", 0.0) for r in mine[1:])
        gaps.append(max(0.0, between - recorded))
    return statistics.fmean(gaps) if gaps else 0.0


def _spread(records: list[Mapping[str, Any]], ranks: list[int]) -> float:
    """Robust relative spread of one step's compute time, each worker against its own median."""
    deviations = []
    for rank in ranks:
        times = [r["compute_s"] for r in records if r.get("worker", 0) == rank]
        center = statistics.median(times)
        deviations += [abs(t - center) / center for t in times if center > 0]
    return 1.4826 * statistics.median(deviations) if deviations else 0.0


def expected_max(n: int) -> float:
    """Expected maximum of n standard normal draws (Blom's approximation): how far the slowest of n
    workers' step is above the median step."""
    if n <= 1:
        return 0.0
    return statistics.NormalDist().inv_cdf((n - 0.375) / (n + 0.25))


FIRST_BUCKET_BYTES = MIB  # the first bucket's cap in the workbench (and DDP): its exchange starts early in backward


def bucket_sizes(payload_bytes: float, bucket_bytes: float) -> list[float]:
    """An all-reduce's buckets in the order they start, as `strategies/allreduce.py` cuts a gradient of
    many small tensors (a bucket closes once it holds its cap): the first of `FIRST_BUCKET_BYTES`, the
    others of `bucket_bytes`, the last of what is left."""
    sizes: list[float] = []
    left = payload_bytes
    while left > 0:
        cap = bucket_bytes if sizes else min(bucket_bytes, FIRST_BUCKET_BYTES)
        sizes.append(min(cap, left))
        left -= sizes[-1]
    return sizes


def bucket_exposure(transfer_s: float, backward_s: float, payload_bytes: float, bucket_bytes: float) -> float:
    """Time an all-reduce adds after backward ends, when its buckets (`bucket_sizes`) start as their
    gradients are ready (gradients become ready evenly during backward, the last layers' first) and share
    one link: the whole transfer takes `transfer_s`."""
    if transfer_s <= 0 or payload_bytes <= 0:
        return 0.0
    finished, ready = 0.0, 0.0
    for size in bucket_sizes(payload_bytes, bucket_bytes):
        ready += backward_s * size / payload_bytes
        finished = max(finished, ready) + transfer_s * size / payload_bytes
    return max(0.0, finished - backward_s)


def _invert_overlap(exposed_s: float, backward_s: float, payload_bytes: float, bucket_bytes: float) -> float:
    """The whole transfer time whose bucketed exposure after `backward_s` is `exposed_s` (bisection)."""
    low, high = exposed_s, exposed_s + backward_s + 1.0
    for _ in range(60):
        middle = (low + high) / 2
        if bucket_exposure(middle, backward_s, payload_bytes, bucket_bytes) < exposed_s:
            low = middle
        else:
            high = middle
    return (low + high) / 2


# --- prediction --------------------------------------------------------------------------------------------

DEFAULTS: dict[str, dict[str, Any]] = {  # each strategy's settings as the workbench defaults them
    "allreduce": {"bucket_mb": 25.0, "wire_dtype": "float32"},
    "average": {"period": 4, "overlap": False, "wire_dtype": "float32"},
    "async": {"push_every": 1, "fetch_every": None, "shards": 1, "overlap": True, "compression": "none",
              "topk_ratio": 0.01, "reply_compression": None},
    "ssp": {"push_every": 1, "fetch_every": None, "shards": 1, "overlap": True, "compression": "none",
            "topk_ratio": 0.01, "reply_compression": None, "max_staleness": 8},
    "easgd": {"period": 4, "alpha": 0.5, "shards": 1, "overlap": True, "compression": "none", "topk_ratio": 0.01,
              "reply_compression": None},
}
SERVER_STRATEGIES = ("async", "ssp", "easgd")


@dataclasses.dataclass
class _Class:
    """Identical workers: how many, their host's CPU cap (cores, all threads), whether each holds a shard."""

    count: int
    cap: float
    holds_shard: bool
    speed: float = 1.0
    cycle: float = 0.0  # seconds between exchanges
    steps: int = 1  # steps per cycle
    exposed: float = 0.0  # communication the cycle waited for
    work: float = 0.0  # CPU seconds (at speed 1) per cycle, the server's share on its host excluded
    throttled: bool = False
    idle: float = 0.0  # of the cycle, waiting for the slowest worker's step: CPU nobody else can use
    runnable: float | None = None  # of the cycle, the time the process has CPU work (None: all but `idle`)
    quota: bool = False  # its speed is set by a CPU quota on its processes (the lab's cgroup), not by cores
    work_quota: float = 0.0  # `work` as such a quota counts it: the process's own CPU time
    runnable_quota: float | None = None  # `runnable` with the exchange's CPU as such a quota counts it
    clocked: bool = True  # its reply starts its next push (the link clocks the flow), not its compute


def predict(calibration: Calibration, strategy: str, settings: Mapping[str, Any] | None, workers: int,
            link_rate: float | None = None, straggler: float | None = None, cores: float | None = None,
            host_cores: float = 2.0, elapsed_s: float | None = None, window_s: float = 0.0,
            link_burst: float = 0.0) -> Prediction:
    """Predicted steady state of `strategy` with `settings` on `workers` workers (one per host) whose
    links run at `link_rate` bytes/s (None: unlimited). `straggler`: one host (the last) capped at that
    many cores. `cores`: all hosts share that many cores (the lab); None: each host has `host_cores`.
    `elapsed_s`: how long the run has trained (None: long enough for every steady state); SSP's gap
    grows at the difference of the workers' push rates and holds the faster ones only once it reaches
    the bound. `window_s`: the prediction is the mean over that many seconds centred on `elapsed_s` (what a
    measurement over a window sees: SSP free before the bound binds, held after). `link_burst`: bytes a
    token-bucket shaper lets through at once after its direction idled long enough to refill (a cloud
    instance's burst credit, the lab's `tbf`: 10 ms of the rate); 0 for a link at line rate."""
    if strategy not in DEFAULTS:
        raise ValueError(f"strategy={strategy!r} is not allowed: expected one of {sorted(DEFAULTS)}")
    if not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} is not allowed: expected an integer >= 1")
    if not (isinstance(link_burst, (int, float)) and math.isfinite(link_burst) and link_burst >= 0):
        raise ValueError(f"link_burst={link_burst!r} is not allowed: expected bytes >= 0 (0: none)")
    if not (isinstance(window_s, (int, float)) and math.isfinite(window_s) and window_s >= 0):
        raise ValueError(f"window_s={window_s!r} is not allowed: expected seconds >= 0 (0: an instant)")
    values = {**DEFAULTS[strategy], **(settings or {})}
    link = math.inf if link_rate is None else link_rate * calibration.link_efficiency
    shards = min(values.get("shards", 0), workers) if strategy in SERVER_STRATEGIES else 0
    # A host's cap on all its processes' threads: its own cores on real hosts; none beyond the shared
    # pool on the lab, but the straggler's cgroup quota.
    host_cap = host_cores if cores is None else math.inf

    def solved(binds: bool) -> _Model:
        model = _Model(calibration, strategy, values, workers, link, shards,
                       _classes(workers, shards, straggler, host_cap, calibration.host_background_cores),
                       0.0 if math.isinf(link) else link_burst)
        model.bound_binds = binds
        _fit_speeds(model, cores)
        model.evaluate()
        return model

    if strategy != "ssp" or elapsed_s is None:
        return solved(True).prediction()
    # Until the faster workers' clocks are more than max_staleness ahead, SSP runs as `async`; from then on
    # it holds them. The gap grows at the difference of the free push rates. A worker that has completed
    # clock c waits only while c - slowest > max_staleness (`staleness.ssp_allows`): the first wait comes
    # when the gap reaches max_staleness + 1.
    free = solved(False)
    cycles = [group.cycle for group in free.classes]
    apart = 1 / min(cycles) - 1 / max(cycles)  # clocks per second
    binds_at = (values["max_staleness"] + 1) / apart if apart > 0 else math.inf
    start, end = max(0.0, elapsed_s - window_s / 2), elapsed_s + window_s / 2
    if end <= start:  # an instant
        share = 1.0 if start < binds_at else 0.0
    else:
        share = min(1.0, max(0.0, (binds_at - start) / (end - start)))
    if share >= 1.0:  # the window ends before the bound binds: the held state is not needed
        return free.prediction()
    return _blend(free.prediction(), solved(True).prediction(), share)


def _blend(free: Prediction, held: Prediction, share: float) -> Prediction:
    """The mean over a window of which `share` ran as `free` and the rest as `held`; staleness is a mean
    over pushes, so each part's counts by its pushes (in proportion to its samples: same push_every)."""
    if share <= 0.0:
        return held

    def mean(a: float, b: float) -> float:
        return share * a + (1 - share) * b

    pushes = (share * free.samples_per_s, (1 - share) * held.samples_per_s)
    staleness = None
    if free.staleness is not None and held.staleness is not None and sum(pushes) > 0:
        staleness = (pushes[0] * free.staleness + pushes[1] * held.staleness) / sum(pushes)
    return Prediction(samples_per_s=mean(free.samples_per_s, held.samples_per_s),
                      comm_share=mean(free.comm_share, held.comm_share), staleness=staleness,
                      per_worker_samples_per_s=tuple(mean(a, b) for a, b in zip(free.per_worker_samples_per_s,
                                                                                 held.per_worker_samples_per_s)),
                      cpu_speed=mean(free.cpu_speed, held.cpu_speed))


def _classes(workers: int, shards: int, straggler: float | None, host_cap: float,
             background: float = 0.0) -> list[_Class]:
    slow = 1 if straggler is not None and workers > 1 else 0
    normal = workers - slow
    holders = min(shards, normal)
    # What a capped host's own Dask processes take comes off its cap (`host_background_cores`).
    cap = host_cap - background if math.isfinite(host_cap) else host_cap
    groups = [_Class(holders, cap, True), _Class(normal - holders, cap, False)]
    if slow:
        groups.append(_Class(1, max(MIN_CAP, min(host_cap, straggler) - background), shards > normal))
    return [group for group in groups if group.count > 0]


def _fit_speeds(model: _Model, cores: float | None) -> None:
    """Each class's CPU speed (<= 1): the largest at which one of its processes (with the shard it holds)
    wants no more than its host's cap, and, when all hosts share `cores`, at which every process together
    wants no more than those; bisections, repeated until they agree."""
    groups = model.classes

    # On the lab (shared `cores`) a host's cap is a cgroup quota on its processes: it counts their CPU time
    # alone. A real host's cap is its own cores, which run the kernel's network work too.
    quotas = cores is not None

    def fits_alone(group: _Class, speed: float) -> bool:
        group.speed = speed
        model.evaluate()
        return (model.demand(group, group.quota) <= group.cap * (1 + 1e-9)
                and speed + model.turns(group) <= 1 + 1e-9)

    def fits_together(level: float, limits: list[float]) -> bool:
        for group, limit in zip(groups, limits):
            group.speed = min(limit, level)
            group.quota = quotas and limit < level
        model.evaluate()
        return sum(model.demand(g) * g.count for g in groups) <= model.c.crowded(crowd, cores) * (1 + 1e-9)

    for _ in range(8):
        limits = []
        for group in groups:
            group.quota = quotas and math.isfinite(group.cap)
            limits.append(_largest(lambda speed: fits_alone(group, speed)))
            group.speed = limits[-1]
        if cores is not None:
            # The processes taking turns on the cores: a capped one (the straggler's quota) wants them
            # for the share of the time its cap lets it run.
            crowd = sum(group.count * min(1.0, limit) for group, limit in zip(groups, limits))
            level = _largest(lambda level: fits_together(level, limits))
            for group, limit in zip(groups, limits):
                group.speed = min(limit, level)
                group.quota = quotas and limit < level


def _largest(fits: Any) -> float:
    """The largest speed in (0, 1] for which `fits(speed)` holds (it holds below some threshold)."""
    if fits(1.0):
        return 1.0
    low, high = 1e-4, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    fits(low)
    return low


class _Model:
    """One strategy's cycle, exposure and CPU work per worker class, given each class's CPU speed."""

    def __init__(self, calibration: Calibration, strategy: str, values: dict[str, Any], workers: int,
                 link: float, shards: int, classes: list[_Class], burst: float = 0.0) -> None:
        self.c, self.strategy, self.values, self.n = calibration, strategy, values, workers
        self.link, self.shards, self.classes, self.burst = link, shards, classes, burst
        self.staleness: float | None = None
        self.bound_binds = True  # SSP: whether the faster workers' clocks have reached the bound
        self.server_load = 0.0  # CPU seconds per second one shard spends serving pushes (at speed 1)
        self.server_load_quota = 0.0  # the same as a quota on the shard's process counts it
        self.remote_turns = 0.0  # of a core, the turns a shard holder gives the pushes that cross a link

    def evaluate(self) -> None:
        if self.strategy in SERVER_STRATEGIES:
            self._server()
        else:
            self._synchronous()

    def demand(self, group: _Class, quota: bool = False) -> float:
        """Cores one worker's process of `group` wants (its shard's service included): of the cores, or
        with `quota` as a CPU quota on the process counts them (its own CPU time)."""
        runnable = group.runnable_quota if quota else group.runnable
        busy = group.cycle - group.idle if runnable is None else runnable
        own = (group.work_quota if quota else group.work) / busy if busy > 0 else 0.0
        server = (self.server_load_quota if quota else self.server_load) if group.holds_shard else 0.0
        return own + server

    def turns(self, group: _Class) -> float:
        """Of a core, what a shard holder's process gives the pushes that come over a link
        (`Calibration.server_turns`): its speed is at most what is left."""
        return self.remote_turns if group.holds_shard else 0.0

    def _transfer(self, payload: float, group: _Class) -> float:
        """A message moved at the slower of the wire and the copies (they overlap for large messages)."""
        return max(payload / self.link, self.c.moving_s(payload, group.speed, group.quota))

    # --- all-reduce and averaging: every worker at the slowest one's pace --------------------------------

    def _synchronous(self) -> None:
        c, n, values = self.c, self.n, self.values
        wire = WIRE_FRACTION[values["wire_dtype"]]
        payload = 2 * (n - 1) / n * c.model_bytes * wire if n > 1 else 0.0
        pace = min(self.classes, key=lambda group: group.speed)
        slowest = pace.speed
        compute = c.compute_s / slowest
        loop = c.step_overhead_s / slowest
        # No shaper's burst here, though one passes: gloo's all-reduce of 7.45 MB between two lab hosts at
        # 1 Gbit/s took 61 ms right after the previous one, 53 ms after 30 ms idle. In a DDP loop the gain
        # is smaller than the bucket allows (a 4 MB bucket instead of 1.25 MB: 10.5 ms less a step of the
        # 23 ms its bytes would save), and the lab's synchronous points at 1 Gbit/s fit within 1-9%
        # without it, 12-19% above with it (2026-11-24 and -25 grids). Why the loop gains less is open.
        if self.strategy == "allreduce":
            steps = 1
            buckets = max(1, len(bucket_sizes(c.model_bytes, values["bucket_mb"] * MIB)))
            transfer = self._transfer(payload, pace) + c.latency_s * 2 * (n - 1) * buckets if payload else 0.0
            exposed = bucket_exposure(transfer, BACKWARD_SHARE * compute, c.model_bytes,
                                      values["bucket_mb"] * MIB)
            # Every step waits for the slowest of n draws of its compute time. The spread is taken as
            # measured (in seconds, as the calibration run had it), not stretched by a lower CPU speed.
            idle = c.compute_s * c.compute_spread * expected_max(n)
            path = compute + loop
            local = 0.0
        else:
            steps = values["period"]
            transfer = self._transfer(payload, pace) + c.latency_s * 2 * (n - 1) if payload else 0.0
            # Over a period the steps' spread averages out as 1/sqrt(period).
            idle = steps * c.compute_s * c.compute_spread * expected_max(n) / math.sqrt(steps)
            # The sync's own copies run on the worker's thread whether the all-reduce overlaps or not.
            local = c.sync_local_s if payload else 0.0
            path = steps * (compute + loop) + local / slowest
            exposed = max(0.0, transfer - path) if values["overlap"] else transfer
        cycle = path + exposed + idle
        copies = c.moving_cpu_s(payload)
        copies_quota = c.moving_cpu_s(payload, quota=True)
        step_work = c.compute_s + c.step_overhead_s
        # Lockstep: the exchange releases every worker at once, so all of them compute at the same time
        # and then all wait on the wire together. A process wants the CPU while it computes and copies,
        # not spread over the whole cycle: a slow link leaves the cores idle during the exchange but does
        # not speed up the computes (on 2 cores, 4 workers compute at half speed at any link rate). Of
        # the exposed exchange, the copies' share of the transfer is CPU work (all of it when the copies
        # are what bound it), the rest a wait on the wire.
        copying = min(1.0, copies / slowest / transfer) if transfer > 0 else 0.0
        copying_quota = min(1.0, copies_quota / slowest / transfer) if transfer > 0 else 0.0
        for group in self.classes:
            group.steps, group.cycle, group.idle = steps, cycle, idle
            group.exposed = cycle - steps * step_work / group.speed  # the sync's local work counts as its comm
            group.work = steps * step_work + copies + local
            group.runnable = (steps * step_work + local) / group.speed + exposed * copying
            group.work_quota = steps * step_work + copies_quota + local
            group.runnable_quota = (steps * step_work + local) / group.speed + exposed * copying_quota

    # --- the parameter server: async, ssp, easgd -------------------------------------------------------

    def _server(self) -> None:
        c, values, n = self.c, self.values, self.n
        elastic = self.strategy == "easgd"
        steps = values["period"] if elastic else values["push_every"]
        pushes_per_fetch = 1 if elastic else max(1, (values["fetch_every"] or steps) // steps)
        replies = values["compression"] if values["reply_compression"] is None else values["reply_compression"]
        push = c.model_bytes * _compressed(values["compression"], values["topk_ratio"])
        reply = c.model_bytes * _compressed(replies, values["topk_ratio"]) / pushes_per_fetch
        shards = max(1, self.shards)
        holder = next((g for g in self.classes if g.holds_shard), self.classes[0])
        # One push served: its CPU (of the cores, and as a quota counts it), and its time at the speed the
        # shard's host gives it.
        moved = (push + reply) / 2
        service = (c.moving_cpu_s(moved) + c.server_apply_s) / shards
        service_quota = (c.moving_cpu_s(moved, quota=True) + c.server_apply_s) / shards
        serving = (c.moving_s(moved, holder.speed, holder.quota) + c.server_apply_s / holder.speed) / shards
        # A worker's own link carries its push one way and the reply the other, one after the other: each
        # direction idles while the other works, long enough to refill a shaper's bucket for every message.
        own = _beyond(push, self.burst) + _beyond(reply, self.burst)
        for group in self.classes:
            remote = 1 - (1 / shards if group.holds_shard else 0.0)
            wire = own * remote / self.link
            copies = c.moving_s(moved, group.speed, group.quota)
            round_trip = max(wire, copies) + serving + 2 * c.latency_s
            compute = steps * (c.compute_s + c.step_overhead_s) / group.speed
            group.steps = steps
            group.cycle = max(compute, round_trip) if values["overlap"] else compute + round_trip
            group.clocked = round_trip >= compute or not values["overlap"]
            # The paced CPU counts as the process's own (under a quota too): most of it is its event loop.
            own_work = steps * (c.compute_s + c.step_overhead_s) + c.paced_cpu_s((push + reply) * remote, self.link)
            group.work = own_work + c.moving_cpu_s(moved)
            group.work_quota = own_work + c.moving_cpu_s(moved, quota=True)
        # Each shard's host link carries every other worker's share of the traffic (a worker on that host
        # sends its share of it through no link): n - 1 request/reply flows, each one's push and reply
        # taking turns with the others' on that link (`_shared_link_cycle`).
        flows = max(1, n - 1)
        shared = _shared_burst(push / shards, reply / shards, self.burst, flows)
        for group in self.classes:
            if not group.holds_shard or shards > 1:
                group.cycle = _shared_link_cycle(shared[0] / self.link, shared[1] / self.link, flows, group.cycle,
                                                 group.clocked)
        # The shard's one actor serves every push in turn: past saturation every worker's pushes wait.
        queue = sum(g.count / g.cycle for g in self.classes) * serving
        for group in self.classes:
            group.cycle *= max(1.0, queue)
        for group in self.classes:
            group.exposed = group.cycle - group.steps * (c.compute_s + c.step_overhead_s) / group.speed
        self._bound_and_staleness(pushes_per_fetch)
        pushes = sum(g.count / g.cycle for g in self.classes)
        arriving = sum(g.count / g.cycle for g in self.classes if not g.holds_shard or shards > 1)
        paced = arriving * c.paced_cpu_s(push + reply, self.link) / shards
        self.server_load = pushes * service + paced
        self.server_load_quota = pushes * service_quota + paced
        self.remote_turns = arriving * c.server_turns * c.moving_cpu_s(push + reply) / shards

    def _bound_and_staleness(self, pushes_per_fetch: int) -> None:
        groups = self.classes
        slowest = max(g.cycle for g in groups)
        fastest = min(g.cycle for g in groups)
        if self.strategy == "ssp" and self.bound_binds and fastest < slowest * (1 - SSP_THROTTLE_TOLERANCE):
            # The gap grows without end, so in steady state every faster worker sits at the bound, released
            # together by the slowest one's push; each refetches after its wait (no version missed then,
            # but those released with it), and the slowest sees one push of every other per cycle.
            throttled = sum(g.count for g in groups if g.cycle < slowest * (1 - SSP_THROTTLE_TOLERANCE))
            free = self.n - throttled
            for group in groups:
                group.throttled = group.cycle < slowest * (1 - SSP_THROTTLE_TOLERANCE)
                group.cycle = slowest
            self.staleness = (throttled * (throttled - 1) / 2 + free * (self.n - 1)) / self.n
            return
        total_rate = sum(g.count / g.cycle for g in groups)
        stale, pushes = 0.0, 0.0
        for group in groups:
            others = total_rate - 1 / group.cycle
            # Own pushes since the fetch count too when fetches are rarer than pushes.
            each = (pushes_per_fetch - 1) / 2 + (pushes_per_fetch + 1) / 2 * group.cycle * others
            stale += each * group.count / group.cycle
            pushes += group.count / group.cycle
        self.staleness = stale / pushes

    def prediction(self) -> Prediction:
        groups = self.classes
        per_worker = tuple(self.c.samples_per_step * g.steps / g.cycle for g in groups)
        steps_rate = sum(g.count * g.steps / g.cycle for g in groups)
        comm = sum(g.count * g.exposed / g.cycle for g in groups)  # comm seconds per second, all workers
        waiting = sum(g.count for g in groups)
        return Prediction(samples_per_s=sum(g.count * w for g, w in zip(groups, per_worker)),
                          comm_share=comm / waiting if steps_rate else 0.0,
                          staleness=self.staleness if self.strategy in SERVER_STRATEGIES else None,
                          per_worker_samples_per_s=per_worker,
                          cpu_speed=max(g.speed for g in groups))


def _shared_link_cycle(push_s: float, reply_s: float, flows: int, alone_s: float, clocked: bool = True) -> float:
    """The cycle of one of `flows` request/reply flows on a shard's full-duplex link, each alone taking
    `alone_s` a cycle, `push_s` and `reply_s` of it on that link at its whole rate (the rest: its service,
    compute). A flow's push and reply take turns (the reply answers the push), so a push can use the
    link's one direction while another flow's reply uses the other.

    - When every flow's push fits into one flow's cycle end to end (and so do the replies), and the link
      clocks each flow (`clocked`: its reply starts its next push, as when the round trip outlasts the
      compute it overlaps), the flows settle into turns, each at its own pace: the lab's two flows went
      back to cycles of exactly their one-flow time (1.25 s at 100 Mbit/s) after every knock. Knocks cost
      them `TURNS_DISRUPTED` of the gap to random phases.
    - Flows whose compute starts each push (the round trip alone shorter than the compute beside it) keep
      its jitter in their phases: they overlap at random. The lab's two flows at 1 Gbit/s (3 workers,
      compute a little longer than the round trip): 167-192 ms a cycle on grid 2026-11-25-e (`async` and
      `ssp` p4); random phases give 168 ms, their own cycle alone about 145.
    - When they do not fit, where they overlap falls at random, and the link's rate is shared equally
      among the transfers in each direction: a transfer of t seconds alone takes t / (1 - load), load the
      other flows' share of that direction (processor sharing), fixed point over the cycle. The lab's
      three flows at 100 Mbit/s: cycles of 1.7-4.5 s, 2.5-2.6 s on average; this gives 2.5 s.
    Plain sockets on the lab (7.45 MB each way, 15 ms service) showed the two states: two flows 1.31 s a
    round trip in turns, 2.2-2.3 s in step; one flow 1.24 s."""
    if flows <= 1:
        return alone_s
    other = max(0.0, alone_s - push_s - reply_s)  # its service and compute (a burst can make it < 0)
    busiest = max(push_s, reply_s)

    def excess(cycle: float) -> float:
        load = (flows - 1) / cycle
        return push_s / (1 - load * push_s) + reply_s / (1 - load * reply_s) + other - cycle

    # excess() falls from +inf just above the busier direction's saturation to below 0 far out.
    low, high = (flows - 1) * busiest, max(alone_s, (flows + 1) * (push_s + reply_s) + other)
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if excess(middle) > 0 else (low, middle)
    random = max(alone_s, high)
    if clocked and flows * busiest <= alone_s:
        return alone_s + TURNS_DISRUPTED * (random - alone_s)
    return random


def _beyond(message: float, burst: float) -> float:
    """Bytes of a message that wait for a shaper's rate: the first `burst` pass at once."""
    return max(0.0, message - burst)


def _shared_burst(push: float, reply: float, burst: float, flows: int) -> tuple[float, float]:
    """Push and reply bytes that wait for the rate on a shaped link shared by `flows` request/reply flows.
    The bucket refills only while its direction idles: per message, about smaller/sqrt(flows) bytes' worth
    (a share of the other direction's time); each message gets the burst or that refill, the less.
    Measured with plain sockets on the lab (1 Gbit/s, its 1.25 MB burst, 7.45 MB each way, 15 ms serial
    service): one flow's round trip took 0.12 s, two messages' bytes beyond the burst at the rate plus the
    service; with a 64 KiB bucket 0.14 s."""
    if burst <= 0:
        return push, reply
    refill = min(push, reply) / (math.sqrt(flows) + 1)  # the fixed point of refill = (smaller - refill)/sqrt(flows)
    # One flow: its direction idles through the whole of the other message (nothing of it is hidden).
    given = min(burst, refill) if flows > 1 else burst
    return _beyond(push, given), _beyond(reply, given)


def _compressed(kind: str, topk_ratio: float) -> float:
    """Bytes on the wire as a fraction of float32's."""
    if kind == "topk":
        return 2 * topk_ratio  # a float32 value and an int32 index per kept entry
    if kind not in COMPRESSED_FRACTION:
        raise ValueError(f"compression={kind!r} is not modelled: expected none, fp16 or topk")
    return COMPRESSED_FRACTION[kind]
