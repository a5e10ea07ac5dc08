"""The CLI's flags: every strategy setting has one, from the settings dataclasses (pure); the job's device and
precision reaching the run: tests/cluster/test_cli_flags_cluster.py."""
import dataclasses

import pytest

from workbench.cli import main as cli
from workbench.cli.setting_flags import chosen_settings, setting_fields
from workbench.strategies import STRATEGIES, make_settings


def test_every_setting_of_every_strategy_is_a_flag_with_its_type():
    defaults = vars(cli.build_parser().parse_args(["train"]))
    for name, strategy in STRATEGIES.items():
        for field in dataclasses.fields(strategy.settings_class):
            assert field.name in defaults and defaults[field.name] is None, f"{name}.{field.name} has no flag"
    fields = setting_fields()
    assert fields["fetch_every"]["type"] is int and fields["overlap"]["type"] is bool
    assert fields["wire_dtype"]["strategies"] == ["allreduce", "average"]
    assert fields["push_every"]["help"] == "Steps between pushes of the accumulated gradients"


def test_flags_become_the_settings_the_strategy_checks():
    arguments = cli.build_parser().parse_args(
        ["train", "--strategy", "async", "--fetch-every", "16", "--no-overlap", "--compression", "topk",
         "--no-staleness-aware-lr"])
    settings = chosen_settings(arguments)
    assert settings == {"fetch_every": 16, "overlap": False, "compression": "topk", "staleness_aware_lr": False}
    made = make_settings("async", settings)
    assert (made.fetch_every, made.overlap, made.staleness_aware_lr) == (16, False, False)
    arguments = cli.build_parser().parse_args(["train", "--strategy", "average", "--wire-dtype", "fp8"])
    with pytest.raises(ValueError, match="wire_dtype='fp8' is not allowed"):
        make_settings("average", chosen_settings(arguments))
