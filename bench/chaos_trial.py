"""One chaos trial: its processes started, its run driven through its faults, checked.

A `Trial` starts a coordinator (`ripples coordinator serve --exit-when-done`, waiting for
its coordinator_listening event for the address) and the run's workers (`ripples worker
run`, each saving its final model and checkpointing), polls the run's status over gRPC
every POLL_SECONDS (progress, ranks, stalls, the victims' states), injects its planned
faults (bench/chaos_faults.py) and starts what follows them (replacements, a coordinator
restart), waits for every process to exit before the deadline, and hands the remains to
the checks (bench/chaos_checks.py). What its processes did, it reads from their events
(ripples/events.py; bench/chaos_procs.py), never from their log text.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ripples import events
from ripples.bench.chaos_checks import check
from ripples.bench.chaos_config import ChaosConfig
from ripples.bench.chaos_faults import (
    FAULT_KINDS,
    FaultRecord,
    plan_faults,
    state_name,
    training_states,
)
from ripples.bench.chaos_procs import Proc
from ripples.bench.chaos_results import TrialResult

if TYPE_CHECKING:
    from ripples.v1 import coordinator_pb2 as pb
    from ripples.worker.client import CoordinatorClient

POLL_SECONDS = 0.2
"""Status poll period of the driver (faults, stalls, the run's progress)."""
GIVE_UP_PROGRESS = 0.8
"""A planned fault that found no victim before this fraction of the budget is skipped."""


class TrialError(Exception):
    """The trial cannot go on (its coordinator did not start): a failure of the trial."""


class Trial:
    """One seeded run with faults: start, drive, wait, check (`run()`).

    Attributes:
        config: The chaos configuration.
        result: What the trial found (filled in as it goes, final after `run()`).
        seed: The trial's seed (its run's, and its fault plan's).
        plan: The faults to inject, in firing order.
        dir: The trial's folder: logs, events, models, checkpoints, harness.log.
        t0: Monotonic time of the trial's start (`elapsed()`, the deadline).
        t0_wall: Wall-clock time of the trial's start (events carry wall-clock times).
        procs: Every process started, in order.
        coordinator: The coordinator process now (a restart starts another).
        status: The last run status polled; final_status: the first one that said the
            run stopped.
        progress: The training workers' mean iteration over the budget, last polled.
        ranks: Process name -> its rank in the run, as the polls saw it.
    """

    def __init__(self, config: ChaosConfig, index: int, seed: int, directory: Path) -> None:
        """Plan the trial (nothing starts before `run()`).

        Args:
            config: The chaos configuration.
            index: The trial's index in its batch.
            seed: The trial's seed.
            directory: The trial's folder (it exists).
        """
        self.config = config
        self.result = TrialResult(index=index, seed=seed, directory=str(directory))
        self.seed = seed
        self.rng = random.Random(seed)
        self.plan = plan_faults(self.rng, config)
        self.dir = directory
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
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
        self.steps_before_fault: list[float] = []
        self._healed_at_iteration: dict[str, int] = {}  # replacement -> first seen healed
        self._notes = open(directory / "harness.log", "w")

    def elapsed(self) -> float:
        """Seconds since the trial started."""
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
        self.coordinator = Proc(name, "coordinator", argv, self.dir / f"{name}.log",
                                self.t0_wall)
        self.procs.append(self.coordinator)
        until = min(self.deadline, time.monotonic() + 120)
        while time.monotonic() < until:
            found = self.coordinator.first_event(events.COORDINATOR_LISTENING)
            if found:
                return str(found["address"])
            if not self.coordinator.alive:
                break
            time.sleep(0.05)
        raise TrialError("the coordinator did not start:\n" + self.coordinator.tail())

    def _start_worker(self, name: str, role: str, address: str) -> Proc:
        """Start a `ripples worker run` named `name` (its --host), saving its final model
        to DIR/NAME.pt and checkpointing if the configuration says so."""
        model = self.dir / f"{name}.pt"
        argv = self._cli("worker", "run", "--coordinator", address, "--host", name,
                         "--metrics-port", "-1", "--save-model", str(model))
        if self.config.checkpoint_every:
            argv += ["--checkpoint-dir", str(self.dir / "checkpoints"),
                     "--checkpoint-every", str(self.config.checkpoint_every)]
        proc = Proc(name, role, argv, self.dir / f"{name}.log", self.t0_wall)
        proc.model_path = model
        self.procs.append(proc)
        self.note(f"started {name} ({role}), pid {proc.popen.pid}")
        return proc

    def replace_later(self, record: FaultRecord, delay: float) -> None:
        """Start a replacement for a fault's victim `delay` seconds from now (once the
        run trains, or restarts: a lock-step replacement joins the restart round); it is
        named in `record`."""
        self._replacements.append((time.monotonic() + delay, record))

    def restart_coordinator_later(self, delay: float) -> None:
        """Start the coordinator again `delay` seconds from now, on its port and state
        dir."""
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
        """The worker processes (the run's first ones and the replacements)."""
        return [p for p in self.procs if p.role != "coordinator"]

    def coordinators(self) -> list[Proc]:
        """The coordinator processes, the first one first (a restart adds one)."""
        return [p for p in self.procs if p.role == "coordinator"]

    def proc(self, name: str) -> Proc | None:
        """The process of that name (None if none)."""
        return next((p for p in self.procs if p.name == name), None)

    def healed(self, proc: Proc) -> bool:
        """A process holds the run's model: it is no replacement, or it healed."""
        return proc.role != "replacement" or proc.first_event(self.heal_event) is not None

    @property
    def heal_event(self) -> str:
        """The event a replacement writes once it holds the run's model: healed from a
        live peer, or (lock-step) restored the run's checkpoint."""
        return events.CHECKPOINT_RESTORED if self.config.lockstep else events.WORKER_HEALED

    # ------------------------------------------------------------------ status
    def poll(self) -> pb.RunStatus | None:
        """Read the run's status; track the progress, the ranks and the survivors'
        stalls.

        Returns:
            The status (None if the coordinator is down or did not answer).
        """
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
        training = [w for w in status.workers if w.state in training_states()]
        if status.started:  # the membership is formed (again, after a restart round)
            for w in status.workers:
                if w.state in training_states():
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
                        self.steps_before_fault.append(gap)
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
        """Note in harness.log the workers' state changes, the start and the stop."""
        for w in status.workers:  # training states (computing, waiting, reducing) as one
            state = "training" if w.state in training_states() else state_name(w.state)
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
        in the coordinator's view.

        Args:
            fast: Poll the status now (else: the last status polled).

        Returns:
            (process, its status) pairs, sorted by the process's name.
        """
        status = self.poll() if fast else self.status
        if status is None or not status.started or status.stopped:
            return []
        out = []
        for w in status.workers:
            p = self.proc(w.host)
            if (p is not None and p.role != "coordinator" and p.alive and not p.fault
                    and w.state in training_states() and self.healed(p)):
                out.append((p, w))
        return sorted(out, key=lambda c: c[0].name)

    # ------------------------------------------------------------------ the trial
    def run(self) -> TrialResult:
        """Run the trial: start the coordinator and the workers, drive the run through
        its fault plan, wait for every process (killing those left at the deadline: a
        HANG), then check what the run left (bench/chaos_checks.py).

        Returns:
            The result: ok, or the failures that say what broke.
        """
        from ripples.worker.client import CoordinatorClient

        r = self.result
        try:
            address = self._start_coordinator()
            self.client = CoordinatorClient(address, rpc_timeout_seconds=5.0)
            for i in range(self.config.workers):
                self._start_worker(f"w{i}", "worker", address)
            self._drive(address)
            self._wait_for_exits()
        except TrialError as err:
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
        check(self)
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
        """Poll until every process exited, or the deadline."""
        while time.monotonic() < self.deadline and any(p.alive for p in self.procs):
            self.poll()
            time.sleep(POLL_SECONDS)
