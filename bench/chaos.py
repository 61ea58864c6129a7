"""`ripples chaos`: seeded chaos trials of an elastic run with real processes and signals.

One trial starts a coordinator (`ripples coordinator serve --exit-when-done`) and N
`ripples worker run` processes of a ripples-smart digits run on loopback, each saving its
final model; then, at random moments of the run (fractions of its iteration budget drawn
from `random.Random(seed)`), it injects faults, each followed by a replacement worker
after a random short delay, and waits for every process to exit before a hard deadline
(a process still running then is killed: a HANG). It checks that the run completed its
iteration budget, that every process exited as its fate says (0 unless SIGKILLed), that
replacements healed from a live peer, that one final model per rank was saved, all
finite, and that their average reaches the accuracy floor on the digits test split. What
the processes did, it reads from the structured events each appends to a file of its own
(ripples/events.py), never from their log text.

The harness is in modules of one concept each:

- bench/chaos_config.py: `ChaosConfig`, what a batch of trials runs;
- bench/chaos_faults.py: the fault kinds (`FAULT_KINDS`: add one there and select it
  with `--faults`) and a trial's fault plan;
- bench/chaos_procs.py: a trial's processes, their logs and their events;
- bench/chaos_trial.py: one trial (`Trial`): start, drive, wait;
- bench/chaos_checks.py: what a finished trial is checked for;
- bench/chaos_results.py: a trial's result and a batch's summary;
- this module: a batch of trials (`run_trials`), and the names the command line
  (ripples/cli/chaos.py), `python -m ripples.bench.fault` and the tests import.

This is orchestration only: it imports no torch until it evaluates the models.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ripples.bench.chaos_checks import evaluate_models
from ripples.bench.chaos_config import ELASTIC_PROTOCOLS, LOCKSTEP_PROTOCOLS, ChaosConfig
from ripples.bench.chaos_faults import (
    FAULT_KINDS,
    FaultKind,
    FaultRecord,
    PlannedFault,
    plan_faults,
)
from ripples.bench.chaos_results import TrialResult, format_summary, summarise
from ripples.bench.chaos_trial import Trial

__all__ = [
    "ELASTIC_PROTOCOLS",
    "FAULT_KINDS",
    "LOCKSTEP_PROTOCOLS",
    "ChaosConfig",
    "FaultKind",
    "FaultRecord",
    "PlannedFault",
    "Trial",
    "TrialResult",
    "evaluate_models",
    "format_summary",
    "plan_faults",
    "run_trials",
    "summarise",
]


def run_trials(config: ChaosConfig, on_result: Callable[[TrialResult], None] = lambda r: None
               ) -> dict[str, Any]:
    """Run the configured trials one after another.

    Args:
        config: What to run.
        on_result: Called with each trial's result as it ends (`ripples chaos` prints
            its line).

    Returns:
        The summary (`summarise`), with the configuration and the folder of the trials
        under "config".
    """
    temporary = config.workdir is None
    root = Path(tempfile.mkdtemp(prefix="ripples-chaos-")) if temporary else config.workdir
    assert root is not None
    results = []
    for i in range(config.trials):
        seed = config.seed + i
        directory = root / f"trial-{i}-seed-{seed}"
        directory.mkdir(parents=True, exist_ok=True)
        result = Trial(config, i, seed, directory).run()
        if temporary and result.ok:
            shutil.rmtree(directory, ignore_errors=True)
        results.append(result)
        on_result(result)
    if temporary and all(r.ok for r in results):
        shutil.rmtree(root, ignore_errors=True)
    summary = summarise(results)
    summary["config"] = {"seed": config.seed, "workers": config.workers,
                         "iterations": config.iterations, "lease_seconds": config.lease_seconds,
                         "faults": list(config.faults),
                         "faults_per_trial": config.faults_per_trial,
                         "deadline_seconds": config.deadline_seconds,
                         "protocol": config.protocol, "task": config.task,
                         "workdir": str(root)}
    return summary
