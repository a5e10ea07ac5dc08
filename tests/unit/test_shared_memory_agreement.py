"""Whether a group sums through /dev/shm (`shared_memory.agree_on_shared_memory`): every rank reaches the
same verdict, yes only when all advertise one address and see each other's probe; no probe is left."""
from __future__ import annotations

import glob
import threading

import pytest
import torch.distributed as dist

from workbench.comm import shared_memory


def _agree(addresses):
    store = dist.HashStore()
    verdicts: dict[int, object] = {}

    def rank(index):
        verdicts[index] = shared_memory.agree_on_shared_memory(store, index, len(addresses), addresses[index])

    threads = [threading.Thread(target=rank, args=(index,)) for index in range(len(addresses))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(verdicts) == len(addresses)
    return [verdicts[index] for index in range(len(addresses))]


def _probes():
    return glob.glob(f"{shared_memory.SHM_DIRECTORY}/{shared_memory.PREFIX}probe-*")


def test_ranks_on_one_address_agree_on_one_token_and_remove_their_probes():
    before = _probes()
    verdicts = _agree(["10.0.0.1"] * 3)
    assert verdicts[0] is not None and len(set(verdicts)) == 1
    assert _probes() == before


@pytest.mark.parametrize("addresses", [["10.0.0.1", "10.0.0.2"], ["10.0.0.1", "10.0.0.1", "10.0.0.3"]])
def test_one_rank_elsewhere_sends_every_rank_through_gloo(addresses):
    # The lab's hosts share this VM's /dev/shm but not its address: they must use their links.
    assert _agree(addresses) == [None] * len(addresses)


def test_switched_off_nobody_uses_shared_memory(monkeypatch):
    monkeypatch.setenv(shared_memory.SWITCH_VARIABLE, "0")
    assert _agree(["127.0.0.1"] * 2) == [None, None]


def test_a_rank_that_cannot_see_the_others_probes_sends_everyone_through_gloo(monkeypatch):
    # Two containers on one address with /dev/shm of their own: no rank finds the others' probes.
    monkeypatch.setattr(shared_memory, "_reads", lambda path, nonce: False)
    assert _agree(["127.0.0.1"] * 2) == [None, None]


def test_one_rank_alone_has_nothing_to_share():
    assert shared_memory.agree_on_shared_memory(dist.HashStore(), 0, 1, "127.0.0.1") is None
