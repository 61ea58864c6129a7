"""The gRPC shell around CoordinatorCore: clock, long-polls, lease reaping.

All handlers run on one asyncio event loop, so the core is only ever touched by one
coroutine at a time (the loop is the lock) and each handler's critical section is a
plain synchronous call into the core.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from ripples import consensus
from ripples.coordinator import heap, snapshot
from ripples.coordinator.core import (
    GONE,
    CoordinatorCore,
    CoordinatorError,
    Deliveries,
    GroupDecision,
    Outcome,
    Progress,
    WorkerState,
)
from ripples.coordinator.groups import GroupRecord, GroupState
from ripples.coordinator.http import SdTargets
from ripples.coordinator.metrics import CoordinatorMetrics
from ripples.coordinator.registry import WorkerRecord
from ripples.coordinator.root_watch import ROOT_POLL_SECONDS, RootWatch
from ripples.coordinator.schema import Schema
from ripples.coordinator.state_store import StateStore
from ripples.guarded import guarded_loop
from ripples.protocols.group_generator.settings import GroupGeneratorSettings
from ripples.protocols.spec import Coordination
from ripples.store_blobs import delete_blob, get_blob, has_blob
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

_OUTCOMES = {
    Outcome.GROUP: pb.GROUP_OUTCOME_GROUP,
    Outcome.STOP: pb.GROUP_OUTCOME_STOP,
    Outcome.CANCELLED: pb.GROUP_OUTCOME_CANCELLED,
    Outcome.NO_GROUP: pb.GROUP_OUTCOME_NO_GROUP,
    Outcome.RETRY: pb.GROUP_OUTCOME_RETRY,
}
_STATES = {
    WorkerState.REGISTERED: pb.WORKER_STATE_REGISTERED,
    WorkerState.COMPUTING: pb.WORKER_STATE_COMPUTING,
    WorkerState.WAITING: pb.WORKER_STATE_WAITING,
    WorkerState.REDUCING: pb.WORKER_STATE_REDUCING,
    WorkerState.LEFT: pb.WORKER_STATE_LEFT,
    WorkerState.EXPIRED: pb.WORKER_STATE_EXPIRED,
    WorkerState.FAILED: pb.WORKER_STATE_FAILED,
}
_GROUP_STATES = {
    GroupState.PENDING: pb.GROUP_STATE_PENDING,
    GroupState.EXECUTING: pb.GROUP_STATE_EXECUTING,
}
MAX_GROUP_WAIT_SECONDS = 30.0
CONSENSUS_SWEEP_REQUESTS = 4
"""How many recent consensus requests every request sweeps the store for."""
STATE_SAVE_SECONDS = 0.5
"""How often the run's state is saved to the state dir besides membership changes."""


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string ("ipv4:10.0.0.5:4242" -> "10.0.0.5",
    "ipv6:[::1]:4242" -> "[::1]"); "" when it is not an IP peer."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0] if rest.startswith("[") else f"[{rest.rpartition(':')[0]}]"
    return ""


def progress_from_proto(p: pb.Progress) -> Progress:
    return Progress(
        iteration=p.iteration,
        loss=p.loss if math.isfinite(p.loss) and p.iteration > 0 else float("nan"),
        samples=p.samples,
        compute_seconds=p.compute_seconds,
        wait_seconds=p.wait_seconds,
        preduce_seconds=p.preduce_seconds,
        planned_iterations=p.planned_iterations,
        checkpoint_step=p.checkpoint_step,
    )


def progress_to_proto(p: Progress) -> pb.Progress:
    return pb.Progress(
        iteration=p.iteration,
        loss=p.loss if math.isfinite(p.loss) else 0.0,
        samples=p.samples,
        compute_seconds=p.compute_seconds,
        wait_seconds=p.wait_seconds,
        preduce_seconds=p.preduce_seconds,
        planned_iterations=p.planned_iterations,
        checkpoint_step=p.checkpoint_step,
    )


async def _abort(context: grpc.aio.ServicerContext, err: Exception) -> NoReturn:
    """End the call with the status a core error names (ValueError: bad input)."""
    code = (getattr(grpc.StatusCode, err.code) if isinstance(err, CoordinatorError)
            else grpc.StatusCode.INVALID_ARGUMENT)
    await context.abort(code, str(err))
    raise AssertionError("unreachable")  # abort raises


def _schema(message: pb.TensorSchema) -> Schema:
    return Schema(tensors=tuple((t.name, tuple(t.shape), t.dtype) for t in message.tensors),
                  digest=message.digest)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """Translates RPCs into core events and core decisions into replies."""

    def __init__(
        self,
        core: CoordinatorCore,
        *,
        store_host: str,
        store_port: int,
        clock: Callable[[], float] = time.monotonic,
        state: StateStore | None = None,
        incarnation: int = 1,
        store: Any = None,
    ) -> None:
        self.core = core
        self.store = store
        """The rendezvous store this coordinator hosts (a torch.distributed.TCPStore, or
        None): consensus models come through it."""
        self._consensus_seq = 0
        self._consensus_expected: set[int] = set()
        """The workers asked to publish for it (the heartbeat tells only these)."""
        self._consensus_done: list[tuple[str, int]] = []
        """(store prefix, id) of the recent requests, whose keys every request sweeps."""
        self.state = state
        """Where the run's state is saved (--state-dir), if anywhere."""
        self.incarnation = incarnation
        self._saving: asyncio.Lock | None = None
        self.store_host = store_host
        self.store_port = store_port
        self.clock = clock
        self._waiters: dict[int, asyncio.Future[GroupDecision]] = {}
        """Workers waiting for a group (see _wait_for_group)."""
        self._members = asyncio.Event()  # the membership is formed (or the run stopped)
        self._started = asyncio.Event()
        self._stopped = asyncio.Event()
        self._reaper: asyncio.Task[None] | None = None
        self._saver: asyncio.Task[None] | None = None
        self._root_watch: RootWatch | None = None
        self._root_task: asyncio.Task[None] | None = None
        self.stopped_at_root = False
        """A shard's run stopped because an operator stopped the root's (it ends as
        stopped, as a run an operator stopped here does)."""
        self._final_waiters: dict[int, asyncio.Future[GroupRecord | None]] = {}
        self._final_formed = False
        self._restarts_seen = core.restarts
        self.metrics = CoordinatorMetrics(core, clock)
        self.metrics_address = ""  # the coordinator's own HOST:PORT, set by the server
        self.metrics_targets: dict[int, str] = {}  # worker id -> HOST:PORT

    # ------------------------------------------------------------------ plumbing
    def start_background(self) -> None:
        self._reaper = self._guarded("lease-reaper", self._reap_leases,
                                     max(0.05, self.core.settings.lease_seconds / 4))
        if self.state is not None:
            self._saver = self._guarded("state-saver", self.save_state, STATE_SAVE_SECONDS)
        settings = self.core.settings
        if GroupGeneratorSettings in settings.protocol_settings:
            root = settings.settings(GroupGeneratorSettings).root
            if root:  # this run is one shard of a sharded job
                self._root_watch = RootWatch(root, self._stop_from_root)
                self._root_task = self._guarded("root-watch", self._root_watch.poll,
                                                ROOT_POLL_SECONDS)

    def _guarded(self, name: str, body: Callable[[], Awaitable[None]], interval: float
                 ) -> asyncio.Task[None]:
        """Run `body` every `interval` s for the coordinator's life: an error is logged,
        counted in ripples_coordinator_background_errors_total{task=name} (whose series
        exists from the start, at 0) and retried, so lease expiry never stops for good."""
        errors = self.metrics.background_errors.labels(task=name)
        return asyncio.get_running_loop().create_task(
            guarded_loop(name, body, interval, on_error=errors.inc))

    async def save_state(self) -> None:
        """Save the run's state to the state dir (if any): the snapshot is taken on the
        loop (consistent), written off it; saves never overlap."""
        if self.state is None:
            return
        if self._saving is None:
            self._saving = asyncio.Lock()
        async with self._saving:
            data = snapshot.take(self.core, self.clock(), time.time())
            data["metrics_targets"] = {str(k): v for k, v in self.metrics_targets.items()}
            await asyncio.to_thread(self.state.save, data)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._saver is not None:
            self._saver.cancel()
        if self._root_task is not None:
            self._root_task.cancel()
        if self._root_watch is not None:
            await self._root_watch.close()
        if self.state is not None and not self.core.stopped:
            # A coordinator that shuts down (SIGTERM, a restart) keeps the run resumable:
            # the saved state is the running run's, not a run stopped by the shutdown.
            await self.save_state()
        self._resolve(self.core.stop("coordinator shutting down", self.clock()))
        heap.release()

    def _suspect(self, wid: int) -> None:
        """Worker `wid`'s stream broke: cut its lease (core.suspect) and reap it as soon
        as the cut lease ends, unless a heartbeat renews it first."""
        ends = self.core.suspect(wid, self.clock())
        if ends is None:
            return
        logger.info("worker %d's stream broke: its lease ends in %.1f s unless it "
                    "heartbeats", wid, ends - self.clock())
        asyncio.get_running_loop().call_later(max(0.0, ends - self.clock()) + 0.01,
                                              self._reap_leases_once)

    async def _reap_leases(self) -> None:
        """One round of the lease reaper: remove the workers whose lease ran out."""
        self._reap_leases_once()

    def _reap_leases_once(self) -> None:
        """Remove the workers whose lease ran out and tell whoever waited on them."""
        deliveries = self.core.expire_leases(self.clock())
        for wid in deliveries:
            logger.info("worker %d notified after lease expiry", wid)
        self._resolve(deliveries)
        self._form_final_group(complete_only=True)

    def _note_run_state(self) -> None:
        """Wake the long-polls whose condition an event just made true (and re-arm them
        when a restart round opened: registration and start happen again)."""
        core = self.core
        if core.restarts > self._restarts_seen:
            self._restarts_seen = core.restarts
            logger.warning("restart round %d: %s; every worker restarts from the last "
                           "checkpoint", core.restarts, core.restart_reason)
        if core.membership_formed or core.stopped:
            self._members.set()
        else:
            self._members.clear()
        if core.stopped:
            self._stopped.set()
        if core.started_at is not None and not self._started.is_set():
            logger.info("all %d workers ready: training starts", len(core.live()))
            self._started.set()
            heap.settle()
        elif core.started_at is None and not core.stopped:
            self._started.clear()

    def _resolve(self, deliveries: Deliveries) -> None:
        self._note_run_state()
        for worker_id, decision in deliveries.items():
            fut = self._waiters.get(worker_id)
            if fut is not None and not fut.done():
                fut.set_result(decision)

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[], object]) -> object:
        try:
            return fn()
        except (CoordinatorError, ValueError) as err:
            await _abort(context, err)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ lifecycle
    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> pb.RegisterReply:
        now = self.clock()
        worker_id = await self._call(context, lambda: self.core.register(
            request.host, request.local_rank, request.device or "cpu", request.pid, now))
        assert isinstance(worker_id, int)
        self._note_run_state()
        w = self.core.workers[worker_id]
        if request.metrics_port:
            host = request.metrics_host or peer_host(context.peer()) or w.host
            self.metrics_targets[worker_id] = f"{host}:{request.metrics_port}"
        await self.save_state()  # a restarted coordinator must know every worker it named
        logger.info("registered worker %d (host %s, local rank %d, %s)",
                    worker_id, w.host, w.local_rank, w.device)
        return pb.RegisterReply(worker_id=worker_id, config=self.core.settings.to_proto(),
                                store_host=self.store_host, store_port=self.store_port)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HeartbeatReply:
        rejoin = self.core.rejoins(request.worker_id)
        if rejoin:  # a restart round ended its part: its process restarts
            return pb.HeartbeatReply(restart=True, restart_reason=rejoin,
                                     incarnation=self.incarnation)
        progress = progress_from_proto(request.progress) if request.HasField("progress") else None
        deliveries = await self._call(context, lambda: self.core.heartbeat(
            request.worker_id, progress, self.clock()))
        assert isinstance(deliveries, dict)
        self._resolve(deliveries)
        return pb.HeartbeatReply(stop=self.core.stopped, stop_reason=self.core.stop_reason,
                                 mean_iterations=self.core.mean_iterations(),
                                 incarnation=self.incarnation,
                                 consensus_id=(self.core.consensus_id
                                               if request.worker_id in self._consensus_expected
                                               else 0))

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
                    ) -> pb.LeaveReply:
        rejoin = self.core.rejoins(request.worker_id)
        if rejoin:  # a restart round ended its part already
            return pb.LeaveReply(restart=True, restart_reason=rejoin)
        progress = progress_from_proto(request.progress) if request.HasField("progress") else None
        deliveries = await self._call(context, lambda: self.core.leave(
            request.worker_id, progress, request.error, self.clock(), request.reason))
        assert isinstance(deliveries, dict)
        self._resolve(deliveries)
        await self.save_state()
        self._form_final_group(complete_only=True)  # it may have been the last one awaited
        if request.error:
            logger.warning("worker %d left with an error: %s", request.worker_id, request.error)
        else:
            logger.info("worker %d left", request.worker_id)
        rejoin = self.core.rejoins(request.worker_id)
        return pb.LeaveReply(restart=bool(rejoin), restart_reason=rejoin)

    async def AwaitMembers(self, request: pb.AwaitMembersRequest,
                           context: grpc.aio.ServicerContext) -> pb.Membership:
        await self._call(context, lambda: self.core.worker(request.worker_id))
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else 60.0
        try:
            await asyncio.wait_for(self._members.wait(), timeout)
        except TimeoutError:
            live = len(self.core.live())
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, (
                f"{live} of {self.core.settings.num_workers} workers registered within "
                f"{timeout:.0f} s; start the missing workers"))
        if self.core.stopped:  # e.g. the topology does not fit the registered hosts
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the run stopped before training: {self.core.stop_reason}")
        core = self.core
        me = await self._call(context, lambda: core.worker(request.worker_id))
        assert isinstance(me, WorkerRecord)
        ranks = [pb.WorkerRank(worker_id=w.worker_id, rank=w.rank, node=w.node)
                 for w in sorted(core.live(), key=lambda x: x.rank)]
        # num_workers is the membership's, not the live count: ranks stay 0..n-1 while a
        # member is gone, and a replacement takes the vacant rank (a lock-step run's
        # restart round may form with fewer than the run's num_workers).
        reply = pb.Membership(
            num_workers=core.registry.size, generation=core.registry.generation,
            ranks=ranks, rank=me.rank,
            num_nodes=core.num_nodes(), neighbours=core.neighbours_of(me.worker_id),
            spectral_gap=core.graph.spectral_gap, replacement=me.replacement,
            start_iteration=me.progress.iteration if me.replacement else 0)
        if core.graph.gossip is not None:
            reply.gossip.CopyFrom(core.graph.gossip)
            reply.gossip.passive = me.worker_id in core.graph.passive
        return reply

    async def AwaitStart(self, request: pb.AwaitStartRequest, context: grpc.aio.ServicerContext
                         ) -> pb.AwaitStartReply:
        schema = _schema(request.schema) if request.HasField("schema") else None
        started = await self._call(context, lambda: self.core.mark_ready(
            request.worker_id, request.planned_iterations, self.clock(), schema))
        assert isinstance(started, bool)
        self._note_run_state()
        if started:  # a restarted coordinator must know the run trains (not only 0.5 s later)
            await self.save_state()
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else 60.0
        try:
            await asyncio.wait_for(self._until_started_or_stopped(), timeout)
        except TimeoutError:
            live = self.core.live()
            ready = sum(w.ready for w in live)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, (
                f"{len(live)} of {self.core.settings.num_workers} workers registered and "
                f"{ready} ready within {timeout:.0f} s; start the missing workers"))
        if self.core.stopped and not self._started.is_set():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the run stopped before training: {self.core.stop_reason}")
        return pb.AwaitStartReply(elapsed_seconds=self.core.elapsed(self.clock()))

    async def _until_started_or_stopped(self) -> None:
        waits = {asyncio.ensure_future(self._started.wait()),
                 asyncio.ensure_future(self._stopped.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()

    async def CheckSchema(self, request: pb.CheckSchemaRequest,
                          context: grpc.aio.ServicerContext) -> pb.CheckSchemaReply:
        await self._call(context, lambda: self.core.check_schema(
            request.worker_id, _schema(request.schema)))
        return pb.CheckSchemaReply()

    # ------------------------------------------------------------------ groups
    async def Synchronize(self, request_iterator: AsyncIterator[pb.SyncMessage],
                          context: grpc.aio.ServicerContext) -> None:
        """One worker's stream: messages are handled in order, requests answered in order.

        This is the coordinator's hot loop (every group request and release), so it reads
        and writes the call directly (one coroutine per stream, not an async generator
        the runs service would wrap in another per message), core errors abort the call
        without a coroutine per message, and a wait for a group is one future and one
        timer (docs/scale.md measures what this costs against gRPC's own floor)."""
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
            await _abort(context, err)
        self._resolve(deliveries)
        if decision is None:
            decision = await self._wait_for_group(wid, request.timeout_seconds)
        self.metrics.group_request_duration.observe(time.perf_counter() - arrived)
        return self._group_reply(decision)

    async def _wait_for_group(self, wid: int, timeout_seconds: float) -> GroupDecision:
        """The decision a deliveries' `_resolve` hands this worker, or, after the timeout,
        the core's answer to an ended wait (RETRY: ask again). Whichever of the two comes
        first on the loop settles the future, and the other then finds it done: the
        timeout ends the core's wait in the same callback (`_end_wait`), so a decision
        is never dropped for a timer that fired first, nor a wait left open."""
        timeout = min(timeout_seconds, MAX_GROUP_WAIT_SECONDS) if timeout_seconds > 0 else 10.0
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GroupDecision] = loop.create_future()
        self._waiters[wid] = fut
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
            if self._waiters.get(wid) is fut:
                del self._waiters[wid]

    def _end_wait(self, wid: int, fut: asyncio.Future[GroupDecision]) -> None:
        """The wait for a group ran out (unless a decision came first): end it in the
        core now and answer with the core's RETRY."""
        if fut.done():
            return
        if self._waiters.get(wid) is fut:
            del self._waiters[wid]
        try:
            fut.set_result(self.core.abandon_wait(wid, self.clock()))
        except CoordinatorError as err:  # the worker is gone meanwhile
            fut.set_exception(err)

    def _group_reply(self, d: GroupDecision) -> pb.GroupReply:
        g = d.group
        group = None if g is None else pb.Group(
            group_id=g.group_id, members=g.members, initiator=g.initiator, comm_id=g.comm_id,
            create_comm=g.create_comm, heal=g.heal_donor is not None,
            heal_donor=g.heal_donor or 0)
        return pb.GroupReply(outcome=_OUTCOMES[d.outcome], more=d.more,
                             evict_comm_ids=d.evictions, detail=d.detail, group=group)

    async def _release_group(self, request: pb.ReleaseRequest,
                             context: grpc.aio.ServicerContext) -> None:
        distance = (request.squared_distance if request.HasField("squared_distance")
                    else None)
        try:
            deliveries = self.core.release(request.worker_id, request.group_id, request.ok,
                                           request.error, self.clock(),
                                           squared_distance=distance)
        except (CoordinatorError, ValueError) as err:
            await _abort(context, err)
        if not request.ok:
            logger.warning("worker %d reports group %d failed: %s",
                           request.worker_id, request.group_id, request.error)
        self._resolve(deliveries)

    # ------------------------------------------------------------------ the final average
    async def FinalGroup(self, request: pb.FinalGroupRequest,
                         context: grpc.aio.ServicerContext) -> pb.GroupReply:
        wid = request.worker_id
        why = await self._call(context, lambda: self.core.final_group_refusal(wid))
        if why:
            return pb.GroupReply(outcome=pb.GROUP_OUTCOME_NO_GROUP, detail=str(why))
        if self._final_formed:
            return pb.GroupReply(outcome=pb.GROUP_OUTCOME_NO_GROUP, detail=(
                "the final average ran before this worker asked"))
        fut = self._final_waiters.setdefault(
            wid, asyncio.get_running_loop().create_future())
        self._form_final_group(complete_only=True)
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else 30.0
        try:
            group = await asyncio.wait_for(asyncio.shield(fut), timeout)
        except TimeoutError:
            self._form_final_group(complete_only=False)  # whoever asked, without the rest
            group = fut.result()
        if group is None or len(group.members) < 2:
            return pb.GroupReply(outcome=pb.GROUP_OUTCOME_NO_GROUP,
                                 detail="no other live worker asked for the final average")
        return self._group_reply(GroupDecision(outcome=Outcome.GROUP, group=group))

    def _form_final_group(self, *, complete_only: bool) -> None:
        """Hand the final group to every worker that asked: once all live workers have,
        or (a waiter's timeout) to those that have."""
        waiting = [w for w, fut in self._final_waiters.items() if not fut.done()]
        expected = set(self.core.final_members())
        if (self._final_formed or not waiting
                or (complete_only and not expected <= set(waiting))):
            return
        self._final_formed = True
        group = self.core.final_group(waiting, self.clock()) if len(waiting) >= 2 else None
        for w in waiting:
            self._final_waiters[w].set_result(group)
        if group is not None:
            logger.info("final average over workers %s", list(group.members))

    # ------------------------------------------------------------------ consensus
    async def Consensus(self, request: pb.ConsensusRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.ConsensusChunk]:
        """The live workers' average model now (ripples/consensus.py): ask every live
        worker to publish its model at its next step boundary, wait for all (a worker
        that leaves meanwhile is dropped), average, stream the average back. One request
        at a time (another is refused at once); every wait is bounded by the request's
        timeout; the store keeps no model copy afterwards, whatever happened."""
        core = self.core
        refusal = self._consensus_refusal()
        if not refusal and self._consensus_expected:
            refusal = "another consensus request is in progress; ask again when it is done"
        if refusal:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else 60.0
        started = self.clock()
        self._consensus_seq += 1
        cid = (self.incarnation << 32) + self._consensus_seq  # never reused
        expected = {w.worker_id for w in core.live() if w.healed}
        prefix = f"g{core.registry.generation}/" if core.registry.generation else ""
        keys = {w: prefix + consensus.publish_key(cid, w) for w in expected}
        self._consensus_expected = expected
        core.want_consensus(cid)  # what the workers are asked to publish for
        logger.info("consensus %d: asking workers %s for their models", cid, sorted(expected))
        blobs: list[bytes] = []
        published: list[int] = []
        try:
            missing = await self._await_published(keys, started + timeout)
            core.want_consensus(0)
            if core.started_at is None and not core.stopped:
                await context.abort(grpc.StatusCode.ABORTED, (
                    f"a restart round ({core.restart_reason}) interrupted the request: the "
                    "workers restart from the last checkpoint; ask again once they train"))
            if missing:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, (
                    f"workers {missing} did not publish their model within {timeout:.0f} s "
                    "(each does at its next step boundary); ask again, or with a longer "
                    "--timeout-seconds"))
            # Whoever published (one that left since counts with the model it had).
            for w in sorted(keys):
                if await asyncio.to_thread(has_blob, self.store, keys[w]):
                    blobs.append(await asyncio.to_thread(get_blob, self.store, keys[w]))
                    published.append(w)
        finally:
            self._consensus_expected = set()
            core.want_consensus(0)
            self._consensus_done.append((prefix, cid))
            await asyncio.to_thread(self._sweep_consensus_keys)
        if not published:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "no live worker published its model")
        try:
            average = await asyncio.to_thread(consensus.average_models, blobs)
        except ValueError as err:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(err))
            raise AssertionError("unreachable") from err
        seconds = self.clock() - started
        logger.info("consensus %d: averaged workers %s in %.2f s", cid, published, seconds)
        yield pb.ConsensusChunk(info=pb.ConsensusInfo(
            consensus_id=cid, workers=published, iterations=average.iterations,
            consensus_distance=average.consensus_distance, seconds=seconds,
            size_bytes=len(average.data)))
        for i in range(0, len(average.data), consensus.CHUNK_BYTES):
            yield pb.ConsensusChunk(data=average.data[i:i + consensus.CHUNK_BYTES])

    def _sweep_consensus_keys(self) -> None:
        """Delete every worker's model published for the recent requests, late ones
        included (a lock-step worker that reached the agreed step after the request
        ended): the store keeps no model copy. Runs off the event loop."""
        workers = list(self.core.workers)
        for prefix, cid in self._consensus_done:
            for w in workers:
                delete_blob(self.store, prefix + consensus.publish_key(cid, w))
        del self._consensus_done[:-CONSENSUS_SWEEP_REQUESTS]

    def _consensus_refusal(self) -> str:
        core = self.core
        if self.store is None:
            return "this coordinator hosts no rendezvous store to collect the models"
        if not core.settings.spec.library:
            return (f"{core.settings.protocol}'s updater processes train outside the "
                    "worker's step loop: no consensus model mid-run (the final one is "
                    "written at the end)")
        if core.stopped:
            return f"the run is over ({core.stop_reason})"
        if core.started_at is None:
            return "the run is not training now (it has not started, or a restart round is open)"
        return ""

    async def _await_published(self, keys: dict[int, str], deadline: float) -> list[int]:
        """Wait until every expected worker that is still live published; returns the
        ones missing at the deadline (none: all did)."""
        while True:
            live = {w.worker_id for w in self.core.live()}
            missing = []
            for w, key in keys.items():
                if w in live and not await asyncio.to_thread(has_blob, self.store, key):
                    missing.append(w)
            if not missing or self.clock() > deadline or self.core.started_at is None:
                return sorted(missing)
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ lock-step
    async def GetStaticSchedule(self, request: pb.StaticScheduleRequest,
                                context: grpc.aio.ServicerContext) -> pb.StaticScheduleReply:
        w = await self._call(context, lambda: self.core.worker(request.worker_id))
        assert w is not None
        if self.core.role.coordination is not Coordination.STATIC:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"protocol {self.core.settings.protocol} does not use the "
                                "static schedule")
        if self.core.started_at is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the run has not started")
        me = self.core.workers[request.worker_id]
        ranks = [pb.WorkerRank(worker_id=w.worker_id, rank=w.rank, node=w.node)
                 for w in sorted(self.core.live(), key=lambda x: x.rank)]
        return pb.StaticScheduleReply(
            num_nodes=self.core.num_nodes(), workers_per_node=self.core.settings.workers_per_node,
            rank=me.rank, run_id=self.core.settings.run_id, ranks=ranks)

    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext
                         ) -> pb.CheckpointReply:
        progress = progress_from_proto(request.progress) if request.HasField("progress") else None
        stop_at = await self._call(context, lambda: self.core.checkpoint(
            request.worker_id, request.iteration, self.clock(), progress,
            optimizer_state_ready=request.optimizer_state_ready))
        assert isinstance(stop_at, int)
        return pb.CheckpointReply(stop_at_iteration=stop_at, stop_reason=self.core.stop_reason,
                                  adopt_state_after_iteration=self.core.adopt_state_after,
                                  consensus_id=self.core.consensus_id,
                                  consensus_at_iteration=self.core.consensus_at)

    # ------------------------------------------------------------------ views
    async def GetRunStatus(self, request: pb.RunStatusRequest,
                           context: grpc.aio.ServicerContext) -> pb.RunStatus:
        return self.run_status()

    def run_status(self) -> pb.RunStatus:
        core, now = self.core, self.clock()
        mean = core.mean_loss()
        distance = core.consensus_distance()
        workers = [
            pb.WorkerStatus(
                worker_id=w.worker_id, host=w.host, local_rank=w.local_rank, device=w.device,
                rank=max(w.rank, 0), state=_STATES[w.state], iteration=w.progress.iteration,
                request_count=w.request_count,
                loss=w.progress.loss if math.isfinite(w.progress.loss) else 0.0,
                progress=progress_to_proto(w.progress), error=w.error,
                metrics_address=self.metrics_targets.get(w.worker_id, ""))
            for w in self._shown_workers()
        ]
        return pb.RunStatus(
            config=core.settings.to_proto(), workers=workers, elapsed_seconds=core.elapsed(now),
            started=core.started_at is not None, stopped=core.stopped,
            stop_reason=core.stop_reason, num_groups_formed=core.table.num_formed,
            num_groups_executing=core.table.num_executing,
            num_groups_pending=core.table.num_pending, num_conflicts=core.table.num_conflicts,
            num_pending_waits=core.groups.num_pending_waits,
            pending_wait_seconds=core.groups.pending_wait_seconds,
            num_groups_cancelled=core.groups.num_cancelled,
            num_groups_failed=core.groups.num_failed,
            mean_loss=mean if mean is not None else 0.0,
            time_to_target_seconds=core.time_to_target if core.time_to_target is not None else -1,
            loss_curve=[pb.LossPoint(seconds=s, loss=v, mean_iterations=i)
                        for s, v, i in core.loss_curve],
            recent_groups=[self._group_view(g, now, finished=True) for g in core.recent_groups],
            active_groups=[self._group_view(g, now) for g in core.table.unfinished()],
            metrics_address=self.metrics_address,
            num_lease_expirations=core.num_lease_expirations,
            iterations_to_target=(core.iterations_to_target
                                  if core.iterations_to_target is not None else -1),
            topology_edges=[pb.TopologyEdge(a=a, b=b) for a, b in core.graph.edges],
            edges_always_used=core.graph.edges_always_used,
            topology_complete=core.graph.complete,
            spectral_gap=core.graph.spectral_gap,
            consensus_distance=distance if distance is not None else -1.0,
            num_restarts=core.restarts,
            restarting=core.restart_reason if core.restart_began_at is not None else "",
        )

    def _shown_workers(self) -> list[WorkerRecord]:
        """The workers a run status lists: every one but departed workers beyond the
        newest `num_workers` of them. Replacements of departed members (elastic runs)
        would otherwise pile up over a long run; this keeps the status O(workers) while a
        run whose workers all left still shows each of them."""
        workers = self.core.workers.values()  # in registration order
        gone = [w.worker_id for w in workers if w.state in GONE]
        dropped = set(gone[:-self.core.settings.num_workers])
        return [w for w in workers if w.worker_id not in dropped]

    def _group_view(self, g: GroupRecord, now: float, *, finished: bool = False) -> pb.Group:
        live = self.core.table.get(g.group_id) is g
        state = _GROUP_STATES[g.state] if live or not finished else pb.GROUP_STATE_FINISHED
        return pb.Group(group_id=g.group_id, members=g.members, initiator=g.initiator,
                        comm_id=g.comm_id, state=state, age_seconds=max(0.0, now - g.created_at))

    def discovery(self) -> SdTargets:
        """Prometheus HTTP service discovery: the coordinator and each live worker."""
        groups: SdTargets = []
        if self.metrics_address:
            groups.append({"targets": [self.metrics_address], "labels": {"role": "coordinator"}})
        for w in self.core.live():
            target = self.metrics_targets.get(w.worker_id)
            if target:
                groups.append({"targets": [target], "labels": {
                    "role": "worker", "__meta_ripples_worker": str(w.worker_id),
                    "__meta_ripples_host": w.host}})
        return groups

    async def StopRun(self, request: pb.StopRunRequest, context: grpc.aio.ServicerContext
                      ) -> pb.StopRunReply:
        await self.stop(request.reason or "stopped by request")
        return pb.StopRunReply()

    async def _stop_from_root(self, reason: str) -> None:
        self.stopped_at_root = True
        await self.stop(reason)

    async def stop(self, reason: str, *, failure: bool = False) -> None:
        """Stop the run (an operator, or a failure the service saw: see core.stop)."""
        self._resolve(self.core.stop(reason, self.clock(), failure=failure))
        await self.save_state()
        logger.info("run stopped: %s", reason)
