"""The Group Generator's service (pure code): group requests, deliveries and releases.

A worker asks for its next group; the protocol's group policy or pairing (its Role's
objects) decides the members, the GroupTable orders overlapping groups, and the reply goes to
every member at once when the group may execute and every member has asked for it
(`Deliveries`: the decisions this event completes for other waiting workers). Failed
groups retire their communicator; a departed member cancels its groups.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from ripples.coordinator.comm_directory import CommDirectory
from ripples.coordinator.decisions import Deliveries, GroupDecision, Outcome
from ripples.coordinator.errors import CoordinatorError
from ripples.coordinator.groups import GroupRecord, GroupTable
from ripples.coordinator.pairing import FifoPairing
from ripples.coordinator.policies import ClusterView, GroupPolicy, straggler_bound
from ripples.coordinator.progress import ProgressTracker
from ripples.coordinator.registry import GONE, Registry, WorkerRecord, WorkerState
from ripples.coordinator.run_graph import RunGraph
from ripples.protocols.spec import Role, SettingsLookup

_T = TypeVar("_T")


class _Field(Mapping[int, _T]):
    """One attribute of the member workers' records as a read-only mapping (no copy)."""

    def __init__(self, records: Mapping[int, WorkerRecord], members: set[int],
                 read: Callable[[WorkerRecord], _T | None]) -> None:
        self._records, self._members, self._read = records, members, read

    def __getitem__(self, worker: int) -> _T:
        if worker not in self._members:
            raise KeyError(worker)
        value = self._read(self._records[worker])
        if value is None:
            raise KeyError(worker)
        return value

    def __iter__(self) -> Iterator[int]:
        return (w for w in self._members if self._read(self._records[w]) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _RecordFields:
    """The policies' per-worker mappings, read straight from the records."""

    def __init__(self, records: Mapping[int, WorkerRecord], members: set[int]) -> None:
        self.request_counts: Mapping[int, int] = _Field(records, members,
                                                        lambda w: w.request_count)
        self.node_of: Mapping[int, int] = _Field(records, members, lambda w: w.node)
        self.own_seconds: Mapping[int, float] = _Field(records, members,
                                                       lambda w: w.own_seconds)


class GroupService:
    """Groups of one run: the policy or pairing, the table, the communicator directory."""

    def __init__(self, role: Role, settings: SettingsLookup[Any], *,
                 registry: Registry, graph: Callable[[], RunGraph],
                 progress: ProgressTracker, rng: random.Random,
                 max_comms_per_worker: int) -> None:
        self.registry = registry
        self._graph = graph
        self.progress = progress
        self.rng = rng
        self.policy: GroupPolicy | None = (
            role.group_policy(settings) if role.group_policy is not None else None)
        self.pairing: FifoPairing | None = role.pairing() if role.pairing is not None else None
        self.table = GroupTable()
        self.table.on_idle = self._became_idle
        self.table.on_busy = self._became_busy
        self.comms = CommDirectory(max_comms_per_worker=max_comms_per_worker)
        # The policies' view, kept up to date instead of rebuilt per request: the live,
        # healed workers (id order; rebuilt when the live set changes or a worker heals),
        # those of them with an empty buffer, and the smart policy's straggler bound.
        self._members_key: tuple[int, int] = (-1, -1)
        self._members: list[int] = []
        self._member_set: set[int] = set()
        self._idle: set[int] = set()
        self._num_healed = 0  # heals so far (part of the members' key)
        self._bound: float | None = None
        self._bound_age = 0  # generations since the bound was computed
        self._bound_stale = True
        self._records = _RecordFields(registry.workers, self._member_set)
        self.recent_groups: deque[GroupRecord] = deque(maxlen=32)
        self.num_pending_waits = 0
        self.pending_wait_seconds = 0.0
        self.num_cancelled = 0
        self.num_failed = 0

    # ------------------------------------------------------------------ requests
    def request(self, w: WorkerRecord, now: float, *,
                listen: bool) -> tuple[GroupDecision | None, Deliveries]:
        """`w` asks for its next group (validated by the core; the run goes on)."""
        worker_id = w.worker_id
        deliveries: Deliveries = {}
        head = self.table.head(worker_id)
        if head is not None and head.delivered and worker_id not in head.released:
            return self._group_decision(w, head), deliveries  # a retried request
        if not w.healed:
            return self._heal(w, now)
        if self.pairing is not None and not listen and self.table.head(worker_id) is not None:
            # Paired workers execute at once: a group waiting in its buffer is a heal
            # group it donates to, which it meets before any new pairing.
            return self._arrive(w, now)
        if self.pairing is not None or listen:
            return self._offer_pair(w, now) if self.pairing else self._listen(w, now)
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
            return self.decide(w, Outcome.NO_GROUP, now, detail="no eligible peer"), deliveries
        decision, more = self._arrive(w, now)
        deliveries.update(more)
        return decision, deliveries

    def _arrive(self, w: WorkerRecord, now: float) -> tuple[GroupDecision | None, Deliveries]:
        """`w` waits at the head of its buffer: its decision once that group can execute
        (None: it waits), and the decisions for the other members that this completes."""
        w.state = WorkerState.WAITING
        w.wait_started_at = now
        ready = self.table.arrive(w.worker_id)
        if ready is None:
            self.num_pending_waits += 1
            return None, {}
        deliveries = self._deliver([ready], now)
        return deliveries.pop(w.worker_id), deliveries

    def _heal(self, w: WorkerRecord, now: float) -> tuple[GroupDecision | None, Deliveries]:
        """A replacement's requests before it healed: its heal group {donor, w}, made on
        the first request (and again after a failed or cancelled one). The donor is the
        healed live worker that donated least (then the lowest id): joiners spread over
        donors. The donor meets the group in its own buffer at its next request."""
        deliveries: Deliveries = {}
        head = self.table.head(w.worker_id)
        if head is None:
            healed = [x for x in self.registry.live() if x.healed and x is not w]
            neighbours = set(self.neighbours_of(w.worker_id))
            donors = [x for x in healed if x.worker_id in neighbours] or healed
            if not donors:
                return self.decide(w, Outcome.NO_GROUP, now, detail="no live peer to heal "
                                   "from"), {}
            donor = min(donors, key=lambda x: (x.donations, x.worker_id))
            donor.donations += 1
            head = self._add_group((donor.worker_id, w.worker_id), w.worker_id, now)
            head.heal_donor = donor.worker_id
            if self.pairing is not None and self.pairing.withdraw(donor.worker_id):
                # A donor waiting for a partner takes the heal group instead.
                found = self.table.arrive(donor.worker_id)
                deliveries.update(self._deliver([found] if found else [], now))
            deliveries.update(self._arrive_listeners([head], now))  # a listening donor
        decision, more = self._arrive(w, now)
        deliveries.update(more)
        return decision, deliveries

    def _offer_pair(self, w: WorkerRecord, now: float) -> tuple[GroupDecision | None, Deliveries]:
        """The worker is available; pair it first-in-first-out with a neighbour."""
        assert self.pairing is not None
        w.request_count += 1
        w.state = WorkerState.WAITING
        w.wait_started_at = now
        self.pairing.withdraw(w.worker_id)  # defensive: one place in the queue per worker
        # On a complete graph every queued worker is a live neighbour (a worker leaves
        # the queue when it leaves the run): no list of all n to build per request.
        complete = self._graph().neighbours is None
        neighbours = None if complete else self.neighbours_of(w.worker_id)
        if (self.registry.num_live < 2) if complete else not neighbours:
            return self.decide(w, Outcome.NO_GROUP, now, detail="no live neighbour"), {}
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
        """The passive side of a pairing: arrive at the head of the buffer, or wait until a
        partner's group lands in it (see _generate)."""
        w.state = WorkerState.WAITING
        w.wait_started_at = now
        ready = self.table.arrive(w.worker_id)
        if ready is None:
            w.listening = True
            return None, {}
        deliveries = self._deliver([ready], now)
        return deliveries.pop(w.worker_id), deliveries

    def abandon_wait(self, w: WorkerRecord, now: float) -> GroupDecision:
        """The caller's server-side wait ran out: forget its arrival, tell it to retry."""
        worker_id = w.worker_id
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

    def release(self, w: WorkerRecord, group_id: int, ok: bool, error: str, now: float,
                squared_distance: float | None = None) -> Deliveries:
        worker_id = w.worker_id
        if squared_distance is not None and not squared_distance >= 0:  # also rejects NaN
            raise CoordinatorError("INVALID_ARGUMENT",
                                   f"squared_distance must be >= 0, got {squared_distance}")
        group = self.table.get(group_id)
        if group is not None and worker_id in group.members and not group.delivered:
            raise CoordinatorError(
                "FAILED_PRECONDITION", f"group {group_id} was not delivered to worker {worker_id}"
            )
        if squared_distance is not None and ok:
            self.progress.add_pair_distance(squared_distance)
        if ok and group is not None and group.heal_donor is not None and not w.healed:
            w.healed = True  # the donor was healed already; the joiner is now
            self._num_healed += 1
        if not ok:
            self.num_failed += 1
            if group is not None:
                self._retire_comm(group.comm_id)
            w.error = f"group {group_id} failed: {error}"
        ready = self.table.release(worker_id, group_id)
        if w.state is WorkerState.REDUCING:
            w.state = WorkerState.COMPUTING
        return self._deliver(ready, now)

    # ------------------------------------------------------------------ membership events
    def remove(self, w: WorkerRecord, state: WorkerState, now: float) -> Deliveries:
        """`w` is gone: cancel its groups and tell the peers that waited on them."""
        stranded: Deliveries = {}
        if self.pairing is not None:
            self.pairing.withdraw(w.worker_id)
            stranded = self._strand_isolated(w.worker_id, now,
                                             f"{w.name} {state.value}")
        self.comms.retire_worker(w.worker_id)  # before the deliveries, which carry evictions
        deliveries = self._cancel(lambda: self.table.cancel_where(w.worker_id), now,
                                  f"{w.name} {state.value}")
        return {**stranded, **deliveries}

    def _strand_isolated(self, departed: int, now: float, why: str) -> Deliveries:
        """Pairing on a graph: a queued neighbour of `departed` whose last live neighbour
        it was can never be paired; answer it NO_GROUP (it trains on alone and asks
        again later, as a worker without live neighbours is answered when it asks)
        rather than leave it waiting for nobody."""
        assert self.pairing is not None
        graph = self._graph().neighbours
        if graph is None:
            return {}  # complete: any queued worker pairs with the next one to come
        around = graph.get(departed)  # (a graph rebuilt without it: every queued worker)
        queued = [v for v in (self.pairing.waiting() if around is None else around)
                  if v in self.pairing]
        if not queued:
            return {}
        is_live = self.registry.is_live
        deliveries: Deliveries = {}
        for waiting in queued:
            if not any(v != departed and is_live(v) for v in graph.get(waiting, ())):
                self.pairing.withdraw(waiting)
                peer = self.registry.worker(waiting)
                deliveries[waiting] = self.decide(peer, Outcome.NO_GROUP, now, detail=(
                    f"no live neighbour: {why}"))
        return deliveries

    def _cancel(self, cancel: Callable[[], tuple[list[GroupRecord], list[GroupRecord]]],
                now: float, why: str) -> Deliveries:
        """Run `cancel` (a table cancellation); tell each waiting peer whose group went,
        and deliver the groups that became ready."""
        deliveries: Deliveries = {}
        # The group each waiting peer arrived at (its head) before the cancellation.
        awaited = {}
        for peer in self.registry.live():
            head = self.table.head(peer.worker_id)
            if peer.state is WorkerState.WAITING and head is not None:
                awaited[peer.worker_id] = head.group_id
        cancelled, ready = cancel()
        self.num_cancelled += len(cancelled)
        cancelled_ids = {g.group_id for g in cancelled}
        for peer in self.registry.live():
            if peer.round_target in cancelled_ids:
                peer.round_target = None  # its round now ends with the group it waits on
            if awaited.get(peer.worker_id) in cancelled_ids:
                deliveries[peer.worker_id] = self.decide(peer, Outcome.CANCELLED, now, detail=(
                    f"group {awaited[peer.worker_id]} cancelled: {why}"))
        deliveries.update(self._deliver(ready, now))
        return deliveries

    def stop(self, reason: str, now: float) -> Deliveries:
        """The run stopped: no group forms any more; waiting workers are told STOP."""
        if self.pairing is not None:
            self.pairing.clear()
        self.num_cancelled += len(self.table.cancel_all_undelivered())
        return {w.worker_id: self.decide(w, Outcome.STOP, now, detail=reason)
                for w in self.registry.live() if w.state is WorkerState.WAITING}

    def final_group(self, members: tuple[int, ...], now: float) -> GroupRecord:
        """A group outside the table (the run has stopped: nothing else forms) for the
        final average; its comm id is the directory's, so it never collides."""
        group = GroupRecord(group_id=self.table.next_group_id(), members=members,
                            initiator=members[0], created_at=now)
        self.table.set_comm(group, *self.comms.acquire(members, self.table.comm_ids_in_use()))
        return group

    # ------------------------------------------------------------------ helpers
    def neighbours_of(self, worker_id: int) -> tuple[int, ...]:
        return self._graph().neighbours_of(worker_id,
                                           [w.worker_id for w in self.registry.live()])

    def _retire_comm(self, comm_id: int) -> None:
        """A collective on the comm failed: members drop it, queued groups get a fresh one."""
        self.comms.retire(comm_id)
        for g in self.table.unfinished():  # in id order: the first one creates the new comm
            if g.comm_id == comm_id and not g.delivered:
                self.table.set_comm(g, *self.comms.acquire(g.members,
                                                            self.table.comm_ids_in_use()))

    # ------------------------------------------------------------------ the policies' view
    def _sync_members(self) -> None:
        """Rebuild the member index once the live set changed or a worker healed: O(n)
        then, O(1) per request otherwise."""
        key = (self.registry.version, self._num_healed)
        if key == self._members_key:
            return
        self._members_key = key
        members = [x.worker_id for x in self.registry.live_by_id().values() if x.healed]
        self._members[:] = members
        self._member_set.clear()
        self._member_set.update(members)
        self._idle = {m for m in members if self.table.is_idle(m)}
        self._bound_stale = True  # recompute it at the next generation

    def _became_idle(self, worker: int) -> None:
        if worker in self._member_set:
            self._idle.add(worker)

    def _became_busy(self, worker: int) -> None:
        self._idle.discard(worker)

    def _straggler_bound(self) -> float | None:
        """The smart policy's bound, a median over every member: computed afresh after
        every n / 64 generations (every one below 64 workers) and on membership changes.
        Own seconds are moving averages: the bound moves slowly."""
        self._bound_age += 1
        if self._bound_stale or self._bound_age >= max(1, len(self._members) // 64):
            self._bound_age, self._bound_stale = 0, False
            self._bound = straggler_bound(self._records.own_seconds, self._member_set)
        return self._bound

    def _generate(self, w: WorkerRecord, now: float) -> list[GroupRecord]:
        assert self.policy is not None
        self._sync_members()
        records = self._records
        view = ClusterView(
            live=self._members, live_set=self._member_set, idle=self._idle,
            request_counts=records.request_counts, node_of=records.node_of,
            neighbours=self._graph().neighbours, own_seconds=records.own_seconds,
            straggler_bound=(self._straggler_bound() if self.policy.uses_straggler_bound
                             else None),
        )
        created = []
        for members in self.policy.generate(w.worker_id, view, self.rng):
            initiator = w.worker_id if w.worker_id in members else members[0]
            created.append(self._add_group(members, initiator, now))
        return created

    def _arrive_listeners(self, created: list[GroupRecord], now: float) -> Deliveries:
        """Listening workers arrive at once at the new groups that reach their
        head, so a partner's request completes the pair without waiting for them."""
        ready = []
        workers = self.registry.workers
        for group in created:
            for m in group.members:
                if workers[m].listening:
                    found = self.table.arrive(m)
                    if found is not None:
                        ready.append(found)
        return self._deliver(ready, now)

    def _add_group(self, members: tuple[int, ...], initiator: int, now: float) -> GroupRecord:
        group = self.table.add(members, initiator, now)
        self.table.set_comm(group, *self.comms.acquire(group.members,
                                                        self.table.comm_ids_in_use()))
        return group

    def _deliver(self, groups: list[GroupRecord], now: float) -> Deliveries:
        """Hand executable groups to their members, who all wait for them. A group whose
        members average different tensors (one's optimizer state joined its buffer, a
        peer's not yet: docs/data-plane.md rule 7) is cancelled instead: a collective must
        never join buffers of two sizes. Every member has arrived, so its schema is the
        one it would average with."""
        deliveries: Deliveries = {}
        workers = self.registry.workers
        for g in groups:
            # A heal copies the model part only, which the schema check at the start
            # compared already: the donor's optimizer state may be in its buffer.
            if g.heal_donor is None and len({workers[m].schema_digest for m in g.members}) > 1:
                deliveries.update(self._cancel_mixed(g, now))
                continue
            self.recent_groups.append(g)
            for m in g.members:
                deliveries[m] = self._group_decision(workers[m], g)
                self._account_wait(workers[m], now)
                workers[m].state = WorkerState.REDUCING
                workers[m].listening = False
        return deliveries

    def _cancel_mixed(self, g: GroupRecord, now: float) -> Deliveries:
        self.num_cancelled += 1
        if g.create_comm:  # nobody created its communicator: queued groups get a fresh one
            self._retire_comm(g.comm_id)  # before the cancel locks (delivers) queued groups
        ready = self.table.cancel(g)
        workers = self.registry.workers
        deliveries = {m: self.decide(workers[m], Outcome.CANCELLED, now, detail=(
            f"group {g.group_id} cancelled: its members average different tensors (an "
            "optimizer state has not joined every member's buffer yet)")) for m in g.members}
        deliveries.update(self._deliver(ready, now))
        return deliveries

    def _group_decision(self, w: WorkerRecord, g: GroupRecord) -> GroupDecision:
        more = False
        if w.round_target == g.group_id:
            w.round_target = None
        elif w.round_target is not None:
            more = True
        return GroupDecision(outcome=Outcome.GROUP, group=g, more=more,
                             evictions=self.comms.take_evictions(w.worker_id))

    def decide(self, w: WorkerRecord, outcome: Outcome, now: float, detail: str) -> GroupDecision:
        """A decision other than a group (stop, cancelled, no group) for worker `w`."""
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
