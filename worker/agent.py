"""`ripples worker run --agent`: the long-lived daemon of one host.

The agent registers its host with the coordinator service (name, slots, devices, memory)
and long-polls it (AgentPoll) for the run to work for. For each run it is given a share
of, it starts that many worker processes (local ranks 0..n-1, one per device): the
built-in runner for a task run, the run's script otherwise, in the launch environment
`ripples.init()` reads plus RIPPLES_RUN_ID, so that no process of one run can join
another. A run of workers of G ranks (`ripples submit --ranks-per-worker G`) takes G
processes, on G consecutive devices, per worker: its ranks meet at an address of their
own on this host (worker/replica.py). It watches them: a restart round's exit (75)
starts a process again at once, as `ripples worker run --nproc-per-node` does; a
failure starts it again up to the run's max_restarts (a worker of several ranks is
started again whole, once all its ranks have ended). Their output (stdout and stderr)
goes to this process's stderr, prefixed with the process's name, and to the coordinator
(PushLogs) for `ripples logs`, one log per worker (the lines of its ranks 1..G-1 marked
with the rank). When the run ends (or the coordinator names another), the agent stops
what is left of it and waits for the next.

SIGTERM (or SIGINT) drains: the run's workers get SIGTERM and leave the run gracefully
(a lock-step run shrinks, an elastic one goes on without them); the agent tells the
coordinator it drains, so that it is given nothing new, and exits once they are gone
(after TERMINATE_GRACE_SECONDS they are killed). A second signal kills them at once.

Each run's files on this host live in OUTPUT_DIR/<run id>/: the workers' checkpoints and
their final models (model-HOST-LOCAL_RANK.pt; the first one written is reported to the
coordinator as the run's model).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import grpc

from ripples.run_records import ranks_per_worker
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorCallError, CoordinatorClient, backoff_pause
from ripples.worker.devices import nccl_environment, plan_devices
from ripples.worker.launch_env import CheckpointOptions, LaunchEnv
from ripples.worker.process_launcher import (
    POLL_SECONDS,
    WorkerProcesses,
    free_port,
    launch_environment,
    runner_argv,
    script_argv,
)

logger = logging.getLogger(__name__)

POLL_TIMEOUT_SECONDS = 10.0
"""The long-poll bound the agent asks for (the coordinator answers at once on a change)."""
LOG_FLUSH_SECONDS = 0.5
LOG_BUFFER_LINES = 20_000
"""Lines kept while the coordinator cannot take them; older ones are dropped (counted)."""
_RNG = random.Random()
EXIT_WAIT_SECONDS = 10.0
"""When a run ends, how long its processes have to exit by themselves before SIGTERM."""


@dataclass(kw_only=True)
class AgentConfig:
    """One host agent."""

    coordinator: str
    host: str
    slots: int
    output_dir: Path
    device: str = ""
    """The workers' devices: auto (default: one GPU each when there are GPUs, else cpu),
    cpu, cuda or cuda:K (worker/devices.py)."""
    share_gpus: bool = False
    """More slots than GPUs: slot i on GPU i mod G, each with its own NCCL_HOSTID."""
    metrics_port: int = 0
    """Local rank i's Prometheus port is this plus i (0: any free port; -1: none)."""
    metrics_bind: str = "0.0.0.0"
    metrics_host: str = ""
    num_threads: int = 1
    connect_timeout_seconds: float = 30.0
    start_timeout_seconds: float = 120.0

    def devices(self) -> list[str]:
        """Each slot's device; ValueError when the slots would crowd the GPUs unasked."""
        return plan_devices(self.slots, self.device, share_gpus=self.share_gpus,
                            what="slots")


def host_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


class LogShipper:
    """Collects the workers' output lines and sends them to the coordinator in batches,
    from a thread of its own; while the coordinator is unreachable they wait (bounded)."""

    def __init__(self, client: CoordinatorClient) -> None:
        self._client = client
        self._lines: deque[tuple[str, str, str]] = deque()
        self._dropped = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)
        self._thread.start()

    def add(self, run_id: str, worker: str, line: str) -> None:
        with self._lock:
            self._lines.append((run_id, worker, line))
            self._bound()

    def _bound(self) -> None:
        while len(self._lines) > LOG_BUFFER_LINES:
            self._lines.popleft()
            self._dropped += 1

    def pump(self, run_id: str, name: str, pipe: IO[bytes]) -> None:
        """Read one child's output to its end (on a thread of its own). `name`: HOST/W,
        or HOST/W rank R for rank R > 0 of a worker of several ranks, whose lines go to
        HOST/W's log, each marked [rank R]."""
        worker, _, rank = name.partition(" ")
        mark = f"[{rank}] " if rank else ""

        def read() -> None:
            prefix = f"[{name}] "
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                sys.stderr.write(prefix + line + "\n")
                self.add(run_id, worker, mark + line)
            pipe.close()

        threading.Thread(target=read, name=f"output {name}", daemon=True).start()

    def _run(self) -> None:
        attempt = 0
        while not self._stop.wait(LOG_FLUSH_SECONDS):
            if self.flush():
                attempt = 0
            else:
                self._stop.wait(backoff_pause(attempt, _RNG))
                attempt += 1

    def flush(self) -> bool:
        """Send what is buffered; False if the coordinator is unreachable (kept for the
        next try). Lines it refuses (their run is unknown to it) are dropped."""
        with self._lock:
            lines, self._lines = list(self._lines), deque()
            dropped, self._dropped = self._dropped, 0
        batches: dict[tuple[str, str], list[str]] = {}
        for run_id, worker, line in lines:
            batches.setdefault((run_id, worker), []).append(line)
        if dropped and batches:
            next(iter(batches.values())).insert(0, f"[ripples agent: {dropped} lines "
                                                   "dropped while the coordinator was away]")
        pending = list(batches.items())
        while pending:
            (run_id, worker), chunk = pending[0]
            try:
                self._client.push_logs(pb.LogBatch(run_id=run_id, worker=worker, lines=chunk))
            except CoordinatorCallError as err:
                if err.code not in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED):
                    logger.warning("the coordinator refused %s's output: %s", worker, err)
                    pending.pop(0)
                    continue
                with self._lock:
                    self._lines.extendleft(reversed([(r, w, line) for (r, w), c in pending
                                                     for line in c]))
                    self._bound()
                return False
            pending.pop(0)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.flush()


class HostAgent:
    """The daemon: the run it works for and that run's processes. A poll thread follows
    the coordinator (starts and stops runs); the main thread restarts ended processes
    and takes signals. `_lock` guards the current run and its processes."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.client = CoordinatorClient(config.coordinator)
        self.devices = config.devices()
        self.agent_id = 0
        self.run: pb.RunInfo | None = None
        self.processes: WorkerProcesses | None = None
        self.model_paths: dict[str, str] = {}  # process name -> its model file
        self.logs = LogShipper(self.client)
        self.draining = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the loop
    def serve(self) -> int:
        """Work for the coordinator's runs until a signal; 0 after a clean drain."""
        cfg = self.config
        try:
            self.client.wait_until_reachable(cfg.connect_timeout_seconds)
        except CoordinatorCallError as err:
            logger.error("%s", err)
            return 1
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM,
                                                                   signal.SIGINT)}
        print(f"ripples agent on {cfg.host}: {cfg.slots} slots ({', '.join(self.devices)}), "
              f"coordinator {cfg.coordinator}", file=sys.stderr, flush=True)
        poller = threading.Thread(target=self._poll_loop, name="agent-poll", daemon=True)
        poller.start()
        try:
            while not self.draining:
                with self._lock:
                    if self.processes is not None:
                        self.processes.restart_ordered()
                time.sleep(POLL_SECONDS)
            with self._lock:
                self._stop_run("the agent drains")
            try:
                self._report(timeout=0.0)  # drained: its share is free now
            except CoordinatorCallError as err:
                logger.warning("could not tell the coordinator this agent drained: %s", err)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.logs.close()
            self.client.close()
        print(f"ripples agent on {cfg.host}: drained, exiting", file=sys.stderr, flush=True)
        return 0

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.draining = True
        processes = self.processes
        if processes is not None:
            processes.pass_signal(signum)  # first: leave gracefully; second: kill

    def _poll_loop(self) -> None:
        attempt = 0
        while not self.draining:
            try:
                reply = self._report(timeout=POLL_TIMEOUT_SECONDS)
            except CoordinatorCallError as err:
                if self.draining:  # the poll in flight when the drain closed the channel
                    return
                if attempt == 0:
                    logger.warning("cannot reach the coordinator: %s; retrying (the workers "
                                   "go on meanwhile)", err)
                time.sleep(backoff_pause(attempt, _RNG))
                attempt += 1
                continue
            if attempt:
                logger.warning("the coordinator answers again")
            attempt = 0
            self.agent_id = reply.agent_id
            with self._lock:
                if not self.draining:
                    try:
                        self._follow(reply)
                    except OSError as err:  # e.g. the run's directory cannot be made
                        logger.error("cannot work for run %s: %s", reply.run.run_id, err)
                        time.sleep(backoff_pause(3, _RNG))

    def _report(self, timeout: float) -> pb.AgentReply:
        with self._lock:
            request = self._poll_request(timeout)
        return self.client.agent_poll(request)

    def _poll_request(self, timeout: float) -> pb.AgentPollRequest:
        """This host and its current run's processes, as a poll tells them (the caller
        holds `_lock`)."""
        cfg = self.config
        return pb.AgentPollRequest(
            agent_id=self.agent_id, host=cfg.host, slots=cfg.slots, devices=self.devices,
            memory_bytes=host_memory_bytes(), run_id=self.run.run_id if self.run else "",
            processes=self._process_reports(), timeout_seconds=timeout,
            draining=self.draining)

    def _process_reports(self) -> list[pb.ProcessReport]:
        processes = self.processes
        if processes is None:
            return []
        reports = []
        ranks = ranks_per_worker(self.run) if self.run is not None else 1
        for i, c in enumerate(processes.children):
            code = c.process.poll()
            model = self.model_paths.get(c.name, "")
            worker, rank = divmod(i, ranks)
            reports.append(pb.ProcessReport(
                local_rank=worker, replica_rank=rank,
                running=code is None or processes.will_restart(c),
                exit_code=code or 0, restarts=c.restarts,
                # Written whole or not at all (api.py), by this run (the directory is
                # the run's), at the worker's end: its final model, whatever came after.
                model_path=model if model and Path(model).exists() else ""))
        return reports

    # ------------------------------------------------------------------ runs
    def _follow(self, reply: pb.AgentReply) -> None:
        """Do what the coordinator's reply says: keep the run, switch runs, or stop."""
        wanted = reply.run.run_id if reply.HasField("run") else ""
        current = self.run.run_id if self.run else ""
        if wanted == current:
            return
        if current:
            self._stop_run(f"run {current} is no longer this host's work")
        if wanted:
            self._start_run(reply)

    def _start_run(self, reply: pb.AgentReply) -> None:
        cfg, run = self.config, reply.run
        directory = cfg.output_dir / run.run_id
        directory.mkdir(parents=True, exist_ok=True)
        cwd = run.workdir if run.workdir and Path(run.workdir).is_dir() else None
        if run.workdir and cwd is None:
            logger.warning("run %s's working directory %s does not exist on this host; its "
                           "script runs in %s", run.run_id, run.workdir, os.getcwd())
        processes = WorkerProcesses(
            max_failure_restarts=reply.max_restarts,
            capture=lambda name, pipe: self.logs.pump(run.run_id, name, pipe))
        n, ranks = reply.num_processes, ranks_per_worker(run)
        workers = n // ranks
        print(f"ripples agent on {cfg.host}: run {run.run_id} ({run.name}): starting "
              f"{workers} workers" + (f" of {ranks} ranks each" if ranks > 1 else ""),
              file=sys.stderr, flush=True)
        self.model_paths = {}
        meeting = ""
        for i in range(n):
            local_rank, rank = divmod(i, ranks)
            worker = f"{cfg.host}/{local_rank}" + (f" rank {rank}" if rank else "")
            model = directory / f"model-{cfg.host}-{local_rank}.pt"
            if ranks > 1 and rank == 0:  # each worker's ranks meet at an address of its own
                meeting = f"127.0.0.1:{free_port()}"
            env = LaunchEnv(
                coordinator=cfg.coordinator, launcher="ripples", host=cfg.host,
                local_rank=local_rank, local_world_size=workers, device=self.devices[i],
                num_threads=cfg.num_threads, ranks_per_worker=ranks, replica_rank=rank,
                replica_address=meeting,
                metrics_port=(cfg.metrics_port + i if cfg.metrics_port > 0
                              else cfg.metrics_port),
                metrics_bind=cfg.metrics_bind, metrics_host=cfg.metrics_host,
                save_model=str(model), connect_timeout_seconds=cfg.connect_timeout_seconds,
                start_timeout_seconds=cfg.start_timeout_seconds, run_id=run.run_id,
                checkpoint=CheckpointOptions(checkpoint_dir=str(directory / "checkpoints")))
            # The workers log at INFO whatever the agent's own level: their output is the
            # run's log (`ripples logs`), line by line as it comes (unbuffered).
            argv = script_argv(list(run.command)) or runner_argv(env, "", quiet=False)
            if rank == 0:  # a worker's other ranks write no model
                self.model_paths[worker] = str(model)
            child_env = launch_environment(env, rank=None, world_size=None)
            child_env.update(nccl_environment(self.devices, i, cfg.host, loopback=False))
            child_env["PYTHONUNBUFFERED"] = "1"
            unit = local_rank if ranks > 1 else None
            try:
                processes.start(worker, argv, child_env, cwd=cwd, unit=unit)
            except OSError as err:  # not on this host (a script's path, torchrun, ...)
                # A stand-in that says why and fails as the process would have (127, as a
                # shell's "command not found"): the run's failure accounting sees it.
                why = f"cannot start {argv[0]!r} on {cfg.host}: {err}"
                processes.start(worker, [sys.executable, "-c",
                                         f"import sys; print({why!r}); sys.exit(127)"],
                                child_env, unit=unit)
        self.run, self.processes = run, processes

    def _stop_run(self, why: str) -> None:
        """End what is left of the current run's processes (SIGTERM, then SIGKILL after
        the grace time), after one last report of them: the coordinator learns where
        their models were written."""
        processes, run = self.processes, self.run
        if processes is None or run is None:
            return
        deadline = time.monotonic() + EXIT_WAIT_SECONDS
        while processes.alive() and time.monotonic() < deadline and not processes.signalled:
            time.sleep(POLL_SECONDS)  # workers that left the run end by themselves
        if processes.alive():
            logger.warning("%s: stopping its workers", why)
            processes.terminate()
        try:
            self.client.agent_poll(self._poll_request(timeout=0.0))
        except CoordinatorCallError as err:
            logger.warning("could not report run %s's processes: %s", run.run_id, err)
        for line in processes.failures():
            logger.warning("run %s: %s", run.run_id, line)
        self.run, self.processes = None, None


def run_agent(config: AgentConfig) -> int:
    """`ripples worker run --agent`: serve until drained."""
    return HostAgent(config).serve()
