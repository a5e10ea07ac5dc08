"""A teammate on a shared cluster, as its own process: for each round, waits for the round's Dask Event
(so that teammates start at the same moment), starts a run, and reports on the `outcomes` Dask Queue
what happened (started, queued or refused, then how the run ended).

    python teammate.py SCHEDULER NAME ROUNDS RUN_DIR TAG

Names are the test's TAG then: `-go-<i>` (the round's Event), `-round-<i>` (a Variable with the round's
settings: {"workers", "queue", "epochs", "last"}) and `-outcomes` (the Queue).
Used by tests/cluster/test_shared_cluster.py.
"""
import sys

from distributed import Event, Queue, Variable

import workbench
from workbench.strategies import suggested_sgd


def main(address: str, name: str, rounds: int, run_dir: str, tag: str) -> None:
    client = workbench.connect(scheduler=address)
    outcomes = Queue(f"{tag}-outcomes", client=client)
    outcomes.put({"name": name, "kind": "ready"})
    for index in range(rounds):
        Event(f"{tag}-go-{index}", client=client).wait(timeout=120)
        plan = Variable(f"{tag}-round-{index}", client=client).get(timeout=10)
        job = workbench.Job(model=workbench.mlp(64, 10), data="digits", batch_size=8, epochs=plan["epochs"],
                            **suggested_sgd("allreduce"))
        report = {"name": name, "round": index, "kind": "start"}
        try:
            run = workbench.train(job, "allreduce", client=client, workers=plan["workers"], queue=plan["queue"],
                                  owner=name, run_dir=run_dir, checkpoint_every_s=None)
        except workbench.ConfigError as error:
            outcomes.put({**report, "outcome": "refused", "error": str(error)})
            continue
        outcomes.put({**report, "outcome": run.status, "run_id": run.run_id, "position": run.queue_position})
        status = run.wait(timeout=300)
        end = {"name": name, "round": index, "kind": "end", "run_id": run.run_id, "status": status,
               "workers": run.config["workers"], "queued_s": run.config["queued_s"],
               "steps": run.summary().get("steps_done"), "total_steps": run.total_steps}
        if plan.get("last"):
            end["accuracy"] = run.evaluate()["accuracy"]
        outcomes.put(end)
    client.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
