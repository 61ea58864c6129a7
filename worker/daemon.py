"""`ripples worker run`: one worker of a built-in task, or the processes of one host.

- `ripples worker run --task digits` (or the run's task): this process is one worker,
  trained by the built-in runner (worker/runner.py) through the public API.
- `ripples worker run --nproc-per-node K [--task T]`: starts K such workers on this host,
  local ranks 0..K-1 (one per GPU, cuda:i), like torchrun.
- `ripples worker run --nproc-per-node K -- python train.py ARGS`: starts K processes of
  the user's script, with the launch environment `ripples.init()` reads.

In the last two forms this process watches its children, passes SIGINT/SIGTERM on to them
(they finish their step and leave the run), and exits with the first failure's code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ripples import events
from ripples.worker.agent import AgentConfig
from ripples.worker.devices import check_device_choice, nccl_environment, plan_devices
from ripples.worker.launch_env import ENV_RUN_ID, CheckpointOptions, LaunchEnv, default_host
from ripples.worker.process_launcher import (
    RESTART_EXIT_CODE,
    WorkerProcesses,
    free_port,
    launch_environment,
    runner_argv,
    script_argv,
)
from ripples.worker.slowdown import SlowdownSpec

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class WorkerConfig:
    """One host's workers of a run."""

    coordinator: str
    """Coordinator address, HOST:PORT (default: RIPPLES_COORDINATOR)."""
    task: str = ""
    """Task spec (built-in name or module:function); default: the run's task. Not used with
    a script after `--`."""
    nproc_per_node: int = 1
    """Worker processes to start on this host, local ranks 0..K-1 (one per GPU)."""
    ranks_per_worker: int = 1
    """Processes per worker: with a script that shards its model with FSDP2 over
    worker.mesh, the K processes are K/G workers of G ranks each (docs/library.md)."""
    device: str = "auto"
    """torch device: auto, cpu, cuda or cuda:K (auto: cuda:<local rank> with
    GPUs, else cpu). With --nproc-per-node, one worker per GPU (docs/gpu.md)."""
    share_gpus: bool = False
    """With --nproc-per-node (or --agent): allow more workers than GPUs, worker i on GPU
    i mod G, each with its own NCCL_HOSTID (NCCL then talks over sockets; docs/gpu.md)."""
    host: str = ""
    """Node name this worker reports (default: the host name); workers on one host form a node."""
    local_rank: int = 0
    """Index of this worker on its host (with --nproc-per-node: of the first one)."""
    slowdown: str = ""
    """Straggler injection: FACTOR or FACTOR@PROBABILITY (see SlowdownSpec)."""
    save_model: str = ""
    """Write the final model's state_dict here."""
    save_record: str = ""
    """Write this worker's record of the run here (JSON: iterations, stop reason, and what
    the protocol tells, e.g. hop's iterations over time)."""
    num_threads: int = 1
    """torch intra-op threads (several workers usually share a host's cores)."""
    metrics_port: int = 0
    """Port of this worker's Prometheus endpoint (0: any free port; -1: no endpoint). The
    coordinator lists it in its service discovery."""
    metrics_bind: str = "0.0.0.0"
    """Interface the metrics endpoint listens on."""
    metrics_host: str = ""
    """Address Prometheus scrapes this worker at (default: the address the coordinator
    sees it connect from)."""
    connect_timeout_seconds: float = 30.0
    """How long to wait for the coordinator to be reachable."""
    start_timeout_seconds: float = 120.0
    """How long to wait for every expected worker to register, and to be ready."""
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    """--checkpoint-dir, --checkpoint-every, --keep-checkpoints (ripples.Checkpointer)."""
    agent: bool = False
    """Run as this host's long-lived agent: work for the coordinator service's runs one
    after another, --nproc-per-node workers each (one per device), restarting failed ones
    per the run's max_restarts, streaming their output for `ripples logs`; SIGTERM drains
    (docs/service.md)."""
    output_dir: str = "ripples-agent"
    """--agent: each run's checkpoints and final models go to OUTPUT_DIR/<run id>/."""

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError("num_threads must be at least 1")
        if self.nproc_per_node < 1:
            raise ValueError("nproc_per_node must be at least 1")
        if self.ranks_per_worker < 1 or self.nproc_per_node % self.ranks_per_worker:
            raise ValueError(f"--ranks-per-worker {self.ranks_per_worker} does not divide "
                             f"--nproc-per-node {self.nproc_per_node} into workers")
        if self.ranks_per_worker > 1 and self.agent:
            raise ValueError("an agent starts each run's workers with the run's ranks per "
                             "worker: drop --ranks-per-worker here and give it to `ripples "
                             "submit --ranks-per-worker G -- python train.py`")
        if self.slowdown:
            SlowdownSpec.parse(self.slowdown)  # fail early with the parse message
        check_device_choice(self.device)
        self.launch_env()  # the rest is the launch environment's to check

    def host_devices(self) -> list[str]:
        """The device of each of this host's --nproc-per-node workers (local ranks
        local_rank.. on, so that two launches on one host with --local-rank 0 and K take
        different GPUs); ValueError when they would crowd the GPUs unasked."""
        first = self.local_rank
        return plan_devices(first + self.nproc_per_node, self.device,
                            share_gpus=self.share_gpus, what="workers on this host")[first:]

    def launch_env(self) -> LaunchEnv:
        """This (single) worker process's launch environment."""
        env = LaunchEnv(
            coordinator=self.coordinator, launcher="ripples", local_rank=self.local_rank,
            local_world_size=self.nproc_per_node, host=self.host or default_host(),
            device="" if self.device in ("", "auto") else self.device,
            num_threads=self.num_threads, metrics_port=self.metrics_port,
            metrics_bind=self.metrics_bind, metrics_host=self.metrics_host,
            save_model=self.save_model, save_record=self.save_record, slowdown=self.slowdown,
            connect_timeout_seconds=self.connect_timeout_seconds,
            start_timeout_seconds=self.start_timeout_seconds, checkpoint=self.checkpoint,
            run_id=os.environ.get(ENV_RUN_ID, ""))  # a host agent's child: its run
        env.validate()
        return env


def run_worker(config: WorkerConfig) -> int:
    """Run one worker of the built-in runner to the end of the run: 0; 1 on error; 128+N
    when a second signal N aborted it. Any exception, an abort included, marks the worker
    FAILED with its error at the coordinator (never a clean leave)."""
    from ripples.worker.api import init
    from ripples.worker.client import PROCESS_RESTART, RestartRequested
    from ripples.worker.runner import train_task

    worker = None
    error = ""
    code = 0
    PROCESS_RESTART.action = exec_again  # no launcher watches this process: it execs itself
    try:
        worker = init(env=config.launch_env())
        reason = train_task(worker, config.task)
        logger.info("worker %d finished: %s", worker.worker_id, reason)
        events.emit(events.WORKER_FINISHED, worker_id=worker.worker_id, reason=reason)
    except BaseException as err:  # noqa: BLE001 (every failure is reported, none is clean)
        code = 1
        error = f"{type(err).__name__}: {err}"
        if isinstance(err, RestartRequested):
            code, error = RESTART_EXIT_CODE, ""
        elif isinstance(err, SystemExit):  # the signal handler's abort
            code = err.code if isinstance(err.code, int) and err.code else 1
            error = f"aborted by a second signal (exit code {code})"
        elif isinstance(err, KeyboardInterrupt):
            code, error = 130, "aborted (KeyboardInterrupt)"
        worker_id = worker.worker_id if worker is not None else "-"
        if error:
            logger.error("worker %s failed: %s", worker_id, error)
    finally:
        if worker is not None:
            worker.shutdown(error)
        if PROCESS_RESTART.pending:  # a restart round (a failed start included)
            code = RESTART_EXIT_CODE
    return code


def agent_config(config: WorkerConfig) -> AgentConfig:
    """The host agent of `ripples worker run --agent` (ValueError for options it cannot
    take: a run's task or script comes from the coordinator)."""
    if config.task:
        raise ValueError("an agent runs the coordinator's runs: drop --task (give it to "
                         "`ripples submit`)")
    if config.local_rank or config.save_model or config.save_record or config.slowdown:
        raise ValueError("an agent sets each worker's --local-rank, --save-model and "
                         "--save-record itself, and takes no --slowdown")
    env = config.launch_env()
    return AgentConfig(
        coordinator=config.coordinator, host=env.host, slots=config.nproc_per_node,
        output_dir=Path(config.output_dir).absolute(), device=config.device,
        share_gpus=config.share_gpus,
        metrics_port=config.metrics_port, metrics_bind=config.metrics_bind,
        metrics_host=config.metrics_host, num_threads=config.num_threads,
        connect_timeout_seconds=config.connect_timeout_seconds,
        start_timeout_seconds=config.start_timeout_seconds)


def run_host(config: WorkerConfig, script: list[str], quiet: bool) -> int:
    """Start the host's K workers (the built-in runner, or `script`), watch them, pass
    signals on; returns 0 when all succeeded, else the first failure's exit code."""
    env = config.launch_env()
    devices = config.host_devices()
    processes = WorkerProcesses()
    g = config.ranks_per_worker
    workers = config.nproc_per_node // g
    for i in range(config.nproc_per_node):
        worker, shard = divmod(i, g)
        local_rank = config.local_rank + worker
        save_model = _numbered(config.save_model, local_rank, workers)
        save_record = _numbered(config.save_record, local_rank, workers)
        if shard == 0:  # each worker's ranks meet at an address of its own
            meeting = f"127.0.0.1:{free_port()}" if g > 1 else ""
        child = env.replace(local_rank=local_rank, save_model=save_model,
                            save_record=save_record, device=devices[i],
                            ranks_per_worker=g, replica_rank=shard,
                            replica_address=meeting)
        child_env = launch_environment(child, rank=None, world_size=None)
        child_env.update(nccl_environment(devices, i, f"{env.host}-{config.local_rank}",
                                          loopback=False))
        argv = script_argv(script) or runner_argv(child, config.task, quiet=quiet)
        name = f"local rank {local_rank}" + (f" (its rank {shard} of {g})" if g > 1 else "")
        processes.start(name, argv, child_env, unit=worker if g > 1 else None)
    return processes.wait_all()


def _numbered(path: str, local_rank: int, count: int) -> str:
    """One output file per local rank when several workers share the option."""
    if not path or count == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{local_rank}{p.suffix}"))


def exit_now(code: int) -> None:
    """Exit a worker process without interpreter finalization.

    The worker has saved its model and left the run; what remains is a final garbage
    collection over torch's module graph that takes seconds per process on a busy
    machine (measured with py-spy: gc_collect_main at exit), multiplied by N workers,
    and destructors of communicators that a thread may still be blocked in (a hop link
    whose peer never answered our BYE), which abort the process."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exec_again() -> None:
    """A restart round of the run (lock-step protocols): this process becomes a fresh copy
    of itself, with the same pid and command line (a supervisor that watches the pid, such
    as a chaos harness or a container runtime, sees one process throughout); the new image
    registers anew and restores the run's last checkpoint. Every descriptor of the old
    image (communicators, the store, gRPC's) is marked close-on-exec first, so that its
    peers see them end; closing them here instead would pull them from under threads that
    still run (gRPC's poller failed on a closed epoll descriptor, and the exec never came)."""
    logger.info("restarting this worker process for the run's restart round")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2:
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone
                os.set_inheritable(fd, False)
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def install_signal_handlers() -> None:
    """First SIGINT/SIGTERM: finish the step and leave; second (or before the worker has
    joined): exit at once."""
    from ripples.worker.api import current_worker

    received = threading.Event()

    def handler(signum: int, _frame: object) -> None:
        worker = current_worker()
        if received.is_set() or worker is None:
            raise SystemExit(128 + signum)
        received.set()
        logger.warning("signal %d: finishing the current step, then leaving", signum)
        worker.request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
