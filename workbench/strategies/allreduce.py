"""`allreduce`: synchronous gradient all-reduce every step, bucketed and overlapped with backward (as DDP).

Each bucket is one flat buffer; a parameter's gradient, as autograd hands it over, is copied into its
view of the buffer already divided by the world size (one pass over the memory, as DDP's reducer does
with `mul_out`), and the view becomes the parameter's gradient (DDP's `gradient_as_bucket_view`), so the
summed result needs no copy back and no division. Gradients are set to None between steps: zeroing kept
buffers and letting autograd add into them cost three more passes a step. Each bucket's all-reduce starts
from a post-accumulate-grad hook as soon as its last gradient is ready, so communication of late layers
overlaps the backward pass of early ones; `after_backward` waits for what is still in flight, and that
wait is the communication time the step actually pays. Each bucket is a channel of its own
(`Transport.start_all_reduce`): with every worker on one machine its sum goes through shared memory
(`comm/shared_memory.py`), not gloo's loopback sockets; across hosts, on a thin link, it goes coded
(`comm/coded_sum.py`): the same floats, bit for bit, for about 0.84 of the bytes, which is what puts
`allreduce` ahead of DDP where both are bound by the link (DDP sends gloo's raw floats).

`wire_dtype` fp16/bf16 (live) puts each bucket on the wire in half precision, as PyTorch DDP's
`fp16_compress_hook`/`bf16_compress_hook` do: divided by the world size first (so the sum cannot
overflow fp16), cast into a half-precision wire buffer, summed, cast back into the gradients. gloo on
CPU sums float16 and bfloat16 natively (checked with torch 2.13), so no all-gather workaround is needed.
`bytes_sent` per step is what a ring all-reduce of the buckets sends per worker (half with fp16/bf16), or
for a bucket coded across a thin link (`comm/connections.py`), the coded bytes it sent.

`balance` (live) cuts each step's global batch in proportion to the workers' measured speeds
(`strategies/balance.py`) and weights each rank's gradients by its share: on mixed hardware no worker
waits for a slower one, and each update is still the one a single process would make on the global batch.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from workbench.checks import check_positive_int, check_positive_number
from workbench.comm.averaging import WIRE_DTYPES, all_reduce_bytes_sent, assign_buckets, clamp_for_wire
from workbench.errors import ConfigError
from workbench.strategies.balance import BatchBalance
from workbench.strategies.base import Strategy, StrategySettings, TrainingContext, Traits, check_wire_dtype


# The first bucket's cap, as PyTorch DDP's (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`): its all-reduce
# starts early in backward. Under a 4 MB cap the GPT of the fidelity benchmark (3.4 MB) was one bucket,
# whose all-reduce waited for the whole backward.
FIRST_BUCKET_BYTES = 1024 * 1024


@dataclasses.dataclass
class AllReduceSettings(StrategySettings):
    live = ("wire_dtype", "balance", "rebalance_every")

    bucket_mb: float = 25.0
    """Size at which an all-reduce bucket closes, in MB, after the first (1 MB), as DDP's `bucket_cap_mb`
    and cut as DDP cuts them (`assign_buckets`): smaller overlaps more of the exchange with backward,
    larger pays gloo's per-call cost fewer times. 25, DDP's own: on the lab's host at half a core, the
    benchmark MLP in four buckets (1 MB caps, each closed before it overflowed) kept `allreduce` at
    0.91-0.93 of DDP; in DDP's two it ran at 0.94 and 1.04 of DDP there and 1.00 at 1 Gbit/s
    (exploratory runs, 2026-12-05)."""
    wire_dtype: str = "float32"
    """What the gradients travel as: 'float32' (exact), 'fp16' or 'bf16' (half the bytes)."""
    balance: bool = False
    """Share each step's global batch out by the workers' measured speeds (mixed hardware): the same update."""
    rebalance_every: int = 10
    """With balance: steps between two measurements of the workers' speeds and a new cut of the batch."""

    def validate(self) -> None:
        check_positive_number("bucket_mb", self.bucket_mb)
        check_wire_dtype("wire_dtype", self.wire_dtype)
        if not isinstance(self.balance, bool):
            raise ConfigError("balance", self.balance, "True or False")
        check_positive_int("rebalance_every", self.rebalance_every)


class _Bucket:
    def __init__(self, parameters: list[torch.nn.Parameter], channel: int) -> None:
        self.parameters = parameters
        self.channel = channel  # its all-reduce's identity, the same on every rank (`Transport.start_all_reduce`)
        self.buffer = torch.zeros(sum(p.numel() for p in parameters), dtype=parameters[0].dtype,
                                  device=parameters[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for parameter in parameters:
            self.views.append(self.buffer[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()
        self.filled = [False] * len(parameters)  # which gradients this step holds already
        self.ready = 0
        self.work: Any = None
        self.in_flight: torch.Tensor | None = None  # what the all-reduce sums: the buffer or the wire copy
        self.wire: torch.Tensor | None = None  # the half-precision copy in flight, when not float32

    def wire_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The bucket's wire buffer in `dtype`, made once per dtype (the dtype may change live)."""
        if self.wire is None or self.wire.dtype != dtype:
            self.wire = torch.empty(self.buffer.numel(), dtype=dtype, device=self.buffer.device)
        return self.wire

    def take_gradient(self, index: int, factor: float) -> None:
        """Parameter `index`'s fresh gradient, times `factor`, into its view; the view becomes its gradient."""
        parameter, view = self.parameters[index], self.views[index]
        if parameter.grad is None:
            view.zero_()
        else:  # one pass: copied and scaled (in place where autograd wrote into the view itself)
            torch.mul(parameter.grad, factor, out=view)
        parameter.grad = view
        self.filled[index] = True

    def fill_missing(self, factor: float) -> None:
        """Parameters that got no gradient this step: their zeros still count in the sum."""
        for index, filled in enumerate(self.filled):
            if not filled:
                self.take_gradient(index, factor)


class AllReduce(Strategy):
    name = "allreduce"
    settings_class = AllReduceSettings
    traits = Traits(summary="Synchronous: gradients averaged every step (like PyTorch DDP). Exact, chatty.",
                    uses_process_group=True, paced_by_slowest=True)

    def __init__(self, settings: AllReduceSettings) -> None:
        super().__init__(settings)
        self.buckets: list[_Bucket] = []
        self.hooks: list[Any] = []  # none until `setup` (and none at all when the model factory failed)
        self.balance: BatchBalance | None = None  # the cut of the global batch, with more than one worker
        self.launched: float | None = None  # when this step's first bucket went on the wire
        self.exchange_s = 0.0

    def setup(self, context: TrainingContext) -> None:
        self.world_size = context.world_size
        self.bytes_sent = 0
        # Every rank starts from rank 0's weights, whatever the factory's randomness did.
        self.comm = context.comm
        self.comm.broadcast_tensors(list(context.model.state_dict().values()))
        if self.world_size == 1:
            return  # nothing to exchange: plain gradients, as one process
        if context.global_batches:
            self.balance = BatchBalance(context.rank, self.world_size, context.job.batch_size,
                                        self.settings.rebalance_every)
        parameters = [p for p in context.model.parameters() if p.requires_grad]
        cap = int(self.settings.bucket_mb * 1024 * 1024)
        groups = assign_buckets([p.numel() * p.element_size() for p in parameters], cap, FIRST_BUCKET_BYTES)
        self.buckets = [_Bucket([parameters[i] for i in group], channel) for channel, group in enumerate(groups)]
        for bucket in self.buckets:
            for index, parameter in enumerate(bucket.parameters):
                self.hooks.append(parameter.register_post_accumulate_grad_hook(self._hook_for(bucket, index)))

    def _hook_for(self, bucket: _Bucket, index: int):
        def on_gradient_ready(_parameter: torch.Tensor) -> None:
            bucket.take_gradient(index, self._factor())
            bucket.ready += 1
            if bucket.ready == len(bucket.parameters):
                self._launch(bucket)

        return on_gradient_ready

    def _factor(self) -> float:
        """What this rank's gradients are multiplied by before the sum: 1 / world size, or balanced, the rank's
        share of the step's samples (the shares summing to one)."""
        return self.balance.weight if self._balancing() else 1.0 / self.world_size

    def _balancing(self) -> bool:
        return self.balance is not None and self.settings.balance

    def batch_share(self, context: TrainingContext) -> tuple[int, int] | None:
        return self.balance.share() if self._balancing() else None

    def _launch(self, bucket: _Bucket) -> None:
        bucket.fill_missing(self._factor())
        dtype = WIRE_DTYPES[self.settings.wire_dtype]
        if dtype == torch.float32:
            bucket.in_flight = bucket.buffer
        else:  # already scaled: what the sum of world_size of them needs to fit, then the cast
            bucket.in_flight = bucket.wire_buffer(dtype).copy_(clamp_for_wire(bucket.buffer, dtype, self.world_size))
        bucket.work = self.comm.start_all_reduce(bucket.in_flight, channel=bucket.channel)
        if self.launched is None:  # the step's exchange starts with its first bucket
            self.launched = time.perf_counter()

    def after_backward(self, context: TrainingContext) -> dict[str, Any]:
        if not self.buckets:
            return {}
        started = time.perf_counter()
        balancing = self._balancing()
        if balancing:
            self.balance.computed()  # this step's compute ends here; what follows is the exchange
        for bucket in self.buckets:
            if bucket.work is None:  # some parameter got no gradient this step: its zeros still count
                self._launch(bucket)
        ring, coded = 0, 0
        for bucket in self.buckets:
            self.comm.wait(bucket.work)
            if bucket.in_flight is not bucket.buffer:  # the sum came back in the wire's dtype
                bucket.buffer.copy_(bucket.in_flight)
            if hasattr(bucket.work, "bytes_sent"):  # coded across a thin link: what it sent (`comm/coded_sum.py`)
                coded += bucket.work.bytes_sent
            else:
                ring += bucket.in_flight.numel() * bucket.in_flight.element_size()
            bucket.ready, bucket.work, bucket.filled = 0, None, [False] * len(bucket.parameters)
        self.bytes_sent = all_reduce_bytes_sent(ring, self.world_size) + coded
        # The whole exchange, hidden part included: what a peer may have to wait for (plane/deadline.py).
        self.exchange_s, self.launched = time.perf_counter() - (self.launched or started), None
        return {"comm_s": time.perf_counter() - started}

    def after_step(self, context: TrainingContext, step: int) -> dict[str, Any]:
        # Reported here: the loop records the strategy's own fields from `after_step` only.
        if not self.buckets:
            return {}
        if self._balancing():
            started = time.perf_counter()
            if self.balance.due:
                self.balance.rebalance(self.comm)
            return {"bytes_sent": self.bytes_sent, "exchange_s": self.exchange_s, "comm_s": time.perf_counter() - started}
        return {"bytes_sent": self.bytes_sent, "exchange_s": self.exchange_s}

    def step_timed(self, context: TrainingContext, own_s: float) -> None:
        if self._balancing():
            self.balance.timed(own_s)

    def update_settings(self, changes: dict[str, Any]) -> None:
        super().update_settings(changes)
        if self.balance is not None:
            self.balance.follow(self.settings)

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
