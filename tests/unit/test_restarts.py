"""The lost-worker timers of a cluster the workbench starts (cluster/restarts.py): a removal's timer closes
a nanny only if nothing was heard of that worker's name since; a worker killed again while its nanny
restarts it keeps its nanny."""
from __future__ import annotations

from workbench.cluster.restarts import LostWorkerTimers


def test_a_removal_timer_is_stale_once_the_name_was_heard_of_again():
    timers = LostWorkerTimers()
    first = timers.heard(2)  # worker "2" removed (killed)
    assert timers.still_lost(2, first)
    timers.heard(2)  # its nanny's restart registered
    second = timers.heard(2)  # killed again, 15 s after the first: the first timer fires now
    assert not timers.still_lost(2, first)  # Dask's own timer would close the restarting nanny here
    assert timers.still_lost(2, second) and timers.still_lost(0, timers.heard(0))
    timers.heard(2)  # back again before the second timer
    assert not timers.still_lost(2, second)
