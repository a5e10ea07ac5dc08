"""Small ready-made models for the CLI, the examples and the benchmarks."""
from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import nn


class MLP(nn.Sequential):
    """Fully connected network: in_features -> hidden... -> out_features, ReLU between layers."""

    def __init__(self, in_features: int, out_features: int, hidden: Sequence[int] = (128,)) -> None:
        sizes = [in_features, *hidden, out_features]
        layers: list[nn.Module] = [nn.Flatten()]
        for index, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if index < len(sizes) - 2:
                layers.append(nn.ReLU())
        super().__init__(*layers)


def mlp(in_features: int, out_features: int, hidden: Sequence[int] = (128,)) -> functools.partial:
    """A picklable factory for `MLP(in_features, out_features, hidden)`, as `Job.model` expects."""
    return functools.partial(MLP, in_features, out_features, tuple(hidden))
