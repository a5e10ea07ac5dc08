"""Several gloo connections per peer across hosts, and the sums cut over them.

One TCP connection through a thin shaped link stays below the link's rate (its own losses and backoff);
several side by side fill it, which is why NCCL keeps several sockets per peer (`NCCL_NSOCKS_PERTHREAD`).
Measured in the lab at 20 Mbit/s (two hosts, 7.45 MB summed, 10 runs each): one connection 3.6-3.7 s a
sum (the link's own time 3.1 s), the sum cut in four over four connections 3.2-3.3 s; at 100 Mbit/s and
1 Gbit/s the same either way. A group across hosts opens `WORKBENCH_GLOO_SOCKETS` connections per peer
(4 unless set; gloo opens one per interface name, so the name is given that many times while the group
forms), and gloo hands its collectives to its connections in turn, so a sum cut in as many pieces
travels over all of them.

Only a sum the link makes slow is cut: on the lab's unlimited link, where a 7.45 MB sum takes
milliseconds and the CPU is the bound, cutting every one cost `allreduce` 13% of its speed (7,870
samples/s against 8,867-9,427 whole). How long a channel's sums take (the fastest of its newest, over
every rank: the link's figure, `comm/sum_way.py`) is agreed by the group every `AGREE_EVERY` uses, in a
small sum of its own started beside the channel's and read at the next use, so every rank cuts every sum
alike (a rank calling more all-reduces than another would hang the group) and a link that changes while a
run trains is followed within a few steps.

On a thin link a float32 sum is coded instead (`comm/coded_sum.py`): the same exact sum for about 0.84 of
the bytes, its chunks spread over the same connections. Which way a channel's sums go is decided from the
same agreements (`comm/sum_way.py`: the link's figure and the two ways timed against each other).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from workbench.comm.coded_sum import CodedSums
from workbench.comm.sum_way import AGREE_EVERY, SumTimes, WayChoice, codable
from workbench.errors import ConfigError

SOCKETS_VARIABLE = "WORKBENCH_GLOO_SOCKETS"
DEFAULT_SOCKETS = 4
MAX_SOCKETS = 16
MIN_PIECE_BYTES = 256 * 1024  # smaller pieces pay gloo's per-call cost for nothing a link would notice
SLOW_SUM_S = 0.2  # a sum this long is the link's: a few more gloo calls (well under 1 ms each) cost nothing


def sockets_per_peer() -> int:
    """The connections per peer a group across hosts opens: `WORKBENCH_GLOO_SOCKETS`, else 4."""
    value = os.environ.get(SOCKETS_VARIABLE)
    if value is None:
        return DEFAULT_SOCKETS
    try:
        sockets = int(value)
    except ValueError:
        sockets = 0
    if not 1 <= sockets <= MAX_SOCKETS:
        raise ConfigError(SOCKETS_VARIABLE, value, f"an integer from 1 to {MAX_SOCKETS}")
    return sockets


@contextlib.contextmanager
def spread_over_sockets(sockets: int) -> Iterator[int]:
    """While a gloo group forms: every interface `GLOO_SOCKET_IFNAME` names, named `sockets` times (gloo
    opens one connection per peer for each name); yields the connections per peer the group will have.
    Without a named interface gloo picks one itself, once."""
    names = os.environ.get("GLOO_SOCKET_IFNAME")
    if sockets == 1 or not names:
        yield 1
        return
    os.environ["GLOO_SOCKET_IFNAME"] = ",".join(name for name in names.split(",") for _ in range(sockets))
    try:
        yield sockets * len(names.split(","))
    finally:
        os.environ["GLOO_SOCKET_IFNAME"] = names


def pieces_for(nbytes: int, sockets: int, sum_s: float | None, min_piece_bytes: int = MIN_PIECE_BYTES) -> int:
    """How many all-reduces a sum of `nbytes` is cut into over `sockets` connections, given how long the
    group agreed the channel's sums take (None: not agreed yet): one per connection, none smaller than
    `min_piece_bytes`, once that is `SLOW_SUM_S` or more; else one."""
    if sum_s is None or sum_s < SLOW_SUM_S:
        return 1
    return max(1, min(sockets, nbytes // min_piece_bytes))


class PiecesWork:
    """The all-reduces of one vector's pieces, waited for (and watched) as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([work.get_future() for work in self.works])


class _Channel:
    def __init__(self, vector: torch.Tensor, world_size: int) -> None:
        nbytes = vector.numel() * vector.element_size()
        self.kind = _kind(vector)
        self.uses = 0
        self.times = SumTimes()  # this rank's timed sums
        self.way = WayChoice(nbytes, world_size, codable(vector, world_size))  # the group's choice, agreed
        self.vote = torch.zeros(3, dtype=torch.float64)  # `SumTimes.vote`, MIN-reduced over the ranks
        self.vote_work: Any = None  # the agreement in flight, read at the channel's next use


def _kind(vector: torch.Tensor) -> tuple[Any, ...]:
    """What a channel's figures are of: another kind of vector (a live switch to bf16 buckets, to other
    buckets) starts the channel anew, alike on every rank since every rank sums the same kind."""
    return vector.numel(), vector.dtype, vector.device.type, vector.is_contiguous()


class SumCutter:
    """The sums of a group across hosts, channel by channel (`start_all_reduce`): cut in pieces over the
    connections when the link makes them slow, coded when it is thin and coding pays."""

    def __init__(self, sockets: int, timeout_s: Callable[[], float]) -> None:
        self.sockets = sockets
        self.channels: dict[int, _Channel] = {}
        self.coder = CodedSums(timeout_s)

    def close(self) -> None:
        self.coder.close()

    def start(self, vector: torch.Tensor, channel: int, wait: Callable[[Any], None]) -> Any:
        """Begin the sum of `vector` on `channel`, the way the group agreed for it."""
        state = self.channels.get(channel)
        if state is not None and state.kind != _kind(vector):
            if state.vote_work is not None:
                wait(state.vote_work)  # every rank started it: finished, then dropped with the old figures
            state = None
        if state is None:
            state = self.channels[channel] = _Channel(vector, dist.get_world_size())
        if state.vote_work is not None:
            wait(state.vote_work)  # started beside the previous sum, which the caller has waited for
            state.vote_work = None
            before = state.way.coding
            if state.way.agree(*state.vote.tolist()) != before:
                state.times.new_stint(state.way.coding)
        started, stint = time.perf_counter(), state.times.stint
        if state.way.coding:
            work = self.coder.start(vector, channel, state.uses, self.sockets)
        else:
            pieces = pieces_for(vector.numel() * vector.element_size(), self.sockets, state.way.link_s)
            if pieces == 1 or not vector.is_contiguous():
                work = dist.all_reduce(vector, async_op=True)
            else:  # one all-reduce per connection: gloo hands consecutive collectives to its connections in turn
                work = PiecesWork([dist.all_reduce(piece, async_op=True)
                                   for piece in vector.view(-1).tensor_split(pieces)])
        coding = state.way.coding
        work.get_future().add_done_callback(
            lambda _future: state.times.add(coding, time.perf_counter() - started, stint))
        if state.uses % AGREE_EVERY == 1:
            # The shortest figure of any rank: the rank that started last waited for no peer, so its sum took
            # what the link (and its own CPU) took; a rank that started earlier also counts its wait.
            state.vote.copy_(torch.tensor(state.times.vote(), dtype=torch.float64))
            state.vote_work = dist.all_reduce(state.vote, op=dist.ReduceOp.MIN, async_op=True)
        state.uses += 1
        return work
