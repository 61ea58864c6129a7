"""The compute loop shared by every protocol: sample, forward, backward, step, sync."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.metrics import WorkerMetrics
from ripples.worker.slowdown import Slowdown
from ripples.worker.strategies.base import SyncResult, SyncStrategy
from ripples.worker.tasks import Task

logger = logging.getLogger(__name__)


# The reported training loss is smoothed over this many iterations: one mini-batch loss is
# too noisy to decide time-to-target on.
LOSS_WINDOW = 16


@dataclass(kw_only=True)
class WorkerStats:
    """Cumulative counters; read by the heartbeat thread under `lock`."""

    iteration: int = 0
    samples: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    preduce_seconds: float = 0.0
    num_groups: int = 0
    planned_iterations: int = 0
    last_loss: float = float("nan")
    _recent_losses: deque[float] = field(default_factory=lambda: deque(maxlen=LOSS_WINDOW))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add_loss(self, loss: float) -> None:
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
            return self.smoothed_loss()

    def smoothed_loss(self) -> float:
        """Mean loss of the last LOSS_WINDOW iterations (nan before the first); hold `lock`."""
        recent = self._recent_losses
        return sum(recent) / len(recent) if recent else float("nan")

    def snapshot(self) -> pb.Progress:
        """Progress for a heartbeat; the loss is the mean of the last LOSS_WINDOW iterations."""
        with self.lock:
            loss = self.smoothed_loss()
            return pb.Progress(
                iteration=self.iteration, loss=loss if math.isfinite(loss) else 0.0,
                samples=self.samples, compute_seconds=self.compute_seconds,
                wait_seconds=self.wait_seconds, preduce_seconds=self.preduce_seconds,
                planned_iterations=self.planned_iterations,
            )


class ShardSampler:
    """Mini-batches from this worker's shard of the training set, reshuffled every epoch."""

    def __init__(self, num_samples: int, rank: int, num_workers: int, batch_size: int,
                 seed: int, stream: int = 0) -> None:
        order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
        self.shard = order[rank::num_workers]
        if len(self.shard) == 0:
            raise ValueError(f"{num_workers} workers leave rank {rank} no training data")
        self.batch_size = min(batch_size, len(self.shard))
        # `stream` gives processes that share a shard (LPP-SGD's updaters) orders of their own.
        self._generator = torch.Generator().manual_seed(seed * 7919 + rank + 1 + stream * 104729)
        self._order = self.shard[torch.randperm(len(self.shard), generator=self._generator)]
        self._pos = 0

    def next_indices(self) -> torch.Tensor:
        if self._pos + self.batch_size > len(self._order):
            self._order = self.shard[torch.randperm(len(self.shard), generator=self._generator)]
            self._pos = 0
        batch = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return batch


def iterations_per_epoch(num_samples: int, num_workers: int, batch_size: int) -> int:
    """One epoch: the workers together pass over the training set once."""
    return max(1, math.ceil(num_samples / (num_workers * batch_size)))


def train(task: Task, strategy: SyncStrategy, sampler: ShardSampler, stats: WorkerStats,
          slowdown: Slowdown, device: torch.device, local_stop: threading.Event,
          metrics: WorkerMetrics | None = None) -> str:
    """Run until the strategy says stop; returns the reason."""
    model = strategy.training_model()
    model.train()
    while True:
        with stats.lock:
            completed = stats.iteration
        if local_stop.is_set():
            return "stopped by a signal"
        verdict = strategy.should_stop(completed, stats.planned_iterations)
        if verdict is not None and verdict.stop:
            return verdict.stop_reason
        idx = sampler.next_indices()
        inputs = task.train_inputs[idx].to(device, non_blocking=True)
        targets = task.train_targets[idx].to(device, non_blocking=True)
        strategy.before_step(completed)
        t0 = time.perf_counter()
        task.optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(model(inputs), targets)
        loss.backward()
        task.optimizer.step()
        loss_value = float(loss.detach())
        compute = time.perf_counter() - t0
        with stats.lock:  # before the sync, whose RPCs carry this progress to the coordinator
            stats.iteration = completed + 1
            stats.samples += len(idx)
            stats.add_loss(loss_value)
        result = strategy.after_step(completed + 1)
        if result.inside_step:  # DDP: the all-reduce ran inside backward
            compute = max(0.0, compute - result.preduce_seconds)
        compute += slowdown.after_compute(compute)
        smoothed_loss = stats.add_sync(result, compute)
        if metrics is not None:
            metrics.observe_iteration(compute_seconds=compute, result=result, loss=smoothed_loss)
        if not math.isfinite(loss_value):
            raise FloatingPointError(f"training loss became {loss_value} at iteration "
                                     f"{completed + 1}; lower the learning rate")
        if result.stop:
            return result.stop_reason

