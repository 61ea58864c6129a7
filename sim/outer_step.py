"""The outer optimizer on the simulator's vectors: the rule of `OuterState`
(worker/dataplane/outer_state.py, docs/local-steps.md) in numpy, over one group's rows.

Plain data and arithmetic, without torch: the consensus model (sim/models.py) holds each
worker's anchor and momentum beside its vector and calls `OuterStep.group` where a real
group's members would call `outer_preduce` (or, in a gossip exchange,
`OuterState.exchange`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class OuterStep:
    """Nesterov SGD on the pseudo-gradient, as a group of k members applies it.

    Member j brings x_j (its vector as the collective sees it), its anchor φ_j and its
    momentum m_j. A member that *spends* its progress (it took local steps since its last
    spent synchronisation and, in gossip, the exchange is its own) takes its provisional
    step, torch's `SGD(lr=η, momentum=μ, nesterov=True)` with grad Δ_j:

        Δ_j = φ_j − x_j,    m̂_j = μ m_j + Δ_j,    φ̂_j = φ_j − η (Δ_j + μ m̂_j);

    the others contribute φ̂_j = φ_j, m̂_j = m_j. Every member then leaves with

        φ' = mean_j φ̂_j,    m' = mean_j m̂_j,

    and its vector moves by φ' − x_j if it spent (it becomes the new anchor, plus any
    steps taken since x_j was seen), by φ' − φ_j if not (it keeps its progress, which
    counts in its own next spent step). With every worker in the group and equal anchors
    this is DiLoCo's step; with η = 1, μ = 0 the spenders' φ̂_j = x_j: plain averaging.
    """

    lr: float
    """η: outer_lr."""
    momentum: float
    """μ: outer_momentum."""
    compression: str = "none"
    """outer_compression: with bf16 the gradient-like part travels in half the bytes."""

    @property
    def group_vectors(self) -> float:
        """Model-sized vectors a member feeds into a group-form synchronisation (as
        `OuterState.sent_bytes`): the provisional anchor, and the momentum (none with
        μ = 0, where it never counts; half a vector in bf16)."""
        if self.momentum == 0:
            return 1.0
        return 1.5 if self.compression == "bf16" else 2.0

    @property
    def delta_vectors(self) -> float:
        """Model-sized vectors of allreduce's pseudo-gradient (half a vector in bf16)."""
        return 0.5 if self.compression == "bf16" else 1.0

    def group(self, anchor: np.ndarray, momentum: np.ndarray, seen: np.ndarray,
              spend: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One synchronisation over the members' rows (k x dim arrays; `spend` k bools):
        the group's anchor φ' and momentum m' (dim each), and each member's move (k x
        dim) to add to its vector. The operations are OuterState's, in its order."""
        delta = anchor - seen                                      # Δ
        moment = self.momentum * momentum + delta                  # m̂ = μ m + Δ
        step = anchor - self.lr * (delta + self.momentum * moment)  # φ − η (Δ + μ m̂)
        keep = ~spend[:, None]
        provisional_anchor = np.where(keep, anchor, step)
        provisional_moment = np.where(keep, momentum, moment)
        new_anchor = provisional_anchor.mean(axis=0)
        new_momentum = provisional_moment.mean(axis=0)
        moves = new_anchor - np.where(keep, anchor, seen)
        return new_anchor, new_momentum, moves
