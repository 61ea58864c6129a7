"""The simulator (`ripples simulate`): the real core driven by simulated workers.

Small runs with a fixed seed, so every figure is deterministic; the claims are the ones
the models imply (an all-reduce iteration is the slowest compute plus the ring), and the
papers' orderings that the real core must reproduce (Ripples' smart Group Generator
shrugs off a straggler that slows all-reduce down)."""

from __future__ import annotations

import gc
import json
import math

import numpy as np
import pytest

from ripples.sim.config import SimConfig, sim_protocols
from ripples.sim.engine import Simulation, simulate
from ripples.sim.models import (
    CommModel,
    ComputeModel,
    ConsensusModel,
    ConsensusState,
    SharedCores,
    shared_finish_times,
)
from tests.integration.helpers import ripples_cli


def run(protocol: str, *, workers: int = 8, iterations: int = 60, scenario: str = "homogeneous",
        jitter: float = 0.05, **extra: object):  # type: ignore[no-untyped-def]
    return simulate(SimConfig(protocol=protocol, workers=workers, iterations=iterations,
                              compute=ComputeModel(scenario=scenario, jitter=jitter),
                              **extra))  # type: ignore[arg-type]


@pytest.mark.parametrize("protocol", sim_protocols())
def test_every_protocol_runs_to_the_cores_own_budget_stop(protocol: str) -> None:
    result = run(protocol)
    assert result.stop_reason.startswith("iteration budget reached"), result.stop_reason
    # The core stops once the workers' total reaches the budget; it hears of the
    # iterations at the next request or heartbeat (gossip's compute loop runs on between
    # them), so a few more are made meanwhile.
    assert 8 * 60 <= result.iterations <= 8 * 60 * 1.1
    assert result.sim_seconds > 0 and math.isfinite(result.seconds_per_epoch)
    assert 0.99 < result.compute_fraction + result.wait_fraction + (
        0.0 if protocol in ("adpsgd", "a2cid2") else result.comm_fraction) < 1.01
    if protocol != "allreduce":
        assert result.groups > 0 and result.group_requests >= result.groups
        assert result.decisions_per_second > 0
        assert result.mean_group_size >= 2


def test_allreduce_iteration_is_the_slowest_compute_plus_one_ring() -> None:
    comm = CommModel()
    result = run("allreduce", scenario="slow-5x", jitter=0.0, comm=comm)
    ring = comm.allreduce_seconds(8, spans_hosts=True)
    assert result.seconds_per_iteration == pytest.approx(5 * 0.1 + ring, rel=1e-9)
    # The seven others wait 4 steps' worth for the straggler each iteration.
    compute, wait = 0.5 + 7 * 0.1, 7 * 0.4
    assert result.wait_fraction == pytest.approx(wait / (compute + wait + 8 * ring), rel=1e-6)


def test_shared_cores_divide_the_machine_among_the_workers_computing() -> None:
    # Three jobs of 1, 2 and 4 s of work on 2 cores: all three at 2/3 until the first ends
    # (1.5 s), then two at full speed.
    assert shared_finish_times([4.0, 1.0, 2.0], 2.0) == pytest.approx([4.5, 1.5, 2.5])
    cores = SharedCores(2.0)
    for key, work in enumerate([4.0, 1.0, 2.0]):
        cores.start(0.0, key, work)
    ends = []
    while (delay := cores.next_end()) is not None:
        now = cores.t + delay
        ends += [(key, now) for key in cores.finish(now)]
    assert [k for k, _ in ends] == [1, 2, 0]
    assert [t for _, t in ends] == pytest.approx([1.5, 2.5, 4.5])
    # A job that starts later shares from then on: 1 s alone on 1 core, then halved.
    one = SharedCores(1.0)
    one.start(0.0, 0, 2.0)
    one.start(1.0, 1, 1.0)
    assert one.next_end() == pytest.approx(2.0)  # both have 1 s of work left, at 1/2


def test_workers_sharing_cores_compute_slower_and_a_slowed_one_sleeps() -> None:
    # Eight lock-step workers on 2 cores: each iteration is 8 x 0.1 s of work at 2 cores,
    # then the ring's 8 threads on the 2 cores.
    shared = simulate(SimConfig(protocol="allreduce", workers=8, iterations=20,
                                compute=ComputeModel(jitter=0.0, cores=2.0)))
    ring = CommModel().allreduce_seconds(8, spans_hosts=True)
    assert shared.seconds_per_iteration == pytest.approx(0.4 + 4 * ring, rel=1e-9)
    # Worker 0 5x slower: its work shares the cores, then it sleeps 4x the time it took.
    slow = simulate(SimConfig(protocol="allreduce", workers=8, iterations=20, compute=ComputeModel(
        scenario="slow-5x", jitter=0.0, cores=2.0)))
    assert slow.seconds_per_iteration == pytest.approx(5 * 0.4 + 4 * ring, rel=1e-9)
    # A group protocol whose workers wait for groups leaves the cores to the others:
    # compute per iteration is below the 0.4 s of eight workers always computing.
    smart = simulate(SimConfig(protocol="ripples-random", workers=8, iterations=60,
                               compute=ComputeModel(jitter=0.05, cores=2.0)))
    assert smart.wait_fraction > 0.2
    assert 0.1 < smart.compute_seconds_per_iteration < 0.4
    assert smart.seconds_per_iteration == pytest.approx(
        smart.compute_seconds_per_iteration + smart.wait_seconds_per_iteration
        + smart.comm_seconds_per_iteration, rel=0.05)


def test_the_smart_group_generator_shrugs_off_a_straggler_that_slows_allreduce() -> None:
    allreduce = run("allreduce", scenario="slow-5x", iterations=40)
    smart = run("ripples-smart", scenario="slow-5x", iterations=40)
    # Ripples §7.4: with one worker 5x slower, all-reduce runs at the straggler's pace;
    # the smart GG's fast workers do not wait for it.
    assert smart.seconds_per_epoch < 0.5 * allreduce.seconds_per_epoch
    assert smart.wait_fraction < allreduce.wait_fraction


def test_averaging_holds_the_workers_together() -> None:
    # Without averaging the workers drift towards their own optima: mean squared distance
    # from the mean tends to (1 - 1/n) x dim x heterogeneity^2 = 7.
    lonely = ConsensusModel()
    for protocol in ("ripples-smart", "adpsgd", "a2cid2"):
        result = run(protocol, iterations=100, consensus=lonely)
        assert result.consensus_distance < 1.0, (protocol, result.consensus_distance)
    assert run("allreduce").consensus_distance < 1e-20
    curve = run("adpsgd").consensus_curve
    assert len(curve) >= 10 and curve[0] == (0.0, 0.0)


def test_the_same_seed_gives_the_same_run_and_another_seed_another() -> None:
    first, again = run("ripples-random", seed=3), run("ripples-random", seed=3)
    assert (first.sim_seconds, first.groups) == (again.sim_seconds, again.groups)
    assert run("ripples-random", seed=4).sim_seconds != first.sim_seconds


def test_hosts_of_several_workers_average_faster_inside_a_host() -> None:
    comm = CommModel()
    assert comm.allreduce_seconds(4, spans_hosts=False) < comm.allreduce_seconds(
        4, spans_hosts=True) / 10
    result = run("ripples-smart", workers=16, workers_per_host=4,
                 run_options={"inter_intra": True})
    assert result.stop_reason.startswith("iteration budget reached")


def test_the_core_memory_per_worker_is_measured() -> None:
    plain = run("ripples-smart", workers=64, iterations=10)
    traced = run("ripples-smart", workers=64, iterations=10, measure_memory=True)
    assert plain.core_bytes_per_worker == 0 and plain.decisions_per_second > 0
    assert 500 < traced.core_bytes_per_worker < 100_000
    # Tracing does not change what is simulated.
    assert (traced.sim_seconds, traced.groups) == (plain.sim_seconds, plain.groups)


def test_bad_configurations_are_refused_with_the_reason() -> None:
    with pytest.raises(ValueError, match="the simulator runs"):
        SimConfig(protocol="hop")
    with pytest.raises(ValueError, match="unknown scenario"):
        ComputeModel(scenario="slow")
    with pytest.raises(ValueError, match="group_size"):
        SimConfig(run_options={"group_size": 1}).settings()


def test_simulate_command_prints_json_and_a_table(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = ripples_cli("simulate", "--workers", "8,16", "--protocol", "ripples-smart,adpsgd",
                      "--iterations", "20", "--json",
                      "--plot", str(tmp_path / "c.png"))
    assert out.returncode == 0, out.stderr
    runs = json.loads(out.stdout)["runs"]
    assert [(r["protocol"], r["workers"]) for r in runs] == [
        ("ripples-smart", 8), ("adpsgd", 8), ("ripples-smart", 16), ("adpsgd", 16)]
    for r in runs:
        assert r["seconds_per_epoch"] > 0 and r["decisions_per_second"] > 0
    assert (tmp_path / "c.png").stat().st_size > 1000
    table = ripples_cli("simulate", "--workers", "8", "--protocol", "allreduce",
                        "--iterations", "5", "--scenario", "slow-5x")
    assert table.returncode == 0, table.stderr
    assert "allreduce" in table.stdout and "s/epoch" in table.stdout
    bad = ripples_cli("simulate", "--protocol", "hop")
    assert bad.returncode == 2 and "the simulator runs" in bad.stderr
    bad = ripples_cli("simulate", "--set", "group_size=1")
    assert bad.returncode == 2 and "group_size" in bad.stderr


def test_a_run_freezes_its_heap_while_it_trains_and_releases_it_after() -> None:
    """coordinator/heap.py: the service freezes the run's long-lived objects when training
    starts (the collector skips them) and unfreezes them when the run ends, so that a
    finished run's objects can be collected again; the simulator does the same."""
    seen: list[int] = []
    sim = Simulation(SimConfig(protocol="ripples-smart", workers=16, iterations=5))
    original = sim._on_sample

    def sample(every: float) -> None:
        seen.append(gc.get_freeze_count())
        original(every)

    sim._on_sample = sample  # type: ignore[method-assign]
    sim.run()
    assert seen and min(seen) > 0  # frozen while the run trained
    assert gc.get_freeze_count() == 0  # and released after


def test_a_sharded_run_splits_the_coordinators_load_and_mixes_through_heads() -> None:
    flat = simulate(SimConfig(protocol="ripples-smart", workers=64, workers_per_host=4,
                              iterations=40, seed=2))
    sim = Simulation(SimConfig(protocol="ripples-smart", workers=64, workers_per_host=4,
                               iterations=40, seed=2, shards=4, inter_period=2))
    sharded = sim.run()
    assert sharded.shards == 4 and sharded.stop_reason.startswith("iteration budget reached")
    # Four shard cores of 16 workers each (4 hosts each), and a root of their 4 heads.
    assert [c.settings.num_workers for c in sim.cores] == [16, 16, 16, 16, 4]
    heads = [w for w in sim.workers if w.root_wid >= 0]
    assert [w.rank for w in heads] == [0, 16, 32, 48]
    # The busiest coordinator serves about a quarter of the flat one's RPCs.
    assert sharded.coordinator_rpcs_per_second < 0.4 * flat.coordinator_rpcs_per_second
    # Heads carry the shards' models to each other: the root formed groups, and the
    # models stay together (without the root the shards would drift to their own optima).
    root = sim.cores[sim.root]
    assert root.table.num_formed > 0
    assert not root.stopped  # the root has no budget of its own: the shards end the run
    apart = simulate(SimConfig(protocol="ripples-smart", workers=64, workers_per_host=4,
                               iterations=40, seed=2, shards=4, inter_period=10**9))
    assert sharded.consensus_distance < apart.consensus_distance


def test_a_coordinator_serves_one_rpc_at_a_time_when_it_has_a_service_time() -> None:
    fast = simulate(SimConfig(protocol="ripples-smart", workers=64, iterations=20))
    # 64 workers send ~500 RPCs per simulated second (a request and a release per
    # iteration of ~0.4 s, two heartbeats); at 5 ms each the coordinator could answer 200:
    # it is busy all the time and its replies come late.
    slow = simulate(SimConfig(protocol="ripples-smart", workers=64, iterations=20,
                              service_seconds=0.005))
    assert fast.coordinator_utilization == 0.0
    assert 0.8 < slow.coordinator_utilization <= 1.0  # busy but for the start and the end
    assert slow.seconds_per_iteration > 1.5 * fast.seconds_per_iteration
    assert slow.wait_fraction > fast.wait_fraction
    with pytest.raises(ValueError, match="each shard needs a host and 2 workers"):
        SimConfig(protocol="ripples-smart", workers=8, shards=9)
    with pytest.raises(ValueError, match="ripples-random or ripples-smart"):
        SimConfig(protocol="adpsgd", workers=64, shards=4)


def test_a_collective_on_shared_cores_takes_a_thread_per_member() -> None:
    cores = SharedCores(2.0)
    cores.start(0.0, 0, 1.0)              # one worker computing
    cores.start(0.0, -1, 1.0, weight=3)   # a group of three in its collective
    assert cores.rate() == pytest.approx(0.5)  # 4 threads on 2 cores
    assert cores.next_end() == pytest.approx(2.0)
    assert sorted(cores.finish(2.0)) == [-1, 0]
    assert cores.threads == 0


def test_the_smart_generator_keeps_pools_of_a_hundred_workers_in_step() -> None:
    # Regression: while the workers' speeds came in one report at a time, the smart
    # policy refused every worker of unknown speed, so the first ones measured found no
    # eligible idle peer and were grouped with busy ones; the waits desynchronised the
    # run for good (128 workers waited 45% of the time, 256 only 4%).
    for workers in (64, 128):
        r = simulate(SimConfig(workers=workers, protocol="ripples-smart", iterations=30))
        assert r.wait_fraction < 0.12, (workers, r.wait_fraction)


def test_data_skew_gives_each_block_of_hosts_an_optimum_of_its_own() -> None:
    blocks = SimConfig(workers=12, workers_per_host=2, data_blocks=3).data_block_ranks()
    assert blocks == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    plain = ConsensusState(ConsensusModel(), 12, seed=3, blocks=blocks)
    assert np.array_equal(plain.optimum, ConsensusState(ConsensusModel(), 12, seed=3).optimum)
    shared = ConsensusState(ConsensusModel(data_skew=1.0), 12, seed=3, blocks=blocks)
    for ranks in blocks:  # skew 1: a block's workers share one optimum
        assert np.allclose(shared.optimum[ranks], shared.optimum[ranks[0]])
    assert not np.allclose(shared.optimum[0], shared.optimum[4])
    with pytest.raises(ValueError, match="data_skew must be in"):
        ConsensusModel(data_skew=1.5)
    with pytest.raises(ValueError, match="data_blocks must be between"):
        SimConfig(workers=12, workers_per_host=2, data_blocks=7)
