"""The discrete-event simulation: simulated workers drive the real coordinator core.

Nothing of the coordinator is modelled: `CoordinatorCore` (registry, run graph, group
policies, group table, pairing, progress, stop rule) runs as in the service, called with
a fake clock. What is modelled is the workers (sim/models.py): how long an iteration
takes, how long a collective takes, and what averaging does to their models. Each
simulated worker follows its protocol's real loop (worker/protocols/):

- `ripples-random`, `ripples-smart` (group_generator.py): compute an iteration, ask for
  a group, wait until it is delivered, P-Reduce, release it; `more` asks again at once;
  a server-side wait of GROUP_POLL_SECONDS ends in a retry (`abandon_wait`).
- `adpsgd`, `a2cid2` (gossip/protocol.py): the compute loop never waits; each step owes
  averagings (StepCredit, capped backlog); a communication thread asks for a partner
  while it owes one, and otherwise (adpsgd) listens in polls of LISTEN_POLL_SECONDS.
- `allreduce`: lock-step; an iteration takes the slowest worker's compute plus one ring
  all-reduce over every worker (the coordinator takes no part per iteration).

Every worker heartbeats (with its progress) at the run's interval and the lease reaper
runs, as in the service, so the core's per-worker work is all there. The wall time of
each core call is measured (this process is single-threaded: it is one core's time).
"""

from __future__ import annotations

import heapq
import math
import os
import random
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ripples.coordinator import heap
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, GroupDecision, Outcome, Progress
from ripples.coordinator.groups import GroupRecord
from ripples.protocols import Coordination, GossipSettings
from ripples.sim.models import CommModel, ComputeModel, ConsensusModel, ConsensusState
from ripples.worker.protocols.gossip.protocol import (
    LISTEN_POLL_SECONDS,
    MAX_BACKLOG_STEPS,
    REQUEST_WAIT_SECONDS,
)
from ripples.worker.protocols.gossip.state import StepCredit
from ripples.worker.protocols.group_generator import GROUP_POLL_SECONDS

SIM_PROTOCOLS: tuple[str, ...] = ("allreduce", "ripples-random", "ripples-smart", "adpsgd",
                                  "a2cid2")
"""Protocols the simulator runs (the lock-step static schedule, hop and the LPP family
are not simulated: docs/scale.md)."""

REAP_INTERVAL_SECONDS = 1.0
"""How often the simulated service expires leases (coordinator/service.py's reaper)."""

# Event kinds (ints: the heap compares tuples).
_COMPUTE, _GROUP_END, _TIMEOUT, _COMM_NEXT, _HEARTBEAT, _REAP, _SAMPLE = range(7)


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated run."""

    protocol: str = "ripples-smart"
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
    measure_memory: bool = False
    """Trace the run's allocations (tracemalloc) to report the core's bytes per worker:
    what the coordinator's code allocated and still holds at the stop (registry, graph,
    group table, communicator directory, progress). About 3x slower, so the run's
    decisions per second are not reported (0)."""

    def __post_init__(self) -> None:
        if self.protocol not in SIM_PROTOCOLS:
            raise ValueError(f"the simulator runs {', '.join(SIM_PROTOCOLS)}; "
                             f"got {self.protocol!r}")
        if self.workers < 2:
            raise ValueError(f"workers must be at least 2, got {self.workers}")
        if self.workers_per_host < 1:
            raise ValueError("workers_per_host must be at least 1")
        if self.iterations < 1 or self.epoch_iterations < 1:
            raise ValueError("iterations and epoch_iterations must be at least 1")
        if self.samples < 2:
            raise ValueError("samples must be at least 2")

    def settings(self) -> RunSettings:
        options: dict[str, object] = {
            "protocol": self.protocol, "task": "simulated", "num_workers": self.workers,
            "min_workers": 1, "workers_per_node": self.workers_per_host,
            "iterations": self.iterations, "seed": self.seed,
            **self.run_options}
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
    """Of the workers' time: waiting for a group to be delivered (group protocols) or, for
    allreduce, for the slowest worker."""
    comm_fraction: float
    """Of the workers' time: in collectives (for gossip, on the communication thread,
    which overlaps compute)."""
    averagings_per_iteration: float
    """Group memberships (a worker in a group or exchange) per iteration of a worker."""
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
    consensus_distance: float
    """mean_i ||x_i - mean(x)||^2 at the stop (the ConsensusModel)."""
    optimum_gap: float
    """||mean(x) - optimum||^2 at the stop."""
    consensus_curve: list[tuple[float, float]]
    """(simulated seconds, consensus distance) over the run."""
    wall_seconds: float
    events: int

    def summary(self) -> dict[str, object]:
        """The result as JSON-ready data."""
        return {k: v for k, v in self.__dict__.items()}


class _Worker:
    __slots__ = ("rank", "wid", "host", "iteration", "compute_s", "wait_s", "comm_s", "partner_s",
                 "wait_since", "token", "listen", "owed", "done", "more", "credit",
                 "comm_idle", "in_group")

    def __init__(self, rank: int, wid: int, host: int) -> None:
        self.rank, self.wid, self.host = rank, wid, host
        self.iteration = 0
        self.compute_s = self.wait_s = self.comm_s = 0.0
        self.partner_s = 0.0  # gossip: the communication thread's waits for a partner
        self.wait_since: float | None = None
        self.token = 0
        self.listen = False
        self.owed = 0
        self.done = False
        self.more = False
        self.credit: StepCredit | None = None
        self.comm_idle = False  # a2cid2: the communication thread waits for owed work
        self.in_group = False


class Simulation:
    """One run: the core, the simulated workers, the event heap."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.settings = config.settings()
        self.role = self.settings.role
        self.rng = random.Random(config.seed)
        self.compute = config.compute.sampler(config.workers, self.rng)
        self.comm = config.comm
        self.model = ConsensusState(config.consensus, config.workers, config.seed)
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.core_seconds = {"group": 0.0, "heartbeat": 0.0, "other": 0.0}
        self.num_requests = 0
        self.num_heartbeats = 0
        self.num_waits = 0
        self.groups: dict[int, tuple[list[int], float]] = {}  # group id -> ranks, start
        self._snapshots: dict[int, np.ndarray] = {}  # group id -> members' vectors at start
        self.group_sizes: list[int] = []
        self.curve: list[tuple[float, float]] = []
        self.events = 0
        gossip = self.settings.settings(GossipSettings)
        self.rate_com = gossip.rate_com
        self.max_backlog = max(2, MAX_BACKLOG_STEPS * math.ceil(self.rate_com))
        self.coordination = self.role.coordination
        self.core_bytes_per_worker = 0.0
        self.workers: list[_Worker] = []
        self.by_wid: dict[int, _Worker] = {}
        self.core: CoordinatorCore | None = None

    # ------------------------------------------------------------------ set-up
    def _build_core(self) -> CoordinatorCore:
        """A core with every worker registered and ready, training started at 0."""
        cfg = self.config
        core = CoordinatorCore(self.settings, now=0.0)
        k = cfg.workers_per_host
        for r in range(cfg.workers):
            core.register(f"h{r // k}", r % k, "cpu", r + 1, 0.0)
        for w in core.live():
            core.mark_ready(w.worker_id, cfg.iterations, 0.0)
        if core.stopped:
            raise ValueError(f"the simulated run cannot start: {core.stop_reason}")
        return core

    def _setup(self) -> CoordinatorCore:
        cfg = self.config
        core = self._build_core()
        k = cfg.workers_per_host
        for rec in sorted(core.live(), key=lambda x: x.rank):
            w = _Worker(rec.rank, rec.worker_id, rec.rank // k)
            self.workers.append(w)
            self.by_wid[rec.worker_id] = w
        return core

    # ------------------------------------------------------------------ the loop
    def run(self) -> SimResult:
        if not self.config.measure_memory:
            return self._run()
        tracemalloc.start()
        try:
            result = self._run()
            held = tracemalloc.take_snapshot().filter_traces(
                [tracemalloc.Filter(True, f"*{os.sep}coordinator{os.sep}*")])
        finally:
            tracemalloc.stop()
        result.core_bytes_per_worker = sum(t.size for t in held.traces) / self.config.workers
        result.decisions_per_second = result.heartbeats_per_second = 0.0
        return result

    def _run(self) -> SimResult:
        self.core = self._setup()
        heap.settle()  # as the service does once training starts
        try:
            return self._loop()
        finally:
            heap.release()

    def _loop(self) -> SimResult:
        started = time.perf_counter()
        core = self.core
        assert core is not None
        cfg = self.config
        if self.coordination is Coordination.LOCKSTEP:
            return self._run_lockstep(started)
        poisson = self.role.policy == "a2cid2"
        for w in self.workers:
            if self.coordination is Coordination.GOSSIP:
                w.credit = StepCredit(self.rate_com, torch.Generator().manual_seed(
                    cfg.seed * 1000 + w.rank + 17), poisson=poisson)
                self._comm_next(w)
            self._compute(w)
            # Heartbeats spread over one interval, as workers start at different moments.
            self._push(self.rng.random() * self.settings.heartbeat_interval_seconds,
                       _HEARTBEAT, w.rank)
        self._push(REAP_INTERVAL_SECONDS, _REAP)
        sample_every = self._sample_interval()
        self._push(0.0, _SAMPLE, 0, 0)
        handlers: dict[int, Callable[[int, int], None]] = {
            _COMPUTE: self._on_compute, _GROUP_END: self._on_group_end,
            _TIMEOUT: self._on_timeout, _COMM_NEXT: lambda r, _: self._comm_next(
                self.workers[r]),
            _HEARTBEAT: self._on_heartbeat, _REAP: lambda _a, _b: self._on_reap(),
            _SAMPLE: lambda _a, _b: self._on_sample(sample_every)}
        heap = self.heap
        while heap and not core.stopped:
            t, _, kind, a, b = heapq.heappop(heap)
            if t > cfg.max_sim_seconds:
                break
            self.now = t
            self.events += 1
            handlers[kind](a, b)
        stop_reason = core.stop_reason if core.stopped else (
            f"stalled: no stop within {cfg.max_sim_seconds:g} simulated seconds"
            if heap else "stalled: no event left (every worker waits)")
        return self._result(stop_reason, started)

    def _sample_interval(self) -> float:
        """The curve's spacing: the run's expected length (unslowed) over `samples`."""
        cfg = self.config
        return max(cfg.iterations * cfg.compute.step_seconds / cfg.samples, 1e-6)

    def _compute(self, w: _Worker) -> None:
        """The worker starts its next iteration."""
        seconds = self.compute.seconds(w.rank)
        w.compute_s += seconds
        self._push(seconds, _COMPUTE, w.rank)

    def _push(self, delay: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self.now + delay, self.seq, kind, a, b))

    def _progress(self, w: _Worker) -> Progress:
        return Progress(iteration=w.iteration, loss=self.model.loss(w.rank),
                        compute_seconds=w.compute_s, wait_seconds=w.wait_s,
                        preduce_seconds=w.comm_s, planned_iterations=self.config.iterations)

    # ------------------------------------------------------------------ core calls
    def _request(self, w: _Worker, *, listen: bool = False) -> None:
        assert self.core is not None
        w.listen = listen
        progress = self._progress(w)
        t0 = time.perf_counter()
        decision, deliveries = self.core.request_group(w.wid, w.iteration, self.now, progress,
                                                       listen=listen)
        self.core_seconds["group"] += time.perf_counter() - t0
        self.num_requests += 1
        if decision is None:
            self.num_waits += 1
            w.wait_since = self.now
            w.token += 1
            poll = (GROUP_POLL_SECONDS if self.coordination is Coordination.GROUPS
                    else LISTEN_POLL_SECONDS if listen else REQUEST_WAIT_SECONDS)
            self._push(poll, _TIMEOUT, w.rank, w.token)
        self._deliver(deliveries)
        if decision is not None:
            self._decided(w, decision)

    def _deliver(self, deliveries: dict[int, GroupDecision]) -> None:
        for wid, decision in deliveries.items():
            w = self.by_wid.get(wid)
            if w is not None:
                self._decided(w, decision)

    def _decided(self, w: _Worker, d: GroupDecision) -> None:
        if w.wait_since is not None:
            if self.coordination is Coordination.GOSSIP:  # the compute loop never waits
                w.partner_s += self.now - w.wait_since
            else:
                w.wait_s += self.now - w.wait_since
            w.wait_since = None
        w.token += 1  # a pending timeout is void
        outcome = d.outcome
        if outcome is Outcome.GROUP:
            assert d.group is not None
            w.more = d.more
            w.in_group = True
            self._start_group(d.group)
        elif outcome is Outcome.STOP:
            w.done = True
        elif outcome is Outcome.RETRY:
            if self.coordination is Coordination.GROUPS:
                self._request(w)
            else:
                self._comm_next(w)
        elif self.coordination is Coordination.GROUPS:  # NO_GROUP, CANCELLED: train on
            self._compute(w)
        else:
            if outcome is Outcome.NO_GROUP and not w.listen:
                w.owed = max(0, w.owed - 1)
            self._push(LISTEN_POLL_SECONDS, _COMM_NEXT, w.rank)

    def _start_group(self, g: GroupRecord) -> None:
        if g.group_id in self.groups:
            return
        ranks = [self.by_wid[m].rank for m in g.members]
        k = self.config.workers_per_host
        spans = len({r // k for r in ranks}) > 1
        seconds = (self.comm.rpc_seconds
                   + (self.comm.setup_seconds if g.create_comm else 0.0)
                   + self.comm.allreduce_seconds(len(ranks), spans_hosts=spans))
        self.groups[g.group_id] = (ranks, self.now)
        self.group_sizes.append(len(ranks))
        snapshot = self.model.snapshot(ranks)
        self._snapshots[g.group_id] = snapshot
        self._push(seconds, _GROUP_END, g.group_id)

    # ------------------------------------------------------------------ events
    def _on_compute(self, rank: int, _: int) -> None:
        w = self.workers[rank]
        if w.done:
            return
        w.iteration += 1
        self.model.step(rank)
        if self.coordination is Coordination.GROUPS:
            self._request(w)
            return
        # Gossip: the compute loop goes on; the step owes averagings.
        assert w.credit is not None
        owed = 0 if w.wid in self._passive else w.credit.next_step()
        w.owed = min(w.owed + owed, self.max_backlog)
        self._compute(w)
        if w.comm_idle and w.owed > 0:
            w.comm_idle = False
            self._comm_next(w)

    def _on_group_end(self, group_id: int, _: int) -> None:
        assert self.core is not None
        ranks, started = self.groups.pop(group_id)
        snapshot = self._snapshots.pop(group_id)
        self.model.average(ranks, snapshot)
        seconds = self.now - started
        members = [self.workers[r] for r in ranks]
        deliveries: dict[int, GroupDecision] = {}
        t0 = time.perf_counter()
        for w in members:
            w.comm_s += seconds
            w.in_group = False
            deliveries.update(self.core.release(w.wid, group_id, True, "", self.now))
        self.core_seconds["group"] += time.perf_counter() - t0
        self._deliver(deliveries)
        for w in members:
            if w.done:
                continue
            if self.coordination is Coordination.GROUPS:
                if w.more:
                    self._request(w)
                else:
                    self._compute(w)
                continue
            settled = self.role.policy == "a2cid2" or (not w.listen and not w.more)
            if settled and not w.listen:
                w.owed = max(0, w.owed - 1)
            self._comm_next(w)

    def _on_timeout(self, rank: int, token: int) -> None:
        assert self.core is not None
        w = self.workers[rank]
        if w.token != token or w.done:
            return
        t0 = time.perf_counter()
        decision = self.core.abandon_wait(w.wid, self.now)
        self.core_seconds["group"] += time.perf_counter() - t0
        self._decided(w, decision)

    def _comm_next(self, w: _Worker) -> None:
        """Gossip's communication thread asks for its next exchange (or waits for owed
        work: a2cid2)."""
        if w.done or w.in_group or w.wait_since is not None:
            return
        if w.owed > 0:
            self._request(w, listen=False)
        elif self.role.policy == "adpsgd":
            self._request(w, listen=True)
        else:
            w.comm_idle = True

    def _on_heartbeat(self, rank: int, _: int) -> None:
        assert self.core is not None
        w = self.workers[rank]
        if w.done:
            return
        progress = self._progress(w)
        t0 = time.perf_counter()
        deliveries = self.core.heartbeat(w.wid, progress, self.now)
        self.core_seconds["heartbeat"] += time.perf_counter() - t0
        self.num_heartbeats += 1
        self._deliver(deliveries)
        self._push(self.settings.heartbeat_interval_seconds, _HEARTBEAT, rank)

    def _on_reap(self) -> None:
        assert self.core is not None
        t0 = time.perf_counter()
        deliveries = self.core.expire_leases(self.now)
        self.core_seconds["other"] += time.perf_counter() - t0
        self._deliver(deliveries)
        self._push(REAP_INTERVAL_SECONDS, _REAP)

    def _on_sample(self, every: float) -> None:
        self.curve.append((self.now, self.model.distance()))
        self._push(every, _SAMPLE)

    @property
    def _passive(self) -> frozenset[int]:
        assert self.core is not None
        return self.core.graph.passive

    # ------------------------------------------------------------------ allreduce
    def _run_lockstep(self, started: float) -> SimResult:
        """Lock-step all-reduce: iteration k ends when the slowest worker computed it and
        the ring all-reduce over every worker is done; every model is the average."""
        cfg = self.config
        n = cfg.workers
        spans = n > cfg.workers_per_host
        ring = self.comm.allreduce_seconds(n, spans_hosts=spans)
        sample_every = self._sample_interval()
        next_sample = 0.0
        for _ in range(cfg.iterations):
            times = [self.compute.seconds(w.rank) for w in self.workers]
            slowest = max(times)
            for w, t in zip(self.workers, times, strict=True):
                w.compute_s += t
                w.wait_s += slowest - t
                w.comm_s += ring
                w.iteration += 1
            self.now += slowest + ring
            self.events += 1
            for r in range(n):
                self.model.step(r)
            self.model.set_all_to_mean()
            if self.now >= next_sample:
                self.curve.append((self.now, self.model.distance()))
                next_sample = self.now + sample_every
        return self._result(f"iteration budget reached ({cfg.iterations * n} iterations)",
                            started)

    # ------------------------------------------------------------------ the result
    def _result(self, stop_reason: str, started: float) -> SimResult:
        cfg = self.config
        workers = self.workers
        total = sum(w.iteration for w in workers)
        mean_iterations = total / len(workers)
        compute = sum(w.compute_s for w in workers)
        wait = sum(w.wait_s for w in workers)
        comm = sum(w.comm_s for w in workers)
        # Gossip's collectives overlap compute: its fractions are of compute + waits.
        busy = compute + wait + (comm if self.coordination is not Coordination.GOSSIP else 0.0)
        busy = busy or 1.0
        group_core = self.core_seconds["group"]
        heartbeat_core = self.core_seconds["heartbeat"]
        self.curve.append((self.now, self.model.distance()))
        return SimResult(
            protocol=cfg.protocol, workers=cfg.workers, scenario=cfg.compute.scenario,
            stop_reason=stop_reason, sim_seconds=self.now, iterations=total,
            seconds_per_epoch=(self.now / (mean_iterations / cfg.epoch_iterations)
                               if mean_iterations else math.inf),
            seconds_per_iteration=self.now / mean_iterations if mean_iterations else math.inf,
            compute_fraction=compute / busy, wait_fraction=wait / busy,
            comm_fraction=comm / busy,
            averagings_per_iteration=sum(self.group_sizes) / total if total else 0.0,
            conflict_fraction=self.num_waits / self.num_requests if self.num_requests else 0.0,
            group_requests=self.num_requests, groups=len(self.group_sizes),
            mean_group_size=(sum(self.group_sizes) / len(self.group_sizes)
                             if self.group_sizes else 0.0),
            core_seconds=sum(self.core_seconds.values()), group_core_seconds=group_core,
            decisions_per_second=self.num_requests / group_core if group_core else 0.0,
            heartbeats_per_second=(self.num_heartbeats / heartbeat_core
                                   if heartbeat_core else 0.0),
            core_bytes_per_worker=self.core_bytes_per_worker,
            consensus_distance=self.model.distance(), optimum_gap=self.model.gap(),
            consensus_curve=self.curve, wall_seconds=time.perf_counter() - started,
            events=self.events)


def simulate(config: SimConfig) -> SimResult:
    """Run one simulated run to its stop (or its simulated-time bound)."""
    return Simulation(config).run()
