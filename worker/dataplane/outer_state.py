"""A worker's outer optimizer state: the anchor and the outer momentum of local-step
training (DiLoCo, arXiv 2311.08105), over the parameters of an `AveragedState`.

Between synchronisations a worker takes its local steps from its anchor φ (the model it
left its last synchronisation with). Its pseudo-gradient is its own progress, Δ = φ − x
(x: its parameters now). DiLoCo averages Δ over every worker and takes one outer
Nesterov SGD step, exactly torch's `SGD(lr=η, momentum=μ, nesterov=True)` with grad Δ̄:

    m ← μ m + Δ̄,    φ ← φ − η (Δ̄ + μ m),    x ← φ.

Ripples' groups are not every worker, and a group's members come from different
synchronisations, so their anchors and momenta differ. Each member therefore takes its
own outer step first (`stage`, no communication: the *provisional* step from its own φ, m
and Δ), the group averages the results in one SUM collective, and every member adopts the
average (`commit`). The step is linear in (φ, m, Δ), so the average of the provisional
steps is one outer step on the group's mean anchor, mean momentum and mean
pseudo-gradient:

    φ' = φ̄ − η (1 + μ) Δ̄ − η μ² m̄,    m' = μ m̄ + Δ̄.

With every worker in the group and equal anchors and momenta (allreduce) it is DiLoCo's
step; with η = 1 and μ = 0 it is φ' = mean x, plain model averaging (P-Reduce). Each
pseudo-gradient is relative to its member's own anchor: relative to the mean anchor it
would count the anchors' disagreement as progress and push it through the momentum,
where averaging the anchors removes it once. All members receive the same SUM and divide
alike, so they leave with bit-identical models, anchors and momenta. A member that has
taken no local step since its last synchronisation (a second group in the same round)
contributes its φ and m unchanged: momentum is applied once per own round, never
compounded (the failure of naive asynchronous Nesterov, arXiv 2401.09135).

When the members' anchors and momenta are known to be bitwise equal (allreduce, where
every worker is in every synchronisation, once one synchronisation in the group form has
made them equal: `in_agreement`) only Δ needs to travel: `stage(..., same_anchor=True)`
sends Δ (P values instead of 2P) and every member takes the identical outer step on the
sum.

What travels (`stage`): the group form sends [φ̂ | rest | m̂], the same-anchor form
[Δ | rest]; with `compression="bf16"` the gradient-like part (m̂, or Δ with error
feedback) travels apart in bfloat16 (worker/dataplane/gradient_wire.py). With
`compression="int8"` the group form travels on a wire of its own instead: φ̂'s low bits
in a byte each, the momentum kept local (worker/dataplane/modular_wire.py).

The anchor is taken at the first local step (`take_anchor`, called by ripples.Optimizer
before the step), not when the optimizer is built: a script that loads weights into the
model after wrapping it (pretrained weights, its own resume) anchors at what it loaded.
A restore (`load_state_dict`) or a heal from a peer sets it instead.

The rest of the flat buffer (floating-point buffers such as BatchNorm's statistics, and
the optimizer state when it is averaged) is averaged plainly alongside. As for
`AveragedState`, the collective runs on a staging buffer of its own: a failed collective
may still write into it afterwards (docs/data-plane.md rule 4), so on failure it is
abandoned and the model, anchor and momentum keep their values.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import Communicator
from ripples.worker.dataplane.gradient_wire import GradientWire
from ripples.worker.dataplane.modular_wire import ModularWire, modular_preduce
from ripples.worker.dataplane.modular_wire import sent_bytes as modular_bytes
from ripples.worker.dataplane.nonfinite import void_if_flagged
from ripples.worker.dataplane.preduce import copy_from_donor, reduce_staged

logger = logging.getLogger(__name__)


class OuterState:
    """The anchor φ and outer momentum m of one worker, shaped like its parameters (the
    head of `state.flat`), and the count of local steps since its last synchronisation.

    Invariant: between a `stage` and its `commit` or `abandon`, only the staging buffer
    changes; `commit` sets the parameters to the new anchor.
    """

    def __init__(self, state: AveragedState, *, lr: float, momentum: float,
                 compression: str = "none") -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"the outer step needs lr > 0 and 0 <= momentum < 1, got lr "
                             f"{lr:g} and momentum {momentum:g}")
        self.gradient_wire = GradientWire(compression, momentum)
        """How the gradient-like part (m̂, or Δ in the same-anchor form) travels."""
        self.modular = ModularWire(state.flat.device) if compression == "int8" else None
        """With int8, the group form's wire (worker/dataplane/modular_wire.py); None: the
        SUM collectives of `stage`."""
        self.state = state
        self.lr = lr
        self.momentum_factor = momentum
        self.numel = sum(p.numel() for p in state.params)
        """The parameters' elements: the head of the flat buffer the outer step covers."""
        with torch.no_grad():
            self.anchor = state.flat[: self.numel].detach().clone()
            self.momentum = torch.zeros_like(self.anchor)
        self.anchored = False
        """The anchor holds the start of this round: taken at the first local step
        (`take_anchor`), restored from a checkpoint, or healed from a peer."""
        self.in_agreement = False
        """Every member's anchor and momentum are known to be bitwise equal (set by a
        protocol whose every worker is in every synchronisation, after one in the group
        form); a restore or a fresh anchor clears it."""
        self.steps_since_sync = 0
        """Local steps since the last synchronisation (0: nothing to contribute)."""
        self._staged_steps = 0
        """Of them, those the synchronisation staged last covers (the rest came after it
        started: a background P-Reduce, worker/dataplane/background.py)."""
        self._staging: torch.Tensor | None = None
        """[head | rest | m̂] in the flat buffer's dtype (head: φ̂, or Δ in the same-anchor
        form; m̂ only when the momentum travels uncompressed)."""
        self._wire: torch.Tensor | None = None
        """The compressed part of a synchronisation (m̂, or Δ), or None."""
        self._same_anchor = False
        self._flag_inline = True
        """Where the staged flag travels: last in the flat-dtype buffer, else last in the
        bfloat16 Δ (the same-anchor form with compression)."""
        self._lock = threading.Lock()
        """Held while the anchor and momentum change or are read whole: a gossip
        protocol's communication thread exchanges them (`exchange`) while the training
        thread may anchor or checkpoint."""

    @classmethod
    def of_config(cls, state: AveragedState, config: pb.RunConfig) -> OuterState | None:
        """The outer state a run's protocol keeps over `state`: one with
        --outer-optimizer nesterov, none otherwise (plain model averaging)."""
        if config.outer_optimizer != "nesterov":
            return None
        return cls(state, lr=config.outer_lr, momentum=config.outer_momentum,
                   compression=config.outer_compression or "none")

    @property
    def residual(self) -> torch.Tensor | None:
        """Error feedback: what bfloat16 rounding took off the Δ sent so far."""
        return self.gradient_wire.residual

    def take_anchor(self, seen: torch.Tensor | None = None) -> None:
        """Before a local step: anchor at the parameters as they are (or as `seen`, a
        snapshot of the flat buffer, holds them), unless the anchor was already taken,
        restored or healed."""
        if self.anchored:
            return
        with torch.no_grad(), self._lock:
            if self.anchored:
                return
            source = self.state.flat if seen is None else seen
            self.anchor.copy_(source[: self.numel])
            self.anchored = True
            self.in_agreement = False

    def record_step(self) -> None:
        """Count one local step (the caller's optimizer stepped)."""
        self.steps_since_sync += 1

    # ------------------------------------------------------------------ collectives
    def stage(self, scale: float, *, same_anchor: bool = False) -> list[torch.Tensor]:
        """The buffers of one synchronisation, each ready for an in-place SUM collective
        over the group, `scale` (1/|G|) applied: the flat buffer's dtype first, then, with
        compression, the bfloat16 one (module docstring, "What travels"). The member's
        non-finite flag (worker/dataplane/nonfinite.py) travels as the last element of
        the first buffer that carries values: the flat-dtype one, or the bfloat16 Δ.

        Group form (default): [φ̂ | rest | m̂], where (φ̂, m̂) is this member's provisional
        outer step (its φ and m as they are if it took no local step since its last
        synchronisation) and rest the flat buffer past the parameters; m̂ travels apart in
        bfloat16 with compression, and not at all with momentum 0.
        `same_anchor=True` (every member's φ and m bitwise equal): [Δ | rest], Δ apart
        in bfloat16 (plus the rounding left over from before) with compression.
        """
        if self.modular is not None:
            raise ValueError("with --outer-compression int8 a group synchronises through "
                             "modular_preduce (an all-gather), not a SUM collective")
        self.take_anchor()  # a member that has not stepped yet: its model is its anchor
        self._staged_steps = self.steps_since_sync
        flat, n = self.state.flat, self.numel
        rest = flat.numel() - n
        self._flag_inline = self.gradient_wire.flag_inline(same_anchor)
        body = n + rest + (n if self.gradient_wire.momentum_travels(same_anchor) else 0)
        size = body + (1 if self._flag_inline else 0)
        if self._staging is None or self._staging.numel() != size:
            self._staging = torch.empty(size, dtype=flat.dtype, device=flat.device)
        staged = self._staging
        self.gradient_wire.pending_residual = None
        with torch.no_grad():
            flag = self.state.take_flag()
            head = staged[:n]
            torch.sub(self.anchor, flat[:n], out=head)  # Δ
            if not same_anchor:
                moment = staged[n + rest : body] if body > n + rest else torch.empty_like(head)
                self.provisional_step(head, moment, spend=self._staged_steps > 0)
            staged[n : n + rest].copy_(flat[n:])
            staged[:body].mul_(scale)
            self._wire = self.gradient_wire.encode(
                head if same_anchor else moment, scale, same_anchor=same_anchor,
                stepped=self._staged_steps > 0, flag=None if self._flag_inline else flag)
            if self._flag_inline:
                staged[body:].copy_(flag)
        self._same_anchor = same_anchor
        parts = [staged if self._flag_inline else staged[n:], self._wire]
        return [t for t in parts if t is not None and t.numel()]

    def sent_bytes(self, *, same_anchor: bool = False, flag: bool = True) -> int:
        """The bytes a member feeds into one synchronisation (what `stage` returns): the
        flat buffer's size, with the gradient-like part (the group form's momentum, none
        at momentum 0; the same-anchor form's Δ, in place of φ̂) in bfloat16 with
        compression, and the non-finite flag (one element of the buffer it ends; not
        `flag`: a gossip exchange, which carries none); with int8, the payload of
        worker/dataplane/modular_wire.py."""
        if self.modular is not None:
            flat = self.state.flat
            return modular_bytes(self.numel, flat.numel() - self.numel, flat.element_size())
        return self.gradient_wire.sent_bytes(self.state.flat, self.numel,
                                             same_anchor=same_anchor, flag=flag)

    def provisional_step(self, delta_then_anchor: torch.Tensor, moment: torch.Tensor, *,
                          spend: bool) -> None:
        """In place: Δ becomes φ̂ = φ − η (Δ + μ m̂), and `moment` gets m̂ = μ m + Δ; or,
        not `spend`ing (no local step since the last synchronisation, or progress kept for
        a later one), the identity step φ̂ = φ, m̂ = m. The operations are torch's
        SGD(nesterov=True), in its order."""
        if not spend:
            delta_then_anchor.copy_(self.anchor)
            moment.copy_(self.momentum)
            return
        torch.mul(self.momentum, self.momentum_factor, out=moment)
        moment.add_(delta_then_anchor)  # m̂ = μ m + Δ
        delta_then_anchor.add_(moment, alpha=self.momentum_factor)  # Δ + μ m̂
        torch.add(self.anchor, delta_then_anchor, alpha=-self.lr, out=delta_then_anchor)

    def commit(self) -> None:
        """Adopt the collective's result: the group's anchor, momentum and the rest of the
        flat buffer; the parameters become the anchor. Where a member's non-finite flag
        was set (the group's sum of flags above 0), every member keeps its model, anchor,
        momentum and residual instead: selected on the device, no read-back. Its progress
        since the anchor stays in its model, for its next synchronisation after a step."""
        assert self._staging is not None, "commit() without stage()"
        flat, n, staged, wire = self.state.flat, self.numel, self._staging, self._wire
        rest = staged[n : flat.numel()]
        with torch.no_grad():
            flags = staged[-1:] if self._flag_inline else wire[-1:]  # type: ignore[index]
            if self._same_anchor and self._staged_steps:
                delta = staged[:n]  # the group's Δ̄: every member steps identically
                if wire is not None:
                    delta.copy_(wire[:n])
                    self.gradient_wire.adopt_residual(flags)
                momentum = torch.mul(self.momentum, self.momentum_factor).add_(delta)
                delta.add_(momentum, alpha=self.momentum_factor)
                anchor = torch.add(self.anchor, delta, alpha=-self.lr)
                void_if_flagged(flags, self.momentum, momentum)
                void_if_flagged(flags, self.anchor, anchor)
                self.momentum.copy_(momentum)
                self.anchor.copy_(anchor)
            elif not self._same_anchor:
                anchor = staged[:n]
                momentum = self._group_momentum(staged[flat.numel() : -1], wire)
                void_if_flagged(flags, self.anchor, anchor)
                void_if_flagged(flags, self.momentum, momentum)
                self.anchor.copy_(anchor)
                self.momentum.copy_(momentum)
            # (same anchor, nothing unspent anywhere: no outer step, no momentum)
            head = self.anchor.clone()
            void_if_flagged(flags, flat[:n], head)
            void_if_flagged(flags, flat[n:], rest)
            flat[:n].copy_(head)
            flat[n:].copy_(rest)
        self._wire = self.gradient_wire.pending_residual = None
        self.steps_since_sync -= self._staged_steps  # 0, but for steps taken since the stage
        self._staged_steps = 0
        self.anchored = True

    def commit_late(self, snapshot: torch.Tensor) -> None:
        """Adopt the result of a synchronisation staged when the flat buffer held
        `snapshot`, after the worker took further steps (a background P-Reduce): the
        group's anchor, momentum and rest as `commit` adopts them, and the model is the new
        anchor plus the progress since the stage (x − x_t), which the next
        synchronisation counts as the steps taken since. Where a member's flag was set,
        the model, anchor and momentum stay as they are, as with `commit`. `snapshot`
        is overwritten (with that progress)."""
        assert self._staging is not None, "commit_late() without stage()"
        with torch.no_grad():
            since = torch.sub(self.state.flat, snapshot, out=snapshot)
            flags = self._staging[-1:] if self._flag_inline else self._wire[-1:]  # type: ignore[index]
            void_if_flagged(flags, since.new_zeros(()), since)
            self.commit()
            self.state.flat.add_(since)

    def _group_momentum(self, uncompressed: torch.Tensor,
                        wire: torch.Tensor | None) -> torch.Tensor:
        """The group's momentum from a group-form synchronisation: the flat-dtype tail, the
        bfloat16 buffer, or (momentum 0, where it never counts) zero."""
        if uncompressed.numel():
            return uncompressed
        if wire is not None:
            return wire.to(self.momentum.dtype)
        return torch.zeros_like(self.momentum)

    def abandon(self) -> None:
        """Forget the staging buffers after a failed collective; nothing else changed (the
        error feedback's residual included: the Δ it belongs to is still unsent)."""
        self._staging = self._wire = self.gradient_wire.pending_residual = None

    # ------------------------------------------------------------------ gossip
    def exchange(self, seen: torch.Tensor, comm: Communicator, timeout_seconds: float, *,
                 spend: bool) -> torch.Tensor:
        """One synchronisation on a snapshot `seen` of the flat buffer (the model as the
        partners see it), for a gossip protocol's communication thread, which never writes
        the model (docs/data-plane.md rule 6): the anchor and momentum become the group's
        and the return value is the delta the model takes at its next step boundary.

        `spend`: this member's progress since its last synchronisation goes into the
        group's outer step (its provisional step; the model becomes the new anchor plus
        the steps taken since `seen`). Otherwise (a partner mid-round) it contributes its
        anchor and momentum unchanged and keeps its progress: the model moves with the
        anchor (by φ' − φ), so the progress counts in its own next spent step, once, and
        its momentum is applied once per round of its own. The staging buffer is fresh
        each time (a failed collective may write into it later: rule 4); on failure the
        anchor and momentum keep their values."""
        if self.modular is not None:
            raise ValueError("a gossip exchange has no int8 wire (--outer-compression int8 "
                             "is for the Group Generator's and the static schedule's groups)")
        self.take_anchor(seen)
        n, total = self.numel, seen.numel()
        scale = 1.0 / comm.size
        with torch.no_grad():
            inline = self.gradient_wire.momentum_travels(False)
            staged = torch.empty(total + (n if inline else 0), dtype=seen.dtype,
                                 device=seen.device)
            moment = staged[total:] if inline else torch.empty_like(seen[:n])
            with self._lock:
                torch.sub(self.anchor, seen[:n], out=staged[:n])
                self.provisional_step(staged[:n], moment, spend=spend)
                old_anchor = None if spend else self.anchor.clone()
            staged[n:total].copy_(seen[n:])
            staged.mul_(scale)
            wire = self.gradient_wire.encode(moment, scale, same_anchor=False)
        for part in (staged, wire):
            if part is not None:
                comm.allreduce_sum_(part, timeout_seconds)
        with torch.no_grad():
            delta = torch.empty_like(seen)
            with self._lock:
                self.anchor.copy_(staged[:n])
                self.momentum.copy_(self._group_momentum(staged[total:], wire))
                self.in_agreement = False
            base = seen[:n] if old_anchor is None else old_anchor
            torch.sub(staged[:n], base, out=delta[:n])
            torch.sub(staged[n:total], seen[n:], out=delta[n:])
        return delta

    # ------------------------------------------------------------------ healing
    def heal(self, comm: Communicator, donor: int, model_numel: int,
             timeout_seconds: float, *, seen: torch.Tensor | None = None) -> None:
        """A heal group (an elastic join): the joiner takes the donor's anchor, momentum
        and model buffers, and its parameters become the donor's *anchor*, its last
        synchronised point, not its model mid-round: the donor's progress since then is
        in the donor's next pseudo-gradient, and copying it would count it twice. The
        donor keeps its own; the joiner's inner optimizer state starts anew. `seen`: a
        donor's snapshot of its flat buffer, where another thread trains the model."""
        n, flat = self.numel, self.state.flat
        source = flat if seen is None else seen
        self.take_anchor(seen)  # a donor that has not stepped yet: its model is its anchor
        with torch.no_grad(), self._lock:
            payload = torch.cat([self.anchor, self.momentum, source[n:model_numel]])
        copied = copy_from_donor(payload, comm, donor, timeout_seconds)
        if copied is None:  # the donor
            return
        self.state.forget_flag()
        with torch.no_grad():
            self.anchor.copy_(copied[:n])
            self.momentum.copy_(copied[n : 2 * n])
            flat[:n].copy_(self.anchor)
            flat[n:model_numel].copy_(copied[2 * n :])
        self.anchored, self.in_agreement, self.steps_since_sync = True, False, 0
        self.gradient_wire.residual = None  # the rounding owed was on the old anchor's path

    # ------------------------------------------------------------------ checkpoints
    def restore(self, saved: object) -> None:
        """After a checkpoint's model was loaded: `saved` is its `state_dict()`, or None
        where it holds none (another protocol's, a run without the outer optimizer):
        then start afresh from the model."""
        if isinstance(saved, dict):
            self.load_state_dict(saved)
        else:
            self.restart_from_model()

    def restart_from_model(self) -> None:
        """Start afresh from the parameters as they will be at the next local step (a
        checkpoint that holds no outer state was loaded): they become the anchor, the
        momentum is zero."""
        with torch.no_grad():
            self.momentum.zero_()
        self.anchored, self.in_agreement, self.steps_since_sync = False, False, 0
        self.gradient_wire.residual = None

    def state_dict(self) -> dict[str, Any]:
        """CPU copies of the anchor and momentum, the step count and the outer step's
        hyper-parameters."""
        self.take_anchor()
        with self._lock:
            return {"anchor": self.anchor.detach().to("cpu", copy=True),
                    "momentum": self.momentum.detach().to("cpu", copy=True),
                    "steps_since_sync": self.steps_since_sync, "lr": self.lr,
                    "momentum_factor": self.momentum_factor}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore a `state_dict`; ValueError if it was saved for another model. A
        different outer lr or momentum is this run's to choose (as a learning rate on
        resume): it is used from now on, with a warning."""
        for key, option in (("lr", "outer_lr"), ("momentum_factor", "outer_momentum")):
            if float(saved[key]) != getattr(self, key):
                logger.warning("the checkpoint's outer step had %s %g, this run has %g: "
                               "the run's value applies from now on", option,
                               float(saved[key]), getattr(self, key))
        for key in ("anchor", "momentum"):
            value = saved[key]
            if not isinstance(value, torch.Tensor) or value.shape != self.anchor.shape:
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(f"the checkpoint's outer {key} has shape {shape}, this "
                                 f"model's parameters {self.numel} values: not this model")
        with torch.no_grad(), self._lock:
            self.anchor.copy_(saved["anchor"])
            self.momentum.copy_(saved["momentum"])
            self.steps_since_sync = int(saved["steps_since_sync"])
            self.anchored, self.in_agreement = True, False
            self.gradient_wire.residual = None  # not checkpointed (gradient_wire.py)


def outer_preduce(outer: OuterState, comm: Communicator, timeout_seconds: float, *,
                  same_anchor: bool = False) -> None:
    """Synchronise local-step training over one group: every member takes its own outer
    step, the group averages the results, and every member leaves with the group's model,
    anchor and outer momentum (outer_state.py). `same_anchor`: the members' anchors and
    momenta are bitwise equal (allreduce), so only the pseudo-gradients travel.

    One SUM collective on the outer state's staging buffer, pre-scaled by 1/|G| as in
    `preduce`; on any error the staging buffer is abandoned and the model, anchor and
    momentum keep their local values."""
    if outer.modular is not None and not same_anchor:
        modular_preduce(outer, comm, timeout_seconds)
        return
    reduce_staged(outer, outer.stage(1.0 / comm.size, same_anchor=same_anchor),
                  lambda staged: comm.allreduce_sum_(staged, timeout_seconds))
