"""The fault kinds of a chaos trial, and its fault plan.

`FAULT_KINDS` is a table: a kind is a function that injects the fault into a running
trial (picks its victim among the trial's candidates, signals it, sets the exit code its
fate calls for, schedules what follows: a replacement, a coordinator restart) and returns
a `FaultRecord`. Add a kind there (a worker restarted from its checkpoint is the next)
and select it with `ripples chaos --faults`. `plan_faults` draws a trial's plan from its
seed: when each fault fires, of which kind, how long until its replacement.
"""

from __future__ import annotations

import functools
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ripples.bench.chaos_config import ChaosConfig
    from ripples.bench.chaos_trial import Trial

MIN_LIVE_AFTER_FAULT = 2
"""A fault is injected only if this many training workers remain after it (fewer, and the
run stops on purpose below the run's --min-workers, default 2)."""
FAULT_WINDOW = (0.05, 0.5)
"""Faults fire at fractions of the iteration budget drawn from this range, so that their
replacements have time to start, heal and train before the run ends."""


@dataclass(kw_only=True)
class PlannedFault:
    """One fault of a trial's plan, drawn before the trial starts."""

    kind: str
    progress: float
    """Fires once the live workers' mean iteration reaches this fraction of the budget."""
    replace_after: float
    """Seconds from the fault to the start of its replacement."""
    in_preduce: bool
    """Wait (briefly) for a victim that the coordinator sees inside a P-Reduce."""
    pick: float
    """Which victim among the candidates (a fraction of the list sorted by name)."""


@dataclass(kw_only=True)
class FaultRecord:
    """One injected fault, as it happened."""

    kind: str
    victim: str
    rank: int
    at_seconds: float
    """Since the trial started."""
    progress: float
    victim_state: str
    """The coordinator's view of the victim just before the fault (reducing: it held a
    delivered group, inside a P-Reduce)."""
    replacement: str = ""
    replacement_at_seconds: float | None = None
    heal_seconds: float | None = None
    """From the replacement's process start to its heal: its worker_healed event (a
    lock-step run's: checkpoint_restored; ripples/events.py)."""
    heal_after_imports_seconds: float | None = None
    """From the replacement's first sign of life after its imports (its first output
    line, or its worker_registered event if that came first) to its heal: it includes a
    wait for a vacancy (the victim's lease) when it started before one."""
    heal_after_registration_seconds: float | None = None
    """From the replacement's worker_registered event to its heal."""
    fault_to_heal_seconds: float | None = None
    heal_donor: int | None = None
    """The worker id it healed from (-1: a lock-step run's, restored from checkpoints)."""
    first_step_seconds: float | None = None
    """From the fault to the first iteration its replacement made after it healed (seen
    by the status polls)."""


@dataclass(frozen=True)
class FaultKind:
    """A kind of fault (`ripples chaos --faults`): what it does and how to inject it."""

    summary: str
    inject: Callable[[Trial, PlannedFault], FaultRecord | None]
    """Inject the fault into the running trial now, or return None if it cannot be now
    (no victim can be spared): the trial asks again at its next poll."""


def _signal_worker(sig: int, expected_exit: int | None) -> Callable[
        [Trial, PlannedFault], FaultRecord | None]:
    """The injection of a fault kind that sends a training worker `sig` and replaces it.

    Args:
        sig: The signal.
        expected_exit: The victim's exit code its fate calls for (None: any).

    Returns:
        The kind's `inject`: it picks the victim among the trial's candidates (none if
        fewer than MIN_LIVE_AFTER_FAULT would remain), waiting up to 2 s for one inside
        a P-Reduce if the plan says so, and schedules the replacement.
    """

    def inject(trial: Trial, planned: PlannedFault) -> FaultRecord | None:
        candidates = trial.candidates()
        if len(candidates) < MIN_LIVE_AFTER_FAULT + 1:
            return None
        if planned.in_preduce:  # poll fast for a victim that holds a group
            until = time.monotonic() + 2.0
            while time.monotonic() < until:
                reducing = [c for c in candidates if c[1].state == worker_state("REDUCING")]
                if reducing:
                    candidates = reducing
                    break
                time.sleep(0.02)
                candidates = trial.candidates(fast=True)
                if len(candidates) < MIN_LIVE_AFTER_FAULT + 1:
                    return None
        proc, status = candidates[min(int(planned.pick * len(candidates)), len(candidates) - 1)]
        proc.signal(sig)
        proc.fault, proc.expected_exit = planned.kind, expected_exit
        record = FaultRecord(kind=planned.kind, victim=proc.name, rank=status.rank,
                             at_seconds=trial.elapsed(), progress=trial.progress,
                             victim_state=state_name(status.state))
        trial.note(f"{planned.kind} {proc.name} (worker {status.worker_id}, rank "
                   f"{status.rank}, {record.victim_state}) at progress {trial.progress:.2f}; "
                   f"replacement in {planned.replace_after:.1f} s")
        trial.replace_later(record, planned.replace_after)
        return record
    return inject


def _restart_coordinator(trial: Trial, planned: PlannedFault) -> FaultRecord | None:
    """SIGKILL the coordinator; the trial starts it again on its port and state dir after
    the planned delay (`restart_coordinator_later`). The workers ride over the outage."""
    if len(trial.candidates()) < MIN_LIVE_AFTER_FAULT:
        return None
    old = trial.coordinator
    assert old is not None
    old.signal(signal.SIGKILL)
    old.fault, old.expected_exit = planned.kind, None
    record = FaultRecord(kind=planned.kind, victim=old.name, rank=-1,
                         at_seconds=trial.elapsed(), progress=trial.progress,
                         victim_state="serving")
    trial.note(f"{planned.kind}: SIGKILL {old.name} at progress {trial.progress:.2f}; "
               f"restart in {planned.replace_after:.1f} s")
    trial.restart_coordinator_later(planned.replace_after)
    return record


FAULT_KINDS: dict[str, FaultKind] = {
    "sigkill": FaultKind(
        "SIGKILL a training worker (sometimes inside a P-Reduce): its lease expires, a "
        "replacement takes its rank and heals", _signal_worker(signal.SIGKILL, None)),
    "sigterm": FaultKind(
        "SIGTERM a training worker: it finishes its step, saves its model, leaves cleanly "
        "(exit 0); a replacement takes its rank and heals", _signal_worker(signal.SIGTERM, 0)),
    "coordinator": FaultKind(
        "SIGKILL the coordinator and start it again on its address and --state-dir: the "
        "workers train on through the outage and the run resumes", _restart_coordinator),
}


def worker_state(name: str) -> int:
    """The coordinator's WorkerState value of a name (COMPUTING, REDUCING, ...)."""
    from ripples.v1 import coordinator_pb2 as pb

    return int(pb.WorkerState.Value(f"WORKER_STATE_{name}"))


def state_name(value: int) -> str:
    """A WorkerState value's name, in lower case (computing, reducing, ...)."""
    from ripples.v1 import coordinator_pb2 as pb

    return str(pb.WorkerState.Name(value)).removeprefix("WORKER_STATE_").lower()


@functools.cache
def training_states() -> tuple[int, ...]:
    """The coordinator's states of a worker that trains (between groups, waiting for one,
    or inside a P-Reduce)."""
    return tuple(worker_state(s) for s in ("COMPUTING", "WAITING", "REDUCING"))


def plan_faults(rng: random.Random, config: ChaosConfig) -> list[PlannedFault]:
    """Draw a trial's fault plan.

    Args:
        rng: The trial's random source (seeded with its seed).
        config: The chaos configuration (kinds, faults per trial, a fixed plan).

    Returns:
        The faults in firing order, the first of the first kind listed; a lock-step
        run's after its first checkpoint (which a restart round restores). With
        config.fault_at: the one fixed fault of `python -m ripples.bench.fault`.
    """
    lo, hi = FAULT_WINDOW
    if config.lockstep:  # after the first checkpoint, which a restart round restores
        lo = max(lo, (config.checkpoint_every + 20) / config.iterations)
        hi = max(hi, lo + 0.1)
    moments = sorted(rng.uniform(lo, hi) for _ in range(config.faults_per_trial))
    if config.fault_at is not None:
        return [PlannedFault(kind=config.faults[0], progress=config.fault_at,
                             replace_after=config.replace_after, in_preduce=False, pick=1.0)
                for _ in range(min(1, config.faults_per_trial))]
    plan = []
    for i, moment in enumerate(moments):
        kind = config.faults[0] if i == 0 else rng.choice(config.faults)
        plan.append(PlannedFault(kind=kind, progress=moment,
                                 replace_after=rng.uniform(0.0, 2.0),
                                 in_preduce=rng.random() < 0.5, pick=rng.random()))
    return plan
