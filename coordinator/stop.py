"""When the run ends (pure code): the stop flag and reason, the iteration budget, and the
lock-step protocols' agreements on one iteration for every worker: where they stop, and
after which the optimizer state joins the averaged state."""

from __future__ import annotations

from ripples.coordinator.live_sums import LiveSums
from ripples.coordinator.registry import GONE, Registry, WorkerRecord


class StopAgreement:
    """The run's stop, and the stop iteration lock-step workers agree on.

    Lock-step workers (every worker in every collective) must all stop after the same
    iteration, or one would wait in a collective for a peer that left. A worker asks at
    every multiple of `interval` completed iterations (`checkpoint`) and is granted the
    next interval; every worker starts granted the first. Once the run stops, the stop
    iteration is the largest grant given (or the asker's iteration, if larger), which
    every worker learns at or before reaching it.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.stopped = False
        self.reason = ""
        self.stop_at_iteration = 0

    def stop(self, reason: str) -> bool:
        """Stop the run; False if it had already stopped (the first reason stays)."""
        if self.stopped:
            return False
        self.stopped, self.reason = True, reason
        return True

    def checkpoint(self, w: WorkerRecord, iteration: int,
                   workers: list[WorkerRecord]) -> int:
        """0 to go on, else the common stop iteration."""
        if self.stopped:
            if self.stop_at_iteration == 0:
                # The live workers' grants: a departed one's (a lock-step run that restarted
                # from a checkpoint) is no promise to anybody still training.
                live = [x for x in workers if x.state not in GONE] or workers
                grants = [max(x.checkpoint_grant, self.interval) for x in live]
                self.stop_at_iteration = max(max(grants), iteration, 1)
            return self.stop_at_iteration
        w.checkpoint_grant = max(w.checkpoint_grant, iteration + self.interval)
        return 0


class StateAdoption:
    """The iteration after which every lock-step worker averages its optimizer state too.

    A worker's optimizer state appears after its first applied step (a step skipped by
    GradScaler or on_nonfinite="skip" creates none), so workers would add it to their
    averaged buffer at different iterations, and a collective would join buffers of two
    sizes. Workers report at their checkpoints when their state is complete; once every
    live worker has, the adoption iteration is the largest checkpoint grant (as for the
    stop: every worker learns it at or before reaching it) and never changes.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self.after_iteration = 0

    def checkpoint(self, w: WorkerRecord, ready: bool, workers: list[WorkerRecord]) -> int:
        """0 while some worker's state is not ready, else the adoption iteration. Call
        after StopAgreement.checkpoint granted the asker its next interval."""
        w.optimizer_state_ready = w.optimizer_state_ready or ready
        live = [x for x in workers if x.state not in GONE]
        if self.after_iteration == 0 and live and all(x.optimizer_state_ready for x in live):
            self.after_iteration = max(max(x.checkpoint_grant, self.interval) for x in workers)
        return self.after_iteration


def budget_reached(workers: list[WorkerRecord]) -> str | None:
    """The stop reason once the workers' iterations reach their planned total, or None.
    Only when every live worker planned a budget (a user's loop may plan none); a worker
    that left counts with what it did."""
    live = [w for w in workers if w.state not in GONE]
    planned = [w.progress.planned_iterations for w in live]
    if not planned or not all(planned):
        return None
    done = sum(w.progress.iteration for w in workers)
    budget = sum(planned) + sum(w.progress.iteration for w in workers if w.state in GONE)
    return f"iteration budget reached ({done} iterations)" if done >= budget else None


class BudgetWatch:
    """`budget_reached` in O(1) per event: the stop rule holds exactly when the live
    workers' iterations reach their planned total (the departed ones' iterations count
    on both sides of budget_reached's comparison), so these two sums over the live
    workers are kept (LiveSums), each updated with the one worker an event names, and a
    budget they find reached is confirmed by `budget_reached` itself before the run
    stops. A live worker without a budget (a user's loop may plan none) holds it off."""

    def __init__(self) -> None:
        self._sums = LiveSums(
            lambda w: (w.progress.iteration, w.progress.planned_iterations),
            lambda values: values[1] == 0, width=2)

    def reached(self, registry: Registry, touched: WorkerRecord | None) -> str | None:
        self.note(registry, touched)
        sums = self._sums
        if sums.missing or not sums.count or sums.totals[0] < sums.totals[1]:
            return None
        return budget_reached(registry.counted())

    def note(self, registry: Registry, touched: WorkerRecord | None) -> None:
        """`touched`'s iteration or budget may have changed."""
        self._sums.refresh(registry.version, lambda: registry.live_by_id().values(), touched,
                           registry.is_live)
