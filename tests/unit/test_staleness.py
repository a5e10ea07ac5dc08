"""Unit tests of the parameter server's bookkeeping: versions, staleness and the SSP bound (no cluster)."""
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.sharding import split_ranges
from workbench.server.book import ServerBook, ssp_allows


def test_scripted_interleaving_gives_exact_staleness_and_versions():
    book = ServerBook(workers=[0, 1])
    assert book.fetch(0) == 0 and book.fetch(1) == 0
    first = book.push(0, clock=1)
    assert (first.version, first.staleness) == (1, 0)
    second = book.push(1, clock=1)  # worker 1 did not see worker 0's update
    assert (second.version, second.staleness) == (2, 1)
    assert book.fetch(0) == 2
    third = book.push(1, clock=2)  # worker 1 still on version 0: two updates since
    assert (third.version, third.staleness) == (3, 2)
    fourth = book.push(0, clock=2)  # worker 0 fetched version 2; one update (worker 1's) since
    assert (fourth.version, fourth.staleness) == (4, 1)
    assert book.staleness_counts == {0: {0: 1, 1: 1}, 1: {1: 1, 2: 1}}


def test_exchange_is_a_push_then_a_fetch():
    book = ServerBook(workers=[0, 1])
    assert book.exchange(0, clock=1).staleness == 0
    assert book.exchange(1, clock=1).staleness == 1
    assert book.exchange(0, clock=2).staleness == 1  # only worker 1's exchange since its own


def test_clock_gap_and_slowest_clock_in_receipts():
    book = ServerBook(workers=[0, 1])
    book.push(0, clock=1)
    receipt = book.push(0, clock=2)
    assert (receipt.clock_gap, receipt.slowest_clock) == (2, 0)
    receipt = book.push(1, clock=1)
    assert (receipt.clock_gap, receipt.slowest_clock) == (0, 1)


def test_finished_worker_no_longer_holds_others_back():
    book = ServerBook(workers=[0, 1])
    book.push(0, clock=3)
    assert not book.may_proceed(0, 3, max_staleness=2)
    book.finish(1)
    assert book.may_proceed(0, 3, max_staleness=2)
    assert book.all_finished([1]) and not book.all_finished([0, 1])


def test_ssp_allows():
    assert ssp_allows(2, [0, 2], 2) and not ssp_allows(3, [0, 3], 2)
    assert ssp_allows(0, [0, 0], 0) and not ssp_allows(1, [0, 1], 0)
    assert ssp_allows(5, [], 0)  # alone


@given(schedule=st.lists(st.integers(0, 3), min_size=1, max_size=200), workers=st.integers(1, 4),
       bound=st.integers(0, 3))
@settings(max_examples=300, deadline=None)
def test_ssp_bound_holds_for_every_interleaving(schedule, workers, bound):
    """Workers try to finish windows in the generated order; one that may not proceed waits (skips)."""
    book = ServerBook(workers=range(workers))
    clocks = {w: 0 for w in range(workers)}
    for choice in schedule:
        worker = choice % workers
        # A worker at clock c starts window c+1 only when the server allows it...
        if not book.may_proceed(worker, clocks[worker], bound):
            continue
        # ...and may never be more than `bound` ahead of the slowest when it does.
        assert clocks[worker] - min(clocks.values()) <= bound
        clocks[worker] += 1
        book.push(worker, clock=clocks[worker])
        # Completed clocks never spread more than bound + 1 apart.
        assert max(clocks.values()) - min(clocks.values()) <= bound + 1
    # No deadlock: the slowest worker may always proceed.
    slowest = min(clocks, key=clocks.get)
    assert book.may_proceed(slowest, clocks[slowest], bound)


@given(n=st.integers(1, 1000), parts=st.integers(1, 16))
def test_split_ranges_cover_contiguously(n, parts):
    if parts > n:
        return
    ranges = split_ranges(n, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == n and len(ranges) == parts
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1
