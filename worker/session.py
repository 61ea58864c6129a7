"""A worker's part in a run, as the coordinator sees it: registration, lease, start, leave.

`join()` connects, registers (the coordinator hands out the run's settings and a worker
id), starts the heartbeat that keeps the lease and reports progress, and waits until every
expected worker registered: ranks and topology are then final. `start()` declares the
worker ready with the schema of its averaged tensors and waits until every member is;
then it opens the data plane (the rendezvous store and the communicator cache). `leave()`
ends the worker's part, with the error that ended it, if any. Every wait has a timeout.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import torch
import torch.distributed as dist

from ripples import events
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import replica_pb2 as rpb
from ripples.worker.client import (
    PROCESS_RESTART,
    CoordinatorCallError,
    CoordinatorClient,
    HeartbeatThread,
    Restart,
)
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import (
    CommunicatorCache,
    CommunicatorFactory,
    connect_store,
)
from ripples.worker.dataplane.preduce import copy_model
from ripples.worker.launch_env import LaunchEnv
from ripples.worker.metrics import WorkerMetrics
from ripples.worker.protocol import ProtocolContext, max_peer_wait_seconds
from ripples.worker.replica import RelayTimeouts, Replica, worker_schema
from ripples.worker.shard import RootLink, is_head
from ripples.worker.stats import WorkerStats

logger = logging.getLogger(__name__)

START_MODEL_KEY = "start/rank0-model"
"""The communicator over every member that copies rank 0's initial model."""
START_CHECK_IN_SECONDS = 60.0
"""How long the copy of rank 0's model waits for every member to check in (all of them
just passed the start barrier)."""


def relay_timeouts(config: pb.RunConfig) -> RelayTimeouts:
    """A round's longest wait for a group, twice, and four collectives, at least half an
    hour (the run's settings are known once rank 0 registered)."""
    collective = config.collective_timeout_seconds
    return RelayTimeouts(max(1800.0, 2 * max_peer_wait_seconds(config) + 4 * collective))


def take_process_settings(env: LaunchEnv, device: torch.device) -> None:
    """This process's torch threads (the launch's, if set) and current CUDA device."""
    if env.num_threads:
        torch.set_num_threads(env.num_threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def resolve_device(env: LaunchEnv) -> torch.device:
    """The launch's device, else cuda:<local rank> when CUDA is available, else cpu."""
    if env.device:
        device = torch.device(env.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {env.device} requested but CUDA is not available")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


class Session:
    """One worker's membership in one run (the coordinator's side of a worker's life)."""

    def __init__(self, env: LaunchEnv, *,
                 progress: Callable[[], pb.Progress] | None = None,
                 replica: Replica | None = None) -> None:
        """`progress`: what this worker reports (default: its own stats; a head's
        membership at the root reports the head's own, with no budget: worker/shard.py).
        `replica`: rank 0 of a worker of several ranks, which relays what it learns to
        the others (worker/replica.py; they hold a FollowerSession)."""
        if not env.distributed:
            raise ValueError("a session needs a coordinator address")
        self.env = env
        self.device = resolve_device(env)
        self.client = CoordinatorClient(env.coordinator)
        self.stats = WorkerStats()
        self._progress = progress if progress is not None else self.stats.snapshot
        self.metrics = WorkerMetrics()
        self.local_stop = threading.Event()
        """Set by a signal: this worker finishes its step and leaves."""
        self.worker_id: int | None = None
        self.config = pb.RunConfig()
        self.membership = pb.Membership()
        self.heartbeat: HeartbeatThread | None = None
        self.store: dist.Store | None = None
        self.comms: CommunicatorCache | None = None
        self._store_address = ("", 0)
        self._left = False
        self.root: RootLink | None = None
        """A shard's head: its membership in the root's run (opened by the protocol)."""
        self.replica = replica

    # ------------------------------------------------------------------ life
    def join(self) -> None:
        """Register and wait until every expected worker has (ranks are then final)."""
        env = self.env
        take_process_settings(env, self.device)
        self.client.wait_until_reachable(env.connect_timeout_seconds)
        # The run's token guards the worker's metrics too (Prometheus sends it).
        metrics_port = (self.metrics.serve(env.metrics_bind, env.metrics_port,
                                           tokens=(self.client.security.token,))
                        if env.metrics_port >= 0 else 0)
        reg = self.client.register(env.host, env.local_rank, str(self.device), os.getpid(),
                                   metrics_port=metrics_port, metrics_host=env.metrics_host,
                                   vacancy_timeout_seconds=env.start_timeout_seconds,
                                   run_id=env.run_id)
        self.worker_id, self.config = reg.worker_id, reg.config
        self._store_address = (reg.store_host, reg.store_port)
        self.client.outage_seconds = self.config.coordinator_outage_seconds
        logger.info("registered as worker %d for run %s (%s)", self.worker_id,
                    self.config.run_id, self.config.protocol)
        events.emit(events.WORKER_REGISTERED, worker_id=self.worker_id, host=env.host,
                    run_id=self.config.run_id, protocol=self.config.protocol)
        self.heartbeat = HeartbeatThread(self.client, self.worker_id,
                                         self.config.heartbeat_interval_seconds,
                                         self.config.lease_seconds, self._progress,
                                         outage_seconds=self.config.coordinator_outage_seconds)
        self.heartbeat.start()
        self.membership = self.client.await_members(self.worker_id, env.start_timeout_seconds)
        if self.membership.replacement:
            logger.info("worker %d replaces rank %d of the running run from iteration %d",
                        self.worker_id, self.membership.rank, self.membership.start_iteration)
        if self.replica is not None:
            self.replica.timeouts = relay_timeouts(self.config)
            self.replica.send("start", rpb.ReplicaStart(
                worker_id=self.worker_id, config=self.config, membership=self.membership,
                store_host=reg.store_host, store_port=reg.store_port))

    def start_training(self, state: AveragedState, planned_iterations: int) -> None:
        """Declare this worker ready with its averaged tensors, wait for every member, open
        the data plane; then every member starts from one model: rank 0's, copied when
        some member's initial values differ (a script that seeds per rank, as DDP scripts
        do: DDP broadcasts rank 0's model when it wraps it). A replacement heals from a
        live peer instead."""
        schema, fingerprint = state.schema(), state.fingerprint()
        if self.replica is not None:  # every rank's shards, checked as one
            schema, fingerprint = worker_schema(self.replica, schema, fingerprint)
        reply = self.start(schema, planned_iterations, fingerprint)
        differing = list(reply.differing_ranks)
        if not differing or self.membership.replacement:
            return
        assert self.comms is not None
        rank, size = self.membership.rank, self.membership.num_workers
        try:
            comm = self.comms.get(START_MODEL_KEY, rank, size, create=True,
                                  peers_within=START_CHECK_IN_SECONDS)
            copy_model(state, comm, 0, self.config.collective_timeout_seconds)
        except (RuntimeError, TimeoutError, ValueError) as err:
            raise RuntimeError(f"rank {rank} could not copy rank 0's initial model (every "
                               f"worker starts from one model): {err}") from err
        finally:
            self.comms.drop(START_MODEL_KEY)
        if rank in differing:
            logger.info("rank %d built a model that differs from rank 0's; it starts from "
                        "rank 0's, as with DDP", rank)

    def start(self, schema: pb.TensorSchema | None, planned_iterations: int,
              model_fingerprint: str = "") -> pb.AwaitStartReply:
        """Declare this worker ready and wait for every member; then open the data plane.
        Returns the coordinator's reply (which ranks' initial models differ)."""
        assert self.worker_id is not None, "join() first"
        self.stats.planned_iterations = planned_iterations
        reply = self.client.await_start(self.worker_id, planned_iterations,
                                        self.env.start_timeout_seconds, schema,
                                        model_fingerprint)
        if self.replica is not None:
            self.replica.send("start-reply", reply)
        self._open_data_plane()
        return reply

    def _open_data_plane(self) -> None:
        """Connect to the rendezvous store; the communicator cache builds on it."""
        assert self.worker_id is not None, "join() first"
        timeout = self.config.collective_timeout_seconds
        host, port = self._store_address
        generation = self.membership.generation

        run_id = self.config.run_id

        def connect() -> dist.Store:
            # The coordinator's store serves its runs one after another: each run's keys
            # live under its id. After a restart round, every key lives under the round's
            # generation: the keys of the processes before the restart stay in the store.
            store = dist.PrefixStore(f"run/{run_id}/", connect_store(host, port, timeout))
            return dist.PrefixStore(f"g{generation}/", store) if generation else store

        self.store = connect()
        loopback = host in ("127.0.0.1", "localhost")
        factory = CommunicatorFactory(self.store, self.device, timeout,
                                      gloo_hostname="127.0.0.1" if loopback else "",
                                      reconnect=connect)
        self.comms = CommunicatorCache(
            factory, shard=self.replica.rank if self.replica is not None else None)
        self.metrics.attach(worker_id=self.worker_id, host=self.env.host,
                            protocol=self.config.protocol, cache=self.comms)

    def protocol_context(self, model: torch.nn.Module, state: AveragedState) -> ProtocolContext:
        """What the run's protocol may use (after start())."""
        assert self.worker_id is not None
        assert self.comms is not None and self.store is not None, "start() first"
        stop_requested, stop_reason, incarnation = self._run_signals()
        if self.replica is not None and is_head(self.config, self.membership):
            raise ValueError("a shard's head in a sharded job (--root) is a worker of one "
                             "rank: start it without --ranks-per-worker")
        if self.root is None and is_head(self.config, self.membership):
            self.root = RootLink(self.env, self.config, self._progress,
                                 lambda env, progress: Session(env, progress=progress))
        return ProtocolContext(
            client=self.client, worker_id=self.worker_id, rank=self.membership.rank,
            num_workers=self.membership.num_workers, config=self.config,
            membership=self.membership, model=model, state=state, comms=self.comms,
            store=self.store, device=self.device, stop_requested=stop_requested,
            stop_reason=stop_reason, progress=self._progress, incarnation=incarnation,
            metrics=self.metrics.for_protocol(), root=self.root, replica=self.replica)

    def _run_signals(self) -> tuple[threading.Event, Callable[[], str], Callable[[], int]]:
        """Where the protocol hears of the run's stop, its reason, and the coordinator's
        life: the heartbeat's answers."""
        heartbeat = self.heartbeat
        assert heartbeat is not None, "join() first"
        return (heartbeat.stop_requested, lambda: heartbeat.stop_reason,
                lambda: heartbeat.incarnation)

    def check_schema(self, schema: pb.TensorSchema) -> None:
        assert self.worker_id is not None
        self.client.check_schema(self.worker_id, schema)
        if self.root is not None:
            self.root.check_schema(schema)

    def leave(self, error: str = "", reason: str = "", *, done: bool = False) -> None:
        """Leave the run (once): cleanly (`reason`: why it ended; `done`: its training
        loop ended, it is not lost), or FAILED with `error`."""
        if self._left:
            return
        self._left = True
        if self.root is not None:
            self.root.close(reason=reason or "the shard's run ended", done=done)
        if self.heartbeat is not None:
            self.heartbeat.finish()
        if self.comms is not None:
            self.comms.close()
        if self.worker_id is not None:
            try:
                reply = self.client.leave(self.worker_id, self._progress(), error, reason,
                                          done=done and not error)
                if reply.restart:
                    self.restart.order(reply.restart_reason)
            except CoordinatorCallError as err:
                logger.warning("could not leave cleanly: %s", err)
        self.client.close()
        self.metrics.close()

    # ------------------------------------------------------------------ what the run says
    @property
    def stop_requested(self) -> threading.Event:
        """Raised by the heartbeat once the coordinator stopped the run."""
        assert self.heartbeat is not None
        return self.heartbeat.stop_requested

    @property
    def restart(self) -> Restart:
        """The coordinator's restart order (a restart round of a lock-step run), if any."""
        return PROCESS_RESTART

    @property
    def fatal_error(self) -> str:
        """Why the coordinator is lost to this worker (lease gone, unreachable), if it is."""
        return self.heartbeat.fatal_error if self.heartbeat is not None else ""

    def global_iterations(self, own_iterations: int) -> float:
        """Iterations of an average worker of the run now: the coordinator's figure at the
        last heartbeat plus this worker's own iterations since."""
        if self.heartbeat is None:
            return float(own_iterations)
        mean, own_then = self.heartbeat.global_progress
        return mean + (own_iterations - own_then) if own_then else float(own_iterations)
