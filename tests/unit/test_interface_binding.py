"""Which interface the process group binds to, from a worker's Dask address (pure, no process group; a
real group of one rank: tests/inprocess/test_interface_binding_inprocess.py), and the connections per peer
a group across hosts opens (`comm/connections.py`; real groups: tests/cluster/test_gloo_sockets.py)."""
import os

import pytest

from workbench.comm import collectives, connections


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


def test_a_group_across_hosts_names_each_interface_once_per_connection_and_puts_the_name_back(
        clean_environment, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,eth1")
    with connections.spread_over_sockets(3) as sockets:
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0,eth0,eth0,eth1,eth1,eth1"
        assert sockets == 6
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0,eth1"
    with connections.spread_over_sockets(1) as sockets:  # every rank on this machine: one connection
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth0,eth1" and sockets == 1
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with connections.spread_over_sockets(4) as sockets:  # gloo picks the interface itself: once
        assert "GLOO_SOCKET_IFNAME" not in os.environ and sockets == 1


def test_the_connections_per_peer_come_from_the_variable_and_a_bad_one_is_named(clean_environment, monkeypatch):
    monkeypatch.delenv(connections.SOCKETS_VARIABLE, raising=False)
    assert connections.sockets_per_peer() == connections.DEFAULT_SOCKETS == 4
    monkeypatch.setenv(connections.SOCKETS_VARIABLE, "2")
    assert connections.sockets_per_peer() == 2
    for bad in ("0", "17", "two", "1.5"):
        monkeypatch.setenv(connections.SOCKETS_VARIABLE, bad)
        with pytest.raises(ValueError, match=f"WORKBENCH_GLOO_SOCKETS='{bad}' is not allowed: expected an "
                                             f"integer from 1 to 16"):
            connections.sockets_per_peer()


def test_a_sum_the_link_makes_slow_is_cut_in_one_piece_per_connection_none_under_a_quarter_megabyte():
    quarter, slow = connections.MIN_PIECE_BYTES, connections.SLOW_SUM_S
    assert connections.pieces_for(7_450_000, 4, 3.0) == 4  # 3 s a sum: 20 Mbit/s
    assert connections.pieces_for(3 * quarter + 1, 4, slow) == 3
    assert connections.pieces_for(quarter - 1, 4, 60.0) == 1 and connections.pieces_for(0, 4, 60.0) == 1
    assert connections.pieces_for(7_450_000, 1, 3.0) == 1  # one connection: nothing to spread over
    # Fast sums (the link is not the bound) and channels the group has not agreed on yet: whole.
    assert connections.pieces_for(7_450_000, 4, slow * 0.99) == 1
    assert connections.pieces_for(7_450_000, 4, None) == 1
