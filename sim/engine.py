"""The discrete-event simulation: simulated workers drive the real coordinator core.

Nothing of the coordinator is modelled: `CoordinatorCore` (registry, run graph, group
policies, group table, pairing, progress, stop rule) runs as in the service, called with
a fake clock. What is modelled is the workers (sim/models.py): how long an iteration
takes, how long a collective takes, and what averaging does to their models. Each
protocol's workers follow that protocol's real loop, modelled in its own package
(protocols/<name>/sim.py, a `SimulatedWorkers`: sim/worker_model.py); a protocol whose
spec has no such model is not simulated.

Every worker heartbeats (with its progress) at the run's interval and the lease reaper
runs, as in the service, so the core's per-worker work is all there. The wall time of
each core call is measured (this process is single-threaded: it is one core's time).
The cores and the queues of RPCs in front of them are sim/coordinators.py; what the run
measured, sim/summary.py.
"""

from __future__ import annotations

import heapq
import os
import random
import time
import tracemalloc
from collections.abc import Callable

from ripples.coordinator import heap
from ripples.coordinator.core import CoordinatorCore, GroupDecision, Outcome, Progress
from ripples.coordinator.groups import GroupRecord
from ripples.protocols.registry import get_protocol
from ripples.sim.config import SimConfig, SimResult
from ripples.sim.coordinators import ServiceQueues, build_cores
from ripples.sim.models import ConsensusState, GroupSnapshot, SharedCores
from ripples.sim.outer_step import OuterStep
from ripples.sim.summary import summarize
from ripples.sim.worker_model import SimulatedWorkers, SimWorker

REAP_INTERVAL_SECONDS = 1.0
"""How often the simulated service expires leases (coordinator/service.py's reaper)."""

# Event kinds (ints: the heap compares tuples).
(_COMPUTE, _GROUP_END, _TIMEOUT, _TIMER, _HEARTBEAT, _REAP, _SAMPLE, _CPU_END,
 _SERVED, _RELEASE) = range(10)


class Simulation:
    """One run: the cores (one, or a shard's each and the root's), the simulated
    workers, the event heap. It is the `SimHost` its protocol's model acts through."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.settings = config.settings()
        simulation = get_protocol(config.protocol).simulation
        if simulation is None:  # SimConfig refuses it first; kept for direct callers
            raise ValueError(f"protocol {config.protocol} has no model in the simulator")
        self.rng = random.Random(config.seed)
        self.compute_times = config.compute.sampler(config.workers, self.rng)
        self.comm = config.comm
        self.outer = (OuterStep(lr=self.settings.outer_lr,
                                momentum=self.settings.outer_momentum,
                                compression=self.settings.outer_compression)
                      if self.settings.outer_optimizer == "nesterov" else None)
        self.model = ConsensusState(config.consensus, config.workers, config.seed,
                                    config.data_block_ranks(), self.outer)
        self.shared = SharedCores(config.compute.cores) if config.compute.cores else None
        self._shared_token = 0
        self._comm_seq = 0
        self._comm_jobs: dict[int, tuple[int, int, float]] = {}  # job -> group, core, latency
        self.heap: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.core_seconds = {"group": 0.0, "heartbeat": 0.0, "other": 0.0}
        self.num_requests = 0
        self.num_heartbeats = 0
        self.num_waits = 0
        # (group id, core index) -> member ranks, start; and the members' vectors then
        self.groups: dict[tuple[int, int], tuple[list[int], float]] = {}
        self._snapshots: dict[tuple[int, int], GroupSnapshot] = {}
        self.group_sizes: list[int] = []
        self.bytes_sent = 0.0  # what the workers fed into their collectives, together
        self.curve: list[tuple[float, float]] = []
        self.events = 0
        self.core_bytes_per_worker = 0.0
        self.workers: list[SimWorker] = []
        self.cores: list[CoordinatorCore] = []
        """The shards' cores, then (sharded) the root's."""
        self.by_wid: list[dict[int, SimWorker]] = []
        """Per core: its worker ids' simulated workers."""
        self.root = -1  # the root core's index (sharded runs)
        self.queues = ServiceQueues(0, config.service_seconds)
        """The coordinators' queues of RPCs (sim/coordinators.py)."""
        self._releases: dict[int, tuple[int, int, int]] = {}  # queued: worker, group, core
        self._release_seq = 0
        self.protocol: SimulatedWorkers = simulation()(self)
        """The model of this protocol's workers (its package's sim.py)."""

    # ------------------------------------------------------------------ set-up
    def _setup(self) -> None:
        """The cores with their workers (sim/coordinators.py), and their queues."""
        layout = build_cores(self.config)
        self.workers, self.cores, self.by_wid = layout.workers, layout.cores, layout.by_wid
        self.root = layout.root
        self.queues = ServiceQueues(len(self.cores), self.config.service_seconds)

    @property
    def core(self) -> CoordinatorCore:
        """The first shard's core (the only one of a flat run)."""
        return self.cores[0]

    def _wid(self, w: SimWorker, core: int) -> int:
        return w.root_wid if core == self.root else w.wid

    def _stopped(self) -> bool:
        """A shard that reached its budget ends the run (the shards advance together)."""
        return any(c.stopped for i, c in enumerate(self.cores) if i != self.root)

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
        self._setup()
        heap.settle()  # as the service does once training starts
        try:
            return self._loop()
        finally:
            heap.release()

    def _loop(self) -> SimResult:
        started = time.perf_counter()
        cfg = self.config
        own_loop = self.protocol.run()
        if own_loop is not None:
            return summarize(self, own_loop, started)
        for w in self.workers:
            self.protocol.start(w)
            # Heartbeats spread over one interval, as workers start at different moments.
            self._push(self.rng.random() * self.settings.heartbeat_interval_seconds,
                       _HEARTBEAT, w.rank)
        self._push(REAP_INTERVAL_SECONDS, _REAP)
        sample_every = self.sample_interval()
        self._push(0.0, _SAMPLE, 0, 0)
        handlers: dict[int, Callable[[int, int], None]] = {
            _COMPUTE: self._on_compute, _GROUP_END: self._on_group_end,
            _TIMEOUT: self._on_timeout, _TIMER: self._on_timer,
            _HEARTBEAT: self._on_heartbeat, _REAP: lambda _a, _b: self._on_reap(),
            _SAMPLE: lambda _a, _b: self._on_sample(sample_every),
            _CPU_END: self._on_cpu_end, _SERVED: self._on_served,
            _RELEASE: self._on_release}
        events = self.heap
        while events and not self._stopped():
            t, _, kind, a, b = heapq.heappop(events)
            if t > cfg.max_sim_seconds:
                break
            self.now = t
            self.events += 1
            handlers[kind](a, b)
        stopped = [c for i, c in enumerate(self.cores) if i != self.root and c.stopped]
        stop_reason = stopped[0].stop_reason if stopped else (
            f"stalled: no stop within {cfg.max_sim_seconds:g} simulated seconds"
            if events else "stalled: no event left (every worker waits)")
        return summarize(self, stop_reason, started)

    def sample_interval(self) -> float:
        """The curve's spacing: the run's expected length (unslowed) over `samples`."""
        cfg = self.config
        return max(cfg.iterations * cfg.compute.step_seconds / cfg.samples, 1e-6)

    def start_iteration(self, w: SimWorker) -> None:
        """The worker starts its next iteration."""
        work, factor = self.compute_times.draw(w.rank)
        if self.shared is None:
            w.compute_s += work * factor
            self._push(work * factor, _COMPUTE, w.rank)
            return
        w.compute_started, w.factor = self.now, factor
        self.shared.start(self.now, w.rank, work)
        self._schedule_shared()

    def _schedule_shared(self) -> None:
        """One event at the next end of work on the shared cores (earlier ones are void)."""
        assert self.shared is not None
        self._shared_token += 1
        delay = self.shared.next_end()
        if delay is not None:
            self._push(delay, _CPU_END, 0, self._shared_token)

    def _on_cpu_end(self, _: int, token: int) -> None:
        """Shared cores: iterations whose work is done; a slowed one sleeps on."""
        assert self.shared is not None
        if token != self._shared_token:
            return
        for rank in self.shared.finish(self.now):
            if rank < 0:  # a collective's work is done
                group_id, at, latency = self._comm_jobs.pop(rank)
                self._push(latency, _GROUP_END, group_id, at)
                continue
            w = self.workers[rank]
            took = self.now - w.compute_started
            slept = (w.factor - 1.0) * took
            w.compute_s += took + slept
            if slept > 0:
                self._push(slept, _COMPUTE, rank)
            else:
                self._on_compute(rank, 0)
        self._schedule_shared()

    def _push(self, delay: float, kind: int, a: int = 0, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (self.now + delay, self.seq, kind, a, b))

    def _progress(self, w: SimWorker, at: int) -> Progress:
        """What `w` reports to core `at`; to the root, no budget of its own (a worker
        without one holds a budget stop off: the shards end the run)."""
        return Progress(iteration=w.iteration, loss=self.model.loss(w.rank),
                        compute_seconds=w.compute_s, wait_seconds=w.wait_s,
                        preduce_seconds=w.comm_s,
                        planned_iterations=0 if at == self.root else self.config.iterations)

    # ------------------------------------------------------------------ core calls
    def request(self, w: SimWorker, *, listen: bool = False) -> None:
        """The worker asks its current core (w.core_at) for a group; the reply comes when
        the core has served it."""
        w.listen = listen
        if w.wait_since is None:
            w.wait_since = self.now
        delay = self.queues.serve(w.core_at, self.now)
        if delay:
            w.token += 1  # no timeout runs while the request is queued
            self._push(delay, _SERVED, w.rank, w.token)
        else:
            self._ask(w)

    def _on_served(self, rank: int, token: int) -> None:
        w = self.workers[rank]
        if w.token == token and not w.done:
            self._ask(w)

    def later(self, delay: float, w: SimWorker) -> None:
        self._push(delay, _TIMER, w.rank)

    def _on_timer(self, rank: int, _: int) -> None:
        self.protocol.on_timer(self.workers[rank])

    def _ask(self, w: SimWorker) -> None:
        at = w.core_at
        core = self.cores[at]
        progress = self._progress(w, at)
        t0 = time.perf_counter()
        decision, deliveries = core.request_group(self._wid(w, at), w.iteration, self.now,
                                                  progress, listen=w.listen)
        self.core_seconds["group"] += time.perf_counter() - t0
        self.num_requests += 1
        if decision is None:
            self.num_waits += 1
            w.token += 1
            self._push(self.protocol.poll_seconds(w), _TIMEOUT, w.rank, w.token)
        self._deliver(at, deliveries)
        if decision is not None:
            self._decided(w, decision)

    def _deliver(self, at: int, deliveries: dict[int, GroupDecision]) -> None:
        index = self.by_wid[at]
        for wid, decision in deliveries.items():
            w = index.get(wid)
            if w is not None:
                self._decided(w, decision)

    def _decided(self, w: SimWorker, d: GroupDecision) -> None:
        if w.wait_since is not None:
            if self.protocol.waits_hold_compute:
                w.wait_s += self.now - w.wait_since
            else:  # the compute loop went on meanwhile
                w.partner_s += self.now - w.wait_since
            w.wait_since = None
        w.token += 1  # a pending timeout is void
        outcome = d.outcome
        if outcome is Outcome.GROUP:
            assert d.group is not None
            w.more = d.more
            w.in_group = True
            self._start_group(w.core_at, d.group)
        elif outcome is Outcome.STOP:
            w.done = True
        else:  # RETRY, NO_GROUP, CANCELLED: the protocol's loop says what next
            self.protocol.on_decision(w, d)

    def _start_group(self, at: int, g: GroupRecord) -> None:
        key = (g.group_id, at)
        if key in self.groups:
            return
        index = self.by_wid[at]
        ranks = [index[m].rank for m in g.members]
        k = self.config.workers_per_host
        spans = len({r // k for r in ranks}) > 1
        # The outer optimizer's group form carries [provisional anchor | momentum].
        vectors = 1.0 if self.outer is None else self.outer.group_vectors
        collective = self.comm.allreduce_seconds(len(ranks), spans_hosts=spans,
                                                 vectors=vectors)
        seconds = (self.comm.rpc_seconds
                   + (self.comm.setup_seconds if g.create_comm else 0.0) + collective)
        self.groups[key] = (ranks, self.now)
        self.record_collective(len(ranks), vectors)
        self._snapshots[key] = self.model.snapshot(
            ranks, [self.protocol.spends(self.workers[r]) for r in ranks])
        if self.shared is None:
            self._push(seconds, _GROUP_END, g.group_id, at)
            return
        # Shared cores: the collective is len(ranks) threads of work; its latency (the
        # round trip, a new communicator) follows once the work is done.
        self._comm_seq += 1
        job = -self._comm_seq  # compute jobs are keyed by rank, collectives below 0
        self._comm_jobs[job] = (g.group_id, at, seconds - collective)
        self.shared.start(self.now, job, collective, weight=len(ranks))
        self._schedule_shared()

    def record_collective(self, size: int, vectors: float) -> None:
        """Count one collective of `size` members, each feeding `vectors` model-sized
        vectors into it."""
        self.group_sizes.append(size)
        self.bytes_sent += size * vectors * self.comm.model_bytes

    # ------------------------------------------------------------------ events
    def _on_compute(self, rank: int, _: int) -> None:
        w = self.workers[rank]
        if w.done:
            return
        w.iteration += 1
        self.model.step(rank)
        self.protocol.on_compute(w)

    def _on_group_end(self, group_id: int, at: int) -> None:
        ranks, started = self.groups.pop((group_id, at))
        snapshot = self._snapshots.pop((group_id, at))
        self.model.average(ranks, snapshot)
        seconds = self.now - started
        members = [self.workers[r] for r in ranks]
        for w in members:
            w.comm_s += seconds
            w.in_group = False
            # The release goes on the worker's stream: the coordinator takes it when its
            # queue reaches it; the worker goes on without an answer.
            delay = self.queues.serve(at, self.now)
            if delay:
                self._release_seq += 1
                self._releases[self._release_seq] = (self._wid(w, at), group_id, at)
                self._push(delay, _RELEASE, self._release_seq)
            else:
                self._release(self._wid(w, at), group_id, at)
        for w in members:
            if not w.done:
                self.protocol.on_group_end(w)

    def _on_release(self, key: int, _: int) -> None:
        self._release(*self._releases.pop(key))

    def _release(self, wid: int, group_id: int, at: int) -> None:
        t0 = time.perf_counter()
        deliveries = self.cores[at].release(wid, group_id, True, "", self.now)
        self.core_seconds["group"] += time.perf_counter() - t0
        self._deliver(at, deliveries)

    def _on_timeout(self, rank: int, token: int) -> None:
        w = self.workers[rank]
        if w.token != token or w.done:
            return
        at = w.core_at
        self.queues.serve(at, self.now)
        t0 = time.perf_counter()
        decision = self.cores[at].abandon_wait(self._wid(w, at), self.now)
        self.core_seconds["group"] += time.perf_counter() - t0
        self._decided(w, decision)

    def _on_heartbeat(self, rank: int, _: int) -> None:
        w = self.workers[rank]
        if w.done:
            return
        answered = 0.0
        for at in (w.shard, self.root) if w.root_wid >= 0 else (w.shard,):
            progress = self._progress(w, at)
            # A worker's heartbeat thread sends its next beat an interval after the
            # answer: a busy coordinator slows the beats down, as it does the requests.
            answered = max(answered, self.queues.serve(at, self.now))
            t0 = time.perf_counter()
            deliveries = self.cores[at].heartbeat(self._wid(w, at), progress, self.now)
            self.core_seconds["heartbeat"] += time.perf_counter() - t0
            self.num_heartbeats += 1
            self._deliver(at, deliveries)
        self._push(answered + self.settings.heartbeat_interval_seconds, _HEARTBEAT, rank)

    def _on_reap(self) -> None:
        for at, core in enumerate(self.cores):
            t0 = time.perf_counter()
            deliveries = core.expire_leases(self.now)
            self.core_seconds["other"] += time.perf_counter() - t0
            self._deliver(at, deliveries)
        self._push(REAP_INTERVAL_SECONDS, _REAP)

    def _on_sample(self, every: float) -> None:
        self.curve.append((self.now, self.model.distance()))
        self._push(every, _SAMPLE)


def simulate(config: SimConfig) -> SimResult:
    """Run one simulated run to its stop (or its simulated-time bound)."""
    return Simulation(config).run()
