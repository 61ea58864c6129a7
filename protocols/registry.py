"""The protocols Ripples runs: one line each.

Adding a protocol is its own package under protocols/ (settings, spec, runtime) and its
spec below (an import and a line of PROTOCOLS); docs/architecture.md walks through it.
Everything here is pure (no torch): the coordinator, the CLI and the dashboard read the
registry, and a spec loads its runtime only when a worker asks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ripples.protocols.allreduce.spec import ALLREDUCE
from ripples.protocols.gossip.spec import A2CID2, ADPSGD
from ripples.protocols.group_generator.spec import RIPPLES_RANDOM, RIPPLES_SMART
from ripples.protocols.hop.spec import HOP
from ripples.protocols.lpp.spec import LAP_SGD, LPP_SGD
from ripples.protocols.settings import ProtocolSettings
from ripples.protocols.spec import ProtocolSpec, Role
from ripples.protocols.static_schedule.spec import RIPPLES_STATIC

if TYPE_CHECKING:
    from ripples.worker.protocol import Protocol, ProtocolContext

PROTOCOLS: dict[str, ProtocolSpec] = {spec.name: spec for spec in (
    ALLREDUCE,
    RIPPLES_RANDOM,
    RIPPLES_SMART,
    RIPPLES_STATIC,
    ADPSGD,
    A2CID2,
    HOP,
    LAP_SGD,
    LPP_SGD,
)}
"""Protocol name -> spec, in the order help texts list them."""

DEFAULT_PROTOCOL = RIPPLES_SMART.name
"""A run's protocol when none is given."""

SETTINGS_CLASSES: tuple[type[ProtocolSettings], ...] = tuple(dict.fromkeys(
    cls for spec in PROTOCOLS.values() for cls in spec.settings))
"""Every protocol settings class, once each (a run carries all of them)."""


def get_protocol(name: str) -> ProtocolSpec:
    """The spec of a protocol; ValueError naming the choices for an unknown name."""
    spec = PROTOCOLS.get(name)
    if spec is None:
        raise ValueError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    return spec


def role_of_config(config: Any) -> Role:
    """The coordinator's role in a run, from its RunConfig message (workers, dashboard)."""
    return get_protocol(config.protocol).role_of(lambda cls: cls.of_config(config))


def create_runtime(name: str, ctx: ProtocolContext) -> Protocol:
    """The worker-side runtime of protocol `name` for this worker; ValueError for an
    unknown name."""
    from ripples.worker.protocol import Protocol

    cls = get_protocol(name).runtime_class()
    protocol = cls(ctx)
    assert isinstance(protocol, Protocol), f"{cls} is not a Protocol"
    return protocol


__all__ = ["DEFAULT_PROTOCOL", "PROTOCOLS", "SETTINGS_CLASSES", "create_runtime", "get_protocol",
           "role_of_config"]
