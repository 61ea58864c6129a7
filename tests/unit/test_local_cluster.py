"""`ripples run`'s local cluster: what it records, how it takes Ctrl-C and the few lines it
ends with, without workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from ripples.cli.local_cluster import LocalCluster, LocalRunConfig
from ripples.cli.run import result_lines
from ripples.coordinator.config import RunSettings
from ripples.v1 import coordinator_pb2 as pb


def test_local_run_samples_the_consensus_estimate_about_once_a_second() -> None:
    cluster = LocalCluster(LocalRunConfig(run=RunSettings(protocol="a2cid2")))
    for started, elapsed, distance in [(False, 0.0, -1.0), (True, 0.2, -1.0),  # nothing yet
                                       (True, 0.5, 0.4), (True, 1.2, 0.3), (True, 1.6, 0.2),
                                       (True, 2.7, 0.1)]:
        cluster._sample_consensus(pb.RunStatus(started=started, elapsed_seconds=elapsed,
                                               consensus_distance=distance))
    assert cluster.consensus_curve == [[0.5, pytest.approx(0.4)], [1.6, pytest.approx(0.2)],
                                       [2.7, pytest.approx(0.1)]]


def test_first_ctrl_c_asks_for_a_clean_stop_and_the_second_aborts() -> None:
    cluster = LocalCluster(LocalRunConfig(run=RunSettings()))
    cluster._on_signal(2, None)  # the monitor loop sends stop_run and keeps monitoring
    assert cluster.interrupted.is_set()
    with pytest.raises(KeyboardInterrupt):
        cluster._on_signal(2, None)


def _summary(**changes: object) -> dict[str, object]:
    summary: dict[str, object] = {
        "protocol": "ripples-smart", "num_workers": 2, "task": "digits", "script": None,
        "stop_reason": "target loss 0.2 reached", "final_loss": 0.21, "final_accuracy": 0.95,
        "final_train_loss": 0.19, "wall_seconds": 3.24, "time_to_target_seconds": 3.0,
        "workers": [{"rank": 0, "iterations": 120}, {"rank": 1, "iterations": 118}],
        "loss_curve": [[0.5 * i, 2.0 / (1 + i)] for i in range(330)],
    }
    return {**summary, **changes}


def test_the_result_of_a_task_run_is_its_evaluation_time_and_files() -> None:
    lines = result_lines(_summary(), Path("runs/x"), 11.0)
    assert lines == [
        "ripples-smart, 2 workers: target loss 0.2 reached",
        "consensus model on the digits task's evaluation data: loss 0.2100, accuracy 0.9500",
        "final training loss 0.1900 (the workers' reported losses at the end, averaged)",
        "3.2 s of training (11.0 s with start-up), 238 iterations (118-120 per worker); "
        "target loss reached after 3.0 s",
        "wrote runs/x/summary.json and runs/x/model.pt",
    ]


def test_the_result_of_a_script_run_is_its_training_loss_never_nan() -> None:
    script = _summary(task=None, script=["python", "train.py"], final_loss=None,
                      final_accuracy=None, time_to_target_seconds=None,
                      stop_reason="iteration budget reached (60 iterations)",
                      workers=[{"rank": 0, "iterations": 30}, {"rank": 1, "iterations": 30}])
    lines = result_lines(script, Path("out"), 7.5)
    assert lines[1] == ("final training loss 0.1900 (the workers' reported losses at the end, "
                        "averaged); a script's model is not evaluated")
    assert lines[2] == "3.2 s of training (7.5 s with start-up), 60 iterations (30 per worker)"
    assert not any("nan" in line.lower() for line in lines)  # no NaN, nor "nan"
    silent = result_lines({**script, "final_train_loss": None}, Path("out"), 7.5)
    assert silent[1].startswith("no training loss reported (opt.report_loss)")
