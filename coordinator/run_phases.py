"""The phases of one run as the membership long-polls wait for them: the membership
formed (AwaitMembers), training started or the run stopped (AwaitStart).

The service notes the core's state after every event (`RunPhases.note`): what became
true wakes its waiters, and a restart round clears them again (registration and start
happen anew). Training's start also settles the heap (coordinator/heap.py).
"""

from __future__ import annotations

import asyncio
import logging

from ripples.coordinator import heap
from ripples.coordinator.core import CoordinatorCore

logger = logging.getLogger(__name__)


class RunPhases:
    """The run's phases as asyncio events, kept in step with its core."""

    def __init__(self, core: CoordinatorCore) -> None:
        self.core = core
        self.members = asyncio.Event()
        """The membership is formed (or the run stopped)."""
        self.started = asyncio.Event()
        self.stopped = asyncio.Event()
        self._restarts_seen = core.restarts

    def note(self) -> None:
        """Wake the long-polls whose condition an event just made true (and re-arm them
        when a restart round opened: registration and start happen again)."""
        core = self.core
        if core.restarts > self._restarts_seen:
            self._restarts_seen = core.restarts
            logger.warning("restart round %d: %s; every worker restarts from the last "
                           "checkpoint", core.restarts, core.restart_reason)
        if core.membership_formed or core.stopped:
            self.members.set()
        else:
            self.members.clear()
        if core.stopped:
            self.stopped.set()
        if core.started_at is not None and not self.started.is_set():
            logger.info("all %d workers ready: training starts", len(core.live()))
            note = core.start_models_note()
            if note:
                logger.warning("%s", note)
            self.started.set()
            heap.settle()
        elif core.started_at is None and not core.stopped:
            self.started.clear()

    async def until_started_or_stopped(self) -> None:
        """Return once training started or the run stopped."""
        waits = {asyncio.ensure_future(self.started.wait()),
                 asyncio.ensure_future(self.stopped.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
