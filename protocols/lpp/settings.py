"""Settings of LAP-SGD and LPP-SGD (Hogwild updaters per worker, background averaging)."""

from __future__ import annotations

from dataclasses import dataclass

from ripples.protocols.settings import ProtocolSettings, RunFacts

LPP_AVERAGING = ("all", "ripples-random", "ripples-smart")


@dataclass(frozen=True, kw_only=True)
class LppSettings(ProtocolSettings):
    """The knobs of one LAP-SGD / LPP-SGD run; validate() names what is wrong."""

    proto_field = "lpp"
    cli_names = {"averaging": "lpp_averaging"}

    updaters: int = 2
    """lap-sgd, lpp-sgd: Hogwild updater processes per worker sharing its model (U)."""
    averaging: str = "all"
    """lap-sgd, lpp-sgd: average over all workers at once (all, the paper), or in the
    Group Generator's groups (ripples-random, ripples-smart)."""
    sync_period: int = 1
    """lap-sgd, lpp-sgd: average after every update until half the budget, then every
    this many updates (H). The paper's 16 goes with its decaying learning rate; with a
    task's constant rate it raised synthetic-cnn's loss after T/2 (docs/lpp-sgd.md)."""
    full_fraction: float = 0.1
    """lpp-sgd: update the full model for this fraction of the budget (T_st / T), then
    alternate between an updater's own block and the full model."""

    def check_run(self, run: RunFacts) -> None:
        if run.task and run.iterations == 0 and run.epochs == 0:
            raise ValueError(f"{run.protocol} needs a budget of iterations or epochs: the "
                             "full-model phase and the synchronisation scheme are fractions "
                             "of it")

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

    def full_until(self, budget: int, *, partial: bool) -> int:
        """T_st for a budget of T updates (LAP-SGD, not partial: the whole run)."""
        return int(self.full_fraction * budget) if partial else budget

    def sync_frequency(self, s: int, budget: int) -> int:
        """K_j: updates between two averaging rounds once the counter reads s."""
        return 1 if 2 * s < budget else self.sync_period
