"""Settings of the Ripples Group Generator (ripples-random, ripples-smart, and LAP/LPP-SGD
averaging in its groups)."""

from __future__ import annotations

from dataclasses import dataclass

from ripples.protocols.settings import ProtocolSettings, RunFacts

OVERLAP_PROTOCOLS = ("ripples-random", "ripples-smart")
"""The protocols whose P-Reduce may run in the background (overlap), and whose rounds
may be sized to the link (sync_share)."""
MAX_SYNC_SHARE = 0.9
"""The largest sync_share: above it a round would be mostly waiting."""


@dataclass(frozen=True, kw_only=True)
class GroupGeneratorSettings(ProtocolSettings):
    """How the coordinator forms P-Reduce groups."""

    proto_field = "group_generator"

    group_size: int = 3
    """P-Reduce group size for the random and smart group generators."""
    c_thres: int = 5
    """Smart GG slowdown filter: a worker joins a division only if c_i - c_w < c_thres."""
    inter_intra: bool = False
    """Smart GG: alternate Inter (head workers across nodes) and Intra (within a node) groups."""
    overlap: bool = False
    """Run each group's P-Reduce in the background while the worker trains on, and apply
    its result at a later step boundary (at the latest before the worker's next group):
    the averaging leaves the critical path, and the model takes the group's average one
    or more steps late (docs/gpu.md, "Averaging off the critical path")."""

    sync_share: float = 0.0
    """ripples-random, ripples-smart: rounds sized to the link. Each worker lengthens its
    rounds of local steps, from --local-steps H up to 8H, until its synchronisations
    (the wait for its group and the collectives) take at most this share of its time,
    from what it measured over its last rounds; 0: every round is H steps
    (docs/local-steps.md, "Rounds sized to the link")."""

    def validate(self) -> None:
        if not 0 <= self.sync_share <= MAX_SYNC_SHARE:
            raise ValueError(f"sync_share must be from 0 (off) to {MAX_SYNC_SHARE:g}, got "
                             f"{self.sync_share:g}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if self.c_thres < 1:
            raise ValueError(f"c_thres must be at least 1, got {self.c_thres}")

    def no_sharded_workers(self) -> str:
        if self.overlap:  # sized rounds (sync_share) are rank 0's, relayed
            return ("--overlap does not run on workers of several ranks: when a background "
                    "P-Reduce lands each rank would decide by its own clock (its shard's "
                    "collective), and a group's outcome needs every shard's; leave it out")
        return ""

    def check_overlap(self, run: RunFacts) -> None:
        """Raise ValueError if the run cannot overlap its averaging (checked for every
        protocol: one that would ignore the option refuses it instead)."""
        if not self.overlap:
            return
        if run.protocol not in OVERLAP_PROTOCOLS:
            raise ValueError(f"overlap is for {' and '.join(OVERLAP_PROTOCOLS)}, not "
                             f"{run.protocol} (lap-sgd and lpp-sgd average beside the "
                             "training already; the gossip protocols exchange in a thread "
                             "of their own; the lock-step ones wait for every peer)")
        if run.sharded:
            raise ValueError("overlap is not for a shard of a sharded job yet (its head "
                             "also averages at the root, on the same state)")

    def check_sync_share(self, run: RunFacts) -> None:
        """Raise ValueError if the run cannot size its rounds to the link (checked for
        every protocol, as overlap is)."""
        if not self.sync_share:
            return
        if run.protocol not in OVERLAP_PROTOCOLS:
            raise ValueError(f"sync_share is for {' and '.join(OVERLAP_PROTOCOLS)}, not "
                             f"{run.protocol} (their workers choose when to ask for a "
                             "group; the others synchronise on a schedule of their own)")
        if self.overlap:
            raise ValueError("sync_share sizes rounds to synchronisations in the "
                             "foreground; with overlap they are hidden already: leave "
                             "out one of them")
        if run.sharded:
            raise ValueError("sync_share is not for a shard of a sharded job (its head's "
                             "rounds at the root follow inter_period)")
