"""Held-out evaluation of a model: the loss, and what fits the task: accuracy for a classifier; for a
sequence model (scores per position, classes last) bits per character and next-token accuracy."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from workbench.data import Batches


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Batches, loss_fn: Callable[..., torch.Tensor],
             device: torch.device | str = "cpu", batch_size: int = 1024) -> dict[str, Any]:
    """Mean loss over `data`, plus `accuracy` when outputs are class scores and targets class labels, or
    `bits_per_char` and `token_accuracy` when they are a sequence's (batch, length, classes) scores."""
    was_training = model.training
    model.eval()
    total_loss, correct, count, predicted = 0.0, 0, 0, 0
    kind = None
    try:
        for start in range(0, len(data), batch_size):
            indices = torch.arange(start, min(start + batch_size, len(data)))
            inputs, targets = data.batch(indices)
            inputs, targets = inputs.to(device), targets.to(device)
            outputs = model(inputs)
            total_loss += float(loss_fn(outputs, targets)) * len(indices)
            kind = kind or task_kind(outputs, targets)
            if kind == "classification":
                correct += int((outputs.argmax(dim=1) == targets).sum())
                predicted += len(indices)
            elif kind == "sequence":
                correct += int((outputs.argmax(dim=-1) == targets).sum())
                predicted += targets.numel()
            count += len(indices)
    finally:
        model.train(was_training)
    result: dict[str, Any] = {"loss": total_loss / max(count, 1), "samples": count}
    if kind == "classification" and predicted:
        result["accuracy"] = correct / predicted
    elif kind == "sequence" and predicted:
        # The loss is in nats per token; a token is a byte (a character of ASCII text).
        result["bits_per_char"] = result["loss"] / math.log(2)
        result["token_accuracy"] = correct / predicted
    return result


def sequence_scores(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether `outputs` are a sequence model's scores for `targets`: (batch, length, ..., classes) against
    (batch, length, ...), classes last, as every language model gives them. The batch is not compared:
    `targets` may be a whole dataset's and `outputs` one batch's."""
    return outputs.dim() >= 3 and outputs.dim() == targets.dim() + 1 and outputs.shape[1:-1] == targets.shape[1:]


def task_kind(outputs: torch.Tensor, targets: torch.Tensor) -> str | None:
    """'classification' for (batch, classes) scores and class labels, 'sequence' for (batch, length, classes)
    scores and (batch, length) labels, else None (regression, or something else)."""
    if targets.is_floating_point():
        return None
    if outputs.dim() == 2 and targets.dim() == 1:
        return "classification"
    return "sequence" if sequence_scores(outputs, targets) else None


def held_out_text(result: dict[str, Any]) -> str:
    """One line for an evaluation, as the notebook panel says it under its plots."""
    parts = [f"held-out loss {result['loss']:.4f}"]
    if result.get("accuracy") is not None:
        parts.append(f"accuracy {result['accuracy']:.4f}")
    if result.get("bits_per_char") is not None:
        parts.append(f"{result['bits_per_char']:.3f} bits/char")
    if result.get("token_accuracy") is not None:
        parts.append(f"next-token accuracy {result['token_accuracy']:.4f}")
    step = f" at step {result['step']}" if result.get("step") is not None else ""
    return ", ".join(parts) + step
