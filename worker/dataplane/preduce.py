"""Partial All-Reduce: average the model over one group of workers (Ripples paper §3)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import Communicator


class Staged(Protocol):
    """What averages through a staging buffer (AveragedState, OuterState): `stage` filled
    it, `commit` adopts the collective's result, `commit_late` adopts it as the result
    for the state `stage` saw while keeping what changed since (a background P-Reduce),
    `abandon` forgets it."""

    def commit(self) -> None: ...
    def commit_late(self, snapshot: torch.Tensor) -> None: ...  # may overwrite snapshot
    def abandon(self) -> None: ...


def reduce_staged(averaged: Staged, staged: Sequence[torch.Tensor],
                  reduce: Callable[[torch.Tensor], object]) -> None:
    """Run `reduce` (an in-place SUM collective) on each buffer `averaged` staged, then
    commit the result. On any error the staging buffers are abandoned, and what
    `averaged` holds keeps its local values (docs/data-plane.md rule 4)."""
    try:
        for buffer in staged:
            reduce(buffer)
    except BaseException:
        averaged.abandon()
        raise
    averaged.commit()


def preduce(params: AveragedState, comm: Communicator, timeout_seconds: float) -> None:
    """Replace the local model with the mean of the group's models.

    One SUM collective over the flat buffer, pre-scaled by 1/|G| (gloo's AVG is not
    trusted, docs/data-plane.md). On any error the staging buffer is abandoned
    and the parameters keep their local values; the caller reports the group failed and
    drops the communicator.
    """
    reduce_staged(params, [params.stage(1.0 / comm.size)],
                  lambda staged: comm.allreduce_sum_(staged, timeout_seconds))


def copy_from_donor(values: torch.Tensor, comm: Communicator, donor: int,
                    timeout_seconds: float) -> torch.Tensor | None:
    """Heal a joiner: the member `donor` (an index in the communicator) sends `values`;
    every other member gets them back (the donor gets None).

    One SUM collective in which only the donor contributes its values (the others zeros),
    so the result is the donor's exactly (x + 0 = x), with the collective P-Reduce uses,
    into a fresh buffer (a failed collective never touches `values`). A non-finite result
    is refused (ValueError)."""
    is_donor = comm.rank == donor
    with torch.no_grad():
        buffer = values.detach().clone() if is_donor else torch.zeros_like(values)
        comm.allreduce_sum_(buffer, timeout_seconds)
    if is_donor:
        return None
    if not bool(torch.isfinite(buffer).all()):
        raise ValueError("the donor's model is not finite; not copied")
    return buffer


def copy_model(params: AveragedState, comm: Communicator, donor: int,
               timeout_seconds: float) -> None:
    """Heal in a heal group: a joiner's parameters and buffers (the head of the flat
    buffer) become the donor's; the donor keeps its own. The optimizer state is not
    copied: a joiner's starts anew and joins its buffer after its first step."""
    n = params.model_numel
    params.forget_flag()
    copied = copy_from_donor(params.flat[:n], comm, donor, timeout_seconds)
    if copied is not None:
        with torch.no_grad():
            params.flat[:n].copy_(copied)


class DeltaAverager:
    """Averages a live shared model in place (Algorithm 1, lines 13-16).

    snapshot v = x; the members' sum of v/|G| (plus one control value each, summed) in a
    separate buffer; then x += avg - v. Updates made to x while the collective runs stay
    in x. On a failed collective x is untouched (the collective writes only its own
    buffer, docs/data-plane.md rule 4)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat
        self._snapshot = torch.empty_like(flat)
        self._staged = torch.empty(flat.numel(), dtype=flat.dtype, device=flat.device)

    def average(self, comm: Communicator, timeout_seconds: float,
                controls: Sequence[float] = ()) -> tuple[float, ...]:
        """One round; returns the sums of the members' `controls` values (each member
        gives as many, in the same order)."""
        n, k = self.flat.numel(), len(controls)
        if self._staged.numel() != n + k:
            self._staged = torch.empty(n + k, dtype=self.flat.dtype, device=self.flat.device)
        with torch.no_grad():
            self._snapshot.copy_(self.flat)
            torch.mul(self._snapshot, 1.0 / comm.size, out=self._staged[:n])
            if k:
                self._staged[n:].copy_(torch.tensor(controls, dtype=self.flat.dtype))
            try:
                comm.allreduce_sum_(self._staged, timeout_seconds)
            except BaseException:
                # A failed collective may still write into its buffer later (rule 4):
                # the next round gets a buffer of its own.
                self._staged = torch.empty_like(self._staged)
                raise
            delta = self._staged[:n].sub_(self._snapshot)
            self.flat.add_(delta)
        return tuple(float(v) for v in self._staged[n:].tolist())

