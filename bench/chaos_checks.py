"""The checks of a finished chaos trial: what its run and processes left, against what
they must.

Once every process of a trial exited (or was killed at the deadline), `check` fills in
the trial's result and a failure for each thing that broke:

- the run ended "finished" with its iteration budget done (its run_ended event:
  ripples/events.py), else it is LOST;
- every process exited as its fate says;
- the replacements healed (their worker_healed, or checkpoint_restored, events), and how
  fast;
- the final models are one per rank, finite, and their average reaches the accuracy
  floor (`evaluate_models`);
- every checkpoint left loads and holds finite values only.

Nothing here reads a process's log text: its events and exit code say what it did.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ripples import events

if TYPE_CHECKING:
    from ripples.bench.chaos_trial import Trial


def check(trial: Trial) -> None:
    """Check a trial whose processes all exited; fill in its result.

    Args:
        trial: The trial, after its processes were reaped. Its result gets the run's
            figures, the heals' times, the models' accuracy, the checkpoints' counts,
            and one line in `failures` per thing that broke.
    """
    _check_stop(trial)
    _check_exits(trial)
    _check_heals(trial)
    r = trial.result
    if trial.steps_before_fault:
        r.step_seconds_before_fault = statistics.median(trial.steps_before_fault)
        r.longest_step_before_fault_seconds = max(trial.steps_before_fault)
    if trial.final_status is not None:
        r.restart_rounds = trial.final_status.num_restarts
    _check_models(trial)
    _check_checkpoints(trial)


def run_ended(trial: Trial) -> dict[str, Any] | None:
    """The run's run_ended event (from the coordinator that ended it; None if none did)."""
    ended = [e for p in trial.coordinators() for e in p.events(events.RUN_ENDED)]
    return ended[-1] if ended else None


def _check_stop(trial: Trial) -> None:
    """The run ended "finished" with its budget done: every worker's iterations together
    (elastic) or one worker's (lock-step: all stand at the same iteration) reach it."""
    r, config, status = trial.result, trial.config, trial.final_status
    if status is not None:
        r.training_seconds = status.elapsed_seconds
        r.groups_failed = status.num_groups_failed
        r.groups_cancelled = status.num_groups_cancelled
    ended = run_ended(trial)
    if ended is not None:
        r.stop_reason = str(ended.get("reason", ""))
    elif status is not None:
        r.stop_reason = status.stop_reason
    else:  # no coordinator said: its workers' word, for the record
        said = [e for w in trial.workers() for e in w.events(events.WORKER_FINISHED)]
        r.stop_reason = str(said[0].get("reason", "")) if said else ""
    needed = config.iterations * (1 if config.lockstep else config.workers)
    key = "max_worker_iterations" if config.lockstep else "iterations"
    done = int(ended.get(key, 0)) if ended is not None else 0
    if ended is None or ended.get("state") != "finished" or done < needed:
        r.lost = True
        how = ("no coordinator ended it (no run_ended event)" if ended is None else
               f"it ended {ended.get('state')} after {done} iterations "
               f"({r.stop_reason or 'no stop reason'!r})")
        r.failures.append(f"LOST run: {how}, not with its iteration budget of {needed} "
                          "iterations")


def _check_exits(trial: Trial) -> None:
    """Every process exited with the code its fate calls for."""
    for p in trial.procs:
        code = p.returncode
        if p.expected_exit is not None and code != p.expected_exit:
            why = f" after {p.fault}" if p.fault else ""
            trial.result.failures.append(
                f"{p.name} exited with {code}{why}, expected {p.expected_exit}:\n"
                + _indent(p.tail()))


def _check_heals(trial: Trial) -> None:
    """Each replacement's heal and its times, from its events: its start, its first sign
    of life after its imports, its registration, its heal."""
    r = trial.result
    for f in r.faults:
        joiner = trial.proc(f.replacement) if f.replacement else None
        healed = joiner.first_event(trial.heal_event) if joiner is not None else None
        if joiner is None or healed is None:
            continue
        when = float(healed["time"])
        f.heal_seconds = when - joiner.started_at
        registered = joiner.first_event(events.WORKER_REGISTERED)
        registered_at = float(registered["time"]) if registered is not None else None
        # Its first output line, or its registration if that came first (the line may
        # reach the harness a moment after the event was written).
        alive_at = min((t for t in (joiner.first_line_at(), registered_at) if t is not None),
                       default=None)
        if alive_at is not None:
            f.heal_after_imports_seconds = when - alive_at
        if registered_at is not None:
            f.heal_after_registration_seconds = when - registered_at
        f.fault_to_heal_seconds = when - trial.t0_wall - f.at_seconds
        f.heal_donor = -1 if trial.config.lockstep else int(healed.get("donor", -1))
    r.heals = sum(f.heal_seconds is not None for f in r.faults)
    if any(f.replacement for f in r.faults) and r.heals == 0:
        r.failures.append(f"no replacement healed (no {trial.heal_event} event from any)")


def _check_checkpoints(trial: Trial) -> None:
    """Every checkpoint left loads, and holds finite values only (a writer SIGKILLed
    mid-write leaves a hidden partial file, never a torn checkpoint)."""
    root = trial.dir / "checkpoints"
    if not trial.config.checkpoint_every or not root.is_dir():
        return
    import torch

    r = trial.result
    for path in sorted(root.glob("rank-*/step-*.pt")):
        try:
            state = torch.load(path, map_location="cpu", weights_only=False)
            bad = [k for k, v in state["model"].items()
                   if v.is_floating_point() and not torch.isfinite(v).all()]
        except Exception as err:  # noqa: BLE001 (any unreadable checkpoint is a failure)
            r.failures.append(f"CORRUPT checkpoint {path}: {type(err).__name__}: {err}")
            r.corrupt_checkpoints += 1
            continue
        if bad:
            r.failures.append(f"checkpoint {path} holds non-finite {bad[:3]}")
            r.corrupt_checkpoints += 1
        r.checkpoints += 1
    r.partial_checkpoints = len(list(root.glob("rank-*/.step-*.pt.partial")))


def _check_models(trial: Trial) -> None:
    """The final models: saved, one per rank, each from a healed worker, finite, and
    their average accurate enough."""
    r, config = trial.result, trial.config
    fail = r.failures.append
    final = [p for p in trial.workers() if not p.fault and p.returncode == 0]
    saved = [p for p in trial.workers() if p.returncode == 0]
    missing = [p.name for p in saved if p.model_path is None or not p.model_path.exists()]
    if missing:
        fail(f"no saved model from {', '.join(missing)}")
        return
    ranks = sorted(trial.ranks.get(p.name, -1) for p in final)
    if ranks != list(range(config.workers)):
        fail(f"the final models are not one per rank: ranks {ranks} "
             f"({', '.join(p.name for p in final)})")
    for p in final:
        if not trial.healed(p):  # its model would be the task's fresh one
            fail(f"{p.name} saved a final model but never healed (the run stopped "
                 "before its heal group)")
    if not final:
        return
    try:
        accuracy, nonfinite = evaluate_models(
            [p.model_path for p in final if p.model_path is not None],
            [p.model_path for p in saved if p.fault and p.model_path is not None],
            config.task, trial.seed)
    except Exception as err:  # noqa: BLE001 (a model that does not load is a failure)
        fail(f"could not evaluate the models: {type(err).__name__}: {err}")
        return
    r.accuracy = accuracy
    if nonfinite:
        fail(f"non-finite values in saved models: {', '.join(nonfinite)}")
    if not accuracy >= config.min_accuracy:
        fail(f"the average of the final models reaches accuracy {accuracy:.3f} < "
             f"{config.min_accuracy}")


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())


def evaluate_models(final: list[Path], others: list[Path], task: str,
                    seed: int) -> tuple[float, list[str]]:
    """Evaluate saved models on CPU, in this process.

    Args:
        final: The final models: their average is evaluated.
        others: Other saved models, checked for non-finite values only.
        task: The built-in task they were trained on.
        seed: The run's seed (the task's data split).

    Returns:
        (the accuracy of the average of the `final` models on the task's test split,
        the names of the files among `final` and `others` that hold a non-finite value).
    """
    import torch

    from ripples.worker.tasks import TaskOptions, build_task, evaluate

    nonfinite = []
    states = []
    for path in [*final, *others]:
        state = torch.load(path, map_location="cpu")
        if not all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()):
            nonfinite.append(path.name)
        if path in final:
            states.append(state)
    average = {k: (sum(s[k].double() for s in states) / len(states)).to(states[0][k].dtype)
               if states[0][k].is_floating_point() else states[0][k] for k in states[0]}
    built = build_task(task, TaskOptions(seed=seed, device="cpu"))
    model = built.build_model()
    model.load_state_dict(average)
    _, accuracy = evaluate(built, model)
    return float(accuracy if accuracy is not None else math.nan), nonfinite
