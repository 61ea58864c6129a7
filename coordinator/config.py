"""Typed configuration of a run, as the coordinator holds it and hands it to workers."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ripples.coordinator.topology import (
    TOPOLOGIES,
    Edge,
    Topology,
    build_topology,
    parse_edge_list,
)
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.hop import HopSettings
from ripples.worker.lpp import LPP_PROTOCOLS, LppSettings

# Protocol name -> how the coordinator takes part. "group:<policy>" protocols ask the
# Group Generator for every P-Reduce; "lockstep" protocols compute their groups locally
# and use the coordinator only to agree on when to stop. "gossip:<pairing>" protocols
# average in pairs of graph neighbours that the coordinator matches. "p2p" protocols (hop)
# send parameters and tokens worker to worker; the coordinator serves membership, the
# topology and the stop only. lap-sgd / lpp-sgd average over all workers at once
# ("lockstep"), or with lpp_averaging ripples-random / ripples-smart in the Group
# Generator's groups (RunSettings.kind).
PROTOCOLS: dict[str, str] = {
    "allreduce": "lockstep",
    "ripples-random": "group:random",
    "ripples-smart": "group:smart",
    "ripples-static": "lockstep",
    "adpsgd": "gossip:adpsgd",
    "a2cid2": "gossip:a2cid2",
    "hop": "p2p",
    "lap-sgd": "lockstep",
    "lpp-sgd": "lockstep",
}
ADPSGD_MODES = ("serialised", "bipartite")


@dataclass(kw_only=True)
class RunSettings:
    """One training run. Every field is documented once, here."""

    protocol: str = "ripples-smart"
    """Synchronisation protocol: allreduce, ripples-random, ripples-smart, ripples-static,
    adpsgd, a2cid2, hop, lap-sgd or lpp-sgd."""
    task: str = "digits"
    """Training task: a built-in name (digits, synthetic-cnn, synthetic-vgg16) or
    module:function."""
    num_workers: int = 4
    """Workers that must register before training starts."""
    workers_per_node: int = 4
    """Workers per host (node), for Inter-Intra phases and the static schedule."""
    group_size: int = 3
    """P-Reduce group size for the random and smart group generators."""
    c_thres: int = 5
    """Smart GG slowdown filter: a worker joins a division only if c_i - c_w < c_thres."""
    inter_intra: bool = False
    """Smart GG: alternate Inter (head workers across nodes) and Intra (within a node) groups."""
    iterations: int = 0
    """Per-worker iteration budget; the run ends when the workers' total reaches the sum."""
    epochs: float = 5.0
    """Epochs (the workers together pass over the training set once per epoch); used when
    iterations is 0."""
    target_loss: float = 0.0
    """Stop when the workers' mean training loss falls to this value (0: no target)."""
    seed: int = 0
    """Seed for model initialisation, data order and group generation."""
    batch_size: int = 0
    """Per-worker mini-batch size (0: the task's default)."""
    learning_rate: float = 0.0
    """Learning rate (0: the task's default)."""
    average_optimizer_state: bool = True
    """P-Reduce averages the optimizer's per-parameter state (momentum buffers, Adam
    moments) along with the parameters, so a group leaves with one update direction;
    measured here to cut iterations to target ~15% (--no-average-optimizer-state: the
    papers' parameters-only averaging)."""
    collective_timeout_seconds: float = 60.0
    """Bound on one collective; a late or dead peer fails the group after it."""
    heartbeat_interval_seconds: float = 0.5
    """How often workers renew their lease and report progress."""
    lease_seconds: float = 10.0
    """A worker silent for this long is removed and its groups are cancelled."""
    checkpoint_interval: int = 8
    """Lock-step protocols agree on a common stop iteration every this many iterations."""
    topology: str = "complete"
    """Who may average with whom (ripples-random, ripples-smart, adpsgd, a2cid2): complete,
    ring, ring-based, double-ring, exponential, hierarchical (a clique per host, hosts in a
    ring) or file (see topology_file)."""
    topology_file: str = ""
    """Edge list for topology "file": one `i j` pair of ranks per line, # comments."""
    rate_com: float = 1.0
    """Gossip: expected pairwise averagings per worker per gradient step (a2cid2 draws a
    Poisson number per step; below 1, one every Poisson(1/rate_com) steps)."""
    momentum: bool = True
    """a2cid2: continuous momentum (--no-momentum: the asynchronous gossip baseline)."""
    adpsgd_mode: str = "serialised"
    """adpsgd pairing: serialised (any connected graph; the coordinator orders overlapping
    pairs, so no deadlock) or bipartite (the paper's active/passive split)."""
    hop_mode: str = "standard"
    """hop: standard (every in-neighbour's update each iteration), backup (backup workers:
    backup_workers updates may be missing) or staleness (updates up to `staleness`
    iterations old count, weighted by age)."""
    max_ig: int = 4
    """hop: token queues keep a worker at most this many iterations ahead of an
    out-neighbour."""
    backup_workers: int = 1
    """hop backup mode: updates per iteration a worker may go without (N_buw)."""
    staleness: int = 5
    """hop staleness mode: the oldest usable update is from iteration k - staleness."""
    max_jump: int = 0
    """hop: a straggler may skip up to this many iterations at once (0: never; needs
    backup or staleness mode, at most max_ig)."""
    skip_threshold: int = 2
    """hop: skip only when more than this many iterations behind every out-neighbour."""
    updaters: int = 2
    """lap-sgd, lpp-sgd: Hogwild updater processes per worker sharing its model (U)."""
    lpp_averaging: str = "all"
    """lap-sgd, lpp-sgd: average over all workers at once (all, the paper), or in the
    Group Generator's groups (ripples-random, ripples-smart)."""
    sync_period: int = 1
    """lap-sgd, lpp-sgd: average after every update until half the budget, then every
    this many updates (H). The paper's 16 goes with its decaying learning rate; with a
    task's constant rate it raised synthetic-cnn's loss after T/2 (docs/lpp-sgd.md)."""
    full_fraction: float = 0.1
    """lpp-sgd: update the full model for this fraction of the budget (T_st / T), then
    alternate between an updater's own block and the full model."""
    max_comms_per_worker: int = 64
    """Communicators cached per worker before the coordinator orders evictions."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Names this run's communicators in the rendezvous store."""
    _file_edges: list[Edge] = field(default_factory=list, init=False, repr=False,
                                    compare=False)
    """The edges of topology "file", read once by validate()."""

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """How the coordinator takes part (PROTOCOLS), with lap-sgd / lpp-sgd's averaging."""
        if self.protocol in LPP_PROTOCOLS and self.lpp_averaging != "all":
            return PROTOCOLS[self.lpp_averaging]
        return PROTOCOLS[self.protocol]

    @property
    def is_lockstep(self) -> bool:
        return self.kind == "lockstep"

    @property
    def needs_every_worker(self) -> bool:
        """Lock-step and peer-to-peer protocols cannot go on without a worker that
        left or failed: its peers would wait for it."""
        return self.kind in ("lockstep", "p2p")

    def hop_settings(self) -> HopSettings:
        return HopSettings.of_run(self)

    @property
    def policy_name(self) -> str | None:
        kind = self.kind
        return kind.split(":", 1)[1] if kind.startswith("group:") else None

    @property
    def gossip_pairing(self) -> str | None:
        """"adpsgd" or "a2cid2" for gossip protocols, else None."""
        kind = PROTOCOLS[self.protocol]
        return kind.split(":", 1)[1] if kind.startswith("gossip:") else None

    def topology_edges(self) -> list[Edge]:
        """The edges of topology "file" (empty for the built-in graphs)."""
        return list(self._file_edges)

    def check_topology(self, topology: Topology) -> None:
        """Raise ValueError if the protocol cannot run on `topology` (adpsgd's bipartite
        mode needs a bipartite graph)."""
        if (self.protocol == "adpsgd" and self.adpsgd_mode == "bipartite"
                and not topology.is_bipartite()):
            raise ValueError(
                f"adpsgd_mode bipartite needs a bipartite graph; the {self.topology} "
                f"topology on {topology.num_workers} workers has an odd cycle (use an even "
                "ring, or adpsgd_mode serialised, which works on any connected graph)")

    def validate(self) -> None:
        """Raise ValueError naming the field to fix."""
        if self.protocol not in PROTOCOLS:
            raise ValueError(
                f"unknown protocol {self.protocol!r}; choose one of {', '.join(PROTOCOLS)}"
            )
        if self.num_workers < 2:
            raise ValueError(f"num_workers must be at least 2, got {self.num_workers}")
        if self.workers_per_node < 1:
            raise ValueError("workers_per_node must be at least 1")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if self.c_thres < 1:
            raise ValueError("c_thres must be at least 1")
        if self.iterations < 0 or self.epochs < 0:
            raise ValueError("iterations and epochs must not be negative")
        if self.iterations == 0 and self.epochs == 0 and self.target_loss <= 0:
            raise ValueError("give a budget: iterations, epochs or a target loss")
        if self.target_loss < 0:
            raise ValueError("target_loss must not be negative")
        for name in ("collective_timeout_seconds", "heartbeat_interval_seconds", "lease_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.lease_seconds <= 2 * self.heartbeat_interval_seconds:
            raise ValueError("lease_seconds must exceed twice heartbeat_interval_seconds")
        if self.checkpoint_interval < 1:
            raise ValueError("checkpoint_interval must be at least 1")
        LppSettings.of_run(self).validate()
        if self.protocol in LPP_PROTOCOLS and self.iterations == 0 and self.epochs == 0:
            raise ValueError(f"{self.protocol} needs a budget of iterations or epochs: the "
                             "full-model phase and the synchronisation scheme are fractions "
                             "of it")
        self._validate_topology()

    def _validate_topology(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {self.topology!r}; choose one of "
                             f"{', '.join(TOPOLOGIES)}")
        if self.topology == "file" and not self.topology_file:
            raise ValueError("topology 'file' needs topology_file: a file of `i j` edges")
        if self.topology_file and self.topology != "file":
            raise ValueError("topology_file is given: set topology to 'file' to use it")
        if self.is_lockstep and self.topology != "complete":
            raise ValueError(f"{self.protocol} synchronises all workers together and takes "
                             "no topology; use ripples-random, ripples-smart, adpsgd, a2cid2 "
                             "or hop")
        self.hop_settings().validate()
        if not (self.rate_com > 0 and self.rate_com <= 100):
            raise ValueError(f"rate_com must be in (0, 100], got {self.rate_com}")
        if self.adpsgd_mode not in ADPSGD_MODES:
            raise ValueError(f"unknown adpsgd_mode {self.adpsgd_mode!r}; choose one of "
                             f"{', '.join(ADPSGD_MODES)}")
        if self.topology == "file":
            try:
                text = Path(self.topology_file).read_text(encoding="utf-8")
            except OSError as err:
                raise ValueError(f"cannot read topology_file {self.topology_file!r}: "
                                 f"{err.strerror}") from None
            self._file_edges = parse_edge_list(text, self.topology_file)
        if self.topology != "hierarchical":  # needs the hosts, checked when the run starts
            self.check_topology(build_topology(self.topology, self.num_workers,
                                               edges=self._file_edges))

    def to_proto(self) -> pb.RunConfig:
        return pb.RunConfig(
            run_id=self.run_id,
            protocol=self.protocol,
            task=self.task,
            num_workers=self.num_workers,
            workers_per_node=self.workers_per_node,
            group_size=self.group_size,
            iterations=self.iterations,
            epochs=self.epochs,
            target_loss=self.target_loss,
            seed=self.seed,
            collective_timeout_seconds=self.collective_timeout_seconds,
            heartbeat_interval_seconds=self.heartbeat_interval_seconds,
            lease_seconds=self.lease_seconds,
            checkpoint_interval=self.checkpoint_interval,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            average_optimizer_state=self.average_optimizer_state,
            topology=self.topology,
            rate_com=self.rate_com,
            momentum=self.momentum,
            adpsgd_mode=self.adpsgd_mode,
            hop_mode=self.hop_mode,
            max_ig=self.max_ig,
            backup_workers=self.backup_workers,
            staleness=self.staleness,
            max_jump=self.max_jump,
            skip_threshold=self.skip_threshold,
            updaters=self.updaters,
            lpp_averaging=self.lpp_averaging,
            sync_period=self.sync_period,
            full_fraction=self.full_fraction,
        )

    def replace(self, **changes: object) -> RunSettings:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
