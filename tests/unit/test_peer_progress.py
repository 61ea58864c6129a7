"""The peer runs' progress, measured as the coordinator measures a Ripples run, and the
bench options that choose and tune peers (pure code: no peer system runs here)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ripples.bench import harness
from ripples.bench.peers import PEERS
from ripples.bench.peers.config import PeerRunFiles, PeerWorkerConfig
from ripples.bench.peers.progress import (
    StepLogTail,
    StepRecord,
    fault_times,
    read_step_logs,
    replay,
    step_log_path,
)
from ripples.coordinator.progress import ProgressTracker
from ripples.coordinator.registry import Progress, WorkerRecord


def rec(rank: int, t: float, iteration: int, loss: float) -> StepRecord:
    return StepRecord(rank=rank, time=t, iteration=iteration, loss=loss,
                      samples=16 * iteration, compute_seconds=0.1 * iteration,
                      sync_seconds=0.01 * iteration)


def test_the_target_is_the_mean_of_every_workers_latest_loss() -> None:
    records = [rec(0, 100.5, 1, 2.0), rec(0, 101.0, 2, 1.0),  # rank 1 has no loss yet
               rec(1, 101.5, 1, 2.2),  # mean 1.6 at 1.5 s: the first point
               rec(1, 102.0, 2, 1.9),  # 1.45 at 2.0 s
               rec(0, 102.5, 3, 0.8),  # 1.35 at 2.5 s
               rec(1, 103.0, 3, 1.5)]  # 1.15 at 3.0 s
    progress = replay(list(reversed(records)), num_workers=2, start=100.0, target_loss=1.3)
    assert progress.time_to_target == pytest.approx(3.0)
    assert progress.iterations_to_target == pytest.approx(3.0)
    progress = replay(records, num_workers=2, start=100.0, target_loss=1.4)
    assert progress.time_to_target == pytest.approx(2.5)
    assert progress.iterations_to_target == pytest.approx(2.5)  # iterations 3 and 2
    assert progress.elapsed == pytest.approx(3.0)
    assert progress.total_samples == 16 * 6
    assert progress.loss_curve[0] == pytest.approx((1.5, 1.6, 1.5))
    assert replay(records, num_workers=2, start=100.0, target_loss=0.5).time_to_target is None


def test_replay_agrees_with_the_coordinators_progress_tracker() -> None:
    """The same reports, in the same order, give the same time to target and curve."""
    workers = [WorkerRecord(worker_id=i, host="h", local_rank=i, device="cpu", pid=i, node=0,
                            lease_expires_at=1e18, rank=i) for i in range(3)]
    tracker = ProgressTracker(num_workers=3, target_loss=1.0, live=lambda: workers,
                              everyone=lambda: workers)
    losses = [3.0 - 0.05 * k for k in range(60)]
    records = []
    for k, loss in enumerate(losses):
        rank, t = k % 3, 0.07 * k
        w = workers[rank]
        tracker.record(w, Progress(iteration=k // 3 + 1, loss=loss), elapsed=t)
        records.append(rec(rank, 50.0 + t, k // 3 + 1, loss))
    progress = replay(records, num_workers=3, start=50.0, target_loss=1.0)
    assert tracker.time_to_target is not None
    assert progress.time_to_target == pytest.approx(tracker.time_to_target)
    assert progress.iterations_to_target == pytest.approx(tracker.iterations_to_target)
    ours = [v for point in progress.loss_curve for v in point]
    theirs = [v for point in tracker.loss_curve for v in point]
    assert len(progress.loss_curve) > 5 and ours == pytest.approx(theirs)


def test_the_tail_reads_complete_lines_only_and_each_once(tmp_path: Path) -> None:
    tail = StepLogTail(tmp_path, 2)
    assert tail.new_records() == []
    path = step_log_path(tmp_path, 1)
    first, second = rec(1, 10.0, 1, 2.0), rec(1, 11.0, 2, 1.9)
    path.write_text(first.line() + "\n" + second.line()[:10])  # the second being written
    assert tail.new_records() == [first]
    with path.open("a") as f:
        f.write(second.line()[10:] + "\n")
    assert tail.new_records() == [second]
    assert tail.new_records() == []
    assert read_step_logs(tmp_path, 2) == [first, second]


def test_worker_orders_round_trip_through_json(tmp_path: Path) -> None:
    cfg = PeerWorkerConfig(peer="torchft", settings={"mode": "ddp"}, workload="synthetic-cnn",
                           num_workers=4, seed=3, batch_size=16, max_epochs=2.0,
                           max_steps=100, directory=str(tmp_path), slowdowns={0: "5"})
    back = PeerWorkerConfig.from_json(cfg.to_json(), rank=0, incarnation=1)
    assert back.slowdown == "5" and back.incarnation == 1
    assert PeerWorkerConfig.from_json(cfg.to_json(), rank=2).slowdown == ""
    files = PeerRunFiles(tmp_path)
    files.mark_ready(0, 0)
    files.mark_ready(0, 1)
    files.mark_ready(3, 0)
    assert files.ready_ranks() == {0, 3}
    assert set(files.ready_times()) == {(0, 0), (0, 1), (3, 0)}
    assert all(not math.isnan(t) for t in files.ready_times().values())


def test_peer_settings_parse_and_unknown_knobs_are_refused() -> None:
    assert harness.parse_peer_settings(["hivemind-local:target_batch_size=1024",
                                        "torchft:mode=localsgd-4"]) == {
        "hivemind-local": {"target_batch_size": 1024}, "torchft": {"mode": "localsgd-4"}}
    with pytest.raises(ValueError, match="PEER:KEY=VALUE"):
        harness.parse_peer_settings(["hivemind-local"])
    cfg = harness.HarnessConfig(protocols=("allreduce",),
                                peer_settings={"hivemind-local": {"nope": 1}})
    with pytest.raises(ValueError, match="no setting nope"):
        cfg.validate()
    cfg = harness.HarnessConfig(protocols=("allreduce", "no-such-peer"))
    with pytest.raises(ValueError, match="unknown protocol"):
        cfg.validate()
    assert set(harness.PEER_NAMES) == set(PEERS)


def test_the_sweep_varies_one_knob_at_a_time_and_scores_misses_as_slow() -> None:
    from ripples.bench.peers import sweep

    for peer, spec in PEERS.items():
        settings = sweep.settings_of(peer)
        assert settings[0] == {}  # the defaults first
        assert all(len(s) == 1 for s in settings[1:])
        assert all(v != spec.defaults[k] for s in settings[1:] for k, v in s.items())
        assert len(settings) == 1 + sum(
            sum(v != spec.defaults[k] for v in values) for k, values in spec.sweep.items())
    assert sweep.label({}) == "defaults"
    assert sweep.label({"mode": "localsgd-4"}) == "mode=localsgd-4"

    def record(ttt: float | None, wall: float) -> harness.RunRecord:
        return harness.RunRecord(
            scenario="homogeneous", protocol="torchft", repeat=0, time_to_target_seconds=ttt,
            seconds_per_epoch=1.0, iterations_to_target=None, final_loss=1.0,
            final_train_loss=1.0, wall_seconds=wall, seconds_per_iteration=0.1,
            compute_seconds_per_iteration=0.1, wait_seconds_per_iteration=0.0,
            preduce_seconds_per_iteration=0.0)

    assert sweep.score([record(10.0, 12.0), record(40.0, 41.0)]) == pytest.approx(20.0)
    assert sweep.score([record(None, 50.0)]) == pytest.approx(100.0)  # a miss: 2 x its wall


def test_scenarios_give_peers_the_slowdowns_ripples_runs_get() -> None:
    from ripples.sim.scenarios import SCENARIOS

    assert SCENARIOS["homogeneous"].slowdowns(8) == {}
    assert SCENARIOS["slow-5x"].slowdowns(8) == {0: "5"}
    assert SCENARIOS["random-6x"].slowdowns(4) == {r: "6@0.25" for r in range(4)}


def test_a_fault_costs_the_survivors_longest_gap_after_the_kill_and_the_replacements_wait(
        ) -> None:
    # Rank 2 is killed at t=10.05: its replacement's first step lands at 14.0. Rank 0
    # waited from 10.0 to 13.0 (a collective with the dead worker); rank 1 did not wait.
    # Rank 1's 1.5 s pause before the kill is the system's own, not the fault's.
    records = [rec(0, t, i, 1.0) for i, t in enumerate((9.0, 9.5, 10.0, 13.0, 13.5), 1)]
    records += [rec(1, t, i, 1.0) for i, t in enumerate((7.5, 9.0, 9.5, 10.1, 10.6), 1)]
    records += [rec(2, 9.2, 1, 1.0), rec(2, 9.7, 2, 1.0), rec(2, 14.0, 1, 1.0)]
    times = fault_times(records, victim=2, killed_at=10.05)
    assert times.stall_seconds == pytest.approx(3.0) and times.stalled_rank == 0
    assert times.step_seconds_before == pytest.approx(0.5)
    assert times.longest_before_seconds == pytest.approx(1.5)
    assert times.replacement_first_step_seconds == pytest.approx(3.95)
    # No replacement step: None, not a number.
    alone = fault_times(records[:-1], victim=2, killed_at=10.05)
    assert alone.replacement_first_step_seconds is None


def test_torchft_lighthouse_is_found_next_to_the_interpreter_or_on_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pip install --target DIR` puts the wheel's torchft_lighthouse in DIR/bin, not next
    to the interpreter (the 16-core host's run of the bench): PATH is searched too, and
    a lighthouse found nowhere is named with where it was looked for."""
    from ripples.bench.peers import backends

    interpreter = tmp_path / "venv" / "bin"
    interpreter.mkdir(parents=True)
    monkeypatch.setattr("sys.executable", str(interpreter / "python"))
    elsewhere = tmp_path / "site" / "bin"
    elsewhere.mkdir(parents=True)
    monkeypatch.setenv("PATH", str(elsewhere))
    with pytest.raises(RuntimeError, match="neither at .*venv/bin/torchft_lighthouse nor on PATH"):
        backends._lighthouse_binary()
    on_path = elsewhere / "torchft_lighthouse"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    assert backends._lighthouse_binary() == str(on_path)
    beside = interpreter / "torchft_lighthouse"
    beside.write_text("#!/bin/sh\n")
    assert backends._lighthouse_binary() == str(beside)  # next to the interpreter first
