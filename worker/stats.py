"""A worker's cumulative counters: what its heartbeats and sync requests report."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.collective_watch import COLLECTIVES

if TYPE_CHECKING:
    from ripples.worker.protocol import SyncResult

LOSS_WINDOW = 16
"""The reported training loss is smoothed over this many iterations: one mini-batch loss
is too noisy to decide time-to-target on."""


@dataclass(kw_only=True)
class WorkerStats:
    """Cumulative counters; read by the heartbeat thread under `lock`."""

    iteration: int = 0
    samples: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    preduce_seconds: float = 0.0
    num_groups: int = 0
    preduce_bytes: int = 0
    """Bytes fed into the synchronisations' collectives (SyncResult.preduce_bytes)."""
    planned_iterations: int = 0
    checkpoint_step: int = 0
    """The newest step this worker holds a checkpoint of (ripples.Checkpointer)."""
    last_loss: float = float("nan")
    _recent_losses: deque[float] = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_loss(self, loss: float) -> None:
        """One iteration's training loss (hold `lock`)."""
        self._recent_losses.append(loss)
        self.last_loss = loss

    def set_recent_losses(self, losses: list[float]) -> None:
        """Replace the window (processes that train elsewhere report theirs); hold `lock`."""
        self._recent_losses.clear()
        self._recent_losses.extend(losses)
        if losses:
            self.last_loss = losses[-1]

    def add_sync(self, result: SyncResult, compute_seconds: float = 0.0) -> float:
        """Count one synchronisation and the compute before it; returns the smoothed loss."""
        with self.lock:
            self.compute_seconds += compute_seconds
            self.wait_seconds += result.wait_seconds
            self.preduce_seconds += result.preduce_seconds
            self.num_groups += result.num_groups
            self.preduce_bytes += result.preduce_bytes
            return self.smoothed_loss()

    def smoothed_loss(self) -> float:
        """Mean loss of the last LOSS_WINDOW iterations (nan before the first); hold `lock`."""
        recent = self._recent_losses
        return sum(recent) / len(recent) if recent else float("nan")

    def snapshot(self) -> pb.Progress:
        """Progress for a heartbeat; the loss is the mean of the last LOSS_WINDOW iterations
        (NaN while none was reported: the coordinator then counts this worker as not having
        reported one, rather than at loss 0)."""
        collective, waited = COLLECTIVES.waiting()
        with self.lock:
            return pb.Progress(
                iteration=self.iteration, loss=self.smoothed_loss(),
                samples=self.samples, compute_seconds=self.compute_seconds,
                wait_seconds=self.wait_seconds, preduce_seconds=self.preduce_seconds,
                planned_iterations=self.planned_iterations,
                checkpoint_step=self.checkpoint_step,
                collective_wait_seconds=waited, collective=collective,
                preduce_bytes=self.preduce_bytes,
            )
