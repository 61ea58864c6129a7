"""LAP-SGD and LPP-SGD (../shared/papers/lpp-sgd.txt, Algorithm 1): the rules, as pure code.

Each worker hosts U updater processes that share one model and update it lock-free
(Hogwild), each with its own data stream and optimizer state, and one averaging process
that averages the model across workers. A shared counter, read and incremented
atomically by every updater, orders the updates and drives the schedule:

- Block selection (§3.2): LAP-SGD updates the full model every step. LPP-SGD updates the
  full model while s <= T_st, then alternates, per updater, between its own block of the
  parameters and the full model. Blocks are contiguous runs of whole tensors of about
  equal parameter counts, one per updater (§3.1; the paper's cost criterion is not given,
  the authors' code splits by count).
- Synchronisation frequency (§3.3): an averaging round starts once K_j updates were made
  since the last one began: K_j = 1 while s < T/2, then H.
- Averaging (lines 13-16): snapshot v, average the snapshots across workers, add
  avg - v to the live model in place, so updates made during the exchange survive
  (worker/preduce.py: DeltaAverager).

docs/lpp-sgd.md says where this implementation reads the paper one way or another;
docs/lpp-sgd-paper-spec.md extracts the paper.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

LPP_PROTOCOLS = ("lap-sgd", "lpp-sgd")
LPP_AVERAGING = ("all", "ripples-random", "ripples-smart")
FULL_MODEL = 0
"""Block 0 is the whole model (Eq. 10); blocks 1..U partition it."""


@dataclass(frozen=True, kw_only=True)
class LppSettings:
    """The knobs of one LAP-SGD / LPP-SGD run; validate() names what is wrong."""

    partial: bool = True
    """LPP-SGD (partial backpropagation) or LAP-SGD (always the full model)."""
    updaters: int = 2
    """U: updater processes per worker, sharing its model."""
    sync_period: int = 1
    """H: after half the budget, average every H updates (before: after every update)."""
    full_fraction: float = 0.1
    """LPP-SGD: T_st = full_fraction x T, the full-model phase (the paper: T/10)."""
    averaging: str = "all"
    """all: every worker averages together (the paper); ripples-random / ripples-smart:
    in groups made by the coordinator's Group Generator (P-Reduce)."""

    @classmethod
    def of_run(cls, run: Any) -> LppSettings:
        """From a run's options (RunSettings or its RunConfig message: same field names)."""
        return cls(partial=run.protocol == "lpp-sgd", updaters=run.updaters,
                   sync_period=run.sync_period, full_fraction=run.full_fraction,
                   averaging=run.lpp_averaging)

    def validate(self) -> None:
        if not 1 <= self.updaters <= 64:
            raise ValueError(f"updaters must be in 1..64, got {self.updaters}")
        if self.sync_period < 1:
            raise ValueError(f"sync_period must be at least 1, got {self.sync_period}")
        if not 0.0 <= self.full_fraction <= 1.0:
            raise ValueError(f"full_fraction must be in [0, 1], got {self.full_fraction}")
        if self.averaging not in LPP_AVERAGING:
            raise ValueError(f"unknown lpp_averaging {self.averaging!r}; choose one of "
                             f"{', '.join(LPP_AVERAGING)}")

    def full_until(self, budget: int) -> int:
        """T_st for a budget of T updates (LAP-SGD: the whole run)."""
        return int(self.full_fraction * budget) if self.partial else budget

    def sync_frequency(self, s: int, budget: int) -> int:
        """K_j: updates between two averaging rounds once the counter reads s."""
        return 1 if 2 * s < budget else self.sync_period


def partition_blocks(sizes: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Cut tensors of these sizes, in order, into `parts` contiguous non-empty runs of
    about equal total size: [(first tensor, end tensor), ...] covering every tensor once.
    Each cut is the tensor boundary nearest k/parts of the total that leaves every block
    at least one tensor."""
    n = len(sizes)
    if parts < 1:
        raise ValueError(f"need at least one block, got {parts}")
    if n < parts:
        raise ValueError(f"the model has {n} parameter tensors, too few for {parts} blocks "
                         "(one per updater): use fewer updaters")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    cuts = [0]
    for k in range(1, parts):
        target = k * prefix[-1] / parts
        lowest, highest = cuts[-1] + 1, n - (parts - k)
        cuts.append(min(range(lowest, highest + 1), key=lambda i: abs(prefix[i] - target)))
    cuts.append(n)
    return list(zip(cuts[:-1], cuts[1:], strict=True))


class BlockSelection:
    """One updater's Block Selection Rule (§3.2): the full model while s <= T_st (always,
    for LAP-SGD), then alternately its own block and the full model."""

    def __init__(self, own_block: int, full_until: int) -> None:
        if own_block < 1:
            raise ValueError("blocks of updaters are numbered from 1 (0 is the full model)")
        self.own_block, self.full_until = own_block, full_until
        self._own_next = True  # the first step after T_st is a partial one

    def select(self, s: int) -> int:
        """The block to update at counter value s (FULL_MODEL or own_block)."""
        if s <= self.full_until:
            return FULL_MODEL
        block = self.own_block if self._own_next else FULL_MODEL
        self._own_next = not self._own_next
        return block
