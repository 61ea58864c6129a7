"""The run queue: submitted runs, one active at a time, and their history.

A coordinator process keeps every run in its history (coordinator/history.py): runs
submitted with `ripples submit` queue, the oldest becomes the active run when none is,
and the active run has its own `CoordinatorService` (coordinator/service.py), which the
Worker RPCs reach through coordinator/worker_gateway.py, unchanged from the one-run
coordinator. When the active run has stopped and its workers have left, its final status
goes into the history and the next queued run becomes active.

What makes runs safe to run one after another on the same workers' hosts:
- worker ids are unique across runs (the history counts them), so a straggler of an
  ended run is refused and never taken for a worker of the next one;
- every run's keys in the shared rendezvous store live under `run/<run id>/`;
- a worker started for one run (RIPPLES_RUN_ID, set by its agent) is refused by another
  (worker_gateway.py).

One active run at a time is the design (a worker pool serves one run, as a training
cluster's queue does); docs/service.md says why.
"""

from __future__ import annotations

import asyncio
import logging
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError

from ripples import events
from ripples.coordinator import run_graph, snapshot
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, WorkerState
from ripples.coordinator.history import ENDED, RunHistory, state_name
from ripples.coordinator.http import SdTargets
from ripples.coordinator.run_graph import RankGraph
from ripples.coordinator.service import CoordinatorService
from ripples.coordinator.state_dir import RECOVER, StateLost
from ripples.coordinator.state_store import StateStore
from ripples.guarded import guarded_loop
from ripples.protocols.registry import check_ranks_per_worker
from ripples.run_records import printable
from ripples.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

WATCH_SECONDS = 0.25
"""How often the queue checks whether the active run ended."""
FINISH_GRACE_SECONDS = 60.0
"""After the active run stopped, how long its workers have to leave (the final average,
their last reports) before it is closed anyway; the lease reaper marks dead ones sooner."""
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A submitted run id: it names files in the state dir."""
DAMAGED = (ValueError, TypeError, KeyError, DecodeError)
"""What reading, building or showing a run whose stored record is bad raises (options an
older version or a hand edit left, a row that cannot be decoded, a value the proto cannot
hold): that run fails or shows as damaged; no other run is touched."""
MAX_NAME_CHARS = 200
"""A run's name at most (it is a table's cell, a log line's word)."""
MAX_PATH_CHARS = 4096
"""A workdir, or one word of a run's command, at most (Linux's PATH_MAX)."""
MAX_COMMAND_WORDS = 1024
"""A run's command's words at most; every run's row carries them to every agent."""


@dataclass
class ActiveRun:
    """The run the workers' RPCs address now."""

    info: pb.RunInfo
    service: CoordinatorService
    state: StateStore | None
    stopped_at: float | None = None
    """When the queue first saw it stopped (its workers' grace starts)."""
    operator_stop: bool = False
    """An operator stopped it (StopRun): it ends as stopped."""


def default_name(options: dict[str, Any], command: list[str]) -> str:
    """A run's name when none is given: protocol and task, or the script's name (its
    file's stem, `python -m`'s module, or the command itself)."""
    what = str(options.get("task") or "")
    if command:
        if "-m" in command[:-1]:
            what = command[command.index("-m") + 1].rpartition(".")[2]
        else:
            what = next((Path(a).stem for a in command if a.endswith(".py")),
                        Path(command[0]).name)
    return f"{options.get('protocol', 'run')}-{what or 'script'}"


class RunQueue:
    """The runs of one coordinator process: the queue, the active run, the history."""

    def __init__(
        self,
        history: RunHistory,
        *,
        state_dir: str,
        store: Any,
        store_host: str,
        store_port: int,
        incarnation: int,
        resume_workers: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
            history: the runs' history (its SQLite file in the state dir, or in memory).
            state_dir: where runs' state and logs live ("": a temporary directory for
                this process's life).
            store: the rendezvous store (a TCPStore, or None in tests): each run sees its
                own prefix of it.
            store_host: the store's address, as workers reach it.
            store_port: its port.
            incarnation: the coordinator's incarnation (1, then one more per restart).
            resume_workers: a resumed run's workers are gone too; a new set continues
                their ranks (`ripples run --resume`).
            clock: the coordinator's clock.
        """
        self.history = history
        self.store = store
        self.store_host = store_host
        self.store_port = store_port
        self.incarnation = incarnation
        self.resume_workers = resume_workers
        self.clock = clock
        self.metrics_address = ""
        self._temp: tempfile.TemporaryDirectory[str] | None = None
        if state_dir:
            self.state_dir = Path(state_dir)
        else:  # runs' state and logs for this process's life only
            self._temp = tempfile.TemporaryDirectory(prefix="ripples-coordinator-")
            self.state_dir = Path(self._temp.name)
        self._persistent = bool(state_dir)
        self.active: ActiveRun | None = None
        self.last_service: CoordinatorService | None = None
        """The active run's service, or the last run's once it ended (tests, `ripples
        run`)."""
        self.changed = asyncio.Event()
        """Set (and replaced) when the active run or an agent's share changes: the host
        agents' long-polls wait on it."""
        self._watcher: asyncio.Task[None] | None = None
        self._activating = asyncio.Lock()
        """Held while a queued run is being made active: its settings are checked in a
        worker thread (activate_next), so two activations could otherwise interleave."""
        self._configs: dict[str, pb.RunConfig] = {}
        """The settings of queued runs shown before they start (their status), by run id,
        built once, off the loop (status); dropped when the run starts or ends."""

    # ------------------------------------------------------------------ life
    async def start(self, run: RunSettings | None) -> None:
        """Resume the run the history holds as active (a coordinator restart), submit
        `run` if the history is empty (the one-run form), start the next queued run."""
        running = self.history.running()
        if running is not None:
            try:
                self._open(running, resume=True)
            except StateLost:
                raise  # the dir lost the run's state: refused (coordinator/state_dir.py)
            except DAMAGED as err:  # stored by an older version, or edited
                self._fail_start(running, f"could not resume: {err}")
            except OSError as err:  # the disk or the system, maybe for a moment: the run
                # stays as it is and the coordinator refuses to start; fix and restart
                raise OSError(f"cannot resume the active run {running.run_id}: {err}; "
                              "fix that and start the coordinator again") from err
        elif run is not None and not self.history.runs():
            self.submit(run.options(), name="", command=[], workdir="")
        await self.activate_next()
        self._watcher = asyncio.get_running_loop().create_task(
            guarded_loop("run-watcher", self._watch, WATCH_SECONDS))

    async def close(self) -> None:
        """Shutting down: end the active run's long-polls (its state stays resumable).
        Calls may still arrive until the gRPC server stopped; then `release`."""
        if self._watcher is not None:
            self._watcher.cancel()
        if self.active is not None:
            await self.active.service.close()

    def release(self) -> None:
        """After the gRPC server stopped: close the files, free the store."""
        if self.active is not None and self.active.state is not None:
            self.active.state.close()
        self.history.close()
        if self._temp is not None:
            self._temp.cleanup()
        # Drop every reference to the rendezvous store: it closes, and its port is free.
        self.store = None
        if self.last_service is not None:
            self.last_service.consensus.store = None

    def run_dir(self, run_id: str) -> Path:
        """Where a run's state and logs live."""
        return self.state_dir / "runs" / run_id

    def signal_change(self) -> None:
        """Wake every agent's long-poll: the active run or a share changed."""
        self.changed.set()
        self.changed = asyncio.Event()

    def is_active(self, run_id: str) -> bool:
        return self.active is not None and self.active.info.run_id == run_id

    def inactive_reason(self) -> str:
        """Why no run is active, for a call that needs one."""
        queued = len(self.history.queued())
        return ("no run is active yet; the next one is being started" if queued else
                "no run is active (0 queued): submit one with `ripples submit`")

    # ------------------------------------------------------------------ submitting
    def submit(self, options: dict[str, Any], *, name: str, command: list[str],
               workdir: str, ranks_per_worker: int = 1) -> pb.RunInfo:
        """Queue a run; ValueError (nothing stored) when its options are wrong (or its
        workers of `ranks_per_worker` processes would refuse them)."""
        _check_submitted(name, command, workdir)
        options = dict(options)
        if not options.get("run_id"):
            options.pop("run_id", None)
        elif not RUN_ID.fullmatch(str(options["run_id"])):  # it names files in the state dir
            raise ValueError(f"run_id {options['run_id']!r}: use 1-64 letters, digits, '.', "
                             "'_' or '-', starting with a letter or digit")
        settings = RunSettings.build(**options)  # validates: ValueError names the option
        if command and settings.task:
            raise ValueError("give --task or a script after --, not both")
        check_ranks_per_worker(ranks_per_worker, settings.to_proto(), command)
        options = settings.options()
        info = pb.RunInfo(
            run_id=settings.run_id, name=name or default_name(options, command),
            state=pb.RUN_STATE_QUEUED, submitted_at=time.time(), protocol=settings.protocol,
            num_workers=settings.num_workers, task=settings.task, command=command,
            workdir=workdir, ranks_per_worker=ranks_per_worker)
        self.history.add(info, options)
        return info

    def cancel(self, info: pb.RunInfo, reason: str) -> None:
        """Cancel a queued run."""
        info.state, info.ended_at, info.stop_reason = (pb.RUN_STATE_CANCELLED, time.time(),
                                                       reason)
        self._configs.pop(info.run_id, None)
        self.history.update(info)
        logger.info("queued run %s cancelled: %s", info.run_id, reason)

    async def activate_next(self, *, announce: bool = False) -> None:
        """Make the oldest queued run the active one, if none is (`announce`: log it; not
        at the start, where `serve` prints the run)."""
        async with self._activating:
            while self.active is None:
                queued = self.history.queued()
                if not queued:
                    return
                info = queued[0]
                try:
                    # Off the loop: a large run's topology takes a second or more to build
                    # and check, and as long again to build its graph (run_graph.prepare:
                    # the forming then maps it to worker ids), while the loop answers
                    # every other call.
                    settings = await asyncio.to_thread(self._settings, info.run_id)
                    prepared = await asyncio.to_thread(run_graph.prepare, settings)
                    current = self.history.get(info.run_id)
                    if current is None or current.state != pb.RUN_STATE_QUEUED:
                        continue  # cancelled meanwhile
                    info.state = pb.RUN_STATE_RUNNING
                    info.started_at = time.time()
                    self._open(info, resume=False, settings=settings, prepared=prepared)
                except StateLost:
                    raise
                except DAMAGED as err:  # its options no longer hold
                    self._fail_start(info, f"could not start: {err}")
                    announce = True
                    continue
                except OSError as err:  # the disk (full?) or the system, maybe for a
                    # moment: the run stays queued and the watcher tries it again
                    info.state, info.started_at = pb.RUN_STATE_QUEUED, 0.0
                    logger.error("run %s stays queued: it could not start: %s",
                                 info.run_id, err)
                    return
                self._configs.pop(info.run_id, None)  # its status is the live one now
                self.history.update(info)
                if announce:
                    logger.info("run %s (%s) is the active run", info.run_id, info.name)

    def _fail_start(self, info: pb.RunInfo, reason: str) -> None:
        """A run that cannot start (or resume) ends failed with the reason; the queue goes
        on with the next one."""
        info.state, info.ended_at, info.stop_reason = pb.RUN_STATE_FAILED, time.time(), reason
        self._configs.pop(info.run_id, None)
        self.history.update(info)
        logger.error("run %s %s", info.run_id, reason)

    def _settings(self, run_id: str) -> RunSettings:
        """A stored run's settings, checked again (thread-safe: the history locks)."""
        return RunSettings.build(**self.history.options(run_id))

    def _open(self, info: pb.RunInfo, *, resume: bool, settings: RunSettings | None = None,
              prepared: RankGraph | None = None) -> None:
        """The run's core and service: new (from `settings`, else its stored options), or
        resumed from its state after a restart; `prepared`: its graph on ranks, built
        ahead (run_graph.prepare)."""
        state = StateStore(self.run_dir(info.run_id)) if self._persistent else None
        try:
            self._serve(info, state, resume=resume, settings=settings, prepared=prepared)
        except BaseException:  # not opened: its file is not held open either
            if state is not None:
                state.close()
            raise

    def _serve(self, info: pb.RunInfo, state: StateStore | None, *, resume: bool,
               settings: RunSettings | None, prepared: RankGraph | None) -> None:
        """_open's run service on its opened `state`."""
        import torch.distributed as dist

        now = self.clock()
        saved = state.load() if state is not None and resume else None
        if state is not None and resume and saved is None:
            # A new run's state is stored before the history calls it running (below):
            # an active run without one lost it (state_dir.check_active_run refused a
            # missing or empty file already), and starting it afresh would forget its
            # workers and hand their ids out again.
            raise StateLost(
                f"the active run {info.run_id} has lost its state: {state.path} holds no "
                f"saved run (its tables are empty); {RECOVER}")
        if saved is not None:
            core = snapshot.restore(saved, now, self.incarnation, wall=time.time(),
                                    resume=self.resume_workers)
            logger.warning("resumed run %s (incarnation %d): %d live workers, %.0f mean "
                           "iterations", info.run_id, self.incarnation, len(core.live()),
                           core.mean_iterations())
        else:
            settings = settings or self._settings(info.run_id)
            core = CoordinatorCore(settings, now=now,
                                   first_worker_id=self.history.meta("next_worker_id"))
            core.prepared_graph = prepared
        store = (dist.PrefixStore(f"run/{info.run_id}/", self.store)
                 if self.store is not None else None)
        service = CoordinatorService(core, store_host=self.store_host,
                                     store_port=self.store_port, state=state,
                                     incarnation=self.incarnation, store=store,
                                     clock=self.clock)
        if saved is not None:
            service.restored({int(k): v for k, v in saved.get("metrics_targets", {}).items()})
        elif state is not None:  # stored before the history calls the run running
            state.save(snapshot.take(core, now, time.time()))
        service.metrics_address = self.metrics_address
        service.start_background()
        self.active = ActiveRun(info, service, state)
        self.last_service = service
        self.signal_change()

    # ------------------------------------------------------------------ ending
    async def _watch(self) -> None:
        """One round: close the active run once it stopped and its workers left (or
        their grace ran out); start the next one when none is active."""
        active = self.active
        if active is None:
            await self.activate_next(announce=True)
            return
        if not active.service.core.stopped:
            return
        now = self.clock()
        if active.stopped_at is None:
            active.stopped_at = now
        if active.service.core.live() and now - active.stopped_at < FINISH_GRACE_SECONDS:
            return
        await self._finish(active)

    async def _finish(self, active: ActiveRun) -> None:
        service, info = active.service, active.info
        try:
            status = service.run_status()
            info.state = _end_state(active, status)
            info.stop_reason = status.stop_reason
        except DAMAGED as err:  # it still ends, and the queue goes on
            status = pb.RunStatus(stopped=True)
            info.state = pb.RUN_STATE_FAILED
            info.stop_reason = f"{service.core.stop_reason}; damaged record: {err}"
        info.ended_at = time.time()
        fill_progress(info, status)
        status.run.CopyFrom(info)
        await service.save_state()
        await service.close()
        if active.state is not None:
            active.state.close()
        self.history.set_meta("next_worker_id", service.core.registry.next_worker_id)
        self.history.update(info, status)
        self.active = None
        self.signal_change()
        logger.info("run %s (%s) %s: %s", info.run_id, info.name, state_name(info.state),
                    info.stop_reason)
        done = [w.progress.iteration for w in service.core.registry.counted()]
        events.emit(events.RUN_ENDED, run_id=info.run_id, state=state_name(info.state),
                    reason=info.stop_reason, iterations=sum(done),
                    max_worker_iterations=max(done, default=0))
        await self.activate_next(announce=True)

    # ------------------------------------------------------------------ views
    def run_info(self, info: pb.RunInfo) -> pb.RunInfo:
        """The history's row, with the live figures of the active run and queue places."""
        shown = pb.RunInfo()
        shown.CopyFrom(info)
        if self.active is not None and self.active.info.run_id == info.run_id:
            shown.CopyFrom(self.active.info)
            try:
                fill_progress(shown, self.active.service.run_status())
            except DAMAGED as err:  # listed as such; the other runs are listed as ever
                shown.stop_reason = f"damaged record: {err}"
        elif info.state == pb.RUN_STATE_QUEUED:
            ids = [q.run_id for q in self.history.queued()]
            shown.queue_position = ids.index(info.run_id) + 1 if info.run_id in ids else 0
        return shown

    async def status(self, info: pb.RunInfo, *, all_workers: bool = False) -> pb.RunStatus:
        """A run's status: the active run's live one (`all_workers`: with every worker's
        row), an ended run's final one from the history (as bounded as it was), or what
        was submitted (queued, or ended before it started)."""
        try:
            if self.active is not None and info.run_id == self.active.info.run_id:
                status = self.active.service.run_status(all_workers=all_workers)
                status.run.CopyFrom(self.run_info(info))
                return status
            final = self.history.final_status(info.run_id)
            if final is not None:
                final.run.CopyFrom(info)  # the newest row (the model's path comes later)
                return final
            config = self._configs.get(info.run_id)
            if config is None:  # checked off the loop, once (a large run's topology)
                settings = await asyncio.to_thread(self._settings, info.run_id)
                config = self._configs.setdefault(info.run_id, settings.to_proto())
            return pb.RunStatus(config=config, run=self.run_info(info),
                                stopped=info.state in ENDED, stop_reason=info.stop_reason)
        except DAMAGED as err:  # what the row holds, and why there is no more
            shown = pb.RunInfo()
            shown.CopyFrom(info)
            shown.stop_reason = f"damaged record: {err}"
            return pb.RunStatus(run=shown, stopped=info.state in ENDED,
                                stop_reason=shown.stop_reason)

    def find(self, run_id: str) -> pb.RunInfo | None:
        """A run by its id, a unique prefix of one, or its unique name."""
        return self.history.get(run_id) if run_id else None

    def discovery(self) -> SdTargets:
        """Prometheus HTTP service discovery: the active run's, else the coordinator."""
        if self.active is not None:
            return self.active.service.discovery()
        return ([{"targets": [self.metrics_address], "labels": {"role": "coordinator"}}]
                if self.metrics_address else [])

    def finished(self) -> bool:
        """Every run submitted so far has ended (`--exit-when-done`)."""
        runs = self.history.runs()
        return bool(runs) and all(r.state in ENDED for r in runs)


def _check_submitted(name: str, command: list[str], workdir: str) -> None:
    """ValueError naming the field when a run's name, command or workdir is too long, or
    a name holds a character a terminal or a log line would act on (a newline, an escape
    sequence)."""
    if len(name) > MAX_NAME_CHARS:
        raise ValueError(f"name: at most {MAX_NAME_CHARS} characters, got {len(name)}")
    if not name.isprintable():
        raise ValueError(f"name '{printable(name[:60])}' holds control characters (a "
                         "newline, an escape sequence): use printable text")
    if len(command) > MAX_COMMAND_WORDS:
        raise ValueError(f"command: at most {MAX_COMMAND_WORDS} words, got {len(command)}")
    for label, text in [("workdir", workdir), *(("command", word) for word in command)]:
        if len(text) > MAX_PATH_CHARS or "\0" in text:
            raise ValueError(f"{label}: a word of at most {MAX_PATH_CHARS} characters and "
                             "no NUL")


def _end_state(active: ActiveRun, status: pb.RunStatus) -> pb.RunState:
    """Stopped (by an operator), failed (it never trained, a failure stopped it, or no
    worker left cleanly) or finished (its budget or target)."""
    if active.operator_stop or active.service.stopped_at_root:
        return pb.RUN_STATE_STOPPED
    clean = any(w.state is WorkerState.LEFT for w in active.service.core.workers.values())
    if not status.started or not clean or active.service.core.stopped_by_failure:
        return pb.RUN_STATE_FAILED
    return pb.RUN_STATE_FINISHED


def fill_progress(info: pb.RunInfo, status: pb.RunStatus) -> None:
    """A run's row gets its status's progress: loss, elapsed time, mean iterations."""
    # Once every worker left there is no live loss: the curve's last point is the run's.
    info.mean_loss = status.mean_loss or (status.loss_curve[-1].loss if status.loss_curve
                                          else 0.0)
    info.elapsed_seconds = status.elapsed_seconds
    if status.num_worker_rows:
        info.mean_iterations = status.mean_iterations
