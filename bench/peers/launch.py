"""Launch and measure one peer-system run: N worker processes (plus the peer's own
service: torchft's lighthouse), stopped when the mean training loss reaches the target,
summarised into the summary.json a `ripples run` writes (ripples/cli/local_cluster.py), so
the bench reports both alike.

The clock starts when the last worker is ready (its peer system joined), as a Ripples
run's does when the last worker registers: process start-up and imports are not
training time in either.

With link rates (PeerRunConfig.link_mbit) the run is what `ripples run --link-mbit` makes
of a Ripples run: a shaped cluster (ripples/netshape.py), every worker a host in a network
namespace of its own on a link of its rate, the peer's service in the hub on an unshaped
one, each link measured before the run and kept in the summary's `network`. A loopback
run's `network` is None.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ripples.bench.peers import PEERS
from ripples.bench.peers.backends import start_service
from ripples.bench.peers.config import PeerRunFiles, PeerWorkerConfig
from ripples.bench.peers.progress import (
    Replay,
    StepLogTail,
    StepRecord,
    bytes_per_step,
    fault_times,
    read_step_logs,
    replay,
    sent_bytes,
)
from ripples.bench.peers.workloads import build_workload
from ripples.consensus import average_state_dicts
from ripples.netshape import (
    LinkRate,
    NetworkUnavailable,
    ShapedCluster,
    network_record,
    unavailable_reason,
)

POLL_SECONDS = 0.1
EXIT_GRACE_SECONDS = 60.0
"""After the stop, how long the workers get to save their models and leave."""


@dataclass(frozen=True, kw_only=True)
class PeerFault:
    """The fault scenario: one worker SIGKILLed, with its whole process group (the peer
    system's daemons die with it, as on a lost host), once the workers' mean step reaches
    `at` x the run's step budget (max_steps), and a replacement of the same rank started
    `replace_after_seconds` later. The run then trains to its budget; there is no target."""

    at: float = 0.3
    victim: int = -1
    """The killed rank (negative: from the end; the last rank by default, so that rank
    0, through which hivemind's peers join, survives)."""
    replace_after_seconds: float = 0.0


@dataclass(kw_only=True)
class PeerRunConfig:
    peer: str
    workload: str = "synthetic-cnn"
    script_args: tuple[str, ...] = ()
    num_workers: int = 8
    seed: int = 0
    batch_size: int = 16
    max_epochs: float = 12.0
    max_steps: int = 2000
    target_loss: float = 0.0
    slowdowns: dict[int, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    """Overrides of the peer's tuned defaults."""
    output: Path = Path("runs/peer")
    timeout_seconds: float = 900.0
    fault: PeerFault | None = None
    """Run the fault scenario: max_steps per worker, one worker killed and replaced."""
    link_mbit: tuple[float | None, ...] = ()
    """One link rate per rank (Mbit/s each way, None: unshaped): every worker a host in a
    network namespace of its own on that link, the peer's service (torchft's lighthouse)
    on an unshaped one in the hub (ripples/netshape.py). Empty: loopback."""

    @property
    def victim(self) -> int:
        assert self.fault is not None
        return self.fault.victim % self.num_workers


class PeerRun:
    """The processes of one peer run and what they wrote."""

    def __init__(self, cfg: PeerRunConfig) -> None:
        self.cfg = cfg
        self.files = PeerRunFiles(cfg.output)
        self.processes: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.service: subprocess.Popen[bytes] | None = None
        self._tail = StepLogTail(cfg.output, cfg.num_workers)
        self._live: Replay | None = None
        self._steps: dict[int, int] = {}  # rank -> its latest step (the fault scenario)
        self._victim: subprocess.Popen[bytes] | None = None
        self.network: ShapedCluster | None = None
        self.links: list[LinkRate] = []
        self.killed_at: float | None = None
        """When the fault scenario's victim was killed (time.time())."""
        self.replaced_at: float | None = None

    def worker_config(self, rendezvous: dict[str, str]) -> PeerWorkerConfig:
        cfg = self.cfg
        return PeerWorkerConfig(
            peer=cfg.peer, settings={**PEERS[cfg.peer].defaults, **cfg.settings},
            workload=cfg.workload, script_args=cfg.script_args,
            num_workers=cfg.num_workers, seed=cfg.seed, batch_size=cfg.batch_size,
            max_epochs=cfg.max_epochs, max_steps=cfg.max_steps,
            directory=str(cfg.output), rendezvous=rendezvous, slowdowns=cfg.slowdowns,
            until_stopped=cfg.fault is not None,
            addresses=tuple(h.address for h in self.network.hosts) if self.network else ())

    def spawn(self, rank: int, incarnation: int = 0) -> None:
        log = (self.cfg.output / f"worker{rank}.{incarnation}.log").open("wb")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        argv = [sys.executable, "-m", "ripples.bench.peers.worker", str(self.files.config),
                str(rank), str(incarnation)]
        if self.network is not None:
            # Its host's namespace: `ip netns exec` execs the worker, so the pid (and
            # the session killpg ends) stay the worker's; gloo on the host's link.
            argv = self.network.argv(rank, *argv)
            ifname = self.network.hosts[rank].ifname
            env.update(GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname)
        process = subprocess.Popen(
            argv,
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        self.processes.append((f"rank {rank}" + (f" (replacement {incarnation})"
                                                 if incarnation else ""), process))

    def run(self) -> dict[str, object]:
        cfg = self.cfg
        self._check_network()
        shutil.rmtree(cfg.output, ignore_errors=True)
        cfg.output.mkdir(parents=True)
        try:
            self._start_network()
            settings = {**PEERS[cfg.peer].defaults, **cfg.settings}
            self.service, rendezvous = start_service(cfg.peer, self.files, settings,
                                                     self.network)
            self.files.config.write_text(json.dumps(self.worker_config(rendezvous).to_json()))
            for rank in range(cfg.num_workers):
                self.spawn(rank)
            self._monitor()
        finally:
            try:
                self._stop_everything()
            finally:  # a second Ctrl-C during the grace period leaves no namespace
                self._stop_network()
        return self.summarise()

    def _check_network(self) -> None:
        """Refuse shaped links that cannot be had here before anything is touched (the
        message says why; NetworkUnavailable is a RuntimeError, as a failed run's)."""
        cfg = self.cfg
        if not cfg.link_mbit:
            return
        if len(cfg.link_mbit) != cfg.num_workers:
            raise ValueError(f"{len(cfg.link_mbit)} link rates for {cfg.num_workers} workers")
        reason = unavailable_reason()
        if reason is not None:
            raise NetworkUnavailable(f"{cfg.peer} on shaped links runs every worker in a "
                                     f"network namespace of its own, which cannot be made "
                                     f"here: {reason}")

    def _start_network(self) -> None:
        """With link rates: the shaped cluster (one host per rank), every link measured
        and printed, before the peer's service or any worker starts."""
        cfg = self.cfg
        if not cfg.link_mbit:
            return
        self.network = ShapedCluster(cfg.num_workers, cfg.link_mbit)
        self.links = self.network.measure_all(seconds=1.0)
        for link in self.links:
            print(f"  {cfg.peer} {link.describe()}", file=sys.stderr, flush=True)

    def _stop_network(self) -> None:
        """Delete the shaped cluster (after its processes were killed: a namespace whose
        name is gone lives on while a process is still in it)."""
        if self.network is None:
            return
        problems = self.network.destroy()
        if problems:
            print(f"the shaped network was not all removed: {'; '.join(problems)}",
                  file=sys.stderr, flush=True)

    def _monitor(self) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.timeout_seconds
        while True:
            time.sleep(POLL_SECONDS)
            failed = [(name, p) for name, p in self.processes
                      if p.poll() not in (None, 0) and p is not self._victim]
            if failed:
                name, process = failed[0]
                raise RuntimeError(f"{cfg.peer} worker {name} exited {process.returncode}:\n"
                                   + self._log_tail(name))
            if all(p.poll() is not None for _, p in self.processes):
                return
            if cfg.fault is not None:
                self._drive_fault(cfg.fault)
            elif not self.files.stop.exists() and self._target_reached():
                self.files.stop.touch()
            if time.monotonic() > deadline:
                self.files.stop.touch()
                raise TimeoutError(f"the {cfg.peer} run did not finish in "
                                   f"{cfg.timeout_seconds:.0f} s")

    def _drive_fault(self, fault: PeerFault) -> None:
        """Kill the victim at its moment, start its replacement, stop at the budget."""
        for record in self._tail.new_records():
            if self.killed_at is None or record.rank != self.cfg.victim:
                self._steps[record.rank] = record.iteration
        budget = self.cfg.max_steps
        mean = sum(self._steps.values()) / self.cfg.num_workers
        if self.killed_at is None and mean >= fault.at * budget:
            self._victim = next(p for n, p in self.processes
                                if n == f"rank {self.cfg.victim}")
            os.killpg(self._victim.pid, signal.SIGKILL)
            self.killed_at = time.time()
        elif (self.killed_at is not None and self.replaced_at is None
              and time.time() >= self.killed_at + fault.replace_after_seconds):
            self.replaced_at = time.time()
            self.spawn(self.cfg.victim, incarnation=1)
        survivors = [s for r, s in self._steps.items() if r != self.cfg.victim]
        if (self.killed_at is not None and not self.files.stop.exists()
                and len(survivors) == self.cfg.num_workers - 1
                and sum(survivors) / len(survivors) >= budget):
            self.files.stop.touch()

    def _target_reached(self) -> bool:
        """Whether the mean loss reached the target, from the lines written since the
        last look (summarise() replays them all again, in exact time order)."""
        if self.cfg.target_loss <= 0:
            return False
        if self._live is None:
            start = self.start_time()
            if start is None:
                return False
            self._live = Replay(num_workers=self.cfg.num_workers, start=start,
                                target_loss=self.cfg.target_loss)
        for record in self._tail.new_records():
            self._live.add(record)
        return self._live.progress.time_to_target is not None

    def start_time(self) -> float | None:
        """When the last of the run's workers was ready (None: not all were yet)."""
        ready = {rank: t for (rank, incarnation), t in self.files.ready_times().items()
                 if incarnation == 0}
        return max(ready.values()) if len(ready) == self.cfg.num_workers else None

    def _log_tail(self, name: str) -> str:
        rank, _, rest = name.removeprefix("rank ").partition(" ")
        incarnation = rest.strip("()").removeprefix("replacement ") or "0"
        path = self.cfg.output / f"worker{rank}.{incarnation}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"

    def _stop_everything(self) -> None:
        self.files.stop.touch()
        deadline = time.monotonic() + EXIT_GRACE_SECONDS
        for _, process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        everything = [p for _, p in self.processes]
        if self.service is not None:
            everything.append(self.service)
        for process in everything:
            try:  # the process group: p2pd daemons and other helpers go with their worker
                os.killpg(process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            process.wait()

    def summarise(self) -> dict[str, object]:
        cfg = self.cfg
        start = self.start_time()
        if start is None:
            raise RuntimeError(f"the {cfg.peer} run never started: not every worker was "
                               f"ready (see the worker logs in {cfg.output})")
        records = read_step_logs(cfg.output, cfg.num_workers)
        progress = replay(records, num_workers=cfg.num_workers, start=start,
                          target_loss=cfg.target_loss)
        states = []
        for rank in range(cfg.num_workers):
            path = self.files.model(rank)
            if not path.exists():
                raise RuntimeError(f"{cfg.peer} worker rank {rank} saved no model at {path}")
            states.append(torch.load(path, map_location="cpu", weights_only=True))
        work = build_workload(cfg.workload, list(cfg.script_args), seed=cfg.seed,
                              batch_size=cfg.batch_size, rank=0, num_workers=cfg.num_workers,
                              max_epochs=cfg.max_epochs, max_steps=cfg.max_steps)
        # The distance over the parameters, as a Ripples run's summary measures it (not
        # BatchNorm's running statistics, which are averaged too).
        consensus, distance = average_state_dicts(
            states, {name for name, _ in work.model.named_parameters()})
        torch.save(consensus, cfg.output / "model.pt")
        final_loss, accuracy = (work.evaluate(consensus) if work.evaluate is not None
                                else (None, None))
        wall = progress.elapsed
        samples = progress.total_samples
        epochs = samples / work.train_samples if work.train_samples else None
        workers = [{"rank": r.rank, "iterations": r.iteration,
                    "compute_seconds": r.compute_seconds, "wait_seconds": 0.0,
                    "preduce_seconds": r.sync_seconds,
                    "preduce_bytes": sent_bytes([s for s in records if s.rank == r.rank])}
                   for r in sorted(progress.last.values(), key=lambda r: r.rank)]
        summary: dict[str, object] = {
            "protocol": cfg.peer, "peer_settings": {**PEERS[cfg.peer].defaults,
                                                    **cfg.settings},
            "task": cfg.workload, "num_workers": cfg.num_workers, "wall_seconds": wall,
            "final_loss": final_loss, "final_accuracy": accuracy,
            "final_train_loss": progress.loss_curve[-1][1] if progress.loss_curve else None,
            "target_loss": cfg.target_loss or None,
            "time_to_target_seconds": progress.time_to_target,
            "iterations_to_target": progress.iterations_to_target,
            "epochs_completed": epochs,
            "samples_per_second": samples / wall if wall > 0 and samples else None,
            "seconds_per_epoch": wall / epochs if epochs else None,
            "loss_curve": [[t, loss] for t, loss, _ in progress.loss_curve],
            "loss_curve_iterations": [it for _, _, it in progress.loss_curve],
            # What a worker fed into its collectives per step (progress.bytes_per_step).
            "bytes_per_worker_step": bytes_per_step(records),
            "consensus_distance_final": distance,
            "consensus_distance_mean": None,
            "slowdowns": {str(r): s for r, s in cfg.slowdowns.items()},
            "network": network_record(cfg.link_mbit, self.links),
            "workers": workers,
        }
        if cfg.fault is not None:
            summary["fault"] = self._fault_summary(records, start)
        (cfg.output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


    def _fault_summary(self, records: list[StepRecord], start: float) -> dict[str, object]:
        cfg = self.cfg
        if self.killed_at is None or self.replaced_at is None:
            raise RuntimeError(f"the {cfg.peer} run ended before its fault (mean step "
                               f"{cfg.fault.at if cfg.fault else 0:g} x {cfg.max_steps}) "
                               f"and replacement: see {cfg.output}")
        times = fault_times(records, victim=cfg.victim, killed_at=self.killed_at)
        ready = self.files.ready_times().get((cfg.victim, 1))
        first = times.replacement_first_step_seconds
        return {**asdict(times), "victim": cfg.victim,
                "killed_at_seconds": self.killed_at - start,
                "replacement_started_after_kill_seconds": self.replaced_at - self.killed_at,
                "replacement_ready_after_start_seconds":
                    ready - self.replaced_at if ready is not None else None,
                "replacement_first_step_after_start_seconds":
                    self.killed_at + first - self.replaced_at if first is not None else None}


def run_peer(cfg: PeerRunConfig) -> dict[str, object]:
    """Run one peer configuration to its target (or step cap); its summary."""
    if cfg.peer not in PEERS:
        raise ValueError(f"unknown peer {cfg.peer!r}; choose from {', '.join(PEERS)}")
    return PeerRun(cfg).run()
