"""The `workbench dashboard` command refuses bad arguments in one line, each in a process of its own (the
dashboard's pure parts: tests/unit/test_dashboard_logic.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("arguments, message", [
    (["--port", "70000"], "--port=70000"),
    (["--basic-auth", "/nonexistent.json"], "--basic-auth"),
    (["--ssl-certfile", "cert.pem"], "--ssl-keyfile"),
    (["--refresh-ms", "5"], "refresh_ms=5"),
    (["--nice", "20"], "--nice=20"),
])
def test_dashboard_command_refuses_bad_arguments_in_one_line(arguments, message):
    result = subprocess.run([sys.executable, "-m", "workbench", "dashboard", "--scheduler", "tcp://127.0.0.1:9",
                             *arguments], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
