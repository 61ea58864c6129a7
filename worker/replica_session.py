"""The session of ranks 1..G-1 of a worker of several ranks: rank 0's, relayed.

Rank 0 holds the worker's membership in the run (worker/session.py: it registers,
heartbeats and leaves); its other ranks never call the coordinator. Each of them learns
from rank 0 who the worker is (its id, the run's settings, the membership, where the
rendezvous store is) and the start's answer, and opens a data plane of its own on the
same store: its communicators are the groups' /s<r> (worker/replica.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import replica_pb2 as rpb
from ripples.worker.launch_env import LaunchEnv
from ripples.worker.replica import Replica
from ripples.worker.session import Session, relay_timeouts, take_process_settings

logger = logging.getLogger(__name__)


class FollowerSession(Session):
    """Rank r > 0 of a worker: what rank 0 relays, and a data plane of its own."""

    def __init__(self, env: LaunchEnv, replica: Replica) -> None:
        if replica.leads:
            raise ValueError("rank 0 of a worker holds a Session of its own")
        super().__init__(env, replica=replica)
        self._never = threading.Event()
        """The coordinator's stop reaches this rank as rank 0's verdict, never here."""

    def join(self) -> None:
        """Wait for rank 0 to register the worker; take what it learned."""
        take_process_settings(self.env, self.device)
        assert self.replica is not None
        start = self.replica.receive("start", rpb.ReplicaStart())
        assert isinstance(start, rpb.ReplicaStart)
        self.worker_id = int(start.worker_id)
        self.config, self.membership = start.config, start.membership
        self._store_address = (start.store_host, int(start.store_port))
        self.replica.timeouts = relay_timeouts(self.config)
        logger.info("rank %d of worker %d (run %s)", self.replica.rank, self.worker_id,
                    self.config.run_id)

    def start(self, schema: pb.TensorSchema | None, planned_iterations: int,
              model_fingerprint: str = "") -> pb.AwaitStartReply:
        """Rank 0's start (it declared the whole worker ready); then this rank's data
        plane."""
        assert self.replica is not None
        self.stats.planned_iterations = planned_iterations
        reply = self.replica.receive("start-reply", pb.AwaitStartReply())
        assert isinstance(reply, pb.AwaitStartReply)
        self._open_data_plane()
        return reply

    def _run_signals(self) -> tuple[threading.Event, Callable[[], str], Callable[[], int]]:
        """No heartbeat here: the stop comes as rank 0's verdict, and the coordinator's
        life with rank 0's relayed replies."""
        replica = self.replica
        assert replica is not None
        return self._never, lambda: "", lambda: replica.incarnation

    def check_schema(self, schema: pb.TensorSchema) -> None:
        """Rank 0 checks the worker's schema."""

    def leave(self, error: str = "", reason: str = "", *, done: bool = False) -> None:
        """Close this rank's data plane; rank 0 leaves the run for the worker."""
        if self._left:
            return
        self._left = True
        if error:
            logger.warning("rank %s of worker %s ends: %s",
                           self.replica.rank if self.replica else "?", self.worker_id, error)
        if self.comms is not None:
            self.comms.close()
        self.client.close()
        self.metrics.close()

    @property
    def stop_requested(self) -> threading.Event:
        return self._never
