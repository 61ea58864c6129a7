"""The interface between ripples.Optimizer and a synchronisation protocol.

`ripples.Optimizer.step()` runs the local optimizer step, checks the averaged state is
finite, then calls the protocol's `after_step(completed)` (synchronise: P-Reduce in a
group, queue a gossip exchange, hop's Recv/Reduce, ...) and `should_stop(completed,
planned)` (is the run over for this worker?). A protocol gets everything it may use in a
`ProtocolContext`, built once the run has started. docs/architecture.md says how to add
one.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ripples import events
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient, Restart
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.communicators import Communicator, CommunicatorCache
from ripples.worker.dataplane.outer_state import OuterState
from ripples.worker.group_stream import GroupChannel, StreamInterrupted
from ripples.worker.launch_env import CheckpointOptions
from ripples.worker.metrics import MetricSpec, ProtocolMetrics
from ripples.worker.replica_stream import FollowerStream, LeaderStream

if TYPE_CHECKING:
    from ripples.worker.metrics import WorkerMetrics
    from ripples.worker.replica import Replica
    from ripples.worker.shard import RootLink
    from ripples.worker.stats import WorkerStats
    from ripples.worker.tasks import TaskOptions

logger = logging.getLogger(__name__)

DDP_NO_SYNC = "no_sync"
"""DDP's `model.no_sync()`, which a migrated script may still call on its model: the
allreduce runtime gives the model one that works, ripples.Optimizer a no-op elsewhere."""

GROUP_CHECK_IN_SECONDS = 10.0
"""The members of a group the coordinator delivered are all on their way to its
collective; one that has not checked in on the store within this long to build a new
communicator died since (the group fails then, instead of waiting out the collective
timeout: a chaos trial saw every worker stand still for 60 s)."""
HEAL_POLL_SECONDS = 10.0
"""Server-side bound on the wait for a heal group; the replacement then asks again."""
COORDINATOR_RETRY_SECONDS = 0.5
"""While the coordinator is unreachable (StreamInterrupted), a protocol's averaging
pauses this long before asking again; training goes on meanwhile."""

__all__ = ["COORDINATOR_RETRY_SECONDS", "GROUP_CHECK_IN_SECONDS", "Protocol",
           "ProtocolContext", "StreamInterrupted", "SyncResult", "TrainingJob",
           "fail_group", "group_communicator", "heal_from_peer", "max_peer_wait_seconds",
           "run_group_collective"]


@dataclass(kw_only=True)
class ProtocolContext:
    """Everything a protocol may use; built once the run has started."""

    client: CoordinatorClient
    worker_id: int
    rank: int
    num_workers: int
    config: pb.RunConfig
    membership: pb.Membership
    model: torch.nn.Module
    state: AveragedState
    """What is averaged (parameters, float buffers, adopted optimizer state)."""
    comms: CommunicatorCache
    store: dist.Store
    device: torch.device
    stop_requested: threading.Event  # raised by the heartbeat when the coordinator stops the run
    progress: Callable[[], pb.Progress]  # this worker's progress, sent along with sync RPCs
    metrics: ProtocolMetrics  # where a protocol declares metrics of its own
    stop_reason: Callable[[], str] = lambda: ""
    """Why the coordinator stopped the run, as its heartbeat reply said."""
    incarnation: Callable[[], int] = lambda: 0
    """Which life of the coordinator answered the last heartbeat (it grows at each
    restart from the state dir; 0 before the first answer)."""
    root: RootLink | None = None
    """A shard's head in a sharded job: its membership in the root's run, which the
    group protocols open at begin() (worker/shard.py); None for every other worker."""
    replica: Replica | None = None
    """A worker of several ranks (worker/replica.py): this process's place among them.
    Rank 0 asks the coordinator and relays its answers; the others act on them."""

    def open_group_stream(self) -> GroupChannel:
        """This worker's group stream: the coordinator's, or on a worker of several ranks
        rank 0's answers relayed to every rank (worker/replica_stream.py)."""
        replica = self.replica
        if replica is None:
            return self.client.open_group_stream(self.worker_id)
        if replica.leads:
            return LeaderStream(self.client.open_group_stream(self.worker_id), replica,
                                self.incarnation)
        return FollowerStream(replica)

    def coordinator_stop(self) -> SyncResult:
        """The verdict once `stop_requested` is set: stop, with the coordinator's reason."""
        reason = self.stop_reason() or "stopped by the coordinator"
        return SyncResult(stop=True, stop_reason=reason)


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
    inside_step_seconds: float = 0.0
    """Of preduce_seconds, the part spent inside the backward pass (DDP's bucketed
    all-reduce), which the optimizer's compute time would otherwise count too."""
    stop: bool = False
    stop_reason: str = ""

    def merged(self, later: SyncResult) -> SyncResult:
        """This synchronisation and a `later` one of the same step as one result (a
        lock-step protocol's stop synchronises once more): costs add up, the verdict is
        the later one's."""
        return SyncResult(
            wait_seconds=self.wait_seconds + later.wait_seconds,
            preduce_seconds=self.preduce_seconds + later.preduce_seconds,
            num_groups=self.num_groups + later.num_groups,
            group_sizes=self.group_sizes + later.group_sizes,
            preduce_durations=self.preduce_durations + later.preduce_durations,
            preduce_bytes=self.preduce_bytes + later.preduce_bytes,
            num_failed_groups=self.num_failed_groups + later.num_failed_groups,
            inside_step_seconds=self.inside_step_seconds + later.inside_step_seconds,
            stop=later.stop, stop_reason=later.stop_reason)


@dataclass(kw_only=True)
class TrainingJob:
    """What the built-in runner hands a runner-only protocol (Protocol.run_training): the
    task to rebuild in each of its processes, and where the worker's progress goes."""

    task_spec: str
    """The task's spec (each process of the protocol builds the task itself)."""
    task_options: TaskOptions
    batch_size: int
    stats: WorkerStats
    local_stop: threading.Event
    metrics: WorkerMetrics | None
    slowdown_spec: str = ""
    """FACTOR[@PROBABILITY] or empty."""
    num_threads: int = 1
    checkpoint: CheckpointOptions = field(default_factory=CheckpointOptions)
    """The launch's --checkpoint-dir, --checkpoint-every, --keep-checkpoints."""
    restart: Restart | None = None
    """This process's restart order (a restart round of a lock-step run), if any."""


def max_peer_wait_seconds(config: pb.RunConfig) -> float:
    """How long a worker waits for peers (a group, a partner, a neighbour's update) before
    giving up: they may be stragglers, so well beyond one collective's timeout."""
    return max(300.0, 5 * config.collective_timeout_seconds)


class Protocol(abc.ABC):
    """A synchronisation protocol behind ripples.Optimizer.

    Per optimizer step: after_step(completed) synchronises, then should_stop(completed,
    planned) tells whether the run is over for this worker. `completed` counts finished
    optimizer steps. begin() runs once before the first step, close() once at the end.
    """

    name: str = ""
    metrics: tuple[MetricSpec, ...] = ()
    """The metrics this protocol exports besides the shared ones (declared in __init__
    with ctx.metrics.declare)."""
    stops_together: bool = False
    """Every worker is in every collective (allreduce, the static schedule): one worker
    must not stop alone, so a signal or request_stop() asks the coordinator to stop the
    run, and every worker stops at the iteration they agree on (LockstepStop)."""
    syncs_gradients: bool = False
    """Gradients are averaged inside backward (allreduce), not the model after the step."""
    averages_optimizer_state: bool = False
    """The optimizer's per-parameter state joins the averaged state after the first step
    (with the run's average_optimizer_state): protocols that replace the model with a
    group's average. Protocols that exchange deltas or snapshots of a flat buffer fixed at
    the start (gossip, hop, lap/lpp) average parameters and buffers only, as their papers."""

    outer: OuterState | None = None
    """The anchor and outer momentum of local-step training (--outer-optimizer nesterov),
    for the protocols that take it: ripples.Optimizer's state_dict carries them."""
    flags_nonfinite: bool = False
    """Every collective this protocol runs on the averaged state carries the members'
    non-finite flags (AveragedState's and OuterState's stage/commit), so that no member
    adopts a group result with a non-finite contribution: a worker need not wait for its
    own flag before it synchronises (worker/dataplane/nonfinite.py). False: it waits."""

    def __init__(self, ctx: ProtocolContext) -> None:
        self.ctx = ctx

    def begin(self) -> None:  # noqa: B027 (optional hook)
        """Once, after the start and before the first step (hop sends iteration 0)."""

    def backward_sync_seconds(self) -> float:
        """Seconds this step's backward pass spent synchronising (DDP's bucketed
        all-reduce), known before after_step; 0 for protocols that sync in step()."""
        return 0.0

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """While active, backward passes do not synchronise gradients (gradient
        accumulation). Only protocols that synchronise inside backward (allreduce) do
        anything here (the model's DDP_NO_SYNC too); the others synchronise in step()."""
        return contextlib.nullcontext()

    @abc.abstractmethod
    def should_stop(self, completed: int, planned: int) -> SyncResult | None:
        """After a step and its sync: a SyncResult with stop=True ends training."""

    @abc.abstractmethod
    def after_step(self, completed: int) -> SyncResult:
        """After the local optimizer step: synchronise (or not)."""

    def may_adopt_state(self, completed: int, ready: bool) -> bool:
        """For protocols that average the optimizer state: whether step `completed` may
        add it to the averaged buffer, before its sync (`ready`: the state exists for every
        trainable parameter). At once, by default: the coordinator executes a group only
        among workers whose buffers match. Lock-step ones wait for an agreed iteration."""
        return ready

    def consensus_agreement(self) -> tuple[int, int] | None:
        """Lock-step protocols, whose models match at one step only: (the consensus
        request, the step every worker publishes its model after), as the coordinator's
        agreement says ((0, 0) before any). None (the default): each worker publishes at
        its next step boundary once its heartbeat hears of a request."""
        return None

    def on_stop(self) -> None:  # noqa: B027 (optional hook)
        """The run is over for this worker (steps after it are local): stop whatever would
        still reach the peers (allreduce: DDP's gradient sync in backward)."""

    def settle(self) -> None:  # noqa: B027 (optional hook)
        """Land what this worker still has in flight with its peers (a background
        P-Reduce), before the state changes hands: at the end of a training loop that
        ended without an error (before the final average and close()), and before an
        optimizer state dict is loaded. On the CPU it waits, up to the collective's
        deadline; on a GPU it enqueues the landing after the collective."""

    def run_training(self, job: TrainingJob) -> str:
        """Runner-only protocols (the registry's library=False: lap-sgd, lpp-sgd) train
        the task themselves, in processes of their own; returns why training ended."""
        raise NotImplementedError(f"{self.name} runs in a training loop (ripples.Optimizer)")

    def record(self) -> dict[str, object]:
        """What the protocol tells of this worker's run, as JSON values, for the run's
        summary (hop: its iterations over time); empty for most protocols."""
        return {}

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint keeps of this protocol's own state, besides the model and the
        optimizer's (a2cid2: its momentum copy); empty for most protocols. The outer
        optimizer's anchor and momentum are in ripples.Optimizer's state dict."""
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:  # noqa: B027 (optional hook)
        """Put back what state_dict() gave (empty from a checkpoint of another protocol),
        once the checkpoint's model is loaded, before the first step."""

    def close(self) -> None:  # noqa: B027 (optional hook, deliberately empty)
        """Release protocol resources (not communicators: the session owns the cache)."""


def heal_from_peer(ctx: ProtocolContext, stream: GroupChannel,
                   execute: Callable[[pb.Group], tuple[float, bool]],
                   max_wait_seconds: float) -> None:
    """A replacement's first requests (before its first step): ask until the coordinator
    hands it its heal group, and `execute` it (copy the donor's model: copy_model). A
    cancelled heal (the donor left) or an unreachable coordinator asks again; a stop
    returns at once (the first step hears it again)."""
    iteration = int(ctx.membership.start_iteration)
    waited_since = time.perf_counter()
    while True:
        try:
            reply = stream.request(iteration, HEAL_POLL_SECONDS, ctx.progress())
        except StreamInterrupted as err:
            reply = pb.GroupReply(outcome=pb.GROUP_OUTCOME_NO_GROUP, detail=str(err))
        if reply.outcome == pb.GROUP_OUTCOME_STOP:
            return
        if reply.outcome == pb.GROUP_OUTCOME_GROUP:
            seconds, ok = execute(reply.group)
            if ok and reply.group.heal:
                logger.info("healed from worker %d in %.2f s (%.1f s after asking)",
                            reply.group.heal_donor, seconds, time.perf_counter() - waited_since)
                events.emit(events.WORKER_HEALED, donor=reply.group.heal_donor, seconds=seconds,
                            asked_seconds=time.perf_counter() - waited_since)
                return
        waited = time.perf_counter() - waited_since
        if waited > max_wait_seconds:
            raise TimeoutError(f"could not heal from a live peer within {waited:.0f} s: "
                               f"{reply.detail}")
        if reply.outcome in (pb.GROUP_OUTCOME_CANCELLED, pb.GROUP_OUTCOME_NO_GROUP):
            logger.info("heal group not formed, asking again: %s", reply.detail)
            time.sleep(COORDINATOR_RETRY_SECONDS)


def run_group_collective(
    ctx: ProtocolContext, stream: GroupChannel, group: pb.Group, key: str,
    collective: Callable[[Communicator], float | None],
) -> tuple[float, bool]:
    """Run `collective` on the group's communicator (`key` in the cache), then release the
    group: ok, with the squared distance `collective` returns if any; or failed, with the
    communicator dropped and never rebuilt (docs/data-plane.md rule 4).
    Returns (seconds, ok)."""
    t0 = time.perf_counter()
    try:
        distance = collective(group_communicator(ctx, group, key))
    except (RuntimeError, TimeoutError, ValueError) as err:
        seconds = time.perf_counter() - t0
        fail_group(ctx, stream, group, key, err, seconds)
        return seconds, False
    seconds = time.perf_counter() - t0
    stream.release(group.group_id, ok=True, preduce_seconds=seconds, squared_distance=distance)
    return seconds, True


def group_communicator(ctx: ProtocolContext, group: pb.Group, key: str) -> Communicator:
    """The communicator of a group the coordinator handed out (`key` in the cache, built
    if the group says so), this worker's rank in it its index among the members; a member
    that has not checked in within GROUP_CHECK_IN_SECONDS fails it (TimeoutError)."""
    members = list(group.members)
    return ctx.comms.get(key, members.index(ctx.worker_id), len(members),
                         create=group.create_comm, peers_within=GROUP_CHECK_IN_SECONDS)


def fail_group(ctx: ProtocolContext, stream: GroupChannel, group: pb.Group, key: str,
               err: BaseException, seconds: float, *, abort: bool = False) -> None:
    """A group's collective failed: drop its communicator for good (it is never rebuilt:
    docs/data-plane.md rule 4; `abort`: one of its collectives may still be running) and
    tell the coordinator."""
    ctx.comms.drop(key, abort=abort)
    logger.warning("group %d %s failed: %s", group.group_id, list(group.members), err)
    stream.release(group.group_id, ok=False, error=str(err)[:500], preduce_seconds=seconds)
