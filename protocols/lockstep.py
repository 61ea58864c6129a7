"""Agreements of lock-step protocols (every worker in every collective, every iteration):
where all stop, and after which iteration all average their optimizer state too; and how
their collectives are watched and their failures explained."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from ripples.worker.client import CoordinatorCallError
from ripples.worker.collective_watch import COLLECTIVES, describe_peers, explain_failure
from ripples.worker.dataplane.local_rounds import local_steps, next_multiple
from ripples.worker.protocol import ProtocolContext, SyncResult

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def explained_collective(ctx: ProtocolContext, what: str) -> Iterator[None]:
    """Mark `what` as the collective this worker waits in (CollectiveWatch: a worker held
    in one after the run lost a member ends); its failure is raised as a RuntimeError
    saying what failed (explain_collective_failure)."""
    with COLLECTIVES.inside(what):
        try:
            yield
        except (RuntimeError, TimeoutError) as err:
            raise RuntimeError(explain_collective_failure(ctx, what, err)) from err


def explain_collective_failure(ctx: ProtocolContext, what: str, err: BaseException) -> str:
    """The failure of collective `what`, with the peers it waited for as the coordinator
    knows them; logged, and kept for the worker's FAILED reason. Said once per collective
    (each of DDP's buckets in flight fails with it)."""
    if COLLECTIVES.failure.startswith(f"{what} "):
        return COLLECTIVES.failure
    try:
        status = ctx.client.run_status()
    except CoordinatorCallError as status_err:
        logger.warning("could not ask the coordinator which peers were missing: %s",
                       status_err)
        status = None
    message = explain_failure(what, err, timeout_seconds=ctx.config.collective_timeout_seconds,
                              peers=describe_peers(status, ctx.worker_id))
    COLLECTIVES.failure = message
    logger.error("%s", message)
    return message


class LockstepStop:
    """Asks the coordinator every `checkpoint_interval` iterations whether to stop.

    The coordinator answers with one stop iteration for everybody (see
    CoordinatorCore.checkpoint), so no worker is left alone inside a collective. The same
    checkpoints agree on the iteration after which every worker's optimizer state joins
    its averaged buffer (StateAdoption), so that no collective joins buffers of two sizes.
    """

    def __init__(self, ctx: ProtocolContext) -> None:
        self.ctx = ctx
        self.interval = max(1, ctx.config.checkpoint_interval)
        self.round_steps = local_steps(ctx.config)
        self.stop_at = 0
        self.reason = ""
        self.state_ready = False
        self.adopt_after = 0
        self.consensus = (0, 0)
        """(consensus id, the iteration every worker publishes its model after)."""

    def may_adopt_state(self, completed: int, ready: bool) -> bool:
        """Whether step `completed` may add the optimizer state, before its collective:
        only past the agreed iteration (reported ready at the next checkpoint)."""
        self.state_ready = self.state_ready or ready
        return 0 < self.adopt_after < completed


    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        if self.stop_at == 0 and completed % self.interval == 0:
            reply = self.ctx.client.checkpoint(self.ctx.worker_id, completed,
                                               self.ctx.progress(),
                                               optimizer_state_ready=self.state_ready)
            self.adopt_after = self.adopt_after or reply.adopt_state_after_iteration
            if reply.consensus_id and reply.consensus_at_iteration:
                # With local steps, the models are equal only at a synchronisation: the
                # next multiple of H (every worker rounds the same way).
                self.consensus = (reply.consensus_id,
                                  next_multiple(reply.consensus_at_iteration, self.round_steps))
            elif not reply.consensus_id:  # the request is over: a late model would leak
                self.consensus = (0, 0)
            if reply.stop_at_iteration:
                self.stop_at = reply.stop_at_iteration
                self.reason = reply.stop_reason
        if planned and completed >= planned:
            return SyncResult(stop=True, stop_reason="iteration budget reached")
        if self.stop_at and completed >= self.stop_at:
            return SyncResult(stop=True, stop_reason=self.reason)
        return None
