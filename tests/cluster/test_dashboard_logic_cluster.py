"""The `workbench dashboard` command refuses bad arguments in one line: run by its `main` in this process, and
once as the installed command (the dashboard's pure parts: tests/unit/test_dashboard_logic.py)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import cli_in_process


@pytest.mark.parametrize("arguments, message", [
    (["--port", "70000"], "--port=70000"),
    (["--basic-auth", "/nonexistent.json"], "--basic-auth"),
    (["--ssl-certfile", "cert.pem"], "--ssl-keyfile"),
    (["--refresh-ms", "5"], "refresh_ms=5"),
    (["--nice", "20"], "--nice=20"),
])
def test_dashboard_command_refuses_bad_arguments_in_one_line(arguments, message, capsys):
    code, lines = cli_in_process(["dashboard", "--scheduler", "tcp://127.0.0.1:9", *arguments], capsys)
    assert code == 2 and len(lines) == 1 and message in lines[0], lines


def test_the_installed_dashboard_command_refuses_a_bad_argument_in_one_line():
    result = subprocess.run([sys.executable, "-m", "workbench", "dashboard", "--scheduler", "tcp://127.0.0.1:9",
                             "--port", "70000"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--port=70000" in result.stderr and len(result.stderr.strip().splitlines()) == 1
