"""Sums across hosts over several connections per peer (`collectives.spread_over_sockets`,
`start_all_reduce`'s pieces) in real processes, each in a real gloo group formed by
`collectives.init_process_group` with shared memory switched off, as ranks on different hosts are: the
link's rate both ranks agree on, the pieces' sum against gloo's own in one call, fast sums left whole,
the connections the group opened, the completion callback, and the variable a user may set.
"""
from __future__ import annotations

import os
import threading

import pytest
import torch

from helpers import spawn_ranks
from workbench.comm import collectives, shared_memory

TIMEOUT_S = 120


def _rank(rank, world_size, port, sockets, slow_sum_s, results):
    os.environ[shared_memory.SWITCH_VARIABLE] = "0"  # every sum through gloo, as between two hosts
    if sockets is not None:
        os.environ[collectives.SOCKETS_VARIABLE] = sockets
    collectives.SLOW_SUM_S = slow_sum_s  # loopback is never slow: 0 makes every sum one to cut
    torch.set_num_threads(1)
    try:
        collectives.init_process_group("127.0.0.1", port, rank, world_size, torch.device("cpu"), 60,
                                       own_host="127.0.0.1")
        outcome = {"sockets": collectives._sockets, "group_sockets": len(collectives._group_sockets),
                   "rate": collectives._link_bytes_per_s,
                   "interface_after": os.environ.get("GLOO_SOCKET_IFNAME"), "mismatches": [], "kinds": set()}
        generator = torch.Generator().manual_seed(2000 + rank)
        for size in (786_433, 1_000, 70_000):  # 3 MB (cut in pieces), 4 kB and 280 kB (whole)
            vector = torch.randn(size, generator=generator)
            reference = vector.clone()
            done = threading.Event()
            work = collectives.start_all_reduce(vector)
            collectives.when_done(work, lambda _future: done.set())
            outcome["kinds"].add(type(work).__name__)
            collectives.wait(work)
            torch.distributed.all_reduce(reference)  # gloo's own sum, in one call on one connection
            if not torch.equal(vector, reference):
                outcome["mismatches"].append((size, (vector - reference).abs().max().item()))
            if not done.wait(timeout=30):
                outcome["mismatches"].append((size, "the completion callback never ran"))
        outcome["kinds"] = sorted(outcome["kinds"])
        collectives.destroy_process_group()
        results.put((rank, outcome))
    except BaseException as error:
        results.put((rank, {"error": repr(error)}))


def _run(sockets, slow_sum_s=0.0):
    found = spawn_ranks(_rank, 2, 2, collectives.find_free_port("127.0.0.1"), sockets, slow_sum_s)
    for rank, outcome in found.items():
        assert "error" not in outcome, f"rank {rank}: {outcome['error']}"
    return [found[rank] for rank in range(2)]


@pytest.mark.timeout(3 * TIMEOUT_S + 60)
def test_a_slow_sum_travels_in_pieces_over_four_connections_and_equals_gloos_own():
    spread, fast, single = _run(None), _run(None, slow_sum_s=1e9), _run("1")
    # Both ranks agree on the link's rate (each cuts a sum as the other does, or the group would hang).
    for outcomes in (spread, fast):
        assert outcomes[0]["rate"] == outcomes[1]["rate"] > 0
    for outcome in spread:
        assert outcome["sockets"] == collectives.DEFAULT_SOCKETS == 4
        assert outcome["kinds"] == ["PiecesWork", "Work"]  # the 3 MB sum in pieces, the small ones whole
        assert outcome["mismatches"] == []
        assert outcome["interface_after"] is None  # the worker outlives the run: nothing left set
    for outcome in fast:  # no sum the link makes slow: every one whole, over the four connections
        assert outcome["sockets"] == 4 and outcome["kinds"] == ["Work"] and outcome["mismatches"] == []
    for outcome in single:
        assert outcome["sockets"] == 1 and outcome["rate"] is None
        assert outcome["kinds"] == ["Work"] and outcome["mismatches"] == []
    # Each rank holds one end of each connection to its peer: three more with four than with one.
    for rank in range(2):
        assert spread[rank]["group_sockets"] - single[rank]["group_sockets"] == 3


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_bad_count_of_connections_fails_the_group_naming_the_variable():
    found = spawn_ranks(_rank, 2, 2, collectives.find_free_port("127.0.0.1"), "0", 0.0)
    for rank in range(2):
        assert "WORKBENCH_GLOO_SOCKETS='0' is not allowed: expected an integer from 1 to 16" in found[rank]["error"]
