"""The non-finite gate: a NaN or an infinity in one worker's averaged state never becomes
part of a peer's model, and the worker learns of it without stalling its device
(docs/gpu.md, "The non-finite gate").

Two halves:

- **On the wire.** Every P-Reduce of the averaged state carries one more element, the
  member's flag (1 when its state is not all finite, else 0), summed with the data. A
  member whose sum of flags is above 0 keeps its own state: the group's average is void
  for every member alike, on the device (`void_if_flagged`, a select, no read-back).
- **On the host.** The worker computes its flag after every step and reads it back:
  at once on the CPU (free there), and on a GPU from a pinned copy once the copy is
  done (`NonfiniteWatch`), so that the step never waits on the device for it. The worker
  fails with FloatingPointError at the first flagged step it reads.

A protocol whose collectives do not carry the flag yet has its worker wait for each
step's flag before it synchronises (the gate as it was: nothing non-finite is sent).
"""

from __future__ import annotations

from collections import deque

import torch


def nonfinite_flag(values: torch.Tensor) -> torch.Tensor:
    """A 1-element tensor on `values`' device and in its dtype: 1 when `values` hold a
    NaN or an infinity, else 0. One reduction and no read-back: the sum of finite values
    is finite (an overflow of the sum would need values near 1e34, and is flagged too)."""
    total = torch.sum(values, dtype=torch.float64 if values.dtype == torch.float64
                      else torch.float32)
    return torch.logical_not(torch.isfinite(total)).to(values.dtype).reshape(1)


def void_if_flagged(flags: torch.Tensor, kept: torch.Tensor, result: torch.Tensor) -> None:
    """In place: `result` becomes `kept` (a tensor of its shape, or a 0-d one: one value
    for all of it, as a background P-Reduce's change voids to 0) where the group's summed
    `flags` (a 1-element tensor) is above 0, else stays. On a GPU a select on the device,
    without a read-back; on the CPU, where reading the flag costs nothing, a copy only
    when it is set (a select would read both buffers and write one at every P-Reduce)."""
    if flags.device.type == "cpu":
        if flags.item() > 0:
            result.copy_(kept)
        return
    torch.where(flags > 0, kept, result, out=result)


class NonfiniteWatch:
    """The host's view of a worker's per-step flags, never waiting on a GPU for them.

    `note(step, flag)` starts the flag's copy to pinned host memory (on the CPU it is
    already there); `first_flagged()` returns the first noted step whose flag has
    arrived and is set, looking only at copies that are done; `drain()` waits for every
    copy (an error path, the end, or a protocol whose collectives carry no flag)."""

    def __init__(self) -> None:
        self._pending: deque[tuple[int, torch.Tensor, torch.cuda.Event | None]] = deque()
        self._free: list[torch.Tensor] = []

    def note(self, step: int, flag: torch.Tensor) -> None:
        if flag.device.type != "cuda":
            self._pending.append((step, flag, None))
            return
        host = self._free.pop() if self._free else torch.empty(
            1, dtype=flag.dtype, pin_memory=True)
        host.copy_(flag, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((step, host, event))

    def first_flagged(self) -> int | None:
        """The first noted step whose flag arrived set (that step and what follows are
        dropped), or None; steps whose copy is not done yet stay for a later call."""
        while self._pending:
            step, host, event = self._pending[0]
            if event is not None and not event.query():
                return None
            self._pending.popleft()
            if event is not None:
                self._free.append(host)
            if bool(host.item()):
                self._pending.clear()
                return step
        return None

    def drain(self) -> int | None:
        """Like `first_flagged`, after waiting for every copy."""
        for _, _, event in self._pending:
            if event is not None:
                event.synchronize()
        return self.first_flagged()

    @property
    def unread(self) -> int:
        """Noted steps whose flag the host has not read yet."""
        return len(self._pending)
