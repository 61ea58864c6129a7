"""A shard coordinator's watch on its root: `ripples stop` on the root stops every shard.

The root coordinator is the job's: the shard follows the first run it sees running
there (the root's run, started before the shards), and calls it with the client
security of its environment (RIPPLES_TLS_CA, RIPPLES_TOKEN_FILE), as the workers do.

In a sharded job (docs/scale.md) each shard is an ordinary run on a coordinator of its
own, whose settings name the root coordinator (`--root HOST:PORT`); the root's run has
the shards' heads as members. An operator stops the whole job at the root. This watch
polls the root's run and, once an operator stopped it (RUN_STATE_STOPPED), stops the
shard's run with the root's reason. Any other end of the root's run (every head left,
its heads failed) leaves the shard training on: the shard's own budget ends it, and its
head trains on in the shard alone (worker/shard.py).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import grpc

from ripples.rpc import aio_channel, describe_rpc_error
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

ROOT_POLL_SECONDS = 1.0
"""How often a shard coordinator asks the root how its run stands."""
ROOT_CALL_SECONDS = 5.0
"""Deadline of one such call."""

WATCHED_STATES = (pb.RUN_STATE_RUNNING,)
"""The root run a shard follows: the first one it sees running (the root's active run)."""


class RootWatch:
    """Polls the root coordinator (`poll`, from the service's guarded background loop)
    and calls `stop(reason)` once, when an operator stopped the root's run."""

    def __init__(self, root: str, stop: Callable[[str], Awaitable[None]]) -> None:
        self.root = root
        self._stop = stop
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.RunsStub | None = None
        self.run_id = ""
        """The root's run this shard follows (empty until one is seen running)."""
        self.done = False
        self._unreachable = False

    async def poll(self) -> None:
        if self.done:
            return
        if self._stub is None:
            self._channel = aio_channel(self.root)
            self._stub = pb_grpc.RunsStub(self._channel)
        try:
            status = await self._stub.GetRunStatus(pb.RunStatusRequest(run_id=self.run_id),
                                                   timeout=ROOT_CALL_SECONDS)
        except grpc.aio.AioRpcError as err:
            if self.run_id and err.code() == grpc.StatusCode.NOT_FOUND:
                self.done = True
                logger.warning("the root coordinator no longer knows its run %s (restarted "
                               "without its state?); this shard trains on to its own end",
                               self.run_id)
                return
            if not self._unreachable:  # one warning per outage
                logger.warning("the root coordinator does not answer (the shard trains on): "
                               "%s", describe_rpc_error(err, self.root))
            self._unreachable = True
            return
        if self._unreachable:
            logger.info("the root coordinator at %s answers again", self.root)
            self._unreachable = False
        run = status.run
        if not self.run_id:
            if run.run_id and run.state in WATCHED_STATES:
                self.run_id = run.run_id
                logger.info("following the root's run %s (%s) at %s", run.run_id, run.name,
                            self.root)
            return
        if run.state == pb.RUN_STATE_STOPPED:
            self.done = True
            await self._stop(f"the root's run {run.run_id} at {self.root} was stopped: "
                             f"{run.stop_reason or status.stop_reason}")
        elif run.state in (pb.RUN_STATE_FINISHED, pb.RUN_STATE_FAILED):
            self.done = True
            logger.info("the root's run %s ended (%s); this shard trains on to its own end",
                        run.run_id, run.stop_reason or status.stop_reason)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
