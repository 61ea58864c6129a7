"""Translation between the core's types and the ripples.v1 messages.

The core (coordinator/core.py) knows nothing of protobuf or gRPC: the service's handlers
turn requests into core values here, core decisions into replies, and a core error into
the status that ends the call.
"""

from __future__ import annotations

import math
from typing import NoReturn

import grpc

from ripples.coordinator.core import CoordinatorError, GroupDecision, Outcome, Progress
from ripples.coordinator.schema import Schema
from ripples.v1 import coordinator_pb2 as pb

OUTCOMES = {
    Outcome.GROUP: pb.GROUP_OUTCOME_GROUP,
    Outcome.STOP: pb.GROUP_OUTCOME_STOP,
    Outcome.CANCELLED: pb.GROUP_OUTCOME_CANCELLED,
    Outcome.NO_GROUP: pb.GROUP_OUTCOME_NO_GROUP,
    Outcome.RETRY: pb.GROUP_OUTCOME_RETRY,
}
"""A core decision's outcome as the wire names it."""


def peer_host(peer: str) -> str:
    """The address part of a gRPC peer string ("ipv4:10.0.0.5:4242" -> "10.0.0.5",
    "ipv6:[::1]:4242" -> "[::1]"); "" when it is not an IP peer."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0] if rest.startswith("[") else f"[{rest.rpartition(':')[0]}]"
    return ""


MAX_COLLECTIVE_CHARS = 200
"""A worker's words for its current collective are kept up to this long (a status lists
thousands of workers)."""


def progress_from_proto(p: pb.Progress) -> Progress:
    """A worker's reported progress (a loss before the first iteration, or not finite,
    counts as none; a time that is not finite, or negative, as 0: a worker's bad number
    must reach neither the policies' arithmetic nor every status reader)."""
    return Progress(
        iteration=p.iteration,
        loss=p.loss if math.isfinite(p.loss) and p.iteration > 0 else float("nan"),
        samples=p.samples,
        compute_seconds=_seconds(p.compute_seconds),
        wait_seconds=_seconds(p.wait_seconds),
        preduce_seconds=_seconds(p.preduce_seconds),
        planned_iterations=p.planned_iterations,
        checkpoint_step=p.checkpoint_step,
        collective_wait_seconds=_seconds(p.collective_wait_seconds),
        preduce_bytes=p.preduce_bytes,
        collective=p.collective[:MAX_COLLECTIVE_CHARS],
    )


def _seconds(value: float) -> float:
    """A reported duration, 0 when it is not a finite non-negative number."""
    return value if math.isfinite(value) and value >= 0 else 0.0


def progress_to_proto(p: Progress) -> pb.Progress:
    """A worker's progress for a status view (no loss yet: 0)."""
    return pb.Progress(
        iteration=p.iteration,
        loss=p.loss if math.isfinite(p.loss) else 0.0,
        samples=p.samples,
        compute_seconds=p.compute_seconds,
        wait_seconds=p.wait_seconds,
        preduce_seconds=p.preduce_seconds,
        planned_iterations=p.planned_iterations,
        checkpoint_step=p.checkpoint_step,
        collective_wait_seconds=p.collective_wait_seconds,
        preduce_bytes=p.preduce_bytes,
        collective=p.collective,
    )


def schema_from_proto(message: pb.TensorSchema) -> Schema:
    """The averaged tensors a worker declares (AwaitStart, CheckSchema)."""
    return Schema(tensors=tuple((t.name, tuple(t.shape), t.dtype) for t in message.tensors),
                  digest=message.digest)


def group_reply(d: GroupDecision) -> pb.GroupReply:
    """A core decision for one worker as the reply of its group request (or FinalGroup)."""
    g = d.group
    group = None if g is None else pb.Group(
        group_id=g.group_id, members=g.members, initiator=g.initiator, comm_id=g.comm_id,
        create_comm=g.create_comm, heal=g.heal_donor is not None,
        heal_donor=g.heal_donor or 0)
    return pb.GroupReply(outcome=OUTCOMES[d.outcome], more=d.more,
                         evict_comm_ids=d.evictions, detail=d.detail, group=group)


async def abort(context: grpc.aio.ServicerContext, err: Exception) -> NoReturn:
    """End the call with the status a core error names (ValueError: bad input)."""
    code = (getattr(grpc.StatusCode, err.code) if isinstance(err, CoordinatorError)
            else grpc.StatusCode.INVALID_ARGUMENT)
    await context.abort(code, str(err))
    raise AssertionError("unreachable")  # abort raises
