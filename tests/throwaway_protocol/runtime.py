"""ring-pairs' runtime behind ripples.Optimizer: after each step, ask for a group, P-Reduce
in it, release it."""

from __future__ import annotations

import time

from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.dataplane.preduce import preduce
from ripples.worker.protocol import (
    Protocol,
    ProtocolContext,
    SyncResult,
    max_peer_wait_seconds,
    run_group_collective,
)

POLL_SECONDS = 5.0


class RingPairsRuntime(Protocol):
    name = "ring-pairs"
    averages_optimizer_state = True

    def __init__(self, ctx: ProtocolContext) -> None:
        super().__init__(ctx)
        self.stream = ctx.client.open_group_stream(ctx.worker_id)
        self.timeout = ctx.config.collective_timeout_seconds

    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        return self.ctx.coordinator_stop() if self.ctx.stop_requested.is_set() else None

    def after_step(self, completed: int) -> SyncResult:
        result = SyncResult()
        asked = time.perf_counter()
        while True:
            reply = self.stream.request(completed, POLL_SECONDS, self.ctx.progress())
            for comm_id in reply.evict_comm_ids:
                self.ctx.comms.drop(self._key(comm_id))
            if reply.outcome == pb.GROUP_OUTCOME_RETRY:
                if time.perf_counter() - asked > max_peer_wait_seconds(self.ctx.config):
                    raise TimeoutError(f"no group: {reply.detail}")
                continue
            if reply.outcome == pb.GROUP_OUTCOME_STOP:
                result.stop, result.stop_reason = True, reply.detail
                return result
            if reply.outcome != pb.GROUP_OUTCOME_GROUP:
                return result
            group = reply.group
            seconds, ok = run_group_collective(
                self.ctx, self.stream, group, self._key(group.comm_id),
                lambda comm: preduce(self.ctx.state, comm, self.timeout))
            result.num_groups += 1
            result.num_failed_groups += not ok
            result.preduce_seconds += seconds
            result.group_sizes += (len(group.members),)
            if not reply.more:
                return result

    def close(self) -> None:
        self.stream.close()

    def _key(self, comm_id: int) -> str:
        return f"ring-pairs/{self.ctx.config.run_id}/{comm_id}"
