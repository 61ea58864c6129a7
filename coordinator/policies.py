"""Group generation policies of the Ripples Group Generator (paper §4.1 and §5).

Pure code: a policy sees a read-only view of the cluster and a seeded RNG, and returns
the member sets of the groups to create. The GroupTable serialises them.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol


@dataclass(frozen=True, kw_only=True)
class ClusterView:
    """What a policy may look at when a worker asks for a group. The coordinator hands
    its own up-to-date indexes (read only), so a view costs O(1) to make however many
    workers there are; a policy's work is then bounded by what it generates."""

    live: Sequence[int]  # workers taking part, sorted
    idle: Collection[int]  # live workers with an empty group buffer
    request_counts: Mapping[int, int]  # slowdown counters c_w (requests so far)
    node_of: Mapping[int, int]  # worker -> node index
    neighbours: Mapping[int, Sequence[int]] | None = None  # None: complete graph
    own_seconds: Mapping[int, float] = dataclasses.field(default_factory=dict)
    """Recent seconds per iteration that a worker spends on its own (compute and
    collectives, not waiting for peers); absent until it has reported two iterations."""
    live_set: Collection[int] = ()
    """`live` for membership tests (default: a set made of it)."""
    straggler_bound: float | None | Literal["unknown"] = "unknown"
    """The smart policy's bound on own seconds, if the coordinator keeps it (it is a
    median over every live worker: recomputed now and then, not at every request)."""

    def __post_init__(self) -> None:
        if not self.live_set:
            object.__setattr__(self, "live_set", frozenset(self.live))


class GroupPolicy(Protocol):
    """Decides which groups to create when `initiator` starts a new synchronisation round."""

    name: str
    # True: the initiator executes its buffer up to and including the group its request
    # created (random GG: every request makes a group, Fig. 7 step 3). False: it executes
    # only the head of its buffer (Group Buffer, §5.1).
    drain_to_own_group: bool
    # True: the view carries the straggler bound (a median over every live worker, which
    # the coordinator keeps up to date only for the policies that read it).
    uses_straggler_bound: bool

    def generate(
        self, initiator: int, view: ClusterView, rng: random.Random
    ) -> list[tuple[int, ...]]: ...


def _candidates(initiator: int, view: ClusterView) -> list[int]:
    live = view.live_set
    if view.neighbours is None:
        return [w for w in view.live if w != initiator]
    return sorted(w for w in view.neighbours.get(initiator, ()) if w in live and w != initiator)


REJECTION_TRIES = 16
"""Draws per wanted member before `sample_peers` falls back to listing every candidate."""


def sample_peers(initiator: int, view: ClusterView, k: int, rng: random.Random,
                 accept: Callable[[int], bool] = lambda w: True) -> list[int]:
    """Up to `k` distinct peers of `initiator`, uniformly among the candidates (live
    neighbours) that `accept` takes, in draw order. On a complete graph it draws live
    workers at random and rejects the others: O(k) expected while most are acceptable,
    instead of listing all n (the coordinator at 10,000 workers). After
    REJECTION_TRIES x k draws it lists the candidates and samples those (exact)."""
    if view.neighbours is None and view.live:
        live = view.live
        chosen: list[int] = []
        for _ in range(REJECTION_TRIES * k):
            if len(chosen) == k:
                return chosen
            w = live[rng.randrange(len(live))]
            if w != initiator and w not in chosen and accept(w):
                chosen.append(w)
        if len(chosen) == k:
            return chosen
    eligible = [w for w in _candidates(initiator, view) if accept(w)]
    return rng.sample(eligible, min(k, len(eligible)))


@dataclass(kw_only=True)
class RandomPolicy:
    """Random GG (Fig. 7, Fig. 8): the initiator plus group_size-1 members drawn uniformly,
    from its neighbours when a topology is set. Every request creates a group; overlaps are
    serialised by the GroupTable's lock vector and pending queue."""

    group_size: int = 3
    name: str = "random"
    drain_to_own_group: bool = True
    uses_straggler_bound: bool = False

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")

    def generate(
        self, initiator: int, view: ClusterView, rng: random.Random
    ) -> list[tuple[int, ...]]:
        chosen = sample_peers(initiator, view, self.group_size - 1, rng)
        return [tuple(sorted([initiator, *chosen]))] if chosen else []


STRAGGLER_FACTOR = 2.0
"""Smart GG: a worker whose own time per iteration exceeds this many times the median
joins no division it did not initiate (a 2x slower worker still averages with others)."""


@dataclass(kw_only=True)
class SmartPolicy:
    """Smart GG (§5): Group Buffer, Global Division, slowdown filter, Inter-Intra phases.

    Called only when the initiator's buffer is empty (otherwise the GroupTable serves the
    buffer's head). Global Division randomly partitions the idle workers that pass the
    slowdown filter into non-conflicting groups (balanced, at most group_size each).

    The filter is the paper's `c_i - c_w < C_thres` (c_i the initiator's request counter)
    until workers' own speeds are known (`ClusterView.own_seconds`); from then on a worker
    passes exactly when its own time per iteration is known and at most
    STRAGGLER_FACTOR x the median. Counters alone trap fast workers: one that waited for
    a straggler lags in requests as much as the straggler, so it is filtered out of every
    fast division for good (its counter never catches up: everyone requests once per
    iteration) and the straggler passes *its* filter, so it keeps initiating divisions
    with the straggler and waiting for its slow iterations (measured with one worker 10x
    slower: two of seven fast workers spent half the run waiting). With Inter-Intra, each
    division inserts two groups per worker: an Inter group (one head worker per node
    divided among nodes, the other workers in local groups) then an Intra group (all
    eligible workers of a node).

    When the initiator is the only eligible idle worker, it is grouped with random
    filter-passing workers that are busy; the group then waits behind their buffers, so
    every request still yields a group containing its initiator (Fig. 7, step 3).
    """

    group_size: int = 3
    c_thres: int = 5
    inter_intra: bool = False
    name: str = "smart"
    drain_to_own_group: bool = False
    uses_straggler_bound: bool = True

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if self.c_thres < 1:
            raise ValueError(f"c_thres must be at least 1, got {self.c_thres}")

    def passes_filter(self, initiator: int, worker: int, view: ClusterView) -> bool:
        return worker == initiator or self._passes(initiator, worker, view,
                                                   self._straggler_bound(view))

    def _passes(self, initiator: int, worker: int, view: ClusterView,
                bound: float | None) -> bool:
        own = view.own_seconds.get(worker)
        if bound is None or own is None:
            # Nobody's speed is known yet, or not this worker's (its first iterations, a
            # replacement): the paper's counters. Refusing every worker of unknown speed
            # instead left the first workers measured with no eligible idle peer while
            # the others' speeds came in, one report at a time: each of their requests
            # made one group with busy workers, whose waits desynchronised the whole
            # run (the simulator's 64-190-worker runs waited 37-47% of the time).
            counts = view.request_counts
            return counts[initiator] - counts[worker] < self.c_thres
        return own <= bound

    @staticmethod
    def _straggler_bound(view: ClusterView) -> float | None:
        if view.straggler_bound != "unknown":
            return view.straggler_bound
        return straggler_bound(view.own_seconds, view.live_set)

    def generate(
        self, initiator: int, view: ClusterView, rng: random.Random
    ) -> list[tuple[int, ...]]:
        bound = self._straggler_bound(view)

        def eligible(w: int) -> bool:
            return self._passes(initiator, w, view, bound)

        if view.neighbours is None:  # the idle set, not every live worker
            idle = sorted(w for w in view.idle if w != initiator and eligible(w))
        else:
            idle = [w for w in _candidates(initiator, view) if w in view.idle and eligible(w)]
        if idle:
            pool = [initiator, *idle]
            groups = self._inter_intra(initiator, pool, view, rng) if self.inter_intra else []
            if not groups:
                groups = self._divide(initiator, pool, rng)
            if any(initiator in g for g in groups):
                return groups
        chosen = sample_peers(initiator, view, self.group_size - 1, rng, eligible)
        return [tuple(sorted([initiator, *chosen]))] if chosen else []

    def _divide(
        self, initiator: int, pool: Sequence[int], rng: random.Random
    ) -> list[tuple[int, ...]]:
        """A random partition of `pool` into balanced groups of at most group_size.

        ceil(n / group_size) groups whose sizes differ by at most one, the initiator's
        first; so 4 idle workers with group_size 3 give two pairs rather than a triple
        and a lone worker that would have to conflict. A pool of one yields nothing."""
        others = [w for w in pool if w != initiator]
        rng.shuffle(others)
        if initiator in pool:
            others.insert(0, initiator)
        n = len(others)
        if n < 2:
            return []
        num_groups = -(-n // self.group_size)
        base, extra = divmod(n, num_groups)
        groups, start = [], 0
        for i in range(num_groups):
            size = base + (1 if i < extra else 0)
            groups.append(tuple(sorted(others[start : start + size])))
            start += size
        return [g for g in groups if len(g) >= 2]

    def _inter_intra(
        self, initiator: int, pool: Sequence[int], view: ClusterView, rng: random.Random
    ) -> list[tuple[int, ...]]:
        by_node: dict[int, list[int]] = {}
        for w in pool:
            by_node.setdefault(view.node_of[w], []).append(w)
        heads: list[int] = []
        inter: list[tuple[int, ...]] = []
        intra: list[tuple[int, ...]] = []
        for node in sorted(by_node):
            local = by_node[node]
            head = initiator if initiator in local else rng.choice(local)
            heads.append(head)
            inter += self._divide(initiator, [w for w in local if w != head], rng)
            if len(local) >= 2:
                intra.append(tuple(sorted(local)))
        inter = self._divide(initiator, heads, rng) + inter
        # All Inter groups precede all Intra groups in the global order, so every
        # worker's buffer holds its Inter group first (§5.2).
        return inter + intra


def straggler_bound(own_seconds: Mapping[int, float], live: Collection[int]) -> float | None:
    """The smart policy's bound: STRAGGLER_FACTOR x the median own seconds per iteration
    of the live workers whose speed is known (None: nobody's yet)."""
    known = [s for w, s in own_seconds.items() if w in live]
    return STRAGGLER_FACTOR * statistics.median(known) if known else None
