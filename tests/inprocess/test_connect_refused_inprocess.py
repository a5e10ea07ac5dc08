"""Connecting to a scheduler address where nothing listens: refused connections are said as such after
`REFUSED_S` (monkeypatched short here), not after the whole connect timeout; a port that accepts is left
to Dask's own connect."""
import socket

import pytest

import workbench
from workbench.cluster import connection

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    with socket.socket() as probe:  # bound, then closed: nothing listens there now
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_port_nothing_listens_on_is_said_to_refuse(monkeypatch):
    monkeypatch.setattr(connection, "REFUSED_S", 0.3)
    address = f"tcp://127.0.0.1:{_closed_port()}"
    with pytest.raises(workbench.ClusterError, match=r"could not reach the Dask scheduler at .*refused for 0.3 s"):
        workbench.connect(scheduler=address, timeout_s=30)


def test_a_port_that_accepts_is_not_taken_for_refused():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert not connection._refused_throughout(f"tcp://127.0.0.1:{server.getsockname()[1]}", 0.3)
    assert not connection._refused_throughout("inproc://192.168.0.1/1/2", 0.3)  # not host:port: Dask's to judge
