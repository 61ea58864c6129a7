"""Checkpoints of a worker of several ranks: one directory per checkpoint, a shard per rank.

A sharded worker's ripples.Checkpointer writes DIR/rank-R/step-S/ (R: the worker's rank in
the run), with torch.distributed.checkpoint over the worker's ranks:

- the model and the wrapped optimizer, as their sharded state dicts (DTensors, keyed by
  parameter name: `get_model_state_dict`, `get_optimizer_state_dict`): `.metadata` and a
  `__<rank>_0.distcp` file per rank;
- `rank-<r>.pt` per rank: what is each rank's own (its random number generators, the
  outer optimizer's anchor and momentum of its shard) and what every rank holds alike
  (the step, Ripples' counters, the protocol's and the named objects' state).

Whole or not at all: every rank writes into a hidden `.step-S.partial/`, and rank 0
renames it once every rank has finished (the ranks share the directory: on one host, or
a shared filesystem, as torch.distributed.checkpoint's file writer assumes). Restoring
loads the newest complete step, which every rank must name alike; the shards load into
the same sharding (the coordinator's schema check makes every worker shard alike), and
a checkpoint of another model is refused naming the first difference.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ripples.files import write_atomically
from ripples.worker.checkpoint_content import restore_counters, ripples_counters, rng_state
from ripples.worker.replica import Replica

if TYPE_CHECKING:
    from ripples.worker.optimizer import Optimizer

logger = logging.getLogger(__name__)

_STEP = re.compile(r"step-(\d+)")


class ShardedCheckpoints:
    """One sharded worker's checkpoint directories (see the module doc)."""

    def __init__(self, directory: Path, replica: Replica, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> None:
        self.directory = directory
        self.replica = replica
        self.model = model
        self.optimizer = optimizer
        """The wrapped (inner) optimizer."""

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step}"

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, newest first."""
        if not self.directory.is_dir():
            return []
        matches = (_STEP.fullmatch(p.name) for p in self.directory.iterdir() if p.is_dir())
        return sorted((int(m.group(1)) for m in matches if m), reverse=True)

    def _sharded(self) -> dict[str, Any]:
        return {"model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer)}

    def save(self, step: int, own: dict[str, Any]) -> Path:
        """Write step `step`: the shards, and `own` (this rank's file); every rank calls
        it. Returns the checkpoint's directory."""
        final = self.path(step)
        partial = self.directory / f".step-{step}.partial"
        if self.replica.leads:
            self.directory.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)  # a killed writer's
        self.replica.barrier("a checkpoint's directory")
        dcp.save(self._sharded(), checkpoint_id=partial, process_group=self.replica.group)
        write_atomically(partial / f"rank-{self.replica.rank}.pt",
                         lambda f: torch.save(own, f))
        self.replica.barrier("a checkpoint written by every rank")
        if self.replica.leads:
            shutil.rmtree(final, ignore_errors=True)
            partial.rename(final)
        self.replica.barrier("a checkpoint complete")
        return final

    def newest(self) -> int | None:
        """The newest complete step, named alike by every rank (None: none)."""
        steps = self.steps()
        mine = str(steps[0]) if steps else ""
        named = {text.decode() for text in self.replica.gather(mine.encode())}
        if len(named) != 1:
            raise RuntimeError(f"the ranks of this worker see different newest checkpoints "
                               f"in {self.directory} ({sorted(named)}): its ranks must "
                               "share the checkpoint directory")
        return steps[0] if steps else None

    def load(self, step: int) -> dict[str, Any]:
        """Load step `step`'s shards into the model and the optimizer (every rank calls
        it); returns this rank's file. ValueError naming the path for a checkpoint of
        another model."""
        path = self.path(step)
        state = self._sharded()  # the optimizer's state made, to be loaded into
        try:
            dcp.load(state, checkpoint_id=path, process_group=self.replica.group)
        except Exception as err:  # noqa: BLE001 (DCP raises CheckpointException and others)
            raise ValueError(f"{path} does not load into this model and optimizer (another "
                             f"model, or another sharding?): {err}") from err
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        own: dict[str, Any] = torch.load(path / f"rank-{self.replica.rank}.pt",
                                         map_location="cpu", weights_only=False)
        return own

    def prune(self, keep: int) -> None:
        """Rank 0 deletes the checkpoints beyond the newest `keep`."""
        if self.replica.leads:
            for old in self.steps()[keep:]:
                shutil.rmtree(self.path(old), ignore_errors=True)

    def drop_partials(self) -> None:
        """Rank 0 deletes what a killed writer left."""
        if self.replica.leads and self.directory.is_dir():
            for partial in self.directory.glob(".step-*.partial"):
                shutil.rmtree(partial, ignore_errors=True)
        self.replica.barrier("a checkpoint directory swept")


class ShardedTrainingState:
    """A sharded worker's content of its rank files (the Checkpointer's CheckpointContent):
    Ripples' counters (with the outer optimizer's state of this rank's shard) and its
    random number generators. The model and the optimizer are the shards'."""

    def __init__(self, optimizer: Optimizer) -> None:
        self.optimizer = optimizer

    def entries(self) -> dict[str, Any]:
        opt = self.optimizer
        return {"ripples": ripples_counters(opt), "rng": rng_state(opt.worker.device)}

    def check(self, path: Path, checkpoint: dict[str, Any]) -> None:
        if "ripples" not in checkpoint or "rng" not in checkpoint:
            raise ValueError(f"{path} is not a checkpoint of a worker of several ranks")

    def load(self, checkpoint: dict[str, Any]) -> None:
        restore_counters(self.optimizer, checkpoint["ripples"])
