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
samples/s against 8,867-9,427 whole). How long a channel's sums take is agreed by the group every
`AGREE_EVERY` uses, in a one-number sum of its own started beside the channel's and read at the next
use, so every rank cuts every sum alike (a rank calling more all-reduces than another would hang the
group) and a link that changes while a run trains is followed within that many steps.
"""
from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from workbench.errors import ConfigError

SOCKETS_VARIABLE = "WORKBENCH_GLOO_SOCKETS"
DEFAULT_SOCKETS = 4
MAX_SOCKETS = 16
MIN_PIECE_BYTES = 256 * 1024  # smaller pieces pay gloo's per-call cost for nothing a link would notice
SLOW_SUM_S = 0.2  # a sum this long is the link's: a few more gloo calls (well under 1 ms each) cost nothing
AGREE_EVERY = 10  # uses of a channel between two agreements on how long its sums take


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
    def __init__(self) -> None:
        self.uses = 0
        self.last_s = math.inf  # this rank's last sum, from its start here to its end (none yet: inf)
        self.agreed_s: float | None = None  # the group's figure, the same on every rank
        self.vote = torch.zeros(1, dtype=torch.float64)
        self.vote_work: Any = None  # the agreement in flight, read at the channel's next use


class SumCutter:
    """The sums of a group with several connections per peer, channel by channel (`start_all_reduce`)."""

    def __init__(self, sockets: int) -> None:
        self.sockets = sockets
        self.channels: dict[int, _Channel] = {}

    def start(self, vector: torch.Tensor, channel: int, wait: Callable[[Any], None]) -> Any:
        """Begin the sum of `vector` on `channel`, in pieces when the group found its sums slow."""
        state = self.channels.setdefault(channel, _Channel())
        if state.vote_work is not None:
            wait(state.vote_work)  # started beside the previous sum, which the caller has waited for
            state.vote_work = None
            state.agreed_s = None if math.isinf(state.vote.item()) else state.vote.item()
        pieces = pieces_for(vector.numel() * vector.element_size(), self.sockets, state.agreed_s)
        started = time.perf_counter()
        if pieces == 1 or not vector.is_contiguous():
            work = dist.all_reduce(vector, async_op=True)
        else:  # one all-reduce per connection: gloo hands consecutive collectives to its connections in turn
            work = PiecesWork([dist.all_reduce(piece, async_op=True)
                               for piece in vector.view(-1).tensor_split(pieces)])
        if state.uses % AGREE_EVERY == 0:  # the sum the next use votes with: timed; the others need not be
            work.get_future().add_done_callback(lambda _future: setattr(state, "last_s", time.perf_counter() - started))
        if state.uses % AGREE_EVERY == 1:
            # The shortest rank's figure: the rank that started last waited for no peer, so its sum took
            # what the link took; a rank that started earlier also counts its wait for a slower peer.
            state.vote.fill_(state.last_s)
            state.vote_work = dist.all_reduce(state.vote, op=dist.ReduceOp.MIN, async_op=True)
        state.uses += 1
        return work
