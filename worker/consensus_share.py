"""What a worker gives the run's consensus model: its model, published between two steps
for a `ripples checkpoint` request, and the final average after the stop.

A worker of several ranks (worker/replica.py) does both with every rank: for a request,
each rank sends its shards to rank 0, which publishes the whole model; for the final
average, rank 0 relays the coordinator's group to its other ranks and each rank averages
its own shard (all of them, or none).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ripples.consensus import encode_model, publish_key
from ripples.state_dicts import state_dict_views
from ripples.store_blobs import put_blob
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorCallError
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.dataplane.preduce import preduce
from ripples.worker.dataplane.shard_mirror import ShardMirror
from ripples.worker.protocol import GROUP_CHECK_IN_SECONDS, Protocol, ProtocolContext
from ripples.worker.replica import full_state_dict

if TYPE_CHECKING:
    from ripples.worker.session import Session

logger = logging.getLogger(__name__)


class ConsensusPublisher:
    """Publishes this worker's model once per consensus request of the coordinator."""

    def __init__(self, session: Session, model: torch.nn.Module, protocol: Protocol,
                 mirror: ShardMirror | None) -> None:
        self.session = session
        self.model = model
        self.protocol = protocol
        self.mirror = mirror
        self._served = 0

    def due(self, completed: int) -> int:
        """The consensus request this worker publishes its model for after step
        `completed`, once per request; 0: none (ranks 1..G-1 of a worker learn it from
        rank 0)."""
        heartbeat, store = self.session.heartbeat, self.session.store
        agreement = self.protocol.consensus_agreement()
        if agreement is not None:  # lock-step: every worker after the same agreed step
            wanted, at = agreement
            if completed < at:
                return 0
        else:
            wanted = heartbeat.consensus_id if heartbeat is not None else 0
        if wanted == self._served or store is None:
            return 0
        return wanted

    def publish(self, completed: int, wanted: int) -> None:
        """Publish this worker's model, as it stands between two steps, for request
        `wanted` (0: none) through the rendezvous store (ripples/consensus.py). A worker
        of several ranks gathers its shards into rank 0, which publishes the whole
        model. A failure is a warning: the request fails, training goes on."""
        if not wanted:
            return
        self._served = wanted
        session = self.session
        assert session.worker_id is not None and session.store is not None
        try:
            if self.mirror is not None:  # every rank sends its shards; rank 0 publishes
                whole = full_state_dict(self.model)
                if session.replica is not None and not session.replica.leads:
                    return
                blob = encode_model(completed, whole)
            else:
                with state_dict_views():  # encode_model copies them to the CPU
                    blob = encode_model(completed, self.model.state_dict())
            put_blob(session.store, publish_key(wanted, session.worker_id), blob)
        except (RuntimeError, OSError) as err:
            logger.warning("could not publish the model for consensus %d: %s", wanted, err)
            return
        logger.info("published the model of step %d for consensus %d", completed, wanted)


def final_average(session: Session, ctx: ProtocolContext, state: AveragedState,
                  mirror: ShardMirror | None) -> None:
    """After the run stopped and the protocol closed: average with every other live
    worker once more, so that each final model is the consensus model (what a cluster
    keeps, and `ripples run`'s model.pt). Best effort and bounded: a peer that fails it
    leaves this worker's model as it was, with a warning."""
    timeout = session.config.collective_timeout_seconds
    replica = session.replica
    if replica is None or replica.leads:
        try:
            reply = session.client.final_group(ctx.worker_id, timeout)
        except CoordinatorCallError as err:
            reply = pb.GroupReply(outcome=pb.GROUP_OUTCOME_NO_GROUP, detail=str(err))
    if replica is not None:  # every rank averages its shard, or none does
        relayed = replica.relay("final-reply", reply if replica.leads else None,
                                pb.GroupReply())
        assert isinstance(relayed, pb.GroupReply)
        reply = relayed
    if reply.outcome != pb.GROUP_OUTCOME_GROUP:
        logger.info("no final average: %s", reply.detail)
        return
    members = list(reply.group.members)
    key = f"final/{session.config.run_id}/{reply.group.comm_id}"
    try:
        comm = ctx.comms.get(key, members.index(ctx.worker_id), len(members), create=True,
                             peers_within=GROUP_CHECK_IN_SECONDS)
        if mirror is not None:  # steps made after the stop are the shards'
            mirror.pull()
        preduce(state, comm, timeout)
    except (RuntimeError, TimeoutError, ValueError) as err:
        logger.warning("the final average over workers %s failed (%s); this worker's "
                       "model is its own", members, err)
        return
    if mirror is not None:
        mirror.push()
    logger.info("final average over workers %s", members)
