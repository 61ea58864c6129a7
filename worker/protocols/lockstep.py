"""Stop agreement for lock-step protocols (every worker must run the same iterations)."""

from __future__ import annotations

from ripples.worker.protocols.base import ProtocolContext, SyncResult


class LockstepStop:
    """Asks the coordinator every `checkpoint_interval` iterations whether to stop.

    The coordinator answers with one stop iteration for everybody (see
    CoordinatorCore.checkpoint), so no worker is left alone inside a collective.
    """

    def __init__(self, ctx: ProtocolContext) -> None:
        self.ctx = ctx
        self.interval = max(1, ctx.config.checkpoint_interval)
        self.stop_at = 0
        self.reason = ""

    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        if self.stop_at == 0 and completed % self.interval == 0:
            reply = self.ctx.client.checkpoint(self.ctx.worker_id, completed,
                                               self.ctx.progress())
            if reply.stop_at_iteration:
                self.stop_at = reply.stop_at_iteration
                self.reason = reply.stop_reason
        if planned and completed >= planned:
            return SyncResult(stop=True, stop_reason="iteration budget reached")
        if self.stop_at and completed >= self.stop_at:
            return SyncResult(stop=True, stop_reason=self.reason)
        return None
