"""The final average: after the stop, one group of every live worker (Worker.FinalGroup).

Each live worker of a group or gossip run asks for it once the run stopped; the request
long-polls until every live worker asked (the group then reaches all of them at once),
or until its timeout (then the group is of those that asked). Every worker's final model
is then the consensus model. The core says when there is none (`final_group_refusal`:
the run goes on, a lock-step run's models are equal already, ...).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from ripples.coordinator.core import CoordinatorCore, CoordinatorError, GroupDecision, Outcome
from ripples.coordinator.groups import GroupRecord
from ripples.coordinator.wire import abort, group_reply
from ripples.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 30.0
"""A request's wait for the other live workers when it names none."""


class FinalAverage:
    """The final group of one run: who asked, and whether it was formed."""

    def __init__(self, core: CoordinatorCore, *, clock: Callable[[], float]) -> None:
        self.core = core
        self.clock = clock
        self._waiters: dict[int, asyncio.Future[GroupRecord | None]] = {}
        self._formed = False

    async def serve(self, request: pb.FinalGroupRequest,
                    context: grpc.aio.ServicerContext) -> pb.GroupReply:
        """One worker's request for the final group (the FinalGroup RPC)."""
        wid = request.worker_id
        try:
            why = self.core.final_group_refusal(wid)
        except (CoordinatorError, ValueError) as err:
            await abort(context, err)
        if why:
            return pb.GroupReply(outcome=pb.GROUP_OUTCOME_NO_GROUP, detail=str(why))
        if self._formed:
            return pb.GroupReply(outcome=pb.GROUP_OUTCOME_NO_GROUP, detail=(
                "the final average ran before this worker asked"))
        fut = self._waiters.setdefault(wid, asyncio.get_running_loop().create_future())
        self.form(complete_only=True)
        timeout = (request.timeout_seconds if request.timeout_seconds > 0
                   else DEFAULT_TIMEOUT_SECONDS)
        try:
            group = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            self.form(complete_only=False)  # whoever asked, without the rest
            group = fut.result()
        if group is None or len(group.members) < 2:
            return pb.GroupReply(outcome=pb.GROUP_OUTCOME_NO_GROUP,
                                 detail="no other live worker asked for the final average")
        return group_reply(GroupDecision(outcome=Outcome.GROUP, group=group))

    def form(self, *, complete_only: bool) -> None:
        """Hand the final group to every worker that asked: once all live workers have
        (`complete_only`: a request, a departure, a lease expiry may have made it so),
        or (a waiter's timeout) to those that have."""
        waiting = [w for w, fut in self._waiters.items() if not fut.done()]
        expected = set(self.core.final_members())
        if self._formed or not waiting or (complete_only and not expected <= set(waiting)):
            return
        self._formed = True
        group = self.core.final_group(waiting, self.clock()) if len(waiting) >= 2 else None
        for w in waiting:
            self._waiters[w].set_result(group)
        if group is not None:
            logger.info("final average over workers %s", list(group.members))
