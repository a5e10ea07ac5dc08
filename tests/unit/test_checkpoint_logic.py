"""Pure checkpoint logic, no cluster: data position, finiteness, model checks, atomic files, and the
agreement on checkpoints asked for by the client."""

import threading
import time

import pytest
import torch

import workbench
from workbench.plane import checkpoint_format as checkpoints
from workbench.errors import ResumeError
from workbench.cluster.membership import _Dispatcher
from workbench.worker.switching import Position, decide


@pytest.mark.parametrize("step,per_epoch,expected", [(0, 10, (0, 0)), (9, 10, (0, 9)), (10, 10, (1, 0)),
                                                     (57, 10, (5, 7)), (3, 1, (3, 0))])
def test_the_data_position_follows_from_the_step(step, per_epoch, expected):
    assert checkpoints.data_position(step, per_epoch) == expected


def test_a_data_position_needs_whole_epochs():
    with pytest.raises(ValueError):
        checkpoints.data_position(5, 0)


def test_non_finite_values_are_found_anywhere_in_a_checkpoint():
    good = {"weights": {"a": torch.ones(3), "steps": torch.tensor([1, 2])}, "lr": 0.1, "ranks": [{"x": torch.zeros(2)}]}
    assert checkpoints.all_finite(good)
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not checkpoints.all_finite({**good, "ranks": [{"x": torch.tensor([0.0, bad])}]})
        assert not checkpoints.all_finite({**good, "lr": bad})
    assert checkpoints.all_finite({"name": "allreduce", "count": 3, "none": None})


def test_a_checkpoint_of_another_model_is_refused_naming_the_difference():
    model = workbench.mlp(64, 10, [32])()
    same = {"weights": model.state_dict()}
    checkpoints.check_matches_model(same, workbench.mlp(64, 10, [32])(), "c.pt")
    with pytest.raises(ResumeError, match="shapes differ") as caught:
        checkpoints.check_matches_model(same, workbench.mlp(64, 10, [16])(), "c.pt")
    assert caught.value.parameter == "checkpoint"
    with pytest.raises(ResumeError, match="missing"):
        checkpoints.check_matches_model({"weights": {}}, model, "c.pt")


def test_checkpoints_are_written_whole_or_not_at_all(tmp_path):
    path = tmp_path / checkpoints.CHECKPOINT_FILE
    first = {"step": 1, "weights": {"w": torch.ones(2)}}
    checkpoints.save(path, first)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("cannot save this")

    with pytest.raises(RuntimeError):
        checkpoints.save(path, {"step": 2, "weights": {"w": torch.zeros(2)}, "bad": Unpicklable()})
    kept = checkpoints.load(tmp_path)  # the first one, intact; no temporary file left
    assert kept["step"] == 1 and torch.equal(kept["weights"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == [checkpoints.CHECKPOINT_FILE]


def test_loading_says_what_is_wrong_with_a_run_directory(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ResumeError, match="checkpoint_every"):
        checkpoints.load(tmp_path)
    (tmp_path / checkpoints.CHECKPOINT_FILE).write_bytes(b"not a checkpoint")
    with pytest.raises(ResumeError, match="readable"):
        checkpoints.load(tmp_path)


def test_the_snapshot_store_hands_out_the_newest_checkpoint_once():
    checkpoints.leave_snapshot("run-x", {"step": 10})
    checkpoints.leave_snapshot("run-x", {"step": 20})
    assert checkpoints.take_snapshot("run-x") == {"step": 20}
    assert checkpoints.take_snapshot("run-x") is None


def test_rank_zero_goes_on_once_the_client_has_fetched_its_checkpoint():
    # A checkpoint left in rank 0's process is lost with it until the client has fetched it.
    left = {"step": 40}
    checkpoints.leave_snapshot("run-y", left)
    taken = []
    fetcher = threading.Timer(0.3, lambda: taken.append(checkpoints.take_snapshot("run-y")))
    fetcher.start()
    began = time.monotonic()
    assert checkpoints.wait_fetched("run-y", left, timeout_s=30, interrupted=lambda: False)
    waited = time.monotonic() - began
    fetcher.join(timeout=5)
    assert taken == [left] and 0.2 < waited < 5
    # Never fetched: back after the timeout; interrupted (pause, stop, switch): back at once.
    checkpoints.leave_snapshot("run-y", left)
    began = time.monotonic()
    assert not checkpoints.wait_fetched("run-y", left, timeout_s=0.3, interrupted=lambda: False)
    assert 0.25 < time.monotonic() - began < 5
    began = time.monotonic()
    assert not checkpoints.wait_fetched("run-y", left, timeout_s=30, interrupted=lambda: True)
    assert time.monotonic() - began < 1
    assert checkpoints.take_snapshot("run-y") is left  # still there for the client


def _position(step, checkpoint_id, at_end=False):
    return Position(step, at_end, False, {"version": checkpoint_id + 1, "checkpoint_id": checkpoint_id,
                                          "switch_id": 0, "stop": False})


def test_a_requested_checkpoint_is_taken_by_all_at_the_largest_step():
    decision = decide([_position(12, 1), _position(15, 0)], applied_switch_id=0, known_checkpoint_id=0)
    assert decision.checkpoint == 1 and decision.target_step == 15 and decision.switch is None
    assert decide([_position(12, 1), _position(15, 1)], 0, known_checkpoint_id=1).checkpoint is None


def test_membership_changes_reach_every_listener_and_nothing_else():
    heard = []
    dispatcher = _Dispatcher()
    dispatcher.listeners += [lambda action, address: heard.append((1, action, address)),
                             lambda action, address: 1 / 0,  # a broken listener does not stop the others
                             lambda action, address: heard.append((2, action, address))]
    dispatcher((0.0, {"action": "remove-worker", "worker": "tcp://a:1"}))
    dispatcher((0.0, {"action": "add-client", "client": "c"}))
    dispatcher((0.0, "not a dict"))
    assert heard == [(1, "remove-worker", "tcp://a:1"), (2, "remove-worker", "tcp://a:1")]


def test_lost_workers_and_regroups_are_marked_on_the_loss_chart():
    from workbench.plane.metrics import MetricsTable, control_markers

    events = [{"kind": "worker-lost", "worker": 2, "address": "tcp://w:3", "step": 57, "time": 5.0},
              {"kind": "regrouped", "worker": None, "workers": ["a", "b"], "from_step": 40, "time": 6.0,
               "reason": "workers lost"},
              {"kind": "worker-lost", "worker": 1, "address": "tcp://w:2", "step": None, "time": 7.0}]
    assert control_markers(events) == [
        {"kind": "regrouped", "step": 40, "time": 6.0, "label": "2 workers from step 40 (workers lost)"},
        {"kind": "worker-lost", "step": 57, "time": 5.0, "label": "lost tcp://w:3"}]
    table = MetricsTable()
    table.add([{"kind": "worker-started", "worker": 2, "address": "tcp://w:3", "time": 1.0}, events[0]])
    (row,) = table.live_view()["workers"]
    assert row["state"] == "lost"


def test_resuming_from_a_missing_empty_or_checkpointless_directory_says_which(tmp_path):
    from workbench.plane.checkpoint_format import load
    from workbench.errors import ResumeError

    (tmp_path / "empty").mkdir()
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "config.json").write_text("{}")
    (tmp_path / "a-file").write_text("")
    expected = {"missing": "No such directory", "empty": "It is empty", "a-file": "It is a file",
                "early": "ended before its first checkpoint"}
    for name, words in expected.items():
        with pytest.raises(ResumeError, match=f"^run_dir=.*{words}"):
            load(tmp_path / name)


# --- when ranks at their own pace checkpoint, and the step it is labelled with (worker/checkpoints.py) -----

def _loop_of_independent_ranks(strategy, rank=0, start_step=0, total_steps=1000, every=40):
    from types import SimpleNamespace

    from workbench.worker.agreement import Independent
    from workbench.worker.checkpoints import LoopCheckpoints
    task = SimpleNamespace(rank=rank, start_step=start_step, total_steps=total_steps, checkpoint_every_steps=every)
    loop = SimpleNamespace(task=task, step=start_step, strategy=strategy,
                           control=SimpleNamespace(agreement=Independent()))
    checkpoints = LoopCheckpoints(loop)
    checkpoints.strategy_started()
    return loop, checkpoints


def _server_strategy(name, world_size, version=0, **settings):
    from workbench.strategies import get_strategy, make_settings
    strategy = get_strategy(name)(make_settings(name, settings))
    strategy.world_size, strategy.start_version, strategy.known_version = world_size, version, version
    return strategy


def test_rank_zero_alone_checkpoints_when_the_groups_step_crosses_the_interval_not_its_own():
    # Three ranks pushing every 2 steps: 60 pushes are 120 steps of the group, 40 per rank on average.
    strategy = _server_strategy("async", world_size=3, push_every=2)
    loop, checkpoints = _loop_of_independent_ranks(strategy)
    loop.step = 25  # rank 0 lags (its worker serves the shard); the others went on
    strategy.known_version = 59
    assert checkpoints.group_step() == 39 and not checkpoints.due(None, 0)
    strategy.known_version = 60
    assert checkpoints.group_step() == 40 and checkpoints.due(None, 0)
    assert not checkpoints.due(None, 0)  # once per crossing
    strategy.known_version = 130  # 86 steps: the next multiple, 80, crossed once even when jumped past
    assert checkpoints.due(None, 0) and not checkpoints.due(None, 0)
    # Labelled with the group's step at the server version the checkpoint holds.
    assert checkpoints.group_step(version=75) == 50


def test_after_a_resume_or_a_switch_the_group_step_counts_on_from_where_the_strategy_started():
    # Resumed at step 80 with the server at version 300 (from the checkpoint): nothing due at once.
    strategy = _server_strategy("ssp", world_size=2, version=300, push_every=1)
    loop, checkpoints = _loop_of_independent_ranks(strategy, start_step=80, every=40)
    assert checkpoints.group_step() == 80 and not checkpoints.due(None, 0)
    strategy.known_version = 379
    assert checkpoints.group_step() == 119 and not checkpoints.due(None, 0)
    strategy.known_version = 380
    assert checkpoints.due(None, 0)
    # Never past the run's end, and never a periodic one at the end.
    loop.task.total_steps = 150
    strategy.known_version = 600
    assert checkpoints.group_step() == 150 and not checkpoints.due(None, 0)
    # Other ranks never take one alone.
    _, other = _loop_of_independent_ranks(_server_strategy("async", world_size=2, version=0), rank=1)
    other.loop.strategy.known_version = 500
    assert not other.due(None, 0)


def test_the_checkpoint_the_client_took_is_kept_for_the_next_group_as_a_copy_until_the_run_ends():
    first = {"step": 40, "generation": 0, "time": 1.0, "optimizer": {"exp_avg": torch.ones(3)}}
    newer = {"step": 80, "generation": 0, "time": 2.0, "optimizer": {"exp_avg": torch.full((3,), 2.0)}}
    checkpoints.leave_snapshot("run-k", first)
    assert not checkpoints.holds("run-k", checkpoints.identity(first))  # left, not taken: the client may never have it
    assert checkpoints.take_snapshot("run-k") is first
    assert checkpoints.holds("run-k", checkpoints.identity(first))
    checkpoints.leave_snapshot("run-k", newer)
    assert checkpoints.take_snapshot("run-k") is newer
    assert not checkpoints.holds("run-k", checkpoints.identity(first)) and checkpoints.holds("run-k", (0, 80, 2.0))
    # What a group starts from is a copy: the optimizer's state aliases the tensors it loads, and training
    # must not change what a later regroup starts from again.
    resolved = checkpoints.KeptCheckpoint("run-k", (0, 80, 2.0)).resolve()
    resolved["optimizer"]["exp_avg"].add_(1.0)
    assert checkpoints.KeptCheckpoint("run-k", (0, 80, 2.0)).resolve()["optimizer"]["exp_avg"].tolist() == [2.0] * 3
    assert not checkpoints.holds("run-other", (0, 80, 2.0))
    checkpoints.forget("run-k")
    assert not checkpoints.holds("run-k", (0, 80, 2.0))
    with pytest.raises(workbench.WorkbenchError, match="run-k at step 80 that this worker kept is gone"):
        checkpoints.KeptCheckpoint("run-k", (0, 80, 2.0)).resolve()


def test_a_checkpoint_sent_to_keep_is_kept_unless_a_newer_one_is():
    older = {"step": 40, "generation": 0, "time": 1.0, "weights": {}}
    newer = {"step": 80, "generation": 0, "time": 2.0, "weights": {}}
    regrouped = {"step": 60, "generation": 1, "time": 3.0, "weights": {}}
    assert checkpoints.keep_copy("run-c", newer) and checkpoints.holds("run-c", checkpoints.identity(newer))
    # One sent late (a slow link) does not replace a newer one the worker took itself or was sent.
    assert not checkpoints.keep_copy("run-c", older) and checkpoints.holds("run-c", checkpoints.identity(newer))
    # A later group's checkpoint is newer whatever its step (the group after a regroup restarts from one).
    assert checkpoints.keep_copy("run-c", regrouped) and checkpoints.holds("run-c", (1, 60, 3.0))
    checkpoints.forget("run-c")
    assert not checkpoints.holds("run-c", (1, 60, 3.0))


class _Done:
    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        return self.value

    def release(self):
        pass


class _ClientWhoseSendsHang:
    """Hands out the checkpoints rank 0 left; sending one to the other workers hangs until `unblock`."""

    def __init__(self, snapshots):
        self.snapshots, self.unblock, self.sends = list(snapshots), threading.Event(), []

    def submit(self, function, *args, **kwargs):
        if function is checkpoints.take_snapshot:
            return _Done(self.snapshots.pop(0))
        return _Done(function(*(a.value if isinstance(a, _Done) else a for a in args)))  # keep_copy, run here

    def scatter(self, data, workers, **kwargs):
        self.sends.append((data[0]["step"], list(workers)))
        self.unblock.wait(kwargs["timeout"])
        return [_Done(data[0])]

    def run(self, *args, **kwargs):
        return {}


def test_a_send_to_the_other_workers_never_holds_up_the_next_checkpoint(tmp_path):
    """Rank 0 waits for the client to fetch each checkpoint: a send that hangs (a worker lost meanwhile)
    must not delay the next fetch, and the copy newest when the send ends is the one sent next."""
    from workbench.run.checkpoints import CheckpointStore

    taken = [{"step": s, "generation": 0, "time": float(s), "weights": {"w": torch.ones(1)}} for s in (10, 20, 30)]
    client, store = _ClientWhoseSendsHang(taken), CheckpointStore(None, None)
    store.open(tmp_path, lambda message: None)
    writer = threading.Thread(target=store.write_ready, daemon=True,
                              args=(client, "run-s", 30.0, lambda: (0, ["tcp://rank0", "tcp://rank1"])))
    writer.start()
    for step in (10, 20, 30):
        store.ready({"generation": 0, "step": step})
        deadline = time.monotonic() + 10  # fetched and written at once, while the first send still hangs
        while (store.info is None or store.info["step"] != step) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.info["step"] == step and store.info["kept_on"] == ["tcp://rank0"]
    assert client.sends == [(10, ["tcp://rank1"])]
    client.unblock.set()  # the hung send ends: 20 was replaced meanwhile, 30 is sent and kept there
    deadline = time.monotonic() + 10
    while store.info["kept_on"] != ["tcp://rank0", "tcp://rank1"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.sends == [(10, ["tcp://rank1"]), (30, ["tcp://rank1"])]
    assert store.info["kept_on"] == ["tcp://rank0", "tcp://rank1"] and store.kept_by == {"tcp://rank0", "tcp://rank1"}
    assert checkpoints.holds("run-s", checkpoints.identity(taken[2]))
    store.close()
    writer.join(timeout=10)
    assert not writer.is_alive()
    checkpoints.forget("run-s")
