"""`ripples.init()` and the `Worker` it returns: this process's place in a run.

With a coordinator in the launch environment (worker/launch_env.py), `init()` registers
with it and waits until every expected worker has: `rank` and `num_workers` are then the
run's. Without one, the process trains alone (single-process mode): rank 0 of 1, and
`ripples.Optimizer.step()` is the plain step.

The worker leaves the run when the process ends (an `atexit` hook), or earlier with
`worker.shutdown()`. An exception that ends the script marks the worker FAILED with that
error (never a clean leave); a clean end saves the final model where the launcher asked
(`ripples run` averages them into the consensus model). The first SIGTERM asks the
worker to stop after its current step (`opt.stopped` turns True), a second one ends the
process; a handler the script installed itself is left alone.
"""

from __future__ import annotations

import atexit
import json
import logging
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ripples.files import write_atomically
from ripples.worker.client import PROCESS_RESTART
from ripples.worker.collective_watch import COLLECTIVES
from ripples.worker.launch_env import LaunchEnv
from ripples.worker.replica import Replica, full_state_dict
from ripples.worker.replica_session import FollowerSession
from ripples.worker.session import Session, resolve_device, take_process_settings

if TYPE_CHECKING:
    from ripples.worker.optimizer import Optimizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """The run's settings a training script may follow (`ripples run --seed 3 ...`).
    Zero or empty: not set (the script's own defaults apply)."""

    protocol: str = ""
    """The synchronisation protocol ("" in single-process mode)."""
    task: str = ""
    """The run's built-in task, if it has one."""
    seed: int = 0
    batch_size: int = 0
    learning_rate: float = 0.0
    iterations: int = 0
    """Per-worker iteration budget."""
    epochs: float = 0.0
    target_loss: float = 0.0


class Worker:
    """This process in the run (from `ripples.init()`)."""

    def __init__(self, env: LaunchEnv, session: Session | None,
                 replica: Replica | None = None) -> None:
        self.env = env
        self._session = session
        self._replica = replica
        self._optimizer: Optimizer | None = None
        self._shut_down = False
        self.device: torch.device = session.device if session is not None \
            else resolve_device(env)
        """The torch device this worker trains on: cuda:<local rank> when CUDA is
        available (or the launch's RIPPLES_DEVICE), else cpu."""
        if session is None:
            take_process_settings(env, self.device)
            self.settings = RunInfo()
        else:
            c = session.config
            self.settings = RunInfo(protocol=c.protocol, task=c.task, seed=c.seed,
                                    batch_size=c.batch_size, learning_rate=c.learning_rate,
                                    iterations=c.iterations, epochs=c.epochs,
                                    target_loss=c.target_loss)

    @property
    def rank(self) -> int:
        """This worker's rank in the run, 0..num_workers-1 (by host name, then local rank)."""
        return self._session.membership.rank if self._session is not None else 0

    @property
    def num_workers(self) -> int:
        return self._session.membership.num_workers if self._session is not None else 1

    @property
    def local_rank(self) -> int:
        """Index of this process on its host (the launcher's LOCAL_RANK)."""
        return self.env.local_rank

    @property
    def ranks_per_worker(self) -> int:
        """How many processes make up this worker (`--ranks-per-worker`): 1, or G > 1
        ranks that shard the model with FSDP2 over `mesh`."""
        return self.env.ranks_per_worker

    @property
    def rank_in_worker(self) -> int:
        """This process's index among its worker's ranks (0: the one that talks to the
        coordinator); 0 on a worker of one rank."""
        return self._replica.rank if self._replica is not None else 0

    @property
    def mesh(self) -> DeviceMesh:
        """The device mesh over this worker's ranks, one-dimensional ("shard"): shard the
        model over it with `fully_shard(module, mesh=worker.mesh)`. ValueError on a
        worker of one rank (nothing to shard over)."""
        if self._replica is None:
            raise ValueError("this worker is one rank, with no mesh to shard over: launch "
                             "it with --ranks-per-worker G (RIPPLES_RANKS_PER_WORKER)")
        return self._replica.mesh

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The process group of this worker's ranks (the mesh's); ValueError on a worker
        of one rank."""
        if self._replica is None:
            raise ValueError("this worker is one rank, with no process group of its own: "
                             "launch it with --ranks-per-worker G (RIPPLES_RANKS_PER_WORKER)")
        return self._replica.group

    @property
    def is_distributed(self) -> bool:
        """False in single-process mode."""
        return self._session is not None

    @property
    def worker_id(self) -> int | None:
        """The coordinator's id of this worker (None in single-process mode)."""
        return self._session.worker_id if self._session is not None else None

    @property
    def protocol(self) -> str:
        return self.settings.protocol

    def request_stop(self) -> None:
        """Ask this worker to stop after its current step (`opt.stopped` turns True)."""
        if self._session is not None:
            self._session.local_stop.set()
            self._session.restart.decline()  # asked to leave: it leaves, even mid-restart

    def _register_optimizer(self, optimizer: Optimizer) -> None:
        if self._shut_down:
            raise RuntimeError("this worker has left the run; call ripples.init() again")
        if self._optimizer is not None:
            raise ValueError("one ripples.Optimizer per process: this worker already has one")
        self._optimizer = optimizer

    def shutdown(self, error: str = "") -> None:
        """Leave the run: cleanly, or FAILED with `error`. Saves the final model (and this
        worker's record) where the launcher asked, after a clean end. Idempotent; runs at
        exit if the script does not call it."""
        global _current
        if self._shut_down:
            return
        self._shut_down = True
        session = self._session
        try:
            record = self._optimizer._finish(error) if self._optimizer is not None else None
            if not error and session is not None and session.fatal_error:
                error = session.fatal_error
            if not error and self._optimizer is not None and not self.restarting:
                self._save(record)
            if not error and self._replica is not None and self._replica.leads:
                self._replica.settle()  # its other ranks have all it relayed
        except Exception as err:  # noqa: BLE001 (the worker must still leave, failed)
            error = error or f"{type(err).__name__}: {err}"
            logger.error("worker %s could not finish: %s", self.worker_id, error)
        finally:
            if session is not None:
                session.leave(error, self._end_reason(), done=self._done(error))
            with _lock:
                if _current is self:
                    _current = None

    @property
    def restarting(self) -> bool:
        """The coordinator ordered this worker's process to restart (a restart round of a
        lock-step run): it exits with RESTART_EXIT_CODE, its launcher starts it again, and
        the new process restores the run's last checkpoint."""
        return self._session is not None and self._session.restart.pending

    def _done(self, error: str) -> bool:
        """Whether this worker leaves done: its loop ended on its own (or at its own
        budget), not failed, restarting, or asked to stop by a signal (a preemption
        notice: the run shrinks without it)."""
        session = self._session
        return (not error and not self.restarting
                and not (session is not None and session.local_stop.is_set()))

    def _end_reason(self) -> str:
        """Why a clean worker ends: the run's stop, or its own loop's end."""
        if self.restarting:
            assert self._session is not None
            return f"restarting ({self._session.restart.reason})"
        opt = self._optimizer
        if opt is None:
            return "it made no optimizer step"
        reason = getattr(opt, "stop_reason", "")
        steps = getattr(opt, "local_step", 0)
        return reason or f"its training loop ended after {steps} steps"

    def _save(self, record: dict[str, object] | None) -> None:
        assert self._optimizer is not None
        if self.env.save_model:
            model = self._optimizer.model
            if self._replica is not None:  # every rank sends its shards to rank 0
                state = full_state_dict(model)
                if not self._replica.leads:
                    return
            else:  # copies of the views into the averaged state (ripples/state_dicts.py)
                state = model.state_dict()
            write_atomically(Path(self.env.save_model), lambda f: torch.save(state, f))
        if self._replica is not None and not self._replica.leads:
            return
        if self.env.save_record and record is not None:
            write_atomically(Path(self.env.save_record),
                             (json.dumps(record) + "\n").encode())


_current: Worker | None = None
_lock = threading.Lock()
_uncaught: list[str] = []  # the error that is ending the process, if any
_hooks_installed = False


def init(*, coordinator: str | None = None, device: str | None = None, host: str | None = None,
         local_rank: int | None = None, num_threads: int | None = None,
         env: LaunchEnv | None = None) -> Worker:
    """Join the run this process was launched into, or train alone without one.

    Reads the launch environment (RIPPLES_COORDINATOR and RIPPLES_*, torchrun, SLURM,
    Kubeflow; see worker/launch_env.py); keyword arguments override it. Returns the same
    Worker on every call until it shuts down.

    Raises:
        ValueError: a malformed launch environment or argument.
        ripples.worker.client.CoordinatorCallError: the coordinator is unreachable, or
            refused this worker, or the other workers did not register in time.
    """
    global _current
    overrides = {"coordinator": coordinator, "device": device, "host": host,
                 "local_rank": local_rank, "num_threads": num_threads}
    with _lock:
        if _current is not None:
            current = vars(_current.env)
            conflicts = {k: v for k, v in overrides.items()
                         if v is not None and current.get(k) != v}
            if conflicts:
                raise ValueError(f"ripples.init() already ran with other settings "
                                 f"({', '.join(f'{k}={current.get(k)!r}' for k in conflicts)});"
                                 " shut the worker down first")
            return _current
        launch = (env or LaunchEnv.from_environ()).replace(**overrides)
        session = None
        replica = Replica(launch, resolve_device(launch)) if launch.sharded else None
        if launch.distributed:
            _install_exit_hooks()  # before joining: a restart round may end the start
            session = (FollowerSession(launch, replica)
                       if replica is not None and not replica.leads
                       else Session(launch, replica=replica))
            try:
                session.join()
            except BaseException as err:
                session.leave(f"{type(err).__name__}: {err}")
                raise
        _current = Worker(launch, session, replica)
        _install_exit_hooks()
        return _current


def current_worker() -> Worker | None:
    """The Worker `init()` returned, while it has not shut down."""
    return _current


def _install_exit_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_at_exit)
    previous = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException,
                   tb: TracebackType | None) -> None:
        _uncaught.append(COLLECTIVES.error_text(kind, value))
        previous(kind, value, tb)

    sys.excepthook = excepthook
    if (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    worker = _current
    if worker is None or worker._session is None or worker._session.local_stop.is_set():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
        return
    logger.warning("SIGTERM: finishing the current step, then leaving (again: exit now)")
    worker.request_stop()


def _at_exit() -> None:
    worker = _current
    if worker is None:
        if PROCESS_RESTART.pending:  # a restart round ended this worker's start
            PROCESS_RESTART.action()
        return
    error = _uncaught[-1] if _uncaught else ""
    if error:
        logger.debug("leaving after an uncaught error: %s", error)
    try:
        worker.shutdown(error)
    except Exception:  # noqa: BLE001 (nothing is left to report it to at exit)
        traceback.print_exc()
    if worker.restarting:  # the launcher starts this process again
        PROCESS_RESTART.action()
