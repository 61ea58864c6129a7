"""Protocol runtimes behind ripples.Optimizer: one module (or package) each.

The registry is `ripples.protocols.PROTOCOLS` (shared with the coordinator): each spec's
`runtime` names the class here. `create_protocol` instantiates the run's.
"""

from __future__ import annotations

from ripples.protocols import get_protocol
from ripples.worker.protocols.base import Protocol, ProtocolContext, SyncResult


def create_protocol(name: str, ctx: ProtocolContext) -> Protocol:
    """Instantiate the runtime of protocol `name`; ValueError for an unknown name."""
    cls = get_protocol(name).runtime_class()
    protocol = cls(ctx)
    assert isinstance(protocol, Protocol), f"{cls} is not a Protocol"
    return protocol


__all__ = ["Protocol", "ProtocolContext", "SyncResult", "create_protocol"]
