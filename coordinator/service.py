"""The Worker service of one run: the gRPC shell around its CoordinatorCore.

`CoordinatorService` serves the ripples.v1.Worker RPCs of one run (the runs queue hands
each call of the active run to it: coordinator/worker_gateway.py) and keeps the run's
background tasks: the lease reaper, the state saver, a shard's watch of its root. It
owns the clock and the long-polls of membership (AwaitMembers, AwaitStart); the group
stream (coordinator/sync_stream.py), the final average (coordinator/final_average.py),
consensus collection (coordinator/consensus_collector.py), the status view
(coordinator/status_view.py), the saves of the run's state (coordinator/state_saver.py)
and the phases the long-polls wait for (coordinator/run_phases.py) are its parts.

All handlers run on one asyncio event loop, so the core is only ever touched by one
coroutine at a time (the loop is the lock) and each handler's critical section is a
plain synchronous call into the core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from ripples.coordinator import heap, run_graph, status_view
from ripples.coordinator.consensus_collector import ConsensusCollector
from ripples.coordinator.core import CoordinatorCore, CoordinatorError, Deliveries
from ripples.coordinator.final_average import FinalAverage
from ripples.coordinator.http import SdTargets
from ripples.coordinator.metrics import CoordinatorMetrics
from ripples.coordinator.root_watch import ROOT_POLL_SECONDS, RootWatch
from ripples.coordinator.run_phases import RunPhases
from ripples.coordinator.state_saver import StateSaver, refuse_unless_stored, save_interval
from ripples.coordinator.state_store import StateStore
from ripples.coordinator.sync_stream import SyncStreams
from ripples.coordinator.wire import abort, peer_host, progress_from_proto, schema_from_proto
from ripples.guarded import guarded_loop
from ripples.protocols.spec import Coordination
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

T = TypeVar("T")


class CoordinatorService(pb_grpc.WorkerServicer):
    """Translates a run's Worker RPCs into core events and core decisions into replies."""

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
        """Args:
            core: the run's core.
            store_host: the rendezvous store's address, as workers reach it.
            store_port: its port.
            clock: the coordinator's clock.
            state: where the run's state is saved (--state-dir), if anywhere.
            incarnation: the coordinator's incarnation (1, then one more per restart).
            store: the run's view of the rendezvous store this coordinator hosts (a
                torch.distributed store, or None): consensus models come through it.
        """
        self.core = core
        self.state = state
        self.incarnation = incarnation
        self.store_host = store_host
        self.store_port = store_port
        self.clock = clock
        self.phases = RunPhases(core)
        self._reaper: asyncio.Task[None] | None = None
        self._save_loop: asyncio.Task[None] | None = None
        self._root_watch: RootWatch | None = None
        self._root_task: asyncio.Task[None] | None = None
        self.stopped_at_root = False
        """A shard's run stopped because an operator stopped the root's (it ends as
        stopped, as a run an operator stopped here does)."""
        self.metrics = CoordinatorMetrics(core, clock)
        self.metrics_address = ""  # the coordinator's own HOST:PORT, set by the server
        self.metrics_targets: dict[int, str] = {}  # worker id -> HOST:PORT
        self.saver = StateSaver(core, state, clock, lambda: self.metrics_targets)
        self.sync = SyncStreams(core, clock=clock, metrics=self.metrics,
                                resolve=self._resolve, suspect=self._suspect)
        self.final = FinalAverage(core, clock=clock)
        self.consensus = ConsensusCollector(core, store=store, incarnation=incarnation,
                                            clock=clock)

    # ------------------------------------------------------------------ plumbing
    def start_background(self) -> None:
        self._reaper = self._guarded("lease-reaper", self._reap_leases,
                                     max(0.05, self.core.settings.lease_seconds / 4))
        if self.state is not None:  # its failures are logged and retried (guarded)
            self._save_loop = self._guarded("state-saver", self.saver.save_or_raise,
                                            save_interval(self.core.settings.num_workers))
        root = self.core.settings.root
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
        """Save the run's state to the state dir, if any (a refused save is logged and
        retried: StateSaver.save)."""
        await self.saver.save()

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self._save_loop is not None:
            self._save_loop.cancel()
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
        self.final.form(complete_only=True)

    def restored(self, metrics_targets: dict[int, str]) -> None:
        """The run was resumed from its saved state (a coordinator restart): its workers'
        metrics targets, and the long-polls armed as that state says."""
        self.metrics_targets = dict(metrics_targets)
        self.phases.note()

    def _resolve(self, deliveries: Deliveries) -> None:
        """An event changed the run: wake the long-polls it concerns, and hand each
        waiting worker the decision the core made for it."""
        self.phases.note()
        self.sync.deliver(deliveries)

    async def _call(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        """`fn()`, a call into the core; its error ends the call with its status."""
        try:
            return fn()
        except (CoordinatorError, ValueError) as err:
            await abort(context, err)

    # ------------------------------------------------------------------ membership
    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> pb.RegisterReply:
        now = self.clock()
        core, registry = self.core, self.core.registry
        if self.state is not None:  # a disk that takes no write refuses it unchanged
            await refuse_unless_stored(context, asyncio.to_thread(self.state.check_writable))
        await self._prepare_graph(request.host)
        formed, restarts = registry.formed, core.restarts
        worker_id = await self._call(context, lambda: core.register(
            request.host, request.local_rank, request.device or "cpu", request.pid, now))
        w = core.workers[worker_id]
        if request.metrics_port:
            host = request.metrics_host or peer_host(context.peer()) or w.host
            self.metrics_targets[worker_id] = f"{host}:{request.metrics_port}"
        # A restarted coordinator must know every worker it named: stored before the
        # reply. Only this worker's record changed, unless the registration formed the
        # membership, took a departed member's place or opened a restart round.
        alone = (not w.replacement and formed == registry.formed
                 and restarts == core.restarts and not core.stopped)

        def undo() -> bool:
            """Forget it, unless a registration since formed the membership with it."""
            if registry.formed != formed or core.restarts != restarts or core.stopped:
                return False
            registry.undo(w)
            self.metrics_targets.pop(worker_id, None)
            return True

        if alone:  # undone (its id handed out again) if the disk refuses it
            await refuse_unless_stored(context, self.saver.save_or_raise(only=[worker_id]),
                                       undo)
        else:  # too much changed to undo (the disk took a write just now): retried
            await self.save_state()
        self.phases.note()
        logger.info("registered worker %d (host %s, local rank %d, %s)",
                    worker_id, w.host, w.local_rank, w.device)
        return pb.RegisterReply(worker_id=worker_id, config=self.core.settings.to_proto(),
                                store_host=self.store_host, store_port=self.store_port)

    async def _prepare_graph(self, host: str) -> None:
        """A registration from `host` about to complete the membership of a run whose
        graph needs every rank's host (hierarchical): its graph on ranks is built in a
        worker thread first, so that the forming, on the loop, only maps it to worker ids
        (A2CiD2's constants on 4,096 workers take a minute). Other topologies were built
        when the run was activated (run_graph.prepare). If registrations interleave
        meanwhile, the forming builds whatever does not fit on the loop, as before."""
        core, registry = self.core, self.core.registry
        if (registry.formed or not run_graph.needs_nodes(core.settings)
                or registry.num_live + 1 != registry.num_workers):
            return
        nodes = registry.nodes_if_formed(host)
        prepared = core.prepared_graph
        if prepared is not None and prepared.fits(core.settings, nodes):
            return
        try:
            core.prepared_graph = await asyncio.to_thread(
                run_graph.RankGraph.build, core.settings, len(nodes), nodes)
        except ValueError:
            return  # the forming stops the run, saying why

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HeartbeatReply:
        rejoin = self.core.rejoins(request.worker_id)
        if rejoin:  # a restart round ended its part: its process restarts
            return pb.HeartbeatReply(restart=True, restart_reason=rejoin,
                                     incarnation=self.incarnation)
        progress = progress_from_proto(request.progress) if request.HasField("progress") else None
        deliveries = await self._call(context, lambda: self.core.heartbeat(
            request.worker_id, progress, self.clock()))
        self._resolve(deliveries)
        return pb.HeartbeatReply(stop=self.core.stopped, stop_reason=self.core.stop_reason,
                                 members_lost=self.core.members_lost,
                                 mean_iterations=self.core.mean_iterations(),
                                 incarnation=self.incarnation,
                                 consensus_id=(self.core.consensus_id
                                               if request.worker_id in self.consensus.expected
                                               else 0))

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
                    ) -> pb.LeaveReply:
        rejoin = self.core.rejoins(request.worker_id)
        if rejoin:  # a restart round ended its part already
            return pb.LeaveReply(restart=True, restart_reason=rejoin)
        progress = progress_from_proto(request.progress) if request.HasField("progress") else None
        deliveries = await self._call(context, lambda: self.core.leave(
            request.worker_id, progress, request.error, self.clock(), request.reason,
            done=request.done))
        self._resolve(deliveries)
        await self.save_state()
        self.final.form(complete_only=True)  # it may have been the last one awaited
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
            await asyncio.wait_for(self.phases.members.wait(), timeout)
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
        schema = schema_from_proto(request.schema) if request.HasField("schema") else None
        started = await self._call(context, lambda: self.core.mark_ready(
            request.worker_id, request.planned_iterations, self.clock(), schema,
            request.model_fingerprint))
        self.phases.note()
        if started:  # a restarted coordinator must know the run trains (not only 0.5 s later)
            await self.save_state()
        timeout = request.timeout_seconds if request.timeout_seconds > 0 else 60.0
        try:
            await asyncio.wait_for(self.phases.until_started_or_stopped(), timeout)
        except TimeoutError:
            live = self.core.live()
            ready = sum(w.ready for w in live)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, (
                f"{len(live)} of {self.core.settings.num_workers} workers registered and "
                f"{ready} ready within {timeout:.0f} s; start the missing workers"))
        if self.core.stopped and not self.phases.started.is_set():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the run stopped before training: {self.core.stop_reason}")
        replacement = self.core.worker(request.worker_id).replacement  # it heals instead
        return pb.AwaitStartReply(elapsed_seconds=self.core.elapsed(self.clock()),
                                  differing_ranks=() if replacement
                                  else self.core.start_differing_ranks)

    async def CheckSchema(self, request: pb.CheckSchemaRequest,
                          context: grpc.aio.ServicerContext) -> pb.CheckSchemaReply:
        await self._call(context, lambda: self.core.check_schema(
            request.worker_id, schema_from_proto(request.schema)))
        return pb.CheckSchemaReply()

    # ------------------------------------------------------------------ groups
    async def Synchronize(self, request_iterator: AsyncIterator[pb.SyncMessage],
                          context: grpc.aio.ServicerContext) -> None:
        """A worker's group stream (the hot loop: coordinator/sync_stream.py)."""
        await self.sync.serve(request_iterator, context)

    async def FinalGroup(self, request: pb.FinalGroupRequest,
                         context: grpc.aio.ServicerContext) -> pb.GroupReply:
        """The final average's group (coordinator/final_average.py)."""
        return await self.final.serve(request, context)

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
        return pb.CheckpointReply(stop_at_iteration=stop_at, stop_reason=self.core.stop_reason,
                                  adopt_state_after_iteration=self.core.adopt_state_after,
                                  consensus_id=self.core.consensus_id,
                                  consensus_at_iteration=self.core.consensus_at)

    # ------------------------------------------------------------------ views
    def run_status(self, *, all_workers: bool = False) -> pb.RunStatus:
        """The run's status now (coordinator/status_view.py; `all_workers`: every
        worker's row, not the first MAX_STATUS_WORKERS)."""
        return status_view.run_status(self.core, self.clock(),
                                      metrics_address=self.metrics_address,
                                      metrics_targets=self.metrics_targets,
                                      all_workers=all_workers)

    def discovery(self) -> SdTargets:
        """Prometheus HTTP service discovery: the coordinator and each live worker."""
        return status_view.discovery(self.core, metrics_address=self.metrics_address,
                                     metrics_targets=self.metrics_targets)

    # ------------------------------------------------------------------ stopping
    async def _stop_from_root(self, reason: str) -> None:
        self.stopped_at_root = True
        await self.stop(reason)

    async def stop(self, reason: str, *, failure: bool = False) -> None:
        """Stop the run (an operator, or a failure the service saw: see core.stop)."""
        self._resolve(self.core.stop(reason, self.clock(), failure=failure))
        await self.save_state()
        logger.info("run stopped: %s", reason)
