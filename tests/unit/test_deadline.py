"""The run's timeout from its measured waits (plane/deadline.py): floor, ceiling, headroom, when it rises
and falls, what is measured and what is not."""
import pytest

from workbench.plane import deadline
from workbench.plane.deadline import CEILING_S, FLOOR_S, HEADROOM, MIN_STEPS, UNMEASURED_S, WINDOW, WaitBook

pytestmark = pytest.mark.unit


def step(compute_s=0.03, comm_s=0.01, strategy="allreduce", **fields):
    """A step record; with an exchange of its own (as allreduce's every step) unless `exchange_s=None`."""
    return {"compute_s": compute_s, "comm_s": comm_s, "wait_s": 0.0, "strategy": strategy, "exchange_s": 0.02,
            **fields}


def book_of(records):
    book = WaitBook()
    for record in records:
        book.add(record)
    return book


def test_the_timeout_is_ten_times_the_longest_wait_within_its_floor_and_ceiling():
    assert deadline.timeout_for(0.04) == FLOOR_S == 15.0  # a fast run: the floor, not a minute
    assert deadline.timeout_for(2.5) == 25.0 == HEADROOM * 2.5
    assert deadline.timeout_for(600.0) == CEILING_S


def test_nothing_is_proposed_before_enough_steps_of_the_running_strategy():
    book = book_of([step()] * (MIN_STEPS - 1))
    assert book.longest_wait_s() is None and book.propose(UNMEASURED_S, "allreduce") is None
    book.add(step())
    assert book.propose(UNMEASURED_S, "allreduce") == FLOOR_S
    assert book.propose(UNMEASURED_S, "async") is None  # a switch to async asked for: not measured yet


def test_a_fast_run_lowers_the_unmeasured_minute_to_the_floor_and_then_keeps_it():
    book = book_of([step()] * 20)
    assert book.propose(UNMEASURED_S, "allreduce") == FLOOR_S
    assert book.propose(FLOOR_S, "allreduce") is None


def test_a_longer_step_raises_the_timeout_at_once_and_a_shorter_one_lowers_it_only_below_half():
    book = book_of([step()] * 20 + [step(compute_s=1.0, comm_s=2.0)])
    assert book.propose(FLOOR_S, "allreduce") == 30.0  # raised at once
    # The slow step leaves the window: the timeout the fast steps call for (15 s) is half of 30 s, not below.
    for _ in range(WINDOW):
        book.add(step())
    assert book.propose(30.0, "allreduce") is None
    assert book.propose(31.0, "allreduce") == FLOOR_S  # below half: lowered


def test_an_exchange_of_minutes_is_kept_whatever_the_steps_between_exchanges():
    # average with a long period on a thin link: one exchange of 3 minutes, then many short steps.
    book = book_of([step(strategy="average", exchange_s=180.0)] + [step(strategy="average")] * (3 * WINDOW))
    assert book.longest_wait_s() == 180.0
    assert book.propose(UNMEASURED_S, "average") == CEILING_S  # not declared lost after a minute


def test_a_parameter_servers_round_trip_counts_as_an_exchange():
    book = book_of([step(strategy="async", exchange_s=None, comm_total_s=4.0)] * MIN_STEPS)
    assert book.propose(UNMEASURED_S, "async") is None  # 40 s: within half of a minute and under it
    assert book.propose(FLOOR_S, "async") == 40.0


def test_nothing_is_lowered_before_the_strategys_first_exchange_was_measured():
    # average with period 64 on a thin link: 63 steps of compute alone say nothing of the exchange.
    book = book_of([step(strategy="average", comm_s=0.0, exchange_s=None)] * 63)
    assert book.longest_wait_s() is None and book.propose(UNMEASURED_S, "average") is None
    book.add(step(strategy="average", exchange_s=95.0))  # the first sync: an exchange of a minute and a half
    assert book.propose(UNMEASURED_S, "average") == 950.0


def test_a_pause_at_the_control_point_is_not_a_wait_on_a_peer():
    book = book_of([step(wait_s=300.0)] * MIN_STEPS)
    assert book.longest_wait_s() == pytest.approx(0.04)


def test_another_strategy_or_a_regroup_measures_again():
    book = book_of([step(compute_s=5.0)] * MIN_STEPS)
    book.add(step(strategy="async"))
    assert book.strategy == "async" and book.longest_wait_s() is None
    book = book_of([step(compute_s=5.0)] * MIN_STEPS)
    book.restart(book.strategy)
    assert book.longest_wait_s() is None and book.strategy == "allreduce"


def test_a_run_that_evaluates_keeps_the_unmeasured_timeout_until_an_evaluation_was_timed():
    book = book_of([step()] * 20)
    assert book.propose(UNMEASURED_S, "allreduce", evaluates=True) is None
    book.add_evaluation({"kind": "eval", "eval_s": 2.0, "loss": 0.5})
    assert book.longest_wait_s() == 2.0  # the others wait that long for rank 0 at their next collective
    assert book.propose(UNMEASURED_S, "allreduce", evaluates=True) == 20.0
    book.add(step(strategy="async"))  # a switch: the steps are measured again, the evaluation is not
    assert book.measured == 1 and book.longest_evaluation_s == 2.0


@pytest.mark.parametrize("event, words", [
    ({"timeout_s": 15.0, "how": "measured", "longest_wait_s": 0.04, "strategy": "allreduce"},
     ["15 s", "10 times", "allreduce", "0.04 s"]),
    ({"timeout_s": 60.0, "how": "unmeasured", "longest_wait_s": None, "strategy": "async"}, ["60 s", "until", "async"]),
    ({"timeout_s": 10.0, "how": "set", "longest_wait_s": None, "strategy": "average"}, ["10 s", "as set"]),
])
def test_the_timeout_in_force_is_said_in_one_line(event, words):
    text = deadline.describe(event)
    assert "\n" not in text and all(word in text for word in words), text


def test_a_runs_config_says_how_its_timeout_is_decided():
    assert deadline.policy(10.0) == {"how": "set", "timeout_s": 10.0}
    measured = deadline.policy(None)
    assert measured["how"] == "measured" and (measured["floor_s"], measured["ceiling_s"]) == (FLOOR_S, CEILING_S)


@pytest.mark.parametrize("in_force,longest,silent,expected", [
    (60.0, None, 60.0, 60.0),  # nothing measured: the whole timeout, as before
    (15.0, 0.01, 15.5, 5.0),  # silent a whole timeout, steps of milliseconds: the floor
    (60.0, 4.0, 61.0, 12.0),  # three of the longest waits
    (30.0, 20.0, 31.0, 30.0),  # never more than the timeout in force
    (15.0, 0.01, 0.6, 15.0),  # it stepped until the fault (a survivor blocked on a lost peer): the whole timeout
])
def test_a_worker_told_to_leave_gets_a_few_of_its_longest_waits_only_if_silent_a_whole_timeout(in_force, longest,
                                                                                            silent, expected):
    assert deadline.leave_within(in_force, longest, silent) == pytest.approx(expected)
