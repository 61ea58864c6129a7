"""The coordinator's pure core: one run's events in, decisions out.

Events (register, ready, request a group, release, heartbeat, leave, time passes) come
with the time passed explicitly; decisions come out. No threads, sockets or wall clock:
the gRPC shell (service.py) adds those, and tests drive the very same code with a fake
clock. The core composes one object per concept:

- `Registry` (registry.py): workers, nodes, ranks, leases;
- `RunGraph` (run_graph.py): who may average with whom, built when the membership forms;
- `GroupService` (group_service.py): group requests, deliveries, releases, pairing;
- `ProgressTracker` (progress.py): loss curve, time to target, speed signals;
- `StopAgreement` (stop.py): the stop and lock-step workers' common stop iteration;
- `SchemaCheck` (schema.py): every worker averages the same tensors;
- `RestartRounds` (restart_rounds.py): a membership change of a run that restarts.

A run goes through: registration until `num_workers` registered (then the membership is
formed: ranks and graph are final), readiness until every member built its model and
its schema matched (then training starts and the clock runs), training, stop.
"""

from __future__ import annotations

import functools
import random

from ripples.coordinator.config import RunSettings
from ripples.coordinator.errors import CoordinatorError
from ripples.coordinator.group_service import (
    Deliveries,
    GroupDecision,
    GroupService,
    Outcome,
)
from ripples.coordinator.groups import GroupRecord, GroupTable
from ripples.coordinator.membership import RunMembership
from ripples.coordinator.progress import ProgressTracker
from ripples.coordinator.registry import GONE, Progress, Registry, WorkerRecord, WorkerState
from ripples.coordinator.restart_rounds import RestartRounds
from ripples.coordinator.run_graph import RankGraph, RunGraph
from ripples.coordinator.schema import SchemaCheck
from ripples.coordinator.stop import BudgetWatch, StateAdoption, StopAgreement
from ripples.protocols.spec import Coordination

SUSPECT_HEARTBEATS = 3
"""A worker whose Synchronize stream broke keeps its lease for this many heartbeat
intervals only, unless it heartbeats (`suspect`): with the default 0.5 s, a SIGKILLed
worker's groups are cancelled 1.5 s after its death instead of a lease (10 s) after."""

__all__ = ["GONE", "CoordinatorCore", "CoordinatorError", "Deliveries", "GroupDecision",
           "Outcome", "Progress", "WorkerRecord", "WorkerState"]


class CoordinatorCore(RunMembership):
    """All state of one run and every rule that changes it (the membership's rules:
    RunMembership, membership.py)."""

    def __init__(self, settings: RunSettings, *, now: float, first_worker_id: int = 0) -> None:
        self.settings = settings
        self.role = settings.role
        self.registry = Registry(settings.num_workers, settings.lease_seconds,
                                 settings.max_workers, first_worker_id=first_worker_id)
        self.graph = RunGraph()
        self.prepared_graph: RankGraph | None = None
        """The graph of the full membership on ranks, built ahead off the event loop
        (run_graph.prepare): the forming only maps it to worker ids."""
        self.progress = ProgressTracker(num_workers=settings.num_workers,
                                        target_loss=settings.target_loss,
                                        live=self.registry.live,
                                        everyone=self.registry.counted,
                                        lockstep=settings.restarts,
                                        version=lambda: self.registry.version)
        self.groups = GroupService(self.role, settings.settings,
                                   registry=self.registry, graph=lambda: self.graph,
                                   progress=self.progress, rng=random.Random(settings.seed),
                                   max_comms_per_worker=settings.max_comms_per_worker)
        self.stopper = StopAgreement(settings.checkpoint_interval)
        self.budget = BudgetWatch()
        self._ready_ids: set[int] = set()
        """Workers that said they are ready (mark_ready counts them before it checks)."""
        self.start_differing_ranks: tuple[int, ...] = ()
        """The ranks whose initial model differed from rank 0's at the last start (the
        members then copy rank 0's model: AwaitStartReply.differing_ranks)."""
        self.consensus_id = 0
        """The consensus model wanted now (the Consensus RPC; 0: none)."""
        self.consensus_at = 0
        """Lock-step runs: the iteration after which every worker publishes its model for
        consensus_id (0: not agreed yet), agreed as the stop iteration is."""
        self.adoption = StateAdoption(settings.checkpoint_interval)
        self.model_schema = SchemaCheck("model")
        self.training_schema = SchemaCheck("model and optimizer state")
        self.created_at = now
        self.started_at: float | None = None
        self.resumed_elapsed = 0.0
        """Training time of the run before a total failure it resumed from (`resume`), or
        before its last restart round: the clock goes on from there once every member is
        ready again."""
        self.rounds = RestartRounds(settings=settings)
        self.stopped_by_failure = False
        """The run stopped because of a failure (see stop)."""

    def neighbours_of(self, worker_id: int) -> tuple[int, ...]:
        """The live workers `worker_id` may average with (all others on a complete graph)."""
        return self.groups.neighbours_of(worker_id)

    def num_nodes(self) -> int:
        return self.registry.num_nodes()

    # ------------------------------------------------------------------ lifecycle
    def heartbeat(self, worker_id: int, progress: Progress | None, now: float) -> Deliveries:
        """Renew the worker's lease and record its progress; may stop the run."""
        w = self.worker(worker_id)
        self.registry.renew(w, now)
        if progress is not None:
            self._record_progress(w, progress, now)
        return self._check_stop(now, w)

    def leave(
        self, worker_id: int, progress: Progress | None, error: str, now: float,
        reason: str = "", *, done: bool = False,
    ) -> Deliveries:
        """The worker leaves: FAILED with `error`, or cleanly (`reason`: why it ended;
        `done`: its training loop ended, so it is done, not lost)."""
        w = self.worker(worker_id)
        if progress is not None:
            self._record_progress(w, progress, now)
        w.error = error
        w.leave_reason = reason
        w.done = done and not error
        return self._remove(w, WorkerState.FAILED if error else WorkerState.LEFT, now)

    def suspect(self, worker_id: int, now: float) -> float | None:
        """The worker's Synchronize stream ended while it trains: its process died (the
        kernel closed its connection), its connection did, or it is reopening the
        stream. A live worker heartbeats every heartbeat interval, which renews its whole
        lease; so its lease is cut to SUSPECT_HEARTBEATS intervals from now, and a dead
        worker's groups are cancelled then, not a whole lease later
        (docs/fault-tolerance.md). A stream that breaks after the worker's heartbeats had
        already stopped for that long is a path that failed (a cut link: the transport
        gives up seconds after the silence began), not a process that just died: its
        lease is left whole, so a link that comes back within it is ridden over even when
        reconnecting takes seconds. Returns when the cut lease ends (None: the worker is
        gone or not started, the run stopped, it was already silent, or its lease ends
        sooner anyway)."""
        w = self.registry.live_by_id().get(worker_id)
        if w is None or not w.ready or self.stopped:  # stopped: the final average's turn
            return None
        window = SUSPECT_HEARTBEATS * self.settings.heartbeat_interval_seconds
        if now - self.registry.heard_at(w) > window:
            return None
        ends = now + window
        if ends >= w.lease_expires_at:
            return None
        w.lease_expires_at, w.stream_broken = ends, True
        return ends

    def expire_leases(self, now: float) -> Deliveries:
        """Remove the workers whose lease ran out; close an open restart round whose join
        window passed (the lease reaper calls this periodically)."""
        deliveries: Deliveries = {}
        for w in self.registry.expired(now):
            self.registry.num_lease_expirations += 1
            w.error = (f"lease expired: its connection closed and no heartbeat followed "
                       f"within {SUSPECT_HEARTBEATS * self.settings.heartbeat_interval_seconds:.1f}"
                       " s" if w.stream_broken else
                       f"lease expired: no heartbeat for {self.settings.lease_seconds:.1f} s")
            deliveries.update(self._remove(w, WorkerState.EXPIRED, now))
        deliveries.update(self._close_restart_round(now))
        return deliveries

    # ------------------------------------------------------------------ restart rounds
    def _restart(self, reason: str, now: float, *, failure: bool = True,
                 alive: tuple[tuple[str, int], ...] = ()) -> None:
        """Open a restart round (RestartRounds.open); training time pauses meanwhile."""
        self.rounds.open(reason, now, self.live(), failure=failure, alive=alive)
        if self.started_at is not None:  # else a round before this one paused the clock
            self.resumed_elapsed = self.elapsed(now)
        self.started_at = None
        self.registry.formed = False

    def _close_restart_round(self, now: float) -> Deliveries:
        """Form the open round's membership, or stop the run, as the round's verdict says."""
        if self.rounds.began_at is None or self.registry.formed or self.stopped:
            return {}
        verdict = self.rounds.verdict(
            now, self.live(), shrinks=self.role.coordination is not Coordination.STATIC)
        if verdict == "form":
            self._form_membership(now)
        elif verdict:
            return self.stop(verdict, now, failure=True)
        return {}

    def rejoins(self, worker_id: int) -> str:
        """Why this departed worker restarts its process and registers anew, or ""
        (RestartRounds.rejoins)."""
        w = self.registry.workers.get(worker_id)
        if w is None or self.stopped:
            return ""
        return self.rounds.rejoins(w, self.live(), formed=self.registry.formed)

    @functools.cached_property
    def settings_options(self) -> dict[str, object]:
        """The run's settings as flat options (RunSettings.options), made once: they do not
        change during a run, and the state store encodes them only when they are a new
        object (a file topology's 500,000 edges would otherwise be encoded at every save)."""
        return self.settings.options()

    @property
    def restarts(self) -> int:
        """Restart rounds opened so far."""
        return self.rounds.count

    @property
    def restart_reason(self) -> str:
        return self.rounds.reason

    @property
    def restart_began_at(self) -> float | None:
        """When the open restart round began (None: none is open)."""
        return self.rounds.began_at

    def _remove(self, w: WorkerRecord, state: WorkerState, now: float) -> Deliveries:
        if w.state in GONE:
            return {}
        w.state = state
        deliveries = self.groups.remove(w, state, now)
        deliveries.update(self._check_stop(now))
        if self.stopped:
            return deliveries
        why = f": {w.error or w.leave_reason}" if w.error or w.leave_reason else ""
        if self.started_at is None:
            if (self.registry.generation and state is not WorkerState.LEFT
                    and self.registry.formed and not self.rounds.refusal(self.live())):
                # A restart round's member failed before training went on: another round.
                alive = ((w.host, w.local_rank),) if state is WorkerState.FAILED else ()
                self._restart(f"{w.name} {state.value} before training "
                              f"resumed{why}", now, alive=alive)
            elif self.registry.formed:  # a member is missing: the run can never start
                deliveries.update(self.stop(
                    f"{w.describe()} {state.value} before training started{why}", now,
                    failure=True))
            return deliveries
        finished = state is WorkerState.LEFT and (
            w.done or 0 < w.progress.planned_iterations <= w.progress.iteration)
        if self.role.needs_every_worker and not finished:
            # Lock-step peers cannot go on without it: every worker restarts from the last
            # checkpoint with the new membership, or (no restarts) everyone stops at the
            # next agreed iteration rather than wait inside collectives that never complete.
            # A graceful leave (SIGTERM before a preemption, request_stop()) shrinks the
            # run: a round without the leaver, which is no failure (max_restarts does not
            # count it), as when torchelastic loses a node it was told about.
            graceful = state is WorkerState.LEFT
            refusal = ("the static schedule cannot shrink (its hosts must stay full)"
                       if graceful and self.role.coordination is Coordination.STATIC
                       else self.rounds.refusal(self.live(), failure=not graceful))
            if not refusal:
                # A worker that failed and said so (Leave) is alive: it restarts too.
                alive = ((w.host, w.local_rank),) if state is WorkerState.FAILED else ()
                self._restart(f"{w.name} {state.value}{why}", now,
                              failure=not graceful, alive=alive)
                return deliveries
            deliveries.update(self.stop(f"{w.name} {state.value}{why}"
                                        + (f"; no restart: {refusal}" if refusal and
                                           self.settings.restarts else ""), now,
                                        failure=not graceful))
        elif self.role.needs_every_worker:  # its loop ended: lock-step peers end with it
            deliveries.update(self.stop(
                f"{self._done_reason(w)} ({self.settings.protocol}'s workers end together: "
                "each waits for its peers)", now))
        elif finished:  # done, not lost: the others train on; the last one ends the run
            if not self.live():
                deliveries.update(self.stop(
                    f"every worker's training loop ended ({self._done_reason(w)}, the "
                    "last)", now))
        elif len(self.live()) < self.settings.min_workers:
            last = f" ({w.name} {state.value}{why})" if why else ""
            deliveries.update(self.stop(
                f"fewer than {self.settings.min_workers} workers remain{last}", now,
                failure=state is not WorkerState.LEFT))
        return deliveries

    @staticmethod
    def _done_reason(w: WorkerRecord) -> str:
        """Why a done worker ended: its own iteration budget, or its loop."""
        p = w.progress
        if 0 < p.planned_iterations <= p.iteration:
            return (f"iteration budget reached ({w.name} finished its "
                    f"{p.planned_iterations} planned iterations)")
        return f"the training loop of {w.name} ended after {p.iteration} steps"

    # ------------------------------------------------------------------ groups
    def request_group(
        self, worker_id: int, iteration: int, now: float, progress: Progress | None = None,
        *, listen: bool = False,
    ) -> tuple[GroupDecision | None, Deliveries]:
        """A worker asks for its next group, reporting its progress on the way.

        `listen` (gossip protocols): the worker owes no averaging and only serves
        partners; no group is generated for it. Returns (the caller's decision, or None if
        it must wait; decisions for other waiting workers that this request completed).
        """
        w = self.worker(worker_id)
        if not self.role.forms_groups:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"protocol {self.settings.protocol} does not use the group generator",
            )
        if listen and not self.role.listening:
            raise CoordinatorError(
                "INVALID_ARGUMENT",
                f"{self.settings.protocol}'s workers do not listen for partners")
        if not listen and worker_id in self.graph.passive and w.healed:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"worker {worker_id} is on the passive side of {self.settings.protocol}'s "
                "graph: it only listens")
        if self.started_at is None:
            raise CoordinatorError("FAILED_PRECONDITION", "the run has not started yet")
        if progress is not None:
            self._record_progress(w, progress, now)
        w.progress.iteration = max(w.progress.iteration, iteration)
        deliveries = self._check_stop(now, w)
        if self.stopped:
            return self.groups.decide(w, Outcome.STOP, now, detail=self.stop_reason), deliveries
        decision, more = self.groups.request(w, now, listen=listen)
        deliveries.update(more)
        return decision, deliveries

    def abandon_wait(self, worker_id: int, now: float) -> GroupDecision:
        """The caller's server-side wait ran out: forget its arrival, tell it to retry."""
        return self.groups.abandon_wait(self.worker(worker_id), now)

    def release(
        self, worker_id: int, group_id: int, ok: bool, error: str, now: float,
        squared_distance: float | None = None,
    ) -> Deliveries:
        return self.groups.release(self.worker(worker_id), group_id, ok, error, now,
                                   squared_distance=squared_distance)

    # ------------------------------------------------------------------ the final average
    def final_group_refusal(self, worker_id: int) -> str:
        """Why `worker_id` takes part in no final average ("" when it does): the live
        workers average once more after the stop, so that every final model is the
        consensus model."""
        w = self.worker(worker_id)
        if not self.settings.final_average:
            return "the run's final average is off"
        if not self.stopped:
            return "the run goes on: no final average for a worker that ends on its own"
        if self.role.coordination is Coordination.LOCKSTEP:
            return "a lock-step run's workers hold the same model already"
        if not w.healed:
            return "this replacement never healed: its model is not the run's"
        return ""

    def final_members(self) -> list[int]:
        """The workers a final average waits for: the live, healed ones."""
        return [w.worker_id for w in self.live() if w.healed]

    def final_group(self, members: list[int], now: float) -> GroupRecord:
        """The final average's group over `members` (every live worker that asked), with
        a fresh group id and a comm id of the run's directory."""
        return self.groups.final_group(tuple(sorted(members)), now)

    # ------------------------------------------------------------------ stopping
    def checkpoint(
        self, worker_id: int, iteration: int, now: float, progress: Progress | None = None,
        *, optimizer_state_ready: bool = False,
    ) -> int:
        """Lock-step stop agreement (StopAgreement): 0 to go on, else the common stop
        iteration. Also the optimizer state's adoption (StateAdoption: `adopt_state_after`
        once every worker reported its state ready)."""
        w = self.worker(worker_id)
        if progress is not None:
            self._record_progress(w, progress, now)
        w.progress.iteration = max(w.progress.iteration, iteration)
        self._check_stop(now, w)
        workers = list(self.registry.workers.values())
        stop_at = self.stopper.checkpoint(w, iteration, workers)
        self.adoption.checkpoint(w, optimizer_state_ready, workers)
        if self.consensus_id and not self.consensus_at:
            # The largest grant given: every worker learns it at or before reaching it.
            live = [x for x in workers if x.state not in GONE]
            self.consensus_at = max([x.checkpoint_grant for x in live] + [iteration + 1])
        return stop_at

    def want_consensus(self, consensus_id: int) -> None:
        """A consensus model is wanted (0: no longer): lock-step workers agree on the
        iteration to publish at, at their next checkpoints (`checkpoint`)."""
        self.consensus_id, self.consensus_at = consensus_id, 0

    @property
    def adopt_state_after(self) -> int:
        """The iteration after which lock-step workers average their optimizer state
        (0: not agreed yet)."""
        return self.adoption.after_iteration

    def stop(self, reason: str, now: float, *, failure: bool = False) -> Deliveries:
        """Stop the run (the first reason stays); `failure`: a failure stopped it, not
        its budget, its target or a request (the service's history calls it failed)."""
        if not self.stopper.stop(reason):
            return {}
        if self.started_at is not None:
            self.progress.close(now - self.started_at)
        self.stopped_by_failure = failure
        return self.groups.stop(reason, now)

    def _check_stop(self, now: float, touched: WorkerRecord | None = None) -> Deliveries:
        """Stop on the budget or the target; `touched`: the worker whose report came
        (the budget's sums are updated with it alone: BudgetWatch)."""
        if self.stopped or self.started_at is None:
            return {}
        reason = self.budget.reached(self.registry, touched)
        if reason:
            return self.stop(reason, now)
        if self.progress.time_to_target is not None:
            return self.stop(f"target loss {self.settings.target_loss} reached", now)
        return {}

    def _record_progress(self, w: WorkerRecord, p: Progress, now: float) -> None:
        elapsed = None if self.started_at is None or self.stopped else now - self.started_at
        self.progress.record(w, p, elapsed)

    # ------------------------------------------------------------------ views
    @property
    def workers(self) -> dict[int, WorkerRecord]:
        return self.registry.workers

    @property
    def stopped(self) -> bool:
        return self.stopper.stopped

    @property
    def stop_reason(self) -> str:
        return self.stopper.reason

    @property
    def members_lost(self) -> bool:
        """The run stopped for a failure and its peers need every worker: a collective
        that waits for a lost member will never complete (HeartbeatReply.members_lost)."""
        return self.stopped and self.stopped_by_failure and self.role.needs_every_worker

    @property
    def table(self) -> GroupTable:
        return self.groups.table

    @property
    def recent_groups(self) -> list[GroupRecord]:
        return list(self.groups.recent_groups)

    @property
    def loss_curve(self) -> list[tuple[float, float, float]]:
        return self.progress.loss_curve

    @property
    def time_to_target(self) -> float | None:
        return self.progress.time_to_target

    @property
    def iterations_to_target(self) -> float | None:
        return self.progress.iterations_to_target

    @property
    def num_lease_expirations(self) -> int:
        return self.registry.num_lease_expirations

    def live(self) -> list[WorkerRecord]:
        return self.registry.live()

    def mean_loss(self) -> float | None:
        return self.progress.mean_loss()

    def mean_iterations(self) -> float:
        return self.progress.mean_iterations()

    def consensus_distance(self) -> float | None:
        return self.progress.consensus_distance()

    def elapsed(self, now: float) -> float:
        return 0.0 if self.started_at is None else now - self.started_at

    def worker(self, worker_id: int) -> WorkerRecord:
        return self.registry.worker(worker_id)
