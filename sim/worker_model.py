"""The seam between the simulator and a protocol: how a protocol's workers act in a
simulated run (`SimulatedWorkers`, which each simulated protocol implements in its own
package, protocols/<name>/sim.py) and what the simulation offers them (`SimHost`).

The engine (sim/engine.py) owns the clock, the event heap, the coordinator cores and what
every protocol shares: compute times, RPCs and their service time, heartbeats, leases,
collectives and their effect on the consensus model. A protocol's model says what its
worker does next: after an iteration, when the coordinator answers, when a collective
ends. Each one follows that protocol's real loop (its runtime.py), modelled.
"""

from __future__ import annotations

import abc
import random
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ripples.coordinator.config import RunSettings
    from ripples.coordinator.core import CoordinatorCore
    from ripples.coordinator.decisions import GroupDecision
    from ripples.sim.config import SimConfig
    from ripples.sim.models import CommModel, ComputeSampler, ConsensusState
    from ripples.sim.outer_step import OuterStep


class SimWorker:
    """One simulated worker: where it is and what it spent its time on."""

    __slots__ = ("rank", "wid", "host", "shard", "root_wid", "core_at",
                 "iteration", "compute_s", "wait_s", "comm_s", "partner_s",
                 "wait_since", "token", "listen", "done", "more", "in_group",
                 "compute_started", "factor")

    def __init__(self, rank: int, wid: int, host: int, shard: int = 0) -> None:
        self.rank, self.wid, self.host, self.shard = rank, wid, host, shard
        self.root_wid = -1
        """Its id in the root core (sharded runs; -1: it heads no shard)."""
        self.core_at = shard
        """The core of its current request or group."""
        self.iteration = 0
        self.compute_s = self.wait_s = self.comm_s = 0.0
        self.partner_s = 0.0
        """Waits for a partner that do not hold its compute (waits_hold_compute False)."""
        self.wait_since: float | None = None
        self.token = 0
        """Voids stale timeouts and replies: bumped whenever it is answered."""
        self.listen = False
        """Its current request only listens for partners (the role's passive side)."""
        self.done = False
        self.more = False
        """Its last group said that more groups of its round follow."""
        self.in_group = False
        self.compute_started = 0.0  # shared cores: when this iteration's work began
        self.factor = 1.0  # shared cores: this iteration's slowdown (a sleep after it)


class SimHost(Protocol):
    """What a simulated protocol may use of the running simulation."""

    config: SimConfig
    settings: RunSettings
    rng: random.Random
    now: float
    workers: list[SimWorker]
    cores: list[CoordinatorCore]
    root: int
    """The root core's index in `cores` (sharded runs; -1: none)."""
    compute_times: ComputeSampler
    comm: CommModel
    model: ConsensusState
    outer: OuterStep | None
    """The run's outer optimizer (None: a synchronisation averages the models)."""
    curve: list[tuple[float, float]]
    events: int

    @property
    def core(self) -> CoordinatorCore: ...

    def start_iteration(self, w: SimWorker) -> None:
        """`w` starts its next iteration; `on_compute` follows when it is done."""

    def request(self, w: SimWorker, *, listen: bool = False) -> None:
        """`w` asks its current core (w.core_at) for a group; `on_decision` follows."""

    def later(self, delay: float, w: SimWorker) -> None:
        """`on_timer(w)` after `delay` simulated seconds."""

    def sample_interval(self) -> float:
        """The consensus curve's spacing in simulated seconds."""

    def record_collective(self, size: int, vectors: float) -> None:
        """Count a collective the protocol ran itself (lock-step): `size` members, each
        feeding `vectors` model-sized vectors into it."""


class SimulatedWorkers(abc.ABC):
    """How one protocol's workers act in the simulation. The engine makes one per run."""

    waits_hold_compute: bool = True
    """A worker waiting for the coordinator stops computing (its wait counts as the
    worker's); False: its communication runs beside its compute loop."""
    comm_overlaps_compute: bool = False
    """Its collectives run beside its compute: the time fractions leave them out."""

    def __init__(self, sim: SimHost) -> None:
        self.sim = sim

    def run(self) -> str | None:
        """Run the whole simulation here and return its stop reason, for protocols that
        are not driven by the coordinator's events (lock-step); None: event-driven."""
        return None

    def start(self, w: SimWorker) -> None:
        """Schedule `w`'s first events (by default: its first iteration)."""
        self.sim.start_iteration(w)

    @abc.abstractmethod
    def on_compute(self, w: SimWorker) -> None:
        """`w` finished an iteration (its model stepped)."""

    @abc.abstractmethod
    def poll_seconds(self, w: SimWorker) -> float:
        """How long the coordinator holds `w`'s request before telling it to retry."""

    @abc.abstractmethod
    def on_decision(self, w: SimWorker, decision: GroupDecision) -> None:
        """The coordinator answered `w` with something other than a group or a stop
        (which the engine handles): retry, no group, cancelled."""

    @abc.abstractmethod
    def on_group_end(self, w: SimWorker) -> None:
        """`w`'s collective ended and its release went to the coordinator."""

    def on_timer(self, w: SimWorker) -> None:  # noqa: B027 (optional hook)
        """A `later` the model asked for is due."""

    def spends(self, w: SimWorker) -> bool:
        """With the outer optimizer, as `w`'s group starts: whether the synchronisation
        is its own, so that it spends its progress since its last spent one (its
        provisional step); False: a partner picked mid-round, which keeps its progress.
        A group protocol's members always spend (one with no step since contributes the
        identity step all the same)."""
        return True
