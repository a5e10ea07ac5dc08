"""Held-out evaluation of a model: loss, and accuracy when the task is classification."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .data import Batches


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Batches, loss_fn: Callable[..., torch.Tensor],
             device: torch.device | str = "cpu", batch_size: int = 1024) -> dict[str, Any]:
    """Mean loss over `data`, plus `accuracy` when outputs are class scores and targets class labels."""
    was_training = model.training
    model.eval()
    total_loss, correct, count, classification = 0.0, 0, 0, True
    try:
        for start in range(0, len(data), batch_size):
            indices = torch.arange(start, min(start + batch_size, len(data)))
            inputs, targets = data.batch(indices)
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = model(inputs)
            total_loss += float(loss_fn(outputs, targets)) * len(indices)
            classification = classification and outputs.dim() == 2 and not targets.is_floating_point()
            if classification:
                correct += int((outputs.argmax(dim=1) == targets).sum())
            count += len(indices)
    finally:
        model.train(was_training)
    result: dict[str, Any] = {"loss": total_loss / max(count, 1), "samples": count}
    if classification and count:
        result["accuracy"] = correct / count
    return result
