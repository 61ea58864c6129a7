"""The group stream of a worker of several ranks: rank 0 asks, every rank acts.

Rank 0's `LeaderStream` asks the coordinator as any worker does and relays each answer
(a group, a retry, the stop; or the interruption it met instead) to the worker's other
ranks before it returns it; their `FollowerStream` returns the relayed answer in place of
asking. Every rank then runs the protocol's same code on the same answer: rank r averages
its shard in the group's communicator /s<r> (worker/replica.py).

A group is released once per rank, in the same order on every rank: the ranks agree on
its outcome first (ok only where every shard was averaged), and rank 0 tells the
coordinator.
"""

from __future__ import annotations

from collections.abc import Callable

from ripples.rpc import CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import replica_pb2 as rpb
from ripples.worker.group_stream import GroupStream, StreamInterrupted
from ripples.worker.replica import Replica


class LeaderStream:
    """Rank 0's group stream: the coordinator's, relayed to the worker's other ranks."""

    def __init__(self, stream: GroupStream, replica: Replica,
                 incarnation: Callable[[], int]) -> None:
        self.stream = stream
        self.replica = replica
        self.incarnation = incarnation

    def request(self, iteration: int, wait_seconds: float,
                progress: pb.Progress | None = None, *, listen: bool = False) -> pb.GroupReply:
        try:
            reply = self.stream.request(iteration, wait_seconds, progress, listen=listen)
        except StreamInterrupted as err:
            self.replica.send("group-reply", rpb.ReplicaReply(
                interrupted=True, detail=str(err), incarnation=self.incarnation()))
            raise
        except CoordinatorCallError as err:  # the stream broke: every rank fails with it
            self.replica.send("group-reply", rpb.ReplicaReply(
                detail=str(err), incarnation=self.incarnation()))
            raise
        self.replica.send("group-reply", rpb.ReplicaReply(
            reply=reply, incarnation=self.incarnation()))
        return reply

    def release(self, group_id: int, ok: bool, error: str = "",
                preduce_seconds: float = 0.0, squared_distance: float | None = None) -> None:
        all_ok, distance = self.replica.agree(ok, squared_distance)
        if ok and not all_ok:
            error = "another rank of this worker could not average its shard in the group"
        self.stream.release(group_id, all_ok, error, preduce_seconds, distance)

    def close(self, timeout_seconds: float = 5.0) -> None:
        self.stream.close(timeout_seconds)


class FollowerStream:
    """Ranks 1..G-1: rank 0's answers, in its order."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica

    def request(self, iteration: int, wait_seconds: float,
                progress: pb.Progress | None = None, *, listen: bool = False) -> pb.GroupReply:
        relayed = self.replica.receive("group-reply", rpb.ReplicaReply())
        assert isinstance(relayed, rpb.ReplicaReply)
        self.replica.incarnation = int(relayed.incarnation)
        if relayed.interrupted:
            raise StreamInterrupted(relayed.detail, None)
        if not relayed.HasField("reply"):
            raise CoordinatorCallError(f"rank 0's group stream failed: {relayed.detail}", None)
        return relayed.reply

    def release(self, group_id: int, ok: bool, error: str = "",
                preduce_seconds: float = 0.0, squared_distance: float | None = None) -> None:
        self.replica.agree(ok, squared_distance)

    def close(self, timeout_seconds: float = 5.0) -> None:
        """Nothing to close: rank 0 holds the stream."""
