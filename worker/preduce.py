"""Partial All-Reduce: average the model over one group of workers (Ripples paper §3)."""

from __future__ import annotations

from ripples.worker.communicators import Communicator
from ripples.worker.flat_params import FlatParameters


def preduce(params: FlatParameters, comm: Communicator, timeout_seconds: float) -> None:
    """Replace the local model with the mean of the group's models.

    One SUM collective over the flat buffer, pre-scaled by 1/|G| (gloo's AVG is not
    trusted, notes/preduce-findings.md). On any error the staging buffer is abandoned
    and the parameters keep their local values; the caller reports the group failed and
    drops the communicator.
    """
    staged = params.stage(1.0 / comm.size)
    try:
        comm.allreduce_sum_(staged, timeout_seconds)
    except BaseException:
        params.abandon()
        raise
    params.commit()
