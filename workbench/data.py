"""Training data as the workbench sees it: sources that are described on the client and loaded on workers.

Accepted forms (see `as_source`): a torch `Dataset`, a pair of tensors or NumPy arrays, a pair of Dask
arrays, a built-in name (`digits`, `synthetic`, `stdlib-text`) or `module:function`. Built-in data is generated on the
workers themselves, so nothing travels; other data is scattered once to the run's workers.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from workbench.checks import check_positive_int
from workbench.errors import ConfigError
from workbench.sharding import batches, global_batches, local_shuffle
from workbench.text import TextWindows, load_corpus, windows


class Batches(Protocol):
    """Loaded data on a worker: indexable by a tensor of sample indices."""

    def __len__(self) -> int: ...

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclasses.dataclass
class TensorData:
    """Inputs and targets held as two tensors of equal length."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.inputs)

    def load(self) -> TensorData:
        return self

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[indices], self.targets[indices]

    def to(self, device: torch.device | str) -> TensorData:
        return TensorData(self.inputs.to(device), self.targets.to(device))


@dataclasses.dataclass
class DatasetData:
    """A map-style torch `Dataset`; batches are collated from items as a DataLoader would."""

    dataset: Dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def load(self) -> DatasetData:
        return self

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = default_collate([self.dataset[int(i)] for i in indices])
        return inputs, targets


@dataclasses.dataclass(frozen=True)
class BuiltinData:
    """A split of a built-in dataset, generated where it is loaded (on the worker) from a few parameters."""

    name: str
    split: str  # "train" or "eval"
    options: tuple[tuple[str, Any], ...] = ()

    def __len__(self) -> int:
        return len(self.load())

    def load(self) -> TensorData | TextWindows:
        return _load_builtin(self.name, self.options)[self.split]

    def describe(self) -> dict[str, Any]:
        """What the run's config records of this data: its name and options (and a corpus's identity)."""
        described: dict[str, Any] = {"name": self.name, **dict(self.options)}
        if self.name == "stdlib-text":
            described.update(load_corpus(dict(self.options)["limit_bytes"]).info)
        return described


@dataclasses.dataclass
class DaskArrayData:
    """A pair of Dask arrays; the run assigns each worker the blocks it already holds where possible."""

    inputs: Any
    targets: Any

    def __len__(self) -> int:
        return int(self.inputs.shape[0])


DataSource = TensorData | DatasetData | BuiltinData | DaskArrayData | TextWindows


@dataclasses.dataclass
class Splits:
    """What a dataset function returns: training data and optional held-out data, in any accepted form."""

    train: Any
    eval: Any = None


# --- built-in datasets --------------------------------------------------------------------------------


def digits(eval_fraction: float = 0.2, seed: int = 0) -> Splits:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 real images, 10 classes), with a held-out split."""
    options = (("eval_fraction", eval_fraction), ("seed", seed))
    return Splits(BuiltinData("digits", "train", options), BuiltinData("digits", "eval", options))


def synthetic(
    n_samples: int = 8192,
    n_features: int = 784,
    n_classes: int = 10,
    noise: float = 1.0,
    eval_fraction: float = 0.2,
    seed: int = 0,
) -> Splits:
    """Gaussian class clusters: learnable, any size, generated on each worker from the seed (no transfer)."""
    options = tuple(
        dict(n_samples=n_samples, n_features=n_features, n_classes=n_classes, noise=noise,
             eval_fraction=eval_fraction, seed=seed).items()
    )
    return Splits(BuiltinData("synthetic", "train", options), BuiltinData("synthetic", "eval", options))


def stdlib_text(context: int = 128, eval_windows: int = 256, limit_bytes: int | None = None) -> Splits:
    """The running Python's standard library source as bytes, for a character-level language model
    (`workbench.text`): samples are windows of `context` bytes, targets the same shifted by one; the
    held-out split is `eval_windows` windows spread over the held-out files. `limit_bytes` keeps only the
    first bytes of the training text (a small slice for tests)."""
    check_positive_int("context", context)
    check_positive_int("eval_windows", eval_windows)
    if limit_bytes is not None:
        check_positive_int("limit_bytes", limit_bytes)
    options = (("context", context), ("eval_windows", eval_windows), ("limit_bytes", limit_bytes))
    return Splits(BuiltinData("stdlib-text", "train", options), BuiltinData("stdlib-text", "eval", options))


BUILTIN_DATASETS = {"digits": digits, "synthetic": synthetic, "stdlib-text": stdlib_text}


@functools.lru_cache(maxsize=4)
def _load_builtin(name: str, options: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    kwargs = dict(options)
    if name == "stdlib-text":
        corpus = load_corpus(kwargs["limit_bytes"])
        return {"train": windows(corpus.train, kwargs["context"]),
                "eval": windows(corpus.eval, kwargs["context"], kwargs["eval_windows"])}
    if name == "digits":
        inputs, targets = _digits_arrays()
        inputs = torch.as_tensor(inputs / 16.0, dtype=torch.float32)
        targets = torch.as_tensor(targets, dtype=torch.int64)
    elif name == "synthetic":
        generator = torch.Generator().manual_seed(kwargs["seed"])
        n_total = int(kwargs["n_samples"] / (1 - kwargs["eval_fraction"]))
        centers = torch.randn(kwargs["n_classes"], kwargs["n_features"], generator=generator)
        targets = torch.randint(kwargs["n_classes"], (n_total,), generator=generator)
        noise = torch.randn(n_total, kwargs["n_features"], generator=generator) * kwargs["noise"]
        # Centers scaled so classes overlap: the task is learnable but not trivial.
        inputs = centers[targets] * 0.25 + noise
    else:
        raise ConfigError("dataset", name, f"one of {sorted(BUILTIN_DATASETS)} or 'module:function'")
    generator = torch.Generator().manual_seed(kwargs["seed"] + 1)
    order = torch.randperm(len(inputs), generator=generator)
    n_eval = int(round(len(inputs) * kwargs["eval_fraction"]))
    eval_idx, train_idx = order[:n_eval], order[n_eval:]
    return {
        "train": TensorData(inputs[train_idx].contiguous(), targets[train_idx].contiguous()),
        "eval": TensorData(inputs[eval_idx].contiguous(), targets[eval_idx].contiguous()),
    }


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1,797 8x8 images, pixels 0-16, and their labels), as `load_digits` returns them.

    Read from the data file scikit-learn ships, the way `load_digits` reads it, without importing
    scikit-learn: `import sklearn.datasets` takes about 1.5 s (it loads SciPy), paid by every process that
    loads digits (each worker, the command line); the file takes 30 ms. Where the file is not where this
    scikit-learn keeps it, `load_digits` itself."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(folder) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")
            return data[:, :-1], data[:, -1].astype(int, copy=False)
    from sklearn.datasets import load_digits

    return load_digits(return_X_y=True)


# --- normalisation of what the user passes --------------------------------------------------------------


def resolve_dataset(spec: str, parameter: str = "dataset") -> Splits:
    """A built-in name or `module:function` to `Splits`; the function may return `Splits`, a dict or data."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(parameter, spec, f"a built-in name ({', '.join(sorted(BUILTIN_DATASETS))}) or 'module:function'")
    if spec in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[spec]()
    if ":" not in spec:
        raise ConfigError(
            parameter, spec, f"a built-in name ({', '.join(sorted(BUILTIN_DATASETS))}) or 'module:function'",
            "Write a function returning workbench.data.Splits and name it as 'package.module:function'",
        )
    module_name, _, function_name = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(parameter, spec, "an importable 'module:function'", f"Import failed: {error}") from None
    result = function()
    if isinstance(result, Splits):
        return result
    if isinstance(result, dict) and "train" in result:
        return Splits(result["train"], result.get("eval"))
    return Splits(result)


def as_source(data: Any, parameter: str) -> DataSource:
    """Turn any accepted data form into a `DataSource`, or raise `ConfigError` naming `parameter`."""
    allowed = "a torch Dataset, a pair (inputs, targets) of tensors, NumPy or Dask arrays, or a dataset name"
    if isinstance(data, (TensorData, DatasetData, BuiltinData, DaskArrayData, TextWindows)):
        return data
    if isinstance(data, Dataset):
        if not hasattr(data, "__len__"):
            raise ConfigError(parameter, data, "a map-style Dataset with __len__", "Iterable datasets cannot be sharded")
        return DatasetData(data)
    if isinstance(data, (tuple, list)) and len(data) == 2:
        inputs, targets = data
        if _is_dask_array(inputs) and _is_dask_array(targets):
            if inputs.shape[0] != targets.shape[0]:
                raise ConfigError(parameter, (inputs.shape, targets.shape), "inputs and targets of equal length")
            return DaskArrayData(inputs, targets)
        if isinstance(inputs, (torch.Tensor, np.ndarray)) and isinstance(targets, (torch.Tensor, np.ndarray)):
            inputs, targets = _as_tensor(inputs), _as_tensor(targets)
            if len(inputs) != len(targets):
                raise ConfigError(
                    parameter, f"inputs of length {len(inputs)}, targets of length {len(targets)}",
                    "inputs and targets of equal length",
                )
            return TensorData(inputs, targets)
    raise ConfigError(parameter, data, allowed)


def _as_tensor(array: torch.Tensor | np.ndarray) -> torch.Tensor:
    tensor = torch.as_tensor(array)
    # Tensors crossing Dask must be CPU and not bfloat16 (NumPy has no bf16).
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()
    if tensor.dtype == torch.float64:
        tensor = tensor.float()
    return tensor.cpu()


def _is_dask_array(value: Any) -> bool:
    return type(value).__module__.startswith("dask.array")


class Shard:
    """One worker's view of the training data: its batches for each epoch.

    Globally indexed data is split by `shard_indices` (every worker holds the whole dataset), and a step's
    batch is this rank's part of the group's global batch (`global_batches`): its equal part, or the
    share a balanced strategy gives it. Data made of the Dask blocks a worker holds is shuffled locally
    and cut to the common shard size; its batches are the worker's own and never shared out.
    """

    def __init__(self, data: Batches, world_size: int, rank: int, seed: int, samples: int, local: bool) -> None:
        self.data, self.world_size, self.rank, self.seed = data, world_size, rank, seed
        self.samples, self.local = samples, local

    def epoch_rows(self, epoch: int, batch_size: int) -> list[torch.Tensor]:
        """Per step of `epoch`: the group's global batch (this rank's own batch, with local data)."""
        if self.local:
            return batches(local_shuffle(len(self.data), self.samples, self.rank, epoch, self.seed), batch_size)
        return global_batches(len(self.data), self.world_size, epoch, self.seed, batch_size)

    def part(self, row: torch.Tensor, batch_size: int, share: tuple[int, int] | None = None) -> torch.Tensor:
        """This rank's indices of a step's `row`: the `share` (start, stop) a balanced strategy gave it,
        else its equal part."""
        if self.local:
            return row
        start, stop = share if share is not None else (self.rank * batch_size, (self.rank + 1) * batch_size)
        return row[start:stop]

    def epoch_batches(self, epoch: int, batch_size: int) -> list[torch.Tensor]:
        """This rank's equal batches of `epoch`."""
        return [self.part(row, batch_size) for row in self.epoch_rows(epoch, batch_size)]


def concatenate_blocks(input_blocks: list[Any], target_blocks: list[Any]) -> TensorData:
    """The Dask-array blocks a worker was assigned, as one `TensorData`."""
    inputs = np.concatenate([np.asarray(b) for b in input_blocks]) if input_blocks else np.empty((0,))
    targets = np.concatenate([np.asarray(b) for b in target_blocks]) if target_blocks else np.empty((0,))
    return TensorData(_as_tensor(inputs), _as_tensor(targets))
