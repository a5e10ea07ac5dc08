"""`allreduce`: synchronous gradient all-reduce every step, bucketed and overlapped with backward (as DDP).

Each bucket's all-reduce starts from a post-accumulate-grad hook as soon as its last gradient is ready,
so communication of late layers overlaps the backward pass of early ones. `after_backward` waits for
what is still in flight; that wait is the communication time the step actually pays.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from .. import collectives
from ..averaging import assign_buckets, flatten, unflatten_into
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
        self.ready = 0
        self.vector: torch.Tensor | None = None
        self.work: Any = None


class AllReduce(Strategy):
    name = "allreduce"
    settings_class = AllReduceSettings
    uses_process_group = True
    summary = "Synchronous: gradients averaged every step (like PyTorch DDP). Exact, chatty."

    def setup(self, context: TrainingContext) -> None:
        self.world_size = context.world_size
        parameters = [p for p in context.model.parameters() if p.requires_grad]
        # Every rank starts from rank 0's weights, whatever the factory's randomness did.
        collectives.broadcast_tensors(list(context.model.state_dict().values()))
        cap = int(self.settings.bucket_mb * 1024 * 1024)
        groups = assign_buckets([p.numel() * p.element_size() for p in parameters], cap)
        self.buckets = [_Bucket([parameters[i] for i in group]) for group in groups]
        self.hooks = []
        for bucket in self.buckets:
            for parameter in bucket.parameters:
                self.hooks.append(parameter.register_post_accumulate_grad_hook(self._hook_for(bucket)))

    def _hook_for(self, bucket: _Bucket):
        def on_gradient_ready(_parameter: torch.Tensor) -> None:
            bucket.ready += 1
            if bucket.ready == len(bucket.parameters):
                self._launch(bucket)

        return on_gradient_ready

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.parameters]
        bucket.vector = flatten(grads)
        bucket.work = collectives.start_all_reduce(bucket.vector)

    def after_backward(self, context: TrainingContext) -> dict[str, Any]:
        started = time.perf_counter()
        for bucket in self.buckets:
            if bucket.work is None:  # some parameter got no gradient this step: send zeros for it
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            bucket.vector.div_(self.world_size)
            for parameter in bucket.parameters:
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
            unflatten_into(bucket.vector, [p.grad for p in bucket.parameters])
            bucket.ready, bucket.vector, bucket.work = 0, None, None
        return {"comm_s": time.perf_counter() - started}

    def close(self) -> None:
        for hook in getattr(self, "hooks", []):
            hook.remove()
        self.hooks = []
