"""`ripples chaos`: seeded chaos trials of an elastic run with real processes and signals.

One trial starts a coordinator (`ripples coordinator serve --exit-when-done`) and N
`ripples worker run` processes of a ripples-smart digits run on loopback, each saving its
final model; then, at random moments of the run (fractions of its iteration budget drawn
from `random.Random(seed)`), it injects faults, each followed by a replacement worker
after a random short delay, and waits for every process to exit before a hard deadline
(a process still running then is killed: a HANG). It checks that the run completed its
iteration budget, that every process exited as its fate says (0 unless SIGKILLed), that
replacements healed from a live peer, that one final model per rank was saved, all
finite, and that their average reaches the accuracy floor on the digits test split.

Fault kinds are a table (`FAULT_KINDS`): a kind is a function that injects the fault
into a running trial (picking its victim, signalling it, scheduling what follows). Add a
kind there (a worker restarted from its checkpoint, a coordinator restart) and select it
with `--faults`.

This module is orchestration only: it imports no torch until it evaluates the models.
"""

from __future__ import annotations

import functools
import math
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ripples.v1 import coordinator_pb2 as pb
    from ripples.worker.client import CoordinatorClient

LISTENING = re.compile(r"ripples coordinator listening on (\S+) ")
FINISHED = re.compile(r"worker \d+ finished: (.*)$")
REGISTERED = re.compile(r"registered as worker \d+")
"""A worker's line once the coordinator took it in."""
HEALED = re.compile(r"healed from worker (\d+) in ([\d.]+) s \(([\d.]+) s after asking\)")
RESTORED = re.compile(r"restored step (\d+) from ")
"""A lock-step worker's line once it restored the run's checkpoint after a restart round
(its replacement's "heal")."""
LOCKSTEP_PROTOCOLS = ("allreduce",)
"""Lock-step protocols a trial may run: a fault opens a restart round (every worker
restarts from the last checkpoint), a replacement joins it."""
BUDGET = re.compile(r"^iteration budget reached \((\d+) iterations\)")
LOCKSTEP_BUDGET = re.compile(r"^iteration budget reached \(worker \d+ finished its (\d+) "
                             r"iterations\)")
"""A lock-step run stops when its first worker finishes its budget (all stand at the
same iteration)."""
POLL_SECONDS = 0.2
"""Status poll period of the driver (faults, stalls, the run's progress)."""
MIN_LIVE_AFTER_FAULT = 2
"""A fault is injected only if this many training workers remain after it (fewer, and the
run stops on purpose below the run's --min-workers, default 2)."""
FAULT_WINDOW = (0.05, 0.5)
"""Faults fire at fractions of the iteration budget drawn from this range, so that their
replacements have time to start, heal and train before the run ends."""
GIVE_UP_PROGRESS = 0.8
"""A planned fault that found no victim before this fraction of the budget is skipped."""
HEAL_GOAL_SECONDS = 10.0
"""The goal: a replacement heals within this long of starting, after its imports."""
LONG_STALL_SECONDS = 10.0
"""Summaries count the trials whose longest stall exceeded this (several leases: more
than waiting for a dead member's lease to expire)."""


@dataclass(kw_only=True)
class ChaosConfig:
    """What `ripples chaos` runs. Every trial is one run of `workers` workers."""

    trials: int = 1
    seed: int = 0
    """Trial i uses seed + i (for its run and its fault plan): rerun one with --trials 1."""
    workers: int = 4
    iterations: int = 1500
    """Per-worker iteration budget of each run."""
    lease_seconds: float = 2.0
    faults: tuple[str, ...] = ("sigkill", "sigterm", "coordinator")
    """Fault kinds to draw from (keys of FAULT_KINDS); the first fault of a trial is the
    first kind listed."""
    faults_per_trial: int = 3
    min_accuracy: float = 0.85
    deadline_seconds: float = 240.0
    """Every process of a trial must have exited this long after the trial started."""
    workdir: Path | None = None
    """Logs and models of every trial go under here (kept); default: a temporary folder
    whose passing trials are removed (failing ones are kept and named)."""
    task: str = "digits"
    protocol: str = "ripples-smart"
    """ripples-smart, ripples-random, adpsgd (elastic: replacements heal) or allreduce
    (lock-step: restart rounds)."""
    checkpoint_every: int = 250
    """Workers checkpoint every this many steps (0: not at all); every checkpoint left
    must load, with finite values. Lock-step runs restart from them."""
    python: str = sys.executable
    batch_size: int = 0
    """Per-worker batch (0: the task's default)."""
    fault_at: float | None = None
    """Fire the first fault at this fraction of the budget, into the last candidate
    (sorted by name), outside any wait for a P-Reduce, with its replacement
    `replace_after` seconds later: a fixed plan (`python -m ripples.bench.fault`).
    None: drawn from the seed."""
    replace_after: float = 0.0
    """The fixed plan's delay before a replacement starts."""

    @property
    def lockstep(self) -> bool:
        return self.protocol in LOCKSTEP_PROTOCOLS

    def __post_init__(self) -> None:
        unknown = [k for k in self.faults if k not in FAULT_KINDS]
        if unknown or not self.faults:
            raise ValueError(f"unknown fault kind(s) {unknown or '(none)'}; choose from "
                             f"{', '.join(FAULT_KINDS)}")
        if self.workers < MIN_LIVE_AFTER_FAULT + 1:
            raise ValueError(f"a chaos trial needs at least {MIN_LIVE_AFTER_FAULT + 1} workers")
        if self.trials < 1 or self.iterations < 1 or self.faults_per_trial < 0:
            raise ValueError("trials and iterations must be positive, faults_per_trial >= 0")
        elastic = ("ripples-smart", "ripples-random", "adpsgd")
        if self.protocol not in (*elastic, *LOCKSTEP_PROTOCOLS):
            raise ValueError(f"chaos trials run {', '.join((*elastic, *LOCKSTEP_PROTOCOLS))}, "
                             f"not {self.protocol}")
        if self.lockstep and not self.checkpoint_every:
            raise ValueError(f"{self.protocol} restarts from checkpoints: give "
                             "--checkpoint-every")
        if self.checkpoint_every < 0:
            raise ValueError("checkpoint_every must not be negative")
        if self.fault_at is not None and not 0 < self.fault_at < 1:
            raise ValueError(f"fault_at is a fraction of the budget in (0, 1), not "
                             f"{self.fault_at}")
        if self.replace_after < 0 or self.batch_size < 0:
            raise ValueError("replace_after and batch_size must not be negative")


# ---------------------------------------------------------------------------- processes
class Proc:
    """One process of a trial. A thread reads its output: each line is kept with the
    monotonic time it arrived and written to its log file."""

    def __init__(self, name: str, role: str, argv: list[str], log_path: Path,
                 t0: float) -> None:
        self.name = name
        self.role = role  # "coordinator", "worker" or "replacement"
        self.log_path = log_path
        self.model_path: Path | None = None
        self.fault = ""  # the fault kind it received, if any
        self.expected_exit: int | None = 0  # None: any exit code is fine
        self.started_at = time.monotonic()
        self._t0 = t0
        self._lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("RIPPLES_COORDINATOR", None)
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, text=True, env=env)
        self._reader = threading.Thread(target=self._read, name=f"chaos-{name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log_path, "w") as log:
            log.write(f"# {' '.join(self.popen.args)}\n")  # type: ignore[arg-type]
            for line in self.popen.stdout:
                now = time.monotonic()
                with self._lock:
                    self._lines.append((now, line.rstrip("\n")))
                log.write(f"[{now - self._t0:8.3f}] {line}")
                log.flush()

    def find(self, pattern: re.Pattern[str]) -> tuple[float, re.Match[str]] | None:
        """The first line matching `pattern`: (when it arrived, the match)."""
        with self._lock:
            lines = list(self._lines)
        for when, line in lines:
            m = pattern.search(line)
            if m:
                return when, m
        return None

    def first_line_at(self) -> float | None:
        """When its first output line arrived: a worker prints none before its imports
        are done (its first line is its registration, or its wait for a vacancy)."""
        with self._lock:
            return self._lines[0][0] if self._lines else None

    def tail(self, lines: int = 15) -> str:
        with self._lock:
            return "\n".join(line for _, line in self._lines[-lines:])

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.alive:
            self.popen.send_signal(sig)

    def reap(self) -> None:
        """Kill it if it still runs; wait for it and for its output."""
        if self.alive:
            self.popen.kill()
        self.popen.wait()
        self._reader.join(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


# ---------------------------------------------------------------------------- faults
@dataclass(kw_only=True)
class PlannedFault:
    """One fault of a trial's plan, drawn before the trial starts."""

    kind: str
    progress: float
    """Fires once the live workers' mean iteration reaches this fraction of the budget."""
    replace_after: float
    """Seconds from the fault to the start of its replacement."""
    in_preduce: bool
    """Wait (briefly) for a victim that the coordinator sees inside a P-Reduce."""
    pick: float
    """Which victim among the candidates (a fraction of the list sorted by name)."""


@dataclass(kw_only=True)
class FaultRecord:
    """One injected fault, as it happened."""

    kind: str
    victim: str
    rank: int
    at_seconds: float
    """Since the trial started."""
    progress: float
    victim_state: str
    """The coordinator's view of the victim just before the fault (reducing: it held a
    delivered group, inside a P-Reduce)."""
    replacement: str = ""
    replacement_at_seconds: float | None = None
    heal_seconds: float | None = None
    """From the replacement's process start to its "healed from worker" line."""
    heal_after_imports_seconds: float | None = None
    """From the replacement's first output line (its imports done) to its heal line: it
    includes a wait for a vacancy (the victim's lease) when it started before one."""
    heal_after_registration_seconds: float | None = None
    """From the replacement's registration to its heal line."""
    fault_to_heal_seconds: float | None = None
    heal_donor: int | None = None
    first_step_seconds: float | None = None
    """From the fault to the first iteration its replacement made after it healed (seen
    by the status polls)."""


@dataclass(frozen=True)
class FaultKind:
    summary: str
    inject: Callable[[Trial, PlannedFault], FaultRecord | None]
    """Inject the fault into the running trial now, or return None if it cannot be now
    (no victim can be spared): the trial asks again at its next poll."""


def _signal_worker(sig: int, expected_exit: int | None) -> Callable[
        [Trial, PlannedFault], FaultRecord | None]:
    def inject(trial: Trial, planned: PlannedFault) -> FaultRecord | None:
        candidates = trial.candidates()
        if len(candidates) < MIN_LIVE_AFTER_FAULT + 1:
            return None
        if planned.in_preduce:  # poll fast for a victim that holds a group
            until = time.monotonic() + 2.0
            while time.monotonic() < until:
                reducing = [c for c in candidates if c[1].state == _state("REDUCING")]
                if reducing:
                    candidates = reducing
                    break
                time.sleep(0.02)
                candidates = trial.candidates(fast=True)
                if len(candidates) < MIN_LIVE_AFTER_FAULT + 1:
                    return None
        proc, status = candidates[min(int(planned.pick * len(candidates)), len(candidates) - 1)]
        proc.signal(sig)
        proc.fault, proc.expected_exit = planned.kind, expected_exit
        record = FaultRecord(kind=planned.kind, victim=proc.name, rank=status.rank,
                             at_seconds=trial.elapsed(), progress=trial.progress,
                             victim_state=_state_name(status.state))
        trial.note(f"{planned.kind} {proc.name} (worker {status.worker_id}, rank "
                   f"{status.rank}, {record.victim_state}) at progress {trial.progress:.2f}; "
                   f"replacement in {planned.replace_after:.1f} s")
        trial.replace_later(record, planned.replace_after)
        return record
    return inject


def _restart_coordinator(trial: Trial, planned: PlannedFault) -> FaultRecord | None:
    """SIGKILL the coordinator; the trial starts it again on its port and state dir after
    the planned delay (`restart_coordinator_later`). The workers ride over the outage."""
    if len(trial.candidates()) < MIN_LIVE_AFTER_FAULT:
        return None
    old = trial.coordinator
    assert old is not None
    old.signal(signal.SIGKILL)
    old.fault, old.expected_exit = planned.kind, None
    record = FaultRecord(kind=planned.kind, victim=old.name, rank=-1,
                         at_seconds=trial.elapsed(), progress=trial.progress,
                         victim_state="serving")
    trial.note(f"{planned.kind}: SIGKILL {old.name} at progress {trial.progress:.2f}; "
               f"restart in {planned.replace_after:.1f} s")
    trial.restart_coordinator_later(planned.replace_after)
    return record


FAULT_KINDS: dict[str, FaultKind] = {
    "sigkill": FaultKind(
        "SIGKILL a training worker (sometimes inside a P-Reduce): its lease expires, a "
        "replacement takes its rank and heals", _signal_worker(signal.SIGKILL, None)),
    "sigterm": FaultKind(
        "SIGTERM a training worker: it finishes its step, saves its model, leaves cleanly "
        "(exit 0); a replacement takes its rank and heals", _signal_worker(signal.SIGTERM, 0)),
    "coordinator": FaultKind(
        "SIGKILL the coordinator and start it again on its address and --state-dir: the "
        "workers train on through the outage and the run resumes", _restart_coordinator),
}


def _state(name: str) -> int:
    from ripples.v1 import coordinator_pb2 as pb

    return int(pb.WorkerState.Value(f"WORKER_STATE_{name}"))


def _state_name(value: int) -> str:
    from ripples.v1 import coordinator_pb2 as pb

    return str(pb.WorkerState.Name(value)).removeprefix("WORKER_STATE_").lower()


def plan_faults(rng: random.Random, config: ChaosConfig) -> list[PlannedFault]:
    """The trial's faults, in firing order: the first of the first kind listed."""
    lo, hi = FAULT_WINDOW
    if config.lockstep:  # after the first checkpoint, which a restart round restores
        lo = max(lo, (config.checkpoint_every + 20) / config.iterations)
        hi = max(hi, lo + 0.1)
    moments = sorted(rng.uniform(lo, hi) for _ in range(config.faults_per_trial))
    if config.fault_at is not None:
        return [PlannedFault(kind=config.faults[0], progress=config.fault_at,
                             replace_after=config.replace_after, in_preduce=False, pick=1.0)
                for _ in range(min(1, config.faults_per_trial))]
    plan = []
    for i, moment in enumerate(moments):
        kind = config.faults[0] if i == 0 else rng.choice(config.faults)
        plan.append(PlannedFault(kind=kind, progress=moment,
                                 replace_after=rng.uniform(0.0, 2.0),
                                 in_preduce=rng.random() < 0.5, pick=rng.random()))
    return plan


# ---------------------------------------------------------------------------- a trial
@dataclass(kw_only=True)
class TrialResult:
    index: int
    seed: int
    ok: bool = False
    hang: bool = False
    lost: bool = False
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    training_seconds: float = 0.0
    """The coordinator's elapsed time of the run (training started to the stop)."""
    stop_reason: str = ""
    accuracy: float | None = None
    faults: list[FaultRecord] = field(default_factory=list)
    skipped_faults: list[str] = field(default_factory=list)
    heals: int = 0
    longest_stall_seconds: float = 0.0
    """Longest time a training worker that had not been faulted made no iteration (seen
    by status polls every POLL_SECONDS, while the run trained)."""
    longest_stall_worker: str = ""
    stall_after_fault_seconds: float = 0.0
    """The survivors' stall: the longest time one of the run's first workers that was not
    faulted went between iteration changes, over the polls after the first fault."""
    step_seconds_before_fault: float | None = None
    """The survivors' median time between iteration changes before the first fault, as
    the polls see them (what no stall looks like)."""
    longest_step_before_fault_seconds: float | None = None
    """The survivors' longest time between iteration changes before the first fault."""
    groups_failed: int = 0
    groups_cancelled: int = 0
    restart_rounds: int = 0
    """Lock-step runs: restart rounds the faults opened."""
    checkpoints: int = 0
    """Checkpoint files left at the end, each loaded and checked."""
    corrupt_checkpoints: int = 0
    partial_checkpoints: int = 0
    """Hidden partial files of writers killed mid-write (never under a checkpoint name)."""
    directory: str = ""

    def line(self) -> str:
        faults = " ".join(
            f"{f.kind}({f.victim} rank {f.rank}, {f.victim_state})@{f.progress:.2f}"
            + (f"->{f.replacement} healed {f.heal_seconds:.1f}s" if f.heal_seconds is not None
               else f"->{f.replacement or '-'} no heal")
            for f in self.faults)
        acc = f"{self.accuracy:.3f}" if self.accuracy is not None else "-"
        head = f"trial {self.index} seed {self.seed}: "
        head += "ok" if self.ok else ("HANG" if self.hang else "LOST" if self.lost else "FAILED")
        text = (f"{head} {self.seconds:.1f} s (training {self.training_seconds:.1f} s), "
                f"accuracy {acc}, longest stall {self.longest_stall_seconds:.1f} s, "
                f"groups failed {self.groups_failed}; faults: {faults or 'none'}")
        if self.failures:
            text += "\n    " + "\n    ".join(self.failures)
            text += f"\n    logs: {self.directory}"
        return text


class Trial:
    """One seeded run with faults: start, drive, wait, check (`run()`)."""

    def __init__(self, config: ChaosConfig, index: int, seed: int, directory: Path) -> None:
        self.config = config
        self.result = TrialResult(index=index, seed=seed, directory=str(directory))
        self.seed = seed
        self.rng = random.Random(seed)
        self.plan = plan_faults(self.rng, config)
        self.dir = directory
        self.t0 = time.monotonic()
        self.deadline = self.t0 + config.deadline_seconds
        self.procs: list[Proc] = []
        self.coordinator: Proc | None = None
        self.client: CoordinatorClient | None = None
        self.status: pb.RunStatus | None = None
        self.final_status: pb.RunStatus | None = None
        self.progress = 0.0
        self.ranks: dict[str, int] = {}  # host (process name) -> rank
        self._replacements: list[tuple[float, FaultRecord]] = []
        self._coordinator_restart_at: float | None = None
        self._seen: dict[str, tuple[int, float]] = {}  # name -> (iteration, since when)
        self._num_replacements = 0
        self._states: dict[str, str] = {}  # process name -> its last state seen
        self._steps_before_fault: list[float] = []
        self._healed_at_iteration: dict[str, int] = {}  # replacement -> first seen healed
        self._notes = open(directory / "harness.log", "w")

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def note(self, text: str) -> None:
        """One line of the trial's own log (DIR/harness.log): what it did and saw."""
        self._notes.write(f"[{self.elapsed():8.3f}] {text}\n")
        self._notes.flush()

    # ------------------------------------------------------------------ processes
    def _cli(self, *args: str) -> list[str]:
        return [self.config.python, "-m", "ripples.cli", *args]

    def _start_coordinator(self, port: int = 0) -> str:
        """Start the coordinator (again, on `port`, after a coordinator fault: it resumes
        the run from its state dir) and wait until it listens; returns its address."""
        cfg = self.config
        name = "coordinator" if self.coordinator is None else f"coordinator{len(self.procs)}"
        argv = self._cli("coordinator", "serve", "--host", "127.0.0.1", "--port", str(port),
                         "--metrics-port", "0", "--exit-when-done",
                         "--state-dir", str(self.dir / "coordinator-state"),
                         "--workers", str(cfg.workers), "--protocol", cfg.protocol,
                         "--task", cfg.task, "--iterations", str(cfg.iterations),
                         "--lease-seconds", str(cfg.lease_seconds), "--seed", str(self.seed),
                         "--batch-size", str(cfg.batch_size))
        self.coordinator = Proc(name, "coordinator", argv, self.dir / f"{name}.log", self.t0)
        self.procs.append(self.coordinator)
        until = min(self.deadline, time.monotonic() + 120)
        while time.monotonic() < until:
            found = self.coordinator.find(LISTENING)
            if found:
                return found[1].group(1)
            if not self.coordinator.alive:
                break
            time.sleep(0.05)
        raise _TrialError("the coordinator did not start:\n" + self.coordinator.tail())

    def _start_worker(self, name: str, role: str, address: str) -> Proc:
        model = self.dir / f"{name}.pt"
        argv = self._cli("worker", "run", "--coordinator", address, "--host", name,
                         "--metrics-port", "-1", "--save-model", str(model))
        if self.config.checkpoint_every:
            argv += ["--checkpoint-dir", str(self.dir / "checkpoints"),
                     "--checkpoint-every", str(self.config.checkpoint_every)]
        proc = Proc(name, role, argv, self.dir / f"{name}.log", self.t0)
        proc.model_path = model
        self.procs.append(proc)
        self.note(f"started {name} ({role}), pid {proc.popen.pid}")
        return proc

    def replace_later(self, record: FaultRecord, delay: float) -> None:
        self._replacements.append((time.monotonic() + delay, record))

    def restart_coordinator_later(self, delay: float) -> None:
        self._coordinator_restart_at = time.monotonic() + delay

    def _restart_due_coordinator(self, address: str) -> None:
        due = self._coordinator_restart_at
        if due is None or time.monotonic() < due:
            return
        self._coordinator_restart_at = None
        self._start_coordinator(port=int(address.rpartition(":")[2]))
        self.note(f"restarted the coordinator on {address}")

    def _start_due_replacements(self, address: str) -> None:
        now = time.monotonic()
        for item in [r for r in self._replacements if r[0] <= now]:
            self._replacements.remove(item)
            self._num_replacements += 1
            record = item[1]
            record.replacement = f"r{self._num_replacements}"
            record.replacement_at_seconds = self.elapsed()
            self._start_worker(record.replacement, "replacement", address)

    def workers(self) -> list[Proc]:
        return [p for p in self.procs if p.role != "coordinator"]

    def proc(self, name: str) -> Proc | None:
        return next((p for p in self.procs if p.name == name), None)

    def healed(self, proc: Proc) -> bool:
        return proc.role != "replacement" or proc.find(self.heal_line) is not None

    @property
    def heal_line(self) -> re.Pattern[str]:
        """What a replacement logs once it holds the run's model: healed from a live peer,
        or (lock-step) restored the run's checkpoint."""
        return RESTORED if self.config.lockstep else HEALED

    # ------------------------------------------------------------------ status
    def poll(self) -> pb.RunStatus | None:
        """Read the run's status (None if the coordinator did not answer); track the
        progress, the ranks and the survivors' stalls."""
        from ripples.worker.client import CoordinatorCallError

        if self.client is None or self.coordinator is None or not self.coordinator.alive:
            return None
        try:
            status = self.client.run_status()
        except CoordinatorCallError:
            return None
        now = time.monotonic()
        self.status = status
        self._note_changes(status)
        if status.stopped:
            self.final_status = status
        training = [w for w in status.workers if w.state in _training_states()]
        if status.started:  # the membership is formed (again, after a restart round)
            for w in status.workers:
                if w.state in _training_states():
                    self.ranks[w.host] = w.rank
        if training and self.config.iterations:
            self.progress = (sum(w.iteration for w in training) / len(training)
                             / self.config.iterations)
        if status.started and not status.stopped:
            for w in training:
                p = self.proc(w.host)
                if p is None or p.fault or not self.healed(p):
                    self._seen.pop(w.host, None)
                    continue
                last = self._seen.get(w.host)
                changed = last is None or w.iteration != last[0]
                if last is not None:
                    gap = now - last[1]  # since its iteration last changed
                    if not changed and gap > self.result.longest_stall_seconds:
                        self.result.longest_stall_seconds = gap
                        self.result.longest_stall_worker = w.host
                    if p.role == "worker" and self.result.faults:
                        self.result.stall_after_fault_seconds = max(
                            self.result.stall_after_fault_seconds, gap)
                    elif p.role == "worker" and changed:
                        self._steps_before_fault.append(gap)
                if changed:
                    self._seen[w.host] = (w.iteration, now)
                    if p.role == "replacement":
                        self._note_first_step(p, w.iteration)
        return status

    def _note_first_step(self, replacement: Proc, iteration: int) -> None:
        """A healed replacement's iteration changed: its first step, if it is the first
        change since the polls saw it healed."""
        record = next((f for f in self.result.faults if f.replacement == replacement.name),
                      None)
        if record is None or record.first_step_seconds is not None:
            return
        if replacement.name not in self._healed_at_iteration:
            self._healed_at_iteration[replacement.name] = iteration
            return
        record.first_step_seconds = self.elapsed() - record.at_seconds

    def _note_changes(self, status: pb.RunStatus) -> None:
        for w in status.workers:  # training states (computing, waiting, reducing) as one
            state = "training" if w.state in _training_states() else _state_name(w.state)
            key = f"{w.host}/{w.worker_id}"  # a restarted process registers anew
            if self._states.get(key) != state:
                self._states[key] = state
                self.note(f"{w.host} is worker {w.worker_id}, rank {w.rank}: {state} at "
                          f"iteration {w.iteration}" + (f" ({w.error})" if w.error else ""))
        if status.started and "started" not in self._states:
            self._states["started"] = "yes"
            self.note("training started")
        if status.stopped and "stopped" not in self._states:
            self._states["stopped"] = "yes"
            self.note(f"run stopped: {status.stop_reason}")

    def candidates(self, fast: bool = False) -> list[tuple[Proc, pb.WorkerStatus]]:
        """Training workers that may be faulted now: alive, not faulted, healed, training
        in the coordinator's view; sorted by name."""
        status = self.poll() if fast else self.status
        if status is None or not status.started or status.stopped:
            return []
        out = []
        for w in status.workers:
            p = self.proc(w.host)
            if (p is not None and p.role != "coordinator" and p.alive and not p.fault
                    and w.state in _training_states() and self.healed(p)):
                out.append((p, w))
        return sorted(out, key=lambda c: c[0].name)

    # ------------------------------------------------------------------ the trial
    def run(self) -> TrialResult:
        from ripples.worker.client import CoordinatorClient

        r = self.result
        try:
            address = self._start_coordinator()
            self.client = CoordinatorClient(address, rpc_timeout_seconds=5.0)
            for i in range(self.config.workers):
                self._start_worker(f"w{i}", "worker", address)
            self._drive(address)
            self._wait_for_exits()
        except _TrialError as err:
            r.failures.append(str(err))
        finally:
            still = [p.name for p in self.procs if p.alive]
            if still:
                r.hang = True
                r.failures.insert(0, f"HANG: still running at the deadline "
                                  f"({self.config.deadline_seconds:.0f} s): {', '.join(still)}")
                for p in self.procs:
                    if p.alive:
                        with open(p.log_path.with_suffix(".tail"), "w") as f:
                            f.write(p.tail(60) + "\n")
            for p in self.procs:
                p.reap()
                self.note(f"{p.name} exited with {p.returncode}")
            if self.client is not None:
                self.client.close()
            r.seconds = self.elapsed()
        self._check()
        r.ok = not r.failures
        for failure in r.failures:
            self.note(f"FAILURE: {failure}")
        self._notes.close()
        return r

    def _drive(self, address: str) -> None:
        """Poll the run, inject the plan's faults and start replacements until it stops."""
        plan = list(self.plan)
        while time.monotonic() < self.deadline:
            self._restart_due_coordinator(address)
            status = self.poll()
            assert self.coordinator is not None
            restarting = self._coordinator_restart_at is not None
            if (not self.coordinator.alive and not restarting) or (
                    status is not None and status.stopped):
                break
            if status is not None and (status.started or status.restarting):
                # A lock-step run's replacement joins the restart round its fault opened.
                self._start_due_replacements(address)
            if status is not None and status.started:
                if plan and self.progress >= plan[0].progress:
                    record = FAULT_KINDS[plan[0].kind].inject(self, plan[0])
                    if record is not None:
                        self.result.faults.append(record)
                        plan.pop(0)
                    elif self.progress > GIVE_UP_PROGRESS:
                        self.result.skipped_faults.append(plan.pop(0).kind)
            time.sleep(POLL_SECONDS)
        self.result.skipped_faults += [p.kind for p in plan]
        self.result.skipped_faults += [f"replacement of {r.victim}" for _, r in self._replacements]

    def _wait_for_exits(self) -> None:
        while time.monotonic() < self.deadline and any(p.alive for p in self.procs):
            self.poll()
            time.sleep(POLL_SECONDS)

    # ------------------------------------------------------------------ checks
    def _check(self) -> None:
        r = self.result
        fail = r.failures.append
        if self.final_status is not None:
            r.stop_reason = self.final_status.stop_reason
            r.training_seconds = self.final_status.elapsed_seconds
            r.groups_failed = self.final_status.num_groups_failed
            r.groups_cancelled = self.final_status.num_groups_cancelled
        else:  # the coordinator exited before a poll saw the stop: its workers' word
            said = [found for w in self.workers() if (found := w.find(FINISHED)) is not None]
            r.stop_reason = said[0][1].group(1) if said else ""
        budget = (LOCKSTEP_BUDGET if self.config.lockstep else BUDGET).match(r.stop_reason)
        needed = self.config.iterations * (1 if self.config.lockstep else self.config.workers)
        if budget is None or int(budget.group(1)) < needed:
            r.lost = True
            fail(f"LOST run: it stopped with {r.stop_reason or 'no stop reason'!r}, not its "
                 f"iteration budget of {needed} iterations")
        for p in self.procs:
            code = p.returncode
            if p.expected_exit is not None and code != p.expected_exit:
                why = f" after {p.fault}" if p.fault else ""
                fail(f"{p.name} exited with {code}{why}, expected {p.expected_exit}:\n"
                     + _indent(p.tail()))
        # Heals: the time from a replacement's start to its heal line.
        for f in r.faults:
            joiner = self.proc(f.replacement) if f.replacement else None
            healed = joiner.find(self.heal_line) if joiner is not None else None
            if joiner is not None and healed is not None:
                when, m = healed
                f.heal_seconds = when - joiner.started_at
                first = joiner.first_line_at()
                registered = joiner.find(REGISTERED)
                if first is not None:
                    f.heal_after_imports_seconds = when - first
                if registered is not None:
                    f.heal_after_registration_seconds = when - registered[0]
                f.fault_to_heal_seconds = when - self.t0 - f.at_seconds
                f.heal_donor = -1 if self.config.lockstep else int(m.group(1))
        r.heals = sum(f.heal_seconds is not None for f in r.faults)
        if self._steps_before_fault:
            r.step_seconds_before_fault = statistics.median(self._steps_before_fault)
            r.longest_step_before_fault_seconds = max(self._steps_before_fault)
        if any(f.replacement for f in r.faults) and r.heals == 0:
            fail(f"no replacement healed (no {self.heal_line.pattern!r} in their logs)")
        if self.final_status is not None:
            r.restart_rounds = self.final_status.num_restarts
        self._check_models()
        self._check_checkpoints()

    def _check_checkpoints(self) -> None:
        """Every checkpoint left loads, and holds finite values only (a writer SIGKILLed
        mid-write leaves a hidden partial file, never a torn checkpoint)."""
        root = self.dir / "checkpoints"
        if not self.config.checkpoint_every or not root.is_dir():
            return
        import torch

        r = self.result
        for path in sorted(root.glob("rank-*/step-*.pt")):
            try:
                state = torch.load(path, map_location="cpu", weights_only=False)
                bad = [k for k, v in state["model"].items()
                       if v.is_floating_point() and not torch.isfinite(v).all()]
            except Exception as err:  # noqa: BLE001 (any unreadable checkpoint is a failure)
                r.failures.append(f"CORRUPT checkpoint {path}: {type(err).__name__}: {err}")
                r.corrupt_checkpoints += 1
                continue
            if bad:
                r.failures.append(f"checkpoint {path} holds non-finite {bad[:3]}")
                r.corrupt_checkpoints += 1
            r.checkpoints += 1
        r.partial_checkpoints = len(list(root.glob("rank-*/.step-*.pt.partial")))

    def _check_models(self) -> None:
        r = self.result
        fail = r.failures.append
        final = [p for p in self.workers() if not p.fault and p.returncode == 0]
        saved = [p for p in self.workers() if p.returncode == 0]
        missing = [p.name for p in saved if p.model_path is None or not p.model_path.exists()]
        if missing:
            fail(f"no saved model from {', '.join(missing)}")
            return
        ranks = sorted(self.ranks.get(p.name, -1) for p in final)
        if ranks != list(range(self.config.workers)):
            fail(f"the final models are not one per rank: ranks {ranks} "
                 f"({', '.join(p.name for p in final)})")
        for p in final:
            if not self.healed(p):  # its model would be the task's fresh one
                fail(f"{p.name} saved a final model but never healed (the run stopped "
                     "before its heal group)")
        if not final:
            return
        try:
            accuracy, nonfinite = evaluate_models(
                [p.model_path for p in final if p.model_path is not None],
                [p.model_path for p in saved if p.fault and p.model_path is not None],
                self.config.task, self.seed)
        except Exception as err:  # noqa: BLE001 (a model that does not load is a failure)
            fail(f"could not evaluate the models: {type(err).__name__}: {err}")
            return
        r.accuracy = accuracy
        if nonfinite:
            fail(f"non-finite values in saved models: {', '.join(nonfinite)}")
        if not accuracy >= self.config.min_accuracy:
            fail(f"the average of the final models reaches accuracy {accuracy:.3f} < "
                 f"{self.config.min_accuracy}")


class _TrialError(Exception):
    pass


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())


@functools.cache
def _training_states() -> tuple[int, ...]:
    """The coordinator's states of a worker that trains (between groups, waiting for one,
    or inside a P-Reduce)."""
    return tuple(_state(s) for s in ("COMPUTING", "WAITING", "REDUCING"))


def evaluate_models(final: list[Path], others: list[Path], task: str,
                    seed: int) -> tuple[float, list[str]]:
    """(accuracy of the average of the `final` models on the task's test split, the
    files among `final` and `others` that hold a non-finite value). CPU, this process."""
    import torch

    from ripples.worker.tasks import TaskOptions, build_task, evaluate

    nonfinite = []
    states = []
    for path in [*final, *others]:
        state = torch.load(path, map_location="cpu")
        if not all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()):
            nonfinite.append(path.name)
        if path in final:
            states.append(state)
    average = {k: (sum(s[k].double() for s in states) / len(states)).to(states[0][k].dtype)
               if states[0][k].is_floating_point() else states[0][k] for k in states[0]}
    built = build_task(task, TaskOptions(seed=seed, device="cpu"))
    model = built.build_model()
    model.load_state_dict(average)
    _, accuracy = evaluate(built, model)
    return float(accuracy if accuracy is not None else math.nan), nonfinite


# ---------------------------------------------------------------------------- many trials
def run_trials(config: ChaosConfig, on_result: Callable[[TrialResult], None] = lambda r: None
               ) -> dict[str, Any]:
    """Run the configured trials one after another; returns the summary (`summarise`)."""
    temporary = config.workdir is None
    root = Path(tempfile.mkdtemp(prefix="ripples-chaos-")) if temporary else config.workdir
    assert root is not None
    results = []
    for i in range(config.trials):
        seed = config.seed + i
        directory = root / f"trial-{i}-seed-{seed}"
        directory.mkdir(parents=True, exist_ok=True)
        result = Trial(config, i, seed, directory).run()
        if temporary and result.ok:
            shutil.rmtree(directory, ignore_errors=True)
        results.append(result)
        on_result(result)
    if temporary and all(r.ok for r in results):
        shutil.rmtree(root, ignore_errors=True)
    summary = summarise(results)
    summary["config"] = {"seed": config.seed, "workers": config.workers,
                         "iterations": config.iterations, "lease_seconds": config.lease_seconds,
                         "faults": list(config.faults),
                         "faults_per_trial": config.faults_per_trial,
                         "deadline_seconds": config.deadline_seconds,
                         "protocol": config.protocol, "task": config.task,
                         "workdir": str(root)}
    return summary


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3),
            "max": round(max(values), 3)}


def summarise(results: list[TrialResult]) -> dict[str, Any]:
    faults = [f for r in results for f in r.faults]
    after_imports = [f.heal_after_imports_seconds for f in faults
                     if f.heal_after_imports_seconds is not None]
    kinds: dict[str, int] = {}
    for f in faults:
        kinds[f.kind] = kinds.get(f.kind, 0) + 1
    return {
        "trials": len(results),
        "passed": sum(r.ok for r in results),
        "failed": sum(not r.ok for r in results),
        "hangs": sum(r.hang for r in results),
        "lost_runs": sum(r.lost for r in results),
        "failed_seeds": [r.seed for r in results if not r.ok],
        "faults": kinds,
        "faults_inside_preduce": sum(f.victim_state == "reducing" for f in faults),
        "skipped_faults": sum(len(r.skipped_faults) for r in results),
        "heals": sum(r.heals for r in results),
        "heal_seconds": _spread([f.heal_seconds for f in faults if f.heal_seconds is not None]),
        "fault_to_heal_seconds": _spread([f.fault_to_heal_seconds for f in faults
                                          if f.fault_to_heal_seconds is not None]),
        "heal_after_imports_seconds": _spread(after_imports),
        "heal_after_registration_seconds": _spread(
            [f.heal_after_registration_seconds for f in faults
             if f.heal_after_registration_seconds is not None]),
        "heals_within_goal": sum(v <= HEAL_GOAL_SECONDS for v in after_imports),
        "longest_stall_seconds": _spread([r.longest_stall_seconds for r in results]),
        "long_stall_seeds": [r.seed for r in results
                             if r.longest_stall_seconds > LONG_STALL_SECONDS],
        "trial_seconds": _spread([r.seconds for r in results]),
        "training_seconds": _spread([r.training_seconds for r in results]),
        "accuracy": _spread([r.accuracy for r in results if r.accuracy is not None]),
        "groups_failed": sum(r.groups_failed for r in results),
        "groups_cancelled": sum(r.groups_cancelled for r in results),
        "restart_rounds": sum(r.restart_rounds for r in results),
        "checkpoints_loaded": sum(r.checkpoints for r in results),
        "corrupt_checkpoints": sum(r.corrupt_checkpoints for r in results),
        "partial_checkpoint_files": sum(r.partial_checkpoints for r in results),
        "results": [asdict(r) for r in results],
    }


def format_summary(summary: dict[str, Any]) -> str:
    def spread(key: str) -> str:
        s = summary[key]
        return "-" if s is None else f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f}"

    kinds = ", ".join(f"{k} {n}" for k, n in summary["faults"].items()) or "none"
    lines = [
        f"chaos: {summary['trials']} trials, {summary['passed']} passed, "
        f"{summary['failed']} failed ({summary['hangs']} hangs, {summary['lost_runs']} "
        f"lost runs)" + (f"; failed seeds {summary['failed_seeds']}"
                         if summary["failed_seeds"] else ""),
        f"  faults: {kinds} ({summary['faults_inside_preduce']} inside a P-Reduce, "
        f"{summary['skipped_faults']} skipped); heals {summary['heals']}; groups failed "
        f"{summary['groups_failed']}, cancelled {summary['groups_cancelled']}; restart "
        f"rounds {summary['restart_rounds']}",
        f"  checkpoints: {summary['checkpoints_loaded']} loaded, "
        f"{summary['corrupt_checkpoints']} corrupt, "
        f"{summary['partial_checkpoint_files']} partial files of killed writers",
        f"  seconds min / median / max: trial {spread('trial_seconds')}, training "
        f"{spread('training_seconds')}, replacement start to heal {spread('heal_seconds')}, "
        f"fault to heal {spread('fault_to_heal_seconds')}, imports done to heal "
        f"{spread('heal_after_imports_seconds')} ({summary['heals_within_goal']} within "
        f"{HEAL_GOAL_SECONDS:.0f} s), registered to heal "
        f"{spread('heal_after_registration_seconds')}, survivors' longest stall "
        f"{spread('longest_stall_seconds')}"
        + (f"; stalls over {LONG_STALL_SECONDS:.0f} s in seeds {summary['long_stall_seeds']}"
           if summary["long_stall_seeds"] else ""),
    ]
    acc = summary["accuracy"]
    if acc is not None:
        lines.append(f"  accuracy of the averaged final model: min {acc['min']:.3f}, "
                     f"median {acc['median']:.3f}")
    return "\n".join(lines)
