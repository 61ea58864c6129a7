"""Conflict detection for P-Reduce groups: group buffers, the lock vector, the global order.

Pure code: no threads, sockets or clock (times are passed in). The gRPC shell wraps it.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field


def _nothing(worker: int) -> None:
    """The default buffer-change hook."""


class GroupState(enum.Enum):
    PENDING = "pending"  # some member still has an earlier group to finish
    EXECUTING = "executing"  # locks held: the group heads every member's buffer


@dataclass(kw_only=True)
class GroupRecord:
    """One P-Reduce group from creation until every member has released it."""

    group_id: int
    members: tuple[int, ...]
    initiator: int
    created_at: float
    comm_id: int = 0
    create_comm: bool = False
    state: GroupState = GroupState.PENDING
    arrived: set[int] = field(default_factory=set)
    released: set[int] = field(default_factory=set)
    delivered: bool = False
    heal_donor: int | None = None
    """A heal group: its other member copies this worker's model instead of averaging."""

    @property
    def deliverable(self) -> bool:
        return (
            self.state is GroupState.EXECUTING
            and not self.delivered
            and len(self.arrived) == len(self.members)
        )


class GroupTable:
    """Group Buffers plus the lock vector of the Ripples Group Generator (paper §4.1, §5.1).

    Every worker has a buffer: the ids of the unfinished groups it belongs to, in creation
    order. Group ids are the one global order. A group acquires the locks of its members
    (the paper's lock vector) exactly when it heads the buffer of every member; until then
    it waits in the pending queue. Consequences, which the property tests check:

    - no worker is inside two executing groups (an executing group heads its buffer);
    - overlapping groups execute in id order (a buffer is served front to back);
    - no deadlock: the smallest unfinished id heads all its members' buffers, so it can
      always execute once its members ask for it; a worker waits only on smaller ids.

    A group is delivered once it executes and every member has asked for it (arrived), so
    all members enter the collective together and nobody waits inside it for a late peer.
    Each member releases its own lock when it acknowledges (paper Fig. 8, step 8).
    """

    def __init__(self) -> None:
        self._next_id = 1
        self._groups: dict[int, GroupRecord] = {}
        self._buffers: dict[int, list[int]] = {}
        """Worker -> its unfinished groups' ids (a few at most: lists, not deques, which
        take 600 bytes each whatever they hold)."""
        self.num_formed = 0
        self.num_conflicts = 0
        self.on_idle: Callable[[int], None] = _nothing
        """Called with a worker whose buffer just emptied."""
        self.on_busy: Callable[[int], None] = _nothing
        """Called with a worker whose buffer just got its first group."""
        self._comms_in_use: Counter[int] = Counter()
        """Comm id -> unfinished groups that use it (`set_comm` keeps it)."""

    # ---------------------------------------------------------------- queries
    def buffer(self, worker: int) -> tuple[int, ...]:
        return tuple(self._buffers.get(worker, ()))

    def is_idle(self, worker: int) -> bool:
        """True when the worker belongs to no unfinished group (its buffer is empty)."""
        return not self._buffers.get(worker)

    def head(self, worker: int) -> GroupRecord | None:
        buf = self._buffers.get(worker)
        return self._groups[buf[0]] if buf else None

    def get(self, group_id: int) -> GroupRecord | None:
        return self._groups.get(group_id)

    def unfinished(self) -> list[GroupRecord]:
        return [self._groups[g] for g in sorted(self._groups)]

    @property
    def num_executing(self) -> int:
        return sum(g.state is GroupState.EXECUTING for g in self._groups.values())

    @property
    def num_pending(self) -> int:
        return sum(g.state is GroupState.PENDING for g in self._groups.values())

    def comm_ids_in_use(self) -> Collection[int]:
        """The comm ids of unfinished groups (a live view: O(1))."""
        return self._comms_in_use.keys()

    def set_comm(self, group: GroupRecord, comm_id: int, create: bool) -> None:
        """Give an unfinished group its communicator (its comm id counts as in use)."""
        if group.group_id in self._groups:
            self._uncount(group.comm_id)
            self._comms_in_use[comm_id] += 1
        group.comm_id, group.create_comm = comm_id, create

    def _uncount(self, comm_id: int) -> None:
        left = self._comms_in_use[comm_id] - 1
        if left > 0:
            self._comms_in_use[comm_id] = left
        else:
            del self._comms_in_use[comm_id]

    # ---------------------------------------------------------------- events
    def next_group_id(self) -> int:
        """Take a group id for a group kept outside the table (the final average)."""
        self._next_id += 1
        return self._next_id - 1

    def add(self, members: Iterable[int], initiator: int, now: float) -> GroupRecord:
        """Create a group, append it to its members' buffers and try to lock it."""
        ordered = tuple(sorted(set(members)))
        if initiator not in ordered:
            raise ValueError(f"group {ordered} must contain its initiator {initiator}")
        if len(ordered) < 2:
            raise ValueError(f"a group needs at least two members, got {ordered}")
        group = GroupRecord(
            group_id=self._next_id, members=ordered, initiator=initiator, created_at=now
        )
        self._next_id += 1
        if any(self._buffers.get(m) for m in ordered):
            self.num_conflicts += 1  # overlaps an unfinished group: serialised behind it
        self._groups[group.group_id] = group
        self._comms_in_use[group.comm_id] += 1
        for m in ordered:
            buf = self._buffers.get(m)
            if buf is None:
                buf = self._buffers[m] = []
            if not buf:
                self.on_busy(m)
            buf.append(group.group_id)
        self.num_formed += 1
        self._try_lock(group)
        return group

    def arrive(self, worker: int) -> GroupRecord | None:
        """The worker asks for its head group; returns it if it became deliverable."""
        group = self.head(worker)
        if group is None:
            return None
        group.arrived.add(worker)
        if group.deliverable:
            group.delivered = True
            return group
        return None

    def release(self, worker: int, group_id: int) -> list[GroupRecord]:
        """The worker acknowledges a delivered group; returns groups that became deliverable.

        Releasing an unknown group (already cancelled) is a no-op, so that a member whose
        group was cancelled under it can still acknowledge safely.
        """
        group = self._groups.get(group_id)
        if group is None or worker not in group.members or worker in group.released:
            return []
        if not group.delivered:
            raise ValueError(f"worker {worker} released group {group_id} before it executed")
        group.released.add(worker)
        buf = self._buffers[worker]
        assert buf[0] == group_id, "a delivered group heads its members' buffers"
        del buf[0]
        if not buf:
            self.on_idle(worker)
        if len(group.released) == len(group.members):
            del self._groups[group_id]
            self._uncount(group.comm_id)
        return self._lock_heads([worker])

    def cancel_where(self, worker: int) -> tuple[list[GroupRecord], list[GroupRecord]]:
        """Cancel every unfinished group containing `worker` (it left or its lease expired).

        Returns (cancelled groups, groups that became deliverable as a result).
        """
        cancelled = [g for g in self.unfinished() if worker in g.members]
        ready = self._cancel(cancelled)  # the worker's buffer is empty now
        self._buffers.pop(worker, None)
        return cancelled, ready

    def cancel(self, group: GroupRecord) -> list[GroupRecord]:
        """Cancel one group (its members stay); returns the groups that became
        deliverable as a result."""
        return self._cancel([group])

    def cancel_all_undelivered(self) -> list[GroupRecord]:
        """Cancel every group not yet delivered (the run is stopping)."""
        cancelled = [g for g in self.unfinished() if not g.delivered]
        for g in cancelled:
            self._drop(g)
        return cancelled

    # ---------------------------------------------------------------- internals
    def _cancel(self, groups: list[GroupRecord]) -> list[GroupRecord]:
        touched: set[int] = set()
        for g in groups:
            self._drop(g)
            touched.update(g.members)
        return self._lock_heads(sorted(touched))

    def _drop(self, group: GroupRecord) -> None:
        del self._groups[group.group_id]
        self._uncount(group.comm_id)
        for m in group.members:
            buf = self._buffers.get(m)
            if buf is not None and group.group_id in buf:
                buf.remove(group.group_id)
                if not buf:
                    self.on_idle(m)

    def _try_lock(self, group: GroupRecord) -> bool:
        if group.state is GroupState.PENDING and all(
            self._buffers[m][0] == group.group_id for m in group.members
        ):
            group.state = GroupState.EXECUTING
            return True
        return False

    def _lock_heads(self, workers: Iterable[int]) -> list[GroupRecord]:
        ready = []
        for w in workers:
            group = self.head(w)
            if group is not None and self._try_lock(group) and group.deliverable:
                group.delivered = True
                ready.append(group)
        return ready

    def check_invariants(self) -> None:
        """Raise AssertionError if the table broke one of its invariants (for tests)."""
        locked: dict[int, int] = {}
        for g in self._groups.values():
            assert g.initiator in g.members
            if g.state is GroupState.EXECUTING:
                # A member that released its lock has left the group (per-member release).
                for m in (m for m in g.members if m not in g.released):
                    assert m not in locked, f"worker {m} in executing {locked[m]} and {g.group_id}"
                    locked[m] = g.group_id
                    assert self._buffers[m][0] == g.group_id
        for w, buf in self._buffers.items():
            assert list(buf) == sorted(buf), f"buffer of {w} out of order: {list(buf)}"
            for gid in buf:
                assert w in self._groups[gid].members
