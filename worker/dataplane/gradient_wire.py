"""How the gradient-like part of an outer-step synchronisation travels
(worker/dataplane/outer_state.py): in the flat buffer's dtype with the rest, or, with
`--outer-compression bf16`, apart in bfloat16, half the bytes, in a second SUM
collective of its own.

What travels: the group form sends [φ̂ | rest | m̂], the same-anchor form [Δ | rest].
With outer momentum 0 the momentum is never used (m̂ = Δ is multiplied by μ = 0), so m̂
is not sent. With compression the gradient-like part travels apart: m̂ in the group
form and Δ in the same-anchor form. The models and anchors (φ̂) and the rest always
travel in float32: a model rounded to bfloat16 at every synchronisation would lose its
low bits for good. Δ's rounding error is fed back (error feedback, EF-SGD): what rounding
took off this synchronisation's Δ is added to the next one, so over the run every
worker's progress arrives whole. The momentum's is not: m is a running mean that
multiplies each rounding error by μ < 1 at every later synchronisation, so the error
stays within 2⁻⁹/(1 − μ) of m. Every member receives the same SUM, so anchors and
momenta stay bitwise equal among members, compressed or not. The residual is not
checkpointed: a resume loses at most one round's rounding, below 2⁻⁹ of that round's Δ.
"""

from __future__ import annotations

import torch

from ripples.worker.dataplane.nonfinite import void_if_flagged

WIRE_DTYPES: dict[str, torch.dtype | None] = {"none": None, "bf16": torch.bfloat16,
                                              "int8": None}
"""--outer-compression: the dtype the gradient-like part of a synchronisation travels in
(None: the flat buffer's own, in one collective with the rest; int8 has a wire of its own,
worker/dataplane/modular_wire.py, and uses this one only for what it never sends)."""


class GradientWire:
    """The wire of one worker's gradient-like part (m̂, or Δ in the same-anchor form) and
    its error feedback."""

    def __init__(self, compression: str, momentum_factor: float) -> None:
        if compression not in WIRE_DTYPES:
            raise ValueError(f"outer compression must be one of {', '.join(WIRE_DTYPES)}, "
                             f"got {compression!r}")
        self.dtype = WIRE_DTYPES[compression]
        """The dtype the gradient-like part travels in, apart; None: in the flat
        buffer's, with the rest."""
        self.momentum_factor = momentum_factor
        self.residual: torch.Tensor | None = None
        """Error feedback: what bfloat16 rounding took off the Δ sent so far."""
        self.pending_residual: torch.Tensor | None = None
        """The rounding of the Δ staged now, adopted when its collective succeeds."""

    def momentum_travels(self, same_anchor: bool) -> bool:
        """Whether m̂ is in the flat-dtype buffer (group form, momentum above 0, not
        compressed)."""
        return not same_anchor and self.momentum_factor > 0 and self.dtype is None

    def flag_inline(self, same_anchor: bool) -> bool:
        """Whether the non-finite flag travels last in the flat-dtype buffer; else last
        in the bfloat16 Δ (the same-anchor form with compression)."""
        return self.dtype is None or not same_anchor

    def encode(self, values: torch.Tensor, scale: float, *, same_anchor: bool,
               stepped: bool = True, flag: torch.Tensor | None = None) -> torch.Tensor | None:
        """With compression, `values` (m̂ unscaled, or Δ already scaled) in bfloat16,
        scaled, with `flag` after them when given; Δ with error feedback (its rounding is
        adopted at `adopt_residual`) when the member `stepped` since its last
        synchronisation (the same-anchor form; not stepped, the residual waits). None when
        nothing travels apart."""
        if self.dtype is None:
            return None
        if not same_anchor:
            return (torch.mul(values, scale).to(self.dtype)
                    if self.momentum_factor > 0 else None)
        wire = torch.empty(values.numel() + (0 if flag is None else 1),
                           dtype=self.dtype, device=values.device)
        if flag is not None:
            wire[-1:].copy_(flag)
        if not stepped:  # nothing to send: the residual waits for a step
            wire[: values.numel()].copy_(values)
            return wire
        if self.residual is None:
            self.residual = torch.zeros_like(values)
        fed = torch.add(values, self.residual, alpha=scale)  # (Δ + e) / |G|
        rounded = wire[: values.numel()]
        rounded.copy_(fed)
        self.pending_residual = fed.sub_(rounded.to(fed.dtype)).div_(scale)
        return wire

    def adopt_residual(self, flags: torch.Tensor) -> None:
        """The staged Δ's collective succeeded: its rounding is the residual now, unless
        a member's non-finite flag was set (`flags` above 0: the old one stays)."""
        if self.pending_residual is not None and self.residual is not None:
            void_if_flagged(flags, self.residual, self.pending_residual)
        self.residual = self.pending_residual

    def sent_bytes(self, flat: torch.Tensor, numel: int, *, same_anchor: bool,
                   flag: bool) -> int:
        """The bytes a member feeds into one synchronisation over the flat buffer `flat`
        whose head of `numel` values the outer step covers (OuterState.sent_bytes)."""
        wire = (flat.dtype if self.dtype is None else self.dtype).itemsize
        extra = 1 if flag else 0
        if same_anchor:  # the flag after Δ, in its dtype
            return (flat.numel() - numel) * flat.element_size() + (numel + extra) * wire
        momentum = 0 if self.momentum_factor == 0 else numel * wire
        return (flat.numel() + extra) * flat.element_size() + momentum
