"""The loss watch (pure): a run that does not learn, or whose loss climbs, is said to be so once."""
import math

import pytest

from workbench.run.health import LossWatch
from workbench.plane.kinds import TRAINING_WARNING as WARNING_KIND
from workbench.plane.metrics import MetricsTable, control_markers


def _feed(watch, losses_by_step, workers=2, start=0):
    warnings = []
    for step, loss in enumerate(losses_by_step, start=start):
        for worker in range(workers):
            warning = watch.observe({"kind": "step", "worker": worker, "step": step, "loss": loss})
            if warning is not None:
                warnings.append(warning)
    return warnings


def test_a_learning_run_raises_nothing():
    watch = LossWatch(total_steps=400)
    losses = [2.3 * math.exp(-step / 50) + 0.05 for step in range(400)]
    assert _feed(watch, losses) == []
    assert abs(watch.baseline - 2.35) < 1e-12


def test_a_run_sitting_at_chance_is_not_learning_once_a_quarter_is_done():
    watch = LossWatch(total_steps=400, strategy="async", momentum=0.9)
    warnings = _feed(watch, [2.30] + [7.0] * 3 + [2.31] * 396)
    reasons = [w["reason"] for w in warnings]
    assert reasons == ["not-learning"]  # the early spike is shorter than the window: no climb
    warning = warnings[0]
    assert warning["kind"] == WARNING_KIND
    assert warning["step"] == 100  # a quarter of 400 steps
    assert "not learning" in warning["message"] and "momentum 0-0.4" in warning["message"]
    assert warning["strategy"] == "async" and warning["message"].startswith("under async, the training loss")


def test_the_warning_names_the_strategy_training_when_it_fires():
    watch = LossWatch(total_steps=100, window=10, strategy="allreduce")  # switched to average since
    warnings = []
    for step, loss in enumerate([5.5] + [5.4] * 99):
        for worker in range(2):
            warning = watch.observe({"worker": worker, "step": step, "loss": loss,
                                     "strategy": "allreduce" if step < 20 else "average"})
            warnings += [warning] if warning else []
    assert [(w["reason"], w["strategy"]) for w in warnings] == [("not-learning", "average")]
    assert warnings[0]["message"].startswith("under average, the training loss is still 5.4")


def test_a_climbing_loss_is_said_once_and_stalling_is_judged_after_the_minimum():
    watch = LossWatch(total_steps=100, window=10)
    warnings = _feed(watch, [2.3] + [2.0] * 20 + [6.0] * 79)
    assert [w["reason"] for w in warnings] == ["loss-climbing", "not-learning"]
    assert warnings[0]["step"] == 24  # when 7 of the last 10 records (2 a step) are past the jump at 21
    assert warnings[1]["step"] == 50  # the minimum number of steps, more than a quarter of 100
    assert "Try a lower learning rate" in warnings[0]["message"]


def test_a_small_loss_doubling_is_noise_not_a_climb():
    watch = LossWatch(total_steps=1000, window=10)
    assert _feed(watch, [0.02] + [0.01] * 100 + [0.05] * 100) == []  # below baseline + 0.5


def test_a_resumed_run_starts_its_baseline_at_the_resume_step():
    watch = LossWatch(total_steps=400, first_step=300)
    assert _feed(watch, [0.4] + [0.3] * 99, start=300) == []
    assert watch.baseline == 0.4


def test_warnings_reach_the_live_view_and_the_markers():
    table = MetricsTable()
    warning = {"kind": WARNING_KIND, "reason": "not-learning", "step": 100, "time": 1.0, "message": "m"}
    table.add([warning])
    assert table.live_view()["warnings"] == ["m"]
    assert control_markers(table.events()) == [{"kind": WARNING_KIND, "step": 100, "time": 1.0,
                                                "label": "warning: not-learning"}]


# --- LinkWatch: a parameter-server strategy slower than allreduce would be on the run's link ------------

MODEL_BYTES = 7_450_000  # the MLP 784-1024-1024-10 in float32


def _link_records(strategy, every, step_s, round_trip_s, workers=2, steps=64, compute_s=0.07):
    """Step records of `workers` ranks: a push of the whole model every `every` steps, answered in full."""
    records = []
    for step in range(steps):
        for worker in range(workers):
            record = {"kind": "step", "worker": worker, "step": step, "time": 100.0 + step * step_s, "samples": 128,
                      "compute_s": compute_s, "strategy": strategy, "loss": 1.0}
            if (step + 1) % every == 0:
                record.update(comm_total_s=round_trip_s, bytes_sent=MODEL_BYTES, bytes_received=MODEL_BYTES)
            records.append(record)
    return records


def _watch(records, model_bytes=MODEL_BYTES):
    from workbench.run.health import LinkWatch

    from workbench.plane.metrics import MetricsTable
    from workbench.run.views import paced_by_slowest

    # As the run's feed does: the table takes each record, then the watch reads the table's link.
    table = MetricsTable()
    watch = LinkWatch(model_bytes=model_bytes, batch=128,
                      limit=lambda fewest: table.link_limit(paced_by_slowest, fewest))
    watch.feed = lambda record: table.add([record]) or watch.observe(record)
    return watch, [w for w in (watch.feed(r) for r in records) if w is not None]


def test_ssp_exchanging_the_model_every_step_on_a_thin_link_is_told_allreduce_would_be_faster():
    # The figures at 100 Mbit/s: a round trip of 1.2 s a step (push, then the reply), 0.07 s of
    # compute: ssp at about 213 samples/s, where a ring all-reduce moves one model each way, 0.6 s.
    watch, warnings = _watch(_link_records("ssp", every=1, step_s=1.2, round_trip_s=1.2))
    (warning,) = warnings  # once
    measured = warning["measured"]
    assert warning["reason"] == "slower-than-allreduce" and warning["strategy"] == "ssp"
    assert measured["samples_per_s"] == pytest.approx(2 * 128 / 1.2, rel=0.02)
    assert measured["link_mb_per_s"] == pytest.approx(2 * MODEL_BYTES / 1.2 / 1e6)
    assert measured["allreduce_samples_per_s"] == pytest.approx(2 * 128 / (0.07 + 0.6), rel=0.01)
    assert "allreduce would make about 382 on this link" in warning["message"]
    assert "one exchange of the model every 1 step, 1.20 s each" in warning["message"]
    assert watch.raised == {"ssp"} and watch.feed(_link_records("ssp", 1, 1.2, 1.2)[-1]) is None


def test_a_strategy_that_exchanges_rarely_a_small_model_or_a_switch_raise_nothing_or_start_afresh():
    # async push_every=16 on the same link: far faster than allreduce would be.
    assert _watch(_link_records("async", every=16, step_s=0.08, round_trip_s=1.2))[1] == []
    # A model of a few KiB: its exchange time is latency, not the link's rate. Compute longer than an
    # exchange: the link is not the bound (on shared cores the server's work slows compute instead).
    assert _watch(_link_records("ssp", every=1, step_s=0.6, round_trip_s=0.24, compute_s=0.25))[1] == []
    assert _watch(_link_records("ssp", every=1, step_s=1.2, round_trip_s=1.2), model_bytes=40_000)[1] == []
    # Synchronous strategies are not judged; after a switch, ssp is judged on its own records alone, once
    # every worker has 16 of them.
    from workbench.run.health import LINK_MIN_RECORDS

    ssp = _link_records("ssp", every=1, step_s=1.2, round_trip_s=1.2, steps=LINK_MIN_RECORDS)
    watch, warnings = _watch(_link_records("average", every=4, step_s=0.1, round_trip_s=0.5) + ssp[:-2])
    assert warnings == []
    assert watch.feed(ssp[-2]) is None  # worker 0 has 16, worker 1 still 15
    assert watch.feed(ssp[-1])["reason"] == "slower-than-allreduce"


def test_the_slowest_workers_link_counts_not_one_beside_the_server_over_loopback():
    # Worker 0 holds the server's shard: its round trips take 0.01 s; worker 1's cross the link.
    records = [r if r["worker"] == 1 or "comm_total_s" not in r else {**r, "comm_total_s": 0.01}
               for r in _link_records("ssp", every=1, step_s=1.2, round_trip_s=1.2)]
    watch, (warning,) = _watch(records)
    assert warning["measured"]["link_mb_per_s"] == pytest.approx(2 * MODEL_BYTES / 1.2 / 1e6)


def test_the_link_is_judged_at_most_once_a_second_of_the_run_not_at_every_record(monkeypatch):
    from workbench.run.health import LinkWatch

    from workbench.run.health import LINK_MIN_RECORDS

    readings = []  # whether each call read the link (True) or found too few records yet (cheap, False)
    original = LinkWatch.reading
    def reading(self):
        result = original(self)
        readings.append(result is not None)
        return result

    monkeypatch.setattr(LinkWatch, "reading", reading)
    # 3 workers, 200 steps of 0.08 s: 600 records over 16 s, none of them earning a warning.
    watch, warnings = _watch(_link_records("async", every=16, step_s=0.08, round_trip_s=1.2, workers=3, steps=200))
    assert warnings == [] and 10 <= sum(readings) <= 16
    assert readings.count(False) <= 3 * LINK_MIN_RECORDS  # only until every worker has its records
