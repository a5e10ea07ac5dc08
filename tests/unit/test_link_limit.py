"""What the link allows a run (plane/link.py): the link's rate read from the strategy's own exchanges, the
speed the link alone and compute alone would allow, the share of the link's limit the run reaches and
what bounds it; kept as records arrive, by the metrics table, for the summary and the live views."""
from __future__ import annotations

import pytest

from workbench.plane.link import LinkBook, limit_text
from workbench.plane.metrics import MetricsTable

MODEL_BYTES = 7_450_000  # the MLP 784-1024-1024-10 in float32


def _records(strategy, steps, step_s, compute_s, every=1, sent=0, received=0, took=0.0, workers=2, start=100.0,
             worker_compute=None, timed="comm_total_s"):
    """Step records of `workers` ranks, one every `step_s`, an exchange every `every` steps."""
    records = []
    for step in range(steps):
        for worker in range(workers):
            record = {"kind": "step", "worker": worker, "step": step, "time": start + step * step_s, "samples": 128,
                      "compute_s": (worker_compute or {}).get(worker, compute_s), "strategy": strategy, "loss": 1.0,
                      "comm_s": 0.0}
            if (step + 1) % every == 0:
                record.update({"bytes_sent": sent, timed: took})
                if received:
                    record["bytes_received"] = received
            records.append(record)
    return records


def _limit(records, paced):
    book = LinkBook()
    for record in records:
        book.add(record)
    return book.limit(paced)


def test_ssp_on_a_100mbit_link_is_bound_by_the_link_and_reaches_most_of_what_it_allows():
    # A push and a reply of the whole model every step, 1.2 s the round trip, 0.07 s of compute, a step
    # every 1.27 s: the link moves 2 x 7.45 MB in 1.2 s (12.4 MB/s, 100 Mbit/s), so alone it allows each
    # worker 128 samples every 1.2 s.
    limit = _limit(_records("ssp", 64, 1.27, 0.07, sent=MODEL_BYTES, received=MODEL_BYTES, took=1.2), paced=False)
    assert limit["link_mb_per_s"] == pytest.approx(2 * MODEL_BYTES / 1.2 / 1e6)
    assert limit["bytes_per_step"] == 2 * MODEL_BYTES and limit["steps_per_exchange"] == 1
    assert limit["link_samples_per_s"] == pytest.approx(2 * 128 / 1.2)
    assert limit["compute_samples_per_s"] == pytest.approx(2 * 128 / 0.07)
    assert limit["samples_per_s"] == pytest.approx(2 * 128 / 1.27)
    assert limit["share_of_link"] == pytest.approx(1.2 / 1.27) and limit["bound"] == "link"
    text = limit_text(limit)
    assert "link: about 12.4 MB/s, 14.2 MiB a step per worker" in text
    assert "the link alone would allow 213 samples/s, compute alone 3,657; the run makes 202, 94% of the link's " \
           "limit (bound by the link)" in text


def test_an_exchange_every_64_steps_counts_a_64th_of_its_bytes_on_each_step():
    # average p64: 2 MB sent in 0.2 s at each sync; compute 0.05 s a step.
    limit = _limit(_records("average", 128, 0.053, 0.05, every=64, sent=2_000_000, took=0.2), paced=True)
    assert limit["bytes_per_step"] == pytest.approx(2_000_000 / 64)
    assert limit["steps_per_exchange"] == pytest.approx(64)
    assert limit["link_samples_per_s"] == pytest.approx(2 * 128 / (0.2 / 64))
    assert limit["bound"] == "compute" and limit["share_of_link"] < 0.1


def test_ranks_paced_by_the_slowest_go_at_its_pace_and_ranks_on_their_own_each_at_theirs():
    records = _records("allreduce", 32, 0.12, 0.05, sent=400_000, took=0.01, worker_compute={1: 0.1}, timed="comm_s")
    assert _limit(records, paced=True)["compute_samples_per_s"] == pytest.approx(2 * 128 / 0.1)
    assert _limit(records, paced=False)["compute_samples_per_s"] == pytest.approx(128 / 0.05 + 128 / 0.1)


def test_a_rank_ahead_within_the_staleness_bound_does_not_count_as_speed_the_group_sustains():
    # ssp with the shards on rank 0's host: its exchanges stay local and it runs ahead (a step every 1.0 s
    # over the window read) while rank 1 pays 1.25 s on the link each step (a step every 1.3 s). The group
    # goes at rank 1's pace: 2 x 128 samples every 1.3 s, under the 2 x 128 every 1.25 s the link allows.
    ahead = _records("ssp", 24, 1.0, 0.02, sent=MODEL_BYTES, received=MODEL_BYTES, took=0.01, workers=1)
    behind = [{**record, "worker": 1} for record in
              _records("ssp", 18, 1.3, 0.02, sent=MODEL_BYTES, received=MODEL_BYTES, took=1.25, workers=1)]
    limit = _limit(sorted(ahead + behind, key=lambda record: record["time"]), paced=True)
    assert limit["samples_per_s"] == pytest.approx(2 * 128 / 1.3)
    assert limit["link_samples_per_s"] == pytest.approx(2 * 128 / 1.25)
    assert limit["share_of_link"] == pytest.approx(1.25 / 1.3) and limit["bound"] == "link"
    # Ranks on their own (async) are each at their own pace.
    assert _limit(ahead + behind, paced=False)["samples_per_s"] == pytest.approx(128 / 1.0 + 128 / 1.3)


def test_exchanges_queued_on_a_link_they_share_are_time_on_the_link_not_waiting():
    # Two ranks push to and fetch from the server on a third host: its link carries both, so when their
    # exchanges meet, each takes longer (1.7 s) than one alone (1.25 s, the link's rate); a step every 1.75 s.
    records = _records("ssp", 32, 1.75, 0.02, sent=MODEL_BYTES, received=MODEL_BYTES, took=1.25)
    for record in records[4:]:
        if record["step"] % 4:
            record["comm_total_s"] = 1.7
    limit = _limit(records, paced=True)
    assert limit["link_samples_per_s"] == pytest.approx(2 * 128 / 1.25) and limit["share_of_link"] < 0.8
    assert limit["bound"] == "link"


def test_exchanges_slowed_in_bursts_are_time_on_the_link_even_when_most_are_quick():
    # As read on the lab at 100 Mbit/s (ssp, three ranks, the server on a fourth rank's host): most round
    # trips take 1.3 s, but when the ranks' pushes meet at the server's link a burst of them takes 2.5 s.
    # Each step is its compute and its exchange, nothing else: the link bounds the run, and its share of
    # the link's limit is what the bursts leave (a median of the exchanges read 1.3 s and said "waiting").
    took = [2.5 if step % 8 >= 5 else 1.3 for step in range(32)]
    records, clock = [], 100.0
    for step, seconds in enumerate(took):
        clock += 0.02 + seconds
        records += [{"kind": "step", "worker": worker, "step": step, "time": clock, "samples": 128,
                     "compute_s": 0.02, "strategy": "ssp", "bytes_sent": MODEL_BYTES, "bytes_received": MODEL_BYTES,
                     "comm_total_s": seconds} for worker in range(2)]
    limit = _limit(records, paced=True)
    assert limit["link_samples_per_s"] == pytest.approx(2 * 128 / 1.3)
    assert limit["share_of_link"] == pytest.approx(1.3 / (0.02 + sum(took[1:]) / 31), rel=0.01)
    assert limit["share_of_link"] < 0.8 and limit["bound"] == "link"


def test_time_spent_neither_computing_nor_exchanging_is_called_waiting():
    # A step every second, of which 0.07 s compute and 0.1 s on the link: the rest is waiting (a straggler,
    # a queue at the server).
    limit = _limit(_records("async", 32, 1.0, 0.07, sent=1_000_000, received=1_000_000, took=0.1), paced=False)
    assert limit["bound"] == "waiting" and "waiting bounds it" in limit_text(limit)


def test_nothing_until_every_worker_has_exchanged_and_a_switch_or_a_lost_worker_starts_afresh():
    book = LinkBook()
    for record in _records("allreduce", 8, 0.1, 0.05, sent=0):  # nothing sent yet (or one worker alone)
        book.add(record)
    assert book.limit(True) is None and limit_text(None) == ""
    for record in _records("ssp", 8, 1.27, 0.07, sent=MODEL_BYTES, received=MODEL_BYTES, took=1.2, start=200.0):
        book.add(record)
    limit = book.limit(False)
    assert limit["strategy"] == "ssp" and limit["link_mb_per_s"] == pytest.approx(2 * MODEL_BYTES / 1.2 / 1e6)
    # Worker 1 lost: after a few of its step intervals without a record, only worker 0 counts.
    for record in _records("ssp", 8, 1.27, 0.07, sent=MODEL_BYTES, received=MODEL_BYTES, took=1.2, workers=1,
                           start=220.0):
        book.add(record)
    assert book.limit(False)["workers"] == 1


def test_the_metrics_table_keeps_the_book_as_records_arrive():
    table = MetricsTable()
    table.add(_records("ssp", 16, 1.27, 0.07, sent=MODEL_BYTES, received=MODEL_BYTES, took=1.2))
    asked = []
    limit = table.link_limit(lambda strategy: asked.append(strategy) or False)
    assert asked == ["ssp"] and limit["bound"] == "link"


def test_the_strategies_paced_by_their_slowest_worker_are_the_synchronous_ones_and_ssp():
    from workbench.run.views import paced_by_slowest

    assert {name: paced_by_slowest(name) for name in ("allreduce", "average", "ssp", "async", "easgd")} == {
        "allreduce": True, "average": True, "ssp": True, "async": False, "easgd": False}
    assert paced_by_slowest("a-strategy-of-a-newer-client") is True  # the cautious reading
