"""Shared fixtures: one real 2-process LocalCluster for the cluster tests, created once per session."""
from __future__ import annotations

import pytest

import workbench


@pytest.fixture(scope="session")
def client():
    client = workbench.connect(workers=2, dashboard_address=":0")
    try:
        yield client
    finally:
        workbench.shutdown(client)


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "runs"
