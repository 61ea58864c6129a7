"""The coordinators of a simulated run: their cores, built with the workers registered
and ready (one core, or one per shard and the root's of a sharded run), and the queue of
RPCs in front of each.

Nothing of a core is modelled (sim/engine.py drives the real `CoordinatorCore`); what is
modelled is a coordinator's service time (SimConfig.service_seconds): it serves one RPC
at a time, so a reply comes after those queued before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ripples.coordinator.config import MAX_ITERATIONS
from ripples.coordinator.core import CoordinatorCore
from ripples.sim.config import SimConfig
from ripples.sim.worker_model import SimWorker


@dataclass
class CoreLayout:
    """A run's cores and where its simulated workers are."""

    workers: list[SimWorker]
    """Every simulated worker, by rank."""
    cores: list[CoordinatorCore]
    """The shards' cores, then (sharded) the root's."""
    by_wid: list[dict[int, SimWorker]]
    """Per core: its worker ids' simulated workers."""
    root: int = -1
    """The root core's index (sharded runs; -1: none)."""


def build_core(config: SimConfig, num_workers: int, iterations: int, hosts: list[int], *,
               root: bool = False) -> CoordinatorCore:
    """A core with its workers (on `hosts`, one per worker) registered and ready,
    training started at 0; `root`: the root core of a sharded run."""
    core = CoordinatorCore(config.settings(num_workers, iterations, root=root), now=0.0)
    k = config.workers_per_host
    for i, host in enumerate(hosts):
        core.register(f"h{host}", i % k, "cpu", i + 1, 0.0)
    for w in core.live():
        core.mark_ready(w.worker_id, iterations, 0.0)
    if core.stopped:
        raise ValueError(f"the simulated run cannot start: {core.stop_reason}")
    return core


def build_cores(config: SimConfig) -> CoreLayout:
    """The cores of a run: one per shard (one for a flat run), each with its workers; a
    sharded run's root is a core of the shards' heads (their first workers)."""
    k = config.workers_per_host
    layout = CoreLayout(workers=[], cores=[], by_wid=[])
    for s, ranks in enumerate(config.shard_ranks()):
        core = build_core(config, len(ranks), config.iterations, [r // k for r in ranks])
        by_rank = sorted(core.live(), key=lambda x: x.rank)
        index: dict[int, SimWorker] = {}
        for r, rec in zip(ranks, by_rank, strict=True):
            w = SimWorker(r, rec.worker_id, r // k, s)
            layout.workers.append(w)
            index[rec.worker_id] = w
        layout.cores.append(core)
        layout.by_wid.append(index)
    layout.workers.sort(key=lambda w: w.rank)
    if config.shards > 1:  # the root: a core of the shards' heads (their first workers)
        heads = [min(index.values(), key=lambda w: w.rank) for index in layout.by_wid]
        root = build_core(config, len(heads), MAX_ITERATIONS,  # no budget of its own
                          list(range(len(heads))), root=True)
        layout.root = len(layout.cores)
        index = {}
        for head, rec in zip(heads, sorted(root.live(), key=lambda x: x.rank), strict=True):
            head.root_wid = rec.worker_id
            index[rec.worker_id] = head
        layout.cores.append(root)
        layout.by_wid.append(index)
    return layout


class ServiceQueues:
    """The coordinators' queues: each serves one RPC at a time in `service_seconds`
    (0: every RPC is answered at once, and only counted)."""

    def __init__(self, num_cores: int, service_seconds: float) -> None:
        self.service_seconds = service_seconds
        self.rpcs = [0] * num_cores
        """Per core: RPCs served."""
        self._free_at = [0.0] * num_cores
        """Per core: when it is done with its queue."""

    def serve(self, core: int, now: float) -> float:
        """One RPC at `core`, arriving at `now`: the seconds until it is answered (its
        queue, then its service time; 0 without a service time)."""
        self.rpcs[core] += 1
        service = self.service_seconds
        if not service:
            return 0.0
        done = max(now, self._free_at[core]) + service
        self._free_at[core] = done
        return done - now

    def utilization(self, now: float) -> float:
        """Of the busiest coordinator: its serving time until `now` over the run's time
        (what it accepted but had not served by then does not count)."""
        if not now or not self.service_seconds:
            return 0.0
        service = self.service_seconds
        busy = [n * service - max(0.0, free - now)
                for n, free in zip(self.rpcs, self._free_at, strict=True)]
        return max(busy, default=0.0) / now
