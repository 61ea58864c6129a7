"""Starting worker processes: the environment `ripples.init()` reads, and a watcher that
passes signals on and names the first process that failed.

Used by `ripples worker run --nproc-per-node K` (one host's workers) and `ripples run`
(a whole local cluster). Children run in process groups of their own, so a Ctrl-C at the
terminal reaches this process only; it passes SIGTERM on (each worker finishes its step
and leaves the run) and, on a second signal, kills them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

from ripples.worker.launch_env import ENV_COORDINATOR, ENV_RUN_ID, LaunchEnv

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.2
RESTART_EXIT_CODE = 75
"""A worker process that restarts for a restart round of its lock-step run exits with
this code (EX_TEMPFAIL); the launchers here start it again (torchrun does with
--max-restarts)."""
MAX_PROCESS_RESTARTS = 100
"""A child restarted this often is left ended (the coordinator bounds restart rounds by
max_restarts; this bounds a launcher whose coordinator keeps ordering restarts)."""
TERMINATE_GRACE_SECONDS = 30.0
"""After passing a signal on, how long the children have to leave before they are killed."""
UNIT_EXIT_SECONDS = 30.0
"""A rank of a worker of several ranks failed and the worker is to be started again: how
long its other ranks have to end by themselves (their collectives with it fail) before
they are killed."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (a worker's rank 0 binds it moments later, for its
    ranks to meet at: worker/replica.py)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def renewed_address(env: dict[str, str]) -> str:
    """A new meeting address for a worker's ranks started again ("": they have none): the
    old port may still be held by a rank that just ended."""
    address = env.get("RIPPLES_REPLICA_ADDRESS", "")
    if not address:
        return ""
    host = address.rpartition(":")[0]
    return f"{host}:{free_port(host)}"


def launch_environment(env: LaunchEnv, *, rank: int | None,
                       world_size: int | None) -> dict[str, str]:
    """The environment of one child: the parent's, plus where the child stands (torchrun's
    variables and Ripples' own); `rank`/`world_size` None leaves them unset."""
    variables = {
        ENV_COORDINATOR: env.coordinator,
        "RIPPLES_LAUNCHER": "ripples",
        "RIPPLES_HOST": env.host,
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.local_world_size),
        "RIPPLES_METRICS_PORT": str(env.metrics_port),
        "RIPPLES_METRICS_BIND": env.metrics_bind,
        "RIPPLES_CONNECT_TIMEOUT_SECONDS": str(env.connect_timeout_seconds),
        "RIPPLES_START_TIMEOUT_SECONDS": str(env.start_timeout_seconds),
    }
    optional = {"RIPPLES_DEVICE": env.device, "RIPPLES_METRICS_HOST": env.metrics_host,
                "RIPPLES_SAVE_MODEL": env.save_model, "RIPPLES_SAVE_RECORD": env.save_record,
                "RIPPLES_SLOWDOWN": env.slowdown, ENV_RUN_ID: env.run_id}
    variables.update({k: v for k, v in optional.items() if v})
    # Set always, 1 too: a launcher started with RIPPLES_RANKS_PER_WORKER (an sbatch's
    # environment) must not make a run of one rank per worker sharded.
    variables["RIPPLES_RANKS_PER_WORKER"] = str(env.ranks_per_worker)
    if env.sharded and env.replica_address:
        variables["RIPPLES_REPLICA_ADDRESS"] = env.replica_address
    if env.sharded and env.replica_rank >= 0:  # else the launcher's rank says it
        variables["RIPPLES_REPLICA_RANK"] = str(env.replica_rank)
    variables.update(env.checkpoint.environment())
    if env.num_threads:
        variables["RIPPLES_NUM_THREADS"] = str(env.num_threads)
        variables["OMP_NUM_THREADS"] = str(env.num_threads)
    if rank is not None and world_size is not None:
        variables.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    # The parent's own launcher variables (its torchrun rank) are not the child's; with
    # RIPPLES_LAUNCHER=ripples the child reads Ripples' and torchrun's names only, not
    # SLURM's or Kubeflow's (an `srun` around this process gave them all one rank).
    child = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "RIPPLES_REPLICA_ADDRESS", "RIPPLES_REPLICA_RANK")}
    child.update(variables)
    return child


def script_argv(script: list[str] | tuple[str, ...]) -> list[str]:
    """The user's command; a bare `python` or `python3` is the interpreter that runs
    Ripples itself, so the script sees the same packages (as torchrun runs a script)."""
    import sys

    argv = list(script)
    if argv and argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    return argv


def runner_argv(env: LaunchEnv, task: str, *, quiet: bool) -> list[str]:
    """The command line of one built-in-runner worker standing where `env` says."""
    import sys

    argv = [sys.executable, "-m", "ripples.cli", "worker", "run",
            "--coordinator", env.coordinator, "--host", env.host,
            "--local-rank", str(env.local_rank), "--metrics-port", str(env.metrics_port),
            "--metrics-bind", env.metrics_bind,
            "--connect-timeout-seconds", str(env.connect_timeout_seconds),
            "--start-timeout-seconds", str(env.start_timeout_seconds)]
    for flag, value in (("--task", task), ("--device", env.device),
                        ("--metrics-host", env.metrics_host), ("--save-model", env.save_model),
                        ("--save-record", env.save_record), ("--slowdown", env.slowdown)):
        if value:
            argv += [flag, value]
    if env.num_threads:
        argv += ["--num-threads", str(env.num_threads)]
    argv += env.checkpoint.flags()
    return argv + (["--quiet"] if quiet else [])


def describe_exit(code: int) -> str:
    """How a child ended, in words: "exited with code 1", "was killed by SIGABRT (signal
    6)" (Popen reports a death by signal N as -N)."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "a signal"
    return f"was killed by {name} (signal {-code})"


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    argv: list[str]
    env: dict[str, str]
    cwd: str | None = None
    restarts: int = 0
    failures: int = 0
    """Of the restarts, those after the child failed (max_failure_restarts bounds them)."""
    unit: int | None = None
    """A worker of several ranks: the number its ranks share. They are one worker: when
    one fails, all of them are started again, together (and never one alone)."""


@dataclass
class WorkerProcesses:
    """Child processes started together and watched until every one has ended."""

    children: list[_Child] = field(default_factory=list)
    capture: Callable[[str, IO[bytes]], None] | None = None
    """Take each child's output (stdout and stderr as one pipe) instead of letting it share
    this process's: called with the child's name and the pipe at every start (a host
    agent streams it to the coordinator)."""
    max_failure_restarts: int = 0
    """Start a child that failed (a non-zero exit, not a restart round's) again, at most
    this often (a host agent: the run's max_restarts)."""
    _signals: int = 0
    _unit_failed_at: dict[int, float] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str],
              cwd: str | None = None, unit: int | None = None) -> None:
        """Start a child; `unit`: the worker it is a rank of, with the others started with
        the same number (a worker of several ranks, whose ranks restart together)."""
        # A process group of its own (a terminal's Ctrl-C then reaches this process only),
        # not a session of its own: with the kernel's autogroup scheduling (on by default
        # on desktops and here), every session is scheduled as one unit, and workers in
        # sessions of their own got unequal CPU shares (measured with a2cid2 on digits,
        # 4 workers on 2 cores: 174-1490 steps each in one run instead of 783-825, and a
        # quarter of the pairwise exchanges).
        self.children.append(_Child(name, self._popen(name, argv, env, cwd), argv, env, cwd,
                                    unit=unit))

    def _popen(self, name: str, argv: list[str], env: dict[str, str],
               cwd: str | None) -> subprocess.Popen[bytes]:
        if self.capture is None:
            return subprocess.Popen(argv, env=env, cwd=cwd, process_group=0)
        process = subprocess.Popen(argv, env=env, cwd=cwd, process_group=0,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert process.stdout is not None
        self.capture(name, process.stdout)
        return process

    def restart_ordered(self) -> list[str]:
        """Start again every child that ended with RESTART_EXIT_CODE (a restart round of
        its lock-step run), or failed within max_failure_restarts; not after a signal was
        passed on: the names restarted."""
        restarted = self._restart_units()
        for c in self.children:
            if c.unit is None and self.will_restart(c):
                code = c.process.returncode
                c.restarts += 1
                if code != RESTART_EXIT_CODE:
                    c.failures += 1
                    logger.warning("%s %s; starting it again (failure %d of at most %d)",
                                   c.name, describe_exit(code), c.failures,
                                   self.max_failure_restarts)
                else:
                    logger.info("%s restarts (restart %d): it registers anew and restores "
                                "the run's last checkpoint", c.name, c.restarts)
                c.process = self._popen(c.name, c.argv, c.env, c.cwd)
                restarted.append(c.name)
        return restarted

    def _restart_units(self) -> list[str]:
        """Start again, together, the ranks of each worker of several ranks one of which
        failed (within max_failure_restarts), once all of them have ended: those still
        running are killed after UNIT_EXIT_SECONDS. They meet at a new address."""
        restarted = []
        for unit in dict.fromkeys(c.unit for c in self.children if c.unit is not None):
            ranks = self._ranks_of(unit)
            if not self.will_restart(ranks[0]):
                self._unit_failed_at.pop(unit, None)
                continue
            failed_at = self._unit_failed_at.setdefault(unit, time.monotonic())
            running = [c for c in ranks if c.process.poll() is None]
            if running and time.monotonic() - failed_at < UNIT_EXIT_SECONDS:
                continue
            for c in running:
                logger.warning("%s still runs %.0f s after another rank of its worker "
                               "failed: killing it", c.name, UNIT_EXIT_SECONDS)
                c.process.kill()
                c.process.wait()
            self._unit_failed_at.pop(unit)
            why = "; ".join(f"{c.name} {describe_exit(c.process.returncode)}" for c in ranks
                            if c.process.returncode != 0)
            logger.warning("%s; starting its worker's %d ranks again (failure %d of at most "
                           "%d)", why, len(ranks), ranks[0].failures + 1,
                           self.max_failure_restarts)
            meeting = renewed_address(ranks[0].env)
            for c in ranks:
                c.restarts += 1
                c.failures += 1
                if meeting:
                    c.env = {**c.env, "RIPPLES_REPLICA_ADDRESS": meeting}
                c.process = self._popen(c.name, c.argv, c.env, c.cwd)
                restarted.append(c.name)
        return restarted

    def _ranks_of(self, unit: int) -> list[_Child]:
        """The children of one worker of several ranks, in rank order."""
        return [c for c in self.children if c.unit == unit]

    def will_restart(self, child: _Child) -> bool:
        """`restart_ordered` starts the child again: it ended for a restart round (up to
        MAX_PROCESS_RESTARTS), or failed (up to max_failure_restarts), and no signal was
        passed on; a rank of a worker of several ranks: one of its worker's ranks failed
        (within max_failure_restarts), even while it runs itself. Not the child's end."""
        if child.unit is not None and not self._signals:
            failed = any(c.process.poll() not in (None, 0) for c in self._ranks_of(child.unit))
            return failed and child.failures < self.max_failure_restarts
        code = child.process.poll()
        if code is None or self._signals:
            return False
        if code == RESTART_EXIT_CODE:
            return child.restarts < MAX_PROCESS_RESTARTS
        return code != 0 and child.failures < self.max_failure_restarts

    @property
    def signalled(self) -> bool:
        """A signal was passed on to the children."""
        return self._signals > 0

    def alive(self) -> bool:
        return any(c.process.poll() is None or self.will_restart(c) for c in self.children)

    def failures(self) -> list[str]:
        """The children that ended with an error, named with their exit codes."""
        return [f"{c.name} (pid {c.process.pid}) {describe_exit(c.process.returncode)}"
                for c in self.children
                if c.process.returncode is not None and c.process.returncode != 0
                and not self.will_restart(c)]

    def pass_signal(self, signum: int) -> None:
        """First call: SIGTERM to every child (it finishes its step and leaves the run);
        later calls: SIGKILL."""
        self._signals += 1
        sent = signal.SIGTERM if self._signals == 1 else signal.SIGKILL
        for c in self.children:
            if c.process.poll() is None:
                try:
                    os.kill(c.process.pid, sent)
                except ProcessLookupError:
                    pass

    def terminate(self, grace_seconds: float = TERMINATE_GRACE_SECONDS) -> None:
        """Stop every child that still runs: SIGTERM (unless a signal was passed on
        already), then SIGKILL after the grace time."""
        if not self.alive():
            return
        if not self._signals:
            self.pass_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_seconds
        while self.alive() and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        for c in self.children:
            if c.process.poll() is None:
                c.process.kill()
            c.process.wait()

    def wait_all(self) -> int:
        """Wait for every child, passing SIGINT/SIGTERM/SIGHUP on; returns 0 if all
        succeeded, else the exit code of the first to fail (in time; one killed by signal
        N gives 128+N, as a shell does). Every failure is named in the log."""
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                handlers[signum] = signal.signal(
                    signum, lambda s, _f: self.pass_signal(s))
        ended: list[_Child] = []  # in the order they were seen to end
        try:
            while len(ended) < len(self.children):
                self.restart_ordered()
                for c in self.children:
                    if (c not in ended and c.process.poll() is not None
                            and not self.will_restart(c)):
                        ended.append(c)
                time.sleep(POLL_SECONDS)
        finally:
            for signum, previous in handlers.items():
                signal.signal(signum, previous)
        for line in self.failures():
            logger.error("%s", line)
        failed = [c for c in ended if c.process.returncode != 0]
        if not failed:
            return 0
        code = failed[0].process.returncode
        return 128 - code if code < 0 else code
