"""The simulator's twin of a benchmark run (ripples.bench.sim_validation): the calibrated
models reach the simulation as measured, and the comparison reads both sides alike."""

from __future__ import annotations

import pytest

from ripples.bench.harness import HarnessConfig, RunRecord
from ripples.bench.sim_validation import Calibration, compare, format_rows, sim_config
from ripples.sim.engine import simulate


def test_an_allreduce_twin_is_eight_workers_sharing_two_cores_plus_one_ring() -> None:
    cal = Calibration(work_seconds=0.064, pair_seconds=0.005, model_bytes=2_000_000, cores=2)
    config = sim_config(cal, HarnessConfig(), "homogeneous", "allreduce", iterations=50)
    assert (config.workers, config.workers_per_host, config.compute.cores) == (8, 4, 2)
    assert config.comm.allreduce_seconds(2, spans_hosts=True) == pytest.approx(0.005)
    result = simulate(config)
    # Each iteration: 8 jobs of ~64 ms of work on 2 cores (jitter 5%), then a ring of 8
    # (2 x 7/8 of the pair's bytes over bandwidth) whose 8 threads share the 2 cores.
    assert result.seconds_per_iteration == pytest.approx(
        8 * 0.064 / 2 + 4 * 1.75 * 0.005, rel=0.05)
    # The gossip twin takes the bench's rate of averagings.
    gossip = sim_config(cal, HarnessConfig(rate_com=2.0), "slow-5x", "adpsgd", iterations=10)
    assert gossip.run_options == {"rate_com": 2.0}
    assert gossip.compute.scenario == "slow-5x"


def test_the_comparison_sets_measured_beside_simulated() -> None:
    cal = Calibration(work_seconds=0.064, pair_seconds=0.005, model_bytes=2_000_000, cores=2)
    result = simulate(sim_config(cal, HarnessConfig(), "homogeneous", "ripples-smart", 40))
    record = RunRecord(scenario="homogeneous", protocol="ripples-smart", repeat=0,
                       time_to_target_seconds=None, seconds_per_epoch=None,
                       iterations_to_target=None, final_loss=1.0, final_train_loss=None,
                       wall_seconds=10.0, seconds_per_iteration=0.25,
                       compute_seconds_per_iteration=0.2, wait_seconds_per_iteration=0.03,
                       preduce_seconds_per_iteration=0.02)
    summary = {"workers": [{"iterations": 40}] * 8}
    row = compare(record, summary, result, "ripples-smart")
    assert row.measured_sync == pytest.approx(0.05)
    assert row.measured_wait_fraction == pytest.approx(0.05 / 0.25)
    assert row.simulated_s_per_iter == result.seconds_per_iteration
    assert row.simulated_sync == pytest.approx(result.wait_seconds_per_iteration
                                               + result.comm_seconds_per_iteration)
    assert row.within() == (abs(result.seconds_per_iteration / 0.25 - 1) <= 0.2)
    table = format_rows([row], markdown=True).splitlines()
    assert table[0].startswith("| scenario | protocol | s/iter measured")
    assert table[2].startswith("| homogeneous | ripples-smart | 0.250 |")
