"""Pure logic of live switches: the rendezvous decision, and optimizer state that survives re-splitting."""
from __future__ import annotations

import pytest
import torch

from workbench.comm.averaging import (fingerprint, flat_optimizer_state, join_optimizer_states, load_flat_optimizer_state,
                                 slice_optimizer_state)
from workbench.worker.switching import Position, SwitchRequest, decide


def control(version, switch_id=0, strategy="async", stop=False, **settings):
    return {"version": version, "paused": False, "stop": stop, "lr": 0.1, "strategy": strategy,
            "settings": settings, "switch_id": switch_id}


def test_the_newest_control_state_decides_strategy_and_settings():
    positions = [Position(40, False, False, control(3, 1, "average", period=4)),
                 Position(37, False, False, control(5, 1, "average", period=8)),  # a later period change
                 Position(45, True, False, control(2))]  # at its end, has not seen the switch
    decision = decide(positions, applied_switch_id=0)
    assert decision.switch == SwitchRequest(1, "average", {"period": 8})
    assert decision.target_step == 45 and not decision.stop and not decision.all_at_end
    assert not decision.finished


def test_a_switch_already_made_is_not_made_again_and_all_at_end_finishes():
    positions = [Position(100, True, False, control(5, 1, "average")), Position(100, True, False, control(4, 1, "average"))]
    decision = decide(positions, applied_switch_id=1)
    assert decision.switch is None and decision.all_at_end and decision.finished


@pytest.mark.parametrize("stopping,stop_flag", [(True, False), (False, True)])
def test_stop_wins_over_a_switch(stopping, stop_flag):
    positions = [Position(10, stopping, stopping, control(2)),
                 Position(12, False, False, control(3, 1, "average", stop=stop_flag))]
    decision = decide(positions, applied_switch_id=0)
    assert decision.stop and decision.switch is None


def test_positions_travel_as_json_messages():
    position = Position(7, True, False, control(1))
    assert Position.from_message(position.to_message()) == position
    with pytest.raises(ValueError):
        decide([], 0)


def trained_optimizer(kind):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    optimizer = (torch.optim.Adam(model.parameters(), lr=0.01) if kind == "adam"
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.randn(8, 5)).pow(2).sum().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("kind,keys", [("sgd", ["momentum_buffer"]), ("adam", ["exp_avg", "exp_avg_sq", "step"])])
def test_optimizer_state_moves_from_layers_to_one_flat_shard_and_back(kind, keys):
    model, optimizer = trained_optimizer(kind)
    flat = flat_optimizer_state(optimizer)
    assert sorted(flat) == keys
    numel = sum(p.numel() for p in model.parameters())
    # As a parameter server of two shards holds it, each shard's optimizer over one flat parameter:
    shards = []
    for start, stop in ((0, 20), (20, numel)):
        parameter = torch.nn.Parameter(torch.zeros(stop - start))
        shard_optimizer = type(optimizer)([parameter], lr=0.01)
        load_flat_optimizer_state(shard_optimizer, slice_optimizer_state(flat, start, stop))
        shards.append(flat_optimizer_state(shard_optimizer))
    joined = join_optimizer_states(shards)
    # ... and back into a fresh per-layer optimizer: every value equal to the original's.
    fresh_model, _ = trained_optimizer(kind)
    fresh = type(optimizer)(fresh_model.parameters(), lr=0.01)
    load_flat_optimizer_state(fresh, joined)
    for original, restored in zip(model.parameters(), fresh_model.parameters()):
        for key in keys:
            assert torch.equal(torch.as_tensor(optimizer.state[original][key]).float(),
                               torch.as_tensor(fresh.state[restored][key]).float())
    if kind == "adam":
        assert float(fresh.state[next(iter(fresh_model.parameters()))]["step"]) == 3.0


def test_no_state_yet_is_an_empty_carry_and_a_wrong_size_is_refused():
    model = torch.nn.Linear(3, 2)
    assert flat_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)) == {}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="momentum_buffer"):
        load_flat_optimizer_state(optimizer, {"momentum_buffer": torch.zeros(5)})


def test_fingerprint_is_linear_so_an_average_is_recognisable():
    first, second = torch.randn(1000), torch.randn(1000)
    mean = [(a + b) / 2 for a, b in zip(fingerprint(first), fingerprint(second))]
    assert fingerprint((first.double() + second.double()) / 2) == pytest.approx(mean, rel=1e-9, abs=1e-9)
    assert fingerprint(first) != fingerprint(second)


# --- how the ranks agree: lockstep or each on its own (worker/agreement.py) ----------------------------

def _two_ranks(work):
    """`work(rank, transport)` on two ranks of an in-memory group (threads), their results by rank."""
    from concurrent.futures import ThreadPoolExecutor

    from workbench.testing import ThreadGroup, ThreadTransport
    group = ThreadGroup(2, timeout_s=10)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(work, rank, ThreadTransport(group, rank, None)) for rank in range(2)]
        return [future.result(timeout=20) for future in futures]


def test_lockstep_ranks_take_rank_zeros_control_state_and_interval_and_independent_ranks_their_own():
    from workbench.plane.control import ControlState
    from workbench.worker.agreement import Independent, Lockstep

    def agree(policy):
        def work(rank, comm):
            own = ControlState(lr=0.1 * (rank + 1), strategy="allreduce", settings={})
            state, interval = policy.agree(comm, rank, own, lambda: 7 + rank)
            return state.lr, interval
        return work

    assert _two_ranks(agree(Lockstep())) == [(0.1, 7), (0.1, 7)]
    assert _two_ranks(agree(Independent())) == [(0.1, 1), (0.2, 1)]


def test_the_policy_follows_the_strategy_and_meeting_points_are_never_reused_across_switches():
    from workbench.strategies import get_strategy, make_settings
    from workbench.worker.agreement import Agreements

    def work(rank, comm):
        agreements = Agreements()
        points = []
        for name in ("async", "allreduce", "ssp"):  # async -> allreduce -> ssp, as switches would go
            policy = agreements.for_strategy(get_strategy(name)(make_settings(name, {})))
            assert policy.meet(comm, lambda: False)
            points.append((type(policy).__name__, getattr(policy, "meetings", None),
                           policy.checkpoints_together, policy.periodic_checkpoint(rank)))
        return points

    rank0, rank1 = _two_ranks(work)
    assert [p[:3] for p in rank0] == [("Independent", 1, False), ("Lockstep", None, True), ("Independent", 2, False)]
    assert [p[3] for p in rank0] == [True, True, True]
    assert [p[3] for p in rank1] == [False, True, False]  # alone from the server: rank 0 only
