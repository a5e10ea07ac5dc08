"""The capacity-planning simulator (`planner.simulate`): its arithmetic against hand-computed values,
its monotonicity, and calibration recovering what synthetic step records were made from. No cluster."""
from __future__ import annotations

import dataclasses
import math
import random

import pandas as pd
import pytest

from planner import simulate
from planner.simulate import Calibration, bucket_exposure, calibrate, predict

MODEL_BYTES = 7_454_760.0  # MLP 784-1024-1024-10 in float32
STRATEGIES = [("allreduce", {}), ("average", {"period": 16}), ("average", {"period": 16, "overlap": True}),
              ("async", {"push_every": 4}), ("ssp", {"push_every": 4}), ("easgd", {"period": 16})]


def calibration(**changes) -> Calibration:
    fields = dict(compute_s=0.02, compute_spread=0.0, model_bytes=MODEL_BYTES, host_rate=500e6)
    return Calibration(**{**fields, **changes})


@pytest.mark.parametrize("strategy,settings", STRATEGIES)
@pytest.mark.parametrize("workers", [2, 3, 4, 16, 1024])
@pytest.mark.parametrize("cores", [2.0, None])
def test_a_faster_link_never_lowers_predicted_throughput(strategy, settings, workers, cores):
    # Left aside: the turns a shard holder gives the pushes a faster link lets through (their own test).
    cal = calibration(compute_spread=0.1, server_turns=0.0)
    previous = 0.0
    for rate in (1e6, 12.5e6, 125e6, 1.25e9, None):
        now = predict(cal, strategy, settings, workers, rate, cores=cores).samples_per_s
        assert now >= previous * (1 - 1e-9), (rate, now, previous)
        previous = now


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_allreduce_comm_share_is_the_hand_computed_value(workers):
    # Dedicated hosts, no spread, a bucket cap over the model: the first bucket (1 MiB, as DDP's) starts
    # when its share of backward is done, the rest when backward ends; on this thin link the transfer
    # outlasts backward, so the step is compute plus the ring's 2(N-1)/N of the model at the link rate,
    # less the part of backward the first bucket's transfer ran beside.
    cal = calibration()
    rate = 12.5e6
    got = predict(cal, "allreduce", {"bucket_mb": 64}, workers, rate)
    # A shaped link carries its rate in Ethernet frames: TCP's payload is 1448 of every 1514 bytes.
    whole = 2 * (workers - 1) / workers * MODEL_BYTES / (rate * 1448 / 1514)
    first = simulate.MIB / MODEL_BYTES
    backward = simulate.BACKWARD_SHARE * cal.compute_s
    transfer = whole - backward * (1 - first)
    assert got.comm_share == pytest.approx(transfer / (cal.compute_s + transfer))
    assert got.samples_per_s == pytest.approx(workers * 128 / (cal.compute_s + transfer))


def test_bucket_exposure_hides_the_early_buckets_behind_backward():
    # Two equal buckets: the first is ready halfway through backward (0.5 s of 1 s) and takes 0.25 s,
    # the second starts when backward ends and takes 0.25 s more: 0.25 s exposed.
    assert bucket_exposure(0.5, 1.0, 100.0, 50.0) == pytest.approx(0.25)
    # A transfer slower than backward: the first bucket runs from 0.5 to 1.5, the second to 2.5.
    assert bucket_exposure(2.0, 1.0, 100.0, 50.0) == pytest.approx(1.5)
    assert bucket_exposure(2.0, 1.0, 100.0, 1000.0) == pytest.approx(2.0)  # one bucket: nothing hidden


def test_average_pays_one_blocking_exchange_per_period_and_overlap_hides_it():
    cal = calibration()
    rate = 125e6
    blocking = predict(cal, "average", {"period": 8}, 2, rate)
    transfer = MODEL_BYTES / (rate * cal.link_efficiency)
    assert blocking.samples_per_s == pytest.approx(2 * 8 * 128 / (8 * cal.compute_s + transfer))
    hidden = predict(cal, "average", {"period": 8, "overlap": True}, 2, rate)
    assert hidden.samples_per_s == pytest.approx(2 * 128 / cal.compute_s)  # 60 ms hidden behind 160 ms
    assert hidden.comm_share == pytest.approx(0.0)


@pytest.mark.parametrize("workers", [2, 3, 4, 8, 32])
def test_async_staleness_with_push_every_1_is_about_workers_minus_1(workers):
    got = predict(calibration(), "async", {"push_every": 1}, workers, None)
    assert got.staleness == pytest.approx(workers - 1, abs=0.05)


def test_push_weighted_staleness_is_workers_minus_1_whatever_the_speeds():
    # Each push by one worker is missed by the next push of every other: N-1 per push on average.
    cal = calibration()
    for rate in (None, 12.5e6):
        got = predict(cal, "async", {"push_every": 4}, 4, rate, straggler=0.3)
        assert got.staleness == pytest.approx(3.0)


def test_rarer_fetches_add_the_workers_own_pushes():
    # fetch_every 16 with push_every 4: pushes 1..4 after a fetch miss 0..3 own pushes plus 1..4
    # windows of the other worker's: 1, 3, 5, 7, mean 4 (the lab measured 3.9).
    got = predict(calibration(), "async", {"push_every": 4, "fetch_every": 16, "shards": 2}, 2, None)
    assert got.staleness == pytest.approx(4.0)


@pytest.mark.parametrize("workers", [2, 3, 4, 16, 256])
@pytest.mark.parametrize("bound", [0, 1, 2, 8])
def test_ssp_staleness_never_exceeds_its_bound_or_async(workers, bound):
    cal = calibration()
    for rate, straggler in ((None, None), (12.5e6, None), (None, 0.25), (1e6, 0.5)):
        ssp = predict(cal, "ssp", {"push_every": 4, "max_staleness": bound}, workers, rate, straggler=straggler)
        free = predict(cal, "async", {"push_every": 4}, workers, rate, straggler=straggler)
        assert ssp.staleness <= free.staleness + 1e-9
        # Versions missed per push within a bound of `bound` clocks: at most (bound + 1) of each other's.
        assert ssp.staleness <= (bound + 1) * (workers - 1) + 1e-9
        assert ssp.samples_per_s <= free.samples_per_s * (1 + 1e-9)


def test_ssp_holds_fast_workers_to_the_slowest():
    # 100 Mbit/s: the worker across the link is slow, the one beside the server fast; SSP runs both at
    # the slow one's pace, async lets the fast one run alone.
    cal = calibration()
    ssp = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6)
    free = predict(cal, "async", {"push_every": 4}, 2, 12.5e6)
    assert ssp.per_worker_samples_per_s[0] == pytest.approx(ssp.per_worker_samples_per_s[1])
    assert free.per_worker_samples_per_s[0] > 5 * free.per_worker_samples_per_s[1]
    assert ssp.staleness == pytest.approx(0.5)


def test_one_server_shard_saturates_and_more_shards_lift_it():
    cal = calibration()
    one = predict(cal, "async", {"push_every": 1}, 64, None)
    many = predict(cal, "async", {"push_every": 1, "shards": 16}, 64, None)
    assert many.samples_per_s > 4 * one.samples_per_s
    # The shard serves (push + reply) / 2 at host_rate per push: that caps the whole cluster's pushes.
    service = MODEL_BYTES / cal.host_rate
    assert one.samples_per_s <= 128 / service * 1.01


def test_ssp_first_waits_when_the_gap_exceeds_the_bound():
    # A worker that completed clock c goes on while c - slowest <= max_staleness (`staleness.ssp_allows`):
    # with a bound of 0 the gap must reach 1 before a wait, with 8 it must reach 9. Just before those
    # times the window is free (async), just after it is held.
    cal = calibration()
    free = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6, elapsed_s=0.0)
    apart = (free.per_worker_samples_per_s[0] - free.per_worker_samples_per_s[1]) / (cal.samples_per_step * 4)
    held = predict(cal, "ssp", {"push_every": 4, "max_staleness": 0}, 2, 12.5e6)
    for bound in (0, 8):
        settings = {"push_every": 4, "max_staleness": bound}
        before = predict(cal, "ssp", settings, 2, 12.5e6, elapsed_s=0.99 * (bound + 1) / apart)
        after = predict(cal, "ssp", settings, 2, 12.5e6, elapsed_s=1.01 * (bound + 1) / apart)
        assert before.samples_per_s == pytest.approx(free.samples_per_s)
        assert after.samples_per_s == pytest.approx(held.samples_per_s)


@pytest.mark.parametrize("rate", [125e6, 12.5e6])
def test_synchronous_workers_compute_in_lockstep_so_a_slow_link_leaves_their_compute_shared(rate):
    # 4 workers on 2 shared cores: every exchange releases them together, so they compute at half speed
    # (less what four processes taking turns on two cores lose) whatever the link, and the link's wait
    # adds to that (the cores stay idle meanwhile).
    cal = calibration()
    speed = 0.5 * (1 - cal.crowding_loss * (1 - 2 / 4))
    payload = 2 * 3 / 4 * MODEL_BYTES
    transfer = max(payload / (rate * cal.link_efficiency), payload / (cal.host_rate * speed))
    average = predict(cal, "average", {"period": 16}, 4, rate, cores=2)
    assert average.cpu_speed == pytest.approx(speed, rel=1e-6)
    assert average.samples_per_s == pytest.approx(4 * 16 * 128 / (16 * cal.compute_s / speed + transfer), rel=1e-6)
    # A model within the first bucket's 1 MiB, so one bucket: the all-reduce starts when backward ends.
    small = calibration(model_bytes=simulate.MIB)
    payload = 2 * 3 / 4 * small.model_bytes
    transfer_small = max(payload / (rate * cal.link_efficiency), payload / (cal.host_rate * speed))
    allreduce = predict(small, "allreduce", {"bucket_mb": 64}, 4, rate, cores=2)
    assert allreduce.cpu_speed == pytest.approx(speed, rel=1e-6)
    assert allreduce.samples_per_s == pytest.approx(4 * 128 / (cal.compute_s / speed + transfer_small), rel=1e-6)
    # With a core each (dedicated hosts), the same link leaves their compute at full speed.
    alone = predict(cal, "average", {"period": 16}, 4, rate)
    assert alone.samples_per_s == pytest.approx(4 * 16 * 128 / (16 * cal.compute_s + transfer), rel=1e-6)


def test_a_copy_bound_exchange_keeps_its_cpu_in_the_demand():
    # An unlimited link: the exchange is the copies, CPU work like the compute, so shared cores still
    # share it (4 workers on 2 cores: half speed for both, here with nothing lost to crowding), as before
    # the lockstep rule.
    cal = calibration(crowding_loss=0.0)
    got = predict(cal, "average", {"period": 1}, 4, None, cores=2)
    copies = 2 * 3 / 4 * MODEL_BYTES / cal.host_rate
    assert got.cpu_speed == pytest.approx(0.5, rel=1e-6)
    assert got.samples_per_s == pytest.approx(4 * 128 / ((cal.compute_s + copies) / 0.5), rel=1e-6)


@pytest.mark.parametrize("loss", [0.0, 0.06, 0.12])
def test_shared_cores_slow_compute_by_processes_per_core_and_what_crowding_loses(loss):
    # On the lab every host shares the machine: 4 workers on 2 cores compute at half speed, less what
    # four processes taking turns on two cores lose: two cores do 2 * (1 - loss * (1 - 2/4)) cores' work.
    cal = calibration(crowding_loss=loss)
    alone = predict(cal, "average", {"period": 10_000}, 4, None)
    shared = predict(cal, "average", {"period": 10_000}, 4, None, cores=2)
    assert shared.cpu_speed == pytest.approx(0.5 * (1 - loss / 2), rel=0.01)
    assert shared.samples_per_s == pytest.approx(alone.samples_per_s / 2 * (1 - loss / 2), rel=0.01)
    # Three on two: a third of the limit's loss. One process a core or fewer, or hosts with cores of
    # their own, lose nothing.
    three = predict(cal, "average", {"period": 10_000}, 3, None, cores=2)
    assert three.cpu_speed == pytest.approx(2 / 3 * (1 - loss / 3), rel=0.01)
    two = predict(cal, "average", {"period": 10_000}, 2, None, cores=2)
    assert two.samples_per_s == pytest.approx(predict(calibration(crowding_loss=0.0), "average", {"period": 10_000},
                                                      2, None, cores=2).samples_per_s, rel=1e-9)
    assert alone.cpu_speed == 1.0
    # A straggler capped at about half a core (less its Dask processes' share) takes turns that share of
    # the time: 3 + cap processes crowd the two cores, and the other three share what it leaves.
    cap = 0.5 - cal.host_background_cores
    capped = predict(cal, "async", {"push_every": 10_000}, 4, None, straggler=0.5, cores=2)
    assert max(capped.per_worker_samples_per_s) == pytest.approx(
        128 / cal.compute_s * (2 * (1 - loss * (1 - 2 / (3 + cap))) - cap) / 3, rel=0.01)


def test_crowding_loss_is_read_from_plain_processes_side_by_side():
    # Probes made from a known loss (each at its own machine speed) give it back; noise averages out.
    def probe(loss, speed, noise=(0.0, 0.0)):
        return {2: 2 * speed, 3: 2 * speed * (1 - loss / 3) * (1 + noise[0]), 4: 2 * speed * (1 - loss / 2) * (1 + noise[1])}

    assert simulate.crowding_loss_from([probe(0.12, 8000), probe(0.12, 6000)], 2) == pytest.approx(0.12)
    noisy = [probe(0.12, 8000, (0.03, -0.02)), probe(0.12, 7000, (-0.03, 0.02)), probe(0.12, 7500, (0.01, 0.0))]
    assert simulate.crowding_loss_from(noisy, 2) == pytest.approx(0.12, abs=0.03)
    # One probe whose window caught the machine speeding up does not move the median.
    jumped = {2: 14000.0, 3: 14000.0, 4: 16000.0}
    assert simulate.crowding_loss_from([probe(0.12, 8000), probe(0.12, 7000), jumped], 2) == pytest.approx(0.12)
    # Keys as a JSON file has them; more processes doing more than one a core is no loss (not a gain).
    assert simulate.crowding_loss_from([{"2": 100.0, "4": 90.0}], 2) == pytest.approx(0.2)
    assert simulate.crowding_loss_from([{2: 100.0, 4: 120.0}], 2) == 0.0
    with pytest.raises(ValueError, match="no run of 2 processes"):
        simulate.crowding_loss_from([{3: 100.0, 4: 90.0}], 2)
    with pytest.raises(ValueError, match="no run of more processes"):
        simulate.crowding_loss_from([{2: 100.0}], 2)


def test_a_straggler_sets_a_synchronous_pace_but_not_an_asynchronous_one():
    cal = calibration(server_turns=0.0)  # the holder's turns have their own test
    # The capped host's own Dask processes (the nanny, the worker's event loop) take their share of its cap.
    cap = 0.5 - cal.host_background_cores
    assert 0 < cal.host_background_cores < 0.1
    sync = predict(cal, "average", {"period": 10_000}, 4, None, straggler=0.5)
    assert sync.samples_per_s == pytest.approx(4 * 128 / (cal.compute_s / cap), rel=0.01)
    bare = predict(dataclasses.replace(cal, host_background_cores=0.0), "average", {"period": 10_000}, 4, None,
                   straggler=0.5)
    assert bare.samples_per_s == pytest.approx(4 * 128 / (cal.compute_s / 0.5), rel=0.01)
    # Real hosts (2 cores each): the others compute at full speed, their copies on the second core; the
    # straggler's cap holds all of its threads, so half a core covers its compute and its copies.
    free = predict(cal, "async", {"push_every": 4}, 4, None, straggler=0.5)
    holder, other, slow = free.per_worker_samples_per_s
    assert other == pytest.approx(128 / cal.compute_s)
    assert slow == pytest.approx(cap * 4 * 128 / (4 * cal.compute_s + MODEL_BYTES / cal.host_rate), rel=0.01)


def test_a_shard_holder_gives_its_training_thread_turns_to_the_pushes_that_cross_a_link():
    # Lab (2 shared cores), 2 workers, the other at half a core: a core stands idle, yet the holder's
    # training thread gives each push from the other host the push's and reply's moving time. (The CPU
    # a link's pacing costs has its own test.)
    cal = calibration(paced_cpu_s_per_byte=0.0)
    holder, slow = predict(cal, "async", {"push_every": 4}, 2, None, straggler=0.5, cores=2).per_worker_samples_per_s
    turn = 2 * MODEL_BYTES / cal.host_rate
    speed = 1 - slow / (4 * 128) * turn
    assert speed < 0.95
    assert holder == pytest.approx(4 * 128 / (4 * cal.compute_s / speed), rel=0.01)
    # Its own pushes (over loopback) cost it none: one worker alone computes at a whole core.
    alone = predict(cal, "async", {"push_every": 4}, 1, None, cores=2)
    assert alone.per_worker_samples_per_s[0] == pytest.approx(128 / cal.compute_s, rel=0.001)
    # A faster link lets more pushes through, and the holder computes slower (the lab: 7,339 samples/s
    # beside 0.8 pushes a second at 100 Mbit/s, 5,430 beside 8.6 at 1 Gbit/s); without the turns it would not.
    slow_link, fast_link = (predict(cal, "async", {"push_every": 4}, 2, rate, cores=2) for rate in (12.5e6, 125e6))
    assert fast_link.per_worker_samples_per_s[0] < 0.9 * slow_link.per_worker_samples_per_s[0]
    assert fast_link.samples_per_s > slow_link.samples_per_s
    unturned = predict(calibration(server_turns=0.0, paced_cpu_s_per_byte=0.0), "async", {"push_every": 4}, 2, 125e6,
                       cores=2)
    assert fast_link.per_worker_samples_per_s[0] < 0.9 * unturned.per_worker_samples_per_s[0]


def test_a_paced_link_costs_each_exchange_cpu_at_both_ends():
    cal, unpaced = calibration(), calibration(paced_cpu_s_per_byte=0.0)
    assert cal.paced_share(math.inf) == 0.0 and cal.paced_share(2 * cal.host_rate) == 0.0
    assert cal.paced_share(RATE_1GBIT) == pytest.approx(1 - RATE_1GBIT / cal.host_rate)
    # Hosts of 0.3 cores each, 1 Gbit/s: the remote worker's compute outlasts its round trip, so its
    # CPU per cycle (four steps, the exchange's copies, the paced bytes' share) fills its cap.
    link = RATE_1GBIT * cal.link_efficiency
    paced = cal.paced_share(link) * cal.paced_cpu_s_per_byte * 2 * MODEL_BYTES
    assert cal.paced_cpu_s(2 * MODEL_BYTES, link) == pytest.approx(paced)
    cap = 0.3 - cal.host_background_cores
    cycle_cpu = 4 * cal.compute_s + cal.moving_cpu_s(MODEL_BYTES)
    for c, expected in ((cal, 4 * 128 * cap / (cycle_cpu + paced)), (unpaced, 4 * 128 * cap / cycle_cpu)):
        holder, got = predict(c, "async", {"push_every": 4}, 2, RATE_1GBIT, host_cores=0.3).per_worker_samples_per_s
        assert got == pytest.approx(expected, rel=1e-6)
        # The holder's cap holds its four steps and its own push's copies, every push's service (its own
        # and the remote one's copies), and the remote push's paced bytes: its speed s solves
        # s (4c + 2m) / 4c + pushes (m + paced) = cap, pushes the remote worker's per second.
        m, step, remote_pushes = c.moving_cpu_s(MODEL_BYTES), c.compute_s, got / (4 * 128)
        speed = (cap - remote_pushes * (m + c.paced_cpu_s(2 * MODEL_BYTES, link))) * 4 * step / (4 * step + 2 * m)
        assert holder == pytest.approx(4 * 128 * speed / (4 * step), rel=1e-6)
    # The holder serves the paced pushes of three remote workers, on the lab's shared cores: it computes
    # slower, and the remote workers, whose cycle the holder's link sets, gain nothing from it.
    lab, lab_unpaced = (predict(c, "async", {"push_every": 4}, 4, RATE_1GBIT, cores=2) for c in (cal, unpaced))
    assert lab.per_worker_samples_per_s[0] < 0.9 * lab_unpaced.per_worker_samples_per_s[0]
    assert lab.per_worker_samples_per_s[1] <= lab_unpaced.per_worker_samples_per_s[1]
    assert lab.samples_per_s < 0.95 * lab_unpaced.samples_per_s
    # None on an unlimited link, nor for gloo's collectives.
    for strategy, settings in STRATEGIES:
        rates = (None, RATE_1GBIT) if strategy in ("allreduce", "average") else (None,)
        for rate in rates:
            both = [predict(c, strategy, settings, 4, rate, cores=2).samples_per_s for c in (cal, unpaced)]
            assert both[0] == both[1]


def _synthetic_allreduce(cal: Calibration, workers: int, cores: float | None, steps: int = 400):
    """Step records as an allreduce run writes them, for a run whose truth is `cal`: with spare cores the
    buckets' copies run beside backward; with a core or less per worker they share it with the rest of
    backward once the first bucket is ready (`simulate.calibrate`'s two cases)."""
    wire = 2 * (workers - 1) / workers * cal.model_bytes
    copy = wire / cal.host_rate
    bucket = simulate.DEFAULTS["allreduce"]["bucket_mb"] * simulate.MIB  # the run's: the workbench's default
    first = simulate.bucket_sizes(cal.model_bytes, bucket)[0] / cal.model_bytes
    if cores is not None and workers >= cores:
        share = cores / workers
        overlapped = (1 - first) * simulate.BACKWARD_SHARE
        compute = cal.compute_s * (1 + overlapped) / share
        exposed = (copy - overlapped * cal.compute_s) / share
    else:
        compute = cal.compute_s
        exposed = bucket_exposure(copy, simulate.BACKWARD_SHARE * compute, cal.model_bytes, bucket)
    comm = exposed + cal.compute_s * cal.compute_spread * simulate.expected_max(workers)  # the wait for the slower
    rng = random.Random(0)
    records = []
    for worker in range(workers):
        for step in range(steps):
            # A symmetric jitter of known robust spread (a normal draw) around the mean step.
            jitter = rng.gauss(0, cal.compute_spread)
            records.append({"worker": worker, "step": step, "compute_s": compute * (1 + jitter), "comm_s": comm,
                            "wait_s": 0.0, "samples": 128, "strategy": "allreduce", "bytes_sent": wire})
    return records, workers * 128 / (compute + comm)


@pytest.mark.parametrize("cores", [None, 2.0])
def test_calibration_recovers_the_values_synthetic_records_were_made_from(cores):
    truth = calibration(compute_s=0.019, compute_spread=0.05, host_rate=600e6)
    records, samples_per_s = _synthetic_allreduce(truth, 2, cores)
    got = calibrate(records, MODEL_BYTES, workers=2, cores=cores)
    assert got.compute_s == pytest.approx(truth.compute_s, rel=0.03)
    assert got.compute_spread == pytest.approx(truth.compute_spread, rel=0.15)
    assert got.host_rate == pytest.approx(truth.host_rate, rel=0.05)
    assert got.samples_per_step == 128
    # The model's size is also read from what the ring sent per worker.
    assert calibrate(records, workers=2, cores=cores).model_bytes == pytest.approx(MODEL_BYTES)
    # And the calibrated model predicts the run it was calibrated from.
    again = predict(got, "allreduce", {}, 2, None, cores=cores).samples_per_s
    assert again == pytest.approx(samples_per_s, rel=0.05)


def test_calibration_from_averaging_reads_compute_between_syncs_and_the_exchange_at_them():
    records = []
    for worker in range(2):
        for step in range(64):
            sync = step % 4 == 3
            records.append({"worker": worker, "step": step, "compute_s": 0.02, "samples": 128, "strategy": "average",
                            "comm_s": 0.015 if sync else 0.0, **({"bytes_sent": MODEL_BYTES} if sync else {})})
    got = calibrate(records, MODEL_BYTES, workers=2, cores=2)
    assert got.compute_s == pytest.approx(0.02)
    assert got.host_rate == pytest.approx(MODEL_BYTES / 0.015)
    # With a 100 Mbit/s link, the wire's own time is taken out of the exchange first.
    slow = [dict(r, comm_s=MODEL_BYTES / (12.5e6 * 1448 / 1514) + 0.015) if r.get("bytes_sent") else r
            for r in records]
    assert calibrate(slow, MODEL_BYTES, link_rate=12.5e6, workers=2).host_rate == pytest.approx(MODEL_BYTES / 0.015)


def _average_p4_records(cpu_s: tuple[float, float] | None = None) -> list[dict]:
    """Two workers' `average` p4 step records: 20 ms of compute a step; each sync 16 ms, 12 of them the
    all-reduce (`exchange_s`); with `cpu_s`, a local step's and a sync's process CPU time."""
    records = []
    for worker in range(2):
        for step in range(64):
            sync = step % 4 == 3
            extra = {"bytes_sent": MODEL_BYTES, "exchange_s": 0.012} if sync else {}
            if cpu_s is not None:
                extra["cpu_s"] = cpu_s[sync]
            records.append({"worker": worker, "step": step, "compute_s": 0.02, "samples": 128, "strategy": "average",
                            "comm_s": 0.016 if sync else 0.0, **extra})
    return records


def test_an_average_sync_timed_apart_from_its_all_reduce_gives_the_rate_and_its_local_work():
    # Records since 2026-11-25 time the all-reduce alone (`exchange_s`); the rest of the sync is its own
    # copies, on the worker's core, and the rate is the all-reduce's.
    records = _average_p4_records()
    got = calibrate(records, MODEL_BYTES, workers=2)
    assert got.host_rate == pytest.approx(MODEL_BYTES / 0.012)
    assert got.sync_local_s == pytest.approx(0.004)
    # The calibration predicts the run it came from: 4 steps of compute, the local work, the all-reduce.
    again = predict(got, "average", {"period": 4}, 2, None)
    assert again.samples_per_s == pytest.approx(2 * 4 * 128 / (4 * 0.02 + 0.016), rel=1e-6)
    # The local work is the sync's, not the wire's: `allreduce` does not pay it, a slower link does not
    # change it, and overlap cannot hide it.
    assert predict(got, "allreduce", {}, 2, None) == predict(dataclasses.replace(got, sync_local_s=0.0), "allreduce", {}, 2, None)
    overlapped = predict(got, "average", {"period": 4, "overlap": True}, 2, None)
    assert overlapped.samples_per_s == pytest.approx(2 * 4 * 128 / (4 * 0.02 + 0.004), rel=1e-6)
    # The same from a DataFrame's records, where a step between syncs has NaN for what it lacks.
    frame = pd.DataFrame(records).to_dict("records")
    assert math.isnan(frame[0]["bytes_sent"]) and calibrate(frame, MODEL_BYTES, workers=2) == got
    # Older records without `exchange_s` (or with it on some syncs only) keep the whole sync as the exchange.
    untimed = [{k: v for k, v in r.items() if k != "exchange_s"} for r in records]
    assert calibrate(untimed, MODEL_BYTES, workers=2).sync_local_s == 0.0
    assert calibrate(untimed, MODEL_BYTES, workers=2).host_rate == pytest.approx(MODEL_BYTES / 0.016)


def test_the_exchange_cpu_time_is_what_a_capped_host_stretches():
    # Records with the process's CPU time (`cpu_s`): a local step costs 20 ms of CPU, a sync 20 + 4 (its
    # copies) + 5: the all-reduce's 12 ms held 7 ms of waiting for the peer.
    records = _average_p4_records(cpu_s=(0.02, 0.029))
    got = calibrate(records, MODEL_BYTES, workers=2)
    assert got.host_rate == pytest.approx(MODEL_BYTES / 0.012)
    assert got.exchange_cpu_rate == pytest.approx(MODEL_BYTES / 0.005)
    # At a whole core nothing changes; at half a core only the 5 ms of CPU doubles, not the 7 of waiting.
    untimed = calibrate([{k: v for k, v in r.items() if k != "cpu_s"} for r in records], MODEL_BYTES, workers=2)
    assert untimed.exchange_cpu_rate is None
    assert predict(got, "average", {"period": 4}, 2, None) == predict(untimed, "average", {"period": 4}, 2, None)
    # Under a quota on the process (the lab's cgroup) only its own CPU time counts and stretches; on cores
    # it shares, the whole exchange does (the kernel's network work is charged to no one in particular).
    assert got.moving_s(MODEL_BYTES, 0.5, quota=True) == pytest.approx(0.012 + 0.005)
    assert got.moving_s(MODEL_BYTES, 0.5) == untimed.moving_s(MODEL_BYTES, 0.5, quota=True) == pytest.approx(0.024)
    lab = {"straggler": 0.5, "cores": 2.0}
    capped = predict(got, "allreduce", {"bucket_mb": 64}, 2, None, **lab)
    assert capped.samples_per_s > 1.1 * predict(untimed, "allreduce", {"bucket_mb": 64}, 2, None, **lab).samples_per_s
    # Without a straggler, or on hosts of their own (a slow host's cap is its cores), nothing changes.
    for setting in ({"cores": 2.0}, {"straggler": 0.5}):
        assert predict(got, "allreduce", {}, 3, None, **setting) == predict(untimed, "allreduce", {}, 3, None, **setting)
    # A CPU time above the wall-clock time at a whole core is noise: the rate is host_rate's, no lower.
    noisy = [{**r, "cpu_s": 0.04} if r.get("bytes_sent") else r for r in records]
    assert calibrate(noisy, MODEL_BYTES, workers=2).exchange_cpu_rate == pytest.approx(got.host_rate)


def test_bad_arguments_say_what_is_allowed():
    with pytest.raises(ValueError, match="strategy='ring'"):
        predict(calibration(), "ring", {}, 2)
    with pytest.raises(ValueError, match="workers=0"):
        predict(calibration(), "allreduce", {}, 0)
    with pytest.raises(ValueError, match="no step records"):
        calibrate([], MODEL_BYTES)
    with pytest.raises(ValueError, match="not modelled"):
        predict(calibration(), "async", {"compression": "threshold"}, 2)


def test_defaults_are_the_strategies_own():
    from workbench.strategies import make_settings

    for strategy, values in simulate.DEFAULTS.items():
        settings = dataclasses.asdict(make_settings(strategy, {}))
        assert {key: settings[key] for key in values} == values, strategy


def test_buckets_are_cut_as_the_strategy_cuts_them():
    from workbench.comm.averaging import assign_buckets
    from workbench.strategies.allreduce import FIRST_BUCKET_BYTES

    assert simulate.FIRST_BUCKET_BYTES == FIRST_BUCKET_BYTES
    mib = simulate.MIB
    assert simulate.bucket_sizes(7.5 * mib, 25 * mib) == [1 * mib, 6.5 * mib]  # the first capped, the rest one
    assert simulate.bucket_sizes(2.5 * mib, 1 * mib) == [1 * mib, 1 * mib, 0.5 * mib]
    assert simulate.bucket_sizes(0.5 * mib, 25 * mib) == [0.5 * mib]
    # The strategy's own cut of 1 KiB parameters, against the model's of their total.
    sizes = [1024] * 3000
    cut = [sum(sizes[i] for i in group) for group in assign_buckets(sizes, 1 * mib, FIRST_BUCKET_BYTES)]
    assert cut == simulate.bucket_sizes(sum(sizes), 1 * mib)


def test_1024_workers_predict_quickly_and_finitely():
    cal = calibration(compute_spread=0.1)
    for strategy, settings in STRATEGIES:
        got = predict(cal, strategy, settings, 1024, 125e6)
        assert math.isfinite(got.samples_per_s) and got.samples_per_s > 0
        assert 0 <= got.comm_share <= 1


def test_ssp_holds_the_faster_workers_only_once_the_gap_reached_its_bound():
    # 100 Mbit/s: the remote worker pushes about once a second, the one beside the server every 80 ms:
    # a gap of 8 clocks takes well under 2 s to build, but not 0.1 s.
    cal = calibration()
    early = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6, elapsed_s=0.1)
    late = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6, elapsed_s=30.0)
    free = predict(cal, "async", {"push_every": 4}, 2, 12.5e6)
    assert early.samples_per_s == pytest.approx(free.samples_per_s)
    assert late.samples_per_s == pytest.approx(predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6).samples_per_s)
    assert late.samples_per_s < free.samples_per_s / 3


def test_ssp_over_a_window_is_free_until_the_bound_binds_and_held_after():
    # A measurement over a window that the bound starts binding in sees both: the mean is free for the
    # part before the gap reached max_staleness and held after, staleness weighted by each part's pushes.
    cal = calibration()
    free = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6, elapsed_s=0.0)
    held = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6)
    remote, beside = free.per_worker_samples_per_s[1], free.per_worker_samples_per_s[0]
    apart = (beside - remote) / (cal.samples_per_step * 4)  # clocks per second
    binds_at = (8 + 1) / apart  # the first wait comes when the gap exceeds max_staleness 8
    window = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6, elapsed_s=binds_at, window_s=2 * binds_at)
    assert window.samples_per_s == pytest.approx((free.samples_per_s + held.samples_per_s) / 2, rel=1e-6)
    pushes = free.samples_per_s, held.samples_per_s
    assert window.staleness == pytest.approx(
        (pushes[0] * free.staleness + pushes[1] * held.staleness) / sum(pushes), rel=1e-6)
    # Wholly before or wholly after the bound binds: the one state alone.
    before = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6, elapsed_s=binds_at / 4, window_s=binds_at / 4)
    after = predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6, elapsed_s=4 * binds_at, window_s=binds_at)
    assert before.samples_per_s == pytest.approx(free.samples_per_s)
    assert after.samples_per_s == pytest.approx(held.samples_per_s)
    with pytest.raises(ValueError, match="window_s=-1"):
        predict(cal, "ssp", {"push_every": 4}, 2, 12.5e6, elapsed_s=1.0, window_s=-1)


def _random_phase_cycle(a: float, flows: int, other: float) -> float:
    """By hand: f flows of a-second pushes and replies at random phases share each direction equally,
    T = 2a / (1 - (f - 1) a / T) + other, the larger root of T^2 - ((f + 1) a + other) T + other (f - 1) a."""
    b = (flows + 1) * a + other
    return (b + math.sqrt(b * b - 4 * other * (flows - 1) * a)) / 2


def test_flows_on_the_shard_link_take_turns_when_they_fit_and_share_at_random_when_not():
    a = 0.6
    assert simulate._shared_link_cycle(a, a, 1, 2 * a + 0.1) == 2 * a + 0.1  # one flow: its own round trip
    # Two flows fit in turns (2a <= their 2a + other): their own cycle, plus the measured share of the gap
    # to random phases (3a with nothing else in the cycle).
    assert simulate._shared_link_cycle(a, a, 2, 2 * a) == pytest.approx(2 * a + simulate.TURNS_DISRUPTED * a)
    for other in (0.0, 0.1, 0.3):
        alone = 2 * a + other
        turns = simulate._shared_link_cycle(a, a, 2, alone)
        assert turns == pytest.approx(alone + simulate.TURNS_DISRUPTED * (_random_phase_cycle(a, 2, other) - alone))
        # Three do not fit (3a > 2a + other): random phases, 4a with nothing else; never below the link's bytes.
        three = simulate._shared_link_cycle(a, a, 3, alone)
        assert three == pytest.approx(_random_phase_cycle(a, 3, other), rel=1e-9)
        assert three >= 3 * a
    assert simulate._shared_link_cycle(a, a, 3, 2 * a) == pytest.approx(4 * a)
    # A flow the link clocks, with room to spare (3a <= its cycle), takes turns with two others; one
    # whose compute starts each push keeps the compute's jitter in its phase: random overlaps.
    assert simulate._shared_link_cycle(a, a, 3, 4 * a) < _random_phase_cycle(a, 3, 2 * a)
    assert simulate._shared_link_cycle(a, a, 3, 4 * a, clocked=False) == pytest.approx(_random_phase_cycle(a, 3, 2 * a))
    assert simulate._shared_link_cycle(a, a, 2, 2 * a + 0.1, clocked=False) == \
        pytest.approx(_random_phase_cycle(a, 2, 0.1))
    # Compressed pushes: the replies' direction is the busier one and sets when it saturates.
    assert simulate._shared_link_cycle(a / 2, a, 4, 1.5 * a) > 3 * a


def test_remote_workers_wait_on_the_shard_link_as_their_flows_share_it():
    # 100 Mbit/s: the others wait on the shard's link (the holder's turns, which slow its service, aside).
    cal, link = calibration(link_efficiency=1.0, server_turns=0.0), 12.5e6
    a = MODEL_BYTES / link
    one = predict(cal, "async", {"push_every": 4}, 2, link).per_worker_samples_per_s[1]
    alone = 128 * 4 / one  # one flow: its own round trip, both ways in turn
    assert alone > 2 * a
    four = predict(cal, "async", {"push_every": 4}, 4, link).per_worker_samples_per_s[1]
    assert 128 * 4 / four == pytest.approx(_random_phase_cycle(a, 3, alone - 2 * a), rel=1e-6)
    three = predict(cal, "async", {"push_every": 4}, 3, link).per_worker_samples_per_s[1]
    assert 128 * 4 / three == pytest.approx(
        alone + simulate.TURNS_DISRUPTED * (_random_phase_cycle(a, 2, alone - 2 * a) - alone), rel=1e-6)
    # A faster link: the round trip fits beside the compute, which then starts each push (random phases).
    fast = 400e6
    a, compute = MODEL_BYTES / fast, 4 * cal.compute_s
    three = predict(cal, "async", {"push_every": 4}, 3, fast).per_worker_samples_per_s[1]
    assert 2 * a < compute
    assert 128 * 4 / three == pytest.approx(_random_phase_cycle(a, 2, compute - 2 * a), rel=1e-6)


# --- a shaper's burst (the lab's tbf; a cloud instance's burst credit) ----------------------------------------

RATE_1GBIT = 125e6
BURST = 1.25e6  # the lab's bucket at 1 Gbit/s: 10 ms of the rate


def test_a_burst_is_left_out_of_synchronous_exchanges_and_unlimited_links():
    # The lab's synchronous points fit without it (see `_synchronous`); an unlimited link has no shaper.
    cal = calibration()
    for rate in (RATE_1GBIT, None):
        assert predict(cal, "allreduce", {}, 4, rate, link_burst=BURST).samples_per_s == \
            predict(cal, "allreduce", {}, 4, rate).samples_per_s
    assert predict(cal, "async", {"push_every": 4}, 2, None, link_burst=BURST).samples_per_s == \
        predict(cal, "async", {"push_every": 4}, 2, None).samples_per_s


def test_a_burst_shortens_both_messages_of_a_parameter_server_round_trip():
    # One worker across the link from the shard, its compute hidden by the round trip: push, the
    # server's copies in and out, reply. Each direction idles while the other works, so each message
    # finds the bucket full (measured on the lab with plain sockets: 0.12 s a round trip, 0.14 s with a
    # 64 KiB bucket).
    cal = calibration(compute_s=0.001, server_turns=0.0)
    link = RATE_1GBIT * cal.link_efficiency
    service = MODEL_BYTES / cal.host_rate
    got = predict(cal, "async", {"push_every": 4}, 2, RATE_1GBIT, link_burst=BURST)
    assert got.per_worker_samples_per_s[1] == pytest.approx(4 * 128 / (2 * (MODEL_BYTES - BURST) / link + service))
    plain = predict(cal, "async", {"push_every": 4}, 2, RATE_1GBIT)
    assert plain.per_worker_samples_per_s[1] == pytest.approx(4 * 128 / (2 * MODEL_BYTES / link + service))


def test_many_flows_through_one_shard_share_what_the_idle_refills():
    # The shard's link is busy with many flows' messages: each gets at most its share of the idle time
    # (smaller message / (sqrt(flows) + 1)), and with more flows than that leaves room for, less than
    # the whole bucket.
    assert simulate._shared_burst(8e6, 8e6, 1e6, 1) == (7e6, 7e6)
    assert simulate._shared_burst(8e6, 8e6, 1e6, 4) == (7e6, 7e6)  # refill 8/3 MB > 1 MB
    assert simulate._shared_burst(8e6, 8e6, 1e6, 100) == pytest.approx((8e6 - 8e6 / 11, 8e6 - 8e6 / 11))
    assert simulate._shared_burst(8e6, 8e6, 0.0, 4) == (8e6, 8e6)


@pytest.mark.parametrize("strategy,settings", STRATEGIES)
@pytest.mark.parametrize("workers", [2, 4, 64])
def test_a_burst_never_lowers_predicted_throughput(strategy, settings, workers):
    # Left aside: the CPU the exchanges a burst lets through cost the shared cores (their own test).
    cal = calibration(compute_spread=0.1, paced_cpu_s_per_byte=0.0)
    for rate in (12.5e6, RATE_1GBIT):
        without = predict(cal, strategy, settings, workers, rate, cores=2.0).samples_per_s
        with_burst = predict(cal, strategy, settings, workers, rate, cores=2.0, link_burst=rate / 100).samples_per_s
        assert with_burst >= without * (1 - 1e-9)


def test_a_bad_burst_is_refused_by_name():
    with pytest.raises(ValueError, match=r"link_burst=-1 is not allowed: expected bytes >= 0"):
        predict(calibration(), "async", {}, 2, RATE_1GBIT, link_burst=-1)
