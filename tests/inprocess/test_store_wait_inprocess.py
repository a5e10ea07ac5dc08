"""A rank joining its group waits for rank 0's store by probing it (`collectives.await_listening`), not
through torch's store client, which backs off 0.3-0.5 s after a refused connect; and the cyclic garbage
collector leaves what was loaded before the first run alone (`host.freeze_what_is_loaded`). In this
process: real sockets and a real torch TCPStore, no process started."""
from __future__ import annotations

import datetime
import gc
import socket
import threading

import torch.distributed as dist

from workbench.comm import collectives
from workbench.worker import host


def _free_port() -> int:
    return collectives.find_free_port("127.0.0.1")


def test_a_store_opened_after_refusals_is_found_and_takes_the_probes_connection_in_stride(monkeypatch):
    port, refused, opened = _free_port(), threading.Semaphore(0), {}
    connect = socket.create_connection

    def counting(*args, **kwargs):
        try:
            return connect(*args, **kwargs)
        except ConnectionRefusedError:
            refused.release()
            raise

    monkeypatch.setattr(collectives.socket, "create_connection", counting)

    def open_after_two_refusals():
        refused.acquire(timeout=30)
        refused.acquire(timeout=30)  # the probe was refused twice: rank 0 opens its store only now
        opened["store"] = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=datetime.timedelta(seconds=30))

    master = threading.Thread(target=open_after_two_refusals, daemon=True)
    master.start()
    assert collectives.await_listening("127.0.0.1", port, timeout_s=30) is True
    # The store's client connects behind the probe, and both ends work.
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    master.join(timeout=30)
    client.set("rank-1", "here")
    assert opened["store"].get("rank-1") == b"here"


def test_nothing_listening_is_reported_after_the_timeout_and_an_unreachable_host_left_to_the_store():
    assert collectives.await_listening("127.0.0.1", _free_port(), timeout_s=0.2) is False
    # Not a refusal (no route, a firewall dropping packets): the store's own connect reports it.
    assert collectives.await_listening("no-such-host.invalid", 1, timeout_s=5) is True


def test_what_was_loaded_before_the_first_run_is_frozen_once(monkeypatch):
    frozen = []
    monkeypatch.setattr(host, "_frozen", False)
    monkeypatch.setattr(host.gc, "freeze", lambda: frozen.append(gc.get_count()))
    host.freeze_what_is_loaded()
    host.freeze_what_is_loaded()  # the next run on this worker: nothing more is frozen
    assert len(frozen) == 1 and host._frozen is True
