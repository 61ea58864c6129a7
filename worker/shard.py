"""A shard's head in a sharded job: its second membership, in the root coordinator's run.

A sharded job (docs/scale.md) is one run per shard, each on a coordinator of its own,
plus a root coordinator whose run's members are the shards' heads. A shard's run names
the root (`--root HOST:PORT`); its rank-0 worker is its head. The head joins the root's
run as one more worker (a `Session` of its own: registration, lease, the root's
rendezvous store and communicators), and every `inter_period` iterations it P-Reduces in
a root group, with other shards' heads, instead of in a group of its shard; its next
groups in the shard spread what it brought. Ripples' Inter-Intra (one head per node
averages across nodes) lifted one level.

The root holds a shard up only briefly: the head gives its rounds there no outage
window of their own (a root that does not answer makes the round a shard round), a
round waits for its root group at most ROOT_GROUP_WAIT_SECONDS, and a root that refuses
the head, stops, or loses its lease ends the head's part there (with a warning); the
head then trains on in its shard alone. Only an operator's stop of the root's run stops the shards
(their coordinators watch it: coordinator/root_watch.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch

from ripples.rpc import CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.dataplane.averaged_state import AveragedState
from ripples.worker.launch_env import LaunchEnv
from ripples.worker.protocol import ProtocolContext

if TYPE_CHECKING:
    from ripples.worker.session import Session

SessionFactory = Callable[[LaunchEnv, Callable[[], pb.Progress]], "Session"]
"""Makes the head's second session (session.py passes its Session class)."""

logger = logging.getLogger(__name__)

ROOT_CONNECT_SECONDS = 10.0
"""How long a head waits for the root coordinator to answer at all before it trains on
in its shard alone."""
NEVER_WAIT_STEPS = 2**31 - 1
"""The head's outage window at the root, in steps: never stop to wait for the root."""
ROOT_GROUP_WAIT_SECONDS = 5.0
"""How long a head's round at the root waits for its group's other heads; then the
round is a shard round, and the root group waits for the head's next root round."""
ROOT_HEAL_WAIT_SECONDS = 30.0
"""How long a replacement head waits for its heal group at the root before it gives
the root up."""


def is_head(config: pb.RunConfig, membership: pb.Membership) -> bool:
    """Whether this worker heads a shard of a sharded job (its run names a root)."""
    return bool(config.root) and membership.rank == 0


class RootLink:
    """A head's membership in the root's run. `open` joins it (bounded by the launch's
    start timeout) and gives the context a root round runs in; `close` leaves it."""

    def __init__(self, env: LaunchEnv, config: pb.RunConfig,
                 progress: Callable[[], pb.Progress], session: SessionFactory) -> None:
        self.root = config.root
        self.inter_period = config.inter_period
        self.shard = config.run_id

        def root_progress() -> pb.Progress:  # the head's own; no budget at the root
            p = progress()
            p.planned_iterations = 0
            return p

        # One node per head at the root: its host names the shard (heads of two shards
        # may share a host name).
        root_env = dataclasses.replace(
            env, coordinator=self.root, host=f"{env.host}@{self.shard}", run_id="",
            metrics_port=-1, connect_timeout_seconds=ROOT_CONNECT_SECONDS)
        self.session = session(root_env, root_progress)
        self.context: ProtocolContext | None = None

    def open(self, model: torch.nn.Module, state: AveragedState, *,
             accepts: Collection[str]) -> ProtocolContext | None:
        """Join the root's run and wait for its other heads; None (with a warning) if the
        root cannot have this head (its run's protocol is none of `accepts`, ...): the
        shard trains on, its head averaging in it alone."""
        session = self.session
        try:
            session.join()
            config = session.config
            if config.protocol not in accepts:
                raise ValueError(f"the root's run uses {config.protocol}; a root needs "
                                 f"{' or '.join(accepts)}")
            session.start(state.schema(), 0)
        except (CoordinatorCallError, TimeoutError, ValueError, RuntimeError) as err:
            logger.warning("this shard's head could not join the root at %s; the shard "
                           "trains on without averaging across shards: %s", self.root, err)
            self.close(error=str(err)[:500])
            return None
        # Never stop to wait for the root: a step without it is a local step.
        root_config = pb.RunConfig()
        root_config.CopyFrom(session.config)
        root_config.outage_local_steps = NEVER_WAIT_STEPS
        context = session.protocol_context(model, state)
        self.context = dataclasses.replace(context, config=root_config)
        logger.info("head of shard %s: worker %d of the root's run %s at %s, averaging "
                    "there every %d iterations", self.shard, context.worker_id,
                    session.config.run_id, self.root, self.inter_period)
        return self.context

    def check_schema(self, schema: pb.TensorSchema) -> None:
        """The head's averaged tensors changed (its optimizer state joined them): tell the
        root too, which pairs it only with heads whose tensors match."""
        if self.context is not None:
            try:
                self.session.check_schema(schema)
            except CoordinatorCallError as err:
                logger.warning("the root did not take this head's new schema: %s", err)

    def close(self, error: str = "", reason: str = "", *, done: bool = False) -> None:
        """Leave the root's run (once), without waiting out a root that is gone: the
        leave is tried once (the root's lease ends the membership otherwise). `done`:
        the shard's worker ended its loop (the root's run ends once every head is)."""
        self.context = None
        self.session.client.outage_seconds = 0.0
        self.session.leave(error=error, reason=reason, done=done)
