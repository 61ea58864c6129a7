"""The interface between the shared compute loop and a synchronisation protocol."""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from ripples.worker.communicators import Communicator, CommunicatorCache
from ripples.worker.flat_params import FlatParameters
from ripples.worker.group_stream import GroupStream
from ripples.worker.metrics import MetricSpec, ProtocolMetrics, WorkerMetrics

if TYPE_CHECKING:
    from ripples.worker.loop import ShardSampler, WorkerStats
    from ripples.worker.slowdown import Slowdown
    from ripples.worker.tasks import Task, TaskOptions

logger = logging.getLogger(__name__)


@dataclass(kw_only=True)
class SyncContext:
    """Everything a strategy may use; built once by the daemon after the run starts."""

    client: CoordinatorClient
    worker_id: int
    rank: int
    num_workers: int
    config: pb.RunConfig
    start: pb.Membership
    model: torch.nn.Module
    params: FlatParameters
    comms: CommunicatorCache
    store: dist.Store
    device: torch.device
    stop_requested: threading.Event  # raised by the heartbeat when the coordinator stops the run
    progress: Callable[[], pb.Progress]  # this worker's progress, sent along with sync RPCs
    optimizer: torch.optim.Optimizer
    metrics: ProtocolMetrics  # where a protocol declares metrics of its own


@dataclass(kw_only=True)
class SyncResult:
    """What one synchronisation cost, and whether the run is over for this worker."""

    wait_seconds: float = 0.0  # waiting for a group to form
    preduce_seconds: float = 0.0  # inside the collective(s)
    num_groups: int = 0
    group_sizes: tuple[int, ...] = ()  # one per collective
    preduce_durations: tuple[float, ...] = ()  # one per collective, seconds
    preduce_bytes: int = 0  # bytes this worker fed into the collectives
    num_failed_groups: int = 0
    inside_step: bool = False  # the sync ran inside the gradient step (DDP's backward)
    stop: bool = False
    stop_reason: str = ""


@dataclass(kw_only=True)
class TrainingJob:
    """What a worker trains with, built by the daemon; SyncStrategy.run_training runs it."""

    task: Task
    task_spec: str
    """The task's spec (processes of their own, such as LPP-SGD's updaters, rebuild it)."""
    task_options: TaskOptions
    sampler: ShardSampler
    stats: WorkerStats
    slowdown: Slowdown
    slowdown_spec: str
    """FACTOR[@PROBABILITY] or empty, for processes of their own."""
    device: torch.device
    local_stop: threading.Event
    metrics: WorkerMetrics | None
    num_threads: int = 1


def max_peer_wait_seconds(config: pb.RunConfig) -> float:
    """How long a worker waits for peers (a group, a partner, a neighbour's update) before
    giving up: they may be stragglers, so well beyond one collective's timeout."""
    return max(300.0, 5 * config.collective_timeout_seconds)


class SyncStrategy(abc.ABC):
    """A protocol plugged into the compute loop.

    The loop calls, per iteration: should_stop(completed) -> before_step(completed) ->
    gradient step -> after_step(completed). `completed` counts finished gradient steps.
    """

    name: str = ""
    metrics: tuple[MetricSpec, ...] = ()
    """The metrics this protocol exports besides the shared ones (declared in __init__
    with ctx.metrics.declare)."""

    def __init__(self, ctx: SyncContext) -> None:
        self.ctx = ctx
        self._state_adopted = False

    def averaged_state(self) -> FlatParameters:
        """What a P-Reduce averages: the flat parameters, and with the run's
        average_optimizer_state also the optimizer's per-parameter state, which exists
        only after the first step and is adopted into the flat buffer at the first call."""
        if self.ctx.config.average_optimizer_state and not self._state_adopted:
            self.ctx.params.adopt_optimizer_state(self.ctx.optimizer)
            self._state_adopted = True
        return self.ctx.params

    def training_model(self) -> torch.nn.Module:
        """The module the loop runs forward/backward on (DDP wraps it)."""
        return self.ctx.model

    def run_training(self, job: TrainingJob) -> str:
        """Train to the end; returns why it ended. The shared compute loop calls this
        strategy's hooks each iteration; a protocol with processes of its own (LPP-SGD)
        runs them instead."""
        from ripples.worker.loop import train  # the loop imports this module

        return train(job.task, self, job.sampler, job.stats, job.slowdown, job.device,
                     job.local_stop, job.metrics)

    @abc.abstractmethod
    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        """Before a step: a SyncResult with stop=True ends training."""

    def before_step(self, completed: int) -> None:  # noqa: B027 (optional hook)
        """Before the gradient step (hop sends the parameters the step starts from)."""

    @abc.abstractmethod
    def after_step(self, completed: int) -> SyncResult:
        """After the optimizer step: synchronise (or not)."""

    def record(self) -> dict[str, object]:
        """What the protocol tells of this worker's run, as JSON values, for the run's
        summary (hop: its iterations over time); empty for most protocols."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional hook, deliberately empty)
        """Release protocol resources (not communicators: the daemon owns the cache)."""


def run_group_collective(
    ctx: SyncContext, stream: GroupStream, group: pb.Group, key: str,
    collective: Callable[[Communicator], float | None],
) -> tuple[float, bool]:
    """Run `collective` on the group's communicator (`key` in the cache), then release the
    group: ok, with the squared distance `collective` returns if any; or failed, with the
    communicator dropped and never rebuilt (notes/preduce-findings.md rule 4).
    Returns (seconds, ok)."""
    members = list(group.members)
    t0 = time.perf_counter()
    try:
        comm = ctx.comms.get(key, members.index(ctx.worker_id), len(members),
                             create=group.create_comm)
        distance = collective(comm)
    except (RuntimeError, TimeoutError, ValueError) as err:
        seconds = time.perf_counter() - t0
        ctx.comms.drop(key)
        logger.warning("group %d %s failed: %s", group.group_id, members, err)
        stream.release(group.group_id, ok=False, error=str(err)[:500], preduce_seconds=seconds)
        return seconds, False
    seconds = time.perf_counter() - t0
    stream.release(group.group_id, ok=True, preduce_seconds=seconds, squared_distance=distance)
    return seconds, True
