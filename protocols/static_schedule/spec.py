"""ripples-static: P-Reduce on the static conflict-free schedule (the Ripples paper's
Fig. 10 rule), which every worker computes itself: no group RPCs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ripples.protocols.spec import Coordination, Membership, ProtocolSpec, Role

if TYPE_CHECKING:
    from ripples.worker.protocol import Protocol


def _runtime() -> type[Protocol]:
    from ripples.protocols.static_schedule.runtime import StaticScheduleProtocol

    return StaticScheduleProtocol


RIPPLES_STATIC = ProtocolSpec(
    name="ripples-static", summary="P-Reduce on the static conflict-free schedule",
    role=Role(coordination=Coordination.STATIC), runtime=_runtime,
    membership=Membership.RESTART,
    fixed_membership="every worker is in the static schedule's groups every iteration",
    no_local_steps="",
    no_sharded_workers="its lock-step collectives over every worker are what FSDP2 with a "
                       "replicate dimension (HSDP) already does",
    groups_note="ripples-static's workers compute the static schedule's groups themselves, "
                "without the coordinator")
