"""`--outer-compression int8`: a group's outer synchronisation in one byte a parameter
instead of eight (float32) or six (`bf16`), without rounding the model.

The group form (worker/dataplane/outer_state.py) averages each member's provisional
anchor φ̂ and momentum m̂. φ̂ is a model: rounding it to a few bits would lose its low
bits for good. But the members of a group agree on φ̂'s high bits: their anchors differ
by the progress of their last few rounds, not by their magnitude. So each member sends
only the low bits, modulo a width B (modular quantisation, Moniqua, arXiv 2002.11787),
and every receiver supplies the high bits from its own φ̂:

    s = B / 256,  q_j = round(φ̂_j / s)  (an integer),  sent: c_j = q_j mod 256 (a byte)
    receiver i:   k_j = q_i + ((c_j − q_i + 128) mod 256) − 128,   φ̃_j = s k_j

k_j = q_j exactly whenever |q_j − q_i| < 128, that is when the two members' φ̂ are
within B/2 of each other: then every member decodes every φ̂ to the same integers, sums
them exactly (integers), and leaves with the same bits, as with a float SUM. The only
error is the rounding to the step s, at most s/2 per value and per synchronisation,
never accumulated in a member's own model: the anchors and models are never averaged in
low precision; only their differences travel in few bits.

**The width B**, per block of 128 parameters, is agreed before the values travel: each
member proposes `width` times its block's largest outer step (|φ̂ − φ|) plus progress
(|φ − x|), never below 2⁻¹² of its block's largest |φ̂| (so that s stays above float32's
resolution of φ̂), and the group takes the largest proposal (a MAX collective over one
float per block). A block whose members disagree by more than B/2 decodes wrongly at
some member; **a checksum** per block (the integers weighted by fixed distinct weights,
summed exactly in int64) reveals it there, the members agree on the blocks to void (a
MAX collective over one byte per block), and in a voided block every member keeps its
own model, anchor and momentum, as for a non-finite flag (worker/dataplane/nonfinite.py):
its progress stays in its model for its next synchronisation. Each member's `width`
doubles after a synchronisation with a voided block and shrinks back towards its base
after clean ones, on the device (no read-back).

**The momentum stays local**: each member keeps its own m̂ = μ m + Δ (its provisional
momentum) and sends none of it. The group's new anchor is the same as with the momenta
averaged, φ' = mean φ̂ (the average of the provisional steps already carries every
member's μ m̂); only what each member carries into its next round is its own running
mean of pseudo-gradients, which the next group averages in φ̂ again. Measured on the
Transformer LM (8 workers, H = 8, 20 Mbit/s links): the same loss at equal steps as
averaged momenta, and the bytes halved (docs/local-steps.md, "Compression"). **The
rest** of the flat buffer (buffers, averaged optimizer state) and the non-finite flag
travel in their own dtype.

**The collectives:** the MAX of the widths, one all-gather of each member's bytes
(decoded and summed by every member in the same order, never summed in int8), and the
MAX of the voided blocks. An all-gather brings each member (|G| − 1) payloads, where a
ring all-reduce brings 2 (|G| − 1)/|G|: so int8 pays in small groups (the Group
Generator's), not over every worker; allreduce and the gossip protocols refuse it.
`modular_phases` is the synchronisation in phases, one per collective, so that it can
also run in the background (`--overlap`, worker/dataplane/background.py) on a snapshot of
the state, landing with the steps taken since on top.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ripples.worker.dataplane.nonfinite import void_if_flagged

if TYPE_CHECKING:
    from ripples.worker.dataplane.communicators import Communicator
    from ripples.worker.dataplane.outer_state import OuterState

BLOCK = 128
"""Parameters per block: one width and one checksum each. With 128 the
rounding of a block's checksum stays under B/4, and one wrapped value moves it by at
least 3B/4."""
LEVELS = 256
"""Steps of the width a byte tells apart."""
BASE_WIDTH = 8.0
"""A member's width factor at the start, and the least it shrinks back to."""
MAX_WIDTH = 4096.0
WIDEN, NARROW = 2.0, 0.95
"""The width factor's change after a synchronisation with (without) a voided block."""
RELATIVE_FLOOR = 2.0 ** -12
"""The width never falls below this fraction of the block's largest |φ̂|: the step s is
then above 2⁻²⁰ of it, well above float32's resolution (2⁻²⁴)."""
ABSOLUTE_FLOOR = 2.0 ** -40
"""The width of a block of zeros."""
_PRIME = 1_048_573


def checksum_weights(device: torch.device) -> torch.Tensor:
    """BLOCK distinct weights in [1, 2²⁰) (int64): one wrapped value, or two, always
    change a block's weighted sum."""
    index = torch.arange(BLOCK, dtype=torch.int64, device=device)
    return (index * 2_654_435_761) % _PRIME + 1


class ModularWire:
    """One worker's int8 wire: its width factor, kept on the device."""

    def __init__(self, device: torch.device) -> None:
        self.width = torch.full((), BASE_WIDTH, dtype=torch.float64, device=device)
        """This member's factor: its proposed width over its block's outer step."""
        self.weights = checksum_weights(device)
        self.voided_blocks = torch.zeros((), dtype=torch.int64, device=device)
        """Blocks voided so far for a wrong decode (read once at the end, for the
        worker's record in summary.json)."""


def blocks(values: torch.Tensor) -> torch.Tensor:
    """`values` (1-D) as rows of BLOCK, padded with zeros."""
    pad = -values.numel() % BLOCK
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return values.reshape(-1, BLOCK)


def payload_layout(numel: int, rest_bytes: int) -> list[tuple[str, int]]:
    """The sections of one member's bytes, in order, each a multiple of 8 bytes long so
    that each starts aligned for its dtype: the checksums (int64), the rest and the flag
    (their dtype), the codes of φ̂."""
    count = -(-numel // BLOCK)
    sections = [("checksum", count * 8), ("rest", rest_bytes), ("anchor", count * BLOCK)]
    return [(name, -(-size // 8) * 8) for name, size in sections]


def sent_bytes(numel: int, rest_numel: int, itemsize: int) -> int:
    """What a member feeds into one int8 synchronisation: its payload, its proposed
    widths and its voided blocks."""
    payload = sum(size for _, size in payload_layout(numel, (rest_numel + 1) * itemsize))
    count = -(-numel // BLOCK)
    return payload + count * 4 + count


def _split(payload: torch.Tensor, layout: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
    parts, at = {}, 0
    for name, size in layout:
        parts[name] = payload[at : at + size]
        at += size
    return parts


def modular_preduce(outer: OuterState, comm: Communicator, timeout_seconds: float) -> None:
    """The group form's synchronisation over `comm` with the int8 wire (module
    docstring), in the foreground: every member leaves with the group's anchor and rest
    and its own provisional momentum, except in voided blocks (its own anchor, model and
    momentum as they were), or entirely as it was where a member's non-finite flag was
    set. Every collective writes into fresh buffers: on any error nothing has changed."""
    for what, work in modular_phases(outer, comm, outer.state.flat):
        comm.wait(work, what, timeout_seconds)


def modular_phases(outer: OuterState, comm: Communicator, seen: torch.Tensor
                   ) -> Generator[tuple[str, dist.Work], None, None]:
    """One int8 synchronisation of the state `seen` held (the flat buffer itself, or a
    snapshot of it taken when a background synchronisation started), in phases: each
    yields the name and work of the collective it started, and the caller resumes it
    once that work is done (having waited on it, which raises its error). After the
    last, the group's result is applied to the state as it is then: the model is the
    group's anchor plus whatever the worker trained since `seen` (none in the
    foreground), as `OuterState.commit_late` does for the float wire; in voided blocks,
    or everywhere where a member's flag was set, the model, anchor and momentum stay as
    they are. Abandoned midway (an error, `close()`), nothing has changed."""
    wire = outer.modular
    assert wire is not None, "modular_phases() without --outer-compression int8"
    outer.take_anchor(seen)
    staged_steps = outer.steps_since_sync
    state, n = outer.state, outer.numel
    device = seen.device
    with torch.no_grad():
        flag = state.take_flag()
        anchor_hat = torch.sub(outer.anchor, seen[:n])  # Δ, then φ̂
        moment = torch.empty_like(anchor_hat)
        outer.provisional_step(anchor_hat, moment, spend=staged_steps > 0)
        own, anchor = blocks(anchor_hat.double()), blocks(outer.anchor.double())
        step = (own - anchor).abs() + (anchor - blocks(seen[:n].double())).abs()
        proposed = torch.maximum(step.amax(dim=1) * wire.width,
                                 own.abs().amax(dim=1) * RELATIVE_FLOOR)
        width = proposed.clamp(min=ABSOLUTE_FLOOR).float()
    yield "all-reduce (max) of the int8 widths", comm.start_allreduce_max(width)
    with torch.no_grad():
        unit = (width.double() / LEVELS).unsqueeze(1)  # s, per block
        q_own = torch.round(own / unit).to(torch.int64)
        rest = seen[n:]
        layout = payload_layout(n, (rest.numel() + 1) * rest.element_size())
        payload = torch.zeros(sum(size for _, size in layout), dtype=torch.uint8,
                              device=device)
        mine = _split(payload, layout)
        mine["checksum"][: q_own.shape[0] * 8].view(torch.int64).copy_(
            (q_own * wire.weights).sum(dim=1))
        mine["anchor"][: q_own.numel()].copy_(torch.remainder(q_own, LEVELS).flatten())
        values = torch.cat([rest, flag.to(rest.dtype)])
        mine["rest"][: values.numel() * values.element_size()].view(rest.dtype).copy_(values)
    gathered, work = comm.start_allgather(payload)
    yield "all-gather of the int8 payloads", work
    with torch.no_grad():
        count, size = q_own.shape[0], comm.size
        total_q = torch.zeros_like(q_own)
        wrong = torch.zeros(count, dtype=torch.bool, device=device)
        rest_sum = torch.zeros(values.numel(), dtype=rest.dtype, device=device)
        for theirs in gathered:
            part = _split(theirs, layout)
            codes = part["anchor"][: q_own.numel()].reshape(count, BLOCK).to(torch.int64)
            k = q_own + torch.remainder(codes - q_own + LEVELS // 2, LEVELS) - LEVELS // 2
            sent = part["checksum"][: count * 8].view(torch.int64)
            wrong |= (k * wire.weights).sum(dim=1) != sent
            total_q += k
            rest_sum += part["rest"][: values.numel() * values.element_size()].view(rest.dtype)
        voided = wrong.to(torch.uint8)
    yield "all-reduce (max) of the voided int8 blocks", comm.start_allreduce_max(voided)
    flat = state.flat
    if flat.numel() != seen.numel():
        raise RuntimeError("the averaged state changed size while its int8 synchronisation "
                           "was in flight; the group's result was not applied")
    with torch.no_grad():
        flags = rest_sum[-1:]
        keep = voided.bool().unsqueeze(1).expand(count, BLOCK).flatten()[:n]
        group_anchor = (total_q.double() * unit / size).flatten()[:n].to(flat.dtype)
        new_rest = rest_sum[:-1] / size
        new_model = group_anchor
        if seen is not flat:  # the steps taken since: kept on top of the group's result
            since = torch.sub(flat, seen)
            new_model = group_anchor + since[:n]
            new_rest += since[n:]
        new_anchor = torch.where(keep, outer.anchor, group_anchor)
        new_momentum = torch.where(keep, outer.momentum, moment)
        new_model = torch.where(keep, flat[:n], new_model)
        for kept, result in ((outer.anchor, new_anchor), (outer.momentum, new_momentum),
                             (flat[:n], new_model), (flat[n:], new_rest)):
            void_if_flagged(flags, kept, result)
        outer.anchor.copy_(new_anchor)
        outer.momentum.copy_(new_momentum)
        flat[:n].copy_(new_model)
        flat[n:].copy_(new_rest)
        any_void = voided.bool().any()
        flagged = flags[0] > 0
        grown = torch.where(any_void, wire.width * WIDEN,
                            (wire.width * NARROW).clamp(min=BASE_WIDTH)).clamp(max=MAX_WIDTH)
        wire.width.copy_(torch.where(flagged, wire.width, grown))
        wire.voided_blocks += torch.where(flagged, 0, voided.sum(dtype=torch.int64))
    outer.steps_since_sync -= staged_steps
    outer.anchored = True
    outer.in_agreement = False
