"""adpsgd and a2cid2: pairwise gossip with graph neighbours (AD-PSGD, Lian et al., ICML
2018, arXiv:1710.06952; A2CiD2, Nabli et al., NeurIPS 2023, arXiv:2306.08289).

Both share one runtime and one model in the simulator; their `GossipVariant`
(variants.py) says how they differ.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ripples.coordinator.pairing import FifoPairing
from ripples.coordinator.policies import RandomPolicy
from ripples.protocols.gossip.coordinator import a2cid2_extras, adpsgd_extras
from ripples.protocols.gossip.settings import GossipSettings
from ripples.protocols.gossip.variants import A2CID2_VARIANT, ADPSGD_VARIANT
from ripples.protocols.spec import Coordination, ProtocolSpec, Role

if TYPE_CHECKING:
    from ripples.sim.worker_model import SimulatedWorkers
    from ripples.worker.protocol import Protocol


def _runtime() -> type[Protocol]:
    from ripples.protocols.gossip.runtime import GossipProtocol

    return GossipProtocol


def _simulation() -> type[SimulatedWorkers]:
    from ripples.protocols.gossip.sim import GossipWorkers

    return GossipWorkers


def _random_pairs(lookup: Callable[[type[Any]], Any]) -> RandomPolicy:
    # AD-PSGD: each averaging pairs the initiator with one random neighbour; the group
    # table serialises overlapping pairs in one global order.
    return RandomPolicy(group_size=2)


_PAIRWISE = ("its pairwise exchanges (whom to average with, and when) are not relayed "
             "from a worker's rank 0 to its other ranks")

ADPSGD = ProtocolSpec(
    name="adpsgd", summary="AD-PSGD: wait-free pairwise averaging",
    role=Role(coordination=Coordination.GOSSIP, label="adpsgd", group_policy=_random_pairs,
              listening=ADPSGD_VARIANT.listens, graph_extras=adpsgd_extras),
    settings=(GossipSettings,), runtime=_runtime, simulation=_simulation,
    no_local_steps="", no_sharded_workers=_PAIRWISE)
A2CID2 = ProtocolSpec(
    name="a2cid2", summary="A2CiD2: pairwise gossip with continuous momentum",
    role=Role(coordination=Coordination.GOSSIP, label="a2cid2", pairing=FifoPairing,
              listening=A2CID2_VARIANT.listens, graph_extras=a2cid2_extras),
    settings=(GossipSettings,), runtime=_runtime, simulation=_simulation,
    fixed_size="its momentum constants are computed for the run's graph at the start",
    no_sharded_workers=_PAIRWISE,
    no_local_steps="its continuous momentum already accelerates the consensus, and "
                   "rate_com below 1 already spaces its exchanges: an outer Nesterov step "
                   "would be a second momentum")

