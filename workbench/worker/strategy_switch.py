"""Making an agreed strategy switch on one rank: the old strategy hands its weights and optimizer state
over (`carry_out`), its services close once every rank holds them, and the new one takes them (`carry_in`).

The control point (`worker/control_point.py`) decides when; the loop calls `switch_strategy` and keeps
the strategy it returns. The record it returns (the `switched` event) carries fingerprints of the weights
before and after, so that anyone can check from the metrics that every rank starts the new strategy from
the same weights (or, each with its own, over the same common base), and where the switch's time went.
"""
from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any, Callable

import torch

from workbench.comm.averaging import fingerprint, flatten
from workbench.strategies import Strategy, TrainingContext, get_strategy, make_settings
from workbench.worker.switching import SwitchRequest


def switch_strategy(old: Strategy, request: SwitchRequest, context: TrainingContext, comm: Any,
                    new_optimizer: Callable[[], None]) -> tuple[Strategy, dict[str, Any]]:
    """Change from `old` to the strategy `request` names, carrying the weights and optimizer state over.
    `new_optimizer` is called once the new strategy's optimizer is in place (the loop sets its lr).
    Returns the new strategy and the fields of the `switched` event."""
    started = time.perf_counter()
    parts: dict[str, float] = {}  # where the switch's time went (on a slow link: the exchanges in it)
    marks = [started]

    def lap(part: str) -> None:
        marks.append(time.perf_counter())
        parts[part] = round(marks[-1] - marks[-2], 3)

    before = fingerprint(flatten(list(context.model.parameters())))
    new_class = get_strategy(request.strategy)
    # Between two local-SGD strategies each worker goes on with its own optimizer state and, where the
    # old one keeps a common base and the new one can start from it, its own weights: what it would have
    # gone on with, and no model-sized exchange to bring the workers together first.
    own = old.traits.own_optimizer_states and new_class.traits.own_optimizer_states
    common = old.common_base(context) if own and new_class.traits.takes_own_weights else None
    if common is None:
        old.finish(context)  # common weights: averaged, or the server's
    lap("finish")
    carried = old.carry_out(context, own_state=own)
    carried.common = common
    lap("carry_out")
    comm.barrier()  # every rank holds the carried state before the old services go
    old.close()
    if not old.traits.uses_process_group:
        gc.collect()  # the closures Dask's actor calls left hold the old server's shards (see its `close`)
    lap("close")
    settings = make_settings(request.strategy, request.settings)
    new = new_class(settings)
    context.optimizer = new.local_optimizer(context.job, context.model.parameters())
    new_optimizer()
    new.carry_in(context, carried)
    new.setup(context)
    lap("setup")
    event = {"switch_id": request.switch_id, "settings": dataclasses.asdict(settings),
             "took_s": time.perf_counter() - started, "parts_s": parts,
             "carried_optimizer_state": sorted(carried.optimizer_state), "weights_before": before,
             "weights_after": fingerprint(flatten(list(context.model.parameters()))),
             "optimizer_state_after": _state_print(carried.optimizer_state),
             "common_weights": fingerprint(common) if common is not None else None,
             "from": old.name, "to": new.name}
    return new, event


def _state_print(state: dict[str, Any]) -> list[float] | None:
    """The carried optimizer state's fingerprint (its tensors), to tell a common state from each worker's own."""
    tensors = [value for value in state.values() if isinstance(value, torch.Tensor)]
    return fingerprint(flatten(tensors)) if tensors else None
