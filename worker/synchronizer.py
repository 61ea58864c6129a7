"""What ripples.Optimizer does around the local step in a distributed run.

Built once per worker: the averaged state (worker/dataplane/averaged_state.py), the start
barrier (the coordinator checks every worker averages the same tensors), the run's
protocol runtime. Per step, after the local optimizer step:

1. the gate (worker/dataplane/nonfinite.py): the step's non-finite flag, read back at
   once on the CPU and, on a GPU, once its copy to the host is done (the P-Reduce
   carries the flag, so no peer adopts a non-finite state meanwhile; a protocol whose
   collectives do not carry it waits for the flag); `FloatingPointError` names the first
   tensor that is not finite and the step it appeared after;
2. once the optimizer's per-parameter state exists for every trainable parameter (after
   the first applied step), it joins the averaged state (protocols that average it;
   lock-step ones after an iteration every worker agreed on) and the coordinator checks
   the full schema once more (a group executes only among workers whose tensors match);
3. the progress counters and an injected slowdown (experiments);
4. the protocol's synchronisation, then its verdict on whether the run is over.

Time accounting, per step: `compute` is everything since the previous step returned
(data loading, forward, backward, the local step, the user's own code) less a sync that
ran inside backward (DDP); `wait` and `preduce` come from the protocol.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import grpc
import torch

from ripples.protocols.registry import (
    PROTOCOLS,
    check_sharded_run,
    create_runtime,
    get_protocol,
    role_of_config,
)
from ripples.protocols.spec import Coordination
from ripples.v1 import replica_pb2 as rpb
from ripples.worker.client import CoordinatorCallError, RestartRequested
from ripples.worker.consensus_share import ConsensusPublisher, final_average
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.nonfinite import NonfiniteWatch, nonfinite_flag
from ripples.worker.dataplane.shard_mirror import ShardMirror
from ripples.worker.protocol import Protocol, SyncResult
from ripples.worker.replica import ReplicaMismatch, worker_schema
from ripples.worker.slowdown import Slowdown, SlowdownSpec

if TYPE_CHECKING:
    from ripples.worker.session import Session

logger = logging.getLogger(__name__)

STATE_WARNING_STEPS = 100
"""Warn when the optimizer state is still incomplete (not averaged) after this many steps."""

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
            in_loop = ", ".join(name for name, s in PROTOCOLS.items() if s.library)
            raise ValueError(
                f"{config.protocol} runs several updater processes per worker and needs the "
                "built-in runner: start the workers with `ripples worker run --task ...` "
                "(or `ripples run --task ...`), or pick a protocol that runs in your own "
                f"loop ({in_loop})")
        self.session = session
        self.model = model
        self.optimizer = optimizer
        if session.replica is not None:
            check_sharded_run(config)
        if average_optimizer_state is None:
            # With an outer optimizer the inner one's state stays each worker's own, as in
            # DiLoCo: its moments follow the worker's own local steps.
            average_optimizer_state = (config.average_optimizer_state
                                       and config.outer_optimizer != "nesterov")
        self.average_optimizer_state = average_optimizer_state
        self.planned_steps = planned_steps
        self.replica = session.replica
        self.mirror: ShardMirror | None = None
        """A worker of several ranks: this rank's shards, mirrored into the averaged
        state around each synchronisation (worker/dataplane/shard_mirror.py)."""
        if self.replica is not None:
            self.mirror = ShardMirror(model, self.replica.mesh, self.replica.rank)
            self.state = self.mirror.state
        else:
            self.state = AveragedState(model)
        session.start_training(self.state, planned_steps)
        self.ctx = session.protocol_context(model, self.state)
        self.protocol: Protocol = create_runtime(config.protocol, self.ctx)
        self.consensus = ConsensusPublisher(session, model, self.protocol, self.mirror)
        self.adopt_state = (self.average_optimizer_state
                            and self.protocol.averages_optimizer_state)
        self._adopted = False
        spec_text = session.env.slowdown
        self.slowdown = Slowdown(SlowdownSpec.parse(
            spec_text, seed=config.seed * 1000 + self.ctx.rank) if spec_text
            else SlowdownSpec())
        self.times = StepTimes()
        self.stop_reason = ""
        self._stop_asked = False
        self._watch = NonfiniteWatch()
        self._check_finite("before the first step")  # begin() may send already (hop)
        self.protocol.begin()
        if self.mirror is not None:  # a replacement healed its shards
            self.mirror.push()
        self._since = time.perf_counter()

    # ------------------------------------------------------------------ per step
    def before_local_step(self) -> None:
        """Before the local step: local-step training anchors at the model as the first
        step finds it (weights loaded after wrapping included)."""
        outer = self.protocol.outer
        if outer is not None:
            if self.mirror is not None and not outer.anchored:
                self.mirror.pull()
            outer.take_anchor()

    def after_local_step(self, completed: int, local_seconds: float,
                         step_started: float) -> str:
        """Everything after the local step of step `completed`; returns why the run is
        over for this worker, or "" to go on."""
        stats = self.session.stats
        restart = self.session.restart
        if restart.ordered.is_set():  # lock-step: the membership changes, from a checkpoint
            raise RestartRequested(restart.reason)
        # Compute: everything since the last step returned, less a sync that ran inside
        # backward (DDP), which a slower device would not make slower.
        inside = self.protocol.backward_sync_seconds()
        compute = max(0.0, time.perf_counter() - self._since - inside)
        if self.mirror is not None:
            self.mirror.pull()
        flag: torch.Tensor | None = self._gate(completed)
        if self.adopt_state and not self._adopted:
            self._maybe_adopt(completed)
            if self._adopted:  # the state grew: the gate's flag does not cover it
                flag = None
        with stats.lock:  # before the sync, whose RPCs carry this progress to the coordinator
            stats.iteration = completed
        injected = self.slowdown.after_compute(compute)
        compute += injected
        if self.protocol.outer is not None:  # skipped steps count: H is counted in step()s
            self.protocol.outer.record_step()
        try:
            with self.state.flag_known(flag):
                result = self.protocol.after_step(completed)
            verdict: SyncResult | None = result if result.stop else self.protocol.should_stop(
                completed, self.planned_steps)
            if verdict is not None and verdict is not result and verdict.num_groups:
                result = result.merged(verdict)  # the stop synchronised once more
            smoothed = stats.add_sync(result, compute)
            self.session.metrics.observe_iteration(compute_seconds=compute, result=result,
                                                   loss=smoothed)
        except CoordinatorCallError as err:
            self._restart_instead(err)
            raise
        reason = verdict.stop_reason if verdict is not None and verdict.stop else ""
        if not reason and self.session.local_stop.is_set():
            reason = self._asked_to_stop()
        consensus = self.consensus.due(completed)
        if self.mirror is not None:
            self.mirror.push()
            reason, consensus = self._relay_verdict(completed, reason, consensus)
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
        self.consensus.publish(completed, consensus)
        if reason:
            self.protocol.on_stop()
        return reason

    def _relay_verdict(self, completed: int, reason: str, consensus: int) -> tuple[str, int]:
        """A worker of several ranks: rank 0's verdict on step `completed`, and the
        consensus request it publishes for, are every rank's (a signal to another rank is
        not: it would stop alone, mid-collective)."""
        replica = self.replica
        assert replica is not None
        if replica.leads:
            replica.send("step", rpb.ReplicaStep(completed=completed, stop_reason=reason,
                                                 consensus=consensus))
            return reason, consensus
        step = replica.receive("step", rpb.ReplicaStep())
        assert isinstance(step, rpb.ReplicaStep)
        if step.completed != completed:
            raise ReplicaMismatch(f"rank {replica.rank} finished step {completed} while "
                                  f"rank 0 finished step {step.completed}")
        if self.session.local_stop.is_set() and not step.stop_reason and not self._stop_asked:
            self._stop_asked = True
            logger.warning("rank %d of the worker was asked to stop: its ranks stop "
                           "together, when rank 0 does (signal rank 0)", replica.rank)
        return step.stop_reason, int(step.consensus)

    def _restart_instead(self, err: CoordinatorCallError) -> None:
        """The coordinator no longer knows this worker (NOT_FOUND) because a restart
        round ended its part, which its heartbeat learns within a beat: raise
        RestartRequested rather than the error (a lock-step worker's agreement RPC can
        hear of the round before its heartbeat does)."""
        if err.code != grpc.StatusCode.NOT_FOUND:
            return
        restart = self.session.restart
        beat = self.session.config.heartbeat_interval_seconds
        if restart.ordered.wait(timeout=3 * beat + 1.0) and restart.pending:
            raise RestartRequested(restart.reason) from err

    def _check_moved(self) -> None:
        moved = self.state.moved_away()
        if moved is not None:
            raise RuntimeError(
                f"parameter {moved} no longer lives in the averaged state: the model was "
                "moved or converted (model.to(...), .half(), ...) after ripples.Optimizer "
                "was built; move the model first, then build the optimizer and wrap it")

    def _check_finite(self, when: str) -> None:
        """The gate, waiting for the answer (before the first step, and at the end):
        nothing non-finite leaves this worker (nor a model that no longer trains the
        averaged tensors)."""
        self._check_moved()
        bad = self.state.nonfinite()
        if bad is not None:
            self._fail_nonfinite(when, "nothing was sent to any peer", bad)

    def _gate(self, completed: int) -> torch.Tensor:
        """After step `completed`: note its non-finite flag, and fail on the first flagged
        step whose flag has reached the host (at once on the CPU; on a GPU without
        waiting, unless the protocol's collectives do not carry the flag). Returns the
        flag, which the step's first P-Reduce sends as it is."""
        self._check_moved()
        flag = nonfinite_flag(self.state.flat)
        self._watch.note(completed, flag)
        flagged = (self._watch.first_flagged() if self.protocol.flags_nonfinite
                   else self._watch.drain())
        if flagged is None:
            return flag
        if flagged == completed:
            self._fail_nonfinite(f"after step {completed}", "nothing was sent to any peer")
        self._fail_nonfinite(f"after step {flagged} (read back at step {completed})",
                             "the groups it joined since kept their members' own state, "
                             "so no peer's model took it in")

    def drain_gate(self) -> None:
        """Read every step's flag still on its way (the end of the run): a worker whose
        last steps went non-finite fails rather than leave such a model."""
        flagged = self._watch.drain()
        if flagged is not None:
            self._fail_nonfinite(f"after step {flagged}", "no peer's model took it in")

    def _fail_nonfinite(self, when: str, where: str, name: str | None = None) -> NoReturn:
        """Fail naming the tensor that holds the value (`name`, else looked for now)."""
        name = name or self.state.nonfinite() or "an averaged tensor"
        raise FloatingPointError(
            f"rank {self.ctx.rank} (worker {self.session.worker_id}): {name} holds a NaN "
            f"or an infinity {when}; {where}. Lower the learning rate, clip the gradients, "
            "or pass on_nonfinite='skip' to ripples.Optimizer to skip steps whose "
            "gradients are not finite (a non-finite BatchNorm statistic still fails)")

    def _asked_to_stop(self) -> str:
        """A signal or request_stop(): stop now, or (lock-step protocols, where a worker
        that stops alone leaves its peers in a collective) ask the coordinator to stop the
        run and go on to the iteration every worker stops at. A lock-step worker whose run
        shrinks on a membership change (allreduce, with a checkpoint to restart from)
        leaves alone instead: its peers restart without it (a restart round)."""
        if not self.protocol.stops_together or self._leaves_alone():
            return "asked to stop (a signal or request_stop)"
        if not self._stop_asked:
            self._stop_asked = True
            try:
                self.session.client.stop_run(
                    f"rank {self.ctx.rank} (worker {self.session.worker_id}) was asked to "
                    "stop (a signal or request_stop)")
            except CoordinatorCallError as err:
                logger.warning("could not ask the coordinator to stop the run (%s); "
                               "stopping alone", err)
                return "asked to stop (a signal or request_stop); the coordinator was lost"
            logger.warning("%s: asked the coordinator to stop the run; every worker stops "
                           "at the same iteration", self.protocol.name)
        return ""

    def _leaves_alone(self) -> bool:
        """A lock-step worker asked to stop leaves alone (a preemption notice): its run
        restarts its workers on a membership change and can shrink (not the static
        schedule, whose hosts must stay full), and this worker holds a checkpoint (so do
        its peers: they save the same steps)."""
        config = self.session.config
        with self.session.stats.lock:
            held = self.session.stats.checkpoint_step
        return (held > 0 and get_protocol(config.protocol).restarts
                and role_of_config(config).coordination is not Coordination.STATIC)

    def _maybe_adopt_shards(self, completed: int) -> None:
        """A worker of several ranks: its ranks adopt the optimizer's state at one step,
        once every rank has it for every trainable parameter; an optimizer that keeps
        none (SGD without momentum) after a step on every rank is never asked again."""
        assert self.mirror is not None and self.replica is not None
        held = bool(self.optimizer.state)
        ready = held and self.mirror.missing_optimizer_state(self.optimizer) is None
        ready, holding = self.replica.agree(ready, 1.0 if held else 0.0)
        if not holding and completed >= 1:
            self.adopt_state = False
            return
        if self.protocol.may_adopt_state(completed, ready):
            self.adopt_optimizer_state()

    def _maybe_adopt(self, completed: int) -> None:
        """The optimizer's per-parameter state joins the averaged state once it exists for
        every trainable parameter and the protocol allows (see Protocol.may_adopt_state).
        No state at all: no step applied yet, or an optimizer that keeps none (SGD without
        momentum); nothing to adopt either way."""
        if self.mirror is not None:
            self._maybe_adopt_shards(completed)
            return
        if not self.optimizer.state:
            return
        missing = self.state.missing_optimizer_state(self.optimizer)
        if self.protocol.may_adopt_state(completed, missing is None):
            self.adopt_optimizer_state()
        elif missing is not None and completed == STATE_WARNING_STEPS:
            logger.warning(
                "after %d steps the optimizer still has no state for %s (no gradient yet?): "
                "the optimizer state is averaged only once every trainable parameter has "
                "one; freeze unused parameters (requires_grad=False) or pass "
                "average_optimizer_state=False", completed, missing)

    def adopt_optimizer_state(self) -> None:
        """The optimizer's per-parameter state joins the averaged state (again after
        `load_state_dict`, which replaces it); the coordinator compares the full schema
        with the other workers', and executes this worker's groups only with workers whose
        averaged tensors match."""
        if self.mirror is not None:  # every rank's shards of it, checked as one
            assert self.replica is not None
            count = self.mirror.adopt_optimizer_state(self.optimizer)
            schema = worker_schema(self.replica, self.state.schema(), "")[0]
        else:
            count = self.state.adopt_optimizer_state(self.optimizer)
            schema = self.state.schema()
        self._adopted = True
        logger.debug("adopted %d optimizer state tensors", count)
        self.session.check_schema(schema)

    def readopt_after_load(self) -> None:
        if self.adopt_state and self._adopted:
            self.adopt_optimizer_state()

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        self.protocol.close()

    def final_average(self) -> None:
        """Average with every other live worker once more (worker/consensus_share.py)."""
        final_average(self.session, self.ctx, self.state, self.mirror)

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
