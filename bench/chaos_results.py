"""The results of chaos trials: one trial's verdict and figures, a batch's summary.

`TrialResult` is what a trial (bench/chaos_trial.py) found; `summarise` counts a batch's
passes, failures, hangs, lost runs, faults and heals and spreads its times;
`format_summary` prints it.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

from ripples.bench.chaos_faults import FaultRecord

HEAL_GOAL_SECONDS = 10.0
"""The goal: a replacement heals within this long of starting, after its imports."""
LONG_STALL_SECONDS = 10.0
"""Summaries count the trials whose longest stall exceeded this (several leases: more
than waiting for a dead member's lease to expire)."""


@dataclass(kw_only=True)
class TrialResult:
    """What one trial did and found: its verdict (ok, or a HANG, a LOST run, failures
    that say what broke), its faults and heals, its stalls, its run's figures."""

    index: int
    seed: int
    ok: bool = False
    hang: bool = False
    lost: bool = False
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    training_seconds: float = 0.0
    """The coordinator's elapsed time of the run (training started to the stop)."""
    stop_reason: str = ""
    """Why the run stopped, as text (its run_ended event's reason; else the last status
    polled; else a worker's worker_finished event)."""
    accuracy: float | None = None
    faults: list[FaultRecord] = field(default_factory=list)
    skipped_faults: list[str] = field(default_factory=list)
    heals: int = 0
    longest_stall_seconds: float = 0.0
    """Longest time a training worker that had not been faulted made no iteration (seen
    by status polls every POLL_SECONDS, while the run trained)."""
    longest_stall_worker: str = ""
    stall_after_fault_seconds: float = 0.0
    """The survivors' stall: the longest time one of the run's first workers that was not
    faulted went between iteration changes, over the polls after the first fault."""
    step_seconds_before_fault: float | None = None
    """The survivors' median time between iteration changes before the first fault, as
    the polls see them (what no stall looks like)."""
    longest_step_before_fault_seconds: float | None = None
    """The survivors' longest time between iteration changes before the first fault."""
    groups_failed: int = 0
    groups_cancelled: int = 0
    restart_rounds: int = 0
    """Lock-step runs: restart rounds the faults opened."""
    checkpoints: int = 0
    """Checkpoint files left at the end, each loaded and checked."""
    corrupt_checkpoints: int = 0
    partial_checkpoints: int = 0
    """Hidden partial files of writers killed mid-write (never under a checkpoint name)."""
    directory: str = ""

    def line(self) -> str:
        """The trial in one line (`ripples chaos` prints one per trial), then one line per
        failure and the folder that keeps its logs."""
        faults = " ".join(
            f"{f.kind}({f.victim} rank {f.rank}, {f.victim_state})@{f.progress:.2f}"
            + (f"->{f.replacement} healed {f.heal_seconds:.1f}s" if f.heal_seconds is not None
               else f"->{f.replacement or '-'} no heal")
            for f in self.faults)
        acc = f"{self.accuracy:.3f}" if self.accuracy is not None else "-"
        head = f"trial {self.index} seed {self.seed}: "
        head += "ok" if self.ok else ("HANG" if self.hang else "LOST" if self.lost else "FAILED")
        text = (f"{head} {self.seconds:.1f} s (training {self.training_seconds:.1f} s), "
                f"accuracy {acc}, longest stall {self.longest_stall_seconds:.1f} s, "
                f"groups failed {self.groups_failed}; faults: {faults or 'none'}")
        if self.failures:
            text += "\n    " + "\n    ".join(self.failures)
            text += f"\n    logs: {self.directory}"
        return text


def _spread(values: list[float]) -> dict[str, float] | None:
    """min, median and max of the values, rounded to ms (None if there are none)."""
    if not values:
        return None
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3)}


def summarise(results: list[TrialResult]) -> dict[str, Any]:
    """The summary of a batch of trials.

    Args:
        results: The trials' results.

    Returns:
        The counts (passed, failed, hangs, lost runs, faults by kind, heals, ...), the
        spreads of the times (`_spread`), and every result as a dict (JSON-ready).
    """
    faults = [f for r in results for f in r.faults]
    after_imports = [f.heal_after_imports_seconds for f in faults
                     if f.heal_after_imports_seconds is not None]
    kinds: dict[str, int] = {}
    for f in faults:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    return {
        "trials": len(results),
        "passed": sum(r.ok for r in results),
        "failed": sum(not r.ok for r in results),
        "hangs": sum(r.hang for r in results),
        "lost_runs": sum(r.lost for r in results),
        "failed_seeds": [r.seed for r in results if not r.ok],
        "faults": kinds,
        "faults_inside_preduce": sum(f.victim_state == "reducing" for f in faults),
        "skipped_faults": sum(len(r.skipped_faults) for r in results),
        "heals": sum(r.heals for r in results),
        "heal_seconds": _spread([f.heal_seconds for f in faults if f.heal_seconds is not None]),
        "fault_to_heal_seconds": _spread([f.fault_to_heal_seconds for f in faults
                                          if f.fault_to_heal_seconds is not None]),
        "heal_after_imports_seconds": _spread(after_imports),
        "heal_after_registration_seconds": _spread(
            [f.heal_after_registration_seconds for f in faults
             if f.heal_after_registration_seconds is not None]),
        "heals_within_goal": sum(v <= HEAL_GOAL_SECONDS for v in after_imports),
        "longest_stall_seconds": _spread([r.longest_stall_seconds for r in results]),
        "long_stall_seeds": [r.seed for r in results
                             if r.longest_stall_seconds > LONG_STALL_SECONDS],
        "trial_seconds": _spread([r.seconds for r in results]),
        "training_seconds": _spread([r.training_seconds for r in results]),
        "accuracy": _spread([r.accuracy for r in results if r.accuracy is not None]),
        "groups_failed": sum(r.groups_failed for r in results),
        "groups_cancelled": sum(r.groups_cancelled for r in results),
        "restart_rounds": sum(r.restart_rounds for r in results),
        "checkpoints_loaded": sum(r.checkpoints for r in results),
        "corrupt_checkpoints": sum(r.corrupt_checkpoints for r in results),
        "partial_checkpoint_files": sum(r.partial_checkpoints for r in results),
        "results": [asdict(r) for r in results],
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary (`summarise`) as the lines `ripples chaos` prints after its trials."""
    def spread(key: str) -> str:
        s = summary[key]
        return "-" if s is None else f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f}"

    kinds = ", ".join(f"{k} {n}" for k, n in summary["faults"].items()) or "none"
    lines = [
        f"chaos: {summary['trials']} trials, {summary['passed']} passed, "
        f"{summary['failed']} failed ({summary['hangs']} hangs, {summary['lost_runs']} "
        f"lost runs)" + (f"; failed seeds {summary['failed_seeds']}"
                         if summary["failed_seeds"] else ""),
        f"  faults: {kinds} ({summary['faults_inside_preduce']} inside a P-Reduce, "
        f"{summary['skipped_faults']} skipped); heals {summary['heals']}; groups failed "
        f"{summary['groups_failed']}, cancelled {summary['groups_cancelled']}; restart "
        f"rounds {summary['restart_rounds']}",
        f"  checkpoints: {summary['checkpoints_loaded']} loaded, "
        f"{summary['corrupt_checkpoints']} corrupt, "
        f"{summary['partial_checkpoint_files']} partial files of killed writers",
        f"  seconds min / median / max: trial {spread('trial_seconds')}, training "
        f"{spread('training_seconds')}, replacement start to heal {spread('heal_seconds')}, "
        f"fault to heal {spread('fault_to_heal_seconds')}, imports done to heal "
        f"{spread('heal_after_imports_seconds')} ({summary['heals_within_goal']} within "
        f"{HEAL_GOAL_SECONDS:.0f} s), registered to heal "
        f"{spread('heal_after_registration_seconds')}, survivors' longest stall "
        f"{spread('longest_stall_seconds')}"
        + (f"; stalls over {LONG_STALL_SECONDS:.0f} s in seeds {summary['long_stall_seeds']}"
           if summary["long_stall_seeds"] else ""),
    ]
    acc = summary["accuracy"]
    if acc is not None:
        lines.append(f"  accuracy of the averaged final model: min {acc['min']:.3f}, "
                     f"median {acc['median']:.3f}")
    return "\n".join(lines)
