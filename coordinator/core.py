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
- `SchemaCheck` (schema.py): every worker averages the same tensors.

A run goes through: registration until `num_workers` registered (then the membership is
formed: ranks and graph are final), readiness until every member built its model and
its schema matched (then training starts and the clock runs), training, stop.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from ripples.coordinator.config import RunSettings
from ripples.coordinator.errors import CoordinatorError
from ripples.coordinator.group_service import (
    Deliveries,
    GroupDecision,
    GroupService,
    Outcome,
)
from ripples.coordinator.groups import GroupRecord, GroupTable
from ripples.coordinator.progress import ProgressTracker
from ripples.coordinator.registry import GONE, Progress, Registry, WorkerRecord, WorkerState
from ripples.coordinator.run_graph import RunGraph
from ripples.coordinator.schema import Schema, SchemaCheck
from ripples.coordinator.stop import BudgetWatch, StateAdoption, StopAgreement
from ripples.protocols.spec import Coordination

SUSPECT_HEARTBEATS = 3
"""A worker whose Synchronize stream broke keeps its lease for this many heartbeat
intervals only, unless it heartbeats (`suspect`): with the default 0.5 s, a SIGKILLed
worker's groups are cancelled 1.5 s after its death instead of a lease (10 s) after."""
RESTART_STRAGGLER_WINDOWS = 3
"""A restart round forms without the restarting workers that are not back after this many
join windows (with at least min_workers)."""
RESTART_GIVE_UP_WINDOWS = 6
"""A restart round whose workers did not come back within this many join windows stops
the run (every wait has an end; 90 s with the default window, within the workers' own
start timeout of 120 s)."""

__all__ = ["GONE", "CoordinatorCore", "CoordinatorError", "Deliveries", "GroupDecision",
           "Outcome", "Progress", "WorkerRecord", "WorkerState"]


class CoordinatorCore:
    """All state of one run and every rule that changes it."""

    def __init__(self, settings: RunSettings, *, now: float, first_worker_id: int = 0) -> None:
        self.settings = settings
        self.role = settings.role
        self.registry = Registry(settings.num_workers, settings.lease_seconds,
                                 settings.max_workers, first_worker_id=first_worker_id)
        self.graph = RunGraph()
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
        self.restarts = 0
        """Restart rounds opened so far (lock-step runs: `_restart`)."""
        self.failure_restarts = 0
        """Of them, the rounds a failure opened (max_restarts bounds these; a joiner's
        round does not count, as with torchelastic)."""
        self.expected_back: set[tuple[str, int]] = set()
        """The open round's workers that are alive and restart: (host, local rank) of the
        members it ended and of the one whose failed leave opened it. The round waits
        for them before it forms with fewer than num_workers."""
        self.restart_began_at: float | None = None
        """When the open restart round began (None: none is open)."""
        self.restart_reason = ""
        """Why the last restart round was opened."""
        self.stopped_by_failure = False
        """The run stopped because of a failure (see stop)."""

    # ------------------------------------------------------------------ membership
    def register(self, host: str, local_rank: int, device: str, pid: int, now: float) -> int:
        """A worker joins; once all `num_workers` have, the membership is formed."""
        if self.stopped:
            raise CoordinatorError("FAILED_PRECONDITION",
                                   f"the run is over ({self.stop_reason}); start a new "
                                   "coordinator for a new run")
        if not host:  # before a joiner may open a restart round
            raise CoordinatorError("INVALID_ARGUMENT", "host must not be empty")
        fixed = self.settings.spec.fixed_membership
        if self.registry.formed and self.settings.restarts:
            refusal = self._restart_refusal(failure=False)
            if not refusal:
                self._join_lockstep(host, local_rank, now)
            else:
                fixed = f"{fixed}; no restart round: {refusal}"
        w = self.registry.register(host, local_rank, device, pid, now, elastic=not fixed,
                                   fixed_reason=fixed)
        if w.replacement:
            self._take_in_replacement(w)
        elif self.registry.complete:
            self._form_membership(now)
        return w.worker_id

    def _join_lockstep(self, host: str, local_rank: int, now: float) -> None:
        """A worker asks to join a formed lock-step run that restarts on membership
        changes: a run below num_workers opens a restart round for it (scale-up); a full
        one asks it to wait (RESOURCE_EXHAUSTED: the client retries until a member leaves
        and a round opens)."""
        registry = self.registry
        if registry.size < registry.num_workers and self.started_at is not None:
            self._restart(f"host {host} local rank {local_rank} joins: {registry.size} -> "
                          f"{registry.size + 1} workers", now, failure=False)
            return
        raise CoordinatorError(
            "RESOURCE_EXHAUSTED",
            f"the run has its {registry.size} workers; a worker joins a lock-step run when "
            "a restart round opens (a member left)")

    def _take_in_replacement(self, w: WorkerRecord) -> None:
        """`w` took a departed member's rank: it takes that member's place in the graph
        (its neighbours on a sparse topology) and, once ready, trains at once. Or `w` is
        an extra rank (scale-up): the graph is built again over every rank (refused,
        undone, if the topology does not fit the new size)."""
        departed = next((x for x in self.registry.workers.values()
                         if x.replaced_by == w.worker_id), None)
        if departed is not None:
            self.graph.replace_worker(departed.worker_id, w.worker_id)
            return
        try:
            self.graph = RunGraph.build(self.settings, self.registry.holders_by_rank())
        except ValueError as err:
            self.registry.discard(w.worker_id)
            self.registry.size -= 1
            raise CoordinatorError("FAILED_PRECONDITION",
                                   f"the run cannot grow to {self.registry.size + 1} "
                                   f"workers: {err}") from None
        self.progress.num_workers = self.registry.size

    @property
    def membership_formed(self) -> bool:
        return self.registry.formed

    def resume(self, now: float) -> None:
        """Go on with this (restored) run after a total failure: every worker of it is
        gone, a new set registers, ranks form again, and each new member continues the
        iteration count of the departed member of its rank (with the checkpoints the
        workers restore, `ripples run --resume`). The stop that ended it is lifted (a
        run whose budget was spent stops again at once); training time goes on from
        where it was once every member is ready."""
        if self.started_at is not None:  # else a restart round had paused the clock
            self.resumed_elapsed = self.elapsed(now)
        self.started_at = None
        self.restart_began_at = None  # the resumed run waits for every worker
        self.stopper.stopped, self.stopper.reason, self.stopper.stop_at_iteration = False, "", 0
        for w in self.live():
            w.state = WorkerState.EXPIRED
            w.error = "lost with the run, which was resumed"
        self.registry.formed = False

    def _form_membership(self, now: float) -> None:
        if self.restart_began_at is not None:
            self.registry.generation += 1
            self.restart_began_at = None
        ordered = self.registry.form()
        self.registry.continue_ranks(ordered)
        try:
            self.graph = RunGraph.build(self.settings, ordered)
        except ValueError as err:
            self.stop(f"invalid topology: {err}", now)
            return
        problem = self.static_layout_error()
        if problem:
            self.stop(problem, now)

    def mark_ready(self, worker_id: int, planned_iterations: int, now: float,
                   schema: Schema | None = None) -> bool:
        """The worker built its model and waits to train; starts the run when every
        member is ready. The clock of the run starts here, not at registration, so that
        start-up work (imports, data loading) does not count as training time. A schema
        that differs from the first worker's is refused (FAILED_PRECONDITION).
        Returns True once the run has started."""
        w = self.worker(worker_id)
        if schema is not None:
            problem = self.model_schema.check(schema, w.describe())
            if problem:
                raise CoordinatorError("FAILED_PRECONDITION", problem)
            w.schema_digest = schema.digest
        w.progress.planned_iterations = planned_iterations
        w.ready = True
        self.budget.note(self.registry, w)
        self._ready_ids.add(worker_id)
        if w.replacement and self.started_at is not None:
            w.state = WorkerState.COMPUTING
        if (self.started_at is None and self.registry.formed and not self.stopped
                and len(self._ready_ids) >= self.registry.num_live):
            # Counted first: a start checks every worker once, not at each of n readies.
            live = self.live()
            self._ready_ids = {x.worker_id for x in live if x.ready}
            if len(self._ready_ids) == len(live):
                self.started_at = now - self.resumed_elapsed
                for x in live:
                    x.state = WorkerState.COMPUTING
        return self.started_at is not None

    def note_ready(self, worker_ids: Iterable[int]) -> None:
        """Workers ready already (a core restored from a snapshot)."""
        self._ready_ids.update(worker_ids)

    def check_schema(self, worker_id: int, schema: Schema) -> None:
        """The averaged tensors once the optimizer state joined them: refuse a worker
        whose tensors differ from the first one's (FAILED_PRECONDITION). From now on the
        worker's groups execute only with workers that average the same tensors."""
        w = self.worker(worker_id)
        problem = self.training_schema.check(schema, w.describe())
        if problem:
            raise CoordinatorError("FAILED_PRECONDITION", problem)
        w.schema_digest = schema.digest

    def neighbours_of(self, worker_id: int) -> tuple[int, ...]:
        """The live workers `worker_id` may average with (all others on a complete graph)."""
        return self.groups.neighbours_of(worker_id)

    def static_layout_error(self) -> str | None:
        """Why the static schedule cannot run on the registered workers, or None."""
        if self.role.coordination is not Coordination.STATIC:
            return None
        per_node: dict[int, int] = {}
        for w in self.live():
            per_node[w.node] = per_node.get(w.node, 0) + 1
        k = self.settings.workers_per_node
        if any(n != k for n in per_node.values()):
            return (
                f"the static schedule needs exactly {k} workers on every host (workers per "
                f"node), got {sorted(per_node.values())}; set workers_per_node to match"
            )
        return None

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
        reason: str = "",
    ) -> Deliveries:
        """The worker leaves: FAILED with `error`, or cleanly (`reason`: why it ended)."""
        w = self.worker(worker_id)
        if progress is not None:
            self._record_progress(w, progress, now)
        w.error = error
        w.leave_reason = reason
        return self._remove(w, WorkerState.FAILED if error else WorkerState.LEFT, now)

    def suspect(self, worker_id: int, now: float) -> float | None:
        """The worker's Synchronize stream ended while it trains: its process died (the
        kernel closed its connection), its connection did, or it is reopening the
        stream. A live worker heartbeats every heartbeat interval, which renews its whole
        lease; so its lease is cut to SUSPECT_HEARTBEATS intervals from now, and a dead
        worker's groups are cancelled then, not a whole lease later
        (docs/fault-tolerance.md). Returns when the cut lease ends (None: the worker is
        gone or not started, the run stopped, or its lease ends sooner anyway)."""
        w = self.registry.live_by_id().get(worker_id)
        if w is None or not w.ready or self.stopped:  # stopped: the final average's turn
            return None
        ends = now + SUSPECT_HEARTBEATS * self.settings.heartbeat_interval_seconds
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
    def _restart_refusal(self, *, failure: bool = True) -> str:
        """Why this run cannot restart its workers on a membership change ("" when it
        can): its protocol does not, the restarts are spent, or a member holds no
        checkpoint yet (it would start over from its initial model)."""
        if not self.settings.restarts:
            return f"{self.settings.protocol} does not restart its workers"
        if failure and self.failure_restarts >= self.settings.max_restarts:
            return (f"max_restarts ({self.settings.max_restarts}) spent on failures")
        blind = [w.worker_id for w in self.live() if w.progress.checkpoint_step == 0]
        if blind:
            return (f"worker {blind[0]} holds no checkpoint to restart from (give "
                    "--checkpoint-dir; a script saves with ripples.Checkpointer)")
        return ""

    def _restart(self, reason: str, now: float, *, failure: bool = True,
                 alive: tuple[tuple[str, int], ...] = ()) -> None:
        """Open a restart round (lock-step runs, torchelastic's re-rendezvous): every
        live member's part ends (`restarted`: its heartbeat says restart, its process
        exits and its launcher starts it again); registration opens anew; the membership
        forms once num_workers registered, or after the join window with at least
        min_workers (`_close_restart_round`); each new member continues the part of the
        departed member of its rank and restores the last checkpoint every rank holds.
        Training time pauses meanwhile. `failure`: a failure opened it (max_restarts
        counts these); `alive`: (host, local rank) of a departed worker that restarts too
        (it failed and said so: it is alive)."""
        self.restarts += 1
        self.failure_restarts += failure
        self.restart_began_at, self.restart_reason = now, reason
        self.expected_back = {(w.host, w.local_rank) for w in self.live()} | set(alive)
        if self.started_at is not None:  # else a round before this one paused the clock
            self.resumed_elapsed = self.elapsed(now)
        self.started_at = None
        for w in self.live():
            w.state, w.restarted = WorkerState.LEFT, True
            w.leave_reason = f"restart round {self.restarts}: {reason}"
        self.registry.formed = False

    def _close_restart_round(self, now: float) -> Deliveries:
        """Form the open restart round's membership once its join window passed with at
        least min_workers registered (the static schedule waits for every worker: its
        hosts must stay full); stop the run if too few came back within
        RESTART_GIVE_UP_WINDOWS windows."""
        began = self.restart_began_at
        if began is None or self.registry.formed or self.stopped:
            return {}
        waited = now - began
        members = self.live()
        live = len(members)
        window = self.settings.join_window_seconds
        shrinks = self.role.coordination is not Coordination.STATIC
        missing = self.expected_back - {(w.host, w.local_rank) for w in members}
        # Fewer than num_workers: after the join window, once every worker the round
        # ended is back (a blocked one restarts after RESTART_GRACE_SECONDS plus its
        # imports), or without the missing ones after RESTART_STRAGGLER_WINDOWS windows.
        waited_enough = waited >= window and (
            not missing or waited >= RESTART_STRAGGLER_WINDOWS * window)
        if waited_enough and live >= self.settings.min_workers and shrinks:
            self._form_membership(now)
            return {}
        if waited >= RESTART_GIVE_UP_WINDOWS * window:
            need = self.settings.min_workers if shrinks else self.settings.num_workers
            return self.stop(f"restart round {self.restarts} ({self.restart_reason}): "
                             f"{live} of the {need} workers needed registered within "
                             f"{waited:.0f} s", now, failure=True)
        return {}

    def rejoins(self, worker_id: int) -> str:
        """Why this departed worker restarts its process and registers anew, or "": a
        restart round ended its part, or it failed while a round is open (its own failure
        may have opened it)."""
        w = self.registry.workers.get(worker_id)
        if w is None or self.stopped:
            return ""
        round_open = self.restart_began_at is not None and not self.registry.formed
        if w.restarted or (w.state is WorkerState.FAILED and round_open):
            return f"restart round {self.restarts}: {self.restart_reason}"
        if w.state is WorkerState.EXPIRED and self.settings.restarts and (
                round_open or not self._restart_refusal(failure=False)):
            # Alive after all (a long pause cost it its lease): it restarts and registers
            # anew, joining the open round or opening one for the run to grow back.
            return (f"its lease expired ({w.error}); it registers anew"
                    + (f" in restart round {self.restarts}" if round_open else ""))
        return ""

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
                    and self.registry.formed and not self._restart_refusal()):
                # A restart round's member failed before training went on: another round.
                alive = ((w.host, w.local_rank),) if state is WorkerState.FAILED else ()
                self._restart(f"worker {w.worker_id} {state.value} before training "
                              f"resumed{why}", now, alive=alive)
            elif self.registry.formed:  # a member is missing: the run can never start
                deliveries.update(self.stop(
                    f"{w.describe()} {state.value} before training started{why}", now,
                    failure=True))
            return deliveries
        finished = 0 < w.progress.planned_iterations <= w.progress.iteration
        if self.role.needs_every_worker and not (state is WorkerState.LEFT and finished):
            # Lock-step peers cannot go on without it: every worker restarts from the last
            # checkpoint with the new membership, or (no restarts) everyone stops at the
            # next agreed iteration rather than wait inside collectives that never complete.
            # A graceful leave (SIGTERM before a preemption, request_stop()) shrinks the
            # run: a round without the leaver, which is no failure (max_restarts does not
            # count it), as when torchelastic loses a node it was told about.
            graceful = state is WorkerState.LEFT
            refusal = ("the static schedule cannot shrink (its hosts must stay full)"
                       if graceful and self.role.coordination is Coordination.STATIC
                       else self._restart_refusal(failure=not graceful))
            if not refusal:
                # A worker that failed and said so (Leave) is alive: it restarts too.
                alive = ((w.host, w.local_rank),) if state is WorkerState.FAILED else ()
                self._restart(f"worker {w.worker_id} {state.value}{why}", now,
                              failure=not graceful, alive=alive)
                return deliveries
            deliveries.update(self.stop(f"worker {w.worker_id} {state.value}{why}"
                                        + (f"; no restart: {refusal}" if refusal and
                                           self.settings.restarts else ""), now,
                                        failure=not graceful))
        elif self.role.needs_every_worker:  # it left having finished its budget
            deliveries.update(self.stop(
                f"iteration budget reached (worker {w.worker_id} finished its "
                f"{w.progress.planned_iterations} iterations)", now))
        elif len(self.live()) < self.settings.min_workers:
            last = f" (worker {w.worker_id} {state.value}{why})" if why else ""
            deliveries.update(self.stop(
                f"fewer than {self.settings.min_workers} workers remain{last}", now,
                failure=state is not WorkerState.LEFT))
        return deliveries

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
        if not self.groups.active:
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
