"""Small ready-made models for the CLI, the examples and the benchmarks: an MLP, and a character-level GPT
in named sizes for the built-in text corpus."""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch
from torch import nn

from workbench.checks import check_number, check_positive_int
from workbench.errors import ConfigError


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


# --- a small GPT for the built-in text corpus --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GPTSize:
    """A named GPT shape: width, layers, heads, and the positions (longest context) it learns."""

    width: int
    layers: int
    heads: int
    positions: int


# Named sizes. gpt-mini trains usefully on two CPU cores in minutes (about 0.8M parameters); gpt-small is
# nanoGPT's Shakespeare-character model (about 10.7M); gpt-medium (about 85M) and gpt-large (about 300M)
# keep a GPU busy. gpt-test is for the test tier (seconds per run).
GPT_SIZES: dict[str, GPTSize] = {
    "gpt-test": GPTSize(width=32, layers=2, heads=2, positions=64),
    "gpt-mini": GPTSize(width=128, layers=4, heads=4, positions=128),
    "gpt-small": GPTSize(width=384, layers=6, heads=6, positions=256),
    "gpt-medium": GPTSize(width=768, layers=12, heads=12, positions=1024),
    "gpt-large": GPTSize(width=1024, layers=24, heads=16, positions=1024),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.projection = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        # The fused kernel (flash / memory-efficient attention where the device has one).
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                       dropout_p=self.dropout if self.training else 0.0)
        return self.projection(y.transpose(1, 2).contiguous().view(batch, length, width))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a 4x MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A character-level GPT (as nanoGPT's): learned token and position embeddings, pre-norm blocks of causal
    self-attention through `scaled_dot_product_attention`, the output layer tied to the token embedding.
    Takes (batch, length) byte indices, returns (batch, length, vocabulary) scores."""

    def __init__(self, size: GPTSize, vocabulary: int = 256, dropout: float = 0.0) -> None:
        super().__init__()
        self.vocabulary, self.positions, self.size = vocabulary, size.positions, size
        self.token_embedding = nn.Embedding(vocabulary, size.width)
        self.position_embedding = nn.Embedding(size.positions, size.width)
        self.blocks = nn.Sequential(*(Block(size.width, size.heads, dropout) for _ in range(size.layers)))
        self.norm = nn.LayerNorm(size.width)
        self.head = nn.Linear(size.width, vocabulary, bias=False)
        self.head.weight = self.token_embedding.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._initialise)
        for name, parameter in self.named_parameters():
            if name.endswith("projection.weight") or name.endswith("mlp.2.weight"):
                # GPT-2's scaled initialisation of the layers that write into the residual stream.
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * size.layers))

    @staticmethod
    def _initialise(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        if length > self.positions:
            raise ValueError(f"a context of {length} tokens is longer than the model's {self.positions} positions")
        positions = torch.arange(length, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        return self.head(self.norm(self.blocks(x)))

    def flops_per_token(self, context: int) -> float:
        """Training FLOPs per token, forward and backward, as nanoGPT counts them (PaLM, appendix B): 6 per
        parameter (position embeddings left out) plus attention's 12 * layers * width * context."""
        parameters = sum(p.numel() for p in self.parameters()) - self.position_embedding.weight.numel()
        return 6 * parameters + 12 * self.size.layers * self.size.width * context


def gpt(size: str = "gpt-mini", vocabulary: int = 256, dropout: float = 0.0) -> functools.partial:
    """A picklable factory for a `GPT` of a named size (`GPT_SIZES`), as `Job.model` expects."""
    if size not in GPT_SIZES:
        raise ConfigError("model", size, f"one of {', '.join(GPT_SIZES)}")
    check_positive_int("vocabulary", vocabulary)
    check_number("dropout", dropout, minimum=0.0, below=1.0)
    return functools.partial(GPT, GPT_SIZES[size], vocabulary, dropout)
