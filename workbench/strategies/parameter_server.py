"""Asynchronous strategies around the parameter server: `async` (Downpour SGD), `ssp` (stale-synchronous
parallel) and `easgd` (elastic averaging).

Each worker trains on its own and talks to the server (Dask actors, see `server/shards.py`) every few steps,
never through a process group. One call to the server is in flight at a time and runs in the
background while the next steps compute: a worker blocks only when the previous call has not returned
by the time the next is due (`comm_s`, the exposed part); `comm_total_s` is the whole round trip.

With `compression` (and `reply_compression`, by default the same) other than "none", traffic is
compressed both ways: pushes with error feedback on the worker, replies as changes against a mirror of
what each worker holds (`server/replies.py`). An `async`/`ssp` worker keeps its copy of the server's weights
(`known`) and trains on `known` minus its window not pushed yet; an `easgd` worker gets its elastic
pull compressed. The weights travel in full only in a worker's first fetch from a new server (start,
switch, resume), at the end of the run and for checkpoints.
"""
from __future__ import annotations

import dataclasses
import gc
import threading
import time
from typing import Any

import torch

from workbench.checks import check_positive_int, check_positive_number
from workbench.comm.averaging import fingerprint, flat_optimizer_state, flatten, unflatten_into
from workbench.comm.device_staging import HostStaging, to_host
from workbench.errors import ConfigError
from workbench.server.compression import (
    COMPRESSIONS,
    SPARSE_COMPRESSIONS,
    ErrorFeedback,
    add_decoded,
    decode,
    encode,
    validate_compression,
)
from workbench.server.replies import KnownWeights
from workbench.server.shards import Call, Replies, ServerClient, ServerHandle, let_go, merge_replies
from workbench.strategies.base import Carried, Strategy, StrategySettings, TrainingContext, Traits


@dataclasses.dataclass
class ServerOptions(StrategySettings):
    """Settings shared by the strategies that talk to the parameter server."""

    shards: int = 1
    """Parameter-server actors, each holding a contiguous range of the parameters, on different workers."""
    overlap: bool = True
    """Run each exchange with the server in the background while the next steps compute."""
    compression: str = "none"
    """What travels to the server: 'none', 'fp16', 'topk' (largest `topk_ratio` of values) or 'threshold'."""
    topk_ratio: float = 0.01
    threshold_tau: float = 1e-3
    """Strom's threshold: values beyond +/- tau are sent as +/- tau; the rest waits in the residual. Used
    rounded to the nearest power of two (1e-3 -> 2^-10), which keeps the residual arithmetic exact."""
    reply_compression: str | None = None
    """What travels back (fetched weights, elastic pulls): None (default) for the same as `compression`;
    'none' for dense float32 weights, which costs the server no selection (CPU) per reply and suits a
    fast link; otherwise compressed changes against a mirror of what each worker holds, with the same
    `topk_ratio` / `threshold_tau`. Threshold suits gradients better than weights: a weight lags the
    server by up to tau, and moves towards it by tau per reply at most."""

    def validate(self) -> None:
        check_positive_int("shards", self.shards)
        if not isinstance(self.overlap, bool):
            raise ConfigError("overlap", self.overlap, "True or False")
        validate_compression(self.compression, self.topk_ratio, self.threshold_tau)
        if self.reply_compression is not None and self.reply_compression not in COMPRESSIONS:
            raise ConfigError("reply_compression", self.reply_compression,
                              f"None (the same as compression) or one of {list(COMPRESSIONS)}")

    def replies(self) -> tuple[str, float, float]:
        """How the server compresses its replies: (kind, topk_ratio, threshold_tau)."""
        kind = self.compression if self.reply_compression is None else self.reply_compression
        return kind, self.topk_ratio, self.threshold_tau


@dataclasses.dataclass
class AsyncSettings(ServerOptions):
    live = ("push_every", "fetch_every", "staleness_aware_lr")

    push_every: int = 1
    """Steps between pushes of the accumulated gradients."""
    fetch_every: int | None = None
    """Steps between fetches of the server's weights (default: with every push)."""
    staleness_aware_lr: bool = True
    """The server divides each push's learning rate by its staleness (Zhang et al. 2016): with more
    workers each push is staler, and without it 4 workers on `digits` ended at chance."""

    def validate(self) -> None:
        super().validate()
        check_positive_int("push_every", self.push_every)
        if self.fetch_every is not None:
            check_positive_int("fetch_every", self.fetch_every)
        if not isinstance(self.staleness_aware_lr, bool):
            raise ConfigError("staleness_aware_lr", self.staleness_aware_lr, "True or False")


@dataclasses.dataclass
class SSPSettings(AsyncSettings):
    live = AsyncSettings.live + ("max_staleness",)

    max_staleness: int = 8
    """Clocks (push windows) a worker may be ahead of the slowest; 0 is bulk-synchronous."""
    # The bound only orders the pushes: with a fetch at every push a push's staleness stays about 1
    # server version (mean 0.9-1.0) whatever the bound. On 2 shared cores one worker is steadily faster
    # and sits at a tight bound: at 4 it waited in up to 86 of its 110 windows on `digits` (5 epochs), and
    # the 5-epoch accuracy spread with the waiting. The CLI's defaults then (lr 0.25, momentum 0.4), 2 workers on a
    # shared 2-worker cluster as tests/cluster/test_defaults.py runs, held-out accuracy after 5 epochs (min /
    # median / max, runs >= 0.9): bound 2 0.864 / 0.903 / 0.936, 5 of 10; 4 0.797 / 0.913 / 0.947, 19 of
    # 26; 6 0.850 / 0.923 / 0.936, 7 of 10; 8 0.903 / 0.930 / 0.947, 50 of 50 (40 epochs: 0.964 / 0.967 /
    # 0.969, 5 runs). At bound 4 a lower momentum (0.2, lr 0.25) gave 0.866 / 0.916 / 0.947, 35 of 40, and
    # a lower lr (0.2 or 0.15, momentum 0.4) 0.889 / 0.916 / 0.936, 17 of 20. Eight push windows is still a
    # bound against a straggler (`async`'s two workers drifted up to 11 apart here).

    def validate(self) -> None:
        super().validate()
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ConfigError("max_staleness", self.max_staleness, "an integer >= 0 (0 = bulk-synchronous)")


@dataclasses.dataclass
class EASGDSettings(ServerOptions):
    live = ("period", "alpha")

    period: int = 4
    """Steps between elastic exchanges with the center variable."""
    alpha: float = 0.5
    """Strength of the elastic pull between a worker and the center, in (0, 1]."""

    def validate(self) -> None:
        super().validate()
        check_positive_int("period", self.period)
        check_positive_number("alpha", self.alpha)
        if self.alpha > 1:
            raise ConfigError("alpha", self.alpha, "a number in (0, 1]")


class _ServerStrategy(Strategy):
    """What the parameter-server strategies share: the server connection, the one background call,
    the metrics of each exchange, and the end of the run (everyone takes the server's final weights)."""

    settings: ServerOptions
    elastic = False  # the server's replies are elastic pulls (easgd), not weights
    # Set by a switch that carried each worker's own weights over a common base (`takes_own_weights`):
    # the weights the server starts from, until `setup` has used them.
    common: torch.Tensor | None = None

    def __init__(self, settings: ServerOptions) -> None:
        super().__init__(settings)
        # Set in `setup`; a strategy whose setup never ran (the model factory failed) closes without them.
        self.server: ServerClient | None = None
        self.owned_server: ServerHandle | None = None
        self.pending: Any = None  # the one background call in flight
        self.finished = False  # told the server this worker is done
        self.timeout_s = 5.0
        # What a resumed run's checkpoint kept (`restore`) or a switch carried in (`carry_in`), for `setup`.
        self.restored_version = 0
        self.restored_residuals: list[torch.Tensor | None] | None = None
        self.carried_optimizer_state: dict[str, Any] | None = None

    @classmethod
    def check_world(cls, settings: ServerOptions, world_size: int) -> None:
        if settings.shards > world_size:
            raise ConfigError("shards", settings.shards, f"at most {world_size}, the run's workers",
                              "Use fewer shards or more workers")

    def _start_server(self, context: TrainingContext) -> ServerHandle:
        """Rank 0 creates the shards from its current weights (equal on every rank at this point)."""
        job = context.job
        server_job = dataclasses.replace(job, momentum=0.0) if _momentum_on_workers(job, self.settings) else job
        return context.comm.start_parameter_server(context.run_id, context.addresses, self._start_weights(context),
                                      server_job, self.settings.shards,
                                      context.world_size, getattr(self.settings, "staleness_aware_lr", False),
                                      self._server_optimizer_state(), self.restored_version,
                                      self.settings.replies(), self.elastic)

    def setup(self, context: TrainingContext) -> None:
        # Started here rather than by the client, so a live switch can start one from the weights of the
        # moment; rank 0 keeps the references that keep the actors alive, the others get the handle.
        self.owned_server = self._start_server(context) if context.rank == 0 else None
        handle = context.comm.broadcast_object(self.owned_server)
        loop = context.comm.event_loop()
        self.server = ServerClient(handle, context.timeout_s, loop, context.abandoned)
        self.rank, self.world_size, self.timeout_s = context.rank, context.world_size, context.timeout_s
        self.parameters = list(context.model.parameters())
        self.numel = sum(p.numel() for p in self.parameters)
        # On a CUDA worker what goes to and comes from the server passes through pinned host memory.
        self.staging = HostStaging(self.numel, context.device)
        self.compressors = self._compressors()
        restored = self.restored_residuals
        if restored is not None and [r is None for r in restored] == [c.residual is None for c in self.compressors] \
                and all(r is None or r.numel() == c.residual.numel() for r, c in zip(restored, self.compressors)):
            for compressor, residual in zip(self.compressors, restored):
                compressor.residual = residual  # what earlier pushes had not sent yet
        # This worker's copy of the server's weights. A new server has no mirror of it: the first fetch
        # carries the weights in full; later ones, with compressed replies, only changes.
        self.known = KnownWeights(len(self.server.ranges))
        if not self._holds_the_start(context):
            self.known.apply(self.server.fetch(self.rank, full=True).weights)
            self._load(self.known.vector())
            self.common = None  # each worker now holds the server's weights, its own progress dropped
            # Every rank holds the start before any rank pushes: a rank quick off the mark would otherwise
            # push before a slower one fetched, which then starts from weights already moved, not the ones
            # the switch made (seen in the suite: average -> async, rank 1's first fetch came after rank
            # 0's first push, 12 ms into rank 0's steps, and started 0.2 off the average in its fingerprint).
            context.comm.barrier()
        self.pending: Call | None = None
        self.clock = 0  # windows sent
        self.steps_since_send = 0
        # The slowest worker's clock as last heard from the server; it only grows, so it is a safe
        # lower bound between replies.
        self.known_slowest_clock = 0
        # The server's version when this group started with it, and the newest one heard of since.
        self.start_version = self.known_version = self.restored_version

    def group_steps(self, version: int | None = None) -> float:
        """Steps each rank has made on average since `setup`, as the server counts them: every applied
        push is one rank's window of `_send_every()` steps (at `version`, or the newest one replied)."""
        version = self.known_version if version is None else version
        return max(0, version - self.start_version) * self._send_every() / self.world_size

    def _start_weights(self, context: TrainingContext) -> torch.Tensor:
        """What the server starts from: this worker's weights (equal on every rank but for a switch that
        carried each worker's own over a common base, `common`: then that base)."""
        return to_host(self.common if self.common is not None else flatten(list(context.model.parameters())))

    def _holds_the_start(self, context: TrainingContext) -> bool:
        """Whether this worker may skip the fetch that starts it: only elastic averaging's shards keep
        the weights they were made of as every worker's mirror, and only when every rank holds exactly
        rank 0's start weights (a few numbers gathered, against the whole model fetched over the link)."""
        if not self.elastic:
            return False
        prints = context.comm.all_gather_json(fingerprint(self._start_weights(context)))
        return all(other == prints[0] for other in prints)

    def _compressors(self) -> list[ErrorFeedback]:
        """One push compressor per shard, each keeping the residual of what its pushes did not send."""
        return [ErrorFeedback(self.settings.compression, stop - start, self.settings.topk_ratio,
                              self.settings.threshold_tau) for start, stop in self.server.ranges]

    def _encode(self, vector: torch.Tensor, copy: bool = True, slot: int = 0) -> tuple[list[Any], int]:
        # Encoded on the host: packets cross Dask, and compression state (residuals) lives with them.
        vector = self.staging.to_host(vector, slot)
        packets = [compressor.encode(part, copy) for compressor, part in zip(self.compressors, self.server.split(vector))]
        return packets, sum(packet.nbytes for packet in packets)

    def _load(self, vector: torch.Tensor) -> None:
        unflatten_into(self.staging.to_device(vector), [p.data for p in self.parameters])

    def _collect(self, block: bool) -> dict[str, Any]:
        """Take the in-flight call's replies if they are back (waiting for them when `block`)."""
        if self.pending is None or (not block and not self.pending.done()):
            return {}
        started = time.perf_counter()
        replies, round_trip_s = self.pending.result(self.timeout_s)
        exposed = time.perf_counter() - started
        self.pending = None
        reply = merge_replies(replies)
        self.known_slowest_clock = max(self.known_slowest_clock, reply.slowest_clock)
        self.known_version = max(self.known_version, reply.version)
        received = self._apply(reply)  # the compressed size, as it travelled
        return {"comm_s": exposed, "comm_total_s": round_trip_s, "staleness": reply.staleness,
                "server_version": reply.version, "clock_gap": reply.clock_gap, "bytes_received": received}

    def after_step(self, context: TrainingContext, step: int) -> dict[str, Any]:
        self.steps_since_send += 1
        report = self._collect(block=False)
        if self.steps_since_send >= self._send_every():
            report = _merge(report, self._collect(block=True))  # at most one call in flight
            report.update(self._send(context))
            self.steps_since_send = 0
            if not self.settings.overlap:
                report = _merge(report, self._collect(block=True))
        return report

    def _server_optimizer_state(self) -> dict[str, Any] | None:
        """The optimizer state a new server starts with (None: a fresh optimizer)."""
        return None

    def _send_every(self) -> int:
        """Steps between exchanges with the server."""
        raise NotImplementedError

    def _send(self, context: TrainingContext) -> dict[str, Any]:
        """Start this window's exchange (`self.pending`); returns the metrics of what was sent."""
        raise NotImplementedError

    def _apply(self, reply: Replies) -> int:
        """Use a reply on the local weights; returns the bytes it brought."""
        return 0

    def finish(self, context: TrainingContext) -> None:
        self._collect(block=True)
        self._flush(context)
        self._collect(block=True)
        self.finished = True
        self.server.finish(self.rank, self.world_size)
        self._load(self.server.weights())  # every worker ends with the server's (center's) weights

    def follow_timeout(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # the waits on the server's replies and on the slowest worker
        if self.server is not None:
            self.server.timeout_s = timeout_s

    def close(self) -> None:
        # A worker that failed still tells the server it is done, so the others are not held back by
        # the SSP bound or the end-of-run barrier until their timeout.
        if self.server is not None and not self.finished and not self.abandoned:
            self.finished = True
            try:
                self.server.announce_finished(self.rank)
            except Exception:
                pass  # the server may be gone too; the run is failing already
        # The loop calls close only after every rank has taken the final weights (a barrier).
        if self.owned_server is not None:
            self.owned_server.release()
            self.owned_server = None
        # Each actor call leaves a self-referencing closure in Dask (`Actor.__getattr__`) holding the actor
        # handle, which holds the actor's future: without a collection the shards would live on until the
        # worker's next cyclic garbage collection, which whoever drops the strategy runs (the loop as the
        # rank leaves, `switch_strategy` after a switch: one collection, 0.07-0.4 s, not two). A call still
        # in flight is let finish first (bounded): its closure is collectable only then. When the group was
        # ended, off the leaving path: the call's shard may be gone with a lost worker, and waiting for it
        # held every regroup back by half a second (measured); collected once it ends.
        pending, bound_s = self.pending, min(5.0, self.timeout_s)
        if pending is not None and self.abandoned:
            threading.Thread(target=_collect_after, args=(pending, bound_s), name="workbench-last-call",
                             daemon=True).start()
        elif pending is not None:
            _wait_quietly(pending, bound_s)
        if self.server is not None:  # this worker's claims on the shards, whoever still holds a handle
            let_go(self.server.actors)
        self.pending = self.server = pending = None

    def _flush(self, context: TrainingContext) -> None:
        """Send what is still unsent at the end of the run."""

    def checkpoint_state(self, context: TrainingContext, together: bool = True) -> tuple[Carried, dict[str, Any]]:
        # The server's (center's) weights and version; what this worker accumulated for its next push is
        # not part of it.
        self._collect(block=True)
        optimizer_state = self._checkpoint_optimizer_state(context, together)
        if self.rank != 0:
            return Carried(flatten(self.parameters), optimizer_state), {}
        version = self.server.stats()[0]["version"]
        return Carried(self.server.weights(), optimizer_state), {"server_version": version}

    def _checkpoint_optimizer_state(self, context: TrainingContext, together: bool) -> dict[str, Any]:
        """The job optimizer's state for a checkpoint: the workers' mean when `together` (collective),
        else this worker's own."""
        if together:
            return Strategy.carry_out(self, context).optimizer_state
        return flat_optimizer_state(context.optimizer)

    def rank_state(self) -> dict[str, Any]:
        return {"residuals": [None if c.residual is None else c.residual.clone() for c in self.compressors]}

    def restore(self, strategy_state: dict[str, Any], rank_state: dict[str, Any] | None) -> None:
        self.restored_version = int(strategy_state.get("server_version", 0))
        self.restored_residuals = (rank_state or {}).get("residuals")


def _wait_quietly(pending: Any, timeout_s: float) -> None:
    try:
        pending.result(timeout_s)
    except Exception:
        pass  # a lost shard, or a group being ended: nothing to wait for


def _collect_after(pending: Any, timeout_s: float) -> None:
    """Once a leaving rank's last call to the server has ended (or `timeout_s` passed): collect its closure."""
    _wait_quietly(pending, timeout_s)
    del pending
    gc.collect()


def _momentum_on_workers(job: Any, settings: ServerOptions) -> bool:
    """Sparsified pushes with SGD momentum keep the momentum on the workers, before compression.

    Server-side momentum would amplify each coordinate's delayed, accumulated residual when it is finally
    sent; DGC's momentum correction accumulates velocity on the worker instead.
    """
    return (isinstance(settings, AsyncSettings) and settings.compression in SPARSE_COMPRESSIONS
            and job.optimizer == "sgd" and job.momentum > 0)


def _views(flat: torch.Tensor, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-parameter views into one flat vector."""
    views, offset = [], 0
    for parameter in parameters:
        views.append(flat[offset:offset + parameter.numel()].view_as(parameter))
        offset += parameter.numel()
    return views


def _merge(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    merged = {**first, **second}
    for key in ("comm_s", "comm_total_s", "bytes_received"):
        if key in first and key in second:
            merged[key] = first[key] + second[key]
    return merged


class AsyncSGD(_ServerStrategy):
    name = "async"
    settings_class = AsyncSettings
    settings: AsyncSettings
    # Stale updates act like extra momentum (Mitliagkas et al. 2016: about 1 - 1/workers of it), and every
    # push is applied in full, so the explicit momentum is 0. Momentum 0.9 ended `digits` at chance; the
    # old 0.4 (lr 0.25) failed in the runs where the two workers fell into lockstep: 7 of 60 runs below 0.9
    # held-out accuracy after 5 epochs. Lr 0.3 without momentum, constant, was next: median 0.933, but its
    # last iterate is as noisy as its pushes (the held-out loss swung 0.18-0.35 between evaluations near
    # the end), and 2 of 100 runs ended at 0.8997, one of them in CI; a higher constant lr only widened the
    # swing (0.4: 3 of 100 below 0.9; 0.5: 2, down to 0.875). Annealed to zero, the last pushes settle it:
    # lr 0.5 on a cosine schedule, 0 of 100 below 0.919 (median 0.925), `ssp` 0 of 30 below 0.916, and
    # 0.961-0.964 after 40 epochs (6 runs); lr 0.3 annealed learned too little (median 0.905). Per push that
    # is 0.5 of its gradient at the start, against 1.0 of the averaged gradient per synchronous step (lr 0.1,
    # momentum 0.9), with about twice the pushes. tests/cluster/test_defaults.py holds it.
    traits = Traits(summary="Asynchronous parameter server (Downpour SGD): push gradients every `push_every` steps, "
                            "never wait for other workers. Fastest; updates are stale.",
                    suggested_lr=0.5, suggested_momentum=0.0, suggested_schedule="cosine")

    def setup(self, context: TrainingContext) -> None:
        super().setup(context)
        # Two accumulators used in turn: uncompressed pushes send one as it is (no copy) while the next
        # window accumulates into the other; it is free again once that push's reply is back.
        # On the worker's device: gradients are added every step, and staged to the host once a push.
        self.buffers = [torch.zeros(self.numel, device=context.device) for _ in range(2)]
        self.buffer_views = [_views(buffer, self.parameters) for buffer in self.buffers]
        self.accumulated, self.views = self.buffers[0], self.buffer_views[0]
        self.velocity = torch.zeros(self.numel, device=context.device) if self.worker_momentum else None
        self.velocity_views = _views(self.velocity, self.parameters) if self.worker_momentum else []
        carried = self.carried_optimizer_state or {}
        if self.worker_momentum and "momentum_buffer" in carried:
            self.velocity.copy_(carried["momentum_buffer"])
        self.steps_since_fetch = 0
        self.local_lr = context.optimizer.param_groups[0]["lr"]

    # The job's optimizer runs on the server here (or, for sparse pushes with SGD momentum, its momentum
    # on the workers): that is where optimizer state comes from and goes to at a switch.

    def carry_in(self, context: TrainingContext, carried: Carried) -> None:
        unflatten_into(carried.weights, [p.data for p in context.model.parameters()])
        self.carried_optimizer_state = carried.optimizer_state  # for the server (or the velocity)

    def _server_optimizer_state(self) -> dict[str, Any] | None:
        return None if self.worker_momentum else self.carried_optimizer_state

    def carry_out(self, context: TrainingContext, own_state: bool = False) -> Carried:
        # After `finish` every worker holds the server's weights; the job optimizer's state is the
        # server's (or the workers' mean velocity), never a worker's own.
        if self.worker_momentum:
            velocity = self.velocity.clone()
            context.comm.all_reduce_mean(velocity)  # every rank has a velocity of the same size
            return Carried(flatten(self.parameters), {"momentum_buffer": velocity})
        return Carried(flatten(self.parameters), self.server.optimizer_state())

    def _checkpoint_optimizer_state(self, context: TrainingContext, together: bool) -> dict[str, Any]:
        if self.worker_momentum:
            velocity = self.velocity.clone()
            if together:
                context.comm.all_reduce_mean(velocity)
            return {"momentum_buffer": velocity}
        return self.server.optimizer_state() if self.rank == 0 else {}

    def local_optimizer(self, job: Any, parameters: Any) -> torch.optim.Optimizer:
        # As in Downpour SGD, steps between fetches are plain SGD on the local copy; the job's optimizer
        # (momentum, Adam) runs once, on the server, so momentum is not applied twice.
        self.worker_momentum = job.momentum if _momentum_on_workers(job, self.settings) else 0.0
        return torch.optim.SGD(parameters, lr=job.lr)

    def after_backward(self, context: TrainingContext) -> dict[str, Any]:
        if self.worker_momentum:
            # Momentum correction (Lin et al. 2018, DGC): accumulate the velocity, not the gradient.
            for view, parameter in zip(self.velocity_views, self.parameters):
                if parameter.grad is not None:
                    view.mul_(self.worker_momentum).add_(parameter.grad)
            self.accumulated += self.velocity
            return {}
        for view, parameter in zip(self.views, self.parameters):
            if parameter.grad is not None:
                view.add_(parameter.grad)
        return {}

    def after_step(self, context: TrainingContext, step: int) -> dict[str, Any]:
        self.steps_since_fetch += 1
        self.local_lr = context.optimizer.param_groups[0]["lr"]
        return super().after_step(context, step)

    def _send_every(self) -> int:
        return self.settings.push_every

    def _send(self, context: TrainingContext) -> dict[str, Any]:
        fetch = self.steps_since_fetch >= (self.settings.fetch_every or self.settings.push_every)
        packets, sent = self._encode(self.accumulated, copy=False, slot=self._slot())
        self._swap_buffers()
        if self.worker_momentum:
            # Momentum factor masking (DGC): coordinates just sent restart their velocity, so a delayed
            # coordinate's stale momentum is not sent again.
            for part, packet in zip(self.server.split(self.velocity), packets):
                part[packet.indices.long().to(part.device)] = 0
        self.clock += 1
        if fetch:
            self.steps_since_fetch = 0
        lr = context.optimizer.param_groups[0]["lr"]
        self.pending = self.server.push(self.rank, packets, lr, self.clock, fetch)
        return {"bytes_sent": sent, "clock": self.clock}

    def _slot(self) -> int:
        """The staging slot of the buffer being sent: free again, like the buffer, once its reply is back."""
        return 0 if self.accumulated is self.buffers[0] else 1

    def _swap_buffers(self) -> None:
        # Called right after the previous call was collected, so the other buffer is no longer in flight.
        index = 1 if self.accumulated is self.buffers[0] else 0
        self.accumulated, self.views = self.buffers[index], self.buffer_views[index]
        self.accumulated.zero_()

    def _apply(self, reply: Replies) -> int:
        if reply.weights is None:
            return 0
        # Full weights, or the change since what this worker knew (the same change the server added to
        # its mirror of this worker): either way `known` is then the server's weights as far as sent.
        self.known.apply(reply.weights)
        self._load(self.known.vector())
        # The server's weights lack this window's steps, not pushed yet (with overlap, the reply to the
        # previous push arrives after the next step): keep them, as the local SGD steps had them, so
        # the next gradient is not computed on weights that are missing this worker's own latest work.
        for parameter, view in zip(self.parameters, self.views):
            parameter.data.add_(view, alpha=-self.local_lr)
        return reply.nbytes

    def _flush(self, context: TrainingContext) -> None:
        if self.steps_since_send:  # the last, partial window
            packets, _ = self._encode(self.accumulated, copy=False, slot=self._slot())
            self._swap_buffers()
            self.steps_since_send = 0
            self.pending = self.server.push(self.rank, packets, context.optimizer.param_groups[0]["lr"], None, False)


SSP_REFRESH_AFTER_S = 1e-3  # a worker held at the SSP bound longer than this fetches fresh weights


class StaleSynchronous(AsyncSGD):
    name = "ssp"
    settings_class = SSPSettings
    settings: SSPSettings
    traits = dataclasses.replace(
        AsyncSGD.traits, summary="Stale-synchronous parallel: as `async`, but a worker more than `max_staleness` "
                                 "clocks ahead of the slowest waits (0 = bulk-synchronous). Bounded staleness at "
                                 "some waiting.", paced_by_slowest=True)

    def _collect(self, block: bool) -> dict[str, Any]:
        # A push's receipt shows the gap before this worker's SSP check; the gap it trains at is the
        # one `_send` reports after the check.
        report = super()._collect(block)
        report.pop("clock_gap", None)
        return report

    def _send(self, context: TrainingContext) -> dict[str, Any]:
        report = super()._send(context)
        bound = self.settings.max_staleness
        if self.clock - self.known_slowest_clock <= bound:
            # Within the bound by what we already know: no round trip (the gap recorded is an upper bound).
            return {**report, "wait_s": 0.0, "clock_gap": self.clock - self.known_slowest_clock}
        reply = self.server.wait_for_clock(self.rank, self.clock, bound, context.interrupted)
        if reply["interrupted"]:
            # A pause, stop or switch: the loop handles it at the next step; the bound is checked again
            # at the next push.
            return {**report, "wait_s": reply["waited_s"], "clock_gap": self.clock - self.known_slowest_clock}
        self.known_slowest_clock = max(self.known_slowest_clock, reply["slowest_clock"])
        report = {**report, "wait_s": reply["waited_s"], "clock_gap": reply["clock_gap"]}
        if reply["blocked_s"] > SSP_REFRESH_AFTER_S:
            # The others pushed while this worker waited: train on from the server's weights of now, not
            # those its push's reply carries (as Petuum's SSP refreshes a stale cache after a wait).
            # (A change against this worker's mirror when replies are compressed; nothing is unpushed now.)
            report = _merge(report, self._collect(block=True))
            report = _merge(report, {"bytes_received": self._apply(self.server.fetch(self.rank))})
            self.steps_since_fetch = 0
        return report


class ElasticAveraging(_ServerStrategy):
    name = "easgd"
    settings_class = EASGDSettings
    settings: EASGDSettings
    elastic = True
    # takes_own_weights: from `average`, each worker's progress since the last average goes on with it.
    traits = Traits(summary="Elastic averaging SGD: workers keep their own weights and every `period` steps "
                            "exchange an elastic pull of strength `alpha` with a center variable on the server "
                            "(the final model).",
                    own_optimizer_states=True, takes_own_weights=True)

    def carry_in(self, context: TrainingContext, carried: Carried) -> None:
        super().carry_in(context, carried)
        self.common = carried.common

    def setup(self, context: TrainingContext) -> None:
        super().setup(context)
        # This worker's weights as the server knows them (see `replies.ElasticMirrors`): the weights the
        # server was made of (or, with own weights over a common base, that base: the first push then
        # carries the progress since, and the server's mirror becomes this worker's weights).
        self.mirror = self._start_weights(context).clone()
        self.common = None
        self.known = None  # elastic averaging fetches weights only to start

    def _compressors(self) -> list[ErrorFeedback]:
        return []  # see `_encode`

    def _encode(self, vector: torch.Tensor, copy: bool = True, slot: int = 0) -> tuple[list[Any], int]:
        # `vector` is on the host already (see `_send`). The mirror is the error feedback here: what a push
        # did not send stays in weights - mirror. A residual kept as well sends it twice: with top-k 10%
        # over 20 random updates (weights within +/-0.17) and then 20 pushes of nothing new,
        # |weights - mirror| grew to 19 instead of reaching 0 (tests/unit/test_replies.py).
        settings = self.settings
        packets = [encode(part, settings.compression, settings.topk_ratio, settings.threshold_tau, copy)
                   for part in self.server.split(vector)]
        return packets, sum(packet.nbytes for packet in packets)

    def rank_state(self) -> dict[str, Any]:
        return {}  # no residuals: the server's mirror of this worker starts afresh with the next server

    def _send_every(self) -> int:
        return self.settings.period

    def _send(self, context: TrainingContext) -> dict[str, Any]:
        # The mirror lives on the host, as the server's copy of it does: the weights come to it.
        packets, sent = self._encode(self.staging.to_host(flatten(self.parameters)) - self.mirror)
        for part, packet in zip(self.server.split(self.mirror), packets):
            add_decoded(part, packet)  # the same decoded update the server adds to its mirror
        self.clock += 1
        self.pending = self.server.elastic(self.rank, packets, self.settings.alpha, self.clock)
        return {"bytes_sent": sent, "clock": self.clock}

    def _apply(self, reply: Replies) -> int:
        # The pull, compressed when replies are: this worker and its mirror move by what was sent; the
        # rest stays in the distance to the center, which the next pull is computed from.
        # Decoded once: subtracting it equals the server's add_decoded(alpha=-1) bit for bit
        # (tests/unit/test_replies.py).
        pull = torch.cat([decode(packet) for packet in reply.pull])
        self.mirror -= pull
        for parameter, part in zip(self.parameters, _views(self.staging.to_device(pull), self.parameters)):
            parameter.data.sub_(part)
        return reply.nbytes
