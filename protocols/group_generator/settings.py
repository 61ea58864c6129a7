"""Settings of the Ripples Group Generator (ripples-random, ripples-smart, and LAP/LPP-SGD
averaging in its groups)."""

from __future__ import annotations

from dataclasses import dataclass

from ripples.protocols.settings import ProtocolSettings


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

    def validate(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if self.c_thres < 1:
            raise ValueError(f"c_thres must be at least 1, got {self.c_thres}")
