"""Hop's queue protocol for one worker (../shared/papers/hop.txt §4-§6), as pure state.

Worker i's model goes through iterations k = 0, 1, ... on a graph whose edges (j, i)
mean "j sends its parameters to i". Every worker has a self-loop: its own parameters are
always among the ones it averages. This module holds what the paper's update queues and
token queues hold, and decides when a worker may reduce and when it may enter the next
iteration; it sends and receives nothing itself. The runtime feeds it the messages that
arrive (`on_update`, `on_credit`), sends the messages it returns, and waits, with a
timeout, until `recv_ready` / `can_advance` say so.

Update queues (§4.1, §6.1): updates tagged (iteration, sender) land in max_ig + 1 rotating
per-iteration slots; the slot of iteration t is t mod (max_ig + 1). Tokens bound a
worker's in-neighbours to at most max_ig iterations ahead of it, so the slots of the
iterations it may still receive never collide.

Token queues (§4.2) as credits: TokenQ(i->j) lives at i and holds the tokens j must take
to enter a new iteration. Here i sends j a *credit* each time it enters an iteration, and
j counts what it holds; taking a token is spending a credit. j starts with max_ig credits
from each out-neighbour, so credits(j from i) = Iter(i) - Iter(j) + max_ig >= 0 (the
invariant of Theorem 2's proof), which bounds Iter(j) - Iter(i) <= max_ig. A credit also
tells j which iteration i entered: the sender-side check of §6.2 needs no extra request.

Modes (Table 1): standard (wait for every in-neighbour's update of iteration k), backup
workers (§4.3: wait for |N_in| - N_buw of them, take any others that arrived, drop stale
ones), bounded staleness (§4.4: per in-neighbour the newest update, usable while at most
s iterations old, averaged with Eq. 2's iteration weights). Skipping (§5): a worker whose
credits show it behind every out-neighbour by more than `skip_threshold` jumps up to
`max_jump` iterations ahead after a Recv/Reduce of the iteration before its target.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

P = TypeVar("P")  # the payload: a flat parameter tensor at run time, anything in tests

HOP_MODES = ("standard", "backup", "staleness")


@dataclass(frozen=True, kw_only=True)
class HopSettings:
    """Hop's knobs; every field is validated by validate()."""

    mode: str = "standard"
    """standard, backup (backup workers) or staleness (bounded staleness)."""
    max_ig: int = 4
    """Token queues: the most iterations a worker may be ahead of an out-neighbour."""
    backup_workers: int = 1
    """backup: updates per iteration a worker may go without (N_buw)."""
    staleness: int = 5
    """staleness: the oldest usable update is from iteration k - staleness."""
    max_jump: int = 0
    """Skipping: the most iterations one jump may skip (0: never skip)."""
    skip_threshold: int = 2
    """Skipping: jump only when more than this many iterations behind every out-neighbour."""

    @classmethod
    def of_run(cls, run: Any) -> HopSettings:
        """From a run's options (RunSettings or its RunConfig message: same field names)."""
        return cls(mode=run.hop_mode, max_ig=run.max_ig, backup_workers=run.backup_workers,
                   staleness=run.staleness, max_jump=run.max_jump,
                   skip_threshold=run.skip_threshold)

    def validate(self) -> None:
        if self.mode not in HOP_MODES:
            raise ValueError(f"unknown hop mode {self.mode!r}; choose one of "
                             f"{', '.join(HOP_MODES)}")
        if self.max_ig < 1:
            raise ValueError(f"max_ig must be at least 1, got {self.max_ig}")
        if self.mode == "backup" and self.backup_workers < 1:
            raise ValueError(f"backup mode needs backup_workers >= 1, got {self.backup_workers}")
        if self.mode == "staleness" and self.staleness < 0:
            raise ValueError(f"staleness must be at least 0, got {self.staleness}")
        if self.max_jump < 0 or self.skip_threshold < 0:
            raise ValueError("max_jump and skip_threshold must be at least 0")
        if self.max_jump > 0 and self.mode == "standard":
            raise ValueError("skipping iterations needs backup workers or bounded staleness "
                             "(§5): in standard mode the neighbours would wait forever for the "
                             "updates of the skipped iterations")
        if self.max_jump > self.max_ig:
            raise ValueError(f"max_jump ({self.max_jump}) may not exceed max_ig "
                             f"({self.max_ig}): a longer jump could wait for updates that "
                             "the tokens keep the neighbours from sending")

    def gap_bound(self, hops_ahead: int, hops_behind: int) -> int:
        """Table 1: the most Iter(i) may exceed Iter(j), where j is `hops_ahead` hops
        downstream of i (i -> ... -> j) and i is `hops_behind` hops downstream of j.
        Tokens give max_ig per hop from i to j (Theorem 2, every mode); a Recv that waits
        for every in-neighbour gives b0 per hop from j to i (Theorem 1: 1 in standard
        mode, s + 1 with bounded staleness; backup workers give no such bound, and with
        skipping a worker enters an iteration before the Recv that would hold it)."""
        bound = self.max_ig * hops_ahead
        b0 = {"standard": 1, "staleness": self.staleness + 1}.get(self.mode)
        if b0 is None or self.max_jump > 0:  # a jump enters k before its Recv(k - 1)
            return bound
        return min(bound, b0 * hops_behind)


@dataclass(frozen=True)
class UpdateMsg(Generic[P]):
    """i's parameters at the start of `iteration`, for out-neighbour `to`."""

    to: int
    sender: int
    iteration: int
    payload: P


@dataclass(frozen=True)
class CreditMsg:
    """`sender` entered `iteration` and gives `to` this many tokens."""

    to: int
    sender: int
    iteration: int
    count: int


@dataclass
class Received(Generic[P]):
    """What one Recv/Reduce takes: the payloads and their Eq. 2 weights (1 when unweighted),
    the worker's own first."""

    payloads: list[P]
    weights: list[float]
    senders: list[int]
    iterations: list[int]

    def reduce(self) -> P:
        """Reduce (§3.2): the weighted mean of the payloads (Eq. 1's plain mean when every
        weight is 1, Eq. 2's iteration-weighted one in staleness mode)."""
        total = sum(self.weights)
        result = self.payloads[0] * (self.weights[0] / total)  # type: ignore[operator]
        for weight, payload in zip(self.weights[1:], self.payloads[1:], strict=True):
            result = result + payload * (weight / total)  # type: ignore[operator]
        return result  # type: ignore[return-value]


class HopProtocolError(RuntimeError):
    """A message that the protocol's bounds say cannot happen (a bug, or a foreign peer)."""


@dataclass
class HopWorker(Generic[P]):
    """One worker's queues and tokens. Not thread-safe: the runtime holds a lock."""

    rank: int
    in_neighbours: tuple[int, ...]  # senders to this worker, self excluded
    out_neighbours: tuple[int, ...]  # receivers of this worker's updates, self excluded
    settings: HopSettings
    iteration: int = 0
    credits: dict[int, int] = field(default_factory=dict)  # per out-neighbour
    known_iteration: dict[int, int] = field(default_factory=dict)  # per out-neighbour
    num_stale_dropped: int = 0
    num_not_sent: int = 0  # updates the §6.2 check did not send
    num_jumps: int = 0
    iterations_skipped: int = 0

    def __post_init__(self) -> None:
        self.settings.validate()
        if self.rank in self.in_neighbours or self.rank in self.out_neighbours:
            raise ValueError("the self-loop is implicit: list neighbours without the worker")
        self.credits = {j: self.settings.max_ig for j in self.out_neighbours}
        self.known_iteration = {j: 0 for j in self.out_neighbours}
        self._slots: list[list[tuple[int, int, P]]] = [[] for _ in range(self.settings.max_ig + 1)]
        self._newest: dict[int, tuple[int, P]] = {}  # staleness: per sender, newest unread
        self._used_iteration: dict[int, int] = {j: -1 for j in self.in_neighbours}
        self.jump_recv: int | None = None
        """After a jump to k: k - 1, until the Recv(k - 1) that renews the parameters."""

    @property
    def floor(self) -> int:
        """The oldest iteration whose updates are still wanted, and the one the next Recv
        is for: the current one, or after a jump the one before it."""
        return self.iteration if self.jump_recv is None else self.jump_recv
    # ------------------------------------------------------------------ sending
    def enter(self, payload: P) -> list[UpdateMsg[P] | CreditMsg]:
        """Messages for entering the current iteration: a credit to every in-neighbour
        (TokenQ insert, §4.2) and the parameters to every out-neighbour (Send, §3.2),
        except to a receiver already past this iteration in backup mode (§6.2)."""
        if self.jump_recv is not None:
            raise HopProtocolError(f"worker {self.rank} jumped to iteration {self.iteration} "
                                   f"and must Recv({self.jump_recv}) before entering it")
        k = self.iteration
        out: list[UpdateMsg[P] | CreditMsg] = []
        if k > 0:  # iteration 0's tokens are the initial max_ig
            out += [CreditMsg(j, self.rank, k, 1) for j in self.in_neighbours]
        for j in self.out_neighbours:
            if self.settings.mode == "backup" and self.known_iteration[j] > k:
                self.num_not_sent += 1
                continue
            out.append(UpdateMsg(j, self.rank, k, payload))
        return out

    # ------------------------------------------------------------------ receiving
    def on_update(self, msg: UpdateMsg[P]) -> None:
        if msg.sender not in self.in_neighbours or msg.to != self.rank:
            raise HopProtocolError(f"worker {self.rank} got an update from {msg.sender}, "
                                   f"which is not an in-neighbour")
        t, floor = msg.iteration, self.floor
        if t > floor + self.settings.max_ig:
            raise HopProtocolError(f"worker {self.rank} at iteration {self.iteration} got an "
                                   f"update of iteration {t} from {msg.sender}: more than "
                                   f"max_ig ({self.settings.max_ig}) ahead")
        if self.settings.mode == "staleness":
            held = self._newest.get(msg.sender)
            if held is None or held[0] < t:
                self.num_stale_dropped += held is not None
                self._newest[msg.sender] = (t, msg.payload)
            else:
                self.num_stale_dropped += 1
            return
        if t < floor:  # backup mode: a late update nobody will read
            self.num_stale_dropped += 1
            return
        slot = self._slot(t)
        self._drop_older(slot, floor)  # a skipped iteration's leftovers in this slot
        slot.append((t, msg.sender, msg.payload))

    def on_credit(self, msg: CreditMsg) -> None:
        if msg.sender not in self.credits or msg.to != self.rank:
            raise HopProtocolError(f"worker {self.rank} got a credit from {msg.sender}, "
                                   "which is not an out-neighbour")
        self.credits[msg.sender] += msg.count
        self.known_iteration[msg.sender] = max(self.known_iteration[msg.sender], msg.iteration)

    def _slot(self, iteration: int) -> list[tuple[int, int, P]]:
        return self._slots[iteration % len(self._slots)]

    def _drop_older(self, slot: list[tuple[int, int, P]], iteration: int) -> None:
        stale = sum(e[0] < iteration for e in slot)
        if stale:
            self.num_stale_dropped += stale
            slot[:] = [e for e in slot if e[0] >= iteration]

    def _updates_of(self, iteration: int) -> list[tuple[int, int, P]]:
        """The slot's entries of `iteration`; entries of older iterations are dropped."""
        slot = self._slot(iteration)
        self._drop_older(slot, iteration)
        return [e for e in slot if e[0] == iteration]

    def queue_depth(self) -> int:
        """Updates held (the update queue's size)."""
        return sum(len(s) for s in self._slots) + len(self._newest)

    # ------------------------------------------------------------------ Recv / Reduce
    def needed(self) -> int:
        """In-neighbour updates of an iteration that Recv must wait for (standard, backup)."""
        n = len(self.in_neighbours)
        return n if self.settings.mode == "standard" else max(0, n - self.settings.backup_workers)

    def recv_ready(self) -> bool:
        """Whether the next Recv (of iteration `floor`) would not block."""
        k = self.floor
        if self.settings.mode == "staleness":
            oldest = k - self.settings.staleness
            return all(self._usable_since(j) >= oldest for j in self.in_neighbours)
        return len(self._updates_of(k)) >= self.needed()

    def _usable_since(self, sender: int) -> int:
        held = self._newest.get(sender)
        return max(self._used_iteration[sender], held[0] if held else -1)

    def recv(self, own: P) -> Received[P]:
        """Take the updates of the next Recv (call when recv_ready): the own parameters
        first, then what the mode takes. Reduce is the weighted mean of the result."""
        k = self.floor
        if not self.recv_ready():
            raise HopProtocolError(f"Recv({k}) on worker {self.rank} is not ready")
        self.jump_recv = None
        if self.settings.mode == "staleness":
            s, oldest = self.settings.staleness, k - self.settings.staleness
            got = Received([own], [float(s + 1)], [self.rank], [k])
            for j in self.in_neighbours:
                held = self._newest.pop(j, None)
                if held is None:
                    continue  # its last update, used before, still counts as recent enough
                t, payload = held
                self._used_iteration[j] = max(self._used_iteration[j], t)
                if t >= oldest:
                    got.payloads.append(payload)
                    got.weights.append(float(t - oldest + 1))  # Eq. 2
                    got.senders.append(j)
                    got.iterations.append(t)
                else:
                    self.num_stale_dropped += 1
            return got
        entries = self._updates_of(k)
        slot = self._slot(k)
        slot[:] = [e for e in slot if e[0] != k]
        got = Received([own], [1.0], [self.rank], [k])
        for t, sender, payload in entries:
            got.payloads.append(payload)
            got.weights.append(1.0)
            got.senders.append(sender)
            got.iterations.append(t)
        return got

    # ------------------------------------------------------------------ tokens
    def can_advance(self) -> bool:
        """Whether a token from every out-neighbour is at hand (the next iteration may start)."""
        return all(c >= 1 for c in self.credits.values())

    def lag(self) -> int:
        """Iterations this worker is behind its nearest out-neighbour, as its credits tell
        (Iter(j) - Iter(i) = credits - max_ig); 0 without out-neighbours."""
        if not self.credits:
            return 0
        return min(self.credits.values()) - self.settings.max_ig

    def jump_length(self) -> int:
        """How many iterations the next advance moves: 1, or a jump (§5) when skipping is
        on and the worker is more than skip_threshold behind every out-neighbour."""
        cfg = self.settings
        behind = self.lag()
        if cfg.max_jump <= 1 or behind <= cfg.skip_threshold:
            return 1
        return max(1, min(cfg.max_jump, behind))

    def advance(self, jump: int = 1) -> list[CreditMsg]:
        """Spend `jump` tokens from every out-neighbour and move `jump` iterations on. A
        jump also gives every in-neighbour the tokens of the skipped iterations at once
        (before the Recv of the iteration before the target, which cannot then wait on a
        neighbour that these tokens hold back); the credits of the target iteration itself
        go out with enter()."""
        if jump < 1 or any(c < jump for c in self.credits.values()):
            raise HopProtocolError(f"worker {self.rank} cannot advance {jump} iteration(s) "
                                   f"with credits {self.credits}")
        for j in self.credits:
            self.credits[j] -= jump
        self.iteration += jump
        if jump == 1:
            return []
        self.num_jumps += 1
        self.iterations_skipped += jump - 1
        self.jump_recv = self.iteration - 1
        # The tokens of the skipped iterations (enter() gives the target's), sent before
        # the jump's Recv(target - 1).
        return [CreditMsg(j, self.rank, self.iteration - 1, jump - 1) for j in self.in_neighbours]


def graph_distances(out_neighbours: Mapping[int, Iterable[int]]) -> dict[tuple[int, int], int]:
    """Hops along directed edges from every worker to every worker it reaches (BFS)."""
    dist: dict[tuple[int, int], int] = {}
    for src in out_neighbours:
        seen, frontier = {src: 0}, deque([src])
        while frontier:
            u = frontier.popleft()
            for v in out_neighbours.get(u, ()):
                if v not in seen:
                    seen[v] = seen[u] + 1
                    frontier.append(v)
        dist.update({(src, v): d for v, d in seen.items()})
    return dist


@dataclass(kw_only=True)
class GapReport:
    """Every iteration gap observed in a run, checked against Table 1's bound."""

    events: int
    """Iteration changes replayed (every worker's, merged in time order)."""
    max_gap: int
    """The largest Iter(i) - Iter(j) seen over every ordered pair."""
    max_bound: int
    """The largest bound of any pair (how far the setting lets workers drift)."""
    tightest: float
    """The largest gap / bound seen (1.0: some pair reached its bound)."""
    num_violations: int
    """Gaps over their bound (per ordered pair and change; 0: Theorems 1-2 held)."""
    violations: list[str]
    """The first of them, described."""


def check_iteration_gaps(timelines: Mapping[int, Sequence[Sequence[float]]],
                         out_neighbours: Mapping[int, Sequence[int]],
                         settings: HopSettings, max_reported: int = 10) -> GapReport:
    """Replay the workers' iteration timelines, [(time, iteration entered), ...] on one
    clock, in time order and check after every change that Iter(i) - Iter(j) stays within
    settings.gap_bound for every ordered pair. Every worker starts at iteration 0.

    The runtime stamps an iteration before it sends the credits and updates that let
    others move on, so a gap the protocol holds can never appear larger in the replay."""
    dist = graph_distances(out_neighbours)
    workers = sorted(timelines)
    unreachable = 10**9  # hops to a worker no path reaches: nothing bounds that gap
    bounds = {(i, j): settings.gap_bound(dist.get((i, j), unreachable),
                                         dist.get((j, i), unreachable))
              for i in workers for j in workers if i != j}
    events = sorted((float(t), w, int(it)) for w, line in timelines.items() for t, it in line)
    now = dict.fromkeys(workers, 0)
    max_gap, tightest, num_violations = 0, 0.0, 0
    violations: list[str] = []
    for t, w, it in events:
        now[w] = it  # only w's lead over the others can have grown
        for j in workers:
            if j == w:
                continue
            gap, bound = it - now[j], bounds[(w, j)]
            max_gap = max(max_gap, gap)
            if bound > 0:
                tightest = max(tightest, gap / bound)
            if gap > bound:
                num_violations += 1
                if len(violations) < max_reported:
                    violations.append(f"t={t:.3f}: Iter({w}) - Iter({j}) = {it} - {now[j]} "
                                      f"= {gap} > bound {bound}")
    return GapReport(events=len(events), max_gap=max_gap,
                     max_bound=max(bounds.values(), default=0), tightest=tightest,
                     num_violations=num_violations, violations=violations)
