"""Heterogeneity injection for experiments: make a worker a deterministic or random straggler."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class SlowdownSpec:
    """`factor` times slower, on every iteration (probability 1) or at random.

    As in the Ripples experiments, a slowed iteration also sleeps (factor - 1) times its
    measured compute time, so the worker behaves like a device `factor` times slower.
    """

    factor: float = 1.0
    probability: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"slowdown factor must be at least 1, got {self.factor}")
        if not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"slowdown probability must be in [0, 1], got {self.probability}")

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> SlowdownSpec:
        """`FACTOR` (always) or `FACTOR@PROBABILITY` (each iteration with that probability)."""
        factor_text, _, prob_text = text.partition("@")
        try:
            factor = float(factor_text)
            probability = float(prob_text) if prob_text else 1.0
        except ValueError:
            raise ValueError(
                f"malformed slowdown {text!r}: write FACTOR (e.g. 5) or FACTOR@PROBABILITY "
                "(e.g. 6@0.125)"
            ) from None
        return cls(factor=factor, probability=probability, seed=seed)

    @property
    def active(self) -> bool:
        return self.factor > 1.0 and self.probability > 0.0


class Slowdown:
    """Sleeps after a gradient step as its spec says; seeded, so runs repeat."""

    def __init__(self, spec: SlowdownSpec) -> None:
        self.spec = spec
        self._rng = random.Random(spec.seed)

    def after_compute(self, compute_seconds: float) -> float:
        """Sleep if this iteration is slowed; returns the seconds slept."""
        if not self.spec.active:
            return 0.0
        if self.spec.probability < 1.0 and self._rng.random() >= self.spec.probability:
            return 0.0
        seconds = (self.spec.factor - 1.0) * compute_seconds
        time.sleep(seconds)
        return seconds
