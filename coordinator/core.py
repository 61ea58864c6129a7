"""The coordinator's pure core: registry, leases, group generation, stop agreement.

Events go in (register, request a group, release, heartbeat, time passes) with the time
passed explicitly; decisions come out. No threads, sockets or wall clock: the gRPC shell
(service.py) adds those, and tests drive the very same code with a fake clock.
"""

from __future__ import annotations

import enum
import random
import re
from collections import deque
from dataclasses import dataclass, field

from ripples.coordinator.comm_directory import CommDirectory
from ripples.coordinator.config import RunSettings
from ripples.coordinator.groups import GroupRecord, GroupTable
from ripples.coordinator.pairing import FifoPairing
from ripples.coordinator.policies import ClusterView, GroupPolicy, RandomPolicy, make_policy
from ripples.coordinator.topology import A2cid2Constants, Topology, build_topology

LOSS_CURVE_MIN_STEP_SECONDS = 0.2
# The consensus-distance estimate averages the pairwise distances of this many recent
# exchanges per worker.
DISTANCE_WINDOW_PER_WORKER = 4
# Weight of the newest report in a worker's moving average of its own time per iteration.
OWN_SECONDS_SMOOTHING = 0.3


def _natural_key(text: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


class CoordinatorError(Exception):
    """A request the coordinator refuses; `code` names the gRPC status to return."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # INVALID_ARGUMENT | NOT_FOUND | FAILED_PRECONDITION


class WorkerState(enum.Enum):
    REGISTERED = "registered"
    COMPUTING = "computing"
    WAITING = "waiting"
    REDUCING = "reducing"
    LEFT = "left"
    EXPIRED = "expired"
    FAILED = "failed"


GONE = (WorkerState.LEFT, WorkerState.EXPIRED, WorkerState.FAILED)


class Outcome(enum.Enum):
    GROUP = "group"
    STOP = "stop"
    CANCELLED = "cancelled"
    NO_GROUP = "no_group"
    RETRY = "retry"


@dataclass(kw_only=True)
class Progress:
    iteration: int = 0
    loss: float = float("nan")
    samples: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    preduce_seconds: float = 0.0
    planned_iterations: int = 0


@dataclass(kw_only=True)
class WorkerRecord:
    worker_id: int
    host: str
    local_rank: int
    device: str
    pid: int
    node: int
    lease_expires_at: float
    rank: int = -1
    state: WorkerState = WorkerState.REGISTERED
    request_count: int = 0
    progress: Progress = field(default_factory=Progress)
    error: str = ""
    round_target: int | None = None  # the group that ends the worker's current round
    wait_started_at: float | None = None
    checkpoint_grant: int = 0
    ready: bool = False  # built its task and waits in AwaitStart
    listening: bool = False  # gossip: waits only to serve partners (GroupRequest.listen)
    own_seconds: float | None = None
    """Smart GG's speed signal: moving average of the seconds per iteration the worker
    spends on its own (compute + collectives, not waiting for a group); None until two
    progress reports after its first iteration."""
    own_base: tuple[int, float] = (0, 0.0)  # (iteration, own seconds) it is measured from


@dataclass(kw_only=True)
class GroupDecision:
    """What a worker waiting for the reply to its group request is told."""

    outcome: Outcome
    group: GroupRecord | None = None
    more: bool = False
    evictions: list[int] = field(default_factory=list)
    detail: str = ""


Deliveries = dict[int, GroupDecision]


class CoordinatorCore:
    """All coordinator state and every rule that changes it."""

    def __init__(self, settings: RunSettings, *, now: float) -> None:
        self.settings = settings
        self.rng = random.Random(settings.seed)
        policy_name = settings.policy_name
        self.policy: GroupPolicy | None = None
        if policy_name:
            self.policy = make_policy(policy_name, group_size=settings.group_size,
                                      c_thres=settings.c_thres,
                                      inter_intra=settings.inter_intra)
        elif settings.gossip_pairing == "adpsgd":
            # AD-PSGD: each averaging pairs the initiator with one random neighbour; the
            # group table serialises overlapping pairs in one global order.
            self.policy = RandomPolicy(group_size=2)
        self.pairing = FifoPairing() if settings.gossip_pairing == "a2cid2" else None
        self.topology: Topology | None = None  # on ranks; built when the run starts
        self.neighbours: dict[int, tuple[int, ...]] | None = None  # worker id -> ids
        self.edges: list[tuple[int, int]] = []  # the topology's edges as worker ids, a < b
        self.gossip_constants: A2cid2Constants | None = None
        self.spectral_gap = 0.0  # of the topology, once the run has started
        self.passive: frozenset[int] = frozenset()  # adpsgd bipartite: never initiate
        self.pair_sq_distances: deque[float] = deque(
            maxlen=DISTANCE_WINDOW_PER_WORKER * settings.num_workers)
        self.table = GroupTable()
        self.comms = CommDirectory(max_comms_per_worker=settings.max_comms_per_worker)
        self.workers: dict[int, WorkerRecord] = {}
        self._nodes: dict[str, int] = {}
        self._next_worker_id = 0
        self.created_at = now
        self.started_at: float | None = None
        self.stopped = False
        self.stop_reason = ""
        self.stop_at_iteration = 0
        self.time_to_target: float | None = None
        self.iterations_to_target: float | None = None
        self.loss_curve: list[tuple[float, float, float]] = []  # (seconds, loss, iterations)
        self.recent_groups: deque[GroupRecord] = deque(maxlen=32)
        self.num_pending_waits = 0
        self.pending_wait_seconds = 0.0
        self.num_cancelled = 0
        self.num_failed = 0
        self.num_lease_expirations = 0

    # ------------------------------------------------------------------ lifecycle
    def register(self, host: str, local_rank: int, device: str, pid: int, now: float) -> int:
        if not host:
            raise CoordinatorError("INVALID_ARGUMENT", "host must not be empty")
        if len(self.live()) >= self.settings.num_workers or self.started_at is not None \
                or self.stopped:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"the run already has its {self.settings.num_workers} workers; "
                "start a new coordinator for a new run",
            )
        for w in self.live():
            if w.host == host and w.local_rank == local_rank:
                raise CoordinatorError(
                    "FAILED_PRECONDITION",
                    f"host {host} local rank {local_rank} is already registered as worker "
                    f"{w.worker_id}; give each worker on a host its own --local-rank",
                )
        node = self._nodes.setdefault(host, len(self._nodes))
        worker_id = self._next_worker_id
        self._next_worker_id += 1
        self.workers[worker_id] = WorkerRecord(
            worker_id=worker_id,
            host=host,
            local_rank=local_rank,
            device=device,
            pid=pid,
            node=node,
            lease_expires_at=now + self.settings.lease_seconds,
        )
        return worker_id

    def mark_ready(self, worker_id: int, planned_iterations: int, now: float) -> bool:
        """The worker built its task and waits to train; starts the run when all are ready.

        The clock of the run starts here, not at registration, so that start-up work
        (imports, data loading) does not count as training time. Returns True once the
        run has started.
        """
        w = self.worker(worker_id)
        w.progress.planned_iterations = planned_iterations
        w.ready = True
        live = self.live()
        if (self.started_at is None and len(live) == self.settings.num_workers
                and all(x.ready for x in live)):
            self._start(now)
        return self.started_at is not None

    def _start(self, now: float) -> None:
        # Nodes are numbered by host name in natural order (node2 before node10), so ranks
        # do not depend on which worker happened to register first.
        hosts = sorted({w.host for w in self.live()}, key=_natural_key)
        self._nodes = {h: i for i, h in enumerate(hosts)}
        for w in self.live():
            w.node = self._nodes[w.host]
        ordered = sorted(self.live(), key=lambda w: (w.node, w.local_rank))
        for rank, w in enumerate(ordered):
            w.rank = rank
            w.state = WorkerState.COMPUTING
        self.started_at = now
        try:
            self._build_topology(ordered)
        except ValueError as err:
            self.stop(f"invalid topology: {err}", now)

    def _build_topology(self, ordered: list[WorkerRecord]) -> None:
        s = self.settings
        self.topology = build_topology(s.topology, len(ordered),
                                       nodes=[w.node for w in ordered],
                                       edges=s.topology_edges())
        s.check_topology(self.topology)
        self.spectral_gap = self.topology.spectral_gap()
        by_rank = [w.worker_id for w in ordered]
        self.edges = sorted((min(by_rank[i], by_rank[j]), max(by_rank[i], by_rank[j]))
                            for i, j in self.topology.edges())
        if s.topology != "complete":
            self.neighbours = {by_rank[r]: tuple(by_rank[j] for j in ns)
                               for r, ns in enumerate(self.topology.neighbours)}
        if s.gossip_pairing is not None:
            self.gossip_constants = self.topology.a2cid2_constants(s.rate_com)
        if s.gossip_pairing == "adpsgd" and s.adpsgd_mode == "bipartite":
            colours = self.topology.two_colouring()
            assert colours is not None, "check_topology admits bipartite graphs only"
            self.passive = frozenset(by_rank[r] for r, c in enumerate(colours) if c == 1)

    def neighbours_of(self, worker_id: int) -> tuple[int, ...]:
        """The live workers `worker_id` may average with (all others on a complete graph)."""
        live = [w.worker_id for w in self.live() if w.worker_id != worker_id]
        if self.neighbours is None:
            return tuple(live)
        allowed = self.neighbours.get(worker_id, ())
        return tuple(w for w in live if w in allowed)

    def static_layout_error(self) -> str | None:
        """Why the static schedule cannot run on the registered workers, or None."""
        per_node: dict[int, int] = {}
        for w in self.live():
            per_node[w.node] = per_node.get(w.node, 0) + 1
        k = self.settings.workers_per_node
        if any(n != k for n in per_node.values()):
            return (
                f"the static schedule needs exactly {k} workers on every host (workers per "
                f"node), got {sorted(per_node.values())}; set workers_per_node to match"
            )
        return None

    def num_nodes(self) -> int:
        return len({w.node for w in self.live()})

    def heartbeat(self, worker_id: int, progress: Progress | None, now: float) -> Deliveries:
        """Renew the worker's lease and record its progress; may stop the run."""
        w = self.worker(worker_id)
        w.lease_expires_at = now + self.settings.lease_seconds
        if progress is not None:
            self._record_progress(w, progress, now)
        return self._check_stop(now)

    def leave(
        self, worker_id: int, progress: Progress | None, error: str, now: float
    ) -> Deliveries:
        w = self.worker(worker_id)
        if progress is not None:
            self._record_progress(w, progress, now)
        w.error = error
        return self._remove(w, WorkerState.FAILED if error else WorkerState.LEFT, now)

    def expire_leases(self, now: float) -> Deliveries:
        deliveries: Deliveries = {}
        for w in self.live():
            if w.lease_expires_at < now:
                self.num_lease_expirations += 1
                w.error = f"lease expired: no heartbeat for {self.settings.lease_seconds:.1f} s"
                deliveries.update(self._remove(w, WorkerState.EXPIRED, now))
        return deliveries

    def _remove(self, w: WorkerRecord, state: WorkerState, now: float) -> Deliveries:
        if w.state in GONE:
            return {}
        w.state = state
        deliveries: Deliveries = {}
        # The group each waiting peer arrived at (its head) before the cancellation.
        awaited = {}
        for peer in self.live():
            head = self.table.head(peer.worker_id)
            if peer.state is WorkerState.WAITING and head is not None:
                awaited[peer.worker_id] = head.group_id
        if self.pairing is not None:
            self.pairing.withdraw(w.worker_id)
        cancelled, ready = self.table.cancel_where(w.worker_id)
        self.num_cancelled += len(cancelled)
        self.comms.retire_worker(w.worker_id)
        cancelled_ids = {g.group_id for g in cancelled}
        for peer in self.live():
            if peer.round_target in cancelled_ids:
                peer.round_target = None  # its round now ends with the group it waits on
            if awaited.get(peer.worker_id) in cancelled_ids:
                deliveries[peer.worker_id] = self._decide(peer, Outcome.CANCELLED, now, detail=(
                    f"group {awaited[peer.worker_id]} cancelled: worker {w.worker_id} "
                    f"{state.value}"))
        deliveries.update(self._deliver(ready, now))
        deliveries.update(self._check_stop(now))
        if self.started_at is not None and not self.stopped:
            finished = 0 < w.progress.planned_iterations <= w.progress.iteration
            if self.settings.needs_every_worker and not (
                    state is WorkerState.LEFT and finished):
                # Lock-step peers cannot go on without it: stop everyone at the next
                # checkpoint rather than leave them inside collectives that never complete.
                why = f": {w.error}" if w.error else ""
                deliveries.update(self.stop(f"worker {w.worker_id} {state.value}{why}", now))
            elif self.settings.needs_every_worker:  # it left having finished its budget
                deliveries.update(self.stop(
                    f"iteration budget reached (worker {w.worker_id} finished its "
                    f"{w.progress.planned_iterations} iterations)", now))
            elif len(self.live()) < 2:
                deliveries.update(self.stop("fewer than two workers remain", now))
        return deliveries

    # ------------------------------------------------------------------ groups
    def request_group(
        self, worker_id: int, iteration: int, now: float, progress: Progress | None = None,
        *, listen: bool = False,
    ) -> tuple[GroupDecision | None, Deliveries]:
        """A worker asks for its next group, reporting its progress on the way.

        `listen` (gossip protocols): the worker owes no averaging and only serves
        partners; no group is generated for it. Returns (the caller's decision, or None if
        it must wait; decisions for other waiting workers that this request completed).
        """
        w = self.worker(worker_id)
        if self.policy is None and self.pairing is None:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"protocol {self.settings.protocol} does not use the group generator",
            )
        if listen and self.settings.gossip_pairing != "adpsgd":
            raise CoordinatorError(
                "INVALID_ARGUMENT",
                f"listen requests belong to adpsgd, not to {self.settings.protocol}")
        if not listen and worker_id in self.passive:
            raise CoordinatorError(
                "FAILED_PRECONDITION",
                f"worker {worker_id} is passive in adpsgd's bipartite mode: it only listens")
        if self.started_at is None:
            raise CoordinatorError("FAILED_PRECONDITION", "the run has not started yet")
        if progress is not None:
            self._record_progress(w, progress, now)
        w.progress.iteration = max(w.progress.iteration, iteration)
        deliveries = self._check_stop(now)
        if self.stopped:
            return self._decide(w, Outcome.STOP, now, detail=self.stop_reason), deliveries
        head = self.table.head(worker_id)
        if head is not None and head.delivered and worker_id not in head.released:
            return self._group_decision(w, head), deliveries  # a retried request
        if self.pairing is not None or listen:
            decision, more = self._offer_pair(w, now) if self.pairing else self._listen(w, now)
            deliveries.update(more)
            return decision, deliveries
        assert self.policy is not None
        continuing = w.round_target is not None and w.round_target in self.table.buffer(worker_id)
        if not continuing:
            w.request_count += 1
            if self.table.is_idle(worker_id) or self.policy.drain_to_own_group:
                created = self._generate(w, now)
                deliveries.update(self._arrive_listeners(created, now))
                own = next((g for g in created if worker_id in g.members), None)
                if self.policy.drain_to_own_group and own is not None:
                    w.round_target = own.group_id
            if not self.policy.drain_to_own_group or w.round_target is None:
                head = self.table.head(worker_id)
                w.round_target = head.group_id if head else None
        if self.table.head(worker_id) is None:
            return self._decide(w, Outcome.NO_GROUP, now, detail="no eligible peer"), deliveries
        w.state = WorkerState.WAITING
        ready = self.table.arrive(worker_id)
        if ready is None:
            self.num_pending_waits += 1
            w.wait_started_at = now
            return None, deliveries
        w.wait_started_at = now
        deliveries.update(self._deliver([ready], now))
        return deliveries.pop(worker_id), deliveries

    def _offer_pair(self, w: WorkerRecord, now: float) -> tuple[GroupDecision | None, Deliveries]:
        """A2CiD2: the worker is available; pair it first-in-first-out with a neighbour."""
        assert self.pairing is not None
        w.request_count += 1
        w.state = WorkerState.WAITING
        w.wait_started_at = now
        self.pairing.withdraw(w.worker_id)  # defensive: one place in the queue per worker
        neighbours = self.neighbours_of(w.worker_id)
        if not neighbours:
            return self._decide(w, Outcome.NO_GROUP, now, detail="no live neighbour"), {}
        partner = self.pairing.offer(w.worker_id, neighbours)
        if partner is None:
            self.num_pending_waits += 1
            return None, {}
        group = self._add_group((w.worker_id, partner), w.worker_id, now)
        self.table.arrive(partner)
        ready = self.table.arrive(w.worker_id)
        assert ready is group, "a pair of two idle workers executes at once"
        deliveries = self._deliver([group], now)
        return deliveries.pop(w.worker_id), deliveries

    def _listen(self, w: WorkerRecord, now: float) -> tuple[GroupDecision | None, Deliveries]:
        """AD-PSGD's passive side: arrive at the head of the buffer, or wait until a
        partner's group lands in it (see _generate)."""
        w.state = WorkerState.WAITING
        w.wait_started_at = now
        ready = self.table.arrive(w.worker_id)
        if ready is None:
            w.listening = True
            return None, {}
        deliveries = self._deliver([ready], now)
        return deliveries.pop(w.worker_id), deliveries

    def abandon_wait(self, worker_id: int, now: float) -> GroupDecision:
        """The caller's server-side wait ran out: forget its arrival, tell it to retry."""
        w = self.worker(worker_id)
        w.listening = False
        if self.pairing is not None:
            self.pairing.withdraw(worker_id)
        head = self.table.head(worker_id)
        if head is not None and not head.delivered:
            head.arrived.discard(worker_id)
        self._account_wait(w, now)
        w.state = WorkerState.COMPUTING
        waiting_on = [] if head is None else [
            m for m in head.members if m not in head.arrived and m != worker_id]
        return GroupDecision(outcome=Outcome.RETRY, detail=(
            f"group {head.group_id if head else '-'} still waits for workers {waiting_on}"))

    def release(
        self, worker_id: int, group_id: int, ok: bool, error: str, now: float,
        squared_distance: float | None = None,
    ) -> Deliveries:
        w = self.worker(worker_id)
        if squared_distance is not None and not squared_distance >= 0:  # also rejects NaN
            raise CoordinatorError("INVALID_ARGUMENT",
                                   f"squared_distance must be >= 0, got {squared_distance}")
        group = self.table.get(group_id)
        if group is not None and worker_id in group.members and not group.delivered:
            raise CoordinatorError(
                "FAILED_PRECONDITION", f"group {group_id} was not delivered to worker {worker_id}"
            )
        if squared_distance is not None and ok:
            self.pair_sq_distances.append(squared_distance)
        if not ok:
            self.num_failed += 1
            if group is not None:
                self._retire_comm(group.comm_id)
            w.error = f"group {group_id} failed: {error}"
        ready = self.table.release(worker_id, group_id)
        if w.state is WorkerState.REDUCING:
            w.state = WorkerState.COMPUTING
        return self._deliver(ready, now)

    def _retire_comm(self, comm_id: int) -> None:
        """A collective on the comm failed: members drop it, queued groups get a fresh one."""
        self.comms.retire(comm_id)
        for g in self.table.unfinished():  # in id order: the first one creates the new comm
            if g.comm_id == comm_id and not g.delivered:
                g.comm_id, g.create_comm = self.comms.acquire(
                    g.members, self.table.comm_ids_in_use())

    def _generate(self, w: WorkerRecord, now: float) -> list[GroupRecord]:
        assert self.policy is not None
        live = self.live()
        view = ClusterView(
            live=tuple(x.worker_id for x in live),
            idle=frozenset(x.worker_id for x in live if self.table.is_idle(x.worker_id)),
            request_counts={x.worker_id: x.request_count for x in live},
            node_of={x.worker_id: x.node for x in live},
            neighbours=self.neighbours,
            own_seconds={x.worker_id: x.own_seconds for x in live if x.own_seconds is not None},
        )
        created = []
        for members in self.policy.generate(w.worker_id, view, self.rng):
            initiator = w.worker_id if w.worker_id in members else members[0]
            created.append(self._add_group(members, initiator, now))
        return created

    def _arrive_listeners(self, created: list[GroupRecord], now: float) -> Deliveries:
        """Listening workers (adpsgd) arrive at once at the new groups that reach their
        head, so a partner's request completes the pair without waiting for them."""
        ready = []
        for group in created:
            for m in group.members:
                if self.workers[m].listening:
                    found = self.table.arrive(m)
                    if found is not None:
                        ready.append(found)
        return self._deliver(ready, now)

    def _add_group(self, members: tuple[int, ...], initiator: int, now: float) -> GroupRecord:
        group = self.table.add(members, initiator, now)
        group.comm_id, group.create_comm = self.comms.acquire(
            group.members, self.table.comm_ids_in_use())
        return group

    def _deliver(self, groups: list[GroupRecord], now: float) -> Deliveries:
        deliveries: Deliveries = {}
        for g in groups:
            self.recent_groups.append(g)
            for m in g.members:
                deliveries[m] = self._group_decision(self.workers[m], g)
                self._account_wait(self.workers[m], now)
                self.workers[m].state = WorkerState.REDUCING
                self.workers[m].listening = False
        return deliveries

    def _group_decision(self, w: WorkerRecord, g: GroupRecord) -> GroupDecision:
        more = False
        if w.round_target == g.group_id:
            w.round_target = None
        elif w.round_target is not None:
            more = True
        return GroupDecision(
            outcome=Outcome.GROUP,
            group=g,
            more=more,
            evictions=self.comms.take_evictions(w.worker_id),
        )

    def _decide(self, w: WorkerRecord, outcome: Outcome, now: float, detail: str) -> GroupDecision:
        self._account_wait(w, now)
        w.listening = False
        if w.state not in GONE:
            w.state = WorkerState.COMPUTING
        w.round_target = None
        return GroupDecision(outcome=outcome, detail=detail)

    def _account_wait(self, w: WorkerRecord, now: float) -> None:
        if w.wait_started_at is not None:
            self.pending_wait_seconds += now - w.wait_started_at
            w.wait_started_at = None

    # ------------------------------------------------------------------ stopping
    def checkpoint(
        self, worker_id: int, iteration: int, now: float, progress: Progress | None = None
    ) -> int:
        """Lock-step stop agreement: returns 0 to go on, else the common stop iteration.

        A worker calls this when its completed iterations are a multiple of the interval
        and is granted the next interval. Once the run stops, the stop iteration is the
        largest grant given, which every worker learns at or before reaching it."""
        w = self.worker(worker_id)
        if progress is not None:
            self._record_progress(w, progress, now)
        w.progress.iteration = max(w.progress.iteration, iteration)
        self._check_stop(now)
        if self.stopped:
            if self.stop_at_iteration == 0:
                grants = [x.checkpoint_grant for x in self.workers.values()]
                self.stop_at_iteration = max(max(grants), iteration, 1)
            return self.stop_at_iteration
        w.checkpoint_grant = max(w.checkpoint_grant, iteration + self.settings.checkpoint_interval)
        return 0

    def stop(self, reason: str, now: float) -> Deliveries:
        if self.stopped:
            return {}
        self.stopped = True
        self.stop_reason = reason
        if self.pairing is not None:
            self.pairing.clear()
        for g in self.table.cancel_all_undelivered():
            self.num_cancelled += 1
            del g
        return {
            w.worker_id: self._decide(w, Outcome.STOP, now, detail=reason)
            for w in self.live()
            if w.state is WorkerState.WAITING
        }

    def _check_stop(self, now: float) -> Deliveries:
        if self.stopped or self.started_at is None:
            return {}
        workers = list(self.workers.values())
        done = sum(w.progress.iteration for w in workers)
        planned = [w.progress.planned_iterations for w in self.live()]
        if planned and all(planned):
            budget = sum(planned) + sum(w.progress.iteration for w in workers if w.state in GONE)
            if done >= budget:
                return self.stop(f"iteration budget reached ({done} iterations)", now)
        if self.time_to_target is not None:
            return self.stop(f"target loss {self.settings.target_loss} reached", now)
        return {}

    def _record_progress(self, w: WorkerRecord, p: Progress, now: float) -> None:
        p.iteration = max(p.iteration, w.progress.iteration)
        self._update_own_seconds(w, p)
        w.progress = p
        if self.started_at is None or self.stopped:
            return  # after the stop, workers leave one by one: their mean is no training loss
        elapsed = now - self.started_at
        target = self.settings.target_loss
        watching_target = target > 0 and self.time_to_target is None
        curve_due = (not self.loss_curve
                     or elapsed - self.loss_curve[-1][0] >= LOSS_CURVE_MIN_STEP_SECONDS)
        if not (watching_target or curve_due):
            return  # progress arrives with every group request: keep the common case O(1)
        mean = self.mean_loss()
        if mean is None:
            return
        reached = watching_target and mean <= target
        mean_iterations = self.mean_iterations()
        if reached:
            self.time_to_target = elapsed
            self.iterations_to_target = mean_iterations
        # Rate-limited, except for the point that reaches the target: the curve must show it.
        if reached or curve_due:
            self.loss_curve.append((elapsed, mean, mean_iterations))

    @staticmethod
    def _update_own_seconds(w: WorkerRecord, p: Progress) -> None:
        """Measured between reports of different iterations only: a worker counts an
        iteration before its synchronisation and adds the iteration's time after it, so
        the report of iteration k holds the time of iterations 1..k-1, two such reports
        are whole iterations apart, and reports within an iteration (retries, heartbeats)
        see the time grow under the same iteration."""
        base_iteration, base_total = w.own_base
        total = p.compute_seconds + p.preduce_seconds
        if p.iteration <= base_iteration:
            return
        w.own_base = (p.iteration, total)
        if base_iteration < 2:  # from reports 1 to 2: iteration 1, which includes warm-up
            return
        own = (total - base_total) / (p.iteration - base_iteration)
        if own < 0:  # a restarted worker's counters: start over
            w.own_seconds = None
            return
        w.own_seconds = own if w.own_seconds is None else (
            OWN_SECONDS_SMOOTHING * own + (1 - OWN_SECONDS_SMOOTHING) * w.own_seconds)

    # ------------------------------------------------------------------ views
    def live(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.state not in GONE]

    def mean_loss(self) -> float | None:
        """Mean of the live workers' latest losses, once every live worker reported one."""
        losses = [w.progress.loss for w in self.live()]
        if not losses or any(loss != loss for loss in losses):  # NaN: not reported yet
            return None
        return sum(losses) / len(losses)

    def consensus_distance(self) -> float | None:
        """Estimated mean squared distance of the models to their average, from recent
        pairwise exchanges: for distinct workers i, j drawn uniformly,
        E||x_i - x_j||^2 = 2n/(n-1) * D. Gossip pairs are graph neighbours, which are
        closer than random pairs on sparse graphs, so this reads low there; it compares
        protocols on one graph fairly. None before any exchange."""
        if not self.pair_sq_distances:
            return None
        n = max(2, len(self.live()))
        mean = sum(self.pair_sq_distances) / len(self.pair_sq_distances)
        return (n - 1) / (2 * n) * mean

    def mean_iterations(self) -> float:
        """Iterations of an average worker: all iterations done, over the run's workers."""
        return sum(w.progress.iteration for w in self.workers.values()) / self.settings.num_workers

    def elapsed(self, now: float) -> float:
        return 0.0 if self.started_at is None else now - self.started_at

    def worker(self, worker_id: int) -> WorkerRecord:
        w = self.workers.get(worker_id)
        if w is None:
            raise CoordinatorError("NOT_FOUND", f"unknown worker id {worker_id}; register first")
        if w.state in GONE:
            raise CoordinatorError(
                "NOT_FOUND", f"worker {worker_id} is no longer part of the run ({w.state.value}"
                + (f": {w.error})" if w.error else ")")
            )
        return w
