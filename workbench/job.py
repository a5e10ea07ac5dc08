"""The typed job description and its client-side validation.

A `Job` says what to train (model factory, data, loss, optimizer) and how long; the strategy and the
cluster are chosen when the job is started. `Job.prepare()` checks every field on the client and returns
the normalised pieces the workers need, so a bad value fails at once with a message naming it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import cloudpickle
import torch
from torch import nn

from workbench.checks import check_number
from workbench.data import DataSource, Splits, as_source, resolve_dataset
from workbench.datacheck import check_data
from workbench.errors import ConfigError
from workbench.evaluation import sequence_scores
from workbench.schedule import SCHEDULES


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over class scores: torch's own for (batch, classes, ...) scores; for a sequence model's
    (batch, length, classes) scores against (batch, length) targets (classes last, as every language model
    gives them), over every position. (Scores in torch's layout whose second dimension equals the targets'
    last would read as a sequence's: give such a model its own loss function.)"""
    if sequence_scores(outputs, targets):
        return nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))
    return nn.functional.cross_entropy(outputs, targets)


LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "cross_entropy": cross_entropy,
    "mse": nn.functional.mse_loss,
    "nll": nn.functional.nll_loss,
}
OPTIMIZERS = ("sgd", "adam", "adamw")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("float32", "bf16")


@dataclasses.dataclass
class Job:
    """One data-parallel training job. Field docs double as labels in the UI and help in the CLI."""

    model: Callable[[], nn.Module]
    """Factory returning a fresh model; called once on every worker (and once on the client to check it)."""
    data: Any
    """Training data: a torch Dataset, (inputs, targets) tensors/NumPy/Dask arrays, or a dataset name."""
    loss: str | Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = "cross_entropy"
    """Loss: 'cross_entropy', 'mse', 'nll' or a function (outputs, targets) -> scalar tensor."""
    optimizer: str | Callable[..., torch.optim.Optimizer] = "sgd"
    """Optimizer: 'sgd', 'adam', 'adamw' or a function (parameters, lr) -> optimizer."""
    momentum: float = 0.0
    """Momentum for 'sgd'."""
    batch_size: int = 32
    """Samples per step on each worker."""
    epochs: int | None = None
    """Passes over each worker's shard (1 when neither this nor `steps` is given)."""
    steps: int | None = None
    """Total optimizer steps per worker, instead of `epochs`."""
    lr: float = 0.01
    """Learning rate (changeable while running)."""
    seed: int = 0
    """Seed for model initialisation and data shuffling."""
    eval_data: Any = None
    """Held-out data in any accepted form; defaults to the dataset's own held-out split."""
    eval_every: int | None = None
    """Steps between held-out evaluations on worker 0; None evaluates at the end of every epoch."""
    device: str = "auto"
    """'cpu', 'cuda', or 'auto' (CUDA where the worker has a GPU)."""
    precision: str = "float32"
    """'float32', or 'bf16': forward pass and loss under bfloat16 autocast (weights, gradients, optimizer float32)."""
    lr_schedule: str = "constant"
    """'constant', or 'cosine': decay to `min_lr_fraction` of the learning rate at the last step (after warm-up)."""
    warmup_steps: int = 0
    """Steps of linear learning-rate warm-up at the start."""
    min_lr_fraction: float = 0.1
    """Where 'cosine' ends, as a share of the learning rate."""
    compile: bool = False
    """Compile the model's forward pass with torch.compile on every worker."""

    def prepare(self) -> PreparedJob:
        """Validate every field on the client; return the normalised job or raise `ConfigError`."""
        if not callable(self.model):
            raise ConfigError("model", self.model, "a function returning a torch.nn.Module",
                              "Pass the class or a factory, e.g. model=lambda: nn.Linear(64, 10)")
        try:
            cloudpickle.dumps(self.model)
        except Exception as error:
            raise ConfigError("model", self.model, "a picklable factory",
                              f"Workers receive it pickled; pickling failed with: {error}") from None
        try:
            sample_model = self.model()
        except Exception as error:
            raise ConfigError("model", self.model, "a factory that builds a model",
                              f"Calling it raised {type(error).__name__}: {error}") from error
        if not isinstance(sample_model, nn.Module):
            raise ConfigError("model", self.model, "a factory returning a torch.nn.Module",
                              f"It returned {type(sample_model).__name__}")
        n_parameters = sum(p.numel() for p in sample_model.parameters())
        if n_parameters == 0:
            raise ConfigError("model", self.model, "a model with trainable parameters")

        data, default_eval = self.data, None
        if isinstance(data, str):
            splits = resolve_dataset(data, "data")
            data, default_eval = splits.train, splits.eval
        elif isinstance(data, Splits):
            data, default_eval = data.train, data.eval
        train = as_source(data, "data")
        eval_spec = self.eval_data if self.eval_data is not None else default_eval
        evaluation = as_source(eval_spec, "eval_data") if eval_spec is not None else None

        if isinstance(self.loss, str):
            if self.loss not in LOSSES:
                raise ConfigError("loss", self.loss, f"one of {sorted(LOSSES)} or a function")
        elif not callable(self.loss):
            raise ConfigError("loss", self.loss, f"one of {sorted(LOSSES)} or a function")
        if isinstance(self.optimizer, str):
            if self.optimizer not in OPTIMIZERS:
                raise ConfigError("optimizer", self.optimizer, f"one of {list(OPTIMIZERS)} or a function")
        elif not callable(self.optimizer):
            raise ConfigError("optimizer", self.optimizer, f"one of {list(OPTIMIZERS)} or a function")
        check_number("momentum", self.momentum, minimum=0.0, below=1.0, integer=False)
        check_lr(self.lr)
        check_number("batch_size", self.batch_size, minimum=1, integer=True)
        check_number("seed", self.seed, minimum=0, integer=True)
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("steps", self.steps, f"None when epochs={self.epochs!r} is given",
                              "Give either epochs (passes over each worker's shard) or steps (per worker), not both")
        if self.steps is None:
            if self.epochs is not None:
                check_number("epochs", self.epochs, minimum=1, integer=True)
        else:
            check_number("steps", self.steps, minimum=1, integer=True)
        if self.eval_every is not None:
            check_number("eval_every", self.eval_every, minimum=1, integer=True)
        if self.device not in DEVICES:
            raise ConfigError("device", self.device, f"one of {list(DEVICES)}")
        if self.lr_schedule not in SCHEDULES:
            raise ConfigError("lr_schedule", self.lr_schedule, f"one of {list(SCHEDULES)}")
        check_number("warmup_steps", self.warmup_steps, minimum=0, integer=True)
        check_number("min_lr_fraction", self.min_lr_fraction, minimum=0.0, integer=False)
        if self.min_lr_fraction > 1:
            raise ConfigError("min_lr_fraction", self.min_lr_fraction, "a number from 0 to 1")
        if not isinstance(self.compile, bool):
            raise ConfigError("compile", self.compile, "True or False")
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", self.precision, f"one of {list(PRECISIONS)}",
                              "bf16 autocasts the forward pass; weights and the optimizer stay float32")
        check_data("data", train, sample_model, self.loss, loss_function(self), self.batch_size)
        if evaluation is not None:
            check_data("eval_data", evaluation, sample_model, self.loss, loss_function(self), self.batch_size)
        # device='cuda' is checked on the workers: they may have GPUs the client lacks.
        return PreparedJob(self, train, evaluation, n_parameters,
                           train.describe() if hasattr(train, "describe") else None)

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary for the run directory and the UI."""
        described = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, (int, float, str, bool)) or value is None:
                described[field.name] = value
            else:
                described[field.name] = _short_repr(value)
        return described


@dataclasses.dataclass
class PreparedJob:
    """A validated job with its data normalised into sources."""

    job: Job
    train: DataSource
    evaluation: DataSource | None
    n_parameters: int
    data_info: dict[str, Any] | None = None  # a built-in dataset's name and options (a corpus: its identity)

    def steps_per_epoch(self, shard_samples: int) -> int:
        return shard_samples // self.job.batch_size

    def total_steps(self, shard_samples: int) -> int:
        if self.job.steps is not None:
            return self.job.steps
        return (self.job.epochs or 1) * self.steps_per_epoch(shard_samples)


def make_optimizer(job: Job, parameters) -> torch.optim.Optimizer:
    """Build the job's optimizer over `parameters` (runs on the worker)."""
    if callable(job.optimizer):
        return job.optimizer(parameters, job.lr)
    if job.optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=job.lr, momentum=job.momentum)
    if job.optimizer == "adam":
        return torch.optim.Adam(parameters, lr=job.lr)
    return torch.optim.AdamW(parameters, lr=job.lr)


def autocast(job: Job, device: torch.device) -> Any:
    """The forward pass's precision context: bfloat16 autocast for precision='bf16', else none. bf16 has
    float32's range, so no loss scaling is needed (fp16 would need a GradScaler)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=getattr(job, "precision", "float32") == "bf16")


def loss_function(job: Job) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return LOSSES[job.loss] if isinstance(job.loss, str) else job.loss


def check_lr(lr: Any) -> float:
    """A learning rate, checked (ConfigError otherwise): for jobs, and for changes while a run trains."""
    check_number("lr", lr, minimum=0.0, integer=False, strictly=True)
    return float(lr)


def _short_repr(value: Any) -> str:
    name = getattr(value, "__qualname__", None) or getattr(type(value), "__qualname__", "")
    module = getattr(value, "__module__", None) or type(value).__module__
    text = f"{module}.{name}" if callable(value) and name else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
