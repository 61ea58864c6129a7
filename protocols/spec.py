"""What one protocol is, for every part that runs it: the seam between the protocols and
the rest of the house.

A protocol is a package of its own under protocols/ (settings, coordinator role, worker
runtime, simulated workers) and one `ProtocolSpec` line in protocols/registry.py. The
spec holds objects, not names to look up: the coordinator asks its `Role` for the group
policy, the pairing and what the run's graph gives the workers; a worker asks its
`runtime` loader for the class behind `ripples.Optimizer`; the simulator asks its
`simulation` loader for the model of its workers; the dashboard, the launcher and the
chaos harness read its other fields. Nothing outside protocols/ tests a protocol's name.

The loaders import on first use, so that the coordinator and the CLI, which read specs,
never import torch: a loader is a plain function whose body imports the class.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ripples.protocols.settings import ProtocolSettings
from ripples.v1 import coordinator_pb2 as pb

if TYPE_CHECKING:
    from ripples.coordinator.pairing import FifoPairing
    from ripples.coordinator.policies import GroupPolicy
    from ripples.coordinator.topology import Topology
    from ripples.sim.worker_model import SimulatedWorkers
    from ripples.worker.protocol import Protocol

S = TypeVar("S", bound=ProtocolSettings)
SettingsLookup = Callable[[type[S]], S]
"""The run's instance of a settings class (RunSettings.settings, or read from RunConfig)."""


class Coordination(enum.Enum):
    """How the coordinator takes part in a run."""

    LOCKSTEP = "lockstep"
    """Every worker synchronises with every other each iteration; the coordinator only
    agrees on one stop iteration for all (a worker that leaves stops the run)."""
    STATIC = "static"
    """Lock-step in groups of the static schedule, computed by the workers themselves."""
    GROUPS = "groups"
    """P-Reduce in groups the coordinator's group policy forms on request."""
    GOSSIP = "gossip"
    """Pairwise averaging with graph neighbours the coordinator pairs."""
    PEER_TO_PEER = "p2p"
    """Worker to worker on the topology's edges; the coordinator serves membership, the
    topology and the stop."""


class Membership(enum.Enum):
    """What happens to a run whose membership changes (a member fails, a worker joins)."""

    ELASTIC = "elastic"
    """The others go on; a new worker takes a vacant rank (or a new one, up to
    max_workers) and heals from a live peer before it averages."""
    RESTART = "restart"
    """Every worker restarts from the run's last checkpoint with the new membership (a
    restart round, as torchelastic does), if the workers checkpoint; else the run stops."""


@dataclass(frozen=True, kw_only=True)
class GraphExtras:
    """What a protocol derives from the run's graph once the membership is formed."""

    passive_ranks: frozenset[int] = frozenset()
    """Ranks that only answer partners and never ask for an averaging of their own."""
    gossip: pb.GossipConstants | None = None
    """Constants every worker receives with its membership (its `passive` flag is set
    per worker by the coordinator)."""


@dataclass(frozen=True, kw_only=True)
class Role:
    """The coordinator's part in one run: its coordination and, for groups and gossip,
    the objects that decide who averages with whom."""

    coordination: Coordination
    label: str = ""
    """A short name of the group policy or pairing, for logs and the settings' checks
    (random, smart, ...); the coordinator never branches on it."""
    group_policy: Callable[[SettingsLookup[Any]], GroupPolicy] | None = None
    """Builds the policy that forms a group when a worker asks (groups, and gossip that
    pairs through the group table); None: the coordinator forms no groups this way."""
    pairing: Callable[[], FifoPairing] | None = None
    """Builds the queue that pairs available workers first come, first served (gossip
    whose pairs execute at once); None: no such queue."""
    listening: bool = False
    """Workers may wait for partners without owing an averaging (a passive side)."""
    graph_extras: Callable[[Topology, SettingsLookup[Any]], GraphExtras] | None = None
    """What the run's graph gives this protocol's workers (constants, passive ranks)."""

    @property
    def forms_groups(self) -> bool:
        """The coordinator forms groups or pairs on request for this run."""
        return self.group_policy is not None or self.pairing is not None

    @property
    def needs_every_worker(self) -> bool:
        """A worker that leaves or fails stops the run: its peers would wait for it."""
        return self.coordination in (Coordination.LOCKSTEP, Coordination.STATIC,
                                     Coordination.PEER_TO_PEER)

    @property
    def takes_topology(self) -> bool:
        """Averaging follows the run's topology (lock-step protocols use every worker)."""
        return self.coordination in (Coordination.GROUPS, Coordination.GOSSIP,
                                     Coordination.PEER_TO_PEER)


Summariser = Callable[[Mapping[int, Mapping[str, Any]], Any],
                      tuple[dict[int, dict[str, Any]], dict[str, Any]]]
"""Folds the workers' records into summary.json: (records per rank, the RunConfig) ->
(per rank, for the run)."""


@dataclass(frozen=True, kw_only=True)
class ProtocolSpec:
    """One protocol, as every part of Ripples sees it."""

    name: str
    summary: str
    """One line for help texts."""
    role: Role
    """The coordinator's part (for protocols whose part depends on their settings, the
    default; see `role_from`)."""
    runtime: Callable[[], type[Protocol]]
    """Loads the class of its worker-side implementation (behind ripples.Optimizer)."""
    settings: tuple[type[ProtocolSettings], ...] = ()
    """The settings classes it reads."""
    role_from: Callable[[SettingsLookup[Any]], Role] | None = None
    """Derives the role from the run's settings when it depends on them."""
    simulation: Callable[[], type[SimulatedWorkers]] | None = None
    """Loads the model of its workers for `ripples simulate`; None: not simulated."""
    library: bool = True
    """Runs behind ripples.Optimizer in the user's own loop. False: only the built-in
    runner runs it (several processes per worker), and library mode refuses it."""
    membership: Membership = Membership.ELASTIC
    fixed_membership: str = ""
    """Restart protocols: why no worker may join the running run (a joiner could not
    heal from a live peer)."""
    fixed_size: str = ""
    """Elastic protocols that take no workers beyond num_workers: why; empty: the run
    may grow up to max_workers."""
    no_local_steps: str = "its worker runtime has no outer step"
    """Why it refuses local steps and an outer optimizer (RunSettings.local_steps > 1 or
    outer_optimizer other than none), in the refusal's words; empty: it takes them (its
    runtime synchronises every local_steps steps and applies the outer step)."""
    no_sharded_workers: str = ("its exchanges are not relayed from a worker's rank 0 to its "
                               "other ranks")
    """Why it does not run on workers of several ranks (`--ranks-per-worker`, FSDP2), in the
    refusal's words; empty: it does (rank 0 relays each decision, and rank r of each
    member averages its shard: worker/replica.py)."""
    shardable: bool = False
    """Its runs may be shards of a sharded job (the shards' heads average in the root
    coordinator's run of the same protocol; docs/scale.md)."""
    summarise: Summariser | None = None
    """Folds the workers' records into summary.json; None: each record as it is."""
    record_key: str = ""
    """Where summary.json puts each worker's record of the protocol (default: its name)."""
    groups_note: str = ""
    """What the dashboard's list of groups says while it is empty because the protocol
    forms its groups without the coordinator (empty: "none yet")."""

    def role_of(self, lookup: SettingsLookup[Any]) -> Role:
        return self.role_from(lookup) if self.role_from is not None else self.role

    @property
    def restarts(self) -> bool:
        """A membership change restarts every worker (Membership.RESTART)."""
        return self.membership is Membership.RESTART

    def runtime_class(self) -> type[Protocol]:
        return self.runtime()
