"""Host agents: who runs the active run's workers (the ripples.v1.Agents service).

Host agents (`ripples worker run --agent`, worker/agent.py) long-poll AgentPoll: each
reports its host, its slots and its processes, and is told which run to work for and
how many of that run's processes to start. Slots are handed out first come, up to the
run's num_workers; a run of workers of G ranks each (RunInfo.ranks_per_worker) takes G
slots of one agent per worker, whose ranks that agent starts together. An agent that
stops polling (AGENT_EXPIRY_POLLS poll bounds) loses its share, which the next agent
with free slots takes up. When the agents hold the whole run and every process they
started for it has ended for good while no worker is in the run, the run is stopped
(failed if one of them failed). Agents send their processes'
output with PushLogs (coordinator/logs.py keeps it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import grpc

from ripples.coordinator.logs import RunLogs
from ripples.coordinator.run_queue import RunQueue
from ripples.guarded import guarded_loop
from ripples.run_records import ranks_per_worker
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

AGENT_POLL_SECONDS = 10.0
"""An agent's long-poll bound (the reply comes earlier when its work changes)."""
AGENT_EXPIRY_POLLS = 6
"""An agent not heard from for this many poll bounds is gone: its share is handed out
(an agent ending a run's processes is silent for up to 40 s: 10 s to exit, 30 s grace)."""
WATCH_SECONDS = 0.25
"""How often silent agents and ended processes are looked for."""


@dataclass
class Agent:
    """One host agent, as its last poll described it."""

    agent_id: int
    host: str
    slots: int
    devices: list[str]
    memory_bytes: int
    seen: float
    run_id: str = ""
    processes: list[pb.ProcessReport] = field(default_factory=list)
    draining: bool = False
    share: tuple[str, int] | None = None
    """(run id, processes) this agent was told to run (its workers' ranks, all of them)."""
    too_small: str = ""
    """The run whose workers need more slots than this agent has (said once)."""
    polling: bool = False
    """Its long-poll waits now: it is there."""

    def info(self, now: float) -> pb.AgentInfo:
        """The agent as ListRuns shows it."""
        running = sum(p.running for p in self.processes)
        return pb.AgentInfo(agent_id=self.agent_id, host=self.host, slots=self.slots,
                            devices=self.devices, memory_bytes=self.memory_bytes,
                            run_id=self.run_id, processes=running,
                            seen_seconds_ago=0.0 if self.polling else max(0.0, now - self.seen),
                            draining=self.draining)


class AgentsService(pb_grpc.AgentsServicer):
    """The host agents of one coordinator: their polls, shares and log batches."""

    def __init__(self, queue: RunQueue, logs: RunLogs) -> None:
        self.queue = queue
        self.logs = logs
        self.agents: dict[int, Agent] = {}
        self._watcher: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start looking for silent agents and ended processes (on the running loop)."""
        self._watcher = asyncio.get_running_loop().create_task(
            guarded_loop("agent-watcher", self._watch, WATCH_SECONDS))

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    def listed(self) -> list[pb.AgentInfo]:
        """Every agent, by host (ListRuns)."""
        now = self.queue.clock()
        return [a.info(now) for a in sorted(self.agents.values(), key=lambda a: a.host)]

    # ------------------------------------------------------------------ RPCs
    async def AgentPoll(self, request: pb.AgentPollRequest,
                        context: grpc.aio.ServicerContext) -> pb.AgentReply:
        if not request.host or request.slots < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "an agent names its host and has at least one slot")
        agent = self._agent(request)
        self._note_models(agent)
        reply = self._share(agent)
        if reply.run.run_id == agent.run_id and request.timeout_seconds > 0:
            # Nothing new for it: wait for a change.
            changed = self.queue.changed
            timeout = min(request.timeout_seconds, AGENT_POLL_SECONDS)
            agent.polling = True
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout)
            finally:
                agent.polling = False
            agent.seen = self.queue.clock()
            reply = self._share(agent)
        return reply

    async def PushLogs(self, request: pb.LogBatch, context: grpc.aio.ServicerContext
                       ) -> pb.PushLogsReply:
        await self.logs.push(request, context)
        return pb.PushLogsReply()

    # ------------------------------------------------------------------ scheduling
    def _agent(self, request: pb.AgentPollRequest) -> Agent:
        """The polling agent's record, new or updated from its report."""
        history, active = self.queue.history, self.queue.active
        now = self.queue.clock()
        agent = self.agents.get(request.agent_id) if request.agent_id else None
        if agent is not None and agent.host != request.host:
            agent = None  # an id from before a restart, now another host's: a new one
        if agent is None:
            # Ids come from the history, so that one handed out before a coordinator
            # restart is never handed out again to another host.
            known = request.agent_id and request.agent_id not in self.agents
            agent_id = request.agent_id if known else history.meta("agent_ids") + 1
            history.set_meta("agent_ids", max(agent_id, history.meta("agent_ids")))
            agent = Agent(agent_id, request.host, request.slots, list(request.devices),
                          request.memory_bytes, now)
            self.agents[agent_id] = agent
            # An agent already working for the active run (this coordinator restarted)
            # keeps its share.
            if (request.run_id and active is not None
                    and request.run_id == active.info.run_id and request.processes):
                agent.share = (request.run_id, len(request.processes))
            logger.info("agent %d: host %s, %d slots (%s)", agent_id, request.host,
                        request.slots, ", ".join(request.devices) or "cpu")
        agent.seen, agent.slots = now, request.slots
        agent.run_id = request.run_id
        agent.processes = list(request.processes)
        if request.draining and not agent.draining:
            logger.info("agent %d (host %s) drains", agent.agent_id, agent.host)
        agent.draining = request.draining
        return agent

    def _share(self, agent: Agent) -> pb.AgentReply:
        """What this agent runs: its share of the active run, handed out first come up to
        the run's num_workers (a draining agent gets none)."""
        reply = pb.AgentReply(agent_id=agent.agent_id)
        active = self.queue.active
        if active is None or agent.draining:
            agent.share = None
            return reply
        run_id = active.info.run_id
        if not active.info.task and not active.info.command:
            return reply  # its workers run a script started by hand (the one-run form)
        if agent.share is None or agent.share[0] != run_id:
            ranks = ranks_per_worker(active.info)
            taken = sum(a.share[1] for a in self.agents.values()
                        if a.share is not None and a.share[0] == run_id and a is not agent)
            workers = min(agent.slots // ranks, active.info.num_workers - taken // ranks)
            agent.share = (run_id, workers * ranks) if workers > 0 else None
            if workers > 0:
                logger.info("agent %d (host %s) runs %d workers of run %s", agent.agent_id,
                            agent.host, workers, run_id)
            elif agent.slots < ranks and agent.too_small != run_id:
                agent.too_small = run_id
                logger.warning("agent %d (host %s) has %d slots: too few for one worker of "
                               "run %s, %d ranks each", agent.agent_id, agent.host,
                               agent.slots, run_id, ranks)
        if agent.share is None:
            return reply
        reply.run.CopyFrom(active.info)
        reply.num_processes = agent.share[1]
        reply.max_restarts = active.service.core.settings.max_restarts
        return reply

    def _note_models(self, agent: Agent) -> None:
        """Record where the run's model was written: the first process to report one once
        the run stopped (a worker that left earlier, e.g. a drained agent's, wrote a model
        of before the end, not the run's)."""
        path = next((p.model_path for p in agent.processes if p.model_path), "")
        if not path or not agent.run_id:
            return
        active = self.queue.active
        if (active is not None and active.info.run_id == agent.run_id
                and not active.service.core.stopped):
            return
        info = self.queue.history.get(agent.run_id)
        if info is None or info.model_path:
            return
        info.model_path = f"{agent.host}:{path}"
        if active is not None and active.info.run_id == info.run_id:
            active.info.model_path = info.model_path
        self.queue.history.update(info)

    # ------------------------------------------------------------------ watching
    async def _watch(self) -> None:
        """One round: forget silent agents; stop the active run once every process the
        agents started for it ended and none of its workers is in it."""
        now = self.queue.clock()
        for agent in list(self.agents.values()):
            if now - agent.seen > AGENT_EXPIRY_POLLS * AGENT_POLL_SECONDS:
                logger.warning("agent %d (host %s) is gone: no poll for %.0f s",
                               agent.agent_id, agent.host, now - agent.seen)
                del self.agents[agent.agent_id]
                self.queue.signal_change()
        active = self.queue.active
        if active is None or active.service.core.stopped:
            return
        run_id = active.info.run_id
        ended = self._processes_all_ended(
            run_id, active.info.num_workers * ranks_per_worker(active.info))
        if ended and not active.service.core.live():
            failed = any(p.exit_code != 0 for a in self.agents.values()
                         if a.run_id == run_id for p in a.processes)
            await active.service.stop(
                f"every worker process ended and none is in the run ({ended})"
                + (f"; `ripples logs {run_id}` shows why" if failed else ""),
                failure=failed)

    def _processes_all_ended(self, run_id: str, num_processes: int) -> str:
        """When the agents hold the whole run (its `num_processes`) and every process they
        started for it has ended for good (failed past its restarts, or never joined): how
        each ended; else "" (the run may still form)."""
        shares = [a for a in self.agents.values()
                  if a.share is not None and a.share[0] == run_id]
        if not shares or sum(a.share[1] for a in shares if a.share) < num_processes:
            return ""
        ended = []
        for a in shares:
            if a.run_id != run_id or len(a.processes) < (a.share[1] if a.share else 0):
                return ""  # it has not started them all yet
            if any(p.running for p in a.processes):
                return ""
            ended += [f"{a.host}/{p.local_rank}"
                      + (f" (its rank {p.replica_rank})" if p.replica_rank else "")
                      + f" exit code {p.exit_code}" for p in a.processes]
        return ", ".join(ended)
