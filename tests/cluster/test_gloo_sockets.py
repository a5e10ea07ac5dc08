"""Sums across hosts over several connections per peer (`comm/connections.py`) in real processes, each in
a real gloo group formed by `collectives.init_process_group` with shared memory switched off, as ranks on
different hosts are: the figure both ranks agree on, slow sums cut in pieces from the use after that
agreement and equal to gloo's own sum in one call, fast sums left whole, the connections the group
opened, the completion callback, and the variable a user may set.
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers import spawn_ranks, sum_through_channel
from workbench.comm import collectives, connections, shared_memory, sum_way

TIMEOUT_S = 120
USES = 4
SIZES = {0: 786_433, 1: 1_000, 2: 70_000}  # channel -> elements: 3 MB (may be cut), 4 kB and 280 kB (whole)


def _rank(rank, world_size, port, sockets, slow_sum_s, results):
    os.environ[shared_memory.SWITCH_VARIABLE] = "0"  # every sum through gloo, as between two hosts
    if sockets is not None:
        os.environ[connections.SOCKETS_VARIABLE] = sockets
    connections.SLOW_SUM_S = slow_sum_s  # loopback is never slow: 0 makes every agreed sum one to cut
    sum_way.CODE_BELOW_BYTES_PER_S = 0.0  # and never thin: coded sums are tests/cluster/test_coded_sums.py's
    torch.set_num_threads(1)
    try:
        collectives.init_process_group("127.0.0.1", port, rank, world_size, torch.device("cpu"), 60,
                                       own_host="127.0.0.1")
        cutter = collectives._cutter
        outcome = {"sockets": cutter.sockets if cutter else 1, "group_sockets": len(collectives._group_sockets),
                   "interface_after": os.environ.get("GLOO_SOCKET_IFNAME"), "mismatches": [],
                   "kinds": {channel: [] for channel in SIZES}}
        generator = torch.Generator().manual_seed(2000 + rank)
        for use in range(USES):
            for channel, size in SIZES.items():
                vector = torch.randn(size, generator=generator)
                work, reference, called = sum_through_channel(vector, channel)
                outcome["kinds"][channel].append(type(work).__name__)
                if not torch.equal(vector, reference):
                    outcome["mismatches"].append((use, channel, (vector - reference).abs().max().item()))
                if not called:
                    outcome["mismatches"].append((use, channel, "the completion callback never ran"))
        outcome["agreed_s"] = {c: s.way.link_s for c, s in cutter.channels.items()} if cutter else None
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
    # Both ranks agree on each channel's figure (each cuts a sum as the other does, or the group would hang).
    for outcomes in (spread, fast):
        assert outcomes[0]["agreed_s"] == outcomes[1]["agreed_s"]
        assert sorted(outcomes[0]["agreed_s"]) == [0, 1, 2] and all(s > 0 for s in outcomes[0]["agreed_s"].values())
    whole = ["Work"] * USES
    for outcome in spread:
        assert outcome["sockets"] == connections.DEFAULT_SOCKETS == 4
        # Agreed at the second use, read at the third: the 3 MB sum in pieces from then on.
        assert outcome["kinds"] == {0: ["Work", "Work", "PiecesWork", "PiecesWork"], 1: whole, 2: whole}
        assert outcome["mismatches"] == []
        assert outcome["interface_after"] is None  # the worker outlives the run: nothing left set
    for outcome in fast:  # no sum the link makes slow: every one whole, over the four connections
        assert outcome["sockets"] == 4 and outcome["kinds"] == {0: whole, 1: whole, 2: whole}
        assert outcome["mismatches"] == []
    for outcome in single:
        assert outcome["sockets"] == 1 and sorted(outcome["agreed_s"]) == [0, 1, 2]
        assert outcome["kinds"] == {0: whole, 1: whole, 2: whole} and outcome["mismatches"] == []
    # Each rank holds one end of each connection to its peer: three more with four than with one.
    for rank in range(2):
        assert spread[rank]["group_sockets"] - single[rank]["group_sockets"] == 3


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_bad_count_of_connections_fails_the_group_naming_the_variable():
    found = spawn_ranks(_rank, 2, 2, collectives.find_free_port("127.0.0.1"), "0", 0.0)
    for rank in range(2):
        assert "WORKBENCH_GLOO_SOCKETS='0' is not allowed: expected an integer from 1 to 16" in found[rank]["error"]
