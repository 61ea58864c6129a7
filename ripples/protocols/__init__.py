"""Every protocol Ripples runs, described once: the registry shared by the coordinator,
the workers, the launcher, the dashboard and the benchmarks.

A protocol is one `ProtocolSpec` line in `PROTOCOLS` plus its own files: its settings (a
`ProtocolSettings` dataclass with a message of its own in the proto) under
`ripples/protocols/`, and its runtime (the synchronisation behind `ripples.Optimizer`)
under `worker/protocols/`. Nothing else names a protocol: the coordinator asks the spec
for its `Role`, the dashboard reads the edge pattern the coordinator derives from the
role, and the launcher calls the spec's `summarise` hook. docs/architecture.md walks
through adding one.

This package is pure (no torch, no gRPC server): the coordinator imports it without
importing any worker module.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from ripples.protocols.gossip import GossipSettings
from ripples.protocols.group_generator import GroupGeneratorSettings
from ripples.protocols.hop import HopSettings
from ripples.protocols.lpp import LppSettings
from ripples.protocols.settings import ProtocolSettings

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
    """P-Reduce in groups the Group Generator forms on request (policy: random, smart)."""
    GOSSIP = "gossip"
    """Pairwise averaging with graph neighbours the coordinator pairs (policy: adpsgd,
    a2cid2)."""
    PEER_TO_PEER = "p2p"
    """Worker to worker on the topology's edges; the coordinator serves membership, the
    topology and the stop."""


@dataclass(frozen=True)
class Role:
    """The coordinator's part in one run: its coordination and, for groups and gossip,
    the group policy or pairing."""

    coordination: Coordination
    policy: str = ""

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


@dataclass(frozen=True, kw_only=True)
class ProtocolSpec:
    """One protocol: what the coordinator does for it and where its runtime lives."""

    name: str
    summary: str
    """One line for help texts."""
    role: Role
    """The coordinator's part (for protocols whose part depends on their settings, the
    default; see `role_from`)."""
    settings: tuple[type[ProtocolSettings], ...] = ()
    """The settings classes it reads."""
    runtime: str
    """"module:Class" of its worker-side implementation (imported on first use)."""
    library: bool = True
    """Runs behind ripples.Optimizer in the user's own loop. False: only the built-in
    runner runs it (several processes per worker), and library mode refuses it."""
    fixed_membership: str = ""
    """Why no worker may join the running run, or empty: elastic, a worker may join in
    place of a member that left (it heals from a live peer first)."""
    restarts: bool = False
    """A membership change (a member fails, a worker joins) restarts every worker from the
    run's last checkpoint with the new membership (lock-step protocols whose workers
    checkpoint; RunSettings.max_restarts), in runs whose role needs every worker (lap-sgd
    and lpp-sgd averaging over all workers; with group averaging the others go on)."""
    role_from: Callable[[SettingsLookup[Any]], Role] | None = None
    """Derives the role from the run's settings when it depends on them."""
    summarise: str = ""
    """"module:function(records, config) -> (per rank, run)" that folds the workers'
    records into summary.json; empty: each worker's record as it is."""
    record_key: str = ""
    """Where summary.json puts each worker's record of the protocol (default: its name)."""

    def role_of(self, lookup: SettingsLookup[Any]) -> Role:
        return self.role_from(lookup) if self.role_from is not None else self.role

    def runtime_class(self) -> type:
        module_name, _, class_name = self.runtime.partition(":")
        cls: type = getattr(importlib.import_module(module_name), class_name)
        return cls

    def summariser(self) -> Callable[[Mapping[int, Mapping[str, Any]], Any],
                                     tuple[dict[int, dict[str, Any]], dict[str, Any]]] | None:
        if not self.summarise:
            return None
        module_name, _, name = self.summarise.partition(":")
        fn: Callable[..., Any] = getattr(importlib.import_module(module_name), name)
        return fn


def _lpp_role(lookup: SettingsLookup[Any]) -> Role:
    averaging = lookup(LppSettings).averaging
    if averaging == "all":
        return Role(Coordination.LOCKSTEP)
    return Role(Coordination.GROUPS, averaging.removeprefix("ripples-"))


_GROUPS = "P-Reduce in groups of the Group Generator"
_LOCKSTEP_FIXED = "every worker is in every collective of a lock-step protocol"
_LPP_FIXED = "a worker's updater processes share one model, which a joiner cannot heal"
_RUNTIMES = "ripples.worker.protocols"

PROTOCOLS: dict[str, ProtocolSpec] = {spec.name: spec for spec in (
    ProtocolSpec(name="allreduce", summary="PyTorch DDP over all workers (the baseline)",
                 role=Role(Coordination.LOCKSTEP),
                 runtime=f"{_RUNTIMES}.allreduce:AllReduceProtocol",
                 fixed_membership=_LOCKSTEP_FIXED, restarts=True),
    ProtocolSpec(name="ripples-random", summary=f"{_GROUPS}: random groups",
                 role=Role(Coordination.GROUPS, "random"), settings=(GroupGeneratorSettings,),
                 runtime=f"{_RUNTIMES}.group_generator:GroupGeneratorProtocol"),
    ProtocolSpec(name="ripples-smart", summary=f"{_GROUPS}: smart groups (slowdown filter)",
                 role=Role(Coordination.GROUPS, "smart"), settings=(GroupGeneratorSettings,),
                 runtime=f"{_RUNTIMES}.group_generator:GroupGeneratorProtocol"),
    ProtocolSpec(name="ripples-static", summary="P-Reduce on the static conflict-free schedule",
                 role=Role(Coordination.STATIC),
                 runtime=f"{_RUNTIMES}.static_schedule:StaticScheduleProtocol",
                 fixed_membership=_LOCKSTEP_FIXED, restarts=True),
    ProtocolSpec(name="adpsgd", summary="AD-PSGD: wait-free pairwise averaging",
                 role=Role(Coordination.GOSSIP, "adpsgd"), settings=(GossipSettings,),
                 runtime=f"{_RUNTIMES}.gossip.protocol:GossipProtocol"),
    ProtocolSpec(name="a2cid2", summary="A2CiD2: pairwise gossip with continuous momentum",
                 role=Role(Coordination.GOSSIP, "a2cid2"), settings=(GossipSettings,),
                 runtime=f"{_RUNTIMES}.gossip.protocol:GossipProtocol"),
    ProtocolSpec(name="hop", summary="Hop: parameters and tokens worker to worker",
                 role=Role(Coordination.PEER_TO_PEER), settings=(HopSettings,),
                 runtime=f"{_RUNTIMES}.hop.protocol:HopProtocol",
                 summarise="ripples.protocols.hop:summarise", record_key="hop",
                 fixed_membership="hop's queues and tokens are fixed at the start",
                 restarts=True),
    ProtocolSpec(name="lap-sgd", summary="LAP-SGD: Hogwild updaters, background averaging",
                 role=Role(Coordination.LOCKSTEP), settings=(LppSettings, GroupGeneratorSettings),
                 runtime=f"{_RUNTIMES}.lpp.protocol:LppProtocol", library=False,
                 role_from=_lpp_role, record_key="lpp",
                 fixed_membership=_LPP_FIXED, restarts=True),
    ProtocolSpec(name="lpp-sgd", summary="LPP-SGD: LAP-SGD with partial backpropagation",
                 role=Role(Coordination.LOCKSTEP), settings=(LppSettings, GroupGeneratorSettings),
                 runtime=f"{_RUNTIMES}.lpp.protocol:LppProtocol", library=False,
                 role_from=_lpp_role, record_key="lpp",
                 fixed_membership=_LPP_FIXED, restarts=True),
)}
"""Protocol name -> spec, in the order help texts list them."""

SETTINGS_CLASSES: tuple[type[ProtocolSettings], ...] = tuple(dict.fromkeys(
    cls for spec in PROTOCOLS.values() for cls in spec.settings))
"""Every protocol settings class, once each (a run carries all of them)."""


def role_of_config(config: Any) -> Role:
    """The coordinator's role in a run, from its RunConfig message (workers, dashboard)."""
    return get_protocol(config.protocol).role_of(lambda cls: cls.of_config(config))


def get_protocol(name: str) -> ProtocolSpec:
    """The spec of a protocol; ValueError naming the choices for an unknown name."""
    spec = PROTOCOLS.get(name)
    if spec is None:
        raise ValueError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    return spec


__all__ = ["PROTOCOLS", "SETTINGS_CLASSES", "Coordination", "GossipSettings",
           "GroupGeneratorSettings", "HopSettings", "LppSettings", "ProtocolSettings",
           "ProtocolSpec", "Role", "get_protocol", "role_of_config"]
