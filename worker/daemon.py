"""The worker daemon: register, keep the lease, train under a protocol, leave cleanly."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ripples.worker.client import CoordinatorCallError, CoordinatorClient, HeartbeatThread
from ripples.worker.communicators import CommunicatorCache, CommunicatorFactory, connect_store
from ripples.worker.flat_params import FlatParameters
from ripples.worker.loop import ShardSampler, WorkerStats, iterations_per_epoch
from ripples.worker.metrics import WorkerMetrics
from ripples.worker.slowdown import Slowdown, SlowdownSpec
from ripples.worker.strategies import SyncContext, TrainingJob, create_strategy
from ripples.worker.tasks import TaskOptions, build_task

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class WorkerConfig:
    """One worker daemon."""

    coordinator: str
    """Coordinator address, HOST:PORT."""
    task: str = ""
    """Task spec (built-in name or module:function); default: the run's task."""
    device: str = ""
    """torch device, e.g. cpu or cuda:0 (default: cuda:<local rank> if CUDA, else cpu)."""
    host: str = ""
    """Node name this worker reports (default: the host name); workers on one host form a node."""
    local_rank: int = 0
    """Index of this worker on its host."""
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
    """How long to wait for every expected worker to register."""

    def __post_init__(self) -> None:
        if self.local_rank < 0:
            raise ValueError("local rank must not be negative")
        if self.num_threads < 1:
            raise ValueError("num_threads must be at least 1")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port {self.metrics_port} is out of range: give 0-65535, "
                             "or -1 for no metrics endpoint")
        if self.slowdown:
            SlowdownSpec.parse(self.slowdown)  # fail early with the parse message


def _device(config: WorkerConfig) -> torch.device:
    if config.device:
        device = torch.device(config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device} requested but CUDA is not available")
        return device
    if torch.cuda.is_available():
        return torch.device("cuda", config.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def run_worker(config: WorkerConfig, local_stop: threading.Event | None = None) -> int:
    """Run one worker to the end of the run. Returns 0 on success, 1 on error."""
    torch.set_num_threads(config.num_threads)
    local_stop = local_stop or threading.Event()
    device = _device(config)
    client = CoordinatorClient(config.coordinator)
    worker_id: int | None = None
    stats = WorkerStats()
    heartbeat: HeartbeatThread | None = None
    metrics = WorkerMetrics()
    error = ""
    try:
        client.wait_until_reachable(config.connect_timeout_seconds)
        host = config.host or socket.gethostname()
        metrics_port = (metrics.serve(config.metrics_bind, config.metrics_port)
                        if config.metrics_port >= 0 else 0)
        reg = client.register(host, config.local_rank, str(device), os.getpid(),
                              metrics_port=metrics_port, metrics_host=config.metrics_host)
        worker_id, run = reg.worker_id, reg.config
        logger.info("registered as worker %d for run %s (%s)", worker_id, run.run_id, run.protocol)
        heartbeat = HeartbeatThread(client, worker_id, run.heartbeat_interval_seconds,
                                    run.lease_seconds, stats.snapshot)
        heartbeat.start()
        start = client.await_members(worker_id, config.start_timeout_seconds)
        options = TaskOptions(seed=run.seed, device=str(device),
                              learning_rate=run.learning_rate or None,
                              batch_size=run.batch_size or None)
        task = build_task(config.task or run.task, options)
        per_epoch = iterations_per_epoch(len(task.train_inputs), run.num_workers, task.batch_size)
        stats.planned_iterations = run.iterations or int(round(run.epochs * per_epoch))
        client.await_start(worker_id, stats.planned_iterations, config.start_timeout_seconds)
        store = connect_store(reg.store_host, reg.store_port, run.collective_timeout_seconds)
        loopback = reg.store_host in ("127.0.0.1", "localhost")
        factory = CommunicatorFactory(store, device, run.collective_timeout_seconds,
                                      gloo_hostname="127.0.0.1" if loopback else "")
        comms = CommunicatorCache(factory)
        metrics.attach(worker_id=worker_id, host=host, protocol=run.protocol, cache=comms)
        ctx = SyncContext(
            client=client, worker_id=worker_id, rank=start.rank, num_workers=start.num_workers,
            config=run, start=start, model=task.model, params=FlatParameters(task.model),
            comms=comms, store=store, device=device, stop_requested=heartbeat.stop_requested,
            progress=stats.snapshot, optimizer=task.optimizer, metrics=metrics.for_protocol())
        strategy = create_strategy(run.protocol, ctx)
        sampler = ShardSampler(len(task.train_inputs), start.rank, start.num_workers,
                               task.batch_size, run.seed)
        spec = SlowdownSpec.parse(config.slowdown, seed=run.seed * 1000 + start.rank) \
            if config.slowdown else SlowdownSpec()
        job = TrainingJob(task=task, task_spec=config.task or run.task, task_options=options,
                          sampler=sampler, stats=stats, slowdown=Slowdown(spec),
                          slowdown_spec=config.slowdown, device=device, local_stop=local_stop,
                          metrics=metrics, num_threads=config.num_threads)
        try:
            reason = strategy.run_training(job)
        finally:
            strategy.close()
            comms.close()
        if config.save_record:
            _write_json(Path(config.save_record), {
                "worker_id": worker_id, "rank": start.rank, "protocol": run.protocol,
                "iterations": stats.iteration, "stop_reason": reason,
                run.protocol: strategy.record()})
        if heartbeat.fatal_error:
            raise RuntimeError(heartbeat.fatal_error)
        logger.info("worker %d finished after %d iterations: %s", worker_id, stats.iteration,
                    reason)
        if config.save_model:
            Path(config.save_model).parent.mkdir(parents=True, exist_ok=True)
            torch.save(task.model.state_dict(), config.save_model)
    except (CoordinatorCallError, ConnectionError, ValueError, RuntimeError, TimeoutError,
            FloatingPointError, OSError) as err:
        error = f"{type(err).__name__}: {err}"
        logger.error("worker %s failed: %s", worker_id if worker_id is not None else "-", error)
    finally:
        if heartbeat is not None:
            heartbeat.finish()
        if worker_id is not None:
            try:
                client.leave(worker_id, stats.snapshot(), error)
            except CoordinatorCallError as err:
                logger.warning("could not leave cleanly: %s", err)
        client.close()
        metrics.close()
    return 1 if error else 0


def _write_json(path: Path, value: object) -> None:
    """Write whole or not at all (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value) + "\n")
    partial.replace(path)


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


def install_signal_handlers(local_stop: threading.Event) -> None:
    """First SIGINT/SIGTERM: finish the iteration and leave; second: exit at once."""

    def handler(signum: int, _frame: object) -> None:
        if local_stop.is_set():
            raise SystemExit(128 + signum)
        logger.warning("signal %d: finishing the current iteration, then leaving", signum)
        local_stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
