"""Slow-link options of the synchronous strategies, checked without a cluster: bad settings are refused by
name, and the control panel's form offers the wire dtypes (runs on a real 2-process cluster:
tests/cluster/test_slow_sync_cluster.py)."""
from __future__ import annotations

import dataclasses

import pytest

from workbench.errors import ConfigError
from workbench.strategies import get_strategy, make_settings

pytestmark = [pytest.mark.timeout(180)]


@pytest.mark.parametrize("parameter,strategy,values", [
    ("wire_dtype", "allreduce", {"wire_dtype": "int8"}),
    ("wire_dtype", "average", {"wire_dtype": "float16"}),
    ("overlap", "average", {"overlap": "yes"}),
    ("overlap", "average", {"overlap": True, "average_optimizer_state": True}),
    ("outer_lr", "average", {"outer_lr": 0}),
    ("outer_lr", "average", {"outer_lr": float("inf")}),
    ("outer_momentum", "average", {"outer_momentum": 1.0}),
    ("outer_momentum", "average", {"outer_momentum": -0.1}),
])
def test_bad_slow_link_settings_are_refused_naming_them(parameter, strategy, values):
    with pytest.raises(ConfigError) as caught:
        make_settings(strategy, values)
    assert caught.value.parameter == parameter and "expected" in str(caught.value)


def test_the_control_panel_form_offers_the_wire_dtypes_and_gives_every_setting_back():
    from widgets.control_panel import _setting_value, _setting_widget
    from workbench.cli.setting_flags import form_fields

    for strategy in ("average", "allreduce"):
        settings_class = get_strategy(strategy).settings_class
        values = dataclasses.asdict(settings_class(wire_dtype="bf16"))
        widgets = {field.name: _setting_widget(field, values[field.name]) for field in form_fields(strategy)}
        assert [value for _, value in widgets["wire_dtype"].options] == ["float32", "fp16", "bf16"]
        assert {name: _setting_value(widget) for name, widget in widgets.items()} == values
