"""The same-host all-reduce through /dev/shm (`comm/shared_memory.py`) in real processes, each in a real
gloo group formed by `collectives.init_process_group`: its sums against gloo's own, on every rank, over
several uses of several channels, and nothing left in /dev/shm; and a /dev/shm too small for a slot.
"""
from __future__ import annotations

import errno
import glob
import multiprocessing
import os

import pytest
import torch

from helpers import spawn_ranks

from workbench.comm import collectives, shared_memory

TIMEOUT_S = 120


def _no_room_at(call):
    """`os.posix_fallocate` failing as a full /dev/shm does, at its `call`-th use in this process (1 first)."""
    real, calls = os.posix_fallocate, [0]

    def allocate(descriptor, offset, length):
        calls[0] += 1
        if calls[0] == call:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(descriptor, offset, length)

    return allocate


def _rank(rank, world_size, port, switch, no_room_at, results):
    if switch is not None:
        os.environ[shared_memory.SWITCH_VARIABLE] = switch
    if no_room_at is not None and rank == 1:
        os.posix_fallocate = _no_room_at(no_room_at)
    torch.set_num_threads(1)
    try:
        collectives.init_process_group("127.0.0.1", port, rank, world_size, torch.device("cpu"), 60,
                                       own_host="127.0.0.1")
        reducer = collectives._reducer
        token = reducer.token if reducer is not None else None
        generator = torch.Generator().manual_seed(1000 + rank)
        sizes = {0: 100_003, 1: 17}  # two channels, one of them odd-sized
        mismatches, files_mid_run, kinds = [], [], set()
        for use in range(5):
            for channel, size in sizes.items():
                vector = torch.randn(size, generator=generator) * (use + 1)
                reference = vector.clone()
                work = collectives.start_all_reduce(vector, channel=channel)
                kinds.add(type(work).__name__)
                collectives.wait(work)
                torch.distributed.all_reduce(reference)  # gloo's own sum of the same vectors
                if world_size == 2 and not torch.equal(vector, reference):
                    mismatches.append((use, channel, (vector - reference).abs().max().item()))
                if world_size > 2 and not torch.allclose(vector, reference, rtol=1e-6, atol=1e-6):
                    mismatches.append((use, channel, (vector - reference).abs().max().item()))
                gathered = [torch.empty_like(vector) for _ in range(world_size)]
                torch.distributed.all_gather(gathered, vector)
                if not all(torch.equal(gathered[0], other) for other in gathered):
                    mismatches.append((use, channel, "ranks differ"))
            torch.distributed.barrier()
            if token is not None:
                files_mid_run.append(len(glob.glob(f"{shared_memory.SHM_DIRECTORY}/*{token}*")))
            torch.distributed.barrier()  # nobody starts the next use while another rank counts
        collectives.destroy_process_group()
        results.put((rank, {"token": token, "mismatches": mismatches, "kinds": sorted(kinds),
                            "files_mid_run": files_mid_run}))
    except BaseException as error:
        results.put((rank, {"error": repr(error)}))


def _run(world_size, switch=None, no_room_at=None):
    found = spawn_ranks(_rank, world_size, world_size, collectives.find_free_port("127.0.0.1"), switch, no_room_at)
    for rank, outcome in found.items():
        assert "error" not in outcome, f"rank {rank}: {outcome['error']}"
    return [found[rank] for rank in range(world_size)]


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_ranks_sum_through_shared_memory_exactly_as_gloo_and_leave_nothing_in_dev_shm():
    outcomes = _run(2)
    tokens = {outcome["token"] for outcome in outcomes}
    assert len(tokens) == 1 and None not in tokens  # both ranks agreed on one group token
    for outcome in outcomes:
        assert outcome["kinds"] == ["LocalSum"]
        assert outcome["mismatches"] == []
        # A slot's file loses its name once every rank has mapped it (the next use's signal): after uses
        # 1 and 2 one parity per channel and rank is named (2 channels x 2 ranks), from use 3 on none, so
        # a rank killed then leaves nothing behind.
        assert outcome["files_mid_run"] == [4, 4, 0, 0, 0]
    assert glob.glob(f"{shared_memory.SHM_DIRECTORY}/*{tokens.pop()}*") == []


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_three_ranks_agree_with_each_other_and_with_gloo():
    outcomes = _run(3)
    for outcome in outcomes:
        assert outcome["token"] is not None and outcome["kinds"] == ["LocalSum"]
        assert outcome["mismatches"] == []


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_switched_off_the_sums_go_through_gloo():
    outcomes = _run(2, switch="0")
    for outcome in outcomes:
        assert outcome["token"] is None
        assert outcome["kinds"] != ["LocalSum"]
        assert outcome["mismatches"] == []


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("no_room_at, files", [(1, [2, 2, 0, 0, 0]), (3, [4, 2, 0, 0, 0])],
                         ids=["first-use", "second-parity"])
def test_a_dev_shm_without_room_for_a_slot_sends_that_channel_through_gloo_on_every_rank(no_room_at, files):
    # Rank 1 cannot make its slot of channel 0 (the large one): at its first use (the 1st allocation), or
    # at its second (the 3rd: channel 0's other parity, when both ranks have the first one).
    outcomes = _run(2, no_room_at=no_room_at)
    token = outcomes[0]["token"]
    assert token is not None and outcomes[1]["token"] == token
    for outcome in outcomes:
        assert outcome["mismatches"] == []  # that use and every later one summed as gloo sums them
        # Channel 0 through gloo from then on, channel 1 still through shared memory.
        assert "LocalSum" in outcome["kinds"] and len(outcome["kinds"]) == 2, outcome["kinds"]
        # Channel 0's files are gone at once on both ranks (its slots freed); channel 1's as before.
        assert outcome["files_mid_run"] == files
    assert glob.glob(f"{shared_memory.SHM_DIRECTORY}/*{token}*") == []


def _leaving_rank(rank, port, left, results):
    torch.set_num_threads(1)
    try:
        from workbench.worker.loop import peer_lost

        collectives.init_process_group("127.0.0.1", port, rank, 2, torch.device("cpu"), 60, own_host="127.0.0.1")
        vector = torch.ones(1410)
        work = collectives.start_all_reduce(vector, channel=1 << 20)
        if rank == 1:  # signals, reads rank 0's slot, then leaves at once, as a rank failing right after does
            collectives.wait(work)
            collectives.destroy_process_group()
            left.set()
            results.put((rank, {"sum": vector[0].item()}))
            return
        assert left.wait(timeout=60)  # rank 1 has removed its slot before this rank reads it
        try:
            collectives.wait(work)
            outcome = {"error": None}
        except BaseException as error:  # noqa: BLE001 - what the worker loop would see
            outcome = {"error": f"{type(error).__name__}: {error}", "peer_lost": peer_lost(error)}
        collectives.destroy_process_group()
        results.put((rank, outcome))
    except BaseException as error:
        results.put((rank, {"failed": repr(error)}))


@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_slot_removed_by_a_rank_leaving_reads_as_that_peer_lost():
    left = multiprocessing.get_context("spawn").Event()
    found = spawn_ranks(_leaving_rank, 2, collectives.find_free_port("127.0.0.1"), left)
    assert "failed" not in found[0] and "failed" not in found[1], found
    assert found[1]["sum"] == 2.0  # the rank that left had its sum
    # The one left behind: a peer lost (the worker loop leaves and waits for the client's verdict), naming
    # the rank, not a FileNotFoundError reported as this rank's own failure.
    assert found[0]["error"].startswith("ConnectionError: rank 1 left the group"), found[0]
    assert found[0]["peer_lost"] is True
