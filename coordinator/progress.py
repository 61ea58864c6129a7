"""The run's progress as the coordinator sees it (pure code): the loss curve, the time to
the target loss, each worker's own time per iteration (the smart policy's speed signal)
and the consensus-distance estimate of gossip runs.

Progress arrives with every heartbeat and group request; recording it stays O(1) in the
common case (the curve is rate-limited and the mean loss is only computed when due). The
curve is bounded: every run status carries it, however long the run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from ripples.coordinator.live_sums import LiveSums
from ripples.coordinator.registry import Progress, WorkerRecord

LOSS_CURVE_MIN_STEP_SECONDS = 0.2
LOSS_CURVE_MAX_POINTS = 1024
"""Past this length the curve is thinned to about half, evenly over the run, and its
minimum spacing doubles: a run of any length keeps 512 to 1,024 points from start to end
(an hour's run one every 4 to 7 s)."""
# The consensus-distance estimate averages the pairwise distances of this many recent
# exchanges per worker.
DISTANCE_WINDOW_PER_WORKER = 4
# Weight of the newest report in a worker's moving average of its own time per iteration.
OWN_SECONDS_SMOOTHING = 0.3


TARGET_SLACK = 1e-9
"""The running sum of losses may drift by rounding: a mean this close to the target is
checked exactly."""


class ProgressTracker:
    """Loss curve, time to target and speed signals of one run."""

    def __init__(self, *, num_workers: int, target_loss: float,
                 live: Callable[[], list[WorkerRecord]],
                 everyone: Callable[[], list[WorkerRecord]], lockstep: bool = False,
                 version: Callable[[], int] | None = None) -> None:
        self.num_workers = num_workers
        self._version = version
        self._loss_sums = LiveSums(lambda w: (w.progress.loss,), lambda v: v[0] != v[0],
                                   width=1, resum_every=10)
        """While a target loss is watched, its check at every report: O(1) (`version`:
        the registry's live-set version; without it every report sums every loss)."""
        self.lockstep = lockstep
        self.target_loss = target_loss
        self._live = live
        self._everyone = everyone
        self.loss_curve: list[tuple[float, float, float]] = []  # (seconds, loss, iterations)
        self.curve_step = LOSS_CURVE_MIN_STEP_SECONDS
        """Minimum seconds between two points of the curve (doubles at each thinning)."""
        self._first_point_retry_at = float("-inf")
        """The first point waits for every worker's loss: after a try that found one
        missing, the next try comes a curve step later (each try is O(n))."""
        self.time_to_target: float | None = None
        self.iterations_to_target: float | None = None
        self.pair_sq_distances: deque[float] = deque(
            maxlen=DISTANCE_WINDOW_PER_WORKER * num_workers)

    def record(self, w: WorkerRecord, p: Progress, elapsed: float | None) -> None:
        """Take a worker's report; `elapsed` is the training time so far (None before the
        start or after the stop: then only the worker's own numbers are kept)."""
        p.iteration = max(p.iteration, w.progress.iteration)
        # Its predecessor's (a restarted lock-step worker reports its restore later).
        p.checkpoint_step = max(p.checkpoint_step, w.progress.checkpoint_step)
        _update_own_seconds(w, p)
        w.progress = p
        if elapsed is None:
            return  # after the stop, workers leave one by one: their mean is no training loss
        target = self.target_loss
        watching_target = target > 0 and self.time_to_target is None
        curve_due = (elapsed >= self._first_point_retry_at if not self.loss_curve
                     else elapsed - self.loss_curve[-1][0] >= self.curve_step)
        if not (watching_target or curve_due):
            return  # progress arrives with every group request: keep the common case O(1)
        if watching_target and self._version is not None:
            sums = self._loss_sums
            sums.refresh(self._version(), self._live, w)  # takes every report in
            quick = (None if sums.missing or not sums.count
                     else sums.totals[0] / sums.count)
            if not curve_due and (quick is None or (
                    self.loss_curve and quick > target + TARGET_SLACK * max(1.0, abs(target)))):
                return  # not reached, no point due (below: the exact mean, if it may be)
        mean = self.mean_loss()
        if mean is None:
            # Not every worker reported a loss yet (before the first point): try again a
            # curve step later, not at every report (10,000 workers' first requests).
            self._first_point_retry_at = elapsed + self.curve_step
            return
        reached = watching_target and mean <= target
        mean_iterations = self.mean_iterations()
        if reached:
            self.time_to_target = elapsed
            self.iterations_to_target = mean_iterations
        # Rate-limited, except for the point that reaches the target: the curve must show it.
        if reached or curve_due or not self.loss_curve:
            self._add_point(elapsed, mean, mean_iterations)

    def close(self, elapsed: float) -> None:
        """The run stopped at `elapsed`: the curve ends with the mean loss at the stop
        (the history shows a finished run's last loss, and a run shorter than one curve
        step, or whose first try at a point found a worker not yet reported, still has a
        curve). Nothing when a live worker never reported a loss."""
        if self.loss_curve and self.loss_curve[-1][0] >= elapsed:
            return
        mean = self.mean_loss()
        if mean is not None:
            self._add_point(elapsed, mean, self.mean_iterations())

    def _add_point(self, elapsed: float, mean: float, mean_iterations: float) -> None:
        self.loss_curve.append((elapsed, mean, mean_iterations))
        if len(self.loss_curve) > LOSS_CURVE_MAX_POINTS:
            self._thin_curve()

    def _thin_curve(self) -> None:
        """Double the curve's minimum spacing and keep the points that honour it, until
        it fits again: about every other point goes (evenly over the whole run), but never
        the first, the latest or the one where the target was reached. Costs O(points)
        once every ~LOSS_CURVE_MAX_POINTS / 2 points: O(1) per point amortised. A loop, not
        one halving: a curve restored from a snapshot may be spaced unevenly."""
        curve = self.loss_curve
        while len(curve) > LOSS_CURVE_MAX_POINTS:
            self.curve_step *= 2
            kept = [curve[0]]
            for point in curve[1:-1]:
                if point[0] - kept[-1][0] >= self.curve_step or point[0] == self.time_to_target:
                    kept.append(point)
            kept.append(curve[-1])
            curve = kept
        self.loss_curve = curve

    def add_pair_distance(self, squared_distance: float) -> None:
        self.pair_sq_distances.append(squared_distance)

    def mean_loss(self) -> float | None:
        """Mean of the live workers' latest losses, once every live worker reported one."""
        losses = [w.progress.loss for w in self._live()]
        if not losses or any(loss != loss for loss in losses):  # NaN: not reported yet
            return None
        return sum(losses) / len(losses)

    def mean_iterations(self) -> float:
        """Iterations of an average worker: all iterations done, over the run's workers
        (a lock-step run's live workers all stand at its iteration: their mean, also
        after a restart round formed with fewer workers)."""
        if self.lockstep:
            live = self._live()
            if live:
                return sum(w.progress.iteration for w in live) / len(live)
        return sum(w.progress.iteration for w in self._everyone()) / self.num_workers

    def consensus_distance(self) -> float | None:
        """Estimated mean squared distance of the models to their average, from recent
        pairwise exchanges: for distinct workers i, j drawn uniformly,
        E||x_i - x_j||^2 = 2n/(n-1) * D. Gossip pairs are graph neighbours, which are
        closer than random pairs on sparse graphs, so this reads low there; it compares
        protocols on one graph fairly. None before any exchange."""
        if not self.pair_sq_distances:
            return None
        n = max(2, len(self._live()))
        mean = sum(self.pair_sq_distances) / len(self.pair_sq_distances)
        return (n - 1) / (2 * n) * mean


def _update_own_seconds(w: WorkerRecord, p: Progress) -> None:
    """Measured between reports of different iterations only: a worker counts an iteration
    before its synchronisation and adds the iteration's time after it, so the report of
    iteration k holds the time of iterations 1..k-1, two such reports are whole
    iterations apart, and reports within an iteration (retries, heartbeats) see the time
    grow under the same iteration."""
    base_iteration, base_total = w.own_base
    total = p.compute_seconds + p.preduce_seconds
    if p.iteration <= base_iteration:
        return
    w.own_base = (p.iteration, total)
    if base_iteration < 2:  # from reports 1 to 2: iteration 1, which includes warm-up
        return
    own = (total - base_total) / (p.iteration - base_iteration)
    if own < 0:  # a restarted worker's counters: start over
        w.own_seconds = None
        return
    w.own_seconds = own if w.own_seconds is None else (
        OWN_SECONDS_SMOOTHING * own + (1 - OWN_SECONDS_SMOOTHING) * w.own_seconds)
