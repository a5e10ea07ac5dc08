"""Watching a run's workers from the client until the run ends: one thread per run.

It waits for the current group's tasks, notes lost and joined workers, asks for timed checkpoints, and
when a group ends carries out what `run/regroup.py` decides: go on with the survivors or a larger group from
the latest checkpoint, or end the run (finished, stopped, failed) and write its summary. A run waiting
in the cluster's queue is started from here once its workers are free. Losing the scheduler ends the
run, saying where its last checkpoint is.

Who was lost or joined is kept by `run/members.py` (`Members`), which the supervisor ticks.
The supervisor owns the group training now (`group`); it reads the run's settings and parts and changes
the run's record only through its lifecycle (status, `fail_with`, `keep_final_weights`).
"""
from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from distributed.scheduler import KilledWorker

from workbench.cluster.announcements import requests_topic
from workbench.errors import DivergenceError
from workbench.plane import checkpoint_format, deadline, kinds
from workbench.plane.metrics import topic
from workbench.plane.rundir import SUMMARY_FILE
from workbench.run import recovery, regroup
from workbench.run.timeouts import TimeoutKeeper, in_force
from workbench.run.launcher import FutureWatch, Group, LaunchOptions, launch, present_workers
from workbench.run.members import Members

if TYPE_CHECKING:  # the handle imports this module: the type alone, no import cycle at run time
    from workbench.run.handle import Run

SUPERVISION_TICK_S = 0.25  # how often the supervisor looks at membership, checkpoints due and joins
SCHEDULER_LOST_AFTER_S = 3.0  # cut off from the scheduler this long, the run is over (its state is gone)


class SchedulerLost(Exception):
    """The client lost its scheduler while supervising the run."""


class Supervisor:
    """Starts groups of workers for `run` and watches them; `thread` runs `supervise`."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.group: Group | None = None  # the workers training now; set here only (`start_group`)
        self.members = Members(run)  # workers lost and joined, and the group to go on with
        self.recovering: int | None = None  # the group started after lost workers, until its phases are out
        self.timeouts = TimeoutKeeper()  # the measured timeout: proposed, put in force, said
        self.stalled_from: int | None = None  # the checkpoint step the last stalled group went on from
        self.thread: threading.Thread | None = None
        self.scheduler = SchedulerWatch(lambda: getattr(run.client, "status", "running"))

    def start(self) -> None:
        self.thread = threading.Thread(target=self.supervise, name=f"workbench-{self.run.run_id}", daemon=True)
        self.thread.start()

    # --- groups ---------------------------------------------------------------------------------------

    def start_group(self, addresses: list[str], checkpoint: dict[str, Any] | None) -> None:
        """Start the next group of workers (a generation) from `checkpoint`, or the job's initial weights."""
        run = self.run
        generation = run.generation + 1
        state = run.control.state
        # A new group starts under the user's timeout or the unmeasured one; its own waits are measured anew.
        options = LaunchOptions(run.run_id, in_force(None, run.collective_timeout_s),
                                run.checkpoint_every_steps, run.step_delays, run.sample_delays)
        run.feed.new_generation(generation)
        kept_by = set(run.checkpoints.kept_by) if checkpoint is not None and checkpoint is run.checkpoints.latest else set()
        group = launch(run.client, run.prepared, run.job, state, addresses, checkpoint, generation, options, kept_by)
        self.group = group
        run.checkpoints.restart_timer()
        run.feed.publish({"kind": kinds.GENERATION_STARTED, "time": time.time(), "generation": generation,
                          "workers": addresses, "from_step": checkpoint["step"] if checkpoint else 0,
                          "start_step": group.start_step, "total_steps": group.total_steps})
        if checkpoint is not None and checkpoint.get("strategy") not in (None, state.strategy):
            # A switch asked for while the old group broke up is made as the new group starts: recorded
            # as rank 0's, as a switch made by the workers is, so that every view marks it.
            run.feed.publish({"kind": kinds.SWITCHED, "rank": 0, "time": time.time(), "step": group.start_step,
                              "from": checkpoint["strategy"], "to": state.strategy, "settings": state.settings,
                              "generation": generation, "at_regroup": True})

    def supervise(self) -> None:
        run = self.run
        try:
            if run.status == "queued" and not self._start_when_workers_are_free():
                return
            following = self._watch_group()
            while following is not None:
                self.start_group(*following)
                following = self._watch_group()
        except BaseException as error:  # never leave the run looking alive when supervision itself broke
            if run.directory is None:  # it never started: nothing was written
                run.lifecycle.fail_with(f"starting the run failed: {type(error).__name__}: {error}")
                run.lifecycle.move("failed")
                run.announce(kinds.RUN_STATUS, error=run.error)
            elif self.scheduler.lost(error):
                run.lifecycle.fail_with(scheduler_lost_message(run))
            else:
                run.lifecycle.fail_with(f"supervising the run failed: {type(error).__name__}: {error}")
                self.end_group()
            try:
                self._end_run("failed")
            except Exception:
                run.lifecycle.move("failed")
            # Said through the run's error (wait(), the panel, the CLI); re-raised only if not an Exception,
            # so that no thread traceback is printed beside it.
            if not isinstance(error, Exception):
                raise
        finally:
            run.remote_control.close()  # ends the thread serving other clients' control requests
            run.checkpoints.close()  # and the one writing checkpoints
            if run.stop_watching is not None:
                run.stop_watching()
            # However the run ended, its workers are free for the next run (before wait() returns).
            if getattr(run.client, "status", None) == "running":
                self._release_results()
                run.placement.give_back()
                _forget_kept(run)
            run.ended.set()

    def _release_results(self) -> None:
        """Let the last group's rank results (the final weights, a checkpoint) leave the workers' memory,
        taken as they are: a result someone still holds is computed again when its worker dies, and a run's
        rank task ran again on another worker, long after its run had finished (seen after a killed worker:
        "caused the cluster to lose already computed task(s), which will be recomputed elsewhere")."""
        if self.group is not None:
            for future in self.group.futures:
                future.release()

    def _start_when_workers_are_free(self) -> bool:
        """Wait in the queue, then start; False when the run ended there (stopped, or its place lost)."""
        run = self.run
        addresses = run.placement.wait(lambda: run.stop_requested)
        if addresses is None:
            stopped = run.stop_requested
            if not stopped:
                run.lifecycle.fail_with("the run lost its place in the queue (its client's connection to the scheduler "
                                        "ended)")
            run.lifecycle.move("stopped" if stopped else "failed")
            run.announce(kinds.RUN_STATUS, error=run.error)
            return False
        run.begin(addresses)
        if run.stop_requested:  # stopped while it was being started
            run.control.update(stop=True)
        return True

    def _watch_group(self) -> tuple[list[str], dict[str, Any] | None] | None:
        """Wait for the current group of workers; returns the workers and checkpoint to go on with, or
        None once the run has ended (its status set)."""
        run = self.run
        futures, addresses = run.group.futures, list(run.group.addresses)
        watch = FutureWatch(futures)
        while not watch.wait(until_first_error=True, timeout=SUPERVISION_TICK_S):
            self.scheduler.check()
            self.members.take_changes()
            if self.members.roster.lost & set(addresses):
                break
            run.feed.publish_warnings()
            self._publish_recovery()
            if run.status == "running" and self.members.regroup_to is None and run.checkpoints.due():
                run.control.update(checkpoint_id=run.control.state.checkpoint_id + 1)
            self._follow_deadline()
            if run.auto_pilot is not None and self.members.regroup_to is None:
                run.auto_pilot.tick(run, time.monotonic())
            members = self.members
            if run.auto_join and members.roster.joined and members.regroup_to is None and run.status == "running":
                members.add_workers(list(members.roster.joined), automatic=True)
        if any(f.status == "error" for f in futures) or self.members.roster.lost & set(addresses):
            return self._after_failure(futures, addresses)
        results = [f.result() for f in futures]
        run.feed.wait_for_ranks(len(futures), timeout=5)
        final = results[0].get("checkpoint")
        if final is not None:
            run.checkpoints.store(final)
        verdict = regroup.after_success(any(r["stopped"] for r in results), self.members.regroup_to, run.stop_requested)
        if verdict.action == "regroup":
            self.members.regroup_to = None
            run.control.update(stop=False, regroup=False, timeout_s=None)
            run.table.restart_waits()
            self._follow_deadline()
            run.feed.publish({"kind": kinds.REGROUPED, "time": time.time(), "generation": run.generation + 1,
                              "workers": list(verdict.workers), "reason": "workers joined", "from_step": final["step"]})
            return list(verdict.workers), final
        run.lifecycle.keep_final_weights(results[0]["state_dict"])
        self._end_run("stopped" if verdict.action == "stop" else "finished")
        return None

    def _after_failure(self, futures: list[Any], addresses: list[str]) -> tuple[list[str], dict[str, Any]] | None:
        """A worker failed or was lost: end the group; go on with the survivors if workers were lost."""
        run = self.run
        self.end_group()
        # Workers leave at their next step or as their blocked collective is broken; one still busy after
        # that (`deadline.leave_within`: a whole timeout, or a few of its longest waits for one silent that
        # long already) is stuck (in user code, say) and counts as lost.
        self._wait_for_survivors(futures, addresses)
        present = set(present_workers(run.client))
        tasks = [regroup.TaskEnd(address, future.done(), future.status == "error"
                                 and isinstance(future.exception(), KilledWorker))
                 for future, address in zip(futures, addresses)]
        roster = self.members.roster
        for address, reason in regroup.newly_lost(tasks, roster.lost, present, run.timeout_in_force_s).items():
            self.members.record_lost(address, time.time(), reason)
        unfinished = [f for f in futures if not f.done()]
        if unfinished:  # the lost workers' tasks (a nanny's restarted worker would wait for them), the stuck
            run.client.cancel(unfinished, force=True)
        lost = self.members.roster.lost & set(addresses)
        checkpoint = run.checkpoints.latest
        from_step = checkpoint["step"] if checkpoint else 0
        # A stalled group goes on again only if it got further than the last stall went on from: a link
        # that stays cut, or a peer that hangs every time, ends the run instead of regrouping for ever.
        errors = [str(f.exception()) for f in futures if f.status == "error"]
        stalled = regroup.stalled(errors) and (self.stalled_from is None or from_step > self.stalled_from)
        verdict = regroup.after_failure(addresses, lost, present, run.stop_requested, run.min_workers, stalled)
        if verdict.action == "fail":
            self._fail(futures, addresses)
            return None
        # A lost worker (back under the same address it is a new one) and a join under way are given
        # back (below, once the regroup is announced; when the run ends here, all are): the survivors go
        # on (add workers again).
        released = sorted(lost | set(self.members.regroup_to or []) - set(addresses))
        self.members.regroup_to = None
        info = run.checkpoints.info
        where = f"the last checkpoint (step {from_step}) is kept at {info['path']}" if info else \
            "no checkpoint was written yet"
        if verdict.action == "stop":  # stopped while the loss was being handled: keep the last checkpoint
            run.lifecycle.keep_final_weights(checkpoint["weights"] if checkpoint else None)
            self._end_run("stopped")
            return None
        if verdict.action == "too-few":
            run.lifecycle.fail_with(f"lost worker(s) {', '.join(verdict.lost)}; {len(verdict.workers)} left, fewer "
                                    f"than min_workers={run.min_workers}, so the run stopped; {where}. Resume it "
                                    f"with workbench.resume({str(run.directory.path)!r}) once workers are back")
            self._end_run("failed")
            return None
        run.control.update(stop=False, regroup=False, timeout_s=None)
        run.table.restart_waits()
        self._follow_deadline()  # said now: the new group's first steps may be measured by the next tick
        reason = "workers lost" if verdict.lost else \
            "the group stalled: every worker timed out waiting on another (a link cut, a peer paused)"
        run.feed.publish({"kind": kinds.REGROUPED, "time": time.time(), "generation": run.generation + 1,
                          "workers": list(verdict.workers), "lost": list(verdict.lost), "from_step": from_step,
                          "reason": reason})
        run.placement.give_back(released)  # a scheduler round trip: after the announcement, not before
        if verdict.lost:  # a recovery's phases start at a lost worker's last step (run/recovery.py)
            self.recovering = run.generation + 1
        else:
            self.stalled_from = from_step
        return list(verdict.workers), checkpoint

    def _follow_deadline(self) -> None:
        run = self.run
        self.timeouts.follow(run.table, run.control, run.feed.publish, run.collective_timeout_s,
                             evaluates=run.prepared.evaluation is not None)

    def _publish_recovery(self) -> None:
        """Once every rank of the group started after a loss has stepped: the recovery's timed phases."""
        if self.recovering is None:
            return
        run = self.run
        records = run.table.events() + run.table.first_steps_since(run.table.events(kinds.REGROUPED)[-1]["time"])
        done = [entry for entry in recovery.recoveries(records) if entry["generation"] == self.recovering]
        if done:
            self.recovering = None
            run.feed.publish({"kind": kinds.RECOVERED, "time": time.time(), **done[0]})

    def _wait_for_survivors(self, futures: list[Any], addresses: list[str]) -> None:
        """Wait until every worker not known lost has left (each at most `deadline.leave_within`: one
        collective timeout, or a few of its longest measured waits for a worker silent that long already).

        Not for the lost ones: their tasks may never end (a `dask worker` nanny restarts the process under
        a new address, and the scheduler keeps the task for the old one), and waiting for them held every
        regroup back by the whole timeout.
        """
        run, now, started = self.run, time.time(), time.monotonic()
        in_force, longest, last_steps = run.timeout_in_force_s, run.table.longest_wait_s(), run.table.last_steps()
        group_start = self.group.started if self.group is not None else now
        until = {}
        for rank, address in enumerate(addresses):  # silent since its last step in this group, or its start
            silent = now - max(group_start, (last_steps.get(rank) or {}).get("time", group_start))
            until[address] = started + deadline.leave_within(in_force, longest, silent)
        while True:
            self.members.take_changes()
            waiting = [(f, a) for f, a in zip(futures, addresses) if a not in self.members.roster.lost and not f.done()]
            left = max((until[a] - time.monotonic() for _, a in waiting), default=0.0)
            if left <= 0:
                return
            FutureWatch([f for f, _ in waiting]).wait(timeout=min(SUPERVISION_TICK_S, left))

    def end_group(self) -> None:
        """Tell every worker of the current group to leave at once (no final synchronisation)."""
        try:
            self.run.control.update(generation=self.run.generation + 1)
        except Exception:  # the scheduler may be gone; the workers then leave as their tasks are released
            pass

    def _fail(self, futures: list[Any], addresses: list[str]) -> None:
        run = self.run
        errors, diverged = [], None
        for rank, future in enumerate(futures):
            if future.status != "error":
                continue
            exception, tb = future.exception(), future.traceback()
            if isinstance(exception, DivergenceError) and diverged is None:
                diverged = str(exception)
            errors.append(regroup.WorkerError(rank, addresses[rank], type(exception).__name__, str(exception),
                                              "".join(traceback.format_tb(tb)) if tb else ""))
        if diverged is not None:
            info = run.checkpoints.info
            kept = (f" The last good checkpoint (step {info['step']}) is kept at {info['path']}." if info
                    else " No checkpoint was written before.")
            run.lifecycle.fail_with(diverged + kept, diverged=True)
        else:
            run.lifecycle.fail_with(regroup.failure_text(errors))
        self._end_run("failed")

    def _end_run(self, status: str) -> None:
        run = self.run
        # Without a scheduler every call to it would wait out Dask's connect timeout: only the files then.
        connected = getattr(run.client, "status", "running") == "running"
        if connected:
            run.feed.wait_for_ranks(len(run.group.futures) if run.group else 0, timeout=2)
            for name in (topic(run.run_id), requests_topic(run.run_id)):
                try:
                    run.client.unsubscribe_topic(name)
                except Exception:
                    pass
            run.feed.publish_warnings()  # the last records' warnings
            run.control.delete()
        run.lifecycle.move(status)
        if status != "failed" and run.final_weights is not None:
            run.directory.save_model(run.final_weights)
        run.directory.append([{"kind": kinds.RUN_ENDED_AS[run.status], "time": time.time(), "error": run.error}])
        summary = run.summary()
        run.directory.write_json(SUMMARY_FILE, summary)
        run.directory.close()
        if run.exports is not None:
            run.exports.close(run.status)
        if connected:
            run.announce(kinds.RUN_STATUS, samples_per_s=summary.get("samples_per_s"), error=run.error)


def _forget_kept(run: Run) -> None:
    """The checkpoints workers kept for the run's next group go from their memory. On a thread of its
    own: a worker behind a cut link would hold the run's end for Dask's connect timeout."""
    holders = run.checkpoints.all_holders()
    if not holders:
        return

    def forget() -> None:
        try:
            run.client.run(checkpoint_format.forget, run.run_id, workers=holders, on_error="ignore")
        except Exception:
            pass  # a worker or the scheduler gone meanwhile: nothing of it left to free

    threading.Thread(target=forget, name=f"workbench-forget-{run.run_id}", daemon=True).start()


class SchedulerWatch:
    """Whether the client has lost its scheduler: the run's tasks, control state and actors went with it."""

    def __init__(self, client_status: Callable[[], str]) -> None:
        self.client_status = client_status
        self._disconnected_since: float | None = None

    def lost(self, error: BaseException) -> bool:
        """Whether `error` (which ended supervision) came of a lost scheduler."""
        return isinstance(error, SchedulerLost) or self.client_status() != "running" \
            or "scheduler-connection-lost" in str(error)

    def check(self) -> None:
        """Raise `SchedulerLost` once the client has been cut off from the scheduler for a while: Dask alone
        would wait 30 s to say so."""
        if self.client_status() == "running":
            self._disconnected_since = None
            return
        if self._disconnected_since is None:
            self._disconnected_since = time.monotonic()
        elif time.monotonic() - self._disconnected_since >= SCHEDULER_LOST_AFTER_S:
            raise SchedulerLost(self.client_status())


def scheduler_lost_message(run: Run) -> str:
    """What a user reads when the scheduler is gone: where the last checkpoint is, and how to go on."""
    directory, info = str(run.directory.path), run.checkpoints.info
    kept = (f"its last checkpoint (step {info['step']} of {run.total_steps}) is kept in {directory}"
            if info else f"no checkpoint was written yet, so nothing can be resumed from {directory}")
    message = f"lost the connection to the Dask scheduler at {run.config['scheduler']}: the run ended; {kept}."
    if info:
        message += (f" Once a scheduler and workers are up again, go on with workbench.resume({directory!r}, "
                    f"client=workbench.connect(scheduler=...)) or: workbench train --resume {directory} "
                    "--scheduler ADDRESS")
    return message
