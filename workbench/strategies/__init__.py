"""The strategy registry: every strategy by name. The UI's strategy list is filled from here."""
from __future__ import annotations

from typing import Any

from workbench.errors import ConfigError
from workbench.strategies.allreduce import AllReduce
from workbench.strategies.average import Average
from workbench.strategies.base import Strategy, StrategySettings, TrainingContext, build_settings
from workbench.strategies.parameter_server import AsyncSGD, ElasticAveraging, StaleSynchronous

STRATEGIES: dict[str, type[Strategy]] = {}


def register(strategy_class: type[Strategy]) -> type[Strategy]:
    """Add a strategy class under its `name` (usable as a decorator)."""
    STRATEGIES[strategy_class.name] = strategy_class
    return strategy_class


for _strategy in (AllReduce, Average, AsyncSGD, StaleSynchronous, ElasticAveraging):
    register(_strategy)


def get_strategy(name: str) -> type[Strategy]:
    if name not in STRATEGIES:
        raise ConfigError("strategy", name, f"one of {sorted(STRATEGIES)}")
    return STRATEGIES[name]


def suggested_sgd(name: str) -> dict[str, Any]:
    """The SGD learning rate, momentum and learning-rate schedule strategy `name` trains well with by
    default, as `Job` fields."""
    traits = get_strategy(name).traits
    return {"lr": traits.suggested_lr, "momentum": traits.suggested_momentum, "lr_schedule": traits.suggested_schedule}


def make_settings(name: str, values: dict[str, Any]) -> StrategySettings:
    """Validated settings of strategy `name`, raising `ConfigError` for unknown or bad values."""
    return build_settings(get_strategy(name), values)


__all__ = ["STRATEGIES", "Strategy", "StrategySettings", "TrainingContext", "get_strategy", "make_settings", "register",
           "suggested_sgd"]
