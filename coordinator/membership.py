"""The membership part of the coordinator's core (pure code): workers register, the
membership forms (ranks and graph final), a replacement takes a departed member's rank,
an elastic run grows, a lock-step one asks a joiner to wait for a restart round, a
resumed run forms anew; then every member reports ready with its tensor schema and the
run's clock starts.

`RunMembership` is the base of `CoordinatorCore` (core.py), which owns the state named
below and the rules of training and stopping.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ripples.coordinator.errors import CoordinatorError
from ripples.coordinator.registry import Registry, WorkerRecord, WorkerState
from ripples.coordinator.run_graph import RankGraph, RunGraph, static_layout_error
from ripples.coordinator.schema import Schema, SchemaCheck

if TYPE_CHECKING:
    from ripples.coordinator.config import RunSettings
    from ripples.coordinator.decisions import Deliveries
    from ripples.coordinator.progress import ProgressTracker
    from ripples.coordinator.restart_rounds import RestartRounds
    from ripples.coordinator.stop import BudgetWatch, StopAgreement


def differing_ranks(members: Iterable[WorkerRecord]) -> tuple[int, ...]:
    """The ranks whose initial model (fingerprint) differs from rank 0's: the members copy
    rank 0's model before their first step (Every worker starts from one model). Empty
    when rank 0 or a member said no fingerprint (a runner without a model of its own)."""
    by_rank = {w.rank: w.model_fingerprint for w in members}
    first = by_rank.get(0, "")
    if not first or not all(by_rank.values()):
        return ()
    return tuple(sorted(r for r, f in by_rank.items() if f != first))


class RunMembership:
    """Registration, the membership's forming and changes, readiness and the start."""

    settings: RunSettings
    registry: Registry
    graph: RunGraph
    prepared_graph: RankGraph | None
    progress: ProgressTracker
    rounds: RestartRounds
    stopper: StopAgreement
    budget: BudgetWatch
    model_schema: SchemaCheck
    training_schema: SchemaCheck
    started_at: float | None
    resumed_elapsed: float
    _ready_ids: set[int]
    start_differing_ranks: tuple[int, ...]

    if TYPE_CHECKING:  # what CoordinatorCore defines for these rules
        @property
        def stopped(self) -> bool: ...

        @property
        def stop_reason(self) -> str: ...

        def live(self) -> list[WorkerRecord]: ...

        def worker(self, worker_id: int) -> WorkerRecord: ...

        def elapsed(self, now: float) -> float: ...

        def stop(self, reason: str, now: float, *, failure: bool = False) -> Deliveries: ...

        def _restart(self, reason: str, now: float, *, failure: bool = True,
                     alive: tuple[tuple[str, int], ...] = ()) -> None: ...

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
            refusal = self.rounds.refusal(self.live(), failure=False)
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
            self.graph = RunGraph.build(self.settings, self.registry.holders_by_rank(),
                                        self.prepared_graph)
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
        self.rounds.began_at = None  # the resumed run waits for every worker
        self.stopper.stopped, self.stopper.reason, self.stopper.stop_at_iteration = False, "", 0
        for w in self.live():
            w.state = WorkerState.EXPIRED
            w.error = "lost with the run, which was resumed"
        self.registry.formed = False

    def _form_membership(self, now: float) -> None:
        if self.rounds.began_at is not None:
            self.registry.generation += 1
            self.rounds.began_at = None
        ordered = self.registry.form()
        self.registry.continue_ranks(ordered)
        try:
            self.graph = RunGraph.build(self.settings, ordered, self.prepared_graph)
        except ValueError as err:
            self.stop(f"invalid topology: {err}", now)
            return
        problem = static_layout_error(self.settings, self.live())
        if problem:
            self.stop(problem, now)

    def mark_ready(self, worker_id: int, planned_iterations: int, now: float,
                   schema: Schema | None = None, model_fingerprint: str = "") -> bool:
        """The worker built its model and waits to train; starts the run when every
        member is ready. The clock of the run starts here, not at registration, so that
        start-up work (imports, data loading) does not count as training time. A schema
        that differs from the first worker's is refused (FAILED_PRECONDITION).
        `model_fingerprint`: a digest of its initial model (start_differing_ranks).
        Returns True once the run has started."""
        w = self.worker(worker_id)
        w.model_fingerprint = model_fingerprint
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
                self.start_differing_ranks = differing_ranks(live)
        return self.started_at is not None

    def start_models_note(self) -> str:
        """What the start did about the members' initial models ("" when they were one
        model already or none said)."""
        ranks = self.start_differing_ranks
        if not ranks:
            return ""
        return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} built a "
                "model whose initial values differ from rank 0's (a seed per rank?): every "
                "worker starts from rank 0's model, as with DDP")

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
