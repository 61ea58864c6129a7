"""One simulated run: what it is (SimConfig) and what it measured (SimResult).

Plain data, without torch: `ripples simulate` builds its options from these fields
(each documented once, here) before the engine (sim/engine.py) is imported.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ripples.coordinator.config import RunSettings
from ripples.coordinator.topology import read_edge_list
from ripples.protocols.registry import DEFAULT_PROTOCOL, PROTOCOLS
from ripples.sim.models import CommModel, ComputeModel, ConsensusModel

SIMULATED_ROOT = "simulated-root:1"
"""The root coordinator a simulated shard's settings name (no service is reached)."""


def sim_protocols() -> list[str]:
    """Protocols the simulator runs: those whose spec has a model of their workers
    (docs/scale.md lists them)."""
    return [name for name, spec in PROTOCOLS.items() if spec.simulation is not None]


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run."""

    protocol: str = DEFAULT_PROTOCOL
    workers: int = 64
    workers_per_host: int = 1
    iterations: int = 100
    """Per-worker iteration budget (the core stops the run when the total is reached)."""
    epoch_iterations: int = 100
    """Iterations per worker that make one epoch (for seconds_per_epoch)."""
    seed: int = 0
    compute: ComputeModel = field(default_factory=ComputeModel)
    comm: CommModel = field(default_factory=CommModel)
    consensus: ConsensusModel = field(default_factory=ConsensusModel)
    run_options: dict[str, object] = field(default_factory=dict)
    """More RunSettings options (group_size, topology, rate_com, heartbeat_interval_seconds,
    ...), as `ripples run` takes them."""
    samples: int = 50
    """Points of the consensus-distance curve over the run."""
    max_sim_seconds: float = 1e7
    """Simulated-time bound: a run that has not stopped by then ends as `stalled`."""
    shards: int = 1
    """1: one coordinator for every worker (flat). S > 1: the hierarchical design
    (docs/scale.md): the hosts are cut into S shards of consecutive hosts, each with a
    coordinator core of its own, and the first worker of each shard is its head: every
    `inter_period`-th iteration the head asks a root coordinator (a core of the S heads,
    the same code) for a group of heads instead. Shardable protocols only (their specs
    say so)."""
    inter_period: int = 4
    """Sharded: a head's every inter_period-th group is an inter-shard one."""
    data_blocks: int = 0
    """Blocks of consecutive hosts whose data differ (the consensus model's data_skew):
    0, one block per shard (so a flat run compares with a sharded one of as many shards
    when it sets the same number)."""
    service_seconds: float = 0.0
    """Coordinator time per RPC (a group request, a release, a heartbeat, an ended wait):
    each coordinator serves its RPCs one at a time, so a busy one answers late (0: at
    once; the coordinator is never the bottleneck). The gRPC service measured here
    answers 5,152 group requests/s, each with its release, at 1,024 streams: about
    97 us per RPC (heartbeats assumed to cost as much)."""
    measure_memory: bool = False
    """Trace the run's allocations (tracemalloc) to report the core's bytes per worker:
    what the coordinator's code allocated and still holds at the stop (registry, graph,
    group table, communicator directory, progress). About 3x slower, so the run's
    decisions per second are not reported (0)."""

    def __post_init__(self) -> None:
        spec = PROTOCOLS.get(self.protocol)
        if spec is None or spec.simulation is None:
            raise ValueError(f"the simulator runs {', '.join(sim_protocols())}; "
                             f"got {self.protocol!r}")
        if self.workers < 2:
            raise ValueError(f"workers must be at least 2, got {self.workers}")
        if self.workers_per_host < 1:
            raise ValueError("workers_per_host must be at least 1")
        if self.iterations < 1 or self.epoch_iterations < 1:
            raise ValueError("iterations and epoch_iterations must be at least 1")
        if self.samples < 2:
            raise ValueError("samples must be at least 2")
        if self.shards < 1 or self.inter_period < 1:
            raise ValueError("shards and inter_period must be at least 1")
        if not self.service_seconds >= 0:
            raise ValueError("service_seconds must not be negative")
        if self.run_options.get("sync_share"):
            raise ValueError("the simulator does not size rounds to a link (sync_share): "
                             "its workers have no links, only compute times; leave it out "
                             "and set local_steps")
        if self.shards > 1:
            shardable = [n for n in sim_protocols() if PROTOCOLS[n].shardable]
            if self.protocol not in shardable:
                raise ValueError(f"shards > 1 simulates a sharded job: {' or '.join(shardable)}"
                                 f", not {self.protocol}")
            hosts = math.ceil(self.workers / self.workers_per_host)
            if self.shards > hosts or min(map(len, self.shard_ranks())) < 2:
                raise ValueError(f"{self.shards} shards of {self.workers} workers on {hosts} "
                                 "hosts: each shard needs a host and 2 workers at least")
        if self.data_blocks < 0 or self.data_blocks > math.ceil(
                self.workers / self.workers_per_host):
            raise ValueError("data_blocks must be between 0 (one per shard) and the hosts")

    def shard_ranks(self) -> list[list[int]]:
        """The ranks of each shard: shard s holds the hosts h with h * S // hosts == s
        (consecutive hosts), in one pass over the workers."""
        return self._host_blocks(self.shards)

    def data_block_ranks(self) -> list[list[int]]:
        """The ranks of each block of hosts whose data differ (data_blocks, else shards)."""
        return self._host_blocks(self.data_blocks or self.shards)

    def _host_blocks(self, count: int) -> list[list[int]]:
        hosts = math.ceil(self.workers / self.workers_per_host)
        blocks: list[list[int]] = [[] for _ in range(count)]
        for r in range(self.workers):
            blocks[(r // self.workers_per_host) * count // hosts].append(r)
        return blocks

    def settings(self, num_workers: int = 0, iterations: int = 0, *,
                 root: bool = False) -> RunSettings:
        """The run's settings (of one shard's core, or with `root` the root's, with the
        arguments). A sharded run's shards name a root, as a real shard's settings do,
        so that RunSettings refuses what a shard cannot take (local steps)."""
        options: dict[str, object] = {
            "protocol": self.protocol, "task": "simulated",
            "num_workers": num_workers or self.workers,
            "min_workers": 1, "workers_per_node": self.workers_per_host,
            "iterations": iterations or self.iterations, "seed": self.seed,
            **self.run_options}
        if self.shards > 1 and not root:
            options.update(root=SIMULATED_ROOT, inter_period=self.inter_period)
        if options.get("topology_file"):  # read here, as `ripples run` does
            options["topology_edges"] = read_edge_list(str(options.pop("topology_file")))
        settings = RunSettings.build(**options)
        settings.validate()
        return settings


@dataclass(kw_only=True)
class SimResult:
    """What one simulated run measured (sim: simulated seconds; core: real seconds)."""

    protocol: str
    workers: int
    scenario: str
    stop_reason: str
    sim_seconds: float
    """Simulated training time until the stop."""
    iterations: int
    """Iterations of all workers together."""
    seconds_per_epoch: float
    seconds_per_iteration: float
    """Simulated seconds per iteration of one worker (sim_seconds / mean iterations)."""
    compute_fraction: float
    wait_fraction: float
    """Of the workers' time: waiting for a group to be delivered (group protocols) or, in
    lock-step, for the slowest worker."""
    comm_fraction: float
    """Of the workers' time: in collectives (for gossip, on the communication thread,
    which overlaps compute)."""
    compute_seconds_per_iteration: float
    """Seconds of one iteration's compute (an injected slowdown's sleep included)."""
    wait_seconds_per_iteration: float
    comm_seconds_per_iteration: float
    averagings_per_iteration: float
    """Group memberships (a worker in a group or exchange; allreduce: in a collective) per
    iteration of a worker."""
    bytes_per_worker_iteration: float
    """Bytes a worker fed into its collectives per iteration (CommModel.model_bytes per
    vector; the outer optimizer's group form feeds two: summary.json's
    bytes_per_worker_step)."""
    conflict_fraction: float
    """Group requests that found their group not ready (another member was computing or
    busy in an earlier group)."""
    group_requests: int
    groups: int
    mean_group_size: float
    core_seconds: float
    """Real seconds spent in the coordinator core (every call)."""
    group_core_seconds: float
    """Of them, in group requests, releases and ended waits."""
    decisions_per_second: float
    """Group requests answered per second of core time spent on groups."""
    heartbeats_per_second: float
    """Heartbeats taken per second of core time spent on them."""
    core_bytes_per_worker: float
    """Bytes the core holds per worker at the stop (0: not measured; measure_memory)."""
    shards: int
    coordinator_rpcs_per_second: float
    """RPCs per simulated second at the busiest coordinator: the load it must serve."""
    coordinator_utilization: float
    """Of the busiest coordinator: the fraction of simulated time serving RPCs
    (service_seconds x its RPCs / the run's time; 0 when service_seconds is 0)."""
    consensus_distance: float
    """mean_i ||x_i - mean(x)||^2 at the stop (the ConsensusModel)."""
    mean_consensus_distance: float
    """The consensus distance averaged over the curve's points in the run's second half:
    it swings within a round (low after a synchronisation, high after the steps between),
    so the value at the stop depends on the phase the run stopped in."""
    optimum_gap: float
    """||mean(x) - optimum||^2 at the stop."""
    consensus_curve: list[tuple[float, float]]
    """(simulated seconds, consensus distance) over the run."""
    wall_seconds: float
    events: int

    def summary(self) -> dict[str, object]:
        """The result as JSON-ready data."""
        return {k: v for k, v in self.__dict__.items()}
