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



def test_a_socket_the_group_opens_on_a_descriptor_another_connection_freed_is_the_groups():
    """Descriptors are reused at once: a Dask connection that closed while the group formed leaves its
    number to one of gloo's. Judged by number alone, that socket was never the group's, and a survivor
    blocked on it could not be freed (seen once on the lab: a 60 s wait after rank 0's worker was killed)."""
    dask = (("10.0.0.2", 40000), ("10.0.0.1", 8786))
    before = {23: dask, 24: (("10.0.0.2", 40001), ("10.0.0.1", 36000))}
    gloo = (("10.0.0.2", 51000), ("10.0.0.1", 52000))
    now = {23: gloo, 24: before[24], 25: (("10.0.0.2", 51001), ("10.0.0.1", 52001))}
    assert collectives.opened_since(before, now) == {23: gloo, 25: now[25]}
