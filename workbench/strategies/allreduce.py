"""`allreduce`: synchronous gradient all-reduce every step, bucketed and overlapped with backward (as DDP).

Gradients live as views into one flat buffer per bucket (DDP's `gradient_as_bucket_view`), so the
all-reduce works on them in place with no copies. Each bucket's all-reduce starts from a
post-accumulate-grad hook as soon as its last gradient is ready, so communication of late layers
overlaps the backward pass of early ones; `after_backward` waits for what is still in flight, and that
wait is the communication time the step actually pays.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from .. import collectives
from ..averaging import assign_buckets
from .base import Strategy, StrategySettings, TrainingContext, check_positive_number


@dataclasses.dataclass
class AllReduceSettings(StrategySettings):
    bucket_mb: float = 4.0
    """Size cap of one all-reduce bucket in MB: smaller overlaps more, larger has less per-call cost."""

    def validate(self) -> None:
        check_positive_number("bucket_mb", self.bucket_mb)


class _Bucket:
    def __init__(self, parameters: list[torch.nn.Parameter]) -> None:
        self.parameters = parameters
        self.buffer = torch.zeros(sum(p.numel() for p in parameters), dtype=parameters[0].dtype,
                                  device=parameters[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for parameter in parameters:
            self.views.append(self.buffer[offset : offset + parameter.numel()].view_as(parameter))
            offset += parameter.numel()
        self.ready = 0
        self.work: Any = None

    def attach_gradients(self) -> None:
        """Make each parameter's gradient the bucket's view again (autograd may have replaced it)."""
        for parameter, view in zip(self.parameters, self.views):
            if parameter.grad is None or parameter.grad.data_ptr() != view.data_ptr():
                if parameter.grad is not None:
                    view.copy_(parameter.grad)
                else:
                    view.zero_()
                parameter.grad = view


class AllReduce(Strategy):
    name = "allreduce"
    settings_class = AllReduceSettings
    uses_process_group = True
    keeps_gradient_buffers = True
    summary = "Synchronous: gradients averaged every step (like PyTorch DDP). Exact, chatty."

    def setup(self, context: TrainingContext) -> None:
        self.world_size = context.world_size
        self.buckets: list[_Bucket] = []
        self.hooks: list[Any] = []
        # Every rank starts from rank 0's weights, whatever the factory's randomness did.
        collectives.broadcast_tensors(list(context.model.state_dict().values()))
        if self.world_size == 1:
            self.keeps_gradient_buffers = False  # nothing to exchange: plain gradients, as one process
            return
        parameters = [p for p in context.model.parameters() if p.requires_grad]
        cap = int(self.settings.bucket_mb * 1024 * 1024)
        groups = assign_buckets([p.numel() * p.element_size() for p in parameters], cap)
        self.buckets = [_Bucket([parameters[i] for i in group]) for group in groups]
        for bucket in self.buckets:
            bucket.attach_gradients()
            for parameter in bucket.parameters:
                self.hooks.append(parameter.register_post_accumulate_grad_hook(self._hook_for(bucket)))

    def _hook_for(self, bucket: _Bucket):
        def on_gradient_ready(_parameter: torch.Tensor) -> None:
            bucket.ready += 1
            if bucket.ready == len(bucket.parameters):
                self._launch(bucket)

        return on_gradient_ready

    def _launch(self, bucket: _Bucket) -> None:
        bucket.attach_gradients()
        bucket.work = collectives.start_all_reduce(bucket.buffer)

    def after_backward(self, context: TrainingContext) -> dict[str, Any]:
        if not self.buckets:
            return {}
        started = time.perf_counter()
        for bucket in self.buckets:
            if bucket.work is None:  # some parameter got no gradient this step: its zeros still count
                self._launch(bucket)
        for bucket in self.buckets:
            collectives.wait(bucket.work)
            bucket.buffer.div_(self.world_size)
            bucket.ready, bucket.work = 0, None
        return {"comm_s": time.perf_counter() - started}

    def close(self) -> None:
        for hook in getattr(self, "hooks", []):  # none when setup never ran (the model factory failed)
            hook.remove()
        self.hooks = []
