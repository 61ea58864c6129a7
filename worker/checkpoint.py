"""`ripples.Checkpointer`: a worker's periodic checkpoints, and resuming from them.

    ckpt = ripples.Checkpointer(opt, scheduler=scheduler, sampler=sampler,
                                samples_per_step=batch_size)
    start = ckpt.restore()             # the step restored, 0 if there was none
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            ...; opt.step(); scheduler.step()
            ckpt.step()                # saves when the interval says, and when the run stops

Each worker writes its own files, DIR/rank-R/step-S.pt (R: the run's rank of the
worker), holding everything its training loop needs to go on as if it had never stopped:
the model, the optimizer (with Ripples' step counters), the protocol's own state
(a2cid2's momentum copy), every stateful object the script names (scheduler, sampler,
GradScaler, ...), and the random number generators (torch's, CUDA's, Python's, numpy's).
A script with a checkpoint format of its own gives its callables instead
(`Checkpointer(opt, state_dict=fn, load_state_dict=fn)`): the files then hold what its
`state_dict()` returns in place of the model, the optimizer and the generators
(worker/checkpoint_content.py), and take part in restart rounds all the same.

**The cut.** `step()` belongs after the step's last change of state (the optimizer's and
the scheduler's steps): a checkpoint of step S is the state right after step S. The
sampler resumes mid-epoch after the S steps' samples, and the random number generators
are put back when its resumed pass starts (see DistributedSampler._at_next_pass), so a
resumed single-process run ends bit-identical to an uninterrupted one
(tests/unit/test_checkpoint.py proves it).

**Atomic.** A checkpoint is written to a hidden temporary file in its directory, flushed
and fsync'ed, renamed to its final name (os.replace, atomic on POSIX) and the directory
fsync'ed (ripples/files.py: write_atomically): a file under a checkpoint's name is always
whole, whenever the process dies.
Older checkpoints are deleted (beyond the newest `keep`) only after a new one is complete.

**Lock-step protocols** (allreduce, ripples-static: every worker in every collective) need
every worker at the same step: step intervals make them save the same steps (time
intervals are refused), and `restore()` agrees through the run's rendezvous store on the
newest step that every rank holds and can load.

Checkpoints are pickles (torch.save of arbitrary state_dicts): restore only directories
you wrote.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ripples import events
from ripples.files import write_atomically
from ripples.protocols.registry import get_protocol
from ripples.state_dicts import compact_on_cpu
from ripples.worker.checkpoint_content import (
    CheckpointContent,
    ScriptState,
    TrainingState,
    set_rng_state,
)
from ripples.worker.checkpoint_sharded import ShardedCheckpoints, ShardedTrainingState
from ripples.worker.checkpoint_store import NumberedFiles, StoreExchange, agree_on_step
from ripples.worker.collective_watch import rank_describer
from ripples.worker.dataplane.local_rounds import local_steps, next_multiple
from ripples.worker.launch_env import CheckpointInterval
from ripples.worker.optimizer import Optimizer
from ripples.worker.sampler import DistributedSampler

if TYPE_CHECKING:
    from ripples.worker.protocol import Protocol as SyncProtocol

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""The layout of a checkpoint's dictionary; a checkpoint of another version is refused."""


class Stateful(Protocol):
    """Anything with `state_dict()` and `load_state_dict()` (schedulers, samplers,
    GradScaler, your own objects)."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> Any: ...


class Checkpointer:
    """Saves this worker's training state every `every` steps (or seconds), and restores
    the newest checkpoint. With no directory (neither given nor in the launch
    environment) it does nothing and `restore()` returns 0, so a script can always make
    one.

    Args:
        optimizer: The ripples.Optimizer (its model and state, and this worker's rank).
        state_dict: With `load_state_dict`, for a script with a checkpoint format of its
            own: called at each save, it returns what to save (anything torch.save
            writes: typically the model's and optimizer's state_dicts and the script's own
            counters), saved in place of the model, the optimizer and the random number
            generators. None: Ripples saves those.
        load_state_dict: Called by `restore()` with what `state_dict` returned at the step
            restored (its tensors on the CPU). It must load the optimizer's state through
            the optimizer's `load_state_dict` (the ripples.Optimizer's or the wrapped
            one's): its tensors rejoin the averaged state there. `opt.local_step` is set
            to the step restored afterwards.
        directory: Where the workers' checkpoints go, DIR/rank-R/step-S.pt (a worker of
            several ranks: DIR/rank-R/step-S/, a shard per rank,
            worker/checkpoint_sharded.py). None: the launch's `--checkpoint-dir`
            (RIPPLES_CHECKPOINT_DIR), if any.
        every: "500" or 500 (steps), "90s" (seconds; refused by lock-step protocols),
            0 (only `save()` and the save when the run stops). None: the launch's
            `--checkpoint-every` (default 500 steps).
        keep: How many of the newest checkpoints to keep. None: the launch's
            `--keep-checkpoints` (default 3).
        samples_per_step: How many of the sampler's indices one optimizer step consumes
            (the DataLoader's batch size, times the micro-batches of a step with gradient
            accumulation); needed with a ripples.DistributedSampler, which then resumes
            mid-epoch where the training loop was.
        save_on_stop: `step()` also saves when the run has stopped (`opt.stopped`: the
            iteration budget, the coordinator's stop, a SIGTERM), so nothing is lost.
        scheduler, sampler, scaler, **stateful: Objects whose state_dict() the checkpoint
            holds, restored with load_state_dict() under the same names (None: absent).
    """

    def __init__(self, optimizer: Optimizer, *, state_dict: Callable[[], Any] | None = None,
                 load_state_dict: Callable[[Any], object] | None = None,
                 directory: str | os.PathLike[str] | None = None,
                 every: str | int | None = None, keep: int | None = None,
                 samples_per_step: int | None = None, save_on_stop: bool = True,
                 scheduler: Stateful | None = None, sampler: Stateful | None = None,
                 scaler: Stateful | None = None, **stateful: Stateful | None) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"ripples.Checkpointer takes the ripples.Optimizer, got "
                            f"{type(optimizer).__name__}")
        if (state_dict is None) != (load_state_dict is None):
            raise ValueError("give both state_dict and load_state_dict (what to save, and "
                             "how to put it back), or neither (Ripples saves the model, the "
                             "optimizer and the random number generators)")
        launch = optimizer.worker.env.checkpoint
        self.optimizer = optimizer
        replica = optimizer.worker._replica
        if replica is not None and state_dict is not None:
            raise ValueError("a worker of several ranks checkpoints its shards with "
                             "torch.distributed.checkpoint: a script's own state_dict and "
                             "load_state_dict are not taken there")
        self._content: CheckpointContent = (
            ShardedTrainingState(optimizer) if replica is not None
            else TrainingState(optimizer) if state_dict is None or load_state_dict is None
            else ScriptState(optimizer, state_dict, load_state_dict))
        self.interval = CheckpointInterval.parse(launch.checkpoint_every if every is None
                                                 else every)
        self.keep = launch.keep_checkpoints if keep is None else keep
        if self.keep < 1:
            raise ValueError(f"keep must be at least 1, got {self.keep}")
        self.save_on_stop = save_on_stop
        named = {"scheduler": scheduler, "sampler": sampler, "scaler": scaler, **stateful}
        self.objects: dict[str, Stateful] = {k: v for k, v in named.items() if v is not None}
        for name, obj in self.objects.items():
            if not (callable(getattr(obj, "state_dict", None))
                    and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"{name}={type(obj).__name__}: a checkpointed object needs "
                                "state_dict() and load_state_dict()")
        self._sampler = sampler if isinstance(sampler, DistributedSampler) else None
        if self._sampler is not None and (samples_per_step is None or samples_per_step < 1):
            raise ValueError("with a ripples.DistributedSampler, give samples_per_step (the "
                             "DataLoader's batch size, times the micro-batches of one "
                             "optimizer step): the sampler resumes after the samples the "
                             "training loop consumed")
        self.samples_per_step = samples_per_step or 0
        root = launch.checkpoint_dir if directory is None else os.fspath(directory)
        self.directory: Path | None = (Path(root) / f"rank-{optimizer.worker.rank}"
                                       if root else None)
        """This worker's checkpoints (None: checkpointing is off)."""
        self._files = (NumberedFiles(self.directory, "step", self._load)
                       if self.directory is not None and replica is None else None)
        self._shards = (ShardedCheckpoints(self.directory, replica, optimizer.model,
                                           optimizer.optimizer)
                        if self.directory is not None and replica is not None else None)
        """A worker of several ranks: DIR/rank-R/step-S/, a shard per rank
        (worker/checkpoint_sharded.py)."""
        sync = optimizer._sync
        self._protocol: SyncProtocol | None = sync.protocol if sync is not None else None
        # Lock-step protocols, and those that restart every worker on a membership change
        # (hop), restore one step agreed by every rank.
        self._lockstep = self._protocol is not None and (
            self._protocol.stops_together
            or get_protocol(optimizer.worker.protocol).restarts)
        stops_together = self._protocol is not None and self._protocol.stops_together
        if self.directory is not None and stops_together and self.interval.seconds:
            raise ValueError(
                f"{optimizer.worker.protocol} runs in lock-step: every worker must save the "
                f"same steps, which an interval of {self.interval.seconds:g} s cannot "
                "promise; give a step count (--checkpoint-every 500)")
        session = optimizer.worker._session
        self.round_steps = local_steps(session.config) if session is not None else 1
        """Local-step training (--local-steps H): periodic checkpoints fall on multiples
        of H only, right after a synchronisation, where every worker's model is its
        anchor (a lock-step run's ranks hold equal models there; a restart round's copy
        of another rank's file then carries no partial round that would count twice)."""
        if self.interval.steps % self.round_steps:
            rounded = next_multiple(self.interval.steps, self.round_steps)
            logger.info("checkpoints every %d steps, not %d: a multiple of the run's local "
                        "steps (%d), where models are synchronised", rounded,
                        self.interval.steps, self.round_steps)
            self.interval = CheckpointInterval(steps=rounded)
        self._counted_step = optimizer.local_step
        self._saved_step = -1
        self._last_save = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    # ------------------------------------------------------------------ saving
    def step(self) -> Path | None:
        """Call once after every optimizer step, after the step's last change of state
        (the scheduler's step): counts the samples the sampler gave, and saves when the
        interval says so or the run has stopped. Returns the file written, if any."""
        if self.directory is None:
            return None
        opt = self.optimizer
        step = opt.local_step
        if self._sampler is not None and step > self._counted_step:
            self._sampler.advance(self.samples_per_step * (step - self._counted_step))
        self._counted_step = step
        if step == self._saved_step:
            return None
        interval = self.interval
        if interval.steps:
            due = step % interval.steps == 0
        else:
            due = bool(interval.seconds) and step % self.round_steps == 0 and (
                time.monotonic() - self._last_save >= interval.seconds)
        return self.save() if due or (self.save_on_stop and opt.stopped) else None

    def save(self) -> Path | None:
        """Write a checkpoint of the current step now (None when checkpointing is off);
        then delete the checkpoints beyond the newest `keep`."""
        if self._files is None and self._shards is None:
            return None
        started = time.perf_counter()
        step = self.optimizer.local_step
        state = self._state(step)
        if self._shards is not None:
            path = self._shards.save(step, state)
            self._shards.prune(self.keep)
        else:
            assert self._files is not None
            path = self._files.path(step)
            write_atomically(path, lambda f: torch.save(state, f))
            self._files.prune(self.keep)
        self._saved_step, self._last_save = step, time.monotonic()
        self._holds(step)
        logger.info("checkpoint of step %d: %s (%.2f s)", step, path,
                    time.perf_counter() - started)
        return path

    def _state(self, step: int) -> dict[str, Any]:
        worker = self.optimizer.worker
        protocol_state = self._protocol.state_dict() if self._protocol is not None else {}
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "saved_at": time.time(),
            "rank": worker.rank,
            "num_workers": worker.num_workers,
            "protocol": worker.protocol,
            **self._content.entries(),
            "protocol_state": compact_on_cpu(protocol_state),
            "objects": {name: compact_on_cpu(obj.state_dict())
                        for name, obj in self.objects.items()},
        }

    # ------------------------------------------------------------------ restoring
    def restore(self) -> int:
        """Load this worker's newest checkpoint that loads (a file that does not is named
        in a warning, and the one before it is tried); with a lock-step protocol, the
        newest step every rank holds and loads. Call it once, after building everything
        it restores and before the first step. Returns the step restored (the
        optimizer's `local_step` goes on from it), or 0 when there is nothing to restore.
        Given `load_state_dict`, it is called here, before this returns.

        Raises:
            ValueError: the checkpoint is of another model (its state_dict keys or
                shapes differ), another format, or the other kind (a script's own state,
                or Ripples'), or lacks a named object.
            RuntimeError: checkpoints exist but none can be loaded (on every rank).
        """
        if self._files is None and self._shards is None:
            return 0
        session = self.optimizer.worker._session
        if session is not None and session.membership.replacement:
            logger.info("a replacement worker takes its model from a live peer, newer than "
                        "any checkpoint of its rank: nothing restored")
            return 0
        if self._shards is not None:
            found = self._shards_newest()
        else:
            assert self._files is not None
            self._files.drop_partials()
            found = self._agree() if self._lockstep else self._newest()
        if found is None:
            return 0
        path, state = found
        self._apply(path, state)
        step = int(state["step"])
        self._counted_step = self._saved_step = step
        self._holds(step)
        self._last_save = time.monotonic()
        logger.info("restored step %d from %s", step, path)
        events.emit(events.CHECKPOINT_RESTORED, step=step, path=str(path))
        return step

    def _holds(self, step: int) -> None:
        """Tell the coordinator (with the next heartbeat) the newest step this worker
        holds a checkpoint of: a lock-step run restarts from checkpoints only when every
        member holds one."""
        session = self.optimizer.worker._session
        if session is not None:
            with session.stats.lock:
                session.stats.checkpoint_step = step

    def _load(self, step: int) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint of `step`, checked against the model; None (with a warning
        naming the file) if it cannot be read."""
        assert self._files is not None
        path = self._files.path(step)
        try:
            # Our own pickles (RNG states, arbitrary objects' state): not weights only.
            state = torch.load(path, map_location="cpu", weights_only=False)
            if not isinstance(state, dict) or "format" not in state:
                raise ValueError("not a ripples checkpoint")
        except Exception as err:  # noqa: BLE001 (any unreadable file: fall back)
            logger.warning("checkpoint %s cannot be loaded (%s: %s); trying the one before",
                           path, type(err).__name__, err)
            return None
        self._check(path, state)
        return path, state

    def _shards_newest(self) -> tuple[Path, dict[str, Any]] | None:
        """A worker of several ranks: its newest checkpoint, the shards loaded into the
        model and the optimizer; this rank's file, checked."""
        shards = self._shards
        assert shards is not None
        shards.drop_partials()
        step = shards.newest()
        if step is None:
            return None
        path = shards.path(step)
        state = shards.load(step)
        self._check(path, state)
        return path, state

    def _newest(self) -> tuple[Path, dict[str, Any]] | None:
        assert self._files is not None
        steps = self._files.numbers()
        for step in steps:
            found = self._load(step)
            if found is not None:
                return found
        if steps:
            raise RuntimeError(f"none of the checkpoints in {self.directory} (steps {steps}) "
                               "can be loaded (see the warnings); remove them to start afresh")
        return None

    def _agree(self) -> tuple[Path, dict[str, Any]] | None:
        """Lock-step: the newest step that every rank holds and loads, agreed through the
        run's rendezvous store (the workers' directories need not be shared)."""
        worker = self.optimizer.worker
        session = worker._session
        assert session is not None and session.store is not None
        exchange = StoreExchange(session.store, f"ripples/checkpoint/{session.config.run_id}",
                                  worker.rank, worker.num_workers,
                                  worker.env.start_timeout_seconds,
                                  rank_describer(session.client))
        assert self._files is not None
        return agree_on_step(exchange, self._files.numbers(), self._files)  # type: ignore[no-any-return]

    def _check(self, path: Path, state: dict[str, Any]) -> None:
        """ValueError unless `state` is a checkpoint of this format, model and objects."""
        if state["format"] != FORMAT_VERSION:
            raise ValueError(f"{path} has checkpoint format {state['format']}, this version "
                             f"of Ripples reads format {FORMAT_VERSION}")
        self._content.check(path, state)
        absent = [name for name in self.objects if name not in state["objects"]]
        if absent:
            raise ValueError(f"{path} holds no state for {absent} (it has "
                             f"{sorted(state['objects'])})")

    def _apply(self, path: Path, state: dict[str, Any]) -> None:
        worker = self.optimizer.worker
        self._content.load(state)  # the optimizer's state rejoins the averaged one
        if self._protocol is not None:
            same = state["protocol"] == worker.protocol
            self._protocol.load_state_dict(state["protocol_state"] if same else {})
        for name, obj in self.objects.items():
            obj.load_state_dict(state["objects"][name])
        ignored = sorted(set(state["objects"]) - set(self.objects))
        if ignored:
            logger.warning("%s also holds state for %s, not restored (not given to the "
                           "Checkpointer)", path, ignored)
        if "rng" not in state:  # a script's own state: its generators are its own
            return
        rng, device = state["rng"], worker.device
        if state["rank"] != worker.rank:  # another rank's file (a restart round's copy)
            logger.info("%s was saved by rank %d: its random number generators stay "
                        "this process's (rank %d's would repeat its dropout and data order)",
                        path, state["rank"], worker.rank)
            return
        if self._sampler is not None:  # after the DataLoader drew its seed (module doc)
            self._sampler._at_next_pass(lambda: set_rng_state(rng, device))
        else:
            set_rng_state(rng, device)
