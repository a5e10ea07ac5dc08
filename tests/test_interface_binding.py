"""Which interface the process group binds to, from a worker's Dask address (pure, no process group)."""
import os

import pytest

from workbench import collectives
from workbench import errors as workbench_errors


@pytest.fixture
def clean_environment(monkeypatch):
    for variable in collectives.SOCKET_IFNAME_VARIABLES:
        # Set, then deleted: monkeypatch records the variable only if it existed, and what the binding sets
        # must not outlive the test (later processes started from this one would inherit it).
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)


def test_the_interface_holding_an_address_is_found_and_an_unknown_address_has_none():
    assert collectives.interface_holding("127.0.0.1") == "lo"
    assert collectives.interface_holding("192.0.2.77") is None  # TEST-NET-1: on no interface here
    assert collectives.interface_holding("no-such-host.invalid") is None


def test_binding_sets_gloo_and_nccl_to_that_interface(clean_environment):
    bound = collectives.bind_to_interface_of("127.0.0.1")
    assert sorted(bound) == sorted(collectives.SOCKET_IFNAME_VARIABLES)
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert collectives.advertised_address() == "127.0.0.1"


def test_an_interface_the_user_named_is_respected(clean_environment, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert collectives.bind_to_interface_of("192.0.2.77") == []  # not ours: nothing to bind to
    assert collectives.bind_to_interface_of("127.0.0.1") == ["NCCL_SOCKET_IFNAME"]  # gloo's is the user's
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_an_interface_that_does_not_exist_is_named_in_the_error(clean_environment, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(collectives.GroupFormationError, match="GLOO_SOCKET_IFNAME='nosuch0' names no interface"):
        collectives.advertised_address()


def test_a_new_group_waits_for_the_one_still_leaving_this_process_and_fails_if_it_never_leaves(clean_environment):
    import threading

    import torch
    import torch.distributed as dist

    def join(timeout_s):
        port = collectives.find_free_port("127.0.0.1")
        collectives.init_process_group("127.0.0.1", port, 0, 1, torch.device("cpu"), timeout_s, own_host="127.0.0.1")

    join(10)  # the previous run's group, still here
    try:
        with pytest.raises(workbench_errors.TrainingError, match="still belongs to another .* after 0.2 s"):
            join(0.2)
        joined = threading.Event()
        waiting = threading.Thread(target=lambda: (join(10), joined.set()))
        waiting.start()
        assert not joined.wait(0.3)  # waits while the old group is there
        collectives.destroy_process_group()  # the old run's task leaves
        waiting.join(10)
        assert joined.is_set() and dist.is_initialized()
    finally:
        collectives.destroy_process_group()
