"""Pairwise gossip state shared by the compute thread and the communication thread.

AD-PSGD and A2CiD2 average in pairs while the model keeps training (wait-free, AD-PSGD
Appendix A). Following docs/data-plane.md rule 6, the communication thread never
writes the model: it averages a snapshot and hands back a *delta*, which the compute
thread adds at the next step boundary.

For one exchange worker i sends w_i (its snapshot plus the deltas not yet applied) and
gets the pair average m = (w_i + w_j) / 2; its delta is m - w_i = (w_j - w_i) / 2 and the
partner's is the negation, so the workers' parameter sum is preserved exactly as atomic
averaging would (up to float rounding).

A2CiD2's momentum copy x~ is held as y = x~ - x: a gradient step moves x and x~ alike,
so y does not change then; the continuous mixing dx = eta (x~ - x) dt,
dx~ = eta (x - x~) dt becomes x += (1 - e^{-2 eta tau}) / 2 * y, y *= e^{-2 eta tau};
and an exchange with delta d (x += d, x~ += alpha~ * (x_j - x_i) = 2 alpha~ d) gives
y += (2 alpha~ - 1) d. No copy of the model before each step is needed.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class MomentumParameters:
    """A2CiD2's constants (docs/gossip.md, "A2CiD2: the algorithm and its constants"); eta = 0
    turns the momentum off."""

    eta: float = 0.0
    alpha_tilde: float = 0.5

    @property
    def enabled(self) -> bool:
        return self.eta > 0


class GossipState:
    """The model's flat buffer, a published snapshot, and pending exchange deltas.

    Invariant: the model the partners see (snapshot + delta) equals the local model at
    the last step boundary plus every exchange delta since; `delta` is added to the model
    exactly once (at the boundary that follows it).
    """

    def __init__(self, flat: torch.Tensor, momentum: MomentumParameters) -> None:
        self.flat = flat  # the model (the compute thread's)
        self.momentum = momentum
        self._lock = threading.Lock()
        with torch.no_grad():
            self._snapshot = flat.detach().clone()
            self._delta = torch.zeros_like(flat)
            self.y = torch.zeros_like(flat) if momentum.enabled else None  # x~ - x
        self._pending = False  # _delta holds something

    # ------------------------------------------------------------ compute thread
    def mix(self, tau: float) -> None:
        """Run the momentum dynamics for `tau` gradient-step units (no-op without it)."""
        if self.y is None or tau <= 0:
            return
        decay = math.exp(-2.0 * self.momentum.eta * tau)
        with torch.no_grad():
            self.flat.add_(self.y, alpha=(1.0 - decay) / 2.0)
            self.y.mul_(decay)

    def apply_and_publish(self) -> bool:
        """At a step boundary: add the pending deltas to the model (and momentum copy),
        then publish the model as the new snapshot. Returns whether any delta was added."""
        with torch.no_grad(), self._lock:
            applied = self._pending
            if applied:
                self.flat.add_(self._delta)
                if self.y is not None:
                    self.y.add_(self._delta, alpha=2.0 * self.momentum.alpha_tilde - 1.0)
                self._delta.zero_()
                self._pending = False
            self._snapshot.copy_(self.flat)
        return applied

    def restart(self, momentum_copy: torch.Tensor | None) -> None:
        """The model was replaced (a checkpoint restored): drop the deltas of exchanges
        with the old one, publish the new one, and take the momentum copy it was saved
        with (None: start it afresh, as at the run's start)."""
        with torch.no_grad(), self._lock:
            self._delta.zero_()
            self._pending = False
            self._snapshot.copy_(self.flat)
            if self.y is not None:
                if momentum_copy is None:
                    self.y.zero_()
                else:
                    self.y.copy_(momentum_copy)

    # ------------------------------------------------------------ communication thread
    def current(self, out: torch.Tensor) -> None:
        """Write the model as partners should see it (snapshot + pending deltas) to `out`."""
        with torch.no_grad(), self._lock:
            torch.add(self._snapshot, self._delta, out=out)

    def add_delta(self, delta: torch.Tensor) -> None:
        with torch.no_grad(), self._lock:
            self._delta.add_(delta)
            self._pending = True


def exchange_delta(mine: torch.Tensor, pair_average: torch.Tensor) -> float:
    """Turn `pair_average` ((w_i + w_j) / 2) into this worker's delta in place; returns
    ||w_i - w_j||^2 (the exchange's contribution to the consensus-distance estimate)."""
    with torch.no_grad():
        pair_average.sub_(mine)
        half_distance = float(torch.linalg.vector_norm(pair_average, dtype=torch.float64))
    return 4.0 * half_distance * half_distance


class StepCredit:
    """Averagings owed per gradient step.

    Poisson (A2CiD2's reference): rate >= 1 draws max(1, Poisson(rate)) per step; rate < 1
    averages once every max(1, Poisson(1 / rate)) steps. Deterministic (AD-PSGD): rate
    averagings per step as a running credit (1.0: one per step; 0.5: every other step).
    """

    def __init__(self, rate: float, rng: torch.Generator, *, poisson: bool) -> None:
        if rate <= 0:
            raise ValueError(f"rate_com must be positive, got {rate}")
        self.rate = rate
        self.rng = rng
        self.poisson = poisson
        self._credit = 0.0
        self._countdown = self._draw_gap() if poisson and rate < 1 else 0

    def _poisson(self, mean: float) -> int:
        return int(torch.poisson(torch.tensor([mean]), generator=self.rng).item())

    def _draw_gap(self) -> int:
        return max(1, self._poisson(1.0 / self.rate))

    def next_step(self) -> int:
        if not self.poisson:
            self._credit += self.rate
            owed = int(self._credit)
            self._credit -= owed
            return owed
        if self.rate >= 1:
            return max(1, self._poisson(self.rate))
        self._countdown -= 1
        if self._countdown > 0:
            return 0
        self._countdown = self._draw_gap()
        return 1
