"""Data checked against the model and the loss on the client, before anything starts.

What would otherwise surface on a worker as a raw `IndexError` or `mat1 and mat2 ...` at step 0, or as a
divergence blamed on the learning rate, is refused here with a `ConfigError` naming the data and the
offending values: no samples, non-finite values, labels outside the model's outputs, inputs the model
cannot take (dtype, width), targets the loss cannot take. In-memory tensors are checked whole (values and
labels); a `Dataset` or Dask arrays by one batch, which is as much as can be read cheaply on the client.
"""
from __future__ import annotations

from typing import Any, Callable

import cloudpickle
import torch
from torch import nn

from workbench.data import BuiltinData, DaskArrayData, DatasetData, TensorData, _as_tensor
from workbench.errors import ConfigError
from workbench.evaluation import sequence_scores
from workbench.text import VOCABULARY, TextWindows

CLASS_INDEX_LOSSES = ("cross_entropy", "nll")  # losses whose targets are class indices


def check_data(parameter: str, source: Any, model: nn.Module, loss_name: Any,
               loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch_size: int) -> None:
    """Raise `ConfigError` naming `parameter` if `source` cannot train `model` under `loss`."""
    if isinstance(source, BuiltinData):  # generated here as on the workers (cached): its values are sound
        source = source.load()
    # User objects with state (a dataset counting its reads, a loss counting its calls) are tried as copies,
    # made as the workers will receive them: the check must not change what the workers get.
    if isinstance(source, DatasetData):
        source = DatasetData(_copy(parameter, source.dataset, "dataset"))
    loss = _copy("loss", loss, "loss")
    length = len(source)
    if length == 0:
        raise ConfigError(parameter, "a dataset of 0 samples", "at least one sample",
                          "The data is empty: check how it was loaded or filtered")
    if isinstance(source, TextWindows):
        _check_text(parameter, source, model, batch_size)
    inputs, targets = _first_batch(parameter, source, min(batch_size, length))
    if isinstance(source, TensorData):  # whole tensors are at hand: check every value
        _check_finite(parameter, "inputs", source.inputs)
        _check_finite(parameter, "targets", source.targets)
    else:
        _check_finite(parameter, "inputs", inputs, "in the first batch")
        _check_finite(parameter, "targets", targets, "in the first batch")
    outputs = _forward(parameter, model, inputs)
    if loss_name in CLASS_INDEX_LOSSES:
        _check_class_targets(parameter, loss_name, source.targets if isinstance(source, TensorData) else targets,
                             outputs)
    try:
        value = loss(outputs, targets)
    except Exception as error:
        raised = f"{type(error).__name__}: {_first_line(error)}"
        if not isinstance(loss_name, str):  # the user's own loss: it, or the data, may be at fault
            raise ConfigError("loss", loss_name, "a loss that takes the model's outputs and the data's targets",
                              f"On one batch (outputs {_tensor(outputs)}, targets {_tensor(targets)}) it raised "
                              f"{raised}") from None
        raise ConfigError(parameter, _describe(inputs, targets), f"targets the loss {_name(loss_name)} can take",
                          f"On one batch it raised {raised}") from None
    if not torch.is_tensor(value) or value.numel() != 1:
        raise ConfigError("loss", loss_name, "a function returning a scalar tensor",
                          f"On one batch it returned {type(value).__name__}"
                          + (f" of shape {tuple(value.shape)}" if torch.is_tensor(value) else ""))


def _copy(parameter: str, value: Any, what: str) -> Any:
    try:
        return cloudpickle.loads(cloudpickle.dumps(value))
    except Exception as error:
        raise ConfigError(parameter, value, f"a picklable {what}",
                          f"Workers receive it pickled; pickling failed with {type(error).__name__}: {error}") from None


def _first_batch(parameter: str, source: Any, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(source, DaskArrayData):
        return _as_tensor(source.inputs[:size].compute()), _as_tensor(source.targets[:size].compute())
    if isinstance(source, DatasetData):
        try:
            return source.batch(torch.arange(size))
        except Exception as error:
            raise ConfigError(parameter, source.dataset, "a Dataset whose items are (input, target) pairs",
                              f"Reading its first {size} items raised {type(error).__name__}: "
                              f"{_first_line(error)}") from None
    return source.batch(torch.arange(size))


def _check_finite(parameter: str, what: str, values: torch.Tensor, where: str = "") -> None:
    if not values.is_floating_point():
        return
    bad = ~torch.isfinite(values)
    if bad.any():
        per_sample = bad.reshape(len(values), -1)
        rows = per_sample.any(dim=1).nonzero().flatten()
        first = int(rows[0])
        position = int(per_sample[first].nonzero()[0])
        raise ConfigError(parameter, f"{what} with {int(bad.sum())} NaN or infinite values {where}".strip(),
                          f"finite {what}",
                          f"The first is {values[first].flatten()[position].item()} at sample {first}, position "
                          f"{position}; {len(rows)} samples have some: clean or drop them before training")


def _forward(parameter: str, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    parameters = [p for p in model.parameters() if p.is_floating_point()]
    try:
        with torch.no_grad():
            outputs = model(inputs)
    except Exception as error:
        hint = f"On one batch ({_tensor(inputs)}) the model raised {type(error).__name__}: {_first_line(error)}"
        width = _first_linear_width(model)
        if width is not None and inputs.dim() >= 2 and inputs.shape[-1] != width:
            hint += f". The inputs have {inputs.shape[-1]} features; the model's first layer takes {width}"
        elif parameters and not inputs.is_floating_point():
            hint += f". The inputs are {inputs.dtype}; the model's weights are {parameters[0].dtype}: convert them " \
                    "(inputs.float())"
        raise ConfigError(parameter, _tensor(inputs), "inputs the model can take", hint) from None
    if not torch.is_tensor(outputs):
        raise ConfigError("model", model.__class__.__name__, "a model returning a tensor",
                          f"On one batch it returned {type(outputs).__name__}")
    return outputs


def _check_class_targets(parameter: str, loss_name: str, targets: torch.Tensor, outputs: torch.Tensor) -> None:
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ConfigError(parameter, f"targets of dtype {targets.dtype}",
                          f"class indices (an integer dtype) for the loss {loss_name!r}",
                          "Convert them (targets.long()), or use loss='mse' for regression")
    if outputs.dim() < 2:
        raise ConfigError("model", f"outputs of shape {tuple(outputs.shape)}",
                          f"one score per class (shape (batch, classes)) for the loss {loss_name!r}")
    # A sequence model's scores come classes last, one row per position (see job.cross_entropy).
    classes = outputs.shape[-1] if sequence_scores(outputs, targets) else outputs.shape[1]
    low, high = int(targets.min()), int(targets.max())
    if low < 0 or high >= classes:
        offending = targets[(targets < 0) | (targets >= classes)]
        raise ConfigError(parameter, f"labels from {low} to {high}",
                          f"labels 0..{classes - 1}: the model has {classes} outputs",
                          f"{len(offending)} labels are outside, e.g. {sorted(set(offending[:5].tolist()))}: "
                          "give the model as many outputs as there are classes, or fix the labels")


def _check_text(parameter: str, source: TextWindows, model: nn.Module, batch_size: int) -> None:
    """Windows of text against a language model: a context within its positions, bytes within its
    vocabulary, and at least one batch of windows."""
    positions = getattr(model, "positions", None)
    if positions is not None and source.context > positions:
        raise ConfigError("context", source.context, f"at most {positions}, the model's positions",
                          "Give the dataset a shorter context (stdlib_text(context=...), --context) or the model "
                          "more positions (a larger size)")
    vocabulary = getattr(model, "vocabulary", None)
    if vocabulary is not None and vocabulary < VOCABULARY:
        raise ConfigError("model", f"a vocabulary of {vocabulary}", f"a vocabulary of at least {VOCABULARY}",
                          "The text is read as bytes: build the model with vocabulary=256")
    if parameter == "data" and len(source) < batch_size:
        raise ConfigError(parameter, f"{len(source)} windows of {source.context} bytes",
                          f"at least one batch of windows (batch_size={batch_size})",
                          "Give more text (a larger limit_bytes), a shorter context or a smaller batch")


def _first_linear_width(model: nn.Module) -> int | None:
    for module in model.modules():
        if isinstance(module, nn.Linear):
            return module.in_features
        if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.RNNBase)):
            return None  # their inputs' last dimension is not a feature width
    return None


def _describe(inputs: torch.Tensor, targets: torch.Tensor) -> str:
    return f"inputs {_tensor(inputs)}, targets {_tensor(targets)}"


def _tensor(values: torch.Tensor) -> str:
    return f"{values.dtype} of shape {tuple(values.shape)}"


def _name(loss_name: Any) -> str:
    return repr(loss_name) if isinstance(loss_name, str) else getattr(loss_name, "__name__", "given")


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__
