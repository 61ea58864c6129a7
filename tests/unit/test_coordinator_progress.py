"""The coordinator core turns the workers' progress reports into the run's curve and speed.

Progress arrives with heartbeats, group requests and checkpoints (a real `CoordinatorCore`,
the clock given by hand): the mean loss curve waits for every worker's loss, the run stops
at its target loss (time and iterations to target recorded) or its iteration budget, a
run shorter than one curve step still ends its curve at the stop, and a worker's own time
per iteration is measured between iterations, not within one.
"""

from __future__ import annotations

import dataclasses

import pytest
from coordinator_simulation import run_settings

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, Progress


def test_progress_reports_feed_the_loss_curve_and_the_target() -> None:
    run = dataclasses.replace(run_settings("smart", 2, 2, 2, 5, False, seed=0), target_loss=0.5)
    core = CoordinatorCore(run, now=0.0)
    for r in range(2):
        core.mark_ready(core.register("node0", r, "cpu", r, 0.0), 100, 0.0)
    core.heartbeat(0, Progress(iteration=3, loss=0.9), 1.0)
    assert core.mean_loss() is None  # worker 1 has not reported yet
    core.heartbeat(1, Progress(iteration=3, loss=0.7), 1.5)
    core.heartbeat(0, Progress(iteration=5, loss=0.2), 2.0)
    assert core.time_to_target == pytest.approx(2.0) and core.stopped
    assert core.iterations_to_target == pytest.approx(4.0)  # (5 + 3) / 2 workers
    assert core.loss_curve[0] == pytest.approx((1.5, 0.8, 3.0))
    assert core.loss_curve[-1] == pytest.approx((2.0, 0.45, 4.0))


def test_own_time_per_iteration_is_measured_between_iterations_not_within_one() -> None:
    core = CoordinatorCore(run_settings("smart", 2, 2, 2, 5, False, seed=0), now=0.0)
    wid = core.register("node0", 0, "cpu", 0, 0.0)
    w = core.workers[wid]

    def report(iteration: int, compute: float, preduce: float = 0.0) -> None:
        core.heartbeat(wid, Progress(iteration=iteration, compute_seconds=compute,
                                     preduce_seconds=preduce), 1.0)

    report(1, 0.0)  # counted before its time: iteration 1's time arrives later
    report(1, 5.0)  # warm-up, reported within iteration 1
    report(2, 5.0)
    assert w.own_seconds is None  # the first iteration (warm-up) sets no speed
    report(2, 5.5, 0.1)  # within iteration 2: the baseline stays at iteration 2's report
    report(3, 5.5, 0.1)
    assert w.own_seconds == pytest.approx(0.6)  # compute 0.5 + collective 0.1
    report(5, 7.9, 0.1)  # two iterations of 1.2 s
    assert w.own_seconds == pytest.approx(0.3 * 1.2 + 0.7 * 0.6)


@pytest.mark.parametrize("protocol", ["ripples-smart", "allreduce"])
def test_progress_sent_with_sync_requests_records_the_target_without_heartbeats(
    protocol: str,
) -> None:
    """A run shorter than one heartbeat interval still gets its time to target: progress
    rides on every group request (group-generator protocols) and every checkpoint
    (lock-step protocols)."""
    run = RunSettings(protocol=protocol, num_workers=2, workers_per_node=2,
                      iterations=100, target_loss=0.5)
    core = CoordinatorCore(run, now=0.0)
    ids = [core.register("node0", r, "cpu", r, 0.0) for r in range(2)]
    for wid in ids:
        core.mark_ready(wid, 100, 0.0)
    sync = core.checkpoint if protocol == "allreduce" else core.request_group

    sync(ids[0], 8, 0.05, Progress(iteration=8, loss=0.9))
    sync(ids[1], 8, 0.06, Progress(iteration=8, loss=0.6))
    assert core.time_to_target is None and core.loss_curve == [pytest.approx((0.06, 0.75, 8))]
    sync(ids[0], 16, 0.12, Progress(iteration=16, loss=0.3))
    assert core.time_to_target == pytest.approx(0.12)
    assert core.iterations_to_target == pytest.approx(12.0)
    assert core.loss_curve[-1] == pytest.approx((0.12, 0.45, 12.0))
    assert core.workers[ids[0]].progress.iteration == 16


def test_a_run_shorter_than_one_curve_step_still_ends_its_curve_at_the_stop() -> None:
    """The first point waits for every worker's loss and, after a try that found one
    missing, for a curve step (0.2 s); a run whose budget ends inside that step (60 fast
    iterations on a loaded host) still shows its curve: the stop closes it."""
    run = RunSettings(protocol="ripples-smart", num_workers=2, workers_per_node=2,
                      iterations=3)
    core = CoordinatorCore(run, now=0.0)
    ids = [core.register("node0", r, "cpu", r, 0.0) for r in range(2)]
    for wid in ids:
        core.mark_ready(wid, 3, 0.0)

    def report(wid: int, iteration: int, now: float, loss: float) -> None:
        core.request_group(wid, iteration, now, Progress(iteration=iteration, loss=loss,
                                                         planned_iterations=3))

    report(ids[0], 1, 0.01, 2.0)  # worker 1 has not reported: no point yet
    report(ids[1], 1, 0.02, 1.8)
    assert core.loss_curve == []  # the retry is due at 0.21 s
    report(ids[0], 3, 0.04, 1.2)
    report(ids[1], 3, 0.05, 1.0)
    assert core.stopped and "iteration budget" in core.stop_reason
    assert core.loss_curve == [pytest.approx((0.05, 1.1, 3.0))]
    core.stop("again", 0.3)  # the first reason stays and the curve gains no point
    assert len(core.loss_curve) == 1
