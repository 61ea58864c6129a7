"""`ripples run`: a coordinator and N worker processes on loopback, start to summary.

Starts the coordinator in this process and N workers (gloo on loopback): the built-in
runner on a task (`--task digits`), or the user's own script (`ripples run ... -- python
train.py`), each with the launch environment `ripples.init()` reads. Shows progress, names
any worker that fails, and at the end averages the workers' final models into the
consensus model (DIR/model.pt, a state_dict of the model), evaluates it when the task has
evaluation data, and writes DIR/summary.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ripples.cli.local_workers import failed_workers, spawn_workers
from ripples.consensus import average_state_dicts
from ripples.coordinator.config import RunSettings
from ripples.coordinator.history import DB_NAME
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.server import DashboardServer
from ripples.files import write_atomically
from ripples.netshape import (
    HUB_ADDRESS,
    LinkRate,
    NetworkUnavailable,
    ShapedCluster,
    network_record,
)
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorCallError, CoordinatorClient
from ripples.worker.devices import plan_devices
from ripples.worker.launch_env import CheckpointOptions
from ripples.worker.process_launcher import WorkerProcesses
from ripples.worker.slowdown import SlowdownSpec
from ripples.worker.tasks import TaskOptions, build_task, evaluate

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LocalRunConfig:
    run: RunSettings
    slowdowns: dict[int, str] = field(default_factory=dict)  # rank -> FACTOR[@PROBABILITY]
    output: Path = Path("runs/latest")
    threads_per_worker: int = 1
    timeout_seconds: float = 0.0
    """Stop the run and fail after this long; 0: no limit (every wait inside a run has
    its own timeout: collectives, group waits, leases)."""
    progress: bool = True
    worker_log_level: int = logging.WARNING
    dashboard_port: int | None = None  # serve the dashboard on 127.0.0.1:PORT (0: any)
    script: tuple[str, ...] = ()
    """The user's training script (`python train.py ARGS`) run by every worker; empty:
    the built-in runner trains `run.task`."""
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    """The workers' checkpoints (ripples.Checkpointer), handed to them with their launch
    environment. No directory: OUTPUT/checkpoints, so that every run can be resumed."""
    resume: bool = False
    """Go on with the run in `output` after a total failure (ripples run --resume): the
    coordinator's state from OUTPUT/state (its run settings win over `run`), new workers
    that continue each rank from its newest checkpoint."""
    device: str = "cpu"
    """The workers' devices: auto, cpu, cuda or cuda:K (worker/devices.py: one worker per
    GPU, unless `share_gpus`)."""
    share_gpus: bool = False
    """More workers than GPUs: worker i on GPU i mod G, each with its own NCCL_HOSTID."""
    ranks_per_worker: int = 1
    """Processes per worker (`--ranks-per-worker`): G > 1 shards each worker's model over
    its G ranks with FSDP2 (a script's own `fully_shard`; ripples/cli/local_workers.py)."""
    link_mbit: tuple[float | None, ...] = ()
    """One rate per rank (Mbit/s each way; None: unshaped): when given, every worker runs
    in a network namespace of its own, a host on a link of that rate, the coordinator on
    an unshaped one (ripples/netshape.py). Empty: loopback."""


def parse_slowdowns(specs: list[str], num_workers: int) -> dict[int, str]:
    """Parse RANK:FACTOR[@PROBABILITY] items; ValueError saying what to write."""
    result: dict[int, str] = {}
    for spec in specs:
        rank_text, sep, value = spec.partition(":")
        if not sep or not rank_text.strip().isdigit():
            raise ValueError(f"malformed --slowdown {spec!r}: write RANK:FACTOR, e.g. 0:5, or "
                             "RANK:FACTOR@PROBABILITY, e.g. 3:6@0.125")
        rank = int(rank_text)
        if rank >= num_workers:
            raise ValueError(f"--slowdown {spec!r}: rank {rank} does not exist with "
                             f"{num_workers} workers (ranks 0-{num_workers - 1})")
        SlowdownSpec.parse(value)
        result[rank] = value
    return result


INTERRUPTED = "interrupted by the user"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop a local run cleanly (the second one aborts)."""


class LocalCluster:
    """Owns the coordinator thread and the worker processes of one local run."""

    def __init__(self, config: LocalRunConfig) -> None:
        self.config = config
        self.server: CoordinatorServer | None = None
        self.processes = WorkerProcesses()
        self.consensus_curve: list[list[float]] = []
        """[seconds, estimate] of the coordinator's consensus distance, about once a second
        while the run trains (gossip protocols only: others report no estimate)."""
        self.interrupted = threading.Event()  # Ctrl-C seen: stop the run cleanly
        self._stop_sent = False
        self.network: ShapedCluster | None = None
        self.links: list[LinkRate] = []

    def _on_signal(self, signum: int, frame: object) -> None:
        """First Ctrl-C (or SIGTERM, SIGHUP): a flag the monitor loop acts on (an
        exception raised wherever the main thread happens to be, e.g. inside a gRPC call,
        can be swallowed there and the run would go on). Second: abort at once (the
        workers are then terminated)."""
        if self.interrupted.is_set():
            raise KeyboardInterrupt
        self.interrupted.set()
    def run(self) -> dict[str, object]:
        cfg = self.config
        cfg.output.mkdir(parents=True, exist_ok=True)
        self._prepare_resumable_state()
        # No final average: model.pt is the average of the saved models anyway, and the
        # summary reports how far apart they ended (consensus_distance_final).
        run = cfg.run.replace(final_average=False)
        previous_handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                previous_handlers[signum] = signal.signal(signum, self._on_signal)
        try:
            self._start_network()
            self.server = CoordinatorServer(ServerConfig(
                host=HUB_ADDRESS if self.network else "127.0.0.1", port=0, run=run,
                state_dir=str(self._state_dir), resume_workers=cfg.resume,
                netns=self.network.hub if self.network else ""))
            self.server.start()
        except BaseException:
            self._stop_network()
            for signum, previous in previous_handlers.items():
                signal.signal(signum, previous)
            raise
        assert self.server.config.run is not None  # the one-run form: it has a run
        cfg.run = self.server.config.run  # resumed: the saved run's settings
        client = CoordinatorClient(self.server.local_address)
        dashboard = None
        try:
            if cfg.dashboard_port is not None:
                dashboard = DashboardServer(DashboardConfig(
                    coordinator=self.server.local_address, host="127.0.0.1",
                    port=cfg.dashboard_port)).start()
                print(f"dashboard: {dashboard.url}", file=sys.stderr, flush=True)
            if cfg.progress:
                print(f"metrics: http://{self.server.metrics_address}/metrics (Prometheus "
                      "discovery: /sd)", file=sys.stderr, flush=True)
            self._spawn()
            status = self._monitor(client)
        finally:
            for signum, previous in previous_handlers.items():
                signal.signal(signum, previous)
            self._terminate()
            client.close()
            self.server.stop()
            if dashboard is not None:  # after the coordinator: the page shows it went away
                dashboard.stop()
            self._stop_network()
        return self._summarise(status)

    def _start_network(self) -> None:
        """With link rates: the shaped cluster, one host per worker, each link measured
        (printed with the progress; in summary.json's `network`)."""
        cfg = self.config
        if not cfg.link_mbit:
            return
        nodes = cfg.run.num_workers
        if len(cfg.link_mbit) != nodes:
            raise ValueError(f"{len(cfg.link_mbit)} link rates for {nodes} workers")
        try:
            self.network = ShapedCluster(nodes, cfg.link_mbit)
        except NetworkUnavailable as err:
            raise RuntimeError(f"--link-mbit: {err}") from err
        if cfg.progress:
            print(f"network: {nodes} hosts, each in a network namespace on a bridge; "
                  "measuring their links ...", file=sys.stderr, flush=True)
        self.links = self.network.measure_all(seconds=1.0)
        if cfg.progress:
            for link in self.links:
                print(f"  {link.describe()}", file=sys.stderr, flush=True)

    def _stop_network(self) -> None:
        if self.network is None:
            return
        problems = self.network.destroy()
        if problems:
            logger.warning("the shaped network was not all removed: %s", "; ".join(problems))

    @property
    def _state_dir(self) -> Path:
        return self.config.output / "state"

    def _prepare_resumable_state(self) -> None:
        """Every local run keeps the coordinator's state in OUTPUT/state and, unless told
        otherwise, the workers' checkpoints in OUTPUT/checkpoints: `--resume` goes on
        from both. A new run in the same OUTPUT starts afresh: it removes both (the
        checkpoints only where Ripples chose the place), so that no worker of a new run
        ever restores an older run's checkpoint."""
        cfg = self.config
        default_checkpoints = cfg.output / "checkpoints"
        if cfg.resume:
            if not (self._state_dir / DB_NAME).exists():
                raise RuntimeError(f"nothing to resume: {self._state_dir} holds no run (was "
                                   "the run started with this --output?)")
        else:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            if not cfg.checkpoint.checkpoint_dir:
                shutil.rmtree(default_checkpoints, ignore_errors=True)
        if not cfg.checkpoint.checkpoint_dir:
            cfg.checkpoint = dataclasses.replace(cfg.checkpoint,
                                                 checkpoint_dir=str(default_checkpoints))

    def _spawn(self) -> None:
        cfg = self.config
        assert self.server is not None
        try:  # the run's own count: a resumed run's is the saved one
            devices = plan_devices(cfg.run.num_workers * cfg.ranks_per_worker, cfg.device,
                                   share_gpus=cfg.share_gpus,
                                   what="workers" if cfg.ranks_per_worker == 1
                                   else "worker processes")
        except ValueError as err:
            raise RuntimeError(str(err)) from err
        if cfg.progress and devices[0] != "cpu":
            print(f"devices: {', '.join(devices)}", file=sys.stderr, flush=True)
        spawn_workers(self.processes, run=cfg.run, coordinator=self.server.address,
                      devices=devices, output_dir=str(cfg.output), script=cfg.script,
                      threads=cfg.threads_per_worker, slowdowns=cfg.slowdowns,
                      checkpoint=cfg.checkpoint, ranks_per_worker=cfg.ranks_per_worker,
                      quiet=cfg.worker_log_level > logging.INFO, network=self.network)

    def _monitor(self, client: CoordinatorClient) -> pb.RunStatus:
        limit = self.config.timeout_seconds
        deadline = time.monotonic() + limit if limit > 0 else math.inf
        last_print, last_line = 0.0, ""
        status = client.run_status()
        while True:
            time.sleep(0.25)
            if self.interrupted.is_set() and not self._stop_sent:
                print("interrupted: the workers finish their iteration and leave "
                      "(Ctrl-C again to abort)", file=sys.stderr, flush=True)
                client.stop_run(INTERRUPTED)
                self._stop_sent = True
            self.processes.restart_ordered()  # lock-step restart rounds
            alive = self.processes.alive()  # before the failure check: none is missed
            status = client.run_status()
            failed = self._failed_workers(status)
            if failed:
                # The failure may have stopped the run already (a lock-step run that
                # cannot go on): the coordinator then refuses another stop, and the
                # workers' errors are what to report, not that refusal.
                with contextlib.suppress(CoordinatorCallError):
                    client.stop_run("a worker failed")
                raise RuntimeError("; ".join(failed))
            self._sample_consensus(status)
            if not alive:
                return status
            if time.monotonic() > deadline:
                client.stop_run("timeout")
                raise TimeoutError(f"the run did not finish in {self.config.timeout_seconds:.0f} s"
                                   " (raise --timeout-seconds)")
            if self.config.progress and time.monotonic() - last_print >= 1.0:
                line = _progress_line(status)
                if status.started or line != last_line:  # no repeats while waiting
                    print(line, file=sys.stderr, flush=True)
                last_print, last_line = time.monotonic(), line

    def _sample_consensus(self, status: pb.RunStatus) -> None:
        if not status.started or status.consensus_distance < 0:
            return
        if self.consensus_curve and status.elapsed_seconds - self.consensus_curve[-1][0] < 1.0:
            return
        self.consensus_curve.append([status.elapsed_seconds, status.consensus_distance])

    def _failed_workers(self, status: pb.RunStatus) -> list[str]:
        return failed_workers(self.processes, status,
                              workers_per_node=self.config.run.workers_per_node,
                              ranks_per_worker=self.config.ranks_per_worker,
                              will_restart=self.processes.will_restart)  # type: ignore[arg-type]

    def _terminate(self) -> None:
        self.processes.terminate(grace_seconds=10.0)

    def _summarise(self, status: pb.RunStatus) -> dict[str, object]:
        cfg = self.config
        by_host = sorted(status.workers, key=lambda w: w.rank)
        if cfg.resume:  # the workers lost with the run before it resumed: their ranks went on
            by_host = [w for w in by_host if w.state != pb.WORKER_STATE_EXPIRED]
        states = []
        for rank in range(cfg.run.num_workers):
            path = cfg.output / "workers" / f"rank{rank}.pt"
            if not path.exists():
                raise RuntimeError(f"worker rank {rank} saved no model at {path}")
            states.append(torch.load(path, map_location="cpu"))
        # Exact consensus distance of the final models: mean squared distance of the
        # workers' parameters to their average (the model the run returns).
        consensus, consensus_distance = average_state_dicts(
            states, set(self._parameter_names(states[0])))
        write_atomically(cfg.output / "model.pt", lambda f: torch.save(consensus, f))
        # The consensus model's evaluation: a task's, with evaluation data. A script's
        # model is its own: its result is the training loss its workers reported.
        final_loss: float | None = None
        accuracy: float | None = None
        task = None
        if not cfg.script:
            task = build_task(cfg.run.task, TaskOptions(seed=cfg.run.seed, device="cpu"))
            if task.eval_data is not None:
                model = task.build_model()
                model.load_state_dict(consensus)
                final_loss, accuracy = evaluate(task, model)
        # An epoch is one pass of the workers together over the training set.
        total_samples = sum(w.progress.samples for w in status.workers)
        dataset = task.train_data() if task is not None else None
        epochs = (total_samples / len(dataset) if dataset is not None
                  and hasattr(dataset, "__len__") and len(dataset) else None)
        workers = [
            {"rank": w.rank, "worker_id": w.worker_id, "host": w.host,
             "iterations": w.progress.iteration,
             "compute_seconds": w.progress.compute_seconds,
             "wait_seconds": w.progress.wait_seconds,
             "preduce_seconds": w.progress.preduce_seconds,
             "preduce_bytes": w.progress.preduce_bytes,
             "request_count": w.request_count}
            for w in by_host
        ]
        summary: dict[str, object] = {
            "protocol": cfg.run.protocol,
            "task": cfg.run.task if not cfg.script else None,
            "script": list(cfg.script) or None,
            "num_workers": cfg.run.num_workers,
            "wall_seconds": status.elapsed_seconds,
            "stop_reason": status.stop_reason,
            "final_loss": final_loss,
            "final_train_loss": status.loss_curve[-1].loss if status.loss_curve else None,
            "final_accuracy": accuracy,
            "target_loss": cfg.run.target_loss or None,
            "time_to_target_seconds": (status.time_to_target_seconds
                                       if status.time_to_target_seconds >= 0 else None),
            "iterations_to_target": (status.iterations_to_target
                                     if status.iterations_to_target >= 0 else None),
            "epochs_completed": epochs,
            # Training throughput of all workers together, start-up of processes included
            # (the samples the workers reported with their losses).
            "samples_per_second": (total_samples / status.elapsed_seconds
                                   if status.elapsed_seconds > 0 and total_samples else None),
            "seconds_per_epoch": status.elapsed_seconds / epochs if epochs else None,
            "loss_curve": [[p.seconds, p.loss] for p in status.loss_curve],
            "loss_curve_iterations": [p.mean_iterations for p in status.loss_curve],
            # What a worker fed into its synchronisations per optimizer step, on average.
            "bytes_per_worker_step": bytes_per_step(status.workers),
            "num_groups_formed": status.num_groups_formed,
            "num_conflicts": status.num_conflicts,
            "num_pending_waits": status.num_pending_waits,
            "topology": cfg.run.topology,
            # The protocol's own settings, per family (gossip: rate_com, momentum, ...).
            "settings": {cls.proto_field: dataclasses.asdict(cfg.run.settings(cls))
                         for cls in cfg.run.spec.settings},
            "spectral_gap": status.spectral_gap,
            "consensus_distance_final": consensus_distance,
            "consensus_distance_estimate": (status.consensus_distance
                                            if status.consensus_distance >= 0 else None),
            # Mean of the once-a-second samples: the run's time-averaged estimate.
            "consensus_distance_mean": (
                sum(d for _, d in self.consensus_curve) / len(self.consensus_curve)
                if self.consensus_curve else None),
            "consensus_distance_curve": self.consensus_curve,
            "slowdowns": {str(r): s for r, s in cfg.slowdowns.items()},
            "network": network_record(cfg.link_mbit, self.links),
            "workers": workers,
        }
        summary.update(self._protocol_summary(workers))
        write_atomically(cfg.output / "summary.json",
                         (json.dumps(summary, indent=2) + "\n").encode())
        return summary

    def _protocol_records(self) -> dict[int, dict]:
        """Per rank (the coordinator's, as in summary.json's `workers`), what the
        worker's protocol recorded of its run (`ripples worker run --save-record`)."""
        records = {}
        for rank in range(self.config.run.num_workers):
            path = self.config.output / "workers" / f"rank{rank}.json"
            if not path.exists():
                raise RuntimeError(f"worker rank {rank} saved no record at {path}")
            record = json.loads(path.read_text())
            records[record["rank"]] = record[self.config.run.protocol]
        return records

    def _parameter_names(self, state: dict[str, torch.Tensor]) -> list[str]:
        """The entries of a saved state_dict that are parameters (the workers' records
        name them; buffers are averaged too, but the consensus distance is the
        parameters')."""
        record = self.config.output / "workers" / "rank0.json"
        if record.exists():
            names = json.loads(record.read_text()).get("parameter_names")
            if names:
                return [n for n in names if n in state]
        return [k for k, v in state.items() if v.is_floating_point()]

    def _protocol_summary(self, workers: list[dict]) -> dict[str, object]:
        """What the protocol adds to summary.json: its spec's `summarise` hook folds the
        workers' records (hop: counters, and every iteration gap checked against Table
        1's bound); without a hook each worker's record as it is, if it kept one."""
        run = self.config.run
        records = self._protocol_records()
        summariser = run.spec.summarise
        extra: dict[str, object]
        if summariser is None:
            per_worker, extra = {r: rec for r, rec in records.items() if rec}, {}
        else:
            per_worker, extra = summariser(records, run.to_proto())
        for w in workers:
            if w["rank"] in per_worker:
                w[run.spec.record_key or run.protocol] = per_worker[w["rank"]]
        return extra


def bytes_per_step(workers: Iterable[pb.WorkerStatus]) -> float | None:
    """Bytes a worker fed into its synchronisations per optimizer step: all workers'
    bytes over all their steps (None before any step)."""
    rows = list(workers)
    steps = sum(w.progress.iteration for w in rows)
    return sum(w.progress.preduce_bytes for w in rows) / steps if steps else None


def _progress_line(status: pb.RunStatus) -> str:
    if status.restarting:
        return (f"restart round {status.num_restarts} ({status.restarting[:200]}): the "
                "workers restart from the last checkpoint")
    if not status.started:
        registered = len(status.workers)
        return f"waiting for workers: {registered} of {status.config.num_workers} registered"
    iters = " ".join(str(w.iteration) for w in sorted(status.workers, key=lambda w: w.rank))
    loss = f"{status.mean_loss:.4f}" if status.mean_loss else "-"
    return (f"[{status.elapsed_seconds:6.1f}s] loss {loss}  iterations [{iters}]  "
            f"groups {status.num_groups_formed}  conflicts {status.num_conflicts}")


def run_local(config: LocalRunConfig) -> dict[str, object]:
    """Run a whole local cluster; raises RuntimeError/TimeoutError naming what failed."""
    return LocalCluster(config).run()


