"""The in-process tier, marked `inprocess`: the real loop, strategies and collectives in this process
(`workbench.testing`, a process group of one rank), no process started."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import mark_tier


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_tier(items, Path(__file__).parent, pytest.mark.inprocess)
