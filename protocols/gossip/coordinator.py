"""What the coordinator derives from the run's graph for the gossip protocols, once the
membership is formed (their Role's `graph_extras`).

- A2CiD2's constants (docs/gossip.md, "A2CiD2: the algorithm and its constants"): with
  rate_com averagings per worker per gradient step the communication Laplacian is
  rate_com x L (L: the topology's Laplacian of uniform pairwise gossip); chi_1 is 1 over
  its algebraic connectivity, chi_2 its largest half effective resistance over edges, and
  the momentum's constants follow. For a regular graph this L is I - W with
  W_ij = 1/|N_i|.
- AD-PSGD's bipartite mode: the graph's second colour only listens (the passive side).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ripples.coordinator.topology import Topology
from ripples.protocols.gossip.settings import GossipSettings
from ripples.protocols.spec import GraphExtras
from ripples.v1 import coordinator_pb2 as pb


@dataclass(frozen=True)
class A2cid2Constants:
    """A2CiD2's constants for one graph and communication rate."""

    chi_1: float  # 1 / algebraic connectivity of the communication Laplacian
    chi_2: float  # max over edges of half the effective resistance
    eta: float  # momentum mixing rate, per gradient step
    alpha: float  # weight of the partner's model in x (always 1/2)
    alpha_tilde: float  # weight of the partner's model in the momentum copy x~


def a2cid2_constants(topology: Topology, rate_com: float) -> A2cid2Constants:
    """chi_1, chi_2, eta and alpha~ for `rate_com` averagings per gradient step."""
    if rate_com <= 0:
        raise ValueError(f"rate_com must be positive, got {rate_com}")
    chi_1 = 1.0 / (rate_com * topology.algebraic_connectivity())
    chi_2 = topology.max_half_resistance() / rate_com
    return A2cid2Constants(
        chi_1=chi_1, chi_2=chi_2, eta=1.0 / (2.0 * math.sqrt(chi_1 * chi_2)),
        alpha=0.5, alpha_tilde=0.5 * math.sqrt(chi_1 / chi_2))


def a2cid2_extras(topology: Topology, lookup: Callable[[type[Any]], Any]) -> GraphExtras:
    c = a2cid2_constants(topology, lookup(GossipSettings).rate_com)
    return GraphExtras(gossip=pb.GossipConstants(chi_1=c.chi_1, chi_2=c.chi_2, eta=c.eta,
                                                 alpha_tilde=c.alpha_tilde))


def adpsgd_extras(topology: Topology, lookup: Callable[[type[Any]], Any]) -> GraphExtras:
    """Bipartite mode: the second colour is passive (check_topology admits bipartite
    graphs only there)."""
    if lookup(GossipSettings).adpsgd_mode != "bipartite":
        return GraphExtras(gossip=pb.GossipConstants())
    colours = topology.two_colouring()
    assert colours is not None, "GossipSettings.check_topology admits bipartite graphs only"
    return GraphExtras(gossip=pb.GossipConstants(),
                       passive_ranks=frozenset(r for r, c in enumerate(colours) if c == 1))
