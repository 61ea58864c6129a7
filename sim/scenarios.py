"""Heterogeneity scenarios of the papers' evaluations, as `ripples run --slowdown` flags."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Scenario:
    """How the workers of one benchmark run are slowed down."""

    name: str
    description: str
    factor: float = 1.0
    """How many times slower an affected worker is (1: nobody is slowed)."""
    random: bool = False
    """False: worker 0 is slow every iteration. True: every worker is slow with probability
    1/n in each iteration (seeded)."""

    def slowed_ranks(self) -> frozenset[int]:
        """The workers slowed in every iteration (the rest are 'the others')."""
        return frozenset({0}) if self.factor != 1.0 and not self.random else frozenset()

    def slowdowns(self, num_workers: int) -> dict[int, str]:
        """rank -> FACTOR[@PROBABILITY] of every slowed worker."""
        if self.factor == 1.0:
            return {}
        if not self.random:
            return {rank: f"{self.factor:g}" for rank in sorted(self.slowed_ranks())}
        return {rank: f"{self.factor:g}@{1 / num_workers:.6g}" for rank in range(num_workers)}

    def slowdown_flags(self, num_workers: int) -> list[str]:
        """The `ripples run --slowdown RANK:SPEC` flags."""
        return [arg for rank, spec in self.slowdowns(num_workers).items()
                for arg in ("--slowdown", f"{rank}:{spec}")]


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(name="homogeneous", description="every worker at full speed"),
    Scenario(name="slow-2x", factor=2.0, description="worker 0 2x slower (Ripples §7.4)"),
    Scenario(name="slow-4x", factor=4.0,
             description="worker 0 4x slower (Hop §7.3.5: skipping iterations)"),
    Scenario(name="slow-5x", factor=5.0, description="worker 0 5x slower (Ripples §7.4)"),
    Scenario(name="slow-10x", factor=10.0,
             description="worker 0 10x slower (AD-PSGD §5.4)"),
    Scenario(name="random-6x", factor=6.0, random=True,
             description="each worker 6x slower with probability 1/n per iteration (Hop §7.3.1)"),
)}
