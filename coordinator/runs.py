"""The coordinator as a service: submitted runs, one active at a time, history, agents.

`RunsService` is the gRPC servicer of a coordinator process. It keeps every run in the
history (coordinator/history.py): runs submitted with `ripples submit` queue, the oldest
becomes the active run when none is, and every worker RPC (Register, Heartbeat, the group
stream, ...) goes to the active run's `CoordinatorService`, unchanged from the one-run
coordinator. When the active run has stopped and its workers have left, its final
status goes into the history and the next queued run becomes active.

What makes runs safe to run one after another on the same workers' hosts:
- worker ids are unique across runs (the history counts them), so a straggler of an
  ended run is refused and never taken for a worker of the next one;
- every run's keys in the shared rendezvous store live under `run/<run id>/`;
- a worker started for one run (RIPPLES_RUN_ID, set by its agent) is refused by another.

Host agents (`ripples worker run --agent`, worker/agent.py) long-poll AgentPoll: each
reports its host, its slots and its processes, and is told which run to work for and
how many of that run's workers to start. Slots are handed out first come, up to the
run's num_workers; an agent that stops polling (3 poll timeouts) loses its share, which
the next agent with free slots takes up. Agents send their processes' output (PushLogs),
kept per run and worker in the state dir, for `ripples logs` (GetLogs).

One active run at a time is the design (a worker pool serves one run, as a training
cluster's queue does); docs/service.md says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from ripples import events
from ripples.coordinator import snapshot
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore
from ripples.coordinator.history import ENDED, RunHistory, state_name
from ripples.coordinator.http import SdTargets
from ripples.coordinator.service import CoordinatorService
from ripples.coordinator.state_store import StateStore
from ripples.guarded import guarded_loop
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

WATCH_SECONDS = 0.25
"""How often the service checks whether the active run ended."""
FINISH_GRACE_SECONDS = 60.0
"""After the active run stopped, how long its workers have to leave (the final average,
their last reports) before it is closed anyway; the lease reaper marks dead ones sooner."""
AGENT_POLL_SECONDS = 10.0
"""An agent's long-poll bound (the reply comes earlier when its work changes)."""
AGENT_EXPIRY_POLLS = 6
"""An agent not heard from for this many poll bounds is gone: its share is handed out
(an agent ending a run's processes is silent for up to 40 s: 10 s to exit, 30 s grace)."""
LOG_FILE_LIMIT = 64 * 1024 * 1024
"""Bytes kept per worker and run; later lines are dropped (one notice says so)."""
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}/[0-9]{1,6}")
"""HOST/LOCAL_RANK: it names a log file, so no path separator or '..' can be in it."""
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


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
    """(run id, processes) this agent was told to run."""
    polling: bool = False
    """Its long-poll waits now: it is there."""

    def info(self, now: float) -> pb.AgentInfo:
        running = sum(p.running for p in self.processes)
        return pb.AgentInfo(agent_id=self.agent_id, host=self.host, slots=self.slots,
                            devices=self.devices, memory_bytes=self.memory_bytes,
                            run_id=self.run_id, processes=running,
                            seen_seconds_ago=0.0 if self.polling else max(0.0, now - self.seen),
                            draining=self.draining)


@dataclass
class ActiveRun:
    info: pb.RunInfo
    service: CoordinatorService
    state: StateStore | None
    stopped_at: float | None = None
    operator_stop: bool = False


def default_name(options: dict[str, Any], command: list[str]) -> str:
    """A run's name when none is given: protocol and task, or the script's name (its
    file's stem, `python -m`'s module, or the command itself)."""
    what = str(options.get("task") or "")
    if command:
        if "-m" in command[:-1]:
            what = command[command.index("-m") + 1].rpartition(".")[2]
        else:
            what = next((Path(a).stem for a in command if a.endswith(".py")),
                        Path(command[0]).name)
    return f"{options.get('protocol', 'run')}-{what or 'script'}"


class RunsService(pb_grpc.CoordinatorServicer):
    """Runs, agents and logs; every worker RPC goes to the active run's service."""

    def __init__(
        self,
        history: RunHistory,
        *,
        state_dir: str,
        store: Any,
        store_host: str,
        store_port: int,
        incarnation: int,
        resume_workers: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.history = history
        self.store = store
        """The rendezvous store (a TCPStore, or None in tests): each run sees its own
        prefix of it."""
        self.store_host = store_host
        self.store_port = store_port
        self.incarnation = incarnation
        self.resume_workers = resume_workers
        self.clock = clock
        self.metrics_address = ""
        self._temp: tempfile.TemporaryDirectory[str] | None = None
        if state_dir:
            self.state_dir = Path(state_dir)
        else:  # runs' state and logs for this process's life only
            self._temp = tempfile.TemporaryDirectory(prefix="ripples-coordinator-")
            self.state_dir = Path(self._temp.name)
        self._persistent = bool(state_dir)
        self.active: ActiveRun | None = None
        self.last_service: CoordinatorService | None = None
        """The active run's service, or the last run's once it ended (tests, `ripples
        run`)."""
        self.agents: dict[int, Agent] = {}
        self._changed = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._log_dropped: set[Path] = set()

    # ------------------------------------------------------------------ life
    async def start(self, run: RunSettings | None) -> None:
        """Resume the run the history holds as active (a coordinator restart), submit
        `run` if the history is empty (the one-run form), start the next queued run."""
        running = self.history.running()
        if running is not None:
            self._open(running, resume=True)
        elif run is not None and not self.history.runs():
            self.submit(run.options(), name="", command=[], workdir="")
        await self._next(announce=False)
        self._watcher = asyncio.get_running_loop().create_task(
            guarded_loop("run-watcher", self._watch, WATCH_SECONDS))

    async def close(self) -> None:
        """Shutting down: end the active run's long-polls (its state stays resumable).
        Calls may still arrive until the gRPC server stopped; then `release`."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.active is not None:
            await self.active.service.close()

    def release(self) -> None:
        """After the gRPC server stopped: close the files, free the store."""
        if self.active is not None and self.active.state is not None:
            self.active.state.close()
        self.history.close()
        if self._temp is not None:
            self._temp.cleanup()
        # Drop every reference to the rendezvous store: it closes, and its port is free.
        self.store = None
        if self.last_service is not None:
            self.last_service.store = None

    def _run_dir(self, run_id: str) -> Path:
        return self.state_dir / "runs" / run_id

    def _signal_change(self) -> None:
        """Wake every agent's long-poll: the active run or a share changed."""
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ submitting
    def submit(self, options: dict[str, Any], *, name: str, command: list[str],
               workdir: str) -> pb.RunInfo:
        """Queue a run; ValueError (nothing stored) when its options are wrong."""
        options = dict(options)
        if not options.get("run_id"):
            options.pop("run_id", None)
        elif not RUN_ID.fullmatch(str(options["run_id"])):  # it names files in the state dir
            raise ValueError(f"run_id {options['run_id']!r}: use 1-64 letters, digits, '.', "
                             "'_' or '-', starting with a letter or digit")
        settings = RunSettings.build(**options)  # validates: ValueError names the option
        if command and settings.task:
            raise ValueError("give --task or a script after --, not both")
        options = settings.options()
        info = pb.RunInfo(
            run_id=settings.run_id, name=name or default_name(options, command),
            state=pb.RUN_STATE_QUEUED, submitted_at=time.time(), protocol=settings.protocol,
            num_workers=settings.num_workers, task=settings.task, command=command,
            workdir=workdir)
        self.history.add(info, options)
        return info

    async def _next(self, *, announce: bool = True) -> None:
        """Make the oldest queued run the active one, if none is (`announce`: log it; not
        at the start, where `serve` prints the run)."""
        if self.active is not None:
            return
        queued = self.history.queued()
        if not queued:
            return
        info = queued[0]
        info.state = pb.RUN_STATE_RUNNING
        info.started_at = time.time()
        try:
            self._open(info, resume=False)
        except (ValueError, OSError) as err:  # its options no longer hold (a file moved)
            info.state, info.ended_at = pb.RUN_STATE_FAILED, time.time()
            info.stop_reason = f"could not start: {err}"
            self.history.update(info)
            logger.error("run %s could not start: %s", info.run_id, err)
            await self._next()
            return
        self.history.update(info)
        if announce:
            logger.info("run %s (%s) is the active run", info.run_id, info.name)

    def _open(self, info: pb.RunInfo, *, resume: bool) -> None:
        """The run's core and service: new, or resumed from its state after a restart."""
        import torch.distributed as dist

        state = StateStore(self._run_dir(info.run_id)) if self._persistent else None
        now = self.clock()
        saved = state.load() if state is not None and resume else None
        if saved is not None:
            core = snapshot.restore(saved, now, self.incarnation, wall=time.time(),
                                    resume=self.resume_workers)
            logger.warning("resumed run %s (incarnation %d): %d live workers, %.0f mean "
                           "iterations", info.run_id, self.incarnation, len(core.live()),
                           core.mean_iterations())
        else:
            settings = RunSettings.build(**self.history.options(info.run_id))
            core = CoordinatorCore(settings, now=now,
                                   first_worker_id=self.history.meta("next_worker_id"))
        store = (dist.PrefixStore(f"run/{info.run_id}/", self.store)
                 if self.store is not None else None)
        service = CoordinatorService(core, store_host=self.store_host,
                                     store_port=self.store_port, state=state,
                                     incarnation=self.incarnation, store=store,
                                     clock=self.clock)
        if saved is not None:
            service.metrics_targets = {int(k): v for k, v in
                                       saved.get("metrics_targets", {}).items()}
            service._note_run_state()
        service.metrics_address = self.metrics_address
        service.start_background()
        self.active = ActiveRun(info, service, state)
        self.last_service = service
        self._signal_change()

    # ------------------------------------------------------------------ ending
    async def _watch(self) -> None:
        """One round: close the active run once it ended; forget silent agents."""
        now = self.clock()
        for agent in list(self.agents.values()):
            if now - agent.seen > AGENT_EXPIRY_POLLS * AGENT_POLL_SECONDS:
                logger.warning("agent %d (host %s) is gone: no poll for %.0f s",
                               agent.agent_id, agent.host, now - agent.seen)
                del self.agents[agent.agent_id]
                self._signal_change()
        active = self.active
        if active is None:
            await self._next()
            return
        core = active.service.core
        if not core.stopped:
            ended = self._processes_all_ended(active.info.run_id)
            if ended and not core.live():
                failed = any(p.exit_code != 0 for a in self.agents.values()
                             if a.run_id == active.info.run_id for p in a.processes)
                await active.service.stop(
                    f"every worker process ended and none is in the run ({ended})"
                    + (f"; `ripples logs {active.info.run_id}` shows why" if failed else ""),
                    failure=failed)
            return
        if active.stopped_at is None:
            active.stopped_at = now
        if core.live() and now - active.stopped_at < FINISH_GRACE_SECONDS:
            return
        await self._finish(active)

    async def _finish(self, active: ActiveRun) -> None:
        service, info = active.service, active.info
        status = service.run_status()
        info.state = _end_state(active, status)
        info.ended_at = time.time()
        info.stop_reason = status.stop_reason
        _fill_progress(info, status)
        status.run.CopyFrom(info)
        await service.save_state()
        await service.close()
        if active.state is not None:
            active.state.close()
        self.history.set_meta("next_worker_id", service.core.registry.next_worker_id)
        self.history.update(info, status)
        self.active = None
        self._signal_change()
        logger.info("run %s (%s) %s: %s", info.run_id, info.name, state_name(info.state),
                    info.stop_reason)
        done = [w.progress.iteration for w in service.core.registry.counted()]
        events.emit(events.RUN_ENDED, run_id=info.run_id, state=state_name(info.state),
                    reason=info.stop_reason, iterations=sum(done),
                    max_worker_iterations=max(done, default=0))
        await self._next()

    def _processes_all_ended(self, run_id: str) -> str:
        """When the agents hold the whole run and every process they started for it has
        ended for good (failed past its restarts, or never joined): how each ended;
        else "" (the run may still form)."""
        shares = [a for a in self.agents.values()
                  if a.share is not None and a.share[0] == run_id]
        if not shares or self.active is None or sum(
                a.share[1] for a in shares if a.share) < self.active.info.num_workers:
            return ""
        ended = []
        for a in shares:
            if a.run_id != run_id or len(a.processes) < (a.share[1] if a.share else 0):
                return ""  # it has not started them all yet
            if any(p.running for p in a.processes):
                return ""
            ended += [f"{a.host}/{p.local_rank} exit code {p.exit_code}" for p in a.processes]
        return ", ".join(ended)

    # ------------------------------------------------------------------ views
    def run_info(self, info: pb.RunInfo) -> pb.RunInfo:
        """The history's row, with the live figures of the active run and queue places."""
        shown = pb.RunInfo()
        shown.CopyFrom(info)
        if self.active is not None and self.active.info.run_id == info.run_id:
            shown.CopyFrom(self.active.info)
            _fill_progress(shown, self.active.service.run_status())
        elif info.state == pb.RUN_STATE_QUEUED:
            ids = [q.run_id for q in self.history.queued()]
            shown.queue_position = ids.index(info.run_id) + 1 if info.run_id in ids else 0
        return shown

    def find(self, run_id: str) -> pb.RunInfo | None:
        return self.history.get(run_id) if run_id else None

    def discovery(self) -> SdTargets:
        if self.active is not None:
            return self.active.service.discovery()
        return ([{"targets": [self.metrics_address], "labels": {"role": "coordinator"}}]
                if self.metrics_address else [])

    def finished(self) -> bool:
        """Every run submitted so far has ended (`--exit-when-done`)."""
        runs = self.history.runs()
        return bool(runs) and all(r.state in ENDED for r in runs)

    # ------------------------------------------------------------------ worker RPCs
    async def _service(self, context: grpc.aio.ServicerContext, *,
                       code: grpc.StatusCode = grpc.StatusCode.NOT_FOUND
                       ) -> CoordinatorService:
        """The active run's service. None active: a worker's call (it names a worker id)
        gets NOT_FOUND, as for a worker unknown to the active run (its run ended: it
        leaves at once); a new worker's, FAILED_PRECONDITION."""
        if self.active is None:
            queued = len(self.history.queued())
            await context.abort(code, (
                f"no run is active ({queued} queued): submit one with `ripples submit`"
                if not queued else "no run is active yet; the next one is being started"))
        assert self.active is not None
        return self.active.service

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
                       ) -> pb.RegisterReply:
        service = await self._service(context, code=grpc.StatusCode.FAILED_PRECONDITION)
        assert self.active is not None
        if request.run_id and request.run_id != self.active.info.run_id:
            known = self.history.get(request.run_id)
            why = (f"it is {state_name(known.state)}" if known is not None
                   else "no such run")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, (
                f"this worker was started for run {request.run_id}, and {why}; the active "
                f"run is {self.active.info.run_id}"))
        return await service.Register(request, context)

    async def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
                        ) -> pb.HeartbeatReply:
        return await (await self._service(context)).Heartbeat(request, context)

    async def Leave(self, request: pb.LeaveRequest, context: grpc.aio.ServicerContext
                    ) -> pb.LeaveReply:
        return await (await self._service(context)).Leave(request, context)

    async def AwaitMembers(self, request: pb.AwaitMembersRequest,
                           context: grpc.aio.ServicerContext) -> pb.Membership:
        return await (await self._service(context)).AwaitMembers(request, context)

    async def AwaitStart(self, request: pb.AwaitStartRequest, context: grpc.aio.ServicerContext
                         ) -> pb.AwaitStartReply:
        return await (await self._service(context)).AwaitStart(request, context)

    async def CheckSchema(self, request: pb.CheckSchemaRequest,
                          context: grpc.aio.ServicerContext) -> pb.CheckSchemaReply:
        return await (await self._service(context)).CheckSchema(request, context)

    async def Synchronize(self, request_iterator: AsyncIterator[pb.SyncMessage],
                          context: grpc.aio.ServicerContext) -> None:
        # The service reads and writes the call itself (its hot loop: service.py).
        await (await self._service(context)).Synchronize(request_iterator, context)

    async def GetStaticSchedule(self, request: pb.StaticScheduleRequest,
                                context: grpc.aio.ServicerContext) -> pb.StaticScheduleReply:
        return await (await self._service(context)).GetStaticSchedule(request, context)

    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext
                         ) -> pb.CheckpointReply:
        return await (await self._service(context)).Checkpoint(request, context)

    async def FinalGroup(self, request: pb.FinalGroupRequest,
                         context: grpc.aio.ServicerContext) -> pb.GroupReply:
        return await (await self._service(context)).FinalGroup(request, context)

    async def Consensus(self, request: pb.ConsensusRequest, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[pb.ConsensusChunk]:
        service = await self._service(context, code=grpc.StatusCode.FAILED_PRECONDITION)
        async for chunk in service.Consensus(request, context):
            yield chunk

    # ------------------------------------------------------------------ runs
    async def GetRunStatus(self, request: pb.RunStatusRequest,
                           context: grpc.aio.ServicerContext) -> pb.RunStatus:
        if request.run_id:
            info = await self._known(request.run_id, context)
        elif self.active is not None:
            info = self.active.info
        else:
            runs = self.history.runs()
            if not runs:
                return pb.RunStatus()
            info = runs[-1]
        if self.active is not None and info.run_id == self.active.info.run_id:
            status = self.active.service.run_status()
            status.run.CopyFrom(self.run_info(info))
            return status
        final = self.history.final_status(info.run_id)
        if final is not None:
            final.run.CopyFrom(info)  # the newest row (the model's path comes later)
            return final
        # Queued (or ended before it started): what was submitted.
        settings = RunSettings.build(**self.history.options(info.run_id))
        return pb.RunStatus(config=settings.to_proto(), run=self.run_info(info),
                            stopped=info.state in ENDED, stop_reason=info.stop_reason)

    async def _known(self, run_id: str, context: grpc.aio.ServicerContext) -> pb.RunInfo:
        info = self.history.get(run_id)
        if info is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, (
                f"no run {run_id!r} (`ripples runs` lists them; a unique prefix of an id, "
                "or a unique name, will do)"))
        assert info is not None
        return info

    async def SubmitRun(self, request: pb.SubmitRunRequest,
                        context: grpc.aio.ServicerContext) -> pb.RunInfo:
        try:
            options = json.loads(request.options_json or "{}")
            if not isinstance(options, dict):
                raise ValueError("options_json must be a JSON object of run options")
            if not request.command and not options.get("task"):
                raise ValueError("give a task (--task) or a script after --: the host "
                                 "agents start the workers")
            info = self.submit(options, name=request.name, command=list(request.command),
                               workdir=request.workdir)
        except (ValueError, TypeError) as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad run: {err}")
            raise AssertionError("unreachable") from err
        logger.info("run %s (%s) submitted: %s, %d workers", info.run_id, info.name,
                    info.protocol, info.num_workers)
        await self._next()
        return self.run_info(self.history.get(info.run_id) or info)

    async def ListRuns(self, request: pb.ListRunsRequest,
                       context: grpc.aio.ServicerContext) -> pb.RunList:
        now = self.clock()
        runs = [self.run_info(i) for i in reversed(self.history.runs())]
        return pb.RunList(runs=runs, agents=[a.info(now) for a in sorted(
            self.agents.values(), key=lambda a: a.host)])

    async def StopRun(self, request: pb.StopRunRequest, context: grpc.aio.ServicerContext
                      ) -> pb.StopRunReply:
        active = self.active
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
            return await active.service.StopRun(request, context)
        info.state, info.ended_at, info.stop_reason = (pb.RUN_STATE_CANCELLED, time.time(),
                                                       reason)
        self.history.update(info)
        logger.info("queued run %s cancelled: %s", info.run_id, reason)
        return pb.StopRunReply()

    # ------------------------------------------------------------------ agents
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
            changed = self._changed
            timeout = min(request.timeout_seconds, AGENT_POLL_SECONDS)
            agent.polling = True
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout)
            finally:
                agent.polling = False
            agent.seen = self.clock()
            reply = self._share(agent)
        return reply

    def _agent(self, request: pb.AgentPollRequest) -> Agent:
        now = self.clock()
        agent = self.agents.get(request.agent_id) if request.agent_id else None
        if agent is not None and agent.host != request.host:
            agent = None  # an id from before a restart, now another host's: a new one
        if agent is None:
            # Ids come from the history, so that one handed out before a coordinator
            # restart is never handed out again to another host.
            known = request.agent_id and request.agent_id not in self.agents
            agent_id = request.agent_id if known else self.history.meta("agent_ids") + 1
            self.history.set_meta("agent_ids", max(agent_id, self.history.meta("agent_ids")))
            agent = Agent(agent_id, request.host, request.slots, list(request.devices),
                          request.memory_bytes, now)
            self.agents[agent_id] = agent
            # An agent already working for the active run (this coordinator restarted)
            # keeps its share.
            if (request.run_id and self.active is not None
                    and request.run_id == self.active.info.run_id and request.processes):
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
        active = self.active
        if active is None or agent.draining:
            agent.share = None
            return reply
        run_id = active.info.run_id
        if not active.info.task and not active.info.command:
            return reply  # its workers run a script started by hand (the one-run form)
        if agent.share is None or agent.share[0] != run_id:
            taken = sum(a.share[1] for a in self.agents.values()
                        if a.share is not None and a.share[0] == run_id and a is not agent)
            count = min(agent.slots, active.info.num_workers - taken)
            agent.share = (run_id, count) if count > 0 else None
            if count > 0:
                logger.info("agent %d (host %s) runs %d workers of run %s", agent.agent_id,
                            agent.host, count, run_id)
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
        active = self.active
        if (active is not None and active.info.run_id == agent.run_id
                and not active.service.core.stopped):
            return
        info = self.history.get(agent.run_id)
        if info is None or info.model_path:
            return
        info.model_path = f"{agent.host}:{path}"
        if self.active is not None and self.active.info.run_id == info.run_id:
            self.active.info.model_path = info.model_path
        self.history.update(info)

    # ------------------------------------------------------------------ logs
    def _log_path(self, run_id: str, worker: str) -> Path:
        return self._run_dir(run_id) / "logs" / (worker.replace("/", "__") + ".log")

    async def PushLogs(self, request: pb.LogBatch, context: grpc.aio.ServicerContext
                       ) -> pb.PushLogsReply:
        if not WORKER_NAME.fullmatch(request.worker):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"worker {request.worker!r}: name it HOST/LOCAL_RANK"))
        known = self.history.get(request.run_id) if request.run_id else None
        if known is None or known.run_id != request.run_id:  # the exact id, no prefix
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no run {request.run_id!r}")
        path = self._log_path(request.run_id, request.worker)
        await asyncio.to_thread(self._append, path, request.lines)
        return pb.PushLogsReply()

    def _append(self, path: Path, lines: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        size = path.stat().st_size if path.exists() else 0
        text = "".join(line.rstrip("\n") + "\n" for line in lines)
        if size + len(text.encode("utf-8", errors="replace")) > LOG_FILE_LIMIT:
            if path not in self._log_dropped:
                self._log_dropped.add(path)
                with path.open("a", encoding="utf-8") as f:
                    f.write(f"[ripples: this worker's log reached {LOG_FILE_LIMIT} bytes; "
                            "later lines are dropped]\n")
            return
        with path.open("a", encoding="utf-8") as f:
            f.write(text)

    async def GetLogs(self, request: pb.GetLogsRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.LogBatch]:
        info = await self._known(request.run_id, context)
        directory = self._run_dir(info.run_id) / "logs"
        if request.worker and not WORKER_NAME.fullmatch(request.worker):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"worker {request.worker!r}: name it HOST/LOCAL_RANK (`ripples status RUN` "
                "lists them)"))
        offsets: dict[Path, int] = {}
        first, last_pass = True, False
        while True:
            files = sorted(directory.glob("*.log")) if directory.is_dir() else []
            if request.worker:
                files = [f for f in files if f.name == request.worker.replace("/", "__")
                         + ".log"]
                if not files and first and not self._is_active(info.run_id):
                    await context.abort(grpc.StatusCode.NOT_FOUND, (
                        f"run {info.run_id} has no output from worker {request.worker}"))
            active = self._is_active(info.run_id)
            if request.follow and not active and not first and not last_pass:
                last_pass = True  # the run just ended: the agents' last batches (0.5 s)
                await asyncio.sleep(2 * 0.5)
            for path in files:
                lines, offsets[path] = await asyncio.to_thread(
                    _read_from, path, offsets.get(path, 0), request.tail if first else 0)
                worker = "/".join(path.name[:-len(".log")].rsplit("__", 1))
                for batch in _batches(lines):
                    yield pb.LogBatch(run_id=info.run_id, worker=worker, lines=batch)
            first = False
            if not request.follow or not active:  # read once more after the run's end
                return
            await asyncio.sleep(0.5)

    def _is_active(self, run_id: str) -> bool:
        return self.active is not None and self.active.info.run_id == run_id


LOG_BATCH_BYTES = 1024 * 1024
"""A GetLogs message holds about this much (the messages' limit is 16 MiB; a log 64)."""


def _batches(lines: list[str]) -> list[list[str]]:
    batches: list[list[str]] = []
    size = LOG_BATCH_BYTES
    for line in lines:
        if size + len(line) >= LOG_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(line)
        size += len(line) + 8
    return batches


def _read_from(path: Path, offset: int, tail: int) -> tuple[list[str], int]:
    """The whole lines of `path` after byte `offset` (the last `tail` of them if > 0), and
    the offset after them."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    lines = data[:end].decode("utf-8", errors="replace").splitlines()
    return (lines[-tail:] if tail else lines), offset + end


def _end_state(active: ActiveRun, status: pb.RunStatus) -> pb.RunState:
    """Stopped (by an operator), failed (it never trained, a failure stopped it, or no
    worker left cleanly) or finished (its budget or target)."""
    if active.operator_stop or active.service.stopped_at_root:
        return pb.RUN_STATE_STOPPED
    clean = any(w.state == pb.WORKER_STATE_LEFT for w in status.workers)
    if not status.started or not clean or active.service.core.stopped_by_failure:
        return pb.RUN_STATE_FAILED
    return pb.RUN_STATE_FINISHED


def _fill_progress(info: pb.RunInfo, status: pb.RunStatus) -> None:
    # Once every worker left there is no live loss: the curve's last point is the run's.
    info.mean_loss = status.mean_loss or (status.loss_curve[-1].loss if status.loss_curve
                                          else 0.0)
    info.elapsed_seconds = status.elapsed_seconds
    if status.workers:
        info.mean_iterations = sum(w.iteration for w in status.workers) / len(status.workers)

