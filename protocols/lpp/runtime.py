"""`lap-sgd` and `lpp-sgd`: U Hogwild updaters per worker share one model; this process
is the worker's averaging process (Algorithm 1, lines 8-18).

The worker's model lives in shared memory (CPU) or is shared over CUDA IPC (GPU): its
flat parameters and its buffers. The updaters (worker/protocols/lpp/updater.py, started with
spawn) update it lock-free and never wait. This process waits until K_j updates were
made since the last averaging round began, then averages the model across workers with
the delta rule (worker/dataplane/preduce.py: DeltaAverager), so that updates made during the
exchange survive.

Averaging `all` (the paper): every worker's averaging process joins every round of one
all-reduce over all workers. Algorithm 1 as printed lets workers disagree on how many
rounds to run (each decides from its own counter) and so hang; here every round also
sums one control value, a worker's wish to stop (its budget is spent, the coordinator
stopped the run, a signal, a failed updater), and every worker stops after the first
round in which someone wished to: all make the same number of calls. A second control
value, a wish to checkpoint, makes every worker save after the same round
(worker/protocols/lpp/checkpoints.py), which a restart round restores: a member that fails
or joins restarts every worker from the last such round, as for allreduce.
Averaging `ripples-random` / `ripples-smart`: each round is a request to the Group
Generator and a P-Reduce in the group it returns (the delta rule again); a worker that
is done simply leaves.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import queue
import time
from multiprocessing.process import BaseProcess

import torch.distributed as dist
import torch.multiprocessing as torch_mp

from ripples.protocols.group_generator.runtime import GroupGeneratorProtocol
from ripples.protocols.lpp.checkpoints import LppCheckpoints, Restored
from ripples.protocols.lpp.rules import partition_blocks
from ripples.protocols.lpp.settings import LppSettings
from ripples.protocols.lpp.updater import LOSS_SLOTS, SharedState, UpdaterJob, updater_main
from ripples.worker.checkpoint_store import StoreExchange
from ripples.worker.client import RestartRequested
from ripples.worker.collective_watch import rank_describer
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.dataplane.preduce import DeltaAverager
from ripples.worker.protocol import Protocol, ProtocolContext, SyncResult, TrainingJob
from ripples.worker.stats import WorkerStats

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.002
"""How often the averaging process looks at the counter while it waits for K_j updates."""
START_TIMEOUT_SECONDS = 300.0
"""How long the updaters may take to start (import torch, build the task), and a worker
wait for the others' updaters."""
JOIN_SECONDS = 10.0
"""How long the updaters have to finish their update and exit once told to stop."""
STOP_GRACE_SECONDS = 5.0
"""After a round in which another worker wished to stop, how long to wait for the
coordinator's stop before leaving."""
MAX_LEAD_ROUNDS = 4
"""Updaters wait once their worker made this many rounds' worth of updates (x U x H)
beyond the start of the last completed averaging round. Wait-free updaters outran the
averaging on a busy CPU: on digits (0.7 ms updates, 2 ms rounds), 2 workers x 2 updaters,
a worker made its whole budget with ~18 updates per round and its Hogwild model broke
(consensus accuracy 0.1-0.2 in 3 of 7 runs)."""
REPORT_SECONDS = 0.2
"""How often the updaters' counts reach the worker's progress while it waits for K_j."""


class _GroupAverager(GroupGeneratorProtocol):
    """The Group Generator's rounds with the delta rule instead of replacing the model."""

    flags_nonfinite = False  # the delta rule's collective carries no flags

    def __init__(self, ctx: ProtocolContext, averager: DeltaAverager) -> None:
        super().__init__(ctx)
        self.averager = averager

    def average(self, comm: Communicator) -> None:
        self.averager.average(comm, self.timeout)


class LppProtocol(Protocol):
    name = "lpp"

    def __init__(self, ctx: ProtocolContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.settings = LppSettings.of_config(cfg)
        self.settings.validate()
        self.partial = cfg.protocol == "lpp-sgd"  # partial backpropagation (LPP-SGD)
        self.timeout = cfg.collective_timeout_seconds
        flat = ctx.state.flat
        if flat.device.type == "cpu":
            flat.share_memory_()  # in place: the model's parameters stay views into it
        self.buffers = list(ctx.model.buffers())
        for b in self.buffers:
            if b.device.type == "cpu":
                b.share_memory_()
        sizes = [p.numel() for p in ctx.model.parameters()]
        # LAP-SGD never updates a block alone: any number of updaters may share a model.
        self.blocks = (tuple(partition_blocks(sizes, self.settings.updaters))
                       if self.partial else ((0, len(sizes)),) * self.settings.updaters)
        self.averager = DeltaAverager(flat)
        self.groups: _GroupAverager | None = None
        self.comm: Communicator | None = None
        if self.settings.averaging == "all":
            self.comm = ctx.comms.get(f"lpp/{cfg.run_id}/all", ctx.rank, ctx.num_workers,
                                      create=True)
        else:
            self.groups = _GroupAverager(ctx, self.averager)
        self.leaving = ""
        """Why this worker wants to stop (empty: it does not)."""
        self._error = ""
        self._checkpoint_due = False
        self._batch_size = 0
        self._reported_at = 0.0
        self._rounds = 0
        self._updates: list[int] = []
        self._full_until = 0
        self._processes: list[BaseProcess] = []
        self._mp = torch_mp.get_context("spawn")
        self.checkpoints: LppCheckpoints | None = None
        """Averaging over all workers: the round checkpoints (run_training makes them)."""
        self._restored: Restored | None = None

    # ------------------------------------------------------------ one averaging round
    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        if self.ctx.stop_requested.is_set():
            return self.ctx.coordinator_stop()
        return None

    def after_step(self, completed: int) -> SyncResult:
        """One averaging round, with `completed` updates made on this worker."""
        if self.groups is not None:
            return self.groups.after_step(completed)
        assert self.comm is not None
        t0 = time.perf_counter()
        wants_checkpoint = self.checkpoints is not None and self.checkpoints.wish(completed)
        wishes, saves = self.averager.average(
            self.comm, self.timeout, (1.0 if self.leaving else 0.0, float(wants_checkpoint)))
        seconds = time.perf_counter() - t0
        self._checkpoint_due = saves > 0
        result = SyncResult(preduce_seconds=seconds, num_groups=1,
                            group_sizes=(self.comm.size,), preduce_durations=(seconds,),
                            preduce_bytes=self.averager.flat.numel()
                            * self.averager.flat.element_size())
        if wishes > 0:
            result.stop = True
            result.stop_reason = self.leaving
            if not self.leaving:
                # Another worker wished to stop: it leaves (finished, failed or signalled)
                # and the coordinator stops the run naming why; leave after that stop, so
                # that our leaving is not taken for the reason.
                stopped = self.ctx.stop_requested.wait(STOP_GRACE_SECONDS)
                result.stop_reason = (self.ctx.coordinator_stop().stop_reason if stopped
                                      else "another worker stopped the run")
        return result

    # ------------------------------------------------------------ the averaging process
    def run_training(self, job: TrainingJob) -> str:
        stats, cfg = job.stats, self.settings
        budget = stats.planned_iterations
        if budget <= 0:
            raise ValueError("lap-sgd and lpp-sgd need a budget of iterations or epochs (T "
                             "sets the full-model phase and the synchronisation scheme)")
        self._batch_size = job.batch_size
        self._restore(job)
        shared = self._shared_state()
        reason = ""
        restart = job.restart
        kill = self._kill_updaters
        if restart is not None:  # the backstop of a restart order ends them first
            restart.before_exit.append(kill)
        try:
            self._start_updaters(job, budget, shared)
            reason = self._start_together(shared)
            s_pre = int(shared.counter.value)
            reported_done, reported_compute = 0, 0.0
            while not reason:
                if restart is not None and restart.pending:  # a restart round
                    raise RestartRequested(restart.reason)
                s = int(shared.counter.value)
                self._check_leaving(job, shared, budget)
                if not self.leaving and s - s_pre < cfg.sync_frequency(s, budget):
                    if time.monotonic() - self._reported_at > REPORT_SECONDS:
                        self._report(shared, stats)
                    time.sleep(POLL_SECONDS)
                    continue
                s_pre = s
                done, compute = self._report(shared, stats)
                if self.leaving and self.groups is not None:
                    reason = self.leaving  # group averaging: just leave
                    break
                result = self.after_step(done)
                if result.num_groups > result.num_failed_groups:
                    shared.averaged_at.value = s
                self._rounds += result.num_groups - result.num_failed_groups
                if self._checkpoint_due:
                    self._save(shared, stats)
                loss = stats.add_sync(result)  # compute: the updaters' counts, in _report
                if job.metrics is not None:
                    job.metrics.observe_iteration(compute_seconds=compute - reported_compute,
                                                  result=result, loss=loss,
                                                  iterations=done - reported_done)
                reported_done, reported_compute = done, compute
                if result.stop:
                    reason = result.stop_reason
                    break
        finally:
            if restart is not None:
                restart.before_exit.remove(kill)
            self._stop_updaters(shared)
            self._report(shared, stats)
        if self._error:
            raise RuntimeError(self._error)
        return reason

    def _restore(self, job: TrainingJob) -> None:
        """Averaging over all workers: make the round checkpoints, and restore the
        newest round every rank holds (after a restart round, or `ripples run --resume`)."""
        ctx = self.ctx
        if self.comm is None:
            if job.checkpoint.checkpoint_dir:
                logger.warning("lap/lpp-sgd with group averaging keeps no checkpoints (its "
                               "workers restart only when averaging over all workers)")
            return
        self.checkpoints = LppCheckpoints(job.checkpoint, ctx.model, rank=ctx.rank,
                                          num_workers=ctx.num_workers,
                                          protocol=ctx.config.protocol)
        if not self.checkpoints.enabled:
            return
        exchange = StoreExchange(ctx.store, f"ripples/checkpoint/{ctx.config.run_id}",
                                 ctx.rank, ctx.num_workers, START_TIMEOUT_SECONDS,
                                 rank_describer(ctx.client))
        self._restored = self.checkpoints.restore(exchange, self.settings.updaters)
        if self._restored is not None:
            self._rounds = self._restored.round
            self._hold(job.stats, self._restored.counter)

    @staticmethod
    def _hold(stats: WorkerStats, updates: int) -> None:
        """Tell the coordinator (next heartbeat) that this worker holds a checkpoint: a
        restart round needs every member to hold one."""
        with stats.lock:
            stats.checkpoint_step = max(1, updates)

    def _save(self, shared: SharedState, stats: WorkerStats) -> None:
        assert self.checkpoints is not None
        updates = list(shared.done)
        self.checkpoints.save(self._rounds, updates)
        self._hold(stats, sum(updates))

    def _shared_state(self) -> SharedState:
        mp, u = self._mp, self.settings.updaters
        restored = self._restored
        start = restored.counter if restored is not None else 0
        done = list(restored.updates) if restored is not None else [0] * u
        return SharedState(
            flat=self.averager.flat, buffers=self.buffers,
            counter=mp.Value("q", start), done=mp.Array("q", done, lock=False),
            compute=mp.Array("d", u, lock=False),
            losses=mp.Array("d", [math.nan] * LOSS_SLOTS, lock=False),
            ready=mp.Array("b", u, lock=False), go=mp.Event(), stop=mp.Event(),
            averaged_at=mp.Value("q", start),
            max_lead=MAX_LEAD_ROUNDS * u * self.settings.sync_period, errors=mp.Queue())

    def _start_updaters(self, job: TrainingJob, budget: int, shared: SharedState) -> None:
        u, cfg = self.settings.updaters, self.ctx.config
        self._full_until = self.settings.full_until(budget, partial=self.partial)
        for index in range(u):
            updater = UpdaterJob(
                index=index, task=job.task_spec, options=job.task_options, rank=self.ctx.rank,
                num_workers=self.ctx.num_workers, seed=cfg.seed, budget=budget,
                full_until=self._full_until, blocks=self.blocks, parent_pid=os.getpid(),
                slowdown=job.slowdown_spec, num_threads=job.num_threads,
                start=int(shared.counter.value))
            proc = self._mp.Process(target=updater_main, args=(updater, shared), daemon=True,
                              name=f"ripples-updater-{self.ctx.rank}-{index}")
            proc.start()
            self._processes.append(proc)
        logger.info("worker %d started %d updaters (%s, averaging %s)", self.ctx.worker_id, u,
                    "lpp-sgd" if self.partial else "lap-sgd", self.settings.averaging)

    def _start_together(self, shared: SharedState) -> str:
        """Wait until this worker's updaters are built (they import torch and build the
        task), then, averaging over all workers, for every worker's (an averaging round
        of identical models: a barrier), and let the updaters go. Without it a worker
        whose updaters start first trains alone for as long as the others start up.
        Returns why the run ended before it began, or empty."""
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not all(shared.ready):
            # Before it is ready an updater exits only on failure, whatever its code.
            if self._updater_failure(shared, any(p.exitcode is not None
                                                 for p in self._processes)):
                raise RuntimeError(self._error)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the updaters did not start in {START_TIMEOUT_SECONDS:.0f} s")
            time.sleep(0.05)
        if self.comm is None:  # group averaging: meet in the rendezvous store instead
            store, run_id = self.ctx.store, self.ctx.config.run_id
            store.set(f"lpp/{run_id}/ready/{self.ctx.rank}", "1")
            keys = [f"lpp/{run_id}/ready/{r}" for r in range(self.ctx.num_workers)]
            try:
                store.wait(keys, datetime.timedelta(seconds=START_TIMEOUT_SECONDS))
            except (RuntimeError, dist.DistError) as err:
                raise TimeoutError(f"the other workers' updaters did not start in "
                                   f"{START_TIMEOUT_SECONDS:.0f} s: {err}") from err
        else:
            stopping = 1.0 if self.ctx.stop_requested.is_set() else 0.0
            (wishes,) = self.averager.average(
                self.comm, max(self.timeout, START_TIMEOUT_SECONDS), (stopping,))
            if wishes > 0:  # stopped before it began: every worker saw it in this round
                return self.ctx.coordinator_stop().stop_reason
        shared.go.set()
        return ""

    def _collect_errors(self, shared: SharedState, wait_seconds: float = 0.0) -> None:
        try:
            while True:
                message = (shared.errors.get(timeout=wait_seconds) if wait_seconds
                           else shared.errors.get_nowait())
                self._error = self._error or message
                wait_seconds = 0.0
        except queue.Empty:
            pass

    def _updater_failure(self, shared: SharedState, exited: bool) -> str:
        """The first updater's error message, once one sent it or (`exited`) one is gone;
        empty while none failed."""
        self._collect_errors(shared)
        if not self._error and exited:
            self._collect_errors(shared, wait_seconds=1.0)  # its message, if it sent one
            self._error = self._error or (f"an updater process exited (exit codes "
                                          f"{[p.exitcode for p in self._processes]})")
        return self._error

    def _check_leaving(self, job: TrainingJob, shared: SharedState, budget: int) -> None:
        """Set `leaving` once this worker wants to stop."""
        if self.leaving:
            return
        if self._updater_failure(shared, any(p.exitcode not in (None, 0)
                                             for p in self._processes)):
            self.leaving = "an updater failed"
        elif job.local_stop.is_set():
            self.leaving = "stopped by a signal"
        elif self.ctx.stop_requested.is_set():
            self.leaving = self.ctx.coordinator_stop().stop_reason
        elif sum(shared.done) >= budget or all(p.exitcode == 0 for p in self._processes):
            self.leaving = f"iteration budget reached ({budget} updates)"

    def _report(self, shared: SharedState, stats: WorkerStats) -> tuple[int, float]:
        """Copy the updaters' counts into the worker's stats (the heartbeat sends them)."""
        self._reported_at = time.monotonic()
        self._updates = list(shared.done)
        done, compute = sum(self._updates), float(sum(shared.compute))
        losses = [v for v in shared.losses if math.isfinite(v)]
        with stats.lock:
            stats.iteration = done
            stats.samples = done * self._batch_size
            stats.compute_seconds = compute
            stats.set_recent_losses(losses)
        return done, compute

    def _stop_updaters(self, shared: SharedState) -> None:
        shared.stop.set()
        deadline = time.monotonic() + JOIN_SECONDS
        for proc in self._processes:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._processes:
            if proc.is_alive():
                logger.warning("updater %s did not stop in %.0f s; terminating it", proc.name,
                               JOIN_SECONDS)
                proc.terminate()
                proc.join(5.0)
        self._collect_errors(shared)

    def _kill_updaters(self) -> None:
        """The process is about to end (a restart order's backstop): end the updaters at
        once, so that none outlives it (an exec'ed worker keeps its pid: they would not
        see themselves orphaned)."""
        for proc in self._processes:
            if proc.is_alive():
                proc.kill()

    def record(self) -> dict[str, object]:
        return {"updaters": self.settings.updaters, "updates_per_updater": self._updates,
                "averaging_rounds": self._rounds, "averaging": self.settings.averaging,
                "blocks": [list(b) for b in self.blocks], "full_until": self._full_until}

    def close(self) -> None:
        if self.groups is not None:
            self.groups.close()

