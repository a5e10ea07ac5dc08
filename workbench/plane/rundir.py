"""The run directory: config, metrics appended as they arrive, final weights, summary.

Everything is written so that a crash loses nothing already received: metrics are appended and flushed
line by line (JSON Lines), and whole files (config, summary, weights) are written to a temporary name
and renamed into place, which is atomic on POSIX file systems.
"""
from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from workbench.errors import ConfigError

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
SUMMARY_FILE = "summary.json"
MODEL_FILE = "model.pt"


class RunDirectory:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / ".write-test"
            probe.write_text("")
            probe.unlink()
        except OSError as error:
            raise ConfigError("run_dir", str(path), "a directory that can be created and written",
                              f"{type(error).__name__}: {error.strerror or error}") from None
        self._lock = threading.Lock()
        self._metrics = open(self.path / METRICS_FILE, "a", encoding="utf-8")

    def write_json(self, name: str, value: Any) -> None:
        atomic_write(self.path / name, lambda f: f.write(json.dumps(value, indent=2, default=str).encode()))

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        lines = "".join(json.dumps(record, default=str) + "\n" for record in records)
        with self._lock:
            if not self._metrics.closed:
                self._metrics.write(lines)
                self._metrics.flush()

    def save_model(self, state_dict: dict[str, torch.Tensor]) -> Path:
        target = self.path / MODEL_FILE
        atomic_write(target, lambda f: torch.save(state_dict, f))
        return target

    def close(self) -> None:
        with self._lock:
            self._metrics.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record of a run directory's metrics file (a torn last line from a crash is skipped)."""
    records = []
    with open(Path(path) / METRICS_FILE, encoding="utf-8") as lines:
        for line in lines:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def atomic_write(target: Path, write) -> None:
    descriptor, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
