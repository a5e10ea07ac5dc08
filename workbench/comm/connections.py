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

On a thin link (plain sums below `CODE_BELOW_BYTES_PER_S` for a ring's bytes), a float32 sum is coded
instead (`comm/coded_sum.py`): the same exact sum for about 0.84 of the bytes, its chunks spread over the
same connections, as long as the group's timed coded sums are faster than its plain ones. A sum is also
slow when a host's CPU is (measured: with one lab host at half a core the plain sums on the unlimited link
read below the threshold, and coding them halved `allreduce`'s speed), so both ways are timed and agreed:
the way not in use once every `PROBE_EVERY` agreements.
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

from workbench.comm.averaging import all_reduce_bytes_sent
from workbench.comm.coded_sum import CodedSums, CodedWork
from workbench.errors import ConfigError

SOCKETS_VARIABLE = "WORKBENCH_GLOO_SOCKETS"
DEFAULT_SOCKETS = 4
MAX_SOCKETS = 16
MIN_PIECE_BYTES = 256 * 1024  # smaller pieces pay gloo's per-call cost for nothing a link would notice
SLOW_SUM_S = 0.2  # a sum this long is the link's: a few more gloo calls (well under 1 ms each) cost nothing
AGREE_EVERY = 10  # uses of a channel between two agreements on how long its sums take
PROBE_EVERY = 5  # agreements between two timed sums of the way not in use (coded or plain): both kept current
# A coded sum of the MLP's 7.45 MB of gradients between two lab hosts (median of 16): 0.86 of gloo's time at
# 100 Mbit/s (0.54 s against 0.62 s), 0.89 at 1 Gbit/s (51 ms against 57 ms), but 38 ms against 8 ms on the
# unlimited link, where coding is the bound: worth it up to about 165 MB/s of a ring's bytes; a margin below.
CODE_BELOW_BYTES_PER_S = 150e6
MIN_CODED_BYTES = 256 * 1024  # smaller sums: the link's latency, not its rate, is what they pay


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


def coded(vector: torch.Tensor, world_size: int, sum_s: float | None, coded_s: float | None = None,
          probe: bool = False, below_bytes_per_s: float | None = None) -> bool:
    """Whether a sum of `vector` goes coded. Only a float32 CPU vector large enough, once the group agreed
    that its plain sums (`sum_s`) send a ring's bytes at under `below_bytes_per_s` (`CODE_BELOW_BYTES_PER_S`):
    a thin link. Then coded, unless the group timed a coded sum (`coded_s`) no faster than a plain one: a
    sum is slow for a slow CPU too (a host at half a core), and there coding makes it slower still.
    `probe`: this sum is timed the way the figures do not favour, so that both stay current."""
    limit = CODE_BELOW_BYTES_PER_S if below_bytes_per_s is None else below_bytes_per_s
    nbytes = vector.numel() * vector.element_size()
    if sum_s is None or vector.dtype != torch.float32 or vector.device.type != "cpu" or world_size < 2:
        return False
    if not vector.is_contiguous() or nbytes < MIN_CODED_BYTES or all_reduce_bytes_sent(nbytes, world_size) >= limit * sum_s:
        return False
    favoured = coded_s is None or coded_s < sum_s
    return favoured != probe


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
        self.last_s = math.inf  # this rank's last timed sum, from its start here to its end (none yet: inf)
        self.last_coded = False  # whether that sum went coded
        self.agreed_s: float | None = None  # the group's figure for a plain sum, the same on every rank
        self.coded_s: float | None = None  # and for a coded one
        self.vote = torch.zeros(2, dtype=torch.float64)  # (plain, coded): the timed sum's slot, the other inf
        self.vote_work: Any = None  # the agreement in flight, read at the channel's next use


class SumCutter:
    """The sums of a group with several connections per peer, channel by channel (`start_all_reduce`)."""

    def __init__(self, sockets: int, timeout_s: Callable[[], float]) -> None:
        self.sockets = sockets
        self.channels: dict[int, _Channel] = {}
        self.coder = CodedSums(timeout_s)

    def close(self) -> None:
        self.coder.close()

    def start(self, vector: torch.Tensor, channel: int, wait: Callable[[Any], None]) -> Any:
        """Begin the sum of `vector` on `channel`, in pieces when the group found its sums slow."""
        state = self.channels.setdefault(channel, _Channel())
        if state.vote_work is not None:
            wait(state.vote_work)  # started beside the previous sum, which the caller has waited for
            state.vote_work = None
            plain_s, coded_s = state.vote.tolist()
            state.agreed_s = state.agreed_s if math.isinf(plain_s) else plain_s
            state.coded_s = state.coded_s if math.isinf(coded_s) else coded_s
        nbytes = vector.numel() * vector.element_size()
        timed = state.uses % AGREE_EVERY == 0  # the sum the next use votes with: timed; the others need not be
        probe = timed and (state.uses // AGREE_EVERY) % PROBE_EVERY == PROBE_EVERY - 1
        started = time.perf_counter()
        if coded(vector, dist.get_world_size(), state.agreed_s, state.coded_s, probe):
            work = self.coder.start(vector, channel, state.uses, self.sockets)
        else:
            pieces = pieces_for(nbytes, self.sockets, state.agreed_s)
            if pieces == 1 or not vector.is_contiguous():
                work = dist.all_reduce(vector, async_op=True)
            else:  # one all-reduce per connection: gloo hands consecutive collectives to its connections in turn
                work = PiecesWork([dist.all_reduce(piece, async_op=True)
                                   for piece in vector.view(-1).tensor_split(pieces)])
        if timed:
            state.last_s, state.last_coded = math.inf, isinstance(work, CodedWork)  # inf until it ends: no vote
            work.get_future().add_done_callback(lambda _future: setattr(state, "last_s", time.perf_counter() - started))
        if state.uses % AGREE_EVERY == 1:
            # The shortest rank's figure: the rank that started last waited for no peer, so its sum took
            # what the link took; a rank that started earlier also counts its wait for a slower peer.
            state.vote.fill_(math.inf)
            state.vote[1 if state.last_coded else 0] = state.last_s
            state.vote_work = dist.all_reduce(state.vote, op=dist.ReduceOp.MIN, async_op=True)
        state.uses += 1
        return work
