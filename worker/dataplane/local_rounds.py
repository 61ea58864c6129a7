"""Rounds of local steps: a run synchronises every H optimizer steps (--local-steps H),
so a round ends at every multiple of H. Lock-step protocols, the group runtimes and the
checkpointer (which saves at a round's end) count rounds alike.
"""

from __future__ import annotations

from ripples.v1 import coordinator_pb2 as pb


def local_steps(config: pb.RunConfig) -> int:
    """The run's H: a synchronisation every this many optimizer steps (a RunConfig built
    by hand has 0: every step)."""
    return max(1, config.local_steps)


def next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` at or after `step` (a round's end, with every = H)."""
    return -(-step // every) * every
