"""Every strategy trains `digits` from the command line with its own defaults, short or long; a run that
does not learn says so while it runs (issue 18, item 0).

Through the CLI's own `main()` against the session's cluster (`--scheduler`), so the flags, their defaults
and the printed summary are the ones a user gets, without starting a cluster per run.
"""
from __future__ import annotations

import re

import pytest

from workbench.cli import main as cli
from workbench.plane.kinds import TRAINING_WARNING
from workbench.plane.rundir import read_metrics
from workbench.strategies import STRATEGIES


def _train(client, tmp_path, capsys, *flags: str) -> tuple[int, str, str]:
    code = cli.main(["train", "--dataset", "digits", "--workers", "2", "--scheduler", client.scheduler.address,
                     "--no-progress", "--run-dir", str(tmp_path), *flags])
    out, err = capsys.readouterr()
    return code, out, err


# `ssp` after 5 epochs was the narrow case: at its old bound of 4 clocks the faster worker waited often on
# the 2-core machine and 19 of 26 runs reached 0.9 (0.80-0.95); with the bound at 8, 50 of 50 (0.90-0.95),
# 0.96-0.97 after 40 (see SSPSettings.max_staleness).
CASES = [(strategy, epochs) for strategy in sorted(STRATEGIES) for epochs in (5, 40)]


@pytest.mark.parametrize("strategy,epochs", CASES)
@pytest.mark.timeout(180)
def test_each_strategy_trains_digits_with_its_own_defaults(strategy, epochs, client, tmp_path, capsys):
    code, out, err = _train(client, tmp_path, capsys, "--strategy", strategy, "--epochs", str(epochs))
    assert code == 0, err
    accuracy = float(re.search(r"held-out accuracy: ([0-9.]+)", out).group(1))
    assert accuracy >= 0.9, out
    assert "warning" not in out + err  # a run that learns raises no alarm


@pytest.mark.timeout(180)
def test_a_run_that_does_not_learn_says_so_live_and_in_the_summary(client, tmp_path, capsys):
    # What the CLI's old defaults did to `async`: momentum 0.9 on stale pushes, at a constant rate, sent
    # the loss to chance (annealed, as async's own schedule is now, it recovers late: 0.80 accuracy).
    code, out, err = _train(client, tmp_path, capsys, "--strategy", "async", "--epochs", "5",
                            "--lr", "0.1", "--momentum", "0.9", "--lr-schedule", "constant")
    assert code == 0, err
    assert float(re.search(r"held-out accuracy: ([0-9.]+)", out).group(1)) < 0.5
    assert "warning: under async, the training loss" in out and "momentum 0-0.4" in out
    records = read_metrics(next(tmp_path.iterdir()))
    warnings = [r for r in records if r["kind"] == TRAINING_WARNING]
    steps = [r for r in records if r["kind"] == "step"]
    assert warnings and {w["reason"] for w in warnings} <= {"not-learning", "loss-climbing"}
    # Said while the run trained: raised at a step before its last, and kept before the run's end. (Not
    # "steps followed it on disk": under load the last steps' batch can land before the supervisor
    # publishes the warning, seen once in CI.)
    ended = next(i for i, r in enumerate(records) if r["kind"] in ("run-finished", "run-stopped"))
    assert warnings[0]["step"] < max(r["step"] for r in steps) and records.index(warnings[0]) < ended


@pytest.mark.timeout(180)
def test_the_notebook_panel_shows_the_warning(client, tmp_path):
    import workbench
    from widgets import ControlPanel

    job = workbench.Job(model=workbench.mlp(64, 10, [128]), data="digits", lr=0.1, momentum=0.9, epochs=5)
    run = workbench.train(job, "async", client=client, run_dir=tmp_path)
    panel = ControlPanel(run, refresh_s=0.2)
    try:
        assert run.wait(timeout=150) == "finished"
        assert run.warnings() and run.summary()["warnings"] == run.warnings()
        panel._draw(run.snapshot())
        assert "&#9888; under async, the training loss" in panel.message.value
        assert any(m["label"].startswith("warning: ") for m in run.snapshot()["markers"])
    finally:
        panel.close()
