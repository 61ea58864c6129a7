"""hop: parameters and tokens sent worker to worker on the topology's edges (Hop, Luo et
al., ASPLOS 2019, arXiv:1902.01064)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ripples.protocols.hop.gaps import summarise
from ripples.protocols.hop.settings import HopSettings
from ripples.protocols.spec import Coordination, Membership, ProtocolSpec, Role

if TYPE_CHECKING:
    from ripples.worker.protocol import Protocol


def _runtime() -> type[Protocol]:
    from ripples.protocols.hop.runtime import HopProtocol

    return HopProtocol


HOP = ProtocolSpec(
    name="hop", summary="Hop: parameters and tokens worker to worker",
    role=Role(coordination=Coordination.PEER_TO_PEER), settings=(HopSettings,),
    runtime=_runtime, summarise=summarise, record_key="hop",
    no_local_steps="its queues bound the iteration gap between neighbours update by update, "
                   "which local steps would redefine",
    no_sharded_workers="its sends to its neighbours, and their tokens, are not relayed from "
                       "a worker's rank 0 to its other ranks",
    membership=Membership.RESTART, fixed_membership="hop's queues and tokens are fixed at "
    "the start",
    groups_note="hop's workers send their updates to their neighbours themselves, without "
                "the coordinator's groups")
