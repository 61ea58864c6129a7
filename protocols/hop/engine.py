"""Hop's queue protocol for one worker (Luo et al., "Hop: Heterogeneity-Aware Decentralized
Training", ASPLOS 2019, arXiv:1902.01064, §4-§6; docs/hop-paper-spec.md), as pure state.

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

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ripples.protocols.hop.settings import HopSettings

P = TypeVar("P")  # the payload: a flat parameter tensor at run time, anything in tests


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
