"""The loss watch (pure): a run that does not learn, or whose loss climbs, is said to be so once."""
import math

from workbench.run.health import LossWatch
from workbench.plane.kinds import TRAINING_WARNING as WARNING_KIND
from workbench.plane.metrics import MetricsTable, control_markers


def _feed(watch, losses_by_step, workers=2, start=0):
    warnings = []
    for step, loss in enumerate(losses_by_step, start=start):
        for worker in range(workers):
            warning = watch.observe({"kind": "step", "worker": worker, "step": step, "loss": loss})
            if warning is not None:
                warnings.append(warning)
    return warnings


def test_a_learning_run_raises_nothing():
    watch = LossWatch(total_steps=400)
    losses = [2.3 * math.exp(-step / 50) + 0.05 for step in range(400)]
    assert _feed(watch, losses) == []
    assert abs(watch.baseline - 2.35) < 1e-12


def test_a_run_sitting_at_chance_is_not_learning_once_a_quarter_is_done():
    watch = LossWatch(total_steps=400, strategy="async", momentum=0.9)
    warnings = _feed(watch, [2.30] + [7.0] * 3 + [2.31] * 396)
    reasons = [w["reason"] for w in warnings]
    assert reasons == ["not-learning"]  # the early spike is shorter than the window: no climb
    warning = warnings[0]
    assert warning["kind"] == WARNING_KIND
    assert warning["step"] == 100  # a quarter of 400 steps
    assert "not learning" in warning["message"] and "momentum 0-0.4" in warning["message"]
    assert warning["strategy"] == "async" and warning["message"].startswith("under async, the training loss")


def test_the_warning_names_the_strategy_training_when_it_fires():
    watch = LossWatch(total_steps=100, window=10, strategy="allreduce")  # switched to average since
    warnings = []
    for step, loss in enumerate([5.5] + [5.4] * 99):
        for worker in range(2):
            warning = watch.observe({"worker": worker, "step": step, "loss": loss,
                                     "strategy": "allreduce" if step < 20 else "average"})
            warnings += [warning] if warning else []
    assert [(w["reason"], w["strategy"]) for w in warnings] == [("not-learning", "average")]
    assert warnings[0]["message"].startswith("under average, the training loss is still 5.4")


def test_a_climbing_loss_is_said_once_and_stalling_is_judged_after_the_minimum():
    watch = LossWatch(total_steps=100, window=10)
    warnings = _feed(watch, [2.3] + [2.0] * 20 + [6.0] * 79)
    assert [w["reason"] for w in warnings] == ["loss-climbing", "not-learning"]
    assert warnings[0]["step"] == 24  # when 7 of the last 10 records (2 a step) are past the jump at 21
    assert warnings[1]["step"] == 50  # the minimum number of steps, more than a quarter of 100
    assert "Try a lower learning rate" in warnings[0]["message"]


def test_a_small_loss_doubling_is_noise_not_a_climb():
    watch = LossWatch(total_steps=1000, window=10)
    assert _feed(watch, [0.02] + [0.01] * 100 + [0.05] * 100) == []  # below baseline + 0.5


def test_a_resumed_run_starts_its_baseline_at_the_resume_step():
    watch = LossWatch(total_steps=400, first_step=300)
    assert _feed(watch, [0.4] + [0.3] * 99, start=300) == []
    assert watch.baseline == 0.4


def test_warnings_reach_the_live_view_and_the_markers():
    table = MetricsTable()
    warning = {"kind": WARNING_KIND, "reason": "not-learning", "step": 100, "time": 1.0, "message": "m"}
    table.add([warning])
    assert table.live_view()["warnings"] == ["m"]
    assert control_markers(table.events()) == [{"kind": WARNING_KIND, "step": 100, "time": 1.0,
                                                "label": "warning: not-learning"}]
