"""The ripples.v1.Runs service: runs as objects of the coordinator service.

Operators (`ripples submit / runs / status / stop / logs / checkpoint`), the dashboard and
a shard's coordinator watching its root call it. Runs queue and one is active at a time
(coordinator/run_queue.py); a run is named by its id, a unique prefix of one, or a unique
name. A read-only token may call GetRunStatus, ListRuns, GetLogs and Consensus
(ripples/server_security.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from ripples.coordinator.agents import AgentsService
from ripples.coordinator.history import ENDED, state_name
from ripples.coordinator.logs import RunLogs
from ripples.coordinator.run_queue import RunQueue
from ripples.coordinator.state_store import StoreWriteError
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

MAX_OPTIONS_CHARS = 16 * 1024 * 1024
"""SubmitRun's options_json at most: the largest edge list (MAX_TOPOLOGY_EDGES pairs)
fits; every other option takes a few hundred bytes. Parsed in a worker thread."""
MAX_REFUSAL_CHARS = 1000
"""A refusal's message at most: it may quote what was sent."""


def parse_options(text: str) -> dict[str, Any]:
    """SubmitRun's options_json as a JSON object; ValueError saying what is wrong, before
    anything is parsed when it is too long, while parsing when it nests too deep or holds
    NaN or Infinity (no JSON; RunSettings then checks every value)."""
    if len(text) > MAX_OPTIONS_CHARS:
        raise ValueError(f"options_json holds {len(text)} characters, at most "
                         f"{MAX_OPTIONS_CHARS}: give a flat JSON object of run options")
    try:
        options = json.loads(text or "{}", parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("options_json nests too deep: give a flat JSON object of run "
                         "options") from None
    if not isinstance(options, dict):
        raise ValueError("options_json must be a JSON object of run options")
    return options


def _no_constant(name: str) -> float:
    raise ValueError(f"options_json holds {name}, which is no JSON number: give finite "
                     "numbers")


class RunsService(pb_grpc.RunsServicer):
    """Submitting, listing, reading and stopping the queue's runs."""

    def __init__(self, queue: RunQueue, agents: AgentsService, logs: RunLogs) -> None:
        self.queue = queue
        self.agents = agents
        self.logs = logs

    async def _known(self, run_id: str, context: grpc.aio.ServicerContext) -> pb.RunInfo:
        """The run `run_id` names (NOT_FOUND when none)."""
        info = self.queue.find(run_id)
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, (
                f"no run {run_id!r} (`ripples runs` lists them; a unique prefix of an id, "
                "or a unique name, will do)"))
        assert info is not None
        return info

    async def SubmitRun(self, request: pb.SubmitRunRequest,
                        context: grpc.aio.ServicerContext) -> pb.RunInfo:
        def check_and_store() -> pb.RunInfo:
            options = parse_options(request.options_json)
            if not request.command and not options.get("task"):
                raise ValueError("give a task (--task) or a script after --: the host "
                                 "agents start the workers")
            return self.queue.submit(options, name=request.name,
                                     command=list(request.command), workdir=request.workdir,
                                     ranks_per_worker=request.ranks_per_worker or 1)

        try:
            # In a worker thread: parsing and checking a large run (its edge list, its
            # topology) takes a second or more, and the loop goes on answering (health
            # checks, heartbeats) meanwhile.
            info = await asyncio.to_thread(check_and_store)
        except StoreWriteError as err:  # nothing stored: the history's write rolled back
            logger.error("run refused: %s", err)
            await context.abort(
                grpc.StatusCode[err.status],
                f"{err.reason}: the run was not stored, so it is refused; the operator must "
                "free or fix the state dir's disk")
            raise AssertionError("unreachable") from err
        except (ValueError, TypeError) as err:
            message = f"bad run: {err}"
            if len(message) > MAX_REFUSAL_CHARS:
                message = message[:MAX_REFUSAL_CHARS] + " [...]"
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            raise AssertionError("unreachable") from err
        logger.info("run %s (%s) submitted: %s, %d workers", info.run_id, info.name,
                    info.protocol, info.num_workers)
        try:
            await self.queue.activate_next(announce=True)
        except OSError as err:  # stored and queued: the watcher starts it later
            logger.error("run %s is queued; the next run could not start: %s",
                         info.run_id, err)
        return self.queue.run_info(self.queue.history.get(info.run_id) or info)

    async def ListRuns(self, request: pb.ListRunsRequest,
                       context: grpc.aio.ServicerContext) -> pb.RunList:
        runs = [self.queue.run_info(i) for i in reversed(self.queue.history.runs())]
        return pb.RunList(runs=runs, agents=self.agents.listed())

    async def GetRunStatus(self, request: pb.RunStatusRequest,
                           context: grpc.aio.ServicerContext) -> pb.RunStatus:
        if request.run_id:
            info = await self._known(request.run_id, context)
        elif self.queue.active is not None:
            info = self.queue.active.info
        else:
            runs = self.queue.history.runs()
            if not runs:
                return pb.RunStatus()
            info = runs[-1]
        return await self.queue.status(info, all_workers=request.all_workers)

    async def StopRun(self, request: pb.StopRunRequest, context: grpc.aio.ServicerContext
                      ) -> pb.StopRunReply:
        active = self.queue.active
        if not request.run_id:
            if active is None:  # nothing runs: stopping it is done already (idempotent)
                return pb.StopRunReply()
            info = active.info
        else:
            info = await self._known(request.run_id, context)
        if info.state in ENDED:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, (
                f"run {info.run_id} has ended already ({state_name(info.state)}: "
                f"{info.stop_reason})"))
        reason = request.reason or "stopped by request"
        if active is not None and info.run_id == active.info.run_id:
            if active.service.core.stopped:  # its end stays its own (budget, failure)
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, (
                    f"run {info.run_id} is stopping already: "
                    f"{active.service.core.stop_reason}"))
            active.operator_stop = True
            await active.service.stop(reason)
            return pb.StopRunReply()
        self.queue.cancel(info, reason)
        return pb.StopRunReply()

    async def GetLogs(self, request: pb.GetLogsRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.LogBatch]:
        info = await self._known(request.run_id, context)
        async for batch in self.logs.read(info, request, context):
            yield batch

    async def Consensus(self, request: pb.ConsensusRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.ConsensusChunk]:
        """The active run's consensus model (coordinator/consensus_collector.py)."""
        active = self.queue.active
        if active is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                self.queue.inactive_reason())
        assert active is not None
        async for chunk in active.service.consensus.collect(request, context):
            yield chunk
