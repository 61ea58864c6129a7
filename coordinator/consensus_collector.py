"""Consensus collection: the live workers' models, mid-run, on demand.

`ripples checkpoint` (Runs.Consensus) asks for them. The collector asks every live worker
to publish its model at its next step boundary (the heartbeat replies of the workers in
`expected` carry the request's id; lock-step workers agree on one iteration through
their Checkpoint replies), waits for all of them in the run's rendezvous store (a worker
that leaves meanwhile is dropped) and streams each model's bytes back as its worker
encoded them, one model at a time; the client averages them (ripples/consensus.py). The
coordinator never decodes a tensor. One request at a time (another is refused at once);
every wait is bounded by the request's timeout; the store keeps no model copy afterwards,
whatever happened (a client that goes away mid-stream included).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from ripples import consensus
from ripples.coordinator.core import CoordinatorCore
from ripples.store_blobs import delete_blob, get_blob, has_blob
from ripples.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

SWEEP_REQUESTS = 4
"""How many recent consensus requests every request sweeps the store for."""
DEFAULT_TIMEOUT_SECONDS = 60.0
"""A request's wait for every live worker's model when it names none."""


class ConsensusCollector:
    """The consensus requests of one run."""

    def __init__(self, core: CoordinatorCore, *, store: Any, incarnation: int,
                 clock: Callable[[], float]) -> None:
        """Args:
            core: the run's core.
            store: the run's view of the rendezvous store (a torch.distributed store, or
                None: no consensus model can be collected).
            incarnation: the coordinator's incarnation (request ids are never reused
                across restarts).
            clock: the coordinator's clock.
        """
        self.core = core
        self.store = store
        self.incarnation = incarnation
        self.clock = clock
        self._seq = 0
        self.expected: set[int] = set()
        """The workers asked to publish for the request in progress (the heartbeat tells
        only these)."""
        self._done: list[tuple[str, int]] = []
        """(store prefix, id) of the recent requests, whose keys every request sweeps."""

    def refusal(self) -> str:
        """Why no consensus model can be collected now ("": it can)."""
        core = self.core
        if self.store is None:
            return "this coordinator hosts no rendezvous store to collect the models"
        if not core.settings.spec.library:
            return (f"{core.settings.protocol}'s updater processes train outside the "
                    "worker's step loop: no consensus model mid-run (the final one is "
                    "written at the end)")
        if core.stopped:
            return f"the run is over ({core.stop_reason})"
        if core.started_at is None:
            return "the run is not training now (it has not started, or a restart round is open)"
        return ""

    async def collect(self, request: pb.ConsensusRequest, context: grpc.aio.ServicerContext
                      ) -> AsyncIterator[pb.ConsensusChunk]:
        """The live workers' models now: whose they are, then each one's bytes."""
        core = self.core
        refusal = self.refusal()
        if not refusal and self.expected:
            refusal = "another consensus request is in progress; ask again when it is done"
        if refusal:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, refusal)
        timeout = (request.timeout_seconds if request.timeout_seconds > 0
                   else DEFAULT_TIMEOUT_SECONDS)
        started = self.clock()
        self._seq += 1
        cid = (self.incarnation << 32) + self._seq  # never reused
        expected = {w.worker_id for w in core.live() if w.healed}
        prefix = f"g{core.registry.generation}/" if core.registry.generation else ""
        keys = {w: prefix + consensus.publish_key(cid, w) for w in expected}
        self.expected = expected
        core.want_consensus(cid)  # what the workers are asked to publish for
        logger.info("consensus %d: asking workers %s for their models", cid, sorted(expected))
        try:
            missing = await self._await_published(keys, started + timeout)
            core.want_consensus(0)
            if core.started_at is None and not core.stopped:
                await context.abort(grpc.StatusCode.ABORTED, (
                    f"a restart round ({core.restart_reason}) interrupted the request: the "
                    "workers restart from the last checkpoint; ask again once they train"))
            if missing:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, (
                    f"workers {missing} did not publish their model within {timeout:.0f} s "
                    "(each does at its next step boundary); ask again, or with a longer "
                    "--timeout-seconds"))
            # Whoever published (one that left since counts with the model it had).
            published = [w for w in sorted(keys)
                         if await asyncio.to_thread(has_blob, self.store, keys[w])]
            if not published:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    "no live worker published its model")
            seconds = self.clock() - started
            logger.info("consensus %d: sending the models of workers %s (collected in "
                        "%.2f s)", cid, published, seconds)
            yield pb.ConsensusChunk(info=pb.ConsensusInfo(
                consensus_id=cid, workers=published, seconds=seconds))
            for w in published:  # one model in memory at a time
                data = await asyncio.to_thread(get_blob, self.store, keys[w])
                yield pb.ConsensusChunk(model=pb.PublishedModel(worker=w,
                                                                size_bytes=len(data)))
                for i in range(0, len(data), consensus.CHUNK_BYTES):
                    yield pb.ConsensusChunk(data=data[i:i + consensus.CHUNK_BYTES])
        finally:
            self.expected = set()
            core.want_consensus(0)
            self._done.append((prefix, cid))
            await asyncio.to_thread(self._sweep)

    def _sweep(self) -> None:
        """Delete every worker's model published for the recent requests, late ones
        included (a lock-step worker that reached the agreed step after the request
        ended): the store keeps no model copy. Runs off the event loop."""
        workers = list(self.core.workers)
        for prefix, cid in self._done:
            for w in workers:
                delete_blob(self.store, prefix + consensus.publish_key(cid, w))
        del self._done[:-SWEEP_REQUESTS]

    async def _await_published(self, keys: dict[int, str], deadline: float) -> list[int]:
        """Wait until every expected worker that is still live published; returns the
        ones missing at the deadline (none: all did)."""
        while True:
            live = {w.worker_id for w in self.core.live()}
            missing = []
            for w, key in keys.items():
                if w in live and not await asyncio.to_thread(has_blob, self.store, key):
                    missing.append(w)
            if not missing or self.clock() > deadline or self.core.started_at is None:
                return sorted(missing)
            await asyncio.sleep(0.1)
