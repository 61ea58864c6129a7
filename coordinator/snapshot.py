"""The run's state as plain JSON values, and a core rebuilt from it (pure code).

What a coordinator restarted from its state dir needs to go on with the same run: the
settings, every worker record (ids, ranks, progress, slowdown counters, leases renewed
at the restart), the membership and graph, the loss curve and time-to-target
accounting, the stop and lock-step agreements, and the schema references. What is
left out is what the workers re-create by asking again: the groups in flight (a worker
inside a collective finishes it with its peers, its release to the new incarnation is
a no-op; a waiting worker's request is answered by fresh groups), long-polls and the
policy's random state (reseeded per incarnation). Group and comm ids of a new
incarnation live in an id space of their own, so that no id is ever handed out twice
across restarts (a worker's communicator cache is keyed by comm id).
"""

from __future__ import annotations

import dataclasses
import operator
import random
from collections.abc import Iterable
from typing import Any

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore
from ripples.coordinator.registry import GONE, Progress, WorkerRecord, WorkerState
from ripples.coordinator.run_graph import RankGraph, RunGraph
from ripples.coordinator.schema import Schema, SchemaCheck
from ripples.rpc import ID_SPACE_BITS

FORMAT = 1

_TRANSIENT = ("round_target", "wait_started_at", "listening")
"""Worker fields that belong to a pending request, not to the run."""


_WORKER_FIELDS = tuple(f.name for f in dataclasses.fields(WorkerRecord)
                       if f.name not in _TRANSIENT)
_PROGRESS_FIELDS = tuple(f.name for f in dataclasses.fields(Progress))
_worker_values = operator.attrgetter(*_WORKER_FIELDS)
_progress_values = operator.attrgetter(*_PROGRESS_FIELDS)
_STATE, _PROGRESS, _OWN_BASE = (_WORKER_FIELDS.index(name)
                                for name in ("state", "progress", "own_base"))


class Captured:
    """The run's state as `capture` copied it on the event loop: the run's keys as JSON
    values, each worker's record as a tuple of its field values (C-speed attribute reads
    and a copy of its mutable progress). `values()` makes the JSON rows, off the loop."""

    def __init__(self, run: dict[str, Any], workers: list[tuple[Any, ...]]) -> None:
        self.run = run
        self.workers = workers

    def values(self) -> dict[str, Any]:
        """The snapshot as JSON values (what `take` returns)."""
        return {**self.run, "workers": [_worker_row(w) for w in self.workers]}


def take(core: CoordinatorCore, now: float, wall: float = 0.0, *,
         only: Iterable[int] | None = None) -> dict[str, Any]:
    """The run's state at monotonic time `now` (wall-clock time `wall`), as JSON values;
    `only`: of these workers' records alone (a partial snapshot, for a save that knows
    no other record changed: StateStore.save)."""
    return capture(core, now, wall, only=only).values()


def capture(core: CoordinatorCore, now: float, wall: float = 0.0, *,
            only: Iterable[int] | None = None) -> Captured:
    """`take`'s state, with the part that must be consistent done now (on the event loop:
    values copied, O(workers) attribute reads at C speed) and the per-worker JSON rows
    left to `Captured.values()` (in the thread that writes): the loop is held ~10 times
    less than by building the rows here (python -m ripples.bench.loop_hold)."""
    records = (core.workers.values() if only is None
               else [core.workers[i] for i in only if i in core.workers])
    return Captured(_run(core, now, wall), [_capture_worker(w) for w in records])


def _run(core: CoordinatorCore, now: float, wall: float) -> dict[str, Any]:
    """The run's keys but the workers, as JSON values (fresh containers, so that they may
    be serialised off the loop; but the settings, which never change during a run, are
    the core's one dict, which the state store encodes once)."""
    progress = core.progress
    return {
        "format": FORMAT,
        "settings": core.settings_options,
        "elapsed": core.elapsed(now) if core.started_at is not None else None,
        "wall": wall,
        "registry": {"formed": core.registry.formed, "nodes": dict(core.registry._nodes),
                     "next_worker_id": core.registry._next_worker_id,
                     "lease_expirations": core.registry.num_lease_expirations,
                 "size": core.registry.size, "generation": core.registry.generation},
        "restarts": {"count": core.rounds.count, "failures": core.rounds.failures,
                     "open": core.rounds.began_at is not None,
                     "reason": core.restart_reason, "elapsed": core.resumed_elapsed,
                     "expected_back": sorted(core.rounds.expected_back)},
        "stop": {"stopped": core.stopper.stopped, "reason": core.stopper.reason,
                 "at_iteration": core.stopper.stop_at_iteration,
                 "adopt_after": core.adoption.after_iteration},
        "progress": {"curve": [list(p) for p in progress.loss_curve],
                     "time_to_target": progress.time_to_target,
                     "iterations_to_target": progress.iterations_to_target},
        "schemas": {"model": _schema(core.model_schema),
                    "training": _schema(core.training_schema)},
        "counters": {"groups_formed": core.table.num_formed,
                     "conflicts": core.table.num_conflicts,
                     "cancelled": core.groups.num_cancelled, "failed": core.groups.num_failed,
                     "pending_waits": core.groups.num_pending_waits,
                     "pending_wait_seconds": core.groups.pending_wait_seconds},
    }


def restore(snapshot: dict[str, Any], now: float, incarnation: int, *, wall: float = 0.0,
            resume: bool = False, prepared: RankGraph | None = None) -> CoordinatorCore:
    """A core that goes on with the snapshot's run at monotonic time `now` (wall-clock
    time `wall`): with its workers (a coordinator restart: its training time includes the
    time since the save, as the workers trained on meanwhile), or with a new set of them
    (`resume`: after a total failure, whose downtime is no training time; see
    CoordinatorCore.resume); `prepared`: its graph on ranks, built ahead
    (run_graph.prepare)."""
    if snapshot.get("format") != FORMAT:
        raise ValueError(f"state of format {snapshot.get('format')!r}; this coordinator "
                         f"reads format {FORMAT}")
    settings = RunSettings.build(**snapshot["settings"])
    core = CoordinatorCore(settings, now=now)
    core.prepared_graph = prepared
    core.groups.rng = random.Random(f"{settings.seed}/{incarnation}")
    core.table._next_id = max(core.table._next_id, incarnation << ID_SPACE_BITS)
    core.groups.comms._next_id = max(core.groups.comms._next_id,
                                     incarnation << ID_SPACE_BITS)
    started = snapshot["elapsed"] is not None
    registry = core.registry
    for fields in snapshot["workers"]:
        w = _record(fields, now + settings.lease_seconds, started)
        registry.add(w)
    r = snapshot["registry"]
    registry.formed = r["formed"]
    registry._nodes = dict(r["nodes"])
    registry._next_worker_id = r["next_worker_id"]
    registry.num_lease_expirations = r["lease_expirations"]
    registry.size = r.get("size", settings.num_workers)
    registry.generation = r.get("generation", 0)
    restarts = snapshot.get("restarts", {})
    rounds = core.rounds
    rounds.count = restarts.get("count", 0)
    rounds.failures = restarts.get("failures", rounds.count)
    rounds.expected_back = {(h, r) for h, r in restarts.get("expected_back", [])}
    rounds.reason = restarts.get("reason", "")
    if restarts.get("open"):  # its join window starts again with the new incarnation
        rounds.began_at = now
    if not started:  # the training time before a restart round (or 0 before any start)
        core.resumed_elapsed = restarts.get("elapsed", 0.0)
    core.note_ready(w.worker_id for w in registry.live() if w.ready)
    if registry.formed:
        core.graph = RunGraph.build(settings, registry.holders_by_rank(), prepared)
    core.progress.num_workers = registry.size
    if started:
        since_save = 0.0 if resume else max(0.0, wall - snapshot["wall"])
        core.started_at = now - snapshot["elapsed"] - since_save
    stop = snapshot["stop"]
    core.stopper.stopped, core.stopper.reason = stop["stopped"], stop["reason"]
    core.stopper.stop_at_iteration = stop["at_iteration"]
    core.adoption.after_iteration = stop["adopt_after"]
    p = snapshot["progress"]
    core.progress.loss_curve = [tuple(point) for point in p["curve"]]  # type: ignore[misc]
    core.progress.time_to_target = p["time_to_target"]
    core.progress.iterations_to_target = p["iterations_to_target"]
    for check, key in ((core.model_schema, "model"), (core.training_schema, "training")):
        schema = snapshot["schemas"][key]
        if schema is not None:
            check.reference = Schema(tensors=tuple((n, tuple(s), d) for n, s, d in
                                                   schema["tensors"]), digest=schema["digest"])
            check.reference_owner = schema["owner"]
    c = snapshot["counters"]
    core.table.num_formed, core.table.num_conflicts = c["groups_formed"], c["conflicts"]
    core.groups.num_cancelled, core.groups.num_failed = c["cancelled"], c["failed"]
    core.groups.num_pending_waits = c["pending_waits"]
    core.groups.pending_wait_seconds = c["pending_wait_seconds"]
    if resume:
        core.resume(now)
    return core


def _capture_worker(w: WorkerRecord) -> tuple[Any, ...]:
    """A worker's field values (_WORKER_FIELDS), its progress as a tuple of its own."""
    values = list(_worker_values(w))
    values[_PROGRESS] = _progress_values(w.progress)
    return tuple(values)


def _worker_row(values: tuple[Any, ...]) -> dict[str, Any]:
    """A captured worker as the JSON row `_record` reads back."""
    fields = dict(zip(_WORKER_FIELDS, values, strict=True))
    fields["state"] = values[_STATE].value
    fields["progress"] = dict(zip(_PROGRESS_FIELDS, values[_PROGRESS], strict=True))
    fields["own_base"] = list(values[_OWN_BASE])
    return fields


def _record(fields: dict[str, Any], lease_expires_at: float, started: bool) -> WorkerRecord:
    values = dict(fields)
    state = WorkerState(values.pop("state"))
    if state not in GONE:  # whatever it was doing, it asks the new incarnation again
        state = WorkerState.COMPUTING if started else WorkerState.REGISTERED
    values["progress"] = Progress(**values["progress"])
    values["own_base"] = tuple(values["own_base"])
    values["lease_expires_at"] = lease_expires_at  # renewed: the outage was not its fault
    return WorkerRecord(state=state, **values)


def _schema(check: SchemaCheck) -> dict[str, Any] | None:
    schema = check.reference
    if schema is None:
        return None
    return {"tensors": [[n, list(s), d] for n, s, d in schema.tensors], "digest": schema.digest,
            "owner": check.reference_owner}
