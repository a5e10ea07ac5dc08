"""The strategy protocol's shape: what the loop may ask of every registered strategy before, without and
after `setup`, and its traits declared once per class, frozen."""
from __future__ import annotations

import dataclasses

import pytest

from workbench.strategies import STRATEGIES, suggested_sgd
from workbench.strategies.base import Traits


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_a_strategy_whose_setup_never_ran_closes_cleanly(name):
    # The model factory failed on a worker: the loop still closes the strategy it made. Every attribute
    # close reads is declared in __init__, none read with getattr as if it might not be there.
    strategy = STRATEGIES[name](STRATEGIES[name].settings_class())
    strategy.close()
    strategy.close()  # twice: the loop's error path may close again


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_traits_are_declared_once_per_class_and_frozen(name):
    traits = STRATEGIES[name].traits
    assert isinstance(traits, Traits) and traits.summary
    with pytest.raises(dataclasses.FrozenInstanceError):
        traits.uses_process_group = not traits.uses_process_group
    assert suggested_sgd(name) == {"lr": traits.suggested_lr, "momentum": traits.suggested_momentum,
                                   "lr_schedule": traits.suggested_schedule}


def test_the_traits_say_how_each_strategy_meets_the_others():
    synchronous = {n for n, c in STRATEGIES.items() if c.traits.uses_process_group}
    assert synchronous == {"allreduce", "average"}
    assert {n for n, c in STRATEGIES.items() if c.traits.takes_own_weights} == {"easgd"}
    assert {n for n, c in STRATEGIES.items() if c.traits.own_optimizer_states} == {"average", "easgd"}
    assert STRATEGIES["ssp"].traits.suggested_lr == STRATEGIES["async"].traits.suggested_lr == 0.5
    assert {n for n, c in STRATEGIES.items() if c.traits.suggested_schedule == "cosine"} == {"async", "ssp"}
