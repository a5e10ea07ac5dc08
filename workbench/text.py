"""The built-in text corpus: the running Python's standard library source, as bytes, in windows for a
character-level language model. Nothing is downloaded: every machine with Python has this text.

The corpus is the standard library's own `.py` files (`sysconfig.get_paths()["stdlib"]`, without
`site-packages` and without the test suites), read as bytes (a vocabulary of 256). A file belongs to the
held-out split when the CRC-32 of its path relative to that folder is divisible by 10: a fixed rule, so
every machine with the same Python splits the same way, and no file's text is on both sides. Each split is
its files concatenated in path order; sample `i` of a split is the window of `context + 1` bytes starting
at byte `i * context` (inputs: its first `context` bytes, targets: the `context` bytes one further on).
`corpus_info` names the Python, the files, the bytes and a hash, which the run's config records, so runs on
different corpora are never compared silently.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
import sys
import sysconfig
import zlib
from typing import Any

import torch

VOCABULARY = 256  # bytes
HELD_OUT_EVERY = 10  # one file in ten (by the CRC-32 of its path) is held out
SKIPPED_FOLDERS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_folder() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def held_out(relative_path: str) -> bool:
    """Whether the file at `relative_path` (posix, relative to the stdlib folder) is held out."""
    return zlib.crc32(relative_path.encode()) % HELD_OUT_EVERY == 0


def corpus_files(root: pathlib.Path | None = None) -> list[str]:
    """The corpus's files, as sorted posix paths relative to `root` (default: the stdlib folder)."""
    root = root or stdlib_folder()
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if SKIPPED_FOLDERS.isdisjoint(relative.parts[:-1]) and path.is_file():
            found.append(relative.as_posix())
    return sorted(found)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """The two splits as byte tensors, and what identifies them."""

    train: torch.Tensor  # uint8, 1-D
    eval: torch.Tensor
    info: dict[str, Any]


@functools.lru_cache(maxsize=2)
def load_corpus(limit_bytes: int | None = None) -> Corpus:
    """Read the corpus (once per process). `limit_bytes` keeps the first that many bytes of the training
    split and a tenth of it of the held-out split (the test tier's slice); the hash covers what is kept."""
    root = stdlib_folder()
    parts: dict[str, list[bytes]] = {"train": [], "eval": []}
    digest = hashlib.sha256()
    files = corpus_files(root)
    for relative in files:
        text = (root / relative).read_bytes()
        parts["eval" if held_out(relative) else "train"].append(text)
    train, evaluation = b"".join(parts["train"]), b"".join(parts["eval"])
    if limit_bytes is not None:
        train, evaluation = train[:limit_bytes], evaluation[:max(limit_bytes // HELD_OUT_EVERY, 1)]
    for split in (train, evaluation):
        digest.update(len(split).to_bytes(8, "little"))
        digest.update(split)
    info = {
        "corpus": "stdlib-text", "python": sys.version.split()[0], "folder": str(root),
        "files": len(files), "train_files": len(parts["train"]), "eval_files": len(parts["eval"]),
        "train_bytes": len(train), "eval_bytes": len(evaluation), "sha256": digest.hexdigest()[:16],
        "limit_bytes": limit_bytes,
    }
    as_tensor = lambda data: torch.frombuffer(bytearray(data), dtype=torch.uint8)  # noqa: E731
    return Corpus(as_tensor(train), as_tensor(evaluation), info)


@dataclasses.dataclass
class TextWindows:
    """Windows of a byte stream, as a `Batches`: sample `i` starts at byte `starts[i]` (or `i * context`)."""

    tokens: torch.Tensor
    context: int
    starts: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._offsets = torch.arange(self.context + 1, device=self.tokens.device)

    def __len__(self) -> int:
        if self.starts is not None:
            return len(self.starts)
        return max((len(self.tokens) - 1) // self.context, 0)

    def load(self) -> TextWindows:
        return self

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        indices = indices.to(self.tokens.device)
        starts = self.starts[indices] if self.starts is not None else indices * self.context
        windows = self.tokens[starts[:, None] + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]

    def to(self, device: torch.device | str) -> TextWindows:
        starts = self.starts.to(device) if self.starts is not None else None
        return TextWindows(self.tokens.to(device), self.context, starts)


def windows(tokens: torch.Tensor, context: int, count: int | None = None) -> TextWindows:
    """Every window of `tokens`, or `count` of them spread evenly over it (a fixed held-out sample)."""
    every = TextWindows(tokens, context)
    if count is None or count >= len(every):
        return every
    starts = torch.linspace(0, len(every) - 1, count).round().long() * context
    return TextWindows(tokens, context, starts)
