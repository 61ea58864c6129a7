"""`ripples run`'s local cluster: what it records and how it takes Ctrl-C, without workers."""

from __future__ import annotations

import pytest

from ripples.cli.local_cluster import LocalCluster, LocalRunConfig
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
