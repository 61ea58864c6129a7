"""Rounds of local steps: a run synchronises every H optimizer steps (--local-steps H),
so a round ends at every multiple of H. Lock-step protocols, the group runtimes and the
checkpointer (which saves at a round's end) count rounds alike.

With `--sync-share F` (ripples-random, ripples-smart) a worker sizes its own rounds to
its link instead (`RoundSizer`): H to 8H steps, each worker its own. Its periodic
checkpoints still fall on multiples of H, which may then be inside a round; an elastic
protocol's worker restores that as it is (the outer state keeps its steps since its last
synchronisation, worker/dataplane/outer_state.py).
"""

from __future__ import annotations

import math

from ripples.v1 import coordinator_pb2 as pb

LONGEST_ROUND = 8
"""Rounds sized to the link (sync_share) grow to at most this many times H."""
SMOOTHING = 0.3
"""The weight of the newest round in the running means of a round's synchronisation
time and a step's time: one slow group (a partner late to it) moves the round length a
little, a slow link for good."""


def local_steps(config: pb.RunConfig) -> int:
    """The run's H: a synchronisation every this many optimizer steps (a RunConfig built
    by hand has 0: every step)."""
    return max(1, config.local_steps)


def next_multiple(step: int, every: int) -> int:
    """The first multiple of `every` at or after `step` (a round's end, with every = H)."""
    return -(-step // every) * every


class RoundSizer:
    """Rounds sized to the link (GroupGeneratorSettings.sync_share): after each round, the
    next one's length in steps, the fewest from H to 8H whose compute makes the
    synchronisation at most `share` of the round's time,

        steps ≥ sync_seconds (1 − share) / (share · step_seconds),

    from running means of the synchronisations' and the steps' seconds this worker
    measured (a slow link lengthens its rounds; a fast one keeps them at H)."""

    def __init__(self, shortest: int, share: float) -> None:
        self.shortest, self.share = shortest, share
        self.longest = LONGEST_ROUND * shortest
        self.steps = shortest
        """The current round's length."""
        self._sync: float | None = None
        self._step: float | None = None

    def next_round(self, sync_seconds: float, step_seconds: float) -> int:
        """The next round's length, after a round whose steps took `step_seconds` each
        and whose synchronisation `sync_seconds` (a negative or zero step time, as after
        a resume, keeps the length)."""
        if step_seconds <= 0 or sync_seconds < 0:
            return self.steps
        self._sync = _running_mean(self._sync, sync_seconds)
        self._step = _running_mean(self._step, step_seconds)
        needed = self._sync * (1 - self.share) / (self.share * self._step)
        self.steps = max(self.shortest, min(self.longest, math.ceil(needed)))
        return self.steps


def _running_mean(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new
