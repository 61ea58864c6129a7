"""What `ripples chaos` runs: the configuration of its trials.

The protocols a trial may run (elastic ones, whose replacements heal from a live peer;
lock-step ones, whose faults open restart rounds from checkpoints), and `ChaosConfig`:
the trials, their seeds, the run's size and budget, the fault kinds (bench/chaos_faults.py)
and how many per trial, the deadline and the accuracy floor.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ripples.bench.chaos_faults import FAULT_KINDS, MIN_LIVE_AFTER_FAULT
from ripples.protocols.registry import DEFAULT_PROTOCOL, PROTOCOLS
from ripples.protocols.spec import Coordination, Membership

ELASTIC_PROTOCOLS = tuple(name for name, spec in PROTOCOLS.items()
                          if spec.library and spec.membership is Membership.ELASTIC)
"""Elastic protocols a trial may run (their specs say so): a replacement takes its
victim's rank and heals from a live peer."""
LOCKSTEP_PROTOCOLS = tuple(
    name for name, spec in PROTOCOLS.items()
    if spec.library and spec.membership is Membership.RESTART
    and spec.role.coordination is Coordination.LOCKSTEP)
"""Lock-step protocols a trial may run: a fault opens a restart round (every worker
restarts from the last checkpoint), a replacement joins it."""


@dataclass(kw_only=True)
class ChaosConfig:
    """What `ripples chaos` runs. Every trial is one run of `workers` workers."""

    trials: int = 1
    seed: int = 0
    """Trial i uses seed + i (for its run and its fault plan): rerun one with --trials 1."""
    workers: int = 4
    iterations: int = 1500
    """Per-worker iteration budget of each run."""
    lease_seconds: float = 2.0
    faults: tuple[str, ...] = ("sigkill", "sigterm", "coordinator")
    """Fault kinds to draw from (keys of FAULT_KINDS); the first fault of a trial is the
    first kind listed."""
    faults_per_trial: int = 3
    min_accuracy: float = 0.85
    deadline_seconds: float = 240.0
    """Every process of a trial must have exited this long after the trial started."""
    workdir: Path | None = None
    """Logs and models of every trial go under here (kept); default: a temporary folder
    whose passing trials are removed (failing ones are kept and named)."""
    task: str = "digits"
    protocol: str = DEFAULT_PROTOCOL
    """An elastic protocol (ELASTIC_PROTOCOLS: replacements heal) or a lock-step one
    (LOCKSTEP_PROTOCOLS: restart rounds)."""
    checkpoint_every: int = 250
    """Workers checkpoint every this many steps (0: not at all); every checkpoint left
    must load, with finite values. Lock-step runs restart from them."""
    python: str = sys.executable
    batch_size: int = 0
    """Per-worker batch (0: the task's default)."""
    fault_at: float | None = None
    """Fire the first fault at this fraction of the budget, into the last candidate
    (sorted by name), outside any wait for a P-Reduce, with its replacement
    `replace_after` seconds later: a fixed plan (`python -m ripples.bench.fault`).
    None: drawn from the seed."""
    replace_after: float = 0.0
    """The fixed plan's delay before a replacement starts."""

    @property
    def lockstep(self) -> bool:
        """Its protocol is lock-step: a fault opens a restart round."""
        return self.protocol in LOCKSTEP_PROTOCOLS

    def __post_init__(self) -> None:
        """Check the configuration.

        Raises:
            ValueError: an unknown fault kind or protocol, too few workers, or a value
                out of its range (the message says which).
        """
        unknown = [k for k in self.faults if k not in FAULT_KINDS]
        if unknown or not self.faults:
            raise ValueError(f"unknown fault kind(s) {unknown or '(none)'}; choose from "
                             f"{', '.join(FAULT_KINDS)}")
        if self.workers < MIN_LIVE_AFTER_FAULT + 1:
            raise ValueError(f"a chaos trial needs at least {MIN_LIVE_AFTER_FAULT + 1} workers")
        if self.trials < 1 or self.iterations < 1 or self.faults_per_trial < 0:
            raise ValueError("trials and iterations must be positive, faults_per_trial >= 0")
        protocols = (*ELASTIC_PROTOCOLS, *LOCKSTEP_PROTOCOLS)
        if self.protocol not in protocols:
            raise ValueError(f"chaos trials run {', '.join(protocols)}, not {self.protocol}")
        if self.lockstep and not self.checkpoint_every:
            raise ValueError(f"{self.protocol} restarts from checkpoints: give "
                             "--checkpoint-every")
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must not be negative")
        if self.fault_at is not None and not 0 < self.fault_at < 1:
            raise ValueError(f"fault_at is a fraction of the budget in (0, 1), not "
                             f"{self.fault_at}")
        if self.replace_after < 0 or self.batch_size < 0:
            raise ValueError("replace_after and batch_size must not be negative")
