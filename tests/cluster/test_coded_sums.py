"""Coded sums (`comm/coded_sum.py`) in real processes, each in a real gloo group formed by
`collectives.init_process_group` with shared memory switched off, as ranks on different hosts are, and the
link taken as thin (loopback never is): from the use after the group's agreement every large float32 sum
goes coded (then the faster way by the agreed figures, alike on every rank), and it is exact: with two
ranks the very floats of gloo's own sum, with three the rank-order sum of every rank's vector, bit for bit
on every rank; fewer bytes sent than a ring of raw floats; small
sums and other dtypes left to gloo; a peer that dies mid-sum makes the survivor's wait fail, not hang.
"""
from __future__ import annotations

import os
import time

import pytest
import torch

from helpers import spawn_ranks, sum_through_channel
from workbench.comm.averaging import all_reduce_bytes_sent
from workbench.comm import collectives, shared_memory, sum_way

TIMEOUT_S = 120
USES = 12  # agreements read at every second use from the third on (no try of the other way yet), one in flight at the end
# channel -> (elements, dtype): 3 MB and 1.2 MB of floats (coded once agreed), 16 kB (too small), doubles.
SIZES = {0: (786_433, torch.float32), 1: (300_001, torch.float32), 2: (4_000, torch.float32),
         3: (200_000, torch.float64)}


def _vector(rank, use, channel):
    """Rank `rank`'s vector at `use` on `channel`: gradient-like floats, with the values that test a coder."""
    size, dtype = SIZES[channel]
    generator = torch.Generator().manual_seed(1000 * use + 10 * channel + rank)
    vector = (torch.randn(size, generator=generator) * 10.0 ** (-rank - channel)).to(dtype)
    vector[:4] = torch.tensor([-0.0, 1e-40, 1.0e37, -1.0e37], dtype=dtype)  # signed zero, subnormal, large
    return vector


def _rank(rank, world_size, port, results):
    os.environ[shared_memory.SWITCH_VARIABLE] = "0"  # every sum through gloo, as between two hosts
    sum_way.CODE_BELOW_BYTES_PER_S = float("inf")  # every link thin: coded sums tried, kept while faster
    torch.set_num_threads(1)
    try:
        collectives.init_process_group("127.0.0.1", port, rank, world_size, torch.device("cpu"), 60,
                                       own_host="127.0.0.1")
        cutter = collectives._cutter
        outcome = {"kinds": {channel: [] for channel in SIZES}, "mismatches": [], "sums": {}, "sent": {}}
        for use in range(USES):
            for channel in SIZES:
                vector = _vector(rank, use, channel)
                work, reference, called = sum_through_channel(vector, channel)
                outcome["kinds"][channel].append(type(work).__name__)
                if type(work).__name__ == "CodedWork":
                    outcome["sent"][(use, channel)] = work.bytes_sent
                expected = _vector(0, use, channel)
                for other in range(1, world_size):  # the rank-order sum, float by float
                    expected = expected + _vector(other, use, channel)
                # Coded with three ranks: the owner's rank-order sum (gloo's ring adds in another order).
                exact = expected if world_size > 2 and type(work).__name__ == "CodedWork" else reference
                if not torch.equal(vector.view(torch.uint8), exact.view(torch.uint8)):
                    outcome["mismatches"].append((use, channel, (vector - exact).abs().max().item()))
                if not torch.allclose(vector[4:], reference[4:], rtol=1e-5, atol=1e-6):  # the floats' rounding apart
                    outcome["mismatches"].append((use, channel, "far from gloo's sum"))
                if not called:
                    outcome["mismatches"].append((use, channel, "the completion callback never ran"))
                outcome["sums"][(use, channel)] = vector.view(torch.uint8).sum().item()
        outcome["link_s"] = {c: s.way.link_s for c, s in cutter.channels.items()}
        outcome["typical"] = {c: s.way.typical for c, s in cutter.channels.items()}
        outcome["favoured"] = {c: s.way.favoured() for c, s in cutter.channels.items()}
        # Channel 0 then carries doubles (a live switch to other buckets): its figures start anew, not coded.
        outcome["after_switch"] = []
        for use in range(3):
            vector = _vector(rank, use, 3)
            work, reference, _ = sum_through_channel(vector, 0)
            outcome["after_switch"].append(type(work).__name__)
            if not torch.equal(vector, reference):
                outcome["mismatches"].append((use, "after the switch"))
        outcome["after_switch"].append((cutter.channels[0].uses, cutter.channels[0].way.codable))
        collectives.destroy_process_group()
        results.put((rank, outcome))
    except BaseException as error:
        results.put((rank, {"error": repr(error)}))


@pytest.mark.timeout(2 * TIMEOUT_S + 60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_agreed_thin_sums_go_coded_and_are_exact_on_every_rank(world_size):
    found = spawn_ranks(_rank, world_size, world_size, collectives.find_free_port("127.0.0.1"), timeout_s=TIMEOUT_S)
    for rank, outcome in found.items():
        assert "error" not in outcome, f"rank {rank}: {outcome['error']}"
    outcomes = [found[rank] for rank in range(world_size)]
    whole = ["Work"] * USES
    for outcome in outcomes:
        # Agreed at the second use, read at the third: the large float32 sums coded, untimed, for that
        # agreement's two uses; from then on the way with the shorter median sum, agreement by agreement.
        for channel in (0, 1):
            kinds = outcome["kinds"][channel]
            assert kinds[:4] == ["Work", "Work", "CodedWork", "CodedWork"]
            assert all(kinds[use] == kinds[use + 1] for use in range(2, USES - 1, 2))
            assert (kinds[-1] == "CodedWork") == outcome["favoured"][channel]
            assert all(figure is not None for figure in outcome["typical"][channel].values())
        assert outcome["kinds"][2] == whole and outcome["kinds"][3] == whole
        assert outcome["after_switch"] == ["Work"] * 3 + [(3, False)]
        assert outcome["typical"][2][True] is None and outcome["typical"][3][True] is None
        assert outcome["mismatches"] == []
        # Every rank chose alike, from the same figures.
        assert (outcome["link_s"], outcome["typical"]) == (outcomes[0]["link_s"], outcomes[0]["typical"])
        assert outcome["kinds"] == outcomes[0]["kinds"]
        for (use, channel), sent in outcome["sent"].items():
            raw = all_reduce_bytes_sent(SIZES[channel][0] * 4, world_size)
            assert 0.5 * raw < sent < 0.95 * raw, (use, channel, sent, raw)  # the top plane compressed
    assert all(outcome["sums"] == outcomes[0]["sums"] for outcome in outcomes)  # the same bytes everywhere


def _dying_rank(rank, world_size, port, results):
    os.environ[shared_memory.SWITCH_VARIABLE] = "0"
    sum_way.CODE_BELOW_BYTES_PER_S = float("inf")
    torch.set_num_threads(1)
    try:
        collectives.init_process_group("127.0.0.1", port, rank, world_size, torch.device("cpu"), 20,
                                       own_host="127.0.0.1")
        vector = torch.ones(786_433)
        for _ in range(3):  # agreed after these: the next sum is coded
            collectives.wait(collectives.start_all_reduce(vector, channel=0))
        if rank == 1:
            os._exit(0)  # gone before its part of the coded sum: rank 0 waits on a dead peer
        started = time.monotonic()
        work = collectives.start_all_reduce(vector, channel=0)
        kind = type(work).__name__
        try:
            collectives.wait(work)
            results.put((rank, {"error": "the sum with a dead peer completed"}))
        except Exception as error:
            results.put((rank, {"kind": kind, "raised": type(error).__name__, "after_s": time.monotonic() - started}))
    except BaseException as error:
        results.put((rank, {"error": repr(error)}))


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_coded_sum_with_a_dead_peer_fails_instead_of_hanging():
    import multiprocessing
    import queue

    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = collectives.find_free_port("127.0.0.1")
    processes = [context.Process(target=_dying_rank, args=(rank, 2, port, results), daemon=True) for rank in range(2)]
    for process in processes:
        process.start()
    try:
        rank, outcome = results.get(timeout=TIMEOUT_S)
        assert rank == 0, outcome
        assert "error" not in outcome, outcome["error"]
        assert outcome["kind"] == "CodedWork"
        assert outcome["after_s"] < 20 + 10  # within the group's timeout, not forever
    except queue.Empty:
        pytest.fail("rank 0 waited on its dead peer past the test's deadline")
    finally:
        for process in processes:
            process.kill()
            process.join(timeout=10)
