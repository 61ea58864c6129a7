"""The coordinator's loss curve stays bounded however long the run (pure code, fake times)."""

from __future__ import annotations

import pytest

from ripples.coordinator.progress import LOSS_CURVE_MAX_POINTS, ProgressTracker
from ripples.coordinator.registry import Progress, WorkerRecord


def _tracker(target_loss: float) -> tuple[ProgressTracker, list[WorkerRecord]]:
    workers = [WorkerRecord(worker_id=i, host="node0", local_rank=i, device="cpu", pid=i,
                            node=0, lease_expires_at=0.0) for i in range(2)]
    tracker = ProgressTracker(num_workers=2, target_loss=target_loss, live=lambda: workers,
                              everyone=lambda: workers)
    return tracker, workers


def test_a_long_run_keeps_a_bounded_even_curve_with_its_first_and_target_points() -> None:
    tracker, workers = _tracker(target_loss=0.5)
    reports, every = 100_000, 0.07  # the two workers report in turn: a run of 7,000 s
    for i in range(reports):
        t = i * every
        tracker.record(workers[i % 2], Progress(iteration=i // 2 + 1, loss=2.0 / (1 + t / 100)),
                       t)
    curve = tracker.loss_curve
    times = [t for t, _, _ in curve]
    assert len(curve) <= LOSS_CURVE_MAX_POINTS
    assert times == sorted(set(times))
    # Spans the whole run: from the first report both workers had made (every worker's
    # loss is needed for a mean) to within one spacing of the last report.
    assert times[0] == every
    end = (reports - 1) * every
    assert end - tracker.curve_step <= times[-1] <= end
    # Evenly thinned: no hole wider than twice the current spacing.
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) <= 2 * tracker.curve_step
    assert tracker.time_to_target is not None and tracker.time_to_target in times
    at_target = curve[times.index(tracker.time_to_target)]
    assert at_target[1] <= 0.5 < curve[times.index(tracker.time_to_target) - 1][1]


def test_an_unevenly_spaced_curve_restored_from_a_snapshot_is_bounded_too() -> None:
    tracker, workers = _tracker(target_loss=0.0)
    # Saved by an earlier coordinator: spaced ever wider, at the reset minimum spacing.
    tracker.loss_curve = [(i * i * 0.01, 1.0, float(i)) for i in range(LOSS_CURVE_MAX_POINTS)]
    start = tracker.loss_curve[-1][0]
    for i in range(2_000):
        tracker.record(workers[i % 2], Progress(iteration=i, loss=1.0), start + 0.1 * (i + 1))
    times = [t for t, _, _ in tracker.loss_curve]
    assert len(times) <= LOSS_CURVE_MAX_POINTS
    assert times == sorted(set(times)) and times[0] == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_the_running_mean_finds_the_target_at_the_same_report_as_the_full_mean(
        seed: int) -> None:
    """With the registry's version the target check is O(1) per report (a running sum of
    the live losses): it must reach the target at exactly the report the full mean does,
    and leave the same curve."""
    import random

    rng = random.Random(seed)
    n = 50
    reports = [(rng.randrange(n), 3.0 * (1 - i / 4000) + rng.random()) for i in range(4000)]
    results = []
    for version in (None, lambda: 0):
        workers = [WorkerRecord(worker_id=i, host="node0", local_rank=i, device="cpu", pid=i,
                                node=0, lease_expires_at=0.0) for i in range(n)]
        tracker = ProgressTracker(num_workers=n, target_loss=1.2, live=lambda ws=workers: ws,
                                  everyone=lambda ws=workers: ws, version=version)
        for i, (w, loss) in enumerate(reports):
            tracker.record(workers[w], Progress(iteration=i, loss=loss), elapsed=i * 0.01)
        results.append((tracker.time_to_target, tracker.loss_curve))
    assert results[0][0] is not None
    assert results[0] == results[1]
