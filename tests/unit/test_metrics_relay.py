"""The per-host metrics relay (workbench/plane/relay.py), pure: which rank relays for which (messages
through a relay on a real cluster: tests/cluster/test_metrics_relay_cluster.py)."""
from __future__ import annotations

from workbench.plane import relay as metrics_relay


def test_the_lowest_rank_on_a_host_relays_for_its_hosts_other_ranks_and_lone_ranks_go_in_groups():
    addresses = ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1", "tcp://10.0.0.1:2", "tcp://10.0.0.3:1", "tcp://10.0.0.2:2",
                 "tcp://10.0.0.4:1", "tcp://10.0.0.5:1", "tcp://10.0.0.6:1"]
    assert metrics_relay.relay_addresses(addresses, relay_from=8, group=2) == [
        "tcp://10.0.0.1:1", "tcp://10.0.0.2:1", "tcp://10.0.0.1:1",  # hosts 1 and 2: their lowest rank
        "tcp://10.0.0.3:1", "tcp://10.0.0.2:1", "tcp://10.0.0.3:1",  # ranks 3 and 5, alone: a group of 2
        "tcp://10.0.0.5:1", "tcp://10.0.0.5:1"]  # ranks 6 and 7
    assert metrics_relay.relay_addresses(addresses[:6], relay_from=1, group=8)[3] == "tcp://10.0.0.3:1"
    lone = metrics_relay.relay_addresses(["tcp://10.0.0.1:1", "tcp://10.0.0.1:2", "tcp://10.0.0.3:1"], relay_from=1)
    assert lone == ["tcp://10.0.0.1:1", "tcp://10.0.0.1:1", None]  # a group of one sends its own
    assert metrics_relay.relay_addresses(addresses, relay_from=9) == [None] * 8  # a small run: each its own
