"""Typed configuration of a run, as the coordinator holds it and hands it to workers.

`RunSettings` holds what every run has (protocol, budget, timeouts, topology); each
protocol family's knobs are a settings object of their own (protocols/<name>/settings.py),
one per class in `ripples.protocols.registry.SETTINGS_CLASSES`, reached with `settings(cls)`. On the
command line they are flat options (`--group-size`, `--hop-mode`, ...): `RunSettings.build`
routes flat options to the class that owns each one.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ripples.coordinator.topology import (
    TOPOLOGIES,
    Edge,
    Topology,
    build_topology,
    checked_edges,
)
from ripples.protocols.group_generator.settings import GroupGeneratorSettings
from ripples.protocols.registry import (
    DEFAULT_PROTOCOL,
    PROTOCOLS,
    SETTINGS_CLASSES,
    get_protocol,
)
from ripples.protocols.settings import (
    ProtocolSettings,
    RunFacts,
    TopologyFacts,
    check_values,
)
from ripples.protocols.spec import Coordination, Membership, ProtocolSpec, Role
from ripples.rpc import parse_target
from ripples.run_records import printable
from ripples.v1 import coordinator_pb2 as pb

S = TypeVar("S", bound=ProtocolSettings)

MAX_WORKERS = 100_000
"""The most workers one run (or one shard) may have: `ripples simulate`'s largest runs.
Every count of workers (num_workers, max_workers, a group's size) is bounded by it."""
MAX_ITERATIONS = 10**12
"""Per-worker iteration budget's ceiling: times MAX_WORKERS it still fits an int64."""
RUN_LIMITS: dict[str, tuple[float, float]] = {
    "num_workers": (2, MAX_WORKERS), "min_workers": (1, MAX_WORKERS),
    "max_workers": (0, MAX_WORKERS), "workers_per_node": (1, MAX_WORKERS),
    "iterations": (0, MAX_ITERATIONS), "epochs": (0, 1e6),
    "seed": (0, 2**32 - 1),  # numpy's and torch's generators take it as it is
    "batch_size": (0, 2**24), "run_id": (0, 64),
    "local_steps": (1, 100_000), "outer_optimizer": (0, 16),
    "outer_lr": (0.0, 10.0), "outer_momentum": (0.0, 1.0), "outer_compression": (0, 16),
}
"""RunSettings' bounds where the defaults of protocols/settings.py `value_limits` (the
proto field's range, a week for `*_seconds`, 1e9 for a float, 1024 characters) are too
wide. Every field is bounded: a new one gets the defaults."""
CHECKED_APART = frozenset({"protocol_settings", "topology_edges"})
"""RunSettings' fields the one schema (check_values) leaves to checks of their own: each
protocol's settings check their values, and the edges are checked by checked_edges."""
TOPOLOGY_FILE_REFUSED = (
    "topology_file names a file on the submitting machine, and the coordinator opens no "
    "path a client names: send the edges as topology_edges, a list of [i, j] rank pairs "
    "(`ripples submit --topology-file FILE` reads the file and sends them)")
"""The answer to a submission (or a record of an older version) that names topology_file."""

OUTER_OPTIMIZERS = ("none", "nesterov")
"""What a synchronisation applies (RunSettings.outer_optimizer)."""
OUTER_COMPRESSIONS = ("none", "bf16", "int8")
"""How the gradient-like part of an outer synchronisation travels
(RunSettings.outer_compression); int8 is the modular wire of the groups
(worker/dataplane/modular_wire.py)."""
INT8_COORDINATIONS = (Coordination.GROUPS, Coordination.STATIC)
"""Where outer_compression int8 applies: a group's synchronisation, in an all-gather,
which pays in small groups. Over every worker (allreduce) an all-gather brings each one
N − 1 payloads against a ring all-reduce's 2 (N − 1)/N; a gossip exchange has no int8
wire."""
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.5
"""The outer Nesterov step's defaults: DiLoCo's learning rate (arXiv 2311.08105) and a
momentum of 0.5, not DiLoCo's 0.9: on the Transformer LM (8 workers, H = 8, 400 steps)
0.9 ended at loss 2.67 and 0.5 at 2.16 (docs/benchmarks.md, "Local steps on the
Transformer LM"); DiLoCo's 0.9 was tuned for H = 500 over tens of thousands of steps."""

LOCKSTEP_COLLECTIVE_TIMEOUT_SECONDS = 1800.0
"""Lock-step protocols' default collective timeout: torch's, so that a peer busy between
steps (a rank-0 evaluation) is waited for; a dead one is caught by its lease instead."""
GROUP_COLLECTIVE_TIMEOUT_SECONDS = 60.0
"""The other protocols' default: a group fails after it and its members go on."""


def option_names(cls: type[ProtocolSettings]) -> dict[str, str]:
    """Flat option name -> field of `cls` (`hop_mode` -> `mode`)."""
    return {cls.cli_names.get(f.name, f.name): f.name for f in dataclasses.fields(cls)}


def _default_protocol_settings() -> dict[type[ProtocolSettings], ProtocolSettings]:
    return {cls: cls() for cls in SETTINGS_CLASSES}


@dataclass(kw_only=True)
class RunSettings:
    """One training run. Every field is documented once, here."""

    protocol: str = DEFAULT_PROTOCOL
    """Synchronisation protocol: one of the registry's (protocols/registry.py; `ripples run
    --help` lists them with a line each)."""
    task: str = "digits"
    """Training task: a built-in name (digits, synthetic-cnn, synthetic-vgg16) or
    module:function; empty when the workers run the user's own script."""
    num_workers: int = 4
    """Workers that must register before training starts."""
    min_workers: int = 2
    """Elastic protocols go on while at least this many workers are live; a member that
    leaves can be replaced meanwhile (a replacement takes its rank and heals from a live
    peer). Fewer after a failure or a signal: the run stops. A worker whose training loop
    ended is done, not lost, and never counts here: the run ends with the last loop."""
    max_workers: int = 0
    """Elastic protocols: workers may join a running run beyond num_workers, up to this
    many (each takes the next rank, heals from a live peer and averages; 0: num_workers,
    no scale-up)."""
    workers_per_node: int = 4
    """Workers per host (node), for Inter-Intra phases and the static schedule."""
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
    local_steps: int = 1
    """Synchronise every this many optimizer steps (H): the workers take H steps each on
    their own, then average (local SGD; DiLoCo's H). 1: every step, as without it. Only
    protocols whose runtime has the outer step take it (docs/configuration.md)."""
    outer_optimizer: str = "none"
    """What a synchronisation applies: none (average the models) or nesterov (average
    the pseudo-gradients, each worker's progress since its last synchronisation, and take
    an outer Nesterov SGD step with outer_lr and outer_momentum: DiLoCo's outer step)."""
    outer_lr: float = OUTER_LR
    """Outer optimizer nesterov: its learning rate (DiLoCo's 0.7; 1 with outer_momentum 0
    is plain model averaging)."""
    outer_momentum: float = OUTER_MOMENTUM
    """Outer optimizer nesterov: its momentum, below 1 (0.5; DiLoCo's 0.9 suits long
    runs with large H: docs/local-steps.md)."""
    outer_compression: str = "none"
    """Outer optimizer nesterov: none; bf16: the pseudo-gradients (allreduce) and the
    outer momentum (the group form) travel in bfloat16, the pseudo-gradients with error
    feedback, models and anchors in float32; int8 (the groups of ripples-smart,
    ripples-random, ripples-static): the anchors' low bits travel in a byte each, the
    model is never rounded and the momentum stays local (docs/local-steps.md, "The
    groups' int8 wire")."""
    collective_timeout_seconds: float = 0.0
    """Bound on one collective: a peer that has not reached it by then fails it. 0: 1800 s
    (torch's default) for lock-step protocols (allreduce, ripples-static), where every
    worker waits in every collective for the slowest, who may be alive but busy (an
    evaluation or a save on rank 0) while a dead peer is caught by its lease; 60 s for
    the others, whose groups go on without a late peer."""
    heartbeat_interval_seconds: float = 0.5
    """How often workers renew their lease and report progress."""
    lease_seconds: float = 10.0
    """A worker silent for this long is removed and its groups are cancelled."""
    coordinator_outage_seconds: float = 60.0
    """Workers ride over a coordinator outage of up to this long (a coordinator restarted
    from its --state-dir): RPCs retry with back-off and jitter, group streams reconnect,
    training goes on meanwhile; past it a worker fails with the coordinator's error."""
    outage_local_steps: int = 100
    """While the coordinator is unreachable, a worker of a group or gossip protocol trains
    on alone for up to this many steps in a row (optimizer steps, with local steps too:
    a round of H counts H), then waits for it (within the outage window): models that
    never average drift apart, each towards its own shard."""
    final_average: bool = True
    """After the stop, the live workers of a group or gossip protocol average their models
    once more, all together, so that every worker's final model (--save-model) is the
    consensus model. `ripples run` turns it off: it averages the saved models itself and
    reports how far apart they ended (consensus_distance_final)."""
    checkpoint_interval: int = 8
    """Lock-step protocols agree on a common stop iteration every this many iterations."""
    max_restarts: int = 3
    """Protocols that restart (lock-step ones) whose workers write checkpoints: a
    member that fails, or a worker that joins, opens a restart round (every worker restarts
    its process, registers anew and restores the last checkpoint every rank holds, as
    torchelastic does) at most this many times; past it, or without checkpoints, a failure
    stops the run. 0: never restart."""
    join_window_seconds: float = 15.0
    """A restart round forms its membership once all num_workers registered, or after this
    long with at least min_workers (the run then goes on with fewer ranks until a joiner
    opens another round)."""
    topology: str = "complete"
    """Who may average with whom (protocols whose averaging follows a graph): complete,
    ring, ring-based, double-ring, exponential, hierarchical (a clique per host, hosts in a
    ring) or file (see topology_edges)."""
    topology_edges: list[Edge] = field(default_factory=list)
    """Topology "file": its edges, [i, j] pairs of ranks. The command that submits the run
    reads them from --topology-file (one `i j` pair per line, # comments) on its own
    machine; the coordinator never opens a file a client names."""
    max_comms_per_worker: int = 64
    """Communicators cached per worker before the coordinator orders evictions."""
    root: str = ""
    """Sharded jobs: HOST:PORT of the root coordinator, whose run's members are the heads
    of every shard. This run is then one shard: its head (rank 0) also P-Reduces in the
    root's groups every inter_period iterations, and `ripples stop` on the root stops
    this run too (docs/scale.md; shardable protocols only). Empty: a run of its own."""
    inter_period: int = 4
    """Sharded jobs: the head's every inter_period-th iteration averages in a root group
    (with other shards' heads) instead of one of its shard."""
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    """Names this run's communicators in the rendezvous store."""
    protocol_settings: dict[type[ProtocolSettings], ProtocolSettings] = field(
        default_factory=_default_protocol_settings)
    """Each protocol family's settings (one instance per class of SETTINGS_CLASSES)."""

    def __post_init__(self) -> None:
        self.protocol_settings = {**_default_protocol_settings(), **self.protocol_settings}
        self.validate()

    @classmethod
    def build(cls, **options: Any) -> RunSettings:
        """RunSettings from flat options, as the command line has them: protocol settings
        (`group_size`, `hop_mode`, ...) go to the class owning each; the rest are fields.

        Raises:
            ValueError: an option no field or settings class has.
        """
        if options.pop("topology_file", ""):  # "": an older version's record
            raise ValueError(TOPOLOGY_FILE_REFUSED)
        own = {f.name for f in dataclasses.fields(cls) if f.init}
        base = {k: v for k, v in options.items() if k in own}
        rest = {k: v for k, v in options.items() if k not in own}
        protocol_settings: dict[type[ProtocolSettings], ProtocolSettings] = {}
        for settings_cls in SETTINGS_CLASSES:
            names = option_names(settings_cls)
            mine = {names[k]: rest.pop(k) for k in list(rest) if k in names}
            protocol_settings[settings_cls] = settings_cls(**mine)
        if rest:
            unknown = sorted(rest)
            listed = ", ".join(printable(n[:40]) for n in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise ValueError(f"unknown run option(s): {listed}{more}")
        return cls(**base, protocol_settings=protocol_settings)

    def settings(self, settings_cls: type[S]) -> S:
        """This run's settings of one protocol family."""
        value = self.protocol_settings[settings_cls]
        assert isinstance(value, settings_cls)
        return value

    @property
    def spec(self) -> ProtocolSpec:
        return get_protocol(self.protocol)

    @property
    def role(self) -> Role:
        """How the coordinator takes part (the protocol's, resolved from its settings)."""
        return self.spec.role_of(self.settings)

    @property
    def collective_timeout(self) -> float:
        """collective_timeout_seconds, or (0) the default of this run's protocol."""
        if self.collective_timeout_seconds:
            return self.collective_timeout_seconds
        lockstep = self.role.coordination in (Coordination.LOCKSTEP, Coordination.STATIC)
        return (LOCKSTEP_COLLECTIVE_TIMEOUT_SECONDS if lockstep
                else GROUP_COLLECTIVE_TIMEOUT_SECONDS)

    @property
    def restarts(self) -> bool:
        """A membership change restarts every worker from the last checkpoint (a restart
        round): the protocol restarts, and this run's role needs every worker."""
        return self.spec.restarts and self.role.needs_every_worker

    def run_facts(self) -> RunFacts:
        """What the protocol's settings check against the rest of the run."""
        return RunFacts(protocol=self.protocol, policy=self.role.label, task=self.task,
                        iterations=self.iterations, epochs=self.epochs,
                        sharded=bool(self.root))

    def check_topology(self, topology: Topology) -> None:
        """Raise ValueError if the protocol cannot run on `topology` (each settings class
        says, e.g. a pairing that needs a bipartite graph)."""
        facts = TopologyFacts(name=self.topology, num_workers=topology.num_workers,
                              bipartite=topology.is_bipartite())
        for settings_cls in self.spec.settings:
            self.settings(settings_cls).check_topology(self.run_facts(), facts)

    def check_values(self) -> None:
        """Raise ValueError naming the first option of the wrong type or out of its bounds:
        every field of the run and of every protocol's settings (all travel in RunConfig),
        the one schema of flags, config files and SubmitRun alike."""
        check_values(self, pb.RunConfig.DESCRIPTOR, RUN_LIMITS, skip=CHECKED_APART)
        for settings in self.protocol_settings.values():
            settings.check_values()

    def validate(self) -> None:
        """Raise ValueError naming the field to fix."""
        self.check_values()
        group_size = self.settings(GroupGeneratorSettings).group_size
        if group_size > MAX_WORKERS:  # a larger one is cut to the live workers
            raise ValueError(f"group_size must be at most {MAX_WORKERS} (a run's most "
                             f"workers), got {group_size}")
        spec = get_protocol(self.protocol)
        if self.num_workers < 2:
            raise ValueError(f"num_workers must be at least 2, got {self.num_workers}")
        if not 1 <= self.min_workers <= self.num_workers:
            raise ValueError(f"min_workers must be between 1 and num_workers "
                             f"({self.num_workers}), got {self.min_workers}")
        if self.max_workers and self.max_workers < self.num_workers:
            raise ValueError(f"max_workers must be 0 or at least num_workers "
                             f"({self.num_workers}), got {self.max_workers}")
        fixed = spec.fixed_membership or spec.fixed_size
        if self.max_workers > self.num_workers and fixed:
            growing = [s.name for s in PROTOCOLS.values()
                       if s.membership is Membership.ELASTIC and not s.fixed_size]
            raise ValueError(f"{self.protocol} takes no workers beyond num_workers "
                             f"({fixed}); max_workers is for {', '.join(growing)}")
        if self.workers_per_node < 1:
            raise ValueError("workers_per_node must be at least 1")
        if self.iterations < 0 or self.epochs < 0:
            raise ValueError("iterations and epochs must not be negative")
        if self.task and self.iterations == 0 and self.epochs == 0 and self.target_loss <= 0:
            raise ValueError("give a budget: iterations, epochs or a target loss")
        if not self.task and not spec.library:
            raise ValueError(f"{self.protocol} runs several updater processes per worker and "
                             "needs a built-in task (--task); a script can use any other "
                             "protocol")
        if self.target_loss < 0:
            raise ValueError("target_loss must not be negative")
        for name in ("heartbeat_interval_seconds", "lease_seconds",
                     "coordinator_outage_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.collective_timeout_seconds < 0:
            raise ValueError("collective_timeout_seconds must not be negative (0: the "
                             "protocol's default)")
        if self.lease_seconds <= 2 * self.heartbeat_interval_seconds:
            raise ValueError("lease_seconds must exceed twice heartbeat_interval_seconds")
        if self.outage_local_steps < 0:
            raise ValueError("outage_local_steps must not be negative")
        if self.checkpoint_interval < 1:
            raise ValueError("checkpoint_interval must be at least 1")
        if self.max_restarts < 0:
            raise ValueError("max_restarts must not be negative")
        if self.join_window_seconds <= 0:
            raise ValueError("join_window_seconds must be positive")
        self._validate_outer_steps(spec)
        for settings_cls in spec.settings:
            self.settings(settings_cls).validate()
            self.settings(settings_cls).check_run(self.run_facts())
        self.settings(GroupGeneratorSettings).check_overlap(self.run_facts())
        self.settings(GroupGeneratorSettings).check_sync_share(self.run_facts())
        if self.inter_period < 1:
            raise ValueError(f"inter_period must be at least 1, got {self.inter_period}")
        if self.root:
            try:
                parse_target(self.root)
            except ValueError:
                raise ValueError(f"root must be the root coordinator's HOST:PORT, got "
                                 f"{self.root!r}") from None
        if self.root and (self.local_steps > 1 or self.outer_optimizer == "nesterov"):
            raise ValueError("root (a shard of a sharded job) takes no local_steps or "
                             "outer_optimizer yet: a shard's head would hold two anchors (its "
                             "shard's and the root's) over one model")
        if self.root and not spec.shardable:
            shardable = [s.name for s in PROTOCOLS.values() if s.shardable]
            raise ValueError(f"root (a shard of a sharded job) needs protocol "
                             f"{' or '.join(shardable)}, not {self.protocol}")
        self._validate_topology()

    def _validate_int8(self, spec: ProtocolSpec) -> None:
        """outer_compression int8: only the groups' synchronisation."""
        if spec.role.coordination not in INT8_COORDINATIONS:
            raise ValueError(
                f"outer_compression int8 is for the groups of ripples-smart, ripples-random "
                f"and ripples-static, not {self.protocol}: it travels in an all-gather, "
                "which pays in small groups (over every worker each would receive N - 1 "
                "payloads; use bf16 there), and a gossip exchange has no int8 wire")

    def _validate_outer_steps(self, spec: ProtocolSpec) -> None:
        """local_steps and the outer optimizer: their values, and whether the protocol
        takes them (a protocol whose runtime has no outer step refuses them, saying why,
        rather than run without them)."""
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"outer_optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, "
                             f"got {printable(self.outer_optimizer[:20])!r}")
        if self.outer_optimizer == "nesterov":
            if self.outer_lr <= 0:
                raise ValueError(f"outer_lr must be positive, got {self.outer_lr:g}")
            if self.outer_momentum >= 1:
                raise ValueError(f"outer_momentum must be below 1 (1 never forgets a step), "
                                 f"got {self.outer_momentum:g}")
        elif (self.outer_lr, self.outer_momentum, self.outer_compression) != (
                OUTER_LR, OUTER_MOMENTUM, "none"):
            raise ValueError("outer_lr, outer_momentum and outer_compression are for "
                             "outer_optimizer nesterov; set it, or leave them out "
                             "(outer_optimizer none averages the models, which would lose "
                             "their low bits in bf16 at every synchronisation)")
        if self.outer_compression not in OUTER_COMPRESSIONS:
            raise ValueError(f"outer_compression must be one of "
                             f"{', '.join(OUTER_COMPRESSIONS)}, got "
                             f"{printable(self.outer_compression[:20])!r}")
        if self.outer_compression == "int8":
            self._validate_int8(spec)
        if (self.local_steps == 1 and self.outer_optimizer == "none") or not spec.no_local_steps:
            return
        takers = [s.name for s in PROTOCOLS.values() if not s.no_local_steps]
        use = f"use {', '.join(takers)}" if takers else "no protocol takes them yet"
        raise ValueError(f"{self.protocol} takes no local_steps or outer_optimizer "
                         f"({spec.no_local_steps}); {use}, or leave them at 1 and none")

    def _validate_topology(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"unknown topology {self.topology!r}; choose one of "
                             f"{', '.join(TOPOLOGIES)}")
        if self.topology == "file" and not self.topology_edges:
            raise ValueError("topology 'file' needs its edges: topology_edges, a list of "
                             "[i, j] rank pairs (on the command line: --topology-file FILE)")
        if self.topology_edges and self.topology != "file":
            raise ValueError("topology_edges are given: set topology to 'file' to use them")
        if not self.role.takes_topology and self.topology != "complete":
            graphs = [s.name for s in PROTOCOLS.values()
                      if s.role.takes_topology]
            raise ValueError(f"{self.protocol} synchronises all workers together and takes "
                             f"no topology; use {', '.join(graphs)}")
        if self.topology == "file":
            self.topology_edges = checked_edges(self.topology_edges, self.num_workers)
        if self.topology != "hierarchical":  # needs the hosts, checked when the run starts
            self.check_topology(build_topology(self.topology, self.num_workers,
                                               edges=self.topology_edges))

    def to_proto(self) -> pb.RunConfig:
        config = pb.RunConfig(
            run_id=self.run_id,
            protocol=self.protocol,
            task=self.task,
            num_workers=self.num_workers,
            workers_per_node=self.workers_per_node,
            iterations=self.iterations,
            epochs=self.epochs,
            target_loss=self.target_loss,
            seed=self.seed,
            collective_timeout_seconds=self.collective_timeout,
            heartbeat_interval_seconds=self.heartbeat_interval_seconds,
            lease_seconds=self.lease_seconds,
            coordinator_outage_seconds=self.coordinator_outage_seconds,
            final_average=self.final_average,
            outage_local_steps=self.outage_local_steps,
            checkpoint_interval=self.checkpoint_interval,
            batch_size=self.batch_size,
            learning_rate=self.learning_rate,
            average_optimizer_state=self.average_optimizer_state,
            topology=self.topology,
            root=self.root,
            inter_period=self.inter_period,
            local_steps=self.local_steps,
            outer_optimizer=self.outer_optimizer,
            outer_lr=self.outer_lr,
            outer_momentum=self.outer_momentum,
            outer_compression=self.outer_compression,
        )
        for settings in self.protocol_settings.values():
            getattr(config, settings.proto_field).CopyFrom(settings.to_proto())
        return config

    def options(self) -> dict[str, object]:
        """The flat options that `build` takes back (protocol settings by option name)."""
        values: dict[str, object] = {f.name: getattr(self, f.name)
                                     for f in dataclasses.fields(self)
                                     if f.init and f.name != "protocol_settings"}
        for settings_cls, settings in self.protocol_settings.items():
            for option, name in option_names(settings_cls).items():
                values[option] = getattr(settings, name)
        return values

    def replace(self, **changes: object) -> RunSettings:
        """A copy with some flat options changed."""
        return RunSettings.build(**{**self.options(), **changes})


__all__ = ["MAX_WORKERS", "RunSettings", "option_names"]
