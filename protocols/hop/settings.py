"""Hop's settings, and Table 1's bound on the iteration gap between two workers."""

from __future__ import annotations

from dataclasses import dataclass

from ripples.protocols.settings import ProtocolSettings

HOP_MODES = ("standard", "backup", "staleness")


@dataclass(frozen=True, kw_only=True)
class HopSettings(ProtocolSettings):
    """Hop's knobs; every field is validated by validate()."""

    proto_field = "hop"
    cli_names = {"mode": "hop_mode"}
    limits = {"max_ig": (1, 10_000), "staleness": (0, 10_000), "max_jump": (0, 10_000),
              "skip_threshold": (0, 10_000), "backup_workers": (0, 100_000)}
    """A worker keeps max_ig + 1 update slots: an iteration gap past 10,000 is a typo."""

    mode: str = "standard"
    """hop: standard (every in-neighbour's update each iteration), backup (backup workers:
    backup_workers updates may be missing) or staleness (updates up to `staleness`
    iterations old count, weighted by age)."""
    max_ig: int = 4
    """hop: token queues keep a worker at most this many iterations ahead of an
    out-neighbour."""
    backup_workers: int = 1
    """hop backup mode: updates per iteration a worker may go without (N_buw)."""
    staleness: int = 5
    """hop staleness mode: the oldest usable update is from iteration k - staleness."""
    max_jump: int = 0
    """hop: a straggler may skip up to this many iterations at once (0: never; needs
    backup or staleness mode, at most max_ig)."""
    skip_threshold: int = 2
    """hop: skip only when more than this many iterations behind every out-neighbour."""

    def validate(self) -> None:
        if self.mode not in HOP_MODES:
            raise ValueError(f"unknown hop mode {self.mode!r}; choose one of "
                             f"{', '.join(HOP_MODES)}")
        if self.max_ig < 1:
            raise ValueError(f"max_ig must be at least 1, got {self.max_ig}")
        if self.mode == "backup" and self.backup_workers < 1:
            raise ValueError(f"backup mode needs backup_workers >= 1, got {self.backup_workers}")
        if self.mode == "staleness" and self.staleness < 0:
            raise ValueError(f"staleness must be at least 0, got {self.staleness}")
        if self.max_jump < 0 or self.skip_threshold < 0:
            raise ValueError("max_jump and skip_threshold must be at least 0")
        if self.max_jump > 0 and self.mode == "standard":
            raise ValueError("skipping iterations needs backup workers or bounded staleness "
                             "(§5): in standard mode the neighbours would wait forever for the "
                             "updates of the skipped iterations")
        if self.max_jump > self.max_ig:
            raise ValueError(f"max_jump ({self.max_jump}) may not exceed max_ig "
                             f"({self.max_ig}): a longer jump could wait for updates that "
                             "the tokens keep the neighbours from sending")

    def gap_bound(self, hops_ahead: int, hops_behind: int) -> int:
        """Table 1: the most Iter(i) may exceed Iter(j), where j is `hops_ahead` hops
        downstream of i (i -> ... -> j) and i is `hops_behind` hops downstream of j.
        Tokens give max_ig per hop from i to j (Theorem 2, every mode); a Recv that waits
        for every in-neighbour gives b0 per hop from j to i (Theorem 1: 1 in standard
        mode, s + 1 with bounded staleness; backup workers give no such bound, and with
        skipping a worker enters an iteration before the Recv that would hold it)."""
        bound = self.max_ig * hops_ahead
        b0 = {"standard": 1, "staleness": self.staleness + 1}.get(self.mode)
        if b0 is None or self.max_jump > 0:  # a jump enters k before its Recv(k - 1)
            return bound
        return min(bound, b0 * hops_behind)
