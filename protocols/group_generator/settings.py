"""Settings of the Ripples Group Generator (ripples-random, ripples-smart, and LAP/LPP-SGD
averaging in its groups)."""

from __future__ import annotations

from dataclasses import dataclass

from ripples.protocols.settings import ProtocolSettings
from ripples.rpc import parse_target


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
    root: str = ""
    """Sharded jobs: HOST:PORT of the root coordinator, whose run's members are the heads
    of every shard. This run is then one shard: its head (rank 0) also P-Reduces in the
    root's groups every inter_period iterations, and `ripples stop` on the root stops
    this run too (docs/scale.md). Empty: a run of its own."""
    inter_period: int = 4
    """Sharded jobs: the head's every inter_period-th iteration averages in a root group
    (with other shards' heads) instead of one of its shard."""

    def validate(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be at least 2, got {self.group_size}")
        if self.c_thres < 1:
            raise ValueError(f"c_thres must be at least 1, got {self.c_thres}")
        if self.inter_period < 1:
            raise ValueError(f"inter_period must be at least 1, got {self.inter_period}")
        if self.root:
            try:
                parse_target(self.root)
            except ValueError:
                raise ValueError(f"root must be the root coordinator's HOST:PORT, got "
                                 f"{self.root!r}") from None
