"""The cluster tier, marked `cluster`: tests that start processes (a real Dask cluster, the command line,
a notebook kernel, a served dashboard and Chromium), and the session's 2-process cluster they share."""
from __future__ import annotations

from pathlib import Path

import pytest

import workbench

from helpers import mark_tier


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    mark_tier(items, Path(__file__).parent, pytest.mark.cluster)


@pytest.fixture(scope="session")
def client():
    """One real 2-process LocalCluster for the cluster tests, created once per session."""
    client = workbench.connect(workers=2, dashboard_address=":0")
    try:
        yield client
    finally:
        workbench.shutdown(client)
