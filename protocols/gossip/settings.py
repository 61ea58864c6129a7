"""Settings of the pairwise gossip protocols (adpsgd, a2cid2)."""

from __future__ import annotations

from dataclasses import dataclass

from ripples.protocols.settings import ProtocolSettings, RunFacts, TopologyFacts

ADPSGD_MODES = ("serialised", "bipartite")


@dataclass(frozen=True, kw_only=True)
class GossipSettings(ProtocolSettings):
    """How often workers average in pairs, and how pairs are made."""

    proto_field = "gossip"

    rate_com: float = 1.0
    """Gossip: expected pairwise averagings per worker per gradient step (a2cid2 draws a
    Poisson number per step; below 1, one every Poisson(1/rate_com) steps)."""
    momentum: bool = True
    """a2cid2: continuous momentum (--no-momentum: the asynchronous gossip baseline)."""
    adpsgd_mode: str = "serialised"
    """adpsgd pairing: serialised (any connected graph; the coordinator orders overlapping
    pairs, so no deadlock) or bipartite (the paper's active/passive split)."""

    def validate(self) -> None:
        if not 0 < self.rate_com <= 100:
            raise ValueError(f"rate_com must be in (0, 100], got {self.rate_com}")
        if self.adpsgd_mode not in ADPSGD_MODES:
            raise ValueError(f"unknown adpsgd_mode {self.adpsgd_mode!r}; choose one of "
                             f"{', '.join(ADPSGD_MODES)}")

    def check_topology(self, run: RunFacts, topology: TopologyFacts) -> None:
        if (run.policy == "adpsgd" and self.adpsgd_mode == "bipartite"
                and not topology.bipartite):
            raise ValueError(
                f"adpsgd_mode bipartite needs a bipartite graph; the {topology.name} "
                f"topology on {topology.num_workers} workers has an odd cycle (use an even "
                "ring, or adpsgd_mode serialised, which works on any connected graph)")
