"""The vocabulary of what a run records: every message kind and every field of a step record, named
once with what it means.

Workers, the client's supervisor and the announcements on the scheduler all write records with a
`kind`; the run directory, `run.events(kind)`, the panel and the dashboard read them. Code names kinds
through these constants, never as bare strings (`tests/unit/test_kinds.py` holds this), so a kind cannot be
misspelt on one side and silently never match on the other.
"""
from __future__ import annotations

# --- from the workers, on the run's topic ------------------------------------------------------------
STEPS = "steps"  # a batch of step records from one worker (expanded to STEP records on arrival)
BATCHES = "batches"  # several workers' messages forwarded as one (`messages`): fewer at the scheduler
STEP = "step"  # one worker's step: the fields in metrics.STEP_FIELDS plus the strategy's own
EVAL = "eval"  # a held-out evaluation by rank 0
WORKER_STARTED = "worker-started"  # a rank began: address, pid, host, device
RESTORED = "restored"  # a rank started from a checkpoint holds its state (weights, optimizer, strategy)
WORKER_FINISHED = "worker-finished"  # a rank ended its group normally (`stopped` if asked to)
WORKER_FAILED = "worker-failed"  # a rank raised: the error and its step
WORKER_LEFT = "worker-left"  # a rank left a group the client ended (a regroup)
PAUSED = "paused"  # a rank paused at the agreed step
RESUMED = "resumed"  # a rank went on after a pause
CHANGED = "changed"  # a rank applied a learning-rate or live-setting change
SWITCHED = "switched"  # a rank changed strategy (or the client, for a switch made at a regroup)
CHECKPOINT_READY = "checkpoint-ready"  # rank 0 holds a checkpoint for the client to fetch
DEADLINE_APPLIED = "deadline-applied"  # a rank set the run's timeout in force on its waits (`timeout_s`)

# --- from the client, on the run's topic or in the run directory --------------------------------------
RUN_STARTED = "run-started"
RUN_RESUMED = "run-resumed"  # started again from a checkpoint (`from_step`)
RUN_FINISHED = "run-finished"
RUN_STOPPED = "run-stopped"
RUN_FAILED = "run-failed"
RUN_ENDED = (RUN_FINISHED, RUN_STOPPED, RUN_FAILED)
RUN_ENDED_AS = {"finished": RUN_FINISHED, "stopped": RUN_STOPPED, "failed": RUN_FAILED}  # by final status
CONTROL = "control"  # what the user asked for (lr, settings, switch), as they asked it
CONTROL_REQUEST = "control-request"  # another client's request and its outcome
GENERATION_STARTED = "generation-started"  # a group of workers started (the first, or after a regroup)
WORKER_LOST = "worker-lost"  # a rank's worker went away or got stuck
WORKER_JOINED = "worker-joined"  # a worker joined the cluster during the run
JOIN_REFUSED = "join-refused"  # a joined worker could not be added (held, or the batch does not fit)
REGROUPED = "regrouped"  # the run goes on with other workers (lost or joined)
RECOVERED = "recovered"  # a regroup after lost workers is over: its timed phases (run/recovery.py)
DEADLINE = "deadline"  # the timeout in force changed: measured, back to unmeasured, or set (plane/deadline.py)
CHECKPOINT = "checkpoint"  # a checkpoint was written (path, step)
CHECKPOINT_REFUSED = "checkpoint-refused"  # a checkpoint held NaN or infinity and was not written
TRAINING_WARNING = "training-warning"  # the loss watch: not learning, loss climbing
AUTO_DECISION = "auto-decision"  # `auto` switched the run: from, to, settings, lr, reason, its window, what it measured
AUTO_PINNED = "auto-pinned"  # a strategy chosen by hand turned `auto` off
AUTO_ON = "auto-on"  # switch('auto'): `auto` chooses again (after a pin, or on a run started otherwise)

# --- announcements on the scheduler's runs topic (registry.RUNS_TOPIC) ---------------------------------
RUN_QUEUED = "run-queued"  # waits for free workers
RUN_REGISTERED = "run-registered"  # began training: its config
RUN_STATUS = "run-status"  # a new status

# A rank is done with its group once it said one of these.
RANK_ENDED = (WORKER_FINISHED, WORKER_FAILED, WORKER_LEFT)

# --- the fields of a step record ------------------------------------------------------------------------
STEP_FIELDS = {  # every step, every strategy (the loop's own)
    "worker": "rank", "step": "the rank's step", "epoch": "epoch of its shard", "time": "when it ended (s, epoch)",
    "loss": "training loss of the batch", "samples": "samples in the batch",
    "compute_s": "forward, backward and optimizer", "comm_s": "communication the step waited for",
    "wait_s": "agreeing on control state, or held at the SSP bound", "lr": "learning rate used",
    "strategy": "the strategy that made the step",
    "cpu_s": "the worker process's CPU time, all threads, since its previous step (the first: since the loop began)",
}
STRATEGY_FIELDS = {  # added by the strategies (and on GPUs by the loop), at the steps they apply to
    "bytes_sent": "bytes this rank put on the wire for the step (or its push)",
    "bytes_received": "bytes of the server's reply, as compressed",
    "comm_total_s": "the exchange's whole time, hidden part included",
    "steps_since_sync": "average: local steps since the last averaging",
    "divergence": "average: relative L2 distance from the mean weights at a sync",
    "exchange_s": "allreduce and average: how long the exchange took, whole (with overlap: in flight, whole)",
    "settled_s": "average with overlap: the part of comm_s spent waiting for the exchange in flight at the "
                 "control point one step before its sync (the rest of exchange_s ran hidden)",
    "clock": "parameter server: this rank's windows pushed",
    "staleness": "parameter server: server versions since this rank's weights",
    "server_version": "parameter server: the version its reply carried",
    "clock_gap": "parameter server: clocks ahead of the slowest rank when it went on",
    "gpu_memory_mb": "GPU: memory allocated", "gpu_utilization": "GPU: utilisation (NVML)",
}

KINDS = frozenset(value for name, value in dict(globals()).items() if name.isupper() and isinstance(value, str))
