"""What ripples.Optimizer does around the local step in a distributed run.

Built once per worker: the averaged state (worker/dataplane/averaged_state.py), the start
barrier (the coordinator checks every worker averages the same tensors), the run's
protocol runtime. Per step, after the local optimizer step:

1. the gate: every averaged value must be finite before anything leaves the process
   (`FloatingPointError` names the first tensor that is not);
2. after the first step, the optimizer's per-parameter state joins the averaged state
   (protocols that average it) and the coordinator checks the full schema once more;
3. the progress counters and an injected slowdown (experiments);
4. the protocol's synchronisation, then its verdict on whether the run is over.

Time accounting, per step: `compute` is everything since the previous step returned
(data loading, forward, backward, the local step, the user's own code) less a sync that
ran inside backward (DDP); `wait` and `preduce` come from the protocol.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ripples.protocols import get_protocol
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.protocols import create_protocol
from ripples.worker.protocols.base import Protocol, ProtocolContext, SyncResult
from ripples.worker.slowdown import Slowdown, SlowdownSpec

if TYPE_CHECKING:
    from ripples.worker.session import Session

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class StepTimes:
    """Where a worker's optimizer steps spent their time, summed over `steps` steps."""

    steps: int = 0
    local_seconds: float = 0.0
    """Inside the wrapped optimizer's step()."""
    sync_seconds: float = 0.0
    """Waiting for a group or partner, and inside collectives (the protocol's report)."""
    injected_seconds: float = 0.0
    """An experiment's injected slowdown (--slowdown)."""
    other_seconds: float = 0.0
    """The rest of step(): Ripples' own bookkeeping (gate, counters, metrics, RPC
    framing). What library mode costs on top of the local step and the sync."""


class StepSynchronizer:
    """The distributed half of one ripples.Optimizer (single-process mode has none)."""

    def __init__(self, session: Session, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, *, average_optimizer_state: bool | None,
                 planned_steps: int) -> None:
        config = session.config
        spec = get_protocol(config.protocol)
        if not spec.library:
            raise ValueError(
                f"{config.protocol} runs several updater processes per worker and needs the "
                "built-in runner: start the workers with `ripples worker run --task ...` "
                "(or `ripples run --task ...`), or pick a protocol that runs in your own "
                "loop (allreduce, ripples-random, ripples-smart, ripples-static, adpsgd, "
                "a2cid2, hop)")
        self.session = session
        self.model = model
        self.optimizer = optimizer
        self.average_optimizer_state = (config.average_optimizer_state
                                        if average_optimizer_state is None
                                        else average_optimizer_state)
        self.planned_steps = planned_steps
        self.state = AveragedState(model)
        session.start(self.state.schema(), planned_steps)
        assert session.comms is not None and session.store is not None
        assert session.worker_id is not None
        membership = session.membership
        self.ctx = ProtocolContext(
            client=session.client, worker_id=session.worker_id, rank=membership.rank,
            num_workers=membership.num_workers, config=config, membership=membership,
            model=model, state=self.state, comms=session.comms, store=session.store,
            device=session.device, stop_requested=session.stop_requested,
            progress=session.stats.snapshot, metrics=session.metrics.for_protocol())
        self.protocol: Protocol = create_protocol(config.protocol, self.ctx)
        self.adopt_state = (self.average_optimizer_state
                            and self.protocol.averages_optimizer_state)
        self._adopted = False
        spec_text = session.env.slowdown
        self.slowdown = Slowdown(SlowdownSpec.parse(
            spec_text, seed=config.seed * 1000 + membership.rank) if spec_text
            else SlowdownSpec())
        self.times = StepTimes()
        self.stop_reason = ""
        self.protocol.begin()
        self._since = time.perf_counter()

    # ------------------------------------------------------------------ per step
    def after_local_step(self, completed: int, local_seconds: float,
                         step_started: float) -> str:
        """Everything after the local step of step `completed`; returns why the run is
        over for this worker, or "" to go on."""
        stats = self.session.stats
        # Compute: everything since the last step returned, less a sync that ran inside
        # backward (DDP), which a slower device would not make slower.
        inside = self.protocol.backward_sync_seconds()
        compute = max(0.0, time.perf_counter() - self._since - inside)
        bad = self.state.nonfinite()
        if bad is not None:
            raise FloatingPointError(
                f"worker {self.session.worker_id}: {bad} holds a NaN or an infinity after "
                f"step {completed}; nothing was sent to any peer. Lower the learning rate, "
                "clip the gradients, or pass on_nonfinite='skip' to ripples.Optimizer to skip "
                "steps whose gradients are not finite")
        if self.adopt_state and not self._adopted:
            self.adopt_optimizer_state()
        with stats.lock:  # before the sync, whose RPCs carry this progress to the coordinator
            stats.iteration = completed
        injected = self.slowdown.after_compute(compute)
        compute += injected
        result = self.protocol.after_step(completed)
        smoothed = stats.add_sync(result, compute)
        self.session.metrics.observe_iteration(compute_seconds=compute, result=result,
                                               loss=smoothed)
        verdict: SyncResult | None = result if result.stop else self.protocol.should_stop(
            completed, self.planned_steps)
        reason = verdict.stop_reason if verdict is not None and verdict.stop else ""
        if not reason and self.session.local_stop.is_set():
            reason = "stopped by a signal"
        if self.session.fatal_error:
            raise RuntimeError(self.session.fatal_error)
        now = time.perf_counter()
        sync = result.wait_seconds + result.preduce_seconds - result.inside_step_seconds
        t = self.times
        t.steps += 1
        t.local_seconds += local_seconds
        t.sync_seconds += sync
        t.injected_seconds += injected
        t.other_seconds += max(0.0, now - step_started - local_seconds - sync - injected)
        self._since = now
        return reason

    def adopt_optimizer_state(self) -> None:
        """The optimizer's per-parameter state joins the averaged state (it exists after
        the first step, and is replaced by `load_state_dict`); the coordinator compares
        the full schema with the other workers'."""
        count = self.state.adopt_optimizer_state(self.optimizer)
        self._adopted = True
        logger.debug("adopted %d optimizer state tensors", count)
        self.session.check_schema(self.state.schema())

    def readopt_after_load(self) -> None:
        if self.adopt_state and self._adopted:
            self.state.adopt_optimizer_state(self.optimizer)

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        self.protocol.close()

    def record(self, stop_reason: str) -> dict[str, object]:
        """This worker's record of the run (DIR/workers/rankN.json)."""
        config = self.session.config
        return {"worker_id": self.session.worker_id, "rank": self.ctx.rank,
                "protocol": config.protocol, "iterations": self.session.stats.iteration,
                "stop_reason": stop_reason, "step_times": vars(self.times),
                "parameter_names": parameter_names(self.state),
                config.protocol: self.protocol.record()}


def parameter_names(state: AveragedState) -> list[str]:
    """The state_dict keys of the model's parameters (the launcher's consensus distance)."""
    return [n.removeprefix("param:") for n in state.names if n.startswith("param:")]


def write_json(path: Path, value: object) -> None:
    """Write whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value) + "\n")
    partial.replace(path)
