"""Fixtures every tier may use. The tiers are the folders below, each marking its tests from its own
conftest.py: unit/ (`unit`), inprocess/ (`inprocess`), cluster/ (`cluster`, with the session's cluster,
the `client` fixture), lab/ (`multihost`). `helpers.py` beside this file is importable from every tier
(`pythonpath` in pyproject.toml)."""
from __future__ import annotations

import pytest


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "runs"


@pytest.fixture
def clean_environment(monkeypatch):
    """No GLOO_/NCCL_SOCKET_IFNAME set, and none that the test sets left behind."""
    from workbench.comm import collectives

    for variable in collectives.SOCKET_IFNAME_VARIABLES:
        # Set, then deleted: monkeypatch records the variable only if it existed, and what the binding sets
        # must not outlive the test (later processes started from this one would inherit it).
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
