"""The lab tier, marked `multihost`: emulated hosts as network namespaces (`testbed.lab`); needs root and
iproute2, skipped with the reason elsewhere."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import mark_tier


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_tier(items, Path(__file__).parent, pytest.mark.multihost)
