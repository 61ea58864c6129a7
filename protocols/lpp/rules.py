"""LAP-SGD and LPP-SGD (Chatterjee et al., "Scaling the Wild", arXiv:2203.06638,
Algorithm 1): the rules, as pure code.

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
  (worker/dataplane/preduce.py: DeltaAverager).

docs/lpp-sgd.md says where this implementation reads the paper one way or another;
docs/lpp-sgd-paper-spec.md extracts the paper.
"""

from __future__ import annotations

from collections.abc import Sequence

FULL_MODEL = 0
"""Block 0 is the whole model (Eq. 10); blocks 1..U partition it."""


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
