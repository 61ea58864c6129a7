"""What a finished simulated run measured: its `SimResult`, from the simulation's
tallies (the workers' compute, wait and collective times, the groups and their bytes,
the core calls and their wall time, the coordinators' RPCs, the consensus curve).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from ripples.sim.config import SimResult

if TYPE_CHECKING:
    from ripples.sim.engine import Simulation


def summarize(sim: Simulation, stop_reason: str, started: float) -> SimResult:
    """The result of `sim`, stopped for `stop_reason`; `started`: the perf_counter when
    its loop began (for the wall time). The consensus curve gets its last point."""
    cfg = sim.config
    workers = sim.workers
    total = sum(w.iteration for w in workers)
    mean_iterations = total / len(workers)
    compute = sum(w.compute_s for w in workers)
    wait = sum(w.wait_s for w in workers)
    comm = sum(w.comm_s for w in workers)
    # Gossip's collectives overlap compute: its fractions are of compute + waits.
    busy = compute + wait + (0.0 if sim.protocol.comm_overlaps_compute else comm)
    busy = busy or 1.0
    group_core = sim.core_seconds["group"]
    heartbeat_core = sim.core_seconds["heartbeat"]
    sim.curve.append((sim.now, sim.model.distance()))
    half = [d for t, d in sim.curve if t >= sim.now / 2]
    rpcs = sim.queues.rpcs
    return SimResult(
        protocol=cfg.protocol, workers=cfg.workers, scenario=cfg.compute.scenario,
        stop_reason=stop_reason, sim_seconds=sim.now, iterations=total,
        seconds_per_epoch=(sim.now / (mean_iterations / cfg.epoch_iterations)
                           if mean_iterations else math.inf),
        seconds_per_iteration=sim.now / mean_iterations if mean_iterations else math.inf,
        compute_fraction=compute / busy, wait_fraction=wait / busy,
        comm_fraction=comm / busy,
        compute_seconds_per_iteration=compute / total if total else 0.0,
        wait_seconds_per_iteration=wait / total if total else 0.0,
        comm_seconds_per_iteration=comm / total if total else 0.0,
        averagings_per_iteration=sum(sim.group_sizes) / total if total else 0.0,
        bytes_per_worker_iteration=sim.bytes_sent / total if total else 0.0,
        conflict_fraction=sim.num_waits / sim.num_requests if sim.num_requests else 0.0,
        group_requests=sim.num_requests, groups=len(sim.group_sizes),
        mean_group_size=(sum(sim.group_sizes) / len(sim.group_sizes)
                         if sim.group_sizes else 0.0),
        core_seconds=sum(sim.core_seconds.values()), group_core_seconds=group_core,
        decisions_per_second=sim.num_requests / group_core if group_core else 0.0,
        heartbeats_per_second=(sim.num_heartbeats / heartbeat_core
                               if heartbeat_core else 0.0),
        core_bytes_per_worker=sim.core_bytes_per_worker,
        shards=cfg.shards,
        coordinator_rpcs_per_second=max(rpcs, default=0) / sim.now if sim.now else 0.0,
        coordinator_utilization=sim.queues.utilization(sim.now),
        consensus_distance=sim.model.distance(),
        mean_consensus_distance=sum(half) / len(half),
        optimum_gap=sim.model.gap(),
        consensus_curve=sim.curve, wall_seconds=time.perf_counter() - started,
        events=sim.events)
