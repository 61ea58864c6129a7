"""How adpsgd and a2cid2 differ on their workers, read by their shared runtime and
simulator model (this package's own files: nothing else knows the two apart)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class GossipVariant:
    """How one gossip protocol behaves on its workers."""

    listens: bool
    """While it owes no averaging, a worker listens: a partner that picks it is served
    at once (AD-PSGD's passive side)."""
    poisson: bool
    """A step owes a Poisson(rate_com) number of averagings (A2CiD2's clock), not a
    fixed rate."""
    momentum: bool
    """A2CiD2's continuous momentum (with GossipSettings.momentum)."""
    pairs_at_once: bool
    """The coordinator pairs available workers first come, first served, and a pair
    executes at once: every exchange settles one owed averaging."""


ADPSGD_VARIANT = GossipVariant(listens=True, poisson=False, momentum=False, pairs_at_once=False)
A2CID2_VARIANT = GossipVariant(listens=False, poisson=True, momentum=True, pairs_at_once=True)


VARIANTS: dict[str, GossipVariant] = {"adpsgd": ADPSGD_VARIANT, "a2cid2": A2CID2_VARIANT}
"""Protocol name (spec.py) -> how its workers behave."""
