"""`auto`'s decision table, without a cluster (workbench/run/auto_policy.py): measured situation -> choice, the
learning rate that follows a switch, and hysteresis (no flapping, a bounded rate of switches)."""
import pytest

from workbench.run.auto_policy import (PACED_ABOVE, STRAGGLER_BELOW, STRAGGLER_GONE_ABOVE, WAIT_ABOVE, Chooser, Window,
                                      fitting, measure,
                                      waiting_for_the_last)

EVEN = {0: 1000.0, 1: 1000.0}


def window(strategy, exchange_s, compute_s=0.1, rates=EVEN):
    """`rates`: each worker's own speed (samples/s); its compute time per step follows from it."""
    fastest = max(rates.values())
    return Window(strategy, {w: compute_s * fastest / rate for w, rate in rates.items()}, dict(rates), exchange_s)


def past_its_first_choice(chooser):
    """`chooser` after a real first choice long ago (allreduce -> average), so that any later move needs
    `confirm` windows: the first move away from the start needs one fewer."""
    for t in range(chooser.confirm):
        if chooser.observe(window("allreduce", 0.2), {}, t - 1000) is not None:
            return chooser
    raise AssertionError("no first choice")


@pytest.mark.parametrize("strategy,settings,exchange_s,rates,expected", [
    # A link that costs half a step or more per exchange: averaging, with a period that hides it.
    ("allreduce", {}, 0.05, EVEN, ("average", {"period": 8, "overlap": True})),
    ("allreduce", {}, 0.5, EVEN, ("average", {"period": 64, "overlap": True})),
    ("allreduce", {}, 0.01, EVEN, None),  # a fast link: exact allreduce stays
    ("allreduce", {}, 0.03, EVEN, None),  # in the band between the thresholds: nothing changes
    ("average", {"period": 8}, 0.01, EVEN, ("allreduce", {})),  # the link got fast
    ("average", {"period": 8}, 0.03, EVEN, None),
    ("average", {"period": 8}, 0.05, EVEN, None),  # the period fits already
    ("average", {"period": 8}, 0.3, EVEN, ("average", {"period": 32, "overlap": True})),  # the link got slower
    # Overlapped, an exchange that lands within half its period is hidden already: the period stays (6
    # steps in 16, 8 in 64); one that does not is hidden as before, and a period far longer than it needs
    # comes down.
    ("average", {"period": 16, "overlap": True}, 0.6, EVEN, None),
    ("average", {"period": 64, "overlap": True}, 0.8, EVEN, None),
    ("average", {"period": 16, "overlap": True}, 0.9, EVEN, ("average", {"period": 64, "overlap": True, "wire_dtype": "bf16"})),
    ("average", {"period": 64, "overlap": True}, 0.2, EVEN, ("average", {"period": 32, "overlap": True})),
    # So slow that 64 steps cannot hide a float32 exchange (40 steps of compute): half the bytes, bf16.
    ("average", {"period": 64, "overlap": True}, 4.0, EVEN, ("average", {"period": 64, "overlap": True, "wire_dtype": "bf16"})),
    ("allreduce", {}, 1.0, EVEN, ("average", {"period": 64, "overlap": True, "wire_dtype": "bf16"})),
    # bf16 halved what it measures (4 steps): it stays on, no flapping back to float32.
    ("average", {"period": 64, "overlap": True, "wire_dtype": "bf16"}, 0.4, EVEN, None),
    ("average", {"period": 64, "overlap": True, "wire_dtype": "float32"}, 0.4, EVEN, None),  # as a run names it
    # So slow that even bf16 at period 64 leaves the exchange exposed (the overlapped 64 steps cannot hide
    # it): elastic averaging, where only the workers behind the link wait. From float32, its bf16 half counts.
    ("average", {"period": 64, "overlap": True, "wire_dtype": "bf16"}, 7.0, EVEN, ("easgd", {"period": 16})),
    ("average", {"period": 64, "overlap": True, "wire_dtype": "bf16"}, 6.0, EVEN, None),
    ("allreduce", {}, 15.0, EVEN, ("easgd", {"period": 16})),
    ("allreduce", {}, 12.0, EVEN, ("average", {"period": 64, "overlap": True, "wire_dtype": "bf16"})),
    ("easgd", {"period": 16}, 7.0, EVEN, None),  # the link still too slow for averaging: stays
    ("easgd", {"period": 16}, 6.0, EVEN, ("average", {"period": 64, "overlap": True, "wire_dtype": "bf16"})),
    # A straggler: nobody should wait for it. Under allreduce first its share of each batch cut to its
    # speed (balanced, still exact); where that does not even the steps, or under averaging: elastic
    # averaging, the period at least 16, more where the exchange needs it to be hidden.
    ("allreduce", {}, 0.01, {0: 1000.0, 1: 450.0}, ("allreduce", {"balance": True})),
    ("allreduce", {"balance": False}, 0.01, {0: 1000.0, 1: 450.0}, ("allreduce", {"balance": True})),
    ("allreduce", {"balance": True}, 0.01, {0: 1000.0, 1: 450.0}, ("easgd", {"period": 16})),
    ("allreduce", {"balance": True}, 0.01, {0: 1000.0, 1: 950.0}, None),  # balanced: the steps even
    ("average", {"period": 8}, 0.05, {0: 1000.0, 1: 500.0}, ("average", {"balance": True})),
    ("average", {"period": 8, "balance": True}, 0.05, {0: 1000.0, 1: 500.0}, ("easgd", {"period": 16})),
    ("average", {"period": 64, "balance": True}, 0.5, {0: 1000.0, 1: 500.0}, ("easgd", {"period": 64})),
    ("easgd", {"period": 16}, 0.01, {0: 1000.0, 1: 700.0}, None),  # still uneven: stays
    ("easgd", {"period": 16}, 0.01, {0: 1000.0, 1: 950.0}, ("allreduce", {})),  # even again, fast link
    ("easgd", {"period": 16}, 0.2, {0: 1000.0, 1: 950.0}, ("average", {"period": 32, "overlap": True})),
    # A run a user pinned to async and then gave back to auto: as from any strategy that does not wait.
    ("async", {"push_every": 4}, 0.01, {0: 1000.0, 1: 700.0}, None),
    ("async", {"push_every": 4}, 0.01, {0: 1000.0, 1: 950.0}, ("allreduce", {})),
    ("allreduce", {}, None, EVEN, None),  # no exchange seen yet: no judgement
])
def test_the_decision_table(strategy, settings, exchange_s, rates, expected):
    found = fitting(window(strategy, exchange_s, rates=rates), settings)
    assert (found and found[:2]) == expected
    if found:  # the reason carries the measurement behind it
        straggling = min(rates.values()) < 0.6 * max(rates.values())
        assert ("%" in found[2]) if straggling else ("steps" in found[2])


def test_a_straggler_gets_elastic_averaging_and_the_lr_follows_only_moves_to_and_from_full_pushes():
    chooser = Chooser(workers=4, confirm=1, min_interval_s=0)
    straggling = {0: 1000.0, 1: 1000.0, 2: 1000.0, 3: 300.0}
    balanced = chooser.observe(window("allreduce", 0.01, rates=straggling), {}, now=-1)
    assert (balanced.strategy, balanced.settings, balanced.lr_factor) == ("allreduce", {"balance": True}, 1)
    assert "worker 3 computes at 30% of the others' speed: allreduce, balanced" in balanced.reason
    # Balanced, worker 3 still computes at 30% a step (a delay not per sample): elastic averaging.
    elastic = chooser.observe(window("allreduce", 0.01, rates=straggling), {"balance": True}, now=0)
    # Each easgd worker steps at the job's lr, as under allreduce: the lr stays.
    assert elastic.strategy == "easgd" and elastic.lr_factor == 1
    assert "worker 3 computes at 30% of the others' speed: easgd, period 16" in elastic.reason
    # Recovery is judged on each worker's median over the recent windows: a straggler still slow, then
    # even, is not enough (medians 0.46); a second even window is (the medians are even: 100%).
    still_slow = window("easgd", 0.01, rates=straggling)
    even = window("easgd", 0.01, rates={w: 1000.0 for w in range(4)})
    assert chooser.observe(still_slow, {"period": 16}, now=0.5) is None
    assert chooser.observe(even, {"period": 16}, now=1) is None and chooser.spread == pytest.approx(0.4615, abs=1e-3)
    back = chooser.observe(even, {"period": 16}, now=1.5)
    assert back.strategy == "allreduce" and back.lr_factor == 1 and "workers even again (100%)" in back.reason
    average = chooser.observe(window("allreduce", 0.1), {}, now=2)
    assert average.strategy == "average" and average.lr_factor == 1
    # From async (pinned by a user, then auto again) every push was applied in full: the lr x workers.
    from_async = Chooser(workers=4, confirm=1, min_interval_s=0).observe(window("async", 0.01), {}, 0)
    assert from_async.strategy == "allreduce" and from_async.lr_factor == 4


def test_a_straggler_back_at_its_own_speed_ends_easgd_though_the_others_now_run_unevenly():
    # Under easgd nobody waits: the others run flat out on shared cores and measure unevenly among
    # themselves. The straggler's own speed, against what the others had when it was called a straggler,
    # says it recovered.
    chooser = past_its_first_choice(Chooser(workers=4, confirm=2, min_interval_s=0))
    balanced = {"balance": True}  # tried already: the steps stayed uneven
    chose = chooser.observe(window("allreduce", 0.01, rates={0: 1000.0, 1: 1000.0, 2: 1000.0, 3: 300.0}), balanced, 0)
    assert chose is None  # confirm=2: seen once
    chose = chooser.observe(window("allreduce", 0.01, rates={0: 1000.0, 1: 1000.0, 2: 1000.0, 3: 300.0}), balanced, 1)
    assert chose.strategy == "easgd" and chooser.straggler == (3, pytest.approx(0.1))
    uneven = Window("easgd", {0: 0.1, 1: 0.1, 2: 0.16, 3: 0.1}, {}, 0.001)  # worker 2 slowed by contention
    assert uneven.speed_spread == pytest.approx(0.625)  # by itself: still "uneven", would stay async
    assert chooser.observe(uneven, {"period": 16}, 2) is None and chooser.spread == pytest.approx(1.0)
    back = chooser.observe(uneven, {"period": 16}, 3)
    assert back.strategy == "allreduce" and chooser.straggler is None
    # While the straggler is still slow, neither reading lets it go.
    chooser = Chooser(workers=2, confirm=1, min_interval_s=0)
    assert chooser.observe(window("allreduce", 0.01, rates={0: 1000.0, 1: 400.0}), balanced, 0).strategy == "easgd"
    for t in range(1, 6):
        assert chooser.observe(window("easgd", 0.01, rates={0: 1000.0, 1: 450.0}), {"period": 16}, t) is None


def test_easgd_taken_for_the_link_comes_back_with_the_link_though_the_centers_host_reads_slower():
    # Under easgd the worker holding the center serves every push on its own CPU: on the lab it read 0.65
    # of the others' speed for as long as easgd ran. Taken for the link, the way back is the link's alone.
    chooser = past_its_first_choice(Chooser(workers=3, confirm=2, min_interval_s=0))
    bf16 = {"period": 64, "overlap": True, "wire_dtype": "bf16"}
    even = {0: 1000.0, 1: 1000.0, 2: 1000.0}
    move = chooser.observe(window("average", 30.0, rates=even), bf16, 0)  # clear: one window of confirm=2
    assert move.strategy == "easgd" and "hides even in bf16" in move.reason
    assert chooser.for_link and chooser.straggler is None
    serving = {0: 650.0, 1: 1000.0, 2: 1000.0}  # worker 0 holds the center
    assert chooser.observe(window("easgd", 8.0, rates=serving), {"period": 16}, 2) is None  # link still slow
    assert chooser.observe(window("easgd", 0.2, rates=serving), {"period": 16}, 3) is None  # confirm=2: once
    back = chooser.observe(window("easgd", 0.2, rates=serving), {"period": 16}, 4)
    assert (back.strategy, back.settings) == ("average", {"period": 32, "overlap": True})
    assert "the link is back (2.0 steps an exchange)" in back.reason and not chooser.for_link
    # Taken for a straggler, the same readings keep it: the spread is what it waits on.
    chooser = past_its_first_choice(Chooser(workers=3, confirm=1, min_interval_s=0))
    took = chooser.observe(window("average", 0.05, rates={0: 1000.0, 1: 1000.0, 2: 400.0}),
                           {"period": 8, "balance": True}, 0)  # balanced already: the steps stayed uneven
    assert took.strategy == "easgd" and not chooser.for_link and chooser.straggler is not None
    slow_center = {0: 650.0, 1: 1000.0, 2: 600.0}  # the straggler not quite back, the center's host slower
    assert [chooser.observe(window("easgd", 0.2, rates=slow_center), {"period": 16}, t) for t in (1, 2, 3)] == [None] * 3


def test_a_choice_needs_confirming_windows_and_switches_are_spaced():
    chooser = Chooser(workers=2, confirm=3, min_interval_s=20)
    uneven, balanced = window("allreduce", 0.001, rates={0: 1000.0, 1: 400.0}), {"balance": True}
    # The first move away from the start: confirm - 1 windows (nothing to flap back to).
    assert chooser.observe(uneven, balanced, 0) is None
    assert chooser.observe(window("allreduce", 0.001), balanced, 1) is None  # the condition went away: start over
    assert chooser.observe(uneven, balanced, 2) is None
    assert chooser.observe(uneven, balanced, 3).strategy == "easgd"
    # Another condition right after: three windows, and not before min_interval_s has passed.
    back = window("easgd", 0.001)
    assert [chooser.observe(back, {"period": 16}, t) for t in (4, 5, 6, 22)] == [None] * 4
    assert chooser.observe(back, {"period": 16}, 23).strategy == "allreduce"
    slow = window("allreduce", 0.07)  # 0.7 steps: averaging, near its threshold; any later move needs all three
    assert [chooser.observe(slow, {}, t) for t in (44, 45)] == [None, None]
    assert chooser.observe(slow, {}, 46).strategy == "average"


def test_a_link_far_past_its_threshold_is_confirmed_one_window_sooner_and_not_held_back():
    # allreduce at 2 steps an exchange (4x the averaging threshold), after a first move: two windows, not three.
    chooser = past_its_first_choice(Chooser(workers=2, confirm=3, min_interval_s=0))
    slow = window("allreduce", 0.2)
    assert chooser.observe(slow, {}, 0) is None
    assert chooser.observe(slow, {}, 1).strategy == "average"
    # Averaging in bf16 at period 64 on a link that fell: an exchange of 300 steps (past 2 x 64) goes to
    # easgd after two windows; one of 100 steps (past 64, under 128) after three.
    settings = {"period": 64, "overlap": True, "wire_dtype": "bf16"}
    for exchange_s, windows in ((30.0, 2), (10.0, 3)):
        chooser = past_its_first_choice(Chooser(workers=2, confirm=3, min_interval_s=0))
        choices = [chooser.observe(window("average", exchange_s), settings, t) for t in range(windows)]
        assert choices[:-1] == [None] * (windows - 1) and choices[-1].strategy == "easgd", (exchange_s, choices)
    # Nor is it held back by the switch before it (a period change just made): the link fell meanwhile.
    chooser = past_its_first_choice(Chooser(workers=2, confirm=3, min_interval_s=8))
    assert [chooser.observe(window("average", 0.9), {"period": 16, "overlap": True}, t) for t in (0, 2)] == [None, None]
    assert chooser.observe(window("average", 0.9), {"period": 16, "overlap": True}, 4).settings["period"] == 64
    settings = {"period": 64, "overlap": True, "wire_dtype": "bf16"}
    assert chooser.observe(window("average", 30.0), settings, 6) is None
    assert chooser.observe(window("average", 30.0), settings, 8).strategy == "easgd"  # 4 s after, not 12
    # The way back is spaced as usual: an even, fast link right after is not taken before 8 s.
    fast = window("easgd", 0.01)
    assert [chooser.observe(fast, {"period": 16}, t) for t in (10, 12, 14)] == [None] * 3
    assert chooser.observe(fast, {"period": 16}, 16).strategy == "allreduce"
    # A reading that is clear but changes its mind is not: the count starts over as before.
    chooser = past_its_first_choice(Chooser(workers=2, confirm=3, min_interval_s=0))
    assert chooser.observe(slow, {}, 0) is None
    assert chooser.observe(window("allreduce", 0.01), {}, 1) is None
    assert chooser.observe(slow, {}, 2) is None
    assert chooser.observe(slow, {}, 3).strategy == "average"


def test_the_first_move_from_allreduce_to_averaging_takes_one_window_and_to_easgd_two():
    # From the start, allreduce at 0.6 steps an exchange (past the threshold, not clear): averaging at once.
    chooser = Chooser(workers=2, confirm=3, min_interval_s=8)
    first = chooser.observe(window("allreduce", 0.06), {}, 0)
    assert (first.strategy, first.settings) == ("average", {"period": 8, "overlap": True})
    # Later moves are confirmed as usual: back to allreduce after three windows, 8 s on.
    fast = window("average", 0.001)
    assert [chooser.observe(fast, {"period": 8, "overlap": True}, t) for t in (2, 4, 6)] == [None] * 3
    assert chooser.observe(fast, {"period": 8, "overlap": True}, 8).strategy == "allreduce"
    # A first move for a straggler: two windows (speeds on shared cores swing from one to the next).
    chooser = Chooser(workers=2, confirm=3, min_interval_s=8)
    uneven = window("allreduce", 0.001, rates={0: 1000.0, 1: 400.0})
    assert chooser.observe(uneven, {"balance": True}, 0) is None
    assert chooser.observe(uneven, {"balance": True}, 2).strategy == "easgd"


def test_a_link_at_the_edge_does_not_flap():
    # An exchange cost wavering around the averaging threshold: one switch, then the band holds it.
    chooser = Chooser(workers=2, confirm=2, min_interval_s=0)
    strategy, settings, choices = "allreduce", {}, []
    for t, exchange_s in enumerate([0.06, 0.04] * 3 + [0.06] * 6 + [0.04, 0.06] * 5):
        choice = chooser.observe(window(strategy, exchange_s), settings, t)
        if choice:
            choices.append(choice.strategy)
            strategy, settings = choice.strategy, choice.settings
    assert choices == ["average"]


def test_a_straggler_under_averaging_is_read_as_a_straggler_not_a_slow_link():
    # Average p64: worker 2 computes at 40% of the others' speed, so at each sync workers 0 and 1 wait for
    # it, 64 x 1.5 of their steps; its own sync (it arrives last) takes 2 ms.
    records = []
    for step in range(64 * 3):
        for worker, compute_s in ((0, 0.002), (1, 0.002), (2, 0.005)):
            synced = (step + 1) % 64 == 0
            records.append({"worker": worker, "step": step, "time": 100 + 0.005 * step, "samples": 32,
                            "compute_s": compute_s, "comm_s": 0.0,
                            "comm_total_s": (0.002 if worker == 2 else 0.194) if synced else None})
    window = measure(records, "average")
    assert window.exchange_s == pytest.approx(0.002) and window.slowest == 2
    balanced = {"period": 64, "wire_dtype": "bf16", "overlap": True, "balance": True}
    strategy, settings, reason = fitting(window, balanced)
    assert strategy == "easgd" and reason.startswith("worker 2 computes at 40% of the others' speed")
    # Not balanced yet, or with data each worker holds its own of: the batch cut first, or elastic averaging.
    assert fitting(window, {**balanced, "balance": False})[:2] == ("average", {"balance": True})
    assert fitting(window, {**balanced, "balance": False}, can_balance=False)[0] == "easgd"


def test_a_window_is_measured_from_step_records():
    records = []
    for step in range(5):
        records.append({"worker": 0, "step": step, "time": 100 + 0.1 * step, "samples": 32, "compute_s": 0.08,
                        "comm_s": 0.02})
        records.append({"worker": 1, "step": step, "time": 100 + 0.2 * step, "samples": 32, "compute_s": 0.18,
                        "comm_s": 0.02})
    measured = measure(records, "allreduce")
    assert measured.compute_s == pytest.approx({0: 0.08, 1: 0.18})
    assert measured.samples_per_s == pytest.approx({0: 320.0, 1: 160.0})
    assert measured.exchange_s == pytest.approx(0.02) and measured.speed_spread == pytest.approx(0.08 / 0.18)  # the other one: the median of one
    assert measured.slowest == 1
    assert measured.exchange_in_steps == pytest.approx(0.02 / 0.13)
    # Under averaging only the syncs carry an exchange; too few steps say nothing.
    for record in records:
        record["comm_total_s"] = 0.5 if record["step"] == 4 else None
    assert measure(records, "average").exchange_s == 0.5
    # The slowest worker's exchange decides; a worker with none in the window leaves it unknown.
    records[-2]["comm_total_s"] = None
    assert measure(records, "average").exchange_s is None
    for record in records:
        record["comm_total_s"] = 0.5 if record["worker"] == 0 else 2.0
    records[-1]["comm_total_s"] = 0.1
    assert measure(records, "easgd").exchange_s == 2.0
    # Synchronous: the worker that waited least for the others times the exchange itself.
    assert measure(records, "average").exchange_s == 0.5
    assert measure(records[:4], "allreduce") is None

    # Only exchanges that landed after `since` (per worker) count: each is evidence once.
    assert measure(records, "easgd", since={0: 100.35, 1: 100.75}).exchange_s == 0.5  # worker 1's new one: 0.1
    assert measure(records, "easgd", since={0: 100.45, 1: 100.85}).exchange_s is None


class _Run:
    """The parts of a run `AutoPilot.tick` reads and calls, over a real `MetricsTable` fed a scripted
    stream of step records (the pure decision path; the cluster's is in tests/lab/test_multihost.py)."""

    def __init__(self):
        from workbench.plane.metrics import MetricsTable

        self.status, self.strategy, self.settings = "running", "average", {"period": 64, "overlap": True}
        self.worker_addresses, self.lr, self.table, self.switches = ["a", "b"], 0.1, MetricsTable(), []
        self.feed = type("Feed", (), {"publish": lambda _, event: None})()

    def set_lr(self, lr):
        self.lr = lr

    def switch(self, strategy, by_auto=False, **settings):
        self.switches.append((strategy, settings))
        self.strategy, self.settings = strategy, settings


def test_after_the_link_falls_auto_moves_on_the_second_slow_exchange_not_held_by_the_fast_ones_before():
    """Averaging every 64 steps of 5 ms, overlapped; at t=20 s an exchange goes from 20 ms to 3 s (600
    steps: past what bf16 at period 64 hides), longer than a window. Ticked every 0.1 s, judging every
    2 s or as soon as an exchange awaited lands. The move must come as the second slow exchange lands,
    not a window later: an 8 s window that also held the fast exchanges before the fall read as fast and
    cleared the first slow reading (here the move came a third slow exchange later; on the lab 14 s
    after the fall), one slow exchange read in two windows must not confirm it alone, and a tick that
    waits for its time after the exchange landed is up to a window late (on the lab, a second)."""
    from workbench.run.autopilot import AutoPilot

    run, pilot = _Run(), AutoPilot(workers=2)
    pilot.chooser._last_choice_at = 0.0  # past its first move (p16 -> p64), as in the benchmark
    fall, step_s, landed = 20.0, 0.005, {0: [], 1: []}
    state = {w: {"step": 0, "since_sync": 0, "lands": None, "cost": None} for w in (0, 1)}
    t = 0.0
    while t < 40 and not run.switches:
        t = round(t + step_s, 3)
        records = []
        for w, s in state.items():
            record = {"kind": "step", "worker": w, "step": s["step"], "time": t + 0.001 * w, "samples": 32,
                      "compute_s": step_s, "comm_s": 0.0, "comm_total_s": None, "loss": 1.0,
                      "strategy": run.strategy}
            if s["lands"] is not None and t >= s["lands"]:
                record["comm_total_s"], s["lands"] = s["cost"], None
                landed[w].append(t)
            s["step"], s["since_sync"] = s["step"] + 1, s["since_sync"] + 1
            if s["since_sync"] >= 64 and s["lands"] is None:
                s["cost"] = 0.02 if t < fall else 3.0
                s["lands"], s["since_sync"] = t + s["cost"], 0
            records.append(record)
        run.table.add(records)
        if round(t / 0.1, 6) == int(round(t / 0.1, 6)):
            pilot.tick(run, t)
    slow = sorted(x for x in landed[0] if x > fall)
    assert run.switches and run.switches[0][0] == "easgd", run.switches
    landed_on_both = max(min(x for x in landed[w] if x > slow[0] + 1) for w in (0, 1)) if len(slow) >= 2 else None
    assert len(slow) >= 2 and slow[1] <= t <= landed_on_both + 0.1 + 0.01, (t, slow, landed_on_both)


def test_the_first_judgement_comes_once_every_worker_has_its_first_steps_past_warm_up():
    """Under allreduce every step is an exchange: the first move need not wait for the 2 s tick. Steps of
    10 ms compute and 10 ms all-reduce (1 step: average, period 16) after 8 warm-up steps of 100 ms
    compute (which, counted, would make the exchange 0.31 steps and the period 4). Ticked every step."""
    from workbench.run.autopilot import FIRST_STEPS, WARMUP_STEPS, AutoPilot

    run, pilot = _Run(), AutoPilot(workers=2)
    run.strategy, run.settings = "allreduce", {}
    published = []  # each event with whether the pilot's lock was held as it went out
    run.feed.publish = lambda event: published.append((event, pilot._lock.locked()))
    t, step = 0.0, 0
    pilot.tick(run, t)  # the run's start: nothing measured yet
    while t < 3 and not run.switches:
        compute = 0.1 if step < WARMUP_STEPS else 0.01
        t = round(t + compute + 0.01, 3)
        run.table.add([{"kind": "step", "worker": w, "step": step, "time": t + 0.001 * w, "samples": 32,
                        "compute_s": compute, "comm_s": 0.01, "wait_s": 0.0, "loss": 1.0, "strategy": run.strategy}
                       for w in (0, 1)])
        step += 1
        pilot.tick(run, t)
    assert run.switches == [("average", {"period": 16, "overlap": True})], run.switches
    assert step == WARMUP_STEPS + FIRST_STEPS and t < 1.5, (step, t)  # at the tick after the last of them, not at 2 s
    assert pilot.judged == 1
    # The decision goes out as an event the scheduler carries (keyed by worker, as every viewer reads it),
    # and not under the pilot's lock: a reader of `progress` may hold the feed's condition, which storing
    # the event takes (the two taken in opposite orders hung a lab test).
    from distributed.client import _is_dumpable

    from workbench.plane.metrics import wire_form

    ((decision, under_lock),) = published
    assert decision["kind"] == "auto-decision" and decision["to"] == "average" and not under_lock
    assert set(decision["measured"]["compute_s"]) == {0, 1} and not _is_dumpable(decision)  # as judged
    sent = wire_form(decision)
    assert _is_dumpable(sent) and sent["measured"]["compute_s"] == {"0": 0.01, "1": 0.01}


def test_pin_is_refused_on_a_run_not_started_with_auto_and_auto_takes_no_settings(tmp_path):
    import workbench
    from workbench.run.handle import Run

    job = workbench.Job(model=workbench.mlp(64, 10), data="digits")
    with pytest.raises(workbench.TrainingError, match="not started with strategy='auto'"):
        Run(job, "allreduce", client=None, workers=None, run_dir=tmp_path, name=None, collective_timeout_s=60,
            settings={}).pin()
    with pytest.raises(workbench.ConfigError, match=r"^period=4 .*no settings with strategy='auto'"):
        workbench.train(job, "auto", run_dir=tmp_path, period=4)


def test_a_move_is_confirmed_by_its_strategy_though_the_fitting_period_wavers():
    # Back from easgd on a link whose measured exchange cost wavers: period 32 in one window, 64 in the
    # next. The move to 'average' is confirmed by three windows all the same, with the last one's period.
    chooser = Chooser(workers=2, confirm=3, min_interval_s=0)
    chooser.observe(window("allreduce", 0.01, rates={0: 1000.0, 1: 400.0}), {"balance": True}, 0)
    assert chooser.observe(window("allreduce", 0.01, rates={0: 1000.0, 1: 400.0}), {"balance": True}, 1).strategy == "easgd"
    choices = [chooser.observe(window("easgd", exchange_s), {"period": 16}, t)
               for t, exchange_s in enumerate([0.2, 0.4, 0.2], start=2)]
    assert choices[:2] == [None, None]
    assert (choices[2].strategy, choices[2].settings) == ("average", {"period": 32, "overlap": True})


def test_a_window_where_no_exchange_landed_neither_confirms_nor_clears_a_candidate():
    # On a slow link an exchange may take longer than a window, and a window may hold too few steps to
    # judge (None): such windows leave the count as it was.
    chooser = past_its_first_choice(Chooser(workers=2, confirm=3, min_interval_s=0))
    slow, unknown = window("average", 7.0, rates=EVEN), window("average", None, rates=EVEN)
    settings = {"period": 64, "overlap": True, "wire_dtype": "bf16"}
    assert [chooser.observe(w, settings, t) for t, w in enumerate([slow, unknown, slow, None])] == [None] * 4
    chose = chooser.observe(slow, settings, 5)
    assert chose.strategy == "easgd" and chose.settings == {"period": 16} and chose.lr_factor == 1
    assert "more than period 64 hides even in bf16" in chose.reason


# Balanced allreduce on the lab, host 2 at half a core granted over 100 ms (MLP 784-1024-1024-10, one 8 s
# window): the cut (136/120) evened the compute, but the fast worker still waited for the slow one, whose
# CPU comes in bursts and whose part of the all-reduce runs at half speed: its median all-reduce took 37.0 ms,
# the slow worker's (the exchange itself) 10.9.
BALANCED_LAB = {"compute": {0: 0.0218, 1: 0.0321}, "rates": {0: 2599.0, 1: 2288.0}, "samples": {0: 136.0, 1: 120.0},
                "exchange": 0.0109, "waiting": 0.0370 - 0.0109}


def balanced_window(strategy="allreduce", compute=None, exchange=None, waiting=None, samples=None):
    return Window(strategy, compute or BALANCED_LAB["compute"], BALANCED_LAB["rates"],
                  BALANCED_LAB["exchange"] if exchange is None else exchange, samples or BALANCED_LAB["samples"],
                  BALANCED_LAB["waiting"] if waiting is None else waiting)


def test_workers_that_wait_for_a_slow_host_balance_then_leave_for_elastic_averaging():
    window_ = balanced_window()
    assert window_.speed_spread == pytest.approx(0.679, abs=1e-3)  # not a straggler by compute per step
    # 26.1 ms of waiting in a cycle of 27.0 ms computing (the median worker), 10.9 exchanging and the wait.
    assert window_.waiting_share() == pytest.approx(0.0261 / (0.02695 + 0.0109 + 0.0261))
    # Not balanced yet: balance first, as for a worker that computes slower.
    strategy, settings, reason = fitting(window_, {})
    assert (strategy, settings) == ("allreduce", {"balance": True})
    assert "the workers wait 41% of their steps for worker 1: allreduce, balanced" in reason
    # Balanced, and the steps still wait: elastic averaging.
    strategy, settings, reason = fitting(window_, {"balance": True})
    assert (strategy, settings) == ("easgd", {"period": 16})
    assert "the workers wait 41% of their steps for worker 1: easgd, period 16" in reason
    # The steps end together (unlimited, no slow host: 0.5 ms of waiting): nothing to change, balanced or not.
    even = balanced_window(compute={0: 0.0208, 1: 0.0211}, exchange=0.0086, waiting=0.0005,
                           samples={0: 128.0, 1: 128.0})
    assert even.waiting_share() < 0.05
    assert fitting(even, {"balance": True}) is None and fitting(even, {}) is None
    # Under averaging the exchange is one per period: the wait is judged against the period's compute.
    periodic = balanced_window("average", exchange=0.0109, waiting=0.0261 * 8)
    assert periodic.waiting_share(8) == pytest.approx(0.0261 * 8 / (8 * 0.02695 + 0.0109 + 0.0261 * 8))
    assert fitting(periodic, {"balance": True, "period": 8})[0] == "easgd"
    assert fitting(balanced_window("average"), {"balance": True, "period": 8}) is None  # 26 ms in 8 steps
    # Asynchronous windows, or windows without a waiting reading, say nothing of waiting.
    assert Window("allreduce", window_.compute_s, window_.samples_per_s, 0.0109).waiting_share() is None


def test_leaving_a_balanced_run_judges_the_recovery_by_the_slow_hosts_compute_per_sample():
    chooser = Chooser(workers=2, confirm=1, min_interval_s=0)
    chooser.observe(balanced_window(), {"balance": True}, now=0)
    # For the straggler, not the link (its compute per step read even): its recovery is judged by its own
    # compute against the fast worker's at an equal part of the batch (21.8 ms for 136 -> 20.5 for 128).
    assert not chooser.for_link and chooser.straggler == (1, pytest.approx(0.0218 / 136 * 128))
    # Under easgd (128 samples each) the slow host still computes 37.5 ms a step: it stays.
    slow = Window("easgd", {0: 0.0185, 1: 0.0375}, {0: 6797.0, 1: 3259.0}, 0.001, {0: 128.0, 1: 128.0})
    assert chooser.observe(slow, {"period": 16}, now=1) is None
    back = Window("easgd", {0: 0.019, 1: 0.0195}, {0: 6600.0, 1: 6500.0}, 0.001, {0: 128.0, 1: 128.0})
    chooser.observe(back, {"period": 16}, now=2)
    assert chooser.observe(back, {"period": 16}, now=3).strategy == "allreduce"


def test_a_window_counts_each_workers_samples_and_the_others_wait_for_the_last_by_medians():
    # Worker 1 arrives last (its all-reduce is the exchange itself, 10 ms); worker 0 waits 30 ms more,
    # except at one step where worker 1 was held up 500 ms (an evaluation): the medians leave it out.
    records = [{"worker": w, "time": t * 0.05, "samples": n, "compute_s": 0.02,
                "comm_s": (0.5 if t == 3 else 0.04) if w == 0 else 0.01}
               for t in range(7) for w, n in ((0, 136), (1, 120))]
    window_ = measure(records, "allreduce")
    assert window_.samples == {0: 136.0, 1: 120.0}
    assert window_.per_sample() == {0: pytest.approx(0.02 / 136), 1: pytest.approx(0.02 / 120)}
    assert window_.exchange_s == pytest.approx(0.01) and window_.waiting_s == pytest.approx(0.03)
    assert measure(records, "easgd").waiting_s is None  # nobody waits for anyone there


def test_under_overlapped_averaging_the_others_wait_only_what_blocks_their_sync():
    """Average p64 overlapped, balanced: worker 2's period takes 10% longer than the others' (264 ms against
    240). The others start each exchange about a period before it starts its own, so theirs are in flight
    250 ms longer; what blocks their sync is the difference of the periods, 24 ms: no straggler. Without
    overlap the sync blocks for all of it, and the same exchanges read as waiting."""
    def records(overlap):
        out = []
        for step in range(64 * 3):
            for worker, compute_s, in_flight, blocked in ((0, 0.00375, 0.266, 0.024), (1, 0.00375, 0.266, 0.024),
                                                          (2, 0.004125, 0.016, 0.0)):
                synced = (step + 1) % 64 == 0
                out.append({"worker": worker, "step": step, "time": 100 + 0.004 * step, "samples": 32,
                            "compute_s": compute_s, "comm_s": (blocked if overlap else in_flight) if synced else 0.0,
                            "comm_total_s": in_flight if synced else None})
        return out
    settings = {"period": 64, "overlap": True, "balance": True}
    overlapped = measure(records(overlap=True), "average")
    assert overlapped.exchange_s == pytest.approx(0.016) and overlapped.waiting_s == pytest.approx(0.024)
    assert overlapped.speed_spread > STRAGGLER_GONE_ABOVE and waiting_for_the_last(overlapped, settings) is None
    assert fitting(overlapped, settings) is None  # balanced, and it holds: stay
    # Read from the exchanges' whole time, the others waited 250 ms: 50% of a cycle, easgd.
    blocking = measure(records(overlap=False), "average")
    assert blocking.waiting_s == pytest.approx(0.25)
    assert waiting_for_the_last(blocking, settings) == pytest.approx(0.25 / (64 * 0.00375 + 0.016 + 0.25))
    assert fitting(blocking, settings)[0] == "easgd"


def test_a_worker_whose_records_come_late_is_judged_on_the_exchanges_the_others_made_too():
    """Average p32 on a link that just fell: the sync at step 31 took 70 ms, the one at 63 about 2 s. Workers
    0 and 2 had step 31 judged a window ago; worker 1's records of it came late, with step 63's. Read beside
    the others' step 63, its step 31 made it look the last arrival, and the others as waiting 1.1 s for it."""
    records = []
    for worker, late_s in ((0, 2.2), (1, 1.88), (2, 1.91)):
        for step in range(64):
            synced = step in (31, 63)
            exchange_s = (0.07 if step == 31 else late_s) if synced else None  # outlasting the period: all blocked
            records.append({"worker": worker, "step": step, "time": 100 + 0.0022 * step + (2 if step > 31 else 0),
                            "samples": 32, "compute_s": 0.0022, "comm_s": exchange_s or 0.0,
                            "comm_total_s": exchange_s})
    judged = {0: 100 + 0.0022 * 31, 2: 100 + 0.0022 * 31}  # worker 1's step 31: not judged yet
    window_ = measure(records, "average", since=judged)
    assert window_.exchange_s == pytest.approx(1.88) and window_.waiting_s == pytest.approx(2.055 - 1.88)
    assert fitting(window_, {"period": 32, "overlap": True})[0] == "easgd"  # the link, not a straggler
    # Records without steps: every new exchange counts, worker 1's median then mixes the two syncs.
    unnumbered = [{k: v for k, v in record.items() if k != "step"} for record in records]
    assert measure(unnumbered, "average", since=judged).exchange_s == pytest.approx((0.07 + 1.88) / 2)


def test_a_link_too_slow_for_averaging_is_answered_before_a_straggler_and_comes_back_with_the_link():
    """On the lab at 2 Mbit/s a window read 554 steps an exchange and a spread of 0.51 between two windows of
    486 and 421: taken for a straggler first, it began the count of a balanced cut in the middle of the
    link's. No cut of the batch hides such an exchange, and elastic averaging also answers a straggler."""
    settings = {"period": 16, "overlap": True}
    uneven = {0: 1000.0, 1: 510.0, 2: 1000.0}
    slow_link_and_uneven = window("average", 55.4, compute_s=0.1, rates=uneven)
    assert slow_link_and_uneven.speed_spread == pytest.approx(0.51)
    strategy, chosen, reason = fitting(slow_link_and_uneven, settings)
    assert (strategy, chosen) == ("easgd", {"period": 16}) and "more than period 64 hides even in bf16" in reason
    # The same spread on a link averaging hides: the balanced cut, as before.
    assert fitting(window("average", 0.2, rates=uneven), settings)[:2] == ("average", {"balance": True})
    # The uneven window counts toward the link's move (clear: two windows confirm it), and the move was made
    # for the link: the way back is the link's, whatever the speeds read meanwhile.
    chooser = past_its_first_choice(Chooser(workers=3, confirm=3, min_interval_s=0))
    assert chooser.observe(window("average", 48.6, rates=EVEN3), settings, 1) is None
    move = chooser.observe(slow_link_and_uneven, settings, 2)
    assert move.strategy == "easgd" and chooser.for_link and chooser.straggler is None
    back = [chooser.observe(window("easgd", 0.2, rates=uneven), {"period": 16}, t) for t in (3, 4, 5)]
    assert back[:2] == [None, None] and "the link is back" in back[2].reason


EVEN3 = {0: 1000.0, 1: 1000.0, 2: 1000.0}


def _synced_records(workers, steps, exchange_s=0.5, period=4):
    """Averaging every `period` steps: each worker's records of `steps`, the syncs carrying `exchange_s`."""
    return [{"worker": w, "step": s, "time": 100 + 0.01 * s, "samples": 32, "compute_s": 0.01, "comm_s": 0.0,
             "comm_total_s": exchange_s if (s + 1) % period == 0 else None} for w in workers for s in steps]


def test_a_synchronous_window_missing_a_workers_records_is_not_judged():
    # Every worker takes every step: one missing from the window has records still in transit.
    records = _synced_records((0, 1), range(8))
    assert measure(records, "average", workers=3) is None
    assert measure(records, "average", workers=2).exchange_s == 0.5
    assert measure(records, "average").exchange_s == 0.5  # the run's size not given: as many as came
    # Asynchronous workers step on their own: a window is judged on those that reported.
    assert measure(records, "easgd", workers=3).exchange_s == 0.5


def test_a_synchronous_window_with_no_exchange_common_to_every_worker_knows_no_exchange():
    # Worker 1's late records hold the sync at step 3 (fast, before the link fell), which the others had
    # judged already; theirs hold the one at step 7 (slow), whose record worker 1 has not sent yet.
    records = [r for r in _synced_records((0, 1, 2), range(8)) if (r["worker"] == 1) == (r["step"] < 5)]
    for r in records:
        if r["comm_total_s"] is not None:
            r["comm_total_s"] = 0.05 if r["step"] == 3 else 3.0
    window_ = measure(records, "average", since={0: 100.035, 2: 100.035})
    assert window_ is not None and window_.exchange_s is None and window_.waiting_s is None
    # Once worker 1's step 7 lands, the exchange is the slow one, and nobody waits for anyone.
    records += [r for r in _synced_records((1,), range(5, 8), exchange_s=3.0)]
    window_ = measure(records, "average", since={0: 100.035, 2: 100.035, 1: 100.035})
    assert window_.exchange_s == 3.0 and window_.waiting_s == 0.0


def test_a_judgement_without_a_workers_records_keeps_that_workers_mark_of_exchanges_judged():
    """Under easgd a window may lack a worker (it steps on its own); the exchanges it had judged before must
    not count again once its records are back in a window (each is evidence once)."""
    from workbench.run.autopilot import AutoPilot

    run, pilot = _Run(), AutoPilot(workers=3)
    run.strategy, run.settings, run.worker_addresses = "easgd", {"period": 4}, ["a", "b", "c"]
    pilot._since = {0: 99.0, 1: 99.0, 2: 100.5}
    records = [r for r in _synced_records((0, 1), range(8))]
    for r in records:
        r.update(kind="step", loss=1.0, strategy="easgd")
    run.table.add(records)
    pilot._judge(run, now=run.table.steps()["time"].max() + 0.1, first=None)
    assert pilot.last_window.exchange_s == 0.5
    assert pilot._since == {0: pytest.approx(100.07), 1: pytest.approx(100.07), 2: 100.5}


def test_a_synchronous_window_without_a_new_exchange_waits_for_one_before_it_is_judged():
    """Average every 64 steps: the next exchange is still on its way 2 s after the last judgement. The tick
    waits for it (a judgement then is the link's evidence, counted once) and judges on the steps alone only
    once 8 s have passed; under easgd a window is judged at its time, exchange or not."""
    from workbench.run.autopilot import WIDE_WINDOW_S, AutoPilot

    def steps(run, start, end, exchange_at=None):
        run.table.add([{"kind": "step", "worker": w, "step": round(t / 0.01), "time": t, "samples": 32,
                        "compute_s": 0.005, "comm_s": 0.0, "loss": 1.0, "strategy": run.strategy,
                        "comm_total_s": 0.1 if t == exchange_at else None}  # hidden by period 64: no move
                       for t in [round(start + 0.01 * i, 2) for i in range(round((end - start) / 0.01))] for w in (0, 1)])

    run, pilot = _Run(), AutoPilot(workers=2)
    steps(run, 0.0, 10.0, exchange_at=9.0)
    pilot.tick(run, 10.0)
    assert pilot.judged == 1 and pilot.last_window.exchange_s == 0.1
    steps(run, 10.0, 12.5)
    for now in (12.0, 12.25, 12.5):  # due, and no exchange new since: not judged yet
        pilot.tick(run, now)
    assert pilot.judged == 1
    steps(run, 12.5, 13.0, exchange_at=12.8)
    pilot.tick(run, 13.0)  # it landed: judged at once
    assert pilot.judged == 2 and pilot.last_window.exchange_s == 0.1
    steps(run, 13.0, 13.0 + WIDE_WINDOW_S + 0.5)
    pilot.tick(run, 13.0 + WIDE_WINDOW_S - 0.1)
    assert pilot.judged == 2
    pilot.tick(run, 13.0 + WIDE_WINDOW_S + 0.1)  # none for 8 s: judged on the steps
    assert pilot.judged == 3 and pilot.last_window.exchange_s is None
    run, pilot = _Run(), AutoPilot(workers=2)
    run.strategy, run.settings = "easgd", {"period": 16}
    steps(run, 0.0, 10.0, exchange_at=9.0)
    pilot.tick(run, 10.0)
    steps(run, 10.0, 12.5)
    pilot.tick(run, 12.0)
    assert pilot.judged == 2 and pilot.last_window.exchange_s is None


# Balanced `allreduce` on the lab (network benchmark's MLP 784-1024-1024-10, batch 128 a worker, host 2 at half a
# core over 100 ms): the steps even (about 30 ms of compute each), host 2 at 47% of host 1's speed per sample,
# 12.5 ms of exposed exchange (0.41 steps: the link's own rule keeps allreduce) and 1 ms of waiting a step, 42%
# of the cycle not computing by the step records.
PACED = {"compute": {0: 0.0305, 1: 0.0305}, "rates": {0: 3094.0, 1: 1768.0}, "samples": {0: 174.0, 1: 82.0},
         "exchange": 0.0125, "waiting": 0.001, "idle": 0.42}


def paced_window(idle=PACED["idle"], samples=None, compute=None, exchange=None, strategy="allreduce"):
    return Window(strategy, compute or PACED["compute"], PACED["rates"], PACED["exchange"] if exchange is None else exchange,
                  samples or PACED["samples"], PACED["waiting"], idle)


def test_a_balanced_run_still_paced_by_a_straggler_leaves_for_elastic_averaging():
    window_ = paced_window()
    # Not a straggler by compute per step, nor by waiting: the cut evened the steps.
    assert window_.speed_spread == 1.0 and window_.waiting_share() < WAIT_ABOVE
    assert window_.per_sample_spread() == pytest.approx(82 / 174)
    strategy, settings, reason = fitting(window_, {"balance": True})
    assert (strategy, settings) == ("easgd", {"period": 16})
    assert ("worker 1 computes at 47% of the others' speed per sample, and the balanced steps spend 42% of their "
            "time exchanging and waiting: easgd, period 16") in reason
    # Under a third of the cycle not computing: the balanced cut stays (the GPT of the fidelity benchmark on
    # the same hosts: 0.26 s of compute, 10 ms exchanging and 3 ms waiting a step, 6%).
    gpt = paced_window(idle=0.06, compute={0: 0.260, 1: 0.261}, samples={0: 44.0, 1: 20.0}, exchange=0.010)
    assert gpt.per_sample_spread() < STRAGGLER_BELOW and fitting(gpt, {"balance": True}) is None
    assert fitting(paced_window(idle=PACED_ABOVE - 0.01), {"balance": True}) is None
    # Even hosts that spend as much exchanging: the link's matter (allreduce under half a step stays), not a
    # straggler's; and not balanced: this rule does not apply (the cut comes first, `straggling`).
    even = paced_window(samples={0: 128.0, 1: 128.0})
    assert even.per_sample_spread() == 1.0 and fitting(even, {"balance": True}) is None
    assert fitting(window_, {"balance": False}) is None
    # Under balanced averaging the same: its cycle is its period's steps and the sync.
    assert fitting(paced_window(strategy="average"), {"period": 16, "balance": True})[0] == "easgd"


def test_a_window_measures_the_workers_share_of_their_cycle_not_computing():
    # Worker 0: 20 ms computing, 10 exchanging, 0 waiting (1/3); worker 1: 20, 25 and 5 (3/5); the median.
    records = [{"worker": w, "step": t, "time": t * 0.05, "samples": 32, "compute_s": 0.02,
                "comm_s": 0.01 if w == 0 else 0.025, "wait_s": 0.0 if w == 0 else 0.005}
               for t in range(5) for w in (0, 1)]
    assert measure(records, "allreduce").idle_share == pytest.approx((1 / 3 + 3 / 5) / 2)
    for record in records:
        del record["wait_s"]  # records without it (older workers): exchanging only
    assert measure(records, "allreduce").idle_share == pytest.approx((1 / 3 + 0.025 / 0.045) / 2)


def test_the_idle_share_is_judged_by_the_mean_of_the_recent_windows():
    """Window by window the share moves by a tenth with the slow host's bursts (lab, network benchmark: the
    exposed exchange 0.26-0.62 steps); judged one at a time, a window under the threshold began the count again."""
    chooser = past_its_first_choice(Chooser(workers=2))
    balanced = {"balance": True}
    readings = [0.38, 0.31, 0.37, 0.32, 0.36]
    chosen = [chooser.observe(paced_window(idle=idle), balanced, 100 + i) for i, idle in enumerate(readings)]
    # Means 0.38, 0.345, 0.353: three in a row over a third.
    assert chosen[:2] == [None, None] and chosen[2].strategy == "easgd", chosen
    chooser = past_its_first_choice(Chooser(workers=2))
    assert all(chooser.observe(paced_window(idle=idle), balanced, 100 + i) is None
               for i, idle in enumerate([0.30, 0.36, 0.28, 0.31, 0.33, 0.30]))
