"""Which interface the process group binds to, from a worker's Dask address (pure, no process group; a
real group of one rank: tests/inprocess/test_interface_binding_inprocess.py)."""
import os

import pytest

from workbench.comm import collectives


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
