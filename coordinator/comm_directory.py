"""The communicator directory: names every data-plane communicator and orders evictions.

Facts it is built on (docs/data-plane.md): `new_group` hangs for dynamic
groups; reusing a store prefix after a group was destroyed reads stale addresses and
hangs. So every member set gets a comm id that is never reused for anything else, the
group reply tells members whether to create or reuse it, and evictions are decided here
and delivered to every member, so all members' caches agree.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class CommDirectory:
    """Member set -> comm id, with a per-worker LRU bound on cached communicators.

    Invariants: a comm id names one member set forever and is never handed out again
    after eviction or retirement; a comm in use by an unfinished group is never evicted.
    Each worker's comms are kept in its own recency order (a use moves the comm to the
    end for every member), so an eviction looks at that worker's comms only, never at
    every comm of the run.
    """

    max_comms_per_worker: int = 64
    _next_id: int = 1
    _by_members: dict[tuple[int, ...], int] = field(default_factory=dict)
    _members: dict[int, tuple[int, ...]] = field(default_factory=dict)
    _per_worker: dict[int, list[int]] = field(default_factory=dict)
    """Worker -> its cached comm ids, least recently used first. A list: at most
    max_comms_per_worker ids, moved in O(that) on use, at an eighth of the memory of an
    ordered dict (64 comms x 100,000 workers)."""
    _evictions: dict[int, list[int]] = field(default_factory=dict)  # worker -> comm ids
    num_created: int = 0
    num_reused: int = 0

    def __post_init__(self) -> None:
        if self.max_comms_per_worker < 1:
            raise ValueError("max_comms_per_worker must be at least 1")

    def acquire(self, members: tuple[int, ...], in_use: Collection[int]) -> tuple[int, bool]:
        """Comm id for `members` and whether members must create it (True) or reuse it."""
        comm_id = self._by_members.get(members)
        if comm_id is not None:
            for m in members:
                cached = self._per_worker[m]
                cached.remove(comm_id)  # to the end: most recently used
                cached.append(comm_id)
            self.num_reused += 1
            return comm_id, False
        comm_id = self._next_id
        self._next_id += 1
        self._by_members[members] = comm_id
        self._members[comm_id] = members
        for m in members:
            self._per_worker.setdefault(m, []).append(comm_id)
        self.num_created += 1
        self._evict_over_budget(members, in_use, comm_id)
        return comm_id, True

    def retire(self, comm_id: int) -> None:
        """Forget a comm (its group failed): members drop it; the set gets a fresh id."""
        members = self._members.pop(comm_id, None)
        if members is None:
            return
        del self._by_members[members]
        for m in members:
            cached = self._per_worker.get(m)
            if cached is not None and comm_id in cached:
                cached.remove(comm_id)
            self._evictions.setdefault(m, []).append(comm_id)

    def retire_worker(self, worker: int) -> None:
        """Retire every comm containing a worker that left."""
        for comm_id in sorted(self._per_worker.pop(worker, [])):
            self.retire(comm_id)
        self._evictions.pop(worker, None)

    def take_evictions(self, worker: int) -> list[int]:
        """Comm ids the worker must drop before its next group (delivered once)."""
        return self._evictions.pop(worker, [])

    def cached_by(self, worker: int) -> set[int]:
        return set(self._per_worker.get(worker, ()))

    def _evict_over_budget(self, members: Iterable[int], in_use: Collection[int],
                           new: int) -> None:
        for m in members:
            cached = self._per_worker.get(m, [])
            while len(cached) > self.max_comms_per_worker:
                victim = next((c for c in cached if c != new and c not in in_use), None)
                if victim is None:
                    break  # every cached comm is in use; the bound is exceeded briefly
                self.retire(victim)
