"""Ctrl-C and SIGTERM end `workbench train` as interrupted even when the interrupt lands in code that
swallows it (a finalizer while the cluster starts), instead of the command training on and exiting 0."""
from __future__ import annotations

import signal

import pytest

from workbench.cli import main as cli


@pytest.fixture
def ctrl_c():
    """Ctrl-C as an interactive shell gives it (a suite run in the background inherits it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_swallowed_during_start_up_still_ends_the_command_as_interrupted(ctrl_c, monkeypatch, capsys):
    def start_up_that_swallows(arguments):
        try:
            signal.raise_signal(signal.SIGINT)  # what a finalizer running at that moment would swallow
        except KeyboardInterrupt:
            pass
        return 0  # and on it went, as if nothing had happened

    monkeypatch.setattr(cli, "_train", start_up_that_swallows)
    assert cli.main(["train", "--no-progress"]) == 130
    assert "workbench: interrupted" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are given back


def test_an_ignored_ctrl_c_stays_ignored(monkeypatch):
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        seen = []
        monkeypatch.setattr(cli, "_train", lambda arguments: seen.append(signal.getsignal(signal.SIGINT)) or 0)
        assert cli.main(["train", "--no-progress"]) == 0
        assert seen == [signal.SIG_IGN] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_command_that_was_not_interrupted_keeps_its_status(monkeypatch):
    monkeypatch.setattr(cli, "_train", lambda arguments: 0)
    assert cli.main(["train", "--no-progress"]) == 0
    monkeypatch.setattr(cli, "_train", lambda arguments: 3)
    assert cli.main(["train", "--no-progress"]) == 3
