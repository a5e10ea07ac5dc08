"""Starting a group of workers for a run: which workers, where the data goes, and one task per rank.

`launch` places the training data (scattered once per worker, or for a Dask array the blocks each worker
already holds), picks a free port on rank 0's machine for the process group, and submits one long-lived
`train_on_worker` task per rank, pinned to its worker, starting from a checkpoint or the job's initial
weights. The checks before that (client, worker count, batch size against the shards) live here too.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from typing import Any

from distributed import Client
from distributed.comm import get_address_host

from workbench.comm import collectives
from workbench.data import BuiltinData, DaskArrayData, DataSource
from workbench.errors import ClusterError, ConfigError
from workbench.job import Job, PreparedJob
from workbench.plane import checkpoint_format as checkpoints, relay as metrics_relay
from workbench.plane.control import ControlState
from workbench.sharding import assign_blocks, shard_size
from workbench.strategies import make_settings
from workbench.worker.loop import WorkerTask, train_on_worker


class FutureWatch:
    """Waits on Dask futures through their own client's done-callbacks.

    `distributed.wait` would use the process's *default* client, which is whichever client was created
    last (a dashboard's, another notebook cell's) and may run on another event loop.
    """

    def __init__(self, futures: list[Any]) -> None:
        self._futures = futures
        self._changed = threading.Condition()
        for future in futures:
            future.add_done_callback(self._notify)

    def _notify(self, _future: Any) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait(self, until_first_error: bool = False, timeout: float | None = None) -> bool:
        """True when all futures are done (or, with `until_first_error`, one has failed) in time."""
        def settled() -> bool:
            if until_first_error and any(f.status == "error" for f in self._futures):
                return True
            return all(f.done() for f in self._futures)

        with self._changed:
            return self._changed.wait_for(settled, timeout=timeout)


@dataclasses.dataclass
class Group:
    """One group of workers training the run together (a generation)."""

    generation: int
    addresses: list[str]
    futures: list[Any]
    total_steps: int
    shard_samples: int
    start_step: int  # the smallest any rank starts from
    started: float = dataclasses.field(default_factory=time.time)  # when it was launched (wall clock)


@dataclasses.dataclass
class LaunchOptions:
    """The run's options every group of workers gets."""

    run_id: str
    collective_timeout_s: float
    checkpoint_every_steps: int | None
    step_delays: dict[int, float]
    sample_delays: dict[int, float] = dataclasses.field(default_factory=dict)


def resolve_client(client: Client | None) -> Client:
    if client is not None:
        if not isinstance(client, Client):
            raise ConfigError("client", client, "a distributed.Client, e.g. from workbench.connect()")
        return client
    try:
        from distributed import get_client

        return get_client()
    except ValueError:
        raise ConfigError("client", None, "a Dask client",
                          "Start one with client = workbench.connect() and pass client=client") from None


def present_workers(client: Client) -> list[str]:
    """The addresses of every worker the scheduler knows now, asked of the scheduler itself.

    Not `client.scheduler_info(n_workers=-1)`: that returns the client's cached identity after refreshing
    it, and the client's own refresh every 2 s (`scheduler-info-interval`, asking for 0 workers) can land
    between the two, so under load it now and then said the cluster had no workers (seen in a full test
    run: a run refused at start, and a regroup would have counted every worker lost).
    """
    return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def wanted_workers(client: Client, requested: int | None) -> int:
    """How many workers the run asks for: `requested`, or as many as the cluster has."""
    present = len(present_workers(client))
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise ConfigError("workers", requested, "an integer >= 1")
    if not present:
        raise ClusterError("the cluster has no workers; start some (dask worker ADDRESS) and try again")
    if requested is not None and requested > present:
        raise ConfigError("workers", requested, f"at most {present}, the workers in this cluster",
                          "Start more workers or ask for fewer")
    return present if requested is None else requested


def check_world(prepared: PreparedJob, strategy_class: Any, settings: Any, workers: int, min_workers: int) -> None:
    """Everything the number of workers decides, checked before a worker is asked for (the CLI: before
    its embedded cluster starts)."""
    if min_workers > workers:
        raise ConfigError("min_workers", min_workers, f"at most {workers}, the run's workers")
    strategy_class.check_world(settings, workers)
    check_batch_fits(prepared, workers)
    if getattr(settings, "balance", False):
        check_can_balance(prepared)


def check_can_balance(prepared: PreparedJob) -> None:
    """A batch is shared out by speed only where every worker can index the whole dataset."""
    if isinstance(prepared.train, DaskArrayData):
        raise ConfigError("balance", True, "False with a Dask array as the data: each worker trains on the blocks "
                          "it holds, so a step's batch cannot be shared out by speed",
                          "Pass the data as a dataset or tensors to balance")


def check_batch_fits(prepared: PreparedJob, world_size: int) -> None:
    if isinstance(prepared.train, DaskArrayData):
        return  # shards follow where the blocks are; checked when they are placed
    check_batch_fits_shard(prepared.job.batch_size, shard_size(len(prepared.train), world_size), world_size)


def check_batch_fits_shard(batch_size: int, shard_samples: int, world_size: int) -> None:
    if batch_size > shard_samples:
        raise ConfigError("batch_size", batch_size,
                          f"at most {shard_samples}, the samples in each of the {world_size} workers' shards",
                          "Lower batch_size or use fewer workers")


def rescaled_step(checkpoint: dict[str, Any], world_size: int, steps_per_epoch: int, job: Job) -> int:
    """Where a group of another size starts: at the same share of the data seen (epochs of the run),
    unless the job counts steps per worker (`steps=`), which it keeps."""
    old_steps_per_epoch, old_world = checkpoint.get("steps_per_epoch"), checkpoint.get("world_size")
    if job.steps is not None or not old_steps_per_epoch or not old_world:
        return checkpoint["step"]
    epoch, batch = checkpoints.data_position(checkpoint["step"], old_steps_per_epoch)
    return epoch * steps_per_epoch + min(steps_per_epoch - 1, batch * old_world // world_size)


def launch(client: Client, prepared: PreparedJob, job: Job, state: ControlState, addresses: list[str],
           checkpoint: dict[str, Any] | None, generation: int, options: LaunchOptions,
           kept_by: set[str] | frozenset[str] = frozenset()) -> Group:
    """Start group `generation` on `addresses` from `checkpoint` (or the job's initial weights), with the
    run's current learning rate, strategy and settings (`state`). `kept_by`: workers that may keep
    `checkpoint` in memory already (taken from there, or sent there): where one does, it is not sent again."""
    world_size = len(addresses)
    train_payload, shard_samples, local = _place_training_data(client, prepared.train, addresses)
    check_batch_fits_shard(prepared.job.batch_size, shard_samples, world_size)
    total_steps = prepared.total_steps(shard_samples)
    settings = make_settings(state.strategy, state.settings)
    # The data reaches the workers scattered once (or generated there), never inside every task: a job
    # holding tensors would otherwise travel in the graph, once per rank (Dask's "large graph" warning).
    job = dataclasses.replace(job, lr=state.lr if state.lr is not None else job.lr, data=None, eval_data=None)
    ranks = (checkpoint or {}).get("ranks") or []
    same_world = len(ranks) == world_size
    steps_per_epoch = shard_samples // prepared.job.batch_size
    saved = _send_checkpoint(client, options.run_id, checkpoint, kept_by, addresses)
    # Every run has a process group (see worker/loop.py), on a port free on rank 0's machine.
    host = get_address_host(addresses[0])
    port = client.run(collectives.find_free_port, workers=[addresses[0]])[addresses[0]]
    eval_payload = _scatter(client, prepared.evaluation, addresses[:1])[addresses[0]]
    launched = uuid.uuid4().hex[:6]  # task keys never repeat, even for a run resumed under its old id
    relays = metrics_relay.relay_addresses(addresses, metrics_relay.relay_from())
    if any(relays):
        client.run(metrics_relay.install, workers=sorted({r for r in relays if r}))
    futures, starts = [], []
    for rank, address in enumerate(addresses):
        start_step = (ranks[rank]["step"] if same_world else
                      rescaled_step(checkpoint, world_size, steps_per_epoch, prepared.job)) if checkpoint else 0
        task = WorkerTask(
            run_id=options.run_id, rank=rank, world_size=world_size, job=job, strategy=state.strategy,
            settings=settings, shard_samples=shard_samples, total_steps=total_steps,
            local_data=local, master_host=host, master_port=port,
            collective_timeout_s=options.collective_timeout_s, addresses=addresses,
            step_delay_s=options.step_delays.get(rank, 0.0), sample_delay_s=options.sample_delays.get(rank, 0.0),
            generation=generation,
            start_step=start_step, checkpoint_every_steps=options.checkpoint_every_steps,
            applied_switch=state.switch_id, known_checkpoint=state.checkpoint_id, metrics_relay=relays[rank],
        )
        data = train_payload[address]
        starts.append(start_step)
        futures.append(client.submit(
            train_on_worker, task, data, eval_payload if rank == 0 else None, saved.get(address),
            key=f"workbench-{options.run_id}-g{generation}-{launched}-rank-{rank}", workers=[address],
            allow_other_workers=False, pure=False, retries=0,
        ))
    return Group(generation, list(addresses), futures, total_steps, shard_samples, min(starts))


def _send_checkpoint(client: Client, run_id: str, checkpoint: dict[str, Any] | None, kept_by: set[str] | frozenset[str],
                     addresses: list[str]) -> dict[str, Any]:
    """Per worker, what it starts from: a reference to the checkpoint where it keeps it (`kept_by`, asked
    first: a worker restarted under the same address keeps nothing), else the checkpoint, scattered once."""
    if checkpoint is None:
        return {}
    wanted = checkpoints.identity(checkpoint)
    saved: dict[str, Any] = {}
    asked = [a for a in addresses if a in kept_by]
    if asked:
        try:
            answers = client.run(checkpoints.holds, run_id, wanted, workers=asked, on_error="return")
            saved.update({a: checkpoints.KeptCheckpoint(run_id, wanted) for a in asked if answers.get(a) is True})
        except Exception:  # gone meanwhile: they are sent the checkpoint like every other worker
            pass
    saved.update(scatter_to_each(client, checkpoint, [a for a in addresses if a not in saved]))
    return saved


def scatter_to_each(client: Client, value: Any, addresses: list[str], timeout: float | None = None) -> dict[str, Any]:
    """A future per worker for `value`, sent to each worker on its own. Not `scatter(broadcast=True)`: the
    scheduler then replicates under a lock it shares with every replication, and a worker that dies while
    it copies there is retried for ever, so that every later broadcast scatter (the next regroup's) waited
    behind it (seen in a full test run: a run killed mid-copy never regrouped)."""
    # In a list: a dict scattered alone would come back as a dict of futures, one per key.
    return {address: client.scatter([value], workers=[address], hash=False, timeout=timeout)[0] for address in addresses}


def _place_training_data(client: Client, source: DataSource, addresses: list[str]):
    """Where the training data goes: (payload per worker, common shard size, whether shards are worker-local)."""
    if isinstance(source, DaskArrayData):
        return _assign_dask_blocks(client, source, addresses)
    return _scatter(client, source, addresses), shard_size(len(source), len(addresses)), False


def _scatter(client: Client, source: DataSource | None, addresses: list[str]) -> dict[str, Any]:
    """Per worker, the data it trains or evaluates on: built-in data is generated on the workers; only
    user data travels, once per worker."""
    if source is None or isinstance(source, BuiltinData):
        return {address: source for address in addresses}
    return scatter_to_each(client, source, addresses)


def _assign_dask_blocks(client: Client, source: DaskArrayData, addresses: list[str]):
    inputs = source.inputs
    targets = source.targets.rechunk((inputs.chunks[0],) + source.targets.chunks[1:])
    input_blocks = client.compute(list(inputs.to_delayed().ravel()))
    target_blocks = client.compute(list(targets.to_delayed().ravel()))
    FutureWatch(input_blocks + target_blocks).wait()
    holders = client.who_has(input_blocks)
    block_rows = list(inputs.chunks[0])
    assignment = assign_blocks(block_rows, [set(holders.get(f.key, ())) for f in input_blocks], addresses)
    shard_samples = min(sum(block_rows[i] for i in blocks) for blocks in assignment.values())
    payload = {address: ([input_blocks[i] for i in blocks], [target_blocks[i] for i in blocks])
               for address, blocks in assignment.items()}
    return payload, shard_samples, True
