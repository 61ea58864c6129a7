"""Checkpoints of lap-sgd / lpp-sgd workers averaging over all workers, and their restore
after a restart round.

The updaters of a worker train one shared model Hogwild, so the worker's training state
is that model (its parameters and buffers, one copy in shared memory), the updaters'
counts of updates made, and the count of averaging rounds. The averaging process
checkpoints it, not the updaters:

- **When.** Averaging over all workers is lock-step: every worker runs the same rounds.
  Each round's all-reduce carries one more control value, a worker's wish to checkpoint
  (its `--checkpoint-every` updates, or seconds, passed since its last save); after a
  round in which anybody wished, every worker saves, so all hold the same rounds. The
  file is named by its round: DIR/rank-R/round-N.pt.
- **What.** The model (a state_dict, loadable as the worker's model), the updaters'
  counts, the round, the rank. Not the updaters' own optimizer state (their momentum):
  it lives in U processes that never wait, and starts from zero after a restore, as at
  the start of the run.
- **Restore.** As for the library's lock-step checkpoints (worker/checkpoint.py:
  agree_on_step): every rank agrees through the run's rendezvous store on the newest
  round that every rank holds and loads; a rank that lacks it receives the file of the
  lowest rank that holds it. The model goes back into the shared tensors, the counter
  and the updaters' counts go on from the file's (so the full-model phase and the
  synchronisation period go on where they were), and the round count too (so the next
  checkpoints are newer).

The write is atomic (ripples/files.py: write_atomically); the newest `keep` files
are kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ripples.files import write_atomically
from ripples.state_dicts import compact_on_cpu
from ripples.worker.checkpoint_store import NumberedFiles, StoreExchange, agree_on_step
from ripples.worker.launch_env import CheckpointOptions

logger = logging.getLogger(__name__)

FORMAT = "ripples-lpp-1"
"""The layout of an lpp checkpoint's dictionary; another is refused."""


@dataclass(frozen=True)
class Restored:
    """What a restore put back: the round, and the updaters' counts of updates."""

    round: int
    updates: tuple[int, ...]

    @property
    def counter(self) -> int:
        return sum(self.updates)


class LppCheckpoints:
    """One worker's round checkpoints (`options.checkpoint_dir` off: does nothing).

    Args:
        options: The launch's --checkpoint-dir, --checkpoint-every, --keep-checkpoints.
        model: The worker's model (its parameters and buffers are the shared ones).
        rank, num_workers, protocol: This worker in the run.
    """

    def __init__(self, options: CheckpointOptions, model: torch.nn.Module, *, rank: int,
                 num_workers: int, protocol: str) -> None:
        self.interval = options.interval
        self.keep = options.keep_checkpoints
        self.directory = (Path(options.checkpoint_dir) / f"rank-{rank}"
                          if options.checkpoint_dir else None)
        self._files = (NumberedFiles(self.directory, "round", self.load)
                       if self.directory is not None else None)
        self.model = model
        self.rank, self.num_workers, self.protocol = rank, num_workers, protocol
        self._saved_updates = 0
        self._saved_at = time.monotonic()

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def wish(self, updates: int) -> bool:
        """Whether this worker wants a checkpoint after the coming round."""
        if self.directory is None:
            return False
        if self.interval.steps:
            return updates - self._saved_updates >= self.interval.steps
        return bool(self.interval.seconds) and (
            time.monotonic() - self._saved_at >= self.interval.seconds)

    def save(self, round_: int, updates: list[int]) -> Path | None:
        """Save the model as it stands after averaging round `round_` (the updaters go on
        meanwhile: the copy is one more Hogwild read of the shared model)."""
        if self._files is None:
            return None
        started = time.perf_counter()
        path = self._files.path(round_)
        state = {
            "format": FORMAT, "round": round_, "updates": list(updates),
            "rank": self.rank, "num_workers": self.num_workers, "protocol": self.protocol,
            "saved_at": time.time(), "model": compact_on_cpu(self.model.state_dict())}
        write_atomically(path, lambda f: torch.save(state, f))
        self._saved_updates, self._saved_at = sum(updates), time.monotonic()
        self._files.prune(self.keep)
        logger.info("checkpoint of round %d (%d updates): %s (%.2f s)", round_, sum(updates),
                    path, time.perf_counter() - started)
        return path

    def restore(self, exchange: StoreExchange, updaters: int) -> Restored | None:
        """Agree with every rank on the newest round all hold and load, and put it back
        into the model; None when no rank holds any."""
        if self._files is None:
            return None
        self._files.drop_partials()
        found = agree_on_step(exchange, self._files.numbers(), self._files)
        if found is None:
            return None
        path, state = found
        self.model.load_state_dict(state["model"])  # in place: into the shared tensors
        counts = [int(c) for c in state["updates"]]
        if len(counts) != updaters:  # another number of updaters: spread the total
            total = sum(counts)
            counts = [total // updaters + (i < total % updaters) for i in range(updaters)]
        self._saved_updates, self._saved_at = sum(counts), time.monotonic()
        logger.info("restored round %d (%d updates) from %s", state["round"], sum(counts), path)
        return Restored(round=int(state["round"]), updates=tuple(counts))

    def load(self, round_: int) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint of `round_`, checked against the model; None (with a warning)
        if it cannot be read; ValueError if it is another model's."""
        assert self._files is not None
        path = self._files.path(round_)
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} checkpoint")
        except Exception as err:  # noqa: BLE001 (any unreadable file: fall back)
            logger.warning("checkpoint %s cannot be loaded (%s: %s); trying the one before",
                           path, type(err).__name__, err)
            return None
        mine = self.model.state_dict()
        theirs = state["model"]
        if set(mine) != set(theirs) or any(tuple(theirs[k].shape) != tuple(v.shape)
                                           for k, v in mine.items()):
            raise ValueError(f"{path} is a checkpoint of another model")
        return path, state

