"""The service's wait for a group (coordinator/sync_stream.py: SyncStreams.wait_for_group)
against the real core, on a real event loop, with no sockets: a decision and a timeout
that land in the same loop iteration, and a client that goes away, leave the worker and
the core agreeing.
"""

from __future__ import annotations

import asyncio

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore
from ripples.coordinator.group_service import Deliveries, GroupDecision, Outcome
from ripples.coordinator.service import CoordinatorService


def _pair() -> tuple[CoordinatorCore, CoordinatorService, int, int]:
    """Two started workers of a smart run in groups of two; the first waits for the
    second (its group is made, the second has not asked yet)."""
    core = CoordinatorCore(RunSettings.build(protocol="ripples-smart", num_workers=2,
                                             group_size=2, iterations=10**6), now=0.0)
    a, b = (core.register("node0", rank, "cpu", rank, 0.0) for rank in range(2))
    for wid in (a, b):
        core.mark_ready(wid, 10**5, 0.0)
    service = CoordinatorService(core, store_host="127.0.0.1", store_port=0,
                                 clock=lambda: 1.0)
    decision, _ = core.request_group(a, 1, 1.0)
    assert decision is None  # a waits for b
    return core, service, a, b


def test_a_decision_and_a_timeout_in_one_loop_iteration_agree_with_the_core() -> None:
    async def race(seed: int) -> None:
        core, service, a, b = _pair()
        loop = asyncio.get_running_loop()
        b_deliveries: Deliveries = {}

        def b_asks() -> None:
            decision, deliveries = core.request_group(b, 1, 1.0)
            if decision is not None:
                b_deliveries[b] = decision
            b_deliveries.update(deliveries)
            service._resolve(deliveries)

        waiting = asyncio.ensure_future(service.sync.wait_for_group(a, 0.02))
        await asyncio.sleep(0)  # a's wait and its timer are set
        # b's request lands when a's timer fires: both before a's task resumes.
        loop.call_later(0.02 + seed * 1e-9, b_asks)
        told: GroupDecision = await waiting
        delivered = b_deliveries.get(a)
        if delivered is not None:  # b's request came first: a is told its group
            assert told is delivered and told.outcome is Outcome.GROUP
        else:  # the timeout came first: a's arrival is gone, so b waits for it
            assert told.outcome is Outcome.RETRY and b not in b_deliveries
            decision, deliveries = core.request_group(a, 1, 1.0)  # a asks again
            assert decision is not None and decision.outcome is Outcome.GROUP
            assert deliveries[b].group is decision.group

    for seed in range(6):
        asyncio.run(race(seed))


def test_a_client_that_goes_away_ends_its_wait_in_the_core() -> None:
    async def scenario() -> None:
        core, service, a, b = _pair()
        waiting = asyncio.ensure_future(service.sync.wait_for_group(a, 10.0))
        await asyncio.sleep(0)
        waiting.cancel()  # the stream was cancelled
        await asyncio.gather(waiting, return_exceptions=True)
        assert a not in service.sync.waiters
        # a's arrival was withdrawn: b's request now waits for a instead of executing
        decision, deliveries = core.request_group(b, 1, 1.0)
        assert decision is None and a not in deliveries

    asyncio.run(scenario())
