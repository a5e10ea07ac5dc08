"""The unit tier: pure tests, marked `unit`; no process, cluster, subprocess or network server.

A test here fails if it leaves a child process behind, or starts a Python process (the command line, a
kernel, a cluster's workers: `subprocess` with this interpreter or a script beside it, `multiprocessing`,
a fork), even one that has ended by the time the test does. Other programs a library runs on its own
(fontconfig's `fc-list` for matplotlib's font cache, `ldconfig` for `ctypes.util`) are not counted."""
from __future__ import annotations

import multiprocessing.util
import os
import shutil
import sys
from pathlib import Path

import psutil
import pytest

from helpers import mark_tier

_BIN = Path(sys.executable).parent  # this interpreter's scripts: workbench, dask, jupyter ...
_PYTHON = os.path.realpath(sys.executable)
_started: list[str] | None = None  # what a unit test started, while one runs


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_tier(items, Path(__file__).parent, pytest.mark.unit)


def _is_python(program) -> bool:
    path = shutil.which(os.fsdecode(program)) or os.fsdecode(program)
    return Path(path).parent == _BIN or os.path.realpath(path) == _PYTHON


def _audit(event, args):
    if _started is None:
        return
    if event == "subprocess.Popen" and _is_python(args[0]):
        _started.append(" ".join(map(os.fsdecode, args[1])))
    elif event in ("os.fork", "os.forkpty"):
        _started.append(event)


sys.addaudithook(_audit)  # hooks cannot be removed: this one records only while a unit test runs


def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


@pytest.fixture(autouse=True)
def _starts_no_process(monkeypatch):
    global _started
    spawn = multiprocessing.util.spawnv_passfds  # multiprocessing's spawn, which raises no audit event

    def spawn_recorded(path, args, passfds):
        if _started is not None:
            _started.append(" ".join(map(os.fsdecode, args)))
        return spawn(path, args, passfds)

    before, _started = _children(), []
    monkeypatch.setattr(multiprocessing.util, "spawnv_passfds", spawn_recorded)
    try:
        yield
    finally:
        started, _started = _started, None
    left = _children() - before
    assert not started and not left, (
        f"a unit test starts no process: started {started}, left behind {sorted(left)}; "
        f"it belongs in tests/cluster/")
