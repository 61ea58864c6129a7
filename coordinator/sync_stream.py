"""The Synchronize long-poll: one group stream per worker of a group protocol.

Group-generator and gossip protocols ask the coordinator for a group at every iteration
and release it after their P-Reduce, over one long-lived stream per worker (Worker.
Synchronize). This is the coordinator's hot loop: `SyncStreams.serve` reads and writes
the call directly (one coroutine per stream), core errors abort the call without a
coroutine per message, and a wait for a group is one future and one timer
(docs/scale.md measures what this costs against gRPC's own floor).

A request the core cannot answer at once waits here until a delivery (another worker's
request, a release, a lease expiry: `deliver`) or its timeout (the core's RETRY).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from ripples.coordinator.core import CoordinatorCore, CoordinatorError, Deliveries, GroupDecision
from ripples.coordinator.metrics import CoordinatorMetrics
from ripples.coordinator.wire import abort, group_reply, progress_from_proto
from ripples.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

MAX_GROUP_WAIT_SECONDS = 30.0
"""The longest a group request waits on the coordinator before its RETRY."""


class SyncStreams:
    """Every worker's group stream of one run, and the group requests waiting in them."""

    def __init__(
        self,
        core: CoordinatorCore,
        *,
        clock: Callable[[], float],
        metrics: CoordinatorMetrics,
        resolve: Callable[[Deliveries], None],
        suspect: Callable[[int], None],
    ) -> None:
        """Args:
            core: the run's core.
            clock: the coordinator's clock.
            metrics: where each request's time to its reply is observed.
            resolve: hands deliveries (decisions for other workers) to the service, which
                wakes its long-polls and calls `deliver`.
            suspect: called with the stream's worker id when its stream breaks.
        """
        self.core = core
        self.clock = clock
        self.metrics = metrics
        self._resolve = resolve
        self._suspect = suspect
        self.waiters: dict[int, asyncio.Future[GroupDecision]] = {}
        """Workers waiting for a group (see wait_for_group)."""

    def deliver(self, deliveries: Deliveries) -> None:
        """Hand each waiting worker the decision the core made for it."""
        for worker_id, decision in deliveries.items():
            fut = self.waiters.get(worker_id)
            if fut is not None and not fut.done():
                fut.set_result(decision)

    async def serve(self, request_iterator: AsyncIterator[pb.SyncMessage],
                    context: grpc.aio.ServicerContext) -> None:
        """One worker's stream: messages are handled in order, requests answered in order;
        the first message fixes the stream's worker id."""
        bound: int | None = None  # the stream's worker id, fixed by its first message
        read, write = context.read, context.write
        while True:
            try:
                message = await read()
            except asyncio.CancelledError:  # the connection broke: a dead worker?
                if bound is not None:
                    self._suspect(bound)
                raise
            if message is grpc.aio.EOF:
                # A SIGKILLed worker's stream ends so too (measured: EOF, the call's
                # cancellation only after); a live one heartbeats its lease back.
                if bound is not None:
                    self._suspect(bound)
                return
            kind = message.WhichOneof("kind")
            body = message.request if kind == "request" else message.release
            if kind is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "empty sync message: set request or release")
            if bound is None:
                bound = body.worker_id
            elif body.worker_id != bound:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                    f"this stream belongs to worker {bound}, got a message for worker "
                    f"{body.worker_id}; open one stream per worker"))
            if kind == "request":
                await write(await self._request_group(message.request, context))
            else:
                await self._release_group(message.release, context)

    async def _request_group(self, request: pb.GroupRequest,
                             context: grpc.aio.ServicerContext) -> pb.GroupReply:
        wid = request.worker_id
        arrived = time.perf_counter()
        progress = progress_from_proto(request.progress) if request.HasField("progress") else None
        try:
            decision, deliveries = self.core.request_group(
                wid, request.iteration, self.clock(), progress, listen=request.listen)
        except (CoordinatorError, ValueError) as err:
            await abort(context, err)
        self._resolve(deliveries)
        if decision is None:
            decision = await self.wait_for_group(wid, request.timeout_seconds)
        self.metrics.group_request_duration.observe(time.perf_counter() - arrived)
        return group_reply(decision)

    async def wait_for_group(self, wid: int, timeout_seconds: float) -> GroupDecision:
        """The decision a delivery hands this worker, or, after the timeout, the core's
        answer to an ended wait (RETRY: ask again). Whichever of the two comes first on
        the loop settles the future, and the other then finds it done: the timeout ends
        the core's wait in the same callback (`_end_wait`), so a decision is never
        dropped for a timer that fired first, nor a wait left open."""
        timeout = min(timeout_seconds, MAX_GROUP_WAIT_SECONDS) if timeout_seconds > 0 else 10.0
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GroupDecision] = loop.create_future()
        self.waiters[wid] = fut
        timer = loop.call_later(timeout, self._end_wait, wid, fut)
        try:
            return await fut
        except asyncio.CancelledError:  # the client went away: do not deliver to nobody
            # (awaiting the future directly cancels it too: then nothing was delivered)
            if fut.cancelled() and wid in self.core.workers:
                self.core.abandon_wait(wid, self.clock())
            raise
        finally:
            timer.cancel()
            if self.waiters.get(wid) is fut:
                del self.waiters[wid]

    def _end_wait(self, wid: int, fut: asyncio.Future[GroupDecision]) -> None:
        """The wait for a group ran out (unless a decision came first): end it in the
        core now and answer with the core's RETRY."""
        if fut.done():
            return
        if self.waiters.get(wid) is fut:
            del self.waiters[wid]
        try:
            fut.set_result(self.core.abandon_wait(wid, self.clock()))
        except CoordinatorError as err:  # the worker is gone meanwhile
            fut.set_exception(err)

    async def _release_group(self, request: pb.ReleaseRequest,
                             context: grpc.aio.ServicerContext) -> None:
        distance = (request.squared_distance if request.HasField("squared_distance")
                    else None)
        try:
            deliveries = self.core.release(request.worker_id, request.group_id, request.ok,
                                           request.error, self.clock(),
                                           squared_distance=distance)
        except (CoordinatorError, ValueError) as err:
            await abort(context, err)
        if not request.ok:
            logger.warning("worker %d reports group %d failed: %s",
                           request.worker_id, request.group_id, request.error)
        self._resolve(deliveries)
