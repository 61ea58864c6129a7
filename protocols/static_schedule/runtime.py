"""`ripples-static`: the conflict-free static schedule, computed locally with no RPC.

With local steps (`--local-steps H`) a worker synchronises at every H-th step only, in
the schedule's group of round `step / H` (the schedule counts rounds, not steps); with
`--outer-optimizer nesterov` the group averages its members' outer steps
(worker/dataplane/outer_state.py) instead of their models."""

from __future__ import annotations

import time

from ripples.protocols.lockstep import LockstepStop, explained_collective
from ripples.static_schedule import static_group_of
from ripples.worker.dataplane.group_sync import average_in_group, group_bytes
from ripples.worker.dataplane.local_rounds import local_steps
from ripples.worker.dataplane.outer_state import OuterState
from ripples.worker.protocol import Protocol, ProtocolContext, SyncResult


class StaticScheduleProtocol(Protocol):
    """Each iteration, P-Reduce in the group the rule S(iteration, rank) gives.

    The coordinator serves only the schedule's parameters (nodes, workers per node, this
    worker's rank). Every worker computes the same schedule, so groups agree without
    messages; their communicators are named by their ranks and built once. Waiting for a
    late partner happens inside the collective and counts as preduce time.
    """

    name = "ripples-static"
    stops_together = True
    averages_optimizer_state = True
    flags_nonfinite = True  # AveragedState's and the outer step's P-Reduces carry them

    def __init__(self, ctx: ProtocolContext) -> None:
        super().__init__(ctx)
        params = ctx.client.static_schedule(ctx.worker_id)
        self.num_nodes = params.num_nodes
        self.workers_per_node = params.workers_per_node
        self.rank = params.rank
        self.run_id = params.run_id
        self.stopper = LockstepStop(ctx)
        self.local_steps = local_steps(ctx.config)
        self.outer = OuterState.of_config(ctx.state, ctx.config)

    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        return self.stopper.should_stop(completed, planned)

    def consensus_agreement(self) -> tuple[int, int] | None:
        return self.stopper.consensus

    def may_adopt_state(self, completed: int, ready: bool) -> bool:
        return self.stopper.may_adopt_state(completed, ready)

    def after_step(self, completed: int) -> SyncResult:
        if completed % self.local_steps:
            return SyncResult()
        group = static_group_of(completed // self.local_steps - 1, self.rank, self.num_nodes,
                                self.workers_per_node)
        if group is None:
            return SyncResult()
        key = f"static/{self.run_id}/{'-'.join(map(str, group))}"
        t0 = time.perf_counter()
        state = self.ctx.state
        with explained_collective(self.ctx, f"the P-Reduce of step {completed} with "
                                            f"ranks {list(group)}"):
            comm = self.ctx.comms.get(key, group.index(self.rank), len(group), create=True)
            average_in_group(state, self.outer, comm, self.ctx.config.collective_timeout_seconds)
        seconds = time.perf_counter() - t0
        return SyncResult(preduce_seconds=seconds, num_groups=1, group_sizes=(len(group),),
                          preduce_durations=(seconds,),
                          preduce_bytes=group_bytes(state, self.outer))
