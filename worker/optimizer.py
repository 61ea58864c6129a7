"""`ripples.Optimizer`: the user's optimizer, then the run's synchronisation.

Wraps any `torch.optim.Optimizer` built over the model's parameters. `step()` runs the
wrapped optimizer's step (the local step), then the run's protocol: a P-Reduce in the
group the coordinator forms, a gossip exchange, hop's Recv/Reduce, or nothing more for
`allreduce`, whose DDP hooks averaged the gradients during backward. In single-process
mode (no coordinator) `step()` is the wrapped step and nothing else.

It is a `torch.optim.Optimizer` itself, sharing the wrapped optimizer's `param_groups`
and `state`, so learning-rate schedulers, `torch.amp.GradScaler` and gradient clipping
work on it as on the optimizer it wraps (the class doc says how).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

from ripples.state_dicts import compact_state_dicts
from ripples.worker.protocol import DDP_NO_SYNC
from ripples.worker.synchronizer import StepSynchronizer, StepTimes

if TYPE_CHECKING:
    from ripples.worker.api import Worker
    from ripples.worker.dataplane.outer_state import OuterState

logger = logging.getLogger(__name__)

LOSS_FLUSH_STEPS = 16
"""Losses reported as device tensors are read back in batches of this many steps (one
host-device sync per batch instead of one per step)."""


class Optimizer(torch.optim.Optimizer):
    """The wrapped optimizer's step, then this run's synchronisation.

    Args:
        optimizer: The local optimizer, built over `model`'s parameters.
        model: The model whose state the workers average (parameters, floating-point
            buffers such as BatchNorm statistics, and by default the optimizer's
            per-parameter state); see docs/library.md for each protocol.
        average_optimizer_state: Average the optimizer's per-parameter state (momentum,
            Adam's moments) with the model, for protocols that replace the model by a
            group's average. None: the run's setting (on by default).
        on_nonfinite: "raise" (default): a non-finite value in the averaged state fails
            the worker with a FloatingPointError before anything is sent. "skip": a step
            whose gradients are not all finite is skipped (not applied, counted in
            `skipped_steps`); training and synchronisation go on.
        planned_steps: How many steps this worker intends to make (e.g. epochs x
            len(loader)): the run's progress and its iteration budget. None: the run's
            `--iterations`, else no budget (your loop decides; `stopped` still turns True
            when the coordinator stops the run).
        worker: The worker `ripples.init()` returned in this process (and that has not
            shut down): for a script that calls init() itself and wants that explicit.
            None: this calls `ripples.init()`, which returns the process's worker or, the
            first time, joins the run the launch environment names.

    Raises:
        ValueError: a misuse, with what to do instead: an optimizer that holds tensors
            that are not the model's, a second ripples.Optimizer in the process, a
            `worker` that is not this process's live one.
        TypeError: `optimizer`, `model` or `worker` is not of its type.

    One ripples.Optimizer per process. Check `stopped` after each step and leave the loop
    when it is True: the coordinator stopped the run (budget, target loss, a stop
    request, a peer that lock-step protocols cannot do without) or a signal asked this
    worker to stop.

    Why it is built this way: as any `torch.optim.Optimizer` subclass, it runs the base
    class's `__init__` (over copies of the wrapped optimizer's parameter groups), so what
    torch sets up for an optimizer (step hooks, the profiler's step wrapper, whatever a
    later version adds) is torch's own, not rebuilt here from private names. Then its
    `param_groups` and `state` (public attributes) become the wrapped optimizer's objects,
    so schedulers and GradScaler change the wrapped optimizer's values, and become them
    again each time the wrapped optimizer's load_state_dict replaces both (a hook
    registered through its public `register_load_state_dict_post_hook`; the new state
    tensors rejoin the averaged state there too, and a pre-hook lands a background
    P-Reduce still in flight before the load). `step()` is an ordinary subclass step:
    torch calls the step hooks around all of it (local step and synchronisation). In a
    distributed run, the model's and the wrapped optimizer's `state_dict()` copy what is
    a view into the averaged state (public state_dict post-hooks: ripples/state_dicts.py),
    so that torch.save writes what they name, as with DDP.
    """

    _step_supports_amp_scaling = True
    """GradScaler hands the step its inf check (`found_inf`) instead of skipping step()
    altogether, so that a skipped local step still takes part in the synchronisation."""

    _constructed = False
    """False while torch.optim.Optimizer.__init__ adds the parameter groups."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
                 average_optimizer_state: bool | None = None,
                 on_nonfinite: Literal["raise", "skip"] = "raise",
                 planned_steps: int | None = None,
                 worker: Worker | None = None) -> None:
        if isinstance(optimizer, Optimizer):
            raise ValueError("this optimizer is already a ripples.Optimizer")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"ripples.Optimizer wraps a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        if planned_steps is not None and planned_steps < 0:
            raise ValueError("planned_steps must not be negative")
        own = {id(p) for p in model.parameters()}
        foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
        if foreign:
            raise ValueError(f"the optimizer holds {len(foreign)} tensor(s) that are not "
                             "parameters of the model; build it over model.parameters()")
        worker = _this_process_worker(worker)
        # Copies: the base class normalises the groups it is given in place, and the
        # wrapped optimizer's are the user's. The shared ones replace them right after.
        super().__init__([dict(group) for group in optimizer.param_groups], optimizer.defaults)
        self._constructed = True
        self._share_wrapped(optimizer)
        self.optimizer = optimizer
        """The wrapped (local) optimizer."""
        self.model = model
        self.on_nonfinite = on_nonfinite
        self.local_step = 0
        """Optimizer steps this worker made."""
        self.skipped_steps = 0
        """Steps not applied: non-finite gradients (on_nonfinite="skip") or GradScaler."""
        self.stop_reason = ""
        self._pending_losses: list[torch.Tensor] = []
        self._warned_after_stop = False
        self.worker = worker
        self.worker._register_optimizer(self)
        config = self.worker._session.config if self.worker._session else None
        if planned_steps is None:
            planned_steps = int(config.iterations) if config is not None else 0
        self.planned_steps = planned_steps
        self._sync: StepSynchronizer | None = None
        if self.worker._session is not None:
            self._sync = StepSynchronizer(self.worker._session, model, optimizer,
                                          average_optimizer_state=average_optimizer_state,
                                          planned_steps=planned_steps)
            membership = self.worker._session.membership
            if membership.replacement:  # it continues the iterations of the rank it took
                self.local_step = int(membership.start_iteration)
        self._check_gradients = on_nonfinite == "skip" or (
            self._sync is not None and self._sync.protocol.syncs_gradients)
        if not hasattr(model, DDP_NO_SYNC):
            # DDP's `with model.no_sync():` where nothing syncs inside backward (every
            # protocol but allreduce, which gave the model its own, and single-process
            # mode): nothing to skip. A class, not a method of this optimizer, so that
            # copy.deepcopy and pickling of the model stay as they were.
            setattr(model, DDP_NO_SYNC, contextlib.nullcontext)
        # Last: a construction refused above leaves the user's model and optimizer untouched.
        if self._sync is not None:  # their tensors are now views into the averaged state
            compact_state_dicts(model, optimizer)
        optimizer.register_load_state_dict_pre_hook(self._before_wrapped_load)
        optimizer.register_load_state_dict_post_hook(self._after_wrapped_load)

    # ------------------------------------------------------------------ torch.optim API
    def _share_wrapped(self, optimizer: torch.optim.Optimizer) -> None:
        """Point `param_groups` and `state` at the wrapped optimizer's (again after its
        load_state_dict, which replaces both)."""
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def _before_wrapped_load(self, optimizer: torch.optim.Optimizer,
                             state_dict: dict[str, Any]) -> None:
        """Before the wrapped optimizer's load_state_dict replaces its state: a background
        P-Reduce (--overlap) still in flight lands first, on the state it was started
        from, rather than on the loaded one."""
        if self._sync is not None:
            self._sync.protocol.settle()

    def _after_wrapped_load(self, optimizer: torch.optim.Optimizer) -> None:
        """After the wrapped optimizer's load_state_dict, called through this one or on
        it directly: share its new `param_groups` and `state`, whose tensors rejoin the
        averaged state (the protocols that average it keep doing so)."""
        self._share_wrapped(optimizer)
        if self._sync is not None:
            self._sync.readopt_after_load()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._constructed:  # torch.optim.Optimizer.__init__ adding the copies
            super().add_param_group(param_group)
            return
        raise NotImplementedError("the averaged state is fixed when ripples.Optimizer is "
                                  "built: add every parameter group to the optimizer first")

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, plus Ripples' own counters under "ripples"
        (a plain optimizer loads it too, ignoring that key), and there too, with an outer
        optimizer (--outer-optimizer nesterov), its anchor and momentum. Its tensors are
        copies where the optimizer's are views into the averaged state, so torch.save
        writes what it names and no more."""
        state = self.optimizer.state_dict()
        state["ripples"] = {"local_step": self.local_step, "skipped_steps": self.skipped_steps}
        outer = self._outer()
        if outer is not None:  # the anchor and outer momentum (--outer-optimizer nesterov)
            state["ripples"]["outer"] = outer.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer (its new `param_groups` and `state` are this
        optimizer's too); its new state tensors rejoin the averaged state (the protocols
        that average it keep doing so). With an outer optimizer, its anchor and momentum
        come back too; a state dict without them starts them afresh from the model as it
        is then (load the model first)."""
        state_dict = dict(state_dict)
        own = state_dict.pop("ripples", None)
        self.optimizer.load_state_dict(state_dict)  # then _after_wrapped_load
        if own is not None:
            self.local_step = int(own.get("local_step", self.local_step))
            self.skipped_steps = int(own.get("skipped_steps", self.skipped_steps))
        outer = self._outer()
        if outer is not None:
            outer.restore((own or {}).get("outer"))

    def _outer(self) -> OuterState | None:
        """The protocol's outer optimizer state, if it has one."""
        return self._sync.protocol.outer if self._sync is not None else None

    def __repr__(self) -> str:
        protocol = self.worker.protocol or "single-process"
        return f"ripples.Optimizer({self.optimizer!r}, protocol={protocol})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a ripples.Optimizer cannot be pickled; save state_dict() instead")

    # ------------------------------------------------------------------ training
    @property
    def stopped(self) -> bool:
        """The run is over for this worker: leave the training loop."""
        return bool(self.stop_reason)

    @property
    def global_step(self) -> int:
        """Steps of an average worker of the run (its global progress): what learning-
        rate schedules should follow, so that a worker that is slower, or joined late,
        follows the run's schedule rather than its own count. Single-process, and in
        lock-step protocols (allreduce, ripples-static: every worker is at the same step),
        local_step: a heartbeat-timed estimate would differ between workers there."""
        session = self.worker._session
        if session is None or (self._sync is not None and self._sync.protocol.stops_together):
            return self.local_step
        return max(0, round(session.global_iterations(self.local_step)))

    @property
    def step_times(self) -> StepTimes:
        """Where the steps spent their time: local step, sync, Ripples' own overhead."""
        return self._sync.times if self._sync is not None else StepTimes()

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside do not synchronise gradients (gradient accumulation with
        `allreduce`, as DDP's `model.no_sync()`, which works on the model too, as does
        `model.require_backward_grad_sync = False`); other protocols synchronise in
        step() only, so it changes nothing for them."""
        return self._sync.protocol.no_sync() if self._sync is not None else (
            contextlib.nullcontext())

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """The local step, then the protocol's synchronisation (see the class doc)."""
        started = time.perf_counter()
        if self._sync is not None:
            self._sync.before_local_step()
        loss = self._local_step(closure)
        local_seconds = time.perf_counter() - started
        self.local_step += 1
        sync = self._sync
        if self.stop_reason:
            if not self._warned_after_stop:
                logger.warning("the run has stopped (%s); this step and later ones are "
                               "local: check opt.stopped and leave the loop%s",
                               self.stop_reason, self._budget_hint())
                self._warned_after_stop = True
        elif sync is not None:
            self.stop_reason = sync.after_local_step(self.local_step, local_seconds, started)
        elif self.planned_steps and self.local_step >= self.planned_steps:
            self.stop_reason = f"iteration budget reached ({self.planned_steps} steps)"
        return loss

    def _budget_hint(self) -> str:
        """A loop that makes one step more than it planned (`while iter <= max_iters`,
        `range(max_iters + 1)`) ran into its own budget: say what to pass instead."""
        if not self.planned_steps or self.local_step != self.planned_steps + 1:
            return ""
        return (f". This is step {self.local_step} of a loop planned for "
                f"{self.planned_steps}: if your loop makes {self.local_step} steps (e.g. "
                f"`while iter_num <= max_iters`), pass planned_steps={self.local_step}")

    def _local_step(self, closure: Callable[[], float] | None) -> float | None:
        inner = self.optimizer
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step
        if found_inf is None:
            if self._check_gradients and self._gradients_nonfinite():
                if self.on_nonfinite == "raise":
                    raise FloatingPointError(
                        f"non-finite gradients at step {self.local_step + 1} (with "
                        "allreduce: after averaging, so some worker's loss or gradients "
                        "were not finite); nothing was applied. Lower the learning rate, "
                        "clip the gradients, or pass on_nonfinite='skip'")
                self.skipped_steps += 1
                return None
            return inner.step(closure) if closure is not None else inner.step()
        grad_scale = getattr(self, "grad_scale", None)
        if getattr(inner, "_step_supports_amp_scaling", False):  # e.g. fused Adam
            inner.grad_scale, inner.found_inf = grad_scale, found_inf  # type: ignore[attr-defined]
            try:
                return inner.step(closure) if closure is not None else inner.step()
            finally:
                del inner.grad_scale, inner.found_inf  # type: ignore[attr-defined]
        if float(found_inf) > 0:  # the read GradScaler's own path makes too
            self.skipped_steps += 1
            return None
        if grad_scale is not None:  # the scaler did not unscale_ yet: unscale here
            grads = [p.grad for g in self.param_groups for p in g["params"]
                     if p.grad is not None]
            torch._foreach_div_(grads, grad_scale.to(grads[0].device) if grads else grad_scale)
        return inner.step(closure) if closure is not None else inner.step()

    def _gradients_nonfinite(self) -> bool:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return False
        largest = torch.stack(torch._foreach_norm(grads, math.inf)).max()
        return not math.isfinite(float(largest))

    def report_loss(self, loss: float | torch.Tensor, num_samples: int | None = None) -> None:
        """This step's training loss (and batch size), for the run's progress: the
        coordinator's mean loss, the dashboard's curves and the target loss. A tensor on
        a GPU is read back in batches, not one host sync per step. Non-finite losses are
        not reported."""
        if isinstance(loss, torch.Tensor):
            value = loss.detach()
            if value.device.type != "cpu":
                self._pending_losses.append(value.reshape(()))
                if len(self._pending_losses) >= LOSS_FLUSH_STEPS:
                    self._flush_losses()
                self._count_samples(num_samples)
                return
            loss = float(value)
        self._add_loss(float(loss))
        self._count_samples(num_samples)

    def _flush_losses(self) -> None:
        values = torch.stack(self._pending_losses).tolist()
        self._pending_losses.clear()
        for value in values:
            self._add_loss(value)

    def _add_loss(self, value: float) -> None:
        session = self.worker._session
        if session is None or not math.isfinite(value):
            return
        with session.stats.lock:
            session.stats.add_loss(value)

    def _count_samples(self, num_samples: int | None) -> None:
        session = self.worker._session
        if session is not None and num_samples:
            with session.stats.lock:
                session.stats.samples += num_samples

    # ------------------------------------------------------------------ the end
    def _finish(self, error: str) -> dict[str, object] | None:
        """Called by the worker's shutdown: flush the losses, close the protocol; returns
        this worker's record of the run (None in single-process mode)."""
        if self._pending_losses:
            self._flush_losses()
        if self._sync is None:
            return None
        ended_well = not error and not self.worker._session.fatal_error  # type: ignore[union-attr]
        if ended_well:
            self._sync.protocol.settle()  # a background P-Reduce lands before the close
        self._sync.close()
        if ended_well:
            self._sync.drain_gate()  # the last steps' flags, still on their way
            self._sync.final_average()
        return self._sync.record(self.stop_reason or error or "the training loop ended")


def _this_process_worker(worker: Worker | None) -> Worker:
    """`worker` if it is this process's live worker (None: `ripples.init()`'s)."""
    from ripples.worker.api import Worker, current_worker, init

    if worker is None:
        return init()
    if not isinstance(worker, Worker):
        raise TypeError(f"worker must be the ripples.Worker that ripples.init() returned, "
                        f"got {type(worker).__name__}")
    if worker is not current_worker():
        state = "has shut down" if worker._shut_down else "is not this process's worker"
        raise ValueError(f"this worker {state}: pass the worker ripples.init() returns now "
                         "(or leave worker out and ripples.Optimizer calls ripples.init())")
    return worker
