"""The worker's side of the coordinator contract: every call has a deadline."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from ripples.client_security import ClientSecurity, tls_mismatch
from ripples.rpc import (
    CoordinatorCallError,
    coordinator_channel,
    describe_rpc_error,
    tls_refused,
    tls_suspected,
)
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc
from ripples.worker.collective_watch import end_if_stuck, end_process
from ripples.worker.group_stream import GroupStream
from ripples.worker.process_launcher import RESTART_EXIT_CODE

logger = logging.getLogger(__name__)

__all__ = ["CoordinatorCallError", "CoordinatorClient", "GroupStream", "HeartbeatThread"]


TLS_CHECK_AFTER_SECONDS = 2.0
"""A channel not ready after this long is checked for a TLS mismatch (tls_mismatch),
and again after twice as long, ... until the caller's deadline."""


def backoff_pause(attempt: int, rng: random.Random) -> float:
    """Seconds before retry `attempt` (0, 1, ...): exponential from 0.2 s, capped at 2 s,
    with full jitter so that the workers of a run do not reconnect in lock-step."""
    return rng.uniform(0.5, 1.0) * min(2.0, 0.2 * 1.6 ** attempt)


class CoordinatorClient:
    """Blocking client; safe to share between the training and heartbeat threads."""

    def __init__(self, target: str, *, rpc_timeout_seconds: float = 10.0,
                 security: ClientSecurity | None = None) -> None:
        """`security`: TLS and token (default: the environment's, ripples/client_security.py)."""
        self.target = target
        self.rpc_timeout = rpc_timeout_seconds
        self.outage_seconds = 0.0
        """How long calls retry an unreachable coordinator (the run's
        coordinator_outage_seconds, set once registered; 0: no retry)."""
        self.security = security if security is not None else ClientSecurity.from_env()
        self._channel = coordinator_channel(target, self.security)
        self._worker = pb_grpc.WorkerStub(self._channel)  # a worker of the active run
        self._runs = pb_grpc.RunsStub(self._channel)  # runs: submit, status, stop, logs
        self._agents = pb_grpc.AgentsStub(self._channel)  # a host agent's poll and logs
        self._rng = random.Random()

    def wait_until_reachable(self, timeout_seconds: float) -> None:
        """Wait for the channel to connect; a coordinator whose TLS settings differ from
        this client's is named as such after a moment (tls_mismatch) rather than
        waited for in vain."""
        ready = grpc.channel_ready_future(self._channel)
        deadline = time.monotonic() + timeout_seconds
        pause = TLS_CHECK_AFTER_SECONDS
        try:
            while True:
                try:
                    ready.result(timeout=max(0.0, min(pause, deadline - time.monotonic())))
                    return
                except grpc.FutureTimeoutError:
                    mismatch = tls_mismatch(self.target, self.security)
                    if mismatch:
                        raise CoordinatorCallError(mismatch,
                                                   grpc.StatusCode.UNAVAILABLE) from None
                    if time.monotonic() >= deadline:
                        raise CoordinatorCallError(
                            f"coordinator at {self.target} is unreachable after "
                            f"{timeout_seconds:.0f} s; is it running, and is the address "
                            "right?", grpc.StatusCode.UNAVAILABLE) from None
                    pause *= 2  # checked again later: it may be starting now
        finally:
            ready.cancel()

    def _call(self, method: Callable[..., object], request: object, timeout: float, *,
              retry: bool = True) -> object:
        """One call; an unreachable coordinator (UNAVAILABLE: down, or restarting from
        its state dir) is asked again with back-off and jitter for up to
        `outage_seconds`. Every call the coordinator makes is idempotent or harmless
        to repeat (a retried registration is the exception: see register)."""
        failed_since: float | None = None
        attempt = 0
        while True:
            try:
                return method(request, timeout=timeout)
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else None
                suspected = (code == grpc.StatusCode.UNAVAILABLE and attempt == 0
                             and tls_suspected(err.details()))  # type: ignore[attr-defined]
                mismatch = tls_mismatch(self.target, self.security) if suspected else ""
                if mismatch:  # a setting to fix: no retry will pass
                    raise CoordinatorCallError(mismatch, code) from err
                error = CoordinatorCallError(describe_rpc_error(err, self.target), code)
                now = time.monotonic()
                failed_since = now if failed_since is None else failed_since
                if (not retry or code != grpc.StatusCode.UNAVAILABLE
                        or tls_refused(str(error))
                        or now - failed_since + 0.2 > self.outage_seconds):
                    raise error from err
                if attempt == 0:
                    logger.warning("%s; retrying for up to %.0f s", error, self.outage_seconds)
                time.sleep(backoff_pause(attempt, self._rng))
                attempt += 1

    def register(self, host: str, local_rank: int, device: str, pid: int, *,
                 metrics_port: int = 0, metrics_host: str = "",
                 vacancy_timeout_seconds: float = 0.0, run_id: str = "") -> pb.RegisterReply:
        """Register; a replacement for an elastic run that has all its workers now
        (RESOURCE_EXHAUSTED: a dead member's lease has not expired yet; a lock-step run
        until a restart round opens) asks again, with back-off, for up to
        `vacancy_timeout_seconds`, and rides over a coordinator that goes away meanwhile
        (UNAVAILABLE: restarting from its state dir; a chaos trial's replacement died of
        it)."""
        req = pb.RegisterRequest(host=host, local_rank=local_rank, device=device, pid=pid,
                                 metrics_port=metrics_port, metrics_host=metrics_host,
                                 run_id=run_id)
        deadline = time.monotonic() + vacancy_timeout_seconds
        pause = 0.2
        while True:
            try:
                reply = self._call(self._worker.Register, req, self.rpc_timeout)
                break
            except CoordinatorCallError as err:
                waiting = err.code == grpc.StatusCode.RESOURCE_EXHAUSTED or (
                    err.code == grpc.StatusCode.UNAVAILABLE and vacancy_timeout_seconds > 0)
                if not waiting or time.monotonic() + pause > deadline:
                    raise
                logger.info("waiting for a vacancy in the run: %s", err)
                time.sleep(pause)
                pause = min(2.0, pause * 1.5)
        assert isinstance(reply, pb.RegisterReply)
        return reply

    def consensus(self, timeout_seconds: float,
                  on_model: Callable[[int, bytes], None]) -> pb.ConsensusInfo:
        """The live workers' models now (the Consensus RPC), for the caller to average:
        `on_model(worker, bytes)` for each one as it arrives whole (one in memory at a
        time); returns what was collected."""
        req = pb.ConsensusRequest(timeout_seconds=timeout_seconds)
        info = pb.ConsensusInfo()
        worker, expected, data = -1, 0, bytearray()
        received: list[int] = []

        def complete() -> None:
            if worker < 0:
                return
            if len(data) != expected:
                raise CoordinatorCallError(f"worker {worker}'s model arrived cut short "
                                           f"({len(data)} of {expected} bytes)", None)
            received.append(worker)
            on_model(worker, bytes(data))

        try:
            for chunk in self._runs.Consensus(req, timeout=timeout_seconds + 60.0):
                if chunk.HasField("info"):
                    info = chunk.info
                if chunk.HasField("model"):
                    complete()
                    worker, expected, data = chunk.model.worker, chunk.model.size_bytes, bytearray()
                data += chunk.data
            complete()
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            raise CoordinatorCallError(describe_rpc_error(err, self.target), code) from err
        if received != list(info.workers):
            raise CoordinatorCallError(f"the models of workers {list(info.workers)} were "
                                       f"announced, those of {received} arrived", None)
        return info

    def await_members(self, worker_id: int, timeout_seconds: float) -> pb.Membership:
        """Wait until every expected worker registered: ranks and topology."""
        req = pb.AwaitMembersRequest(worker_id=worker_id, timeout_seconds=timeout_seconds)
        reply = self._call(self._worker.AwaitMembers, req, timeout_seconds + self.rpc_timeout)
        assert isinstance(reply, pb.Membership)
        return reply

    def await_start(self, worker_id: int, planned_iterations: int, timeout_seconds: float,
                    schema: pb.TensorSchema | None = None,
                    model_fingerprint: str = "") -> pb.AwaitStartReply:
        """Declare this worker ready (with the schema of its averaged tensors and a digest
        of its initial model) and wait until every member is: training starts."""
        req = pb.AwaitStartRequest(worker_id=worker_id, timeout_seconds=timeout_seconds,
                                   planned_iterations=planned_iterations, schema=schema,
                                   model_fingerprint=model_fingerprint)
        reply = self._call(self._worker.AwaitStart, req, timeout_seconds + self.rpc_timeout)
        assert isinstance(reply, pb.AwaitStartReply)
        return reply

    def check_schema(self, worker_id: int, schema: pb.TensorSchema) -> None:
        """Compare the full schema of averaged tensors with the first worker's."""
        req = pb.CheckSchemaRequest(worker_id=worker_id, schema=schema)
        self._call(self._worker.CheckSchema, req, self.rpc_timeout)

    def heartbeat(self, worker_id: int, progress: pb.Progress) -> pb.HeartbeatReply:
        """One heartbeat, not retried: the heartbeat thread's next beat is the retry."""
        req = pb.HeartbeatRequest(worker_id=worker_id, progress=progress)
        reply = self._call(self._worker.Heartbeat, req, self.rpc_timeout, retry=False)
        assert isinstance(reply, pb.HeartbeatReply)
        return reply

    def leave(self, worker_id: int, progress: pb.Progress, error: str = "",
              reason: str = "", *, done: bool = False) -> pb.LeaveReply:
        """Leave the run: FAILED with `error`, or cleanly for `reason`; `done`: its
        training loop ended (the run ends once every worker is done)."""
        req = pb.LeaveRequest(worker_id=worker_id, progress=progress, error=error,
                              reason=reason, done=done)
        reply = self._call(self._worker.Leave, req, self.rpc_timeout)
        assert isinstance(reply, pb.LeaveReply)
        return reply

    def open_group_stream(self, worker_id: int) -> GroupStream:
        """The worker's Synchronize stream (group requests and releases)."""
        return GroupStream(self._worker, worker_id, self.target,
                           reply_margin_seconds=self.rpc_timeout,
                           outage_seconds=self.outage_seconds)

    def static_schedule(self, worker_id: int) -> pb.StaticScheduleReply:
        req = pb.StaticScheduleRequest(worker_id=worker_id)
        reply = self._call(self._worker.GetStaticSchedule, req, self.rpc_timeout)
        assert isinstance(reply, pb.StaticScheduleReply)
        return reply

    def checkpoint(self, worker_id: int, iteration: int, progress: pb.Progress | None = None,
                   *, optimizer_state_ready: bool = False) -> pb.CheckpointReply:
        req = pb.CheckpointRequest(worker_id=worker_id, iteration=iteration, progress=progress,
                                   optimizer_state_ready=optimizer_state_ready)
        reply = self._call(self._worker.Checkpoint, req, self.rpc_timeout)
        assert isinstance(reply, pb.CheckpointReply)
        return reply

    def run_status(self, run_id: str = "") -> pb.RunStatus:
        """The status of a run (default: the active one, else the newest)."""
        reply = self._call(self._runs.GetRunStatus, pb.RunStatusRequest(run_id=run_id),
                           self.rpc_timeout)
        assert isinstance(reply, pb.RunStatus)
        return reply

    # ------------------------------------------------------------------ the service's runs
    def submit_run(self, options_json: str, *, name: str = "", command: list[str] | None = None,
                   workdir: str = "", ranks_per_worker: int = 1) -> pb.RunInfo:
        req = pb.SubmitRunRequest(options_json=options_json, name=name, command=command or [],
                                  workdir=workdir, ranks_per_worker=ranks_per_worker)
        reply = self._call(self._runs.SubmitRun, req, self.rpc_timeout, retry=False)
        assert isinstance(reply, pb.RunInfo)
        return reply

    def list_runs(self) -> pb.RunList:
        reply = self._call(self._runs.ListRuns, pb.ListRunsRequest(), self.rpc_timeout)
        assert isinstance(reply, pb.RunList)
        return reply

    def agent_poll(self, request: pb.AgentPollRequest) -> pb.AgentReply:
        """An agent's long-poll (the reply may take request.timeout_seconds)."""
        reply = self._call(self._agents.AgentPoll, request,
                           request.timeout_seconds + self.rpc_timeout, retry=False)
        assert isinstance(reply, pb.AgentReply)
        return reply

    def push_logs(self, batch: pb.LogBatch) -> None:
        self._call(self._agents.PushLogs, batch, self.rpc_timeout, retry=False)

    def logs(self, run_id: str, *, worker: str = "", follow: bool = False, tail: int = 0,
             timeout_seconds: float | None = None) -> Iterator[pb.LogBatch]:
        """A run's worker output, batch by batch; with `follow`, until the run ends (or
        `timeout_seconds`)."""
        req = pb.GetLogsRequest(run_id=run_id, worker=worker, follow=follow, tail=tail)
        try:
            yield from self._runs.GetLogs(req, timeout=timeout_seconds)
        except grpc.RpcError as err:
            code = err.code() if isinstance(err, grpc.Call) else None
            raise CoordinatorCallError(describe_rpc_error(err, self.target), code) from err

    def final_group(self, worker_id: int, timeout_seconds: float) -> pb.GroupReply:
        """The final average's group, once every live worker asked (or the timeout)."""
        req = pb.FinalGroupRequest(worker_id=worker_id, timeout_seconds=timeout_seconds)
        reply = self._call(self._worker.FinalGroup, req, timeout_seconds + self.rpc_timeout)
        assert isinstance(reply, pb.GroupReply)
        return reply

    def stop_run(self, reason: str, run_id: str = "") -> None:
        """Stop a run (default: the active one); a queued run is cancelled."""
        self._call(self._runs.StopRun, pb.StopRunRequest(reason=reason, run_id=run_id),
                   self.rpc_timeout)

    def close(self) -> None:
        self._channel.close()


RESTART_GRACE_SECONDS = 2.0
"""After a restart order, the training thread has this long to end the process itself (at
its next step); then the process exits from the heartbeat thread (a training thread held
inside a collective whose peers restarted waits out its timeout otherwise)."""


class Restart:
    """This process's restart order from the coordinator (lock-step runs; one per
    process: PROCESS_RESTART): the process ends and starts again, by `action`
    (exit_for_restart, whose launcher starts it again; `ripples worker run` execs itself
    in place)."""

    def __init__(self) -> None:
        self.ordered = threading.Event()
        self.reason = ""
        self.declined = False
        """The worker was asked to leave (a SIGTERM, request_stop()): it leaves instead."""
        self.action: Callable[[], None] = exit_for_restart
        self.before_exit: list[Callable[[], None]] = []
        """Run (each once, errors logged) before the backstop ends the process: what the
        process must not leave behind (lap/lpp's updater processes)."""

    @property
    def pending(self) -> bool:
        """Ordered, and this process restarts (rather than leave, as it was asked to)."""
        return self.ordered.is_set() and not self.declined

    def order(self, reason: str) -> None:
        """Note the order (once) and arm the backstop that restarts the process if the
        training thread does not end it within RESTART_GRACE_SECONDS (it may be held in
        a collective, or in a wait for the run to start)."""
        if self.ordered.is_set() or self.declined:
            return
        self.reason = reason
        self.ordered.set()
        logger.warning("the run restarts its workers (%s): this process ends (exit code %d) "
                       "and starts again", reason, RESTART_EXIT_CODE)
        timer = threading.Timer(RESTART_GRACE_SECONDS, self._deadline)
        timer.daemon = True
        timer.start()

    def decline(self) -> None:
        """The worker was asked to leave: no restart, even if one was ordered."""
        self.declined = True

    def _deadline(self) -> None:
        if self.pending:
            logger.warning("the training thread did not end within %.0f s of the restart "
                           "order: restarting now", RESTART_GRACE_SECONDS)
            for hook in list(self.before_exit):
                try:
                    hook()
                except Exception:  # noqa: BLE001 (the restart goes on whatever it left)
                    logger.exception("a clean-up before the restart failed")
            self.action()


class RestartRequested(SystemExit):
    """Raised in the training thread at its next step after a restart order: the process
    ends with RESTART_EXIT_CODE (user code that catches Exception does not catch it)."""

    def __init__(self, reason: str) -> None:
        super().__init__(RESTART_EXIT_CODE)
        self.reason = reason

    def __str__(self) -> str:
        return f"restarting: {self.reason}"


def exit_for_restart() -> None:
    """End the process now with RESTART_EXIT_CODE (buffers flushed; no clean-up runs:
    the coordinator ended this worker's part already, and its checkpoints are whole)."""
    end_process(RESTART_EXIT_CODE)


PROCESS_RESTART = Restart()
"""This process's restart order: every session and heartbeat of the process shares it,
so that it outlives a failed start (a restart round that ends a worker waiting in
ripples.init())."""


class HeartbeatThread(threading.Thread):
    """Renews the lease and reports progress; raises the stop flag when told to.

    A coordinator that stays unreachable for longer than a lease and the run's outage
    window, or that no longer knows this worker, sets `fatal_error` and the stop flag: the
    training loop then ends with that error instead of running on unsupervised. Within
    the window training goes on (a coordinator restarted from its state dir answers with
    a new incarnation).
    """

    def __init__(self, client: CoordinatorClient, worker_id: int, interval_seconds: float,
                 lease_seconds: float, progress: Callable[[], pb.Progress], *,
                 outage_seconds: float = 0.0) -> None:
        super().__init__(name=f"heartbeat-{worker_id}", daemon=True)
        self.client = client
        self.worker_id = worker_id
        self.interval = interval_seconds
        self.lease = lease_seconds
        self.progress = progress
        self.stop_requested = threading.Event()
        self.stop_reason = ""
        self.members_lost = False
        """The coordinator stopped this lock-step run because a member was lost: a
        collective the training thread waits in now will not complete (end_if_stuck)."""
        self.fatal_error = ""
        self.restart = PROCESS_RESTART
        self.consensus_id = 0
        """The consensus model the coordinator asks for now (0: none): the training thread
        publishes its model for it at its next step boundary."""
        self.tolerance = max(lease_seconds, outage_seconds)
        self.incarnation = 0
        self.global_progress = (0.0, 0)
        """(iterations of an average worker of the run, this worker's iterations) at the
        last reply: the run's global progress, for learning-rate schedules."""
        self._finish = threading.Event()

    def run(self) -> None:
        last_ok = time.monotonic()
        failing = False
        while not self._finish.wait(self.interval):
            try:
                progress = self.progress()
                reply = self.client.heartbeat(self.worker_id, progress)
                if failing:
                    logger.warning("the coordinator answers again after %.1f s",
                                   time.monotonic() - last_ok)
                    failing = False
                last_ok = time.monotonic()
                self.global_progress = (reply.mean_iterations, progress.iteration)
            except CoordinatorCallError as err:
                silent = time.monotonic() - last_ok
                if err.code == grpc.StatusCode.NOT_FOUND or silent > self.tolerance:
                    self.fatal_error = (str(err) if err.code == grpc.StatusCode.NOT_FOUND else
                                        f"{err} (for {silent:.0f} s, beyond the outage window)")
                    self.stop_requested.set()
                    return
                # One warning per outage, not one per beat (120 lines in a 60 s window).
                log = logger.warning if not failing else logger.debug
                log("heartbeat failed, retrying for up to %.0f s: %s", self.tolerance, err)
                failing = True
                continue
            if reply.incarnation != self.incarnation:
                if self.incarnation:
                    logger.warning("the coordinator restarted (incarnation %d); going on",
                                   reply.incarnation)
                self.incarnation = reply.incarnation
            if reply.restart:
                self.restart.order(reply.restart_reason)
                return
            self.consensus_id = reply.consensus_id
            if reply.stop and not self.stop_requested.is_set():
                self.stop_reason = reply.stop_reason
                self.stop_requested.set()
            self.members_lost = self.members_lost or (reply.stop and reply.members_lost)
            if self.members_lost:
                end_if_stuck(self.stop_reason, self._leave_failed)

    def _leave_failed(self, error: str) -> None:
        """Leave FAILED from this thread (the training thread is held in a collective)."""
        self.client.leave(self.worker_id, self.progress(), error=error)

    def finish(self) -> None:
        self._finish.set()
        if self.is_alive():
            self.join(timeout=self.interval + self.client.rpc_timeout)
