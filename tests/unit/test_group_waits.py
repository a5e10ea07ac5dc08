"""Which of a rank's calls on its process group count as waiting on it: only while one does may the
poller's thread break the group's connections to free a survivor blocked on a lost peer (breaking them
while the group is idle killed the worker process, measured). A wait that does not count waits out the
whole collective timeout after a loss (a killed-worker run under `allreduce`, whose buckets are waited on
with `wait`, failed its regroup so in a full run of 2026-11-28)."""
from workbench.comm import collectives


class _Work:
    """What a collective started in the background returns: its wait records what the rank counted."""

    def __init__(self):
        self.counted = []

    def wait(self):
        self.counted.append(collectives._waiting)


def test_waiting_for_a_collective_started_in_the_background_counts_as_waiting_on_the_group():
    work = _Work()
    collectives.wait(work)
    assert work.counted == [1] and collectives._waiting == 0

