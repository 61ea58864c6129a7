"""What checkpoints are made of, for every saver (ripples.Checkpointer in worker/checkpoint.py,
lap/lpp-sgd's own in their package): numbered files in a worker's directory, written
whole or not at all; rounds through the run's rendezvous store in which every rank says
what it holds; the agreement of lock-step workers on one step that every rank loads.
(What a saver writes goes through ripples.state_dicts.compact_on_cpu: the model's tensors
are views into the averaged state's flat buffer, which torch.save would write whole.)
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from ripples.files import partial_path, write_atomically
from ripples.store_blobs import delete_blob, put_blob, wait_blob

logger = logging.getLogger(__name__)


class NumberedFiles:
    """One worker's checkpoint files in its directory, KIND-N.pt (N: a step of the
    library's checkpoints, a round of lap/lpp-sgd's), as the savers and agree_on_step use
    them. `load(n)`: the checkpoint of N checked by its owner (None: unreadable)."""

    def __init__(self, directory: Path, kind: str,
                 load: Callable[[int], tuple[Path, dict[str, Any]] | None]) -> None:
        self.directory, self.kind = directory, kind
        self.load = load
        self._name = re.compile(rf"{re.escape(kind)}-(\d+)\.pt")

    def path(self, n: int) -> Path:
        return self.directory / f"{self.kind}-{n}.pt"

    def numbers(self) -> list[int]:
        """The numbers of the complete files, newest first (a partial one is hidden
        under another name: ripples.files.partial_path)."""
        if not self.directory.is_dir():
            return []
        matches = (self._name.fullmatch(p.name) for p in self.directory.iterdir())
        return sorted((int(m.group(1)) for m in matches if m), reverse=True)

    def prune(self, keep: int) -> None:
        """Delete the files beyond the newest `keep` (after a new one is complete)."""
        for old in self.numbers()[keep:]:
            self.path(old).unlink(missing_ok=True)

    def drop_partials(self) -> None:
        """Delete the hidden partial files a killed writer left."""
        for partial in self.directory.glob(partial_path(Path(f"{self.kind}-*.pt")).name):
            partial.unlink(missing_ok=True)

    def read(self, n: int) -> bytes:
        return self.path(n).read_bytes()

    def write(self, n: int, data: bytes) -> None:
        write_atomically(self.path(n), data)


class StoreExchange:
    """Rounds in which every rank publishes a string and reads everyone's."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, num_workers: int,
                 timeout_seconds: float,
                 describe: Callable[[list[int]], str] = lambda ranks: "") -> None:
        self.store, self.prefix = store, prefix
        self.rank, self.num_workers = rank, num_workers
        self.timeout = timeout_seconds
        self.describe = describe
        """What the given ranks are doing (a timed-out round says what held them)."""

    def round(self, name: str, value: str) -> list[str]:
        keys = [f"{self.prefix}/{name}/{r}" for r in range(self.num_workers)]
        self.store.set(keys[self.rank], value)
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except dist.DistStoreError:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            doing = self.describe(missing)
            raise TimeoutError(
                f"restoring checkpoints: ranks {missing} did not reach the round ({name}) "
                f"within {self.timeout:.0f} s (the start timeout)"
                + (f"; they were: {doing}" if doing else "")
                + "; in a lock-step run every worker calls Checkpointer.restore() before "
                "its first step") from None
        return [self.store.get(k).decode() for k in keys]

    def publish(self, name: str, data: bytes) -> None:
        put_blob(self.store, f"{self.prefix}/{name}", data)

    def forget(self, name: str) -> None:
        delete_blob(self.store, f"{self.prefix}/{name}")

    def fetch(self, name: str) -> bytes:
        try:
            return wait_blob(self.store, f"{self.prefix}/{name}", self.timeout)
        except TimeoutError as err:
            raise TimeoutError(f"restoring checkpoints: {err}") from None


class _CheckpointFiles(Protocol):
    """What agreeing on a step needs of this rank's checkpoints."""

    def load(self, step: int) -> Any: ...

    def read(self, step: int) -> bytes: ...

    def write(self, step: int, data: bytes) -> None: ...


def agree_on_step(exchange: StoreExchange, steps: list[int],
                   files: _CheckpointFiles) -> Any:
    """The run's newest checkpoint step, loaded on every rank (`files.load`: None, it
    cannot; ValueError, it must not, which fails every rank), or None when no rank holds
    any. Lock-step workers save the same steps and hold the same state at a step, so a
    rank that lacks the newest step (it joined at a restart round on a host of its own;
    it was killed before saving it; its directory is a stale one of its rank from before
    a restart round re-dealt the ranks) gets that step's file from the lowest rank that
    holds it, through the store. A step that some rank cannot load is given up for the
    next newest. Every rank calls it with its own steps, newest first, and gets the same
    step."""
    held = [json.loads(v) for v in exchange.round("steps", json.dumps(steps))]
    candidates = sorted(set().union(*map(set, held)), reverse=True)
    for step in candidates:
        have = [r for r, mine in enumerate(held) if step in mine]
        lacking = [r for r, mine in enumerate(held) if step not in mine]
        key = f"file/{step}"
        if lacking and exchange.rank == have[0]:
            exchange.publish(key, files.read(step))
        elif exchange.rank in lacking:
            files.write(step, exchange.fetch(key))
            logger.info("took the checkpoint of step %d from rank %d", step, have[0])
        try:
            loaded = files.load(step)
        except ValueError as err:  # tell the peers before failing, so they fail too
            exchange.round(f"loaded/{step}", f"error: {err}")
            raise
        verdicts = exchange.round(f"loaded/{step}", "ok" if loaded is not None else "unloadable")
        if lacking and exchange.rank == have[0]:
            exchange.forget(key)  # every rank has read it: the store keeps no model copy
        errors = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v.startswith("error")]
        if errors:
            raise RuntimeError(f"a peer cannot restore step {step}: {'; '.join(errors)}")
        if loaded is not None and all(v == "ok" for v in verdicts):
            return loaded
        failed = [r for r, v in enumerate(verdicts) if v != "ok"]
        logger.warning("step %d cannot be loaded on ranks %s; trying the step before",
                       step, failed)
    if not candidates:
        return None
    raise RuntimeError(f"no checkpoint step ({candidates}) loads on every rank (see the "
                       "warnings); remove the checkpoints to start afresh")

