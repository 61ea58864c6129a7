"""Saving one run's state to the state dir (--state-dir; coordinator/state_store.py).

How often the state saver runs (`save_interval`), how one save goes (the snapshot's
values captured on the event loop, its rows made and written in a thread, saves never
overlapping), and what a write the disk refuses does: a periodic save is logged and
retried by the saver's next round, and a registration that must be stored before its
reply is undone and refused (`refuse_unless_stored`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

import grpc

from ripples.coordinator import snapshot
from ripples.coordinator.core import CoordinatorCore
from ripples.coordinator.state_store import StateStore, StoreWriteError

logger = logging.getLogger(__name__)

STATE_SAVE_SECONDS = 0.5
"""How often the run's state is saved to the state dir besides membership changes (at
up to SAVE_WORKERS workers; see save_interval)."""
SAVE_WORKERS = 5_000
"""Workers per STATE_SAVE_SECONDS of the state saver's interval: a save's rows cost
O(workers) of the saver's thread (~1.5 s at 100,000 workers, which shares the
interpreter with the event loop), so a larger run is saved less often."""


def save_interval(num_workers: int) -> float:
    """Seconds between two periodic saves of a run of `num_workers` workers: 0.5 s up to
    5,000 workers, then 0.5 s more per 5,000 (10 s at 100,000). A restart loses at most
    this much of the workers' progress reports, which their next reports restore;
    membership changes are saved when they happen whatever the size."""
    return STATE_SAVE_SECONDS * max(1.0, num_workers / SAVE_WORKERS)


class StateSaver:
    """The saves of one run's state (none without a state dir)."""

    def __init__(self, core: CoordinatorCore, state: StateStore | None,
                 clock: Callable[[], float], targets: Callable[[], dict[int, str]]) -> None:
        """`targets`: the workers' metrics targets now (saved with the run's state)."""
        self.core = core
        self.state = state
        self.clock = clock
        self._targets = targets
        self._saving: asyncio.Lock | None = None

    async def save(self) -> None:
        """Save the run's state to the state dir (if any). A save the disk refuses is
        logged, and the state saver's next round (every save_interval, backing off
        while it fails) tries again: the run goes on meanwhile."""
        try:
            await self.save_or_raise()
        except StoreWriteError as err:
            logger.error("%s; the state saver retries every %.1f s or more", err,
                         save_interval(self.core.settings.num_workers))

    async def save_or_raise(self, only: Iterable[int] | None = None) -> None:
        """Save the run's state (`only`: the run's keys and these workers' records, when
        nothing else changed); StoreWriteError if the disk refuses. The snapshot's
        values are copied on the loop (consistent: snapshot.capture), made into rows and
        written off it; saves never overlap."""
        if self.state is None:
            return
        if self._saving is None:
            self._saving = asyncio.Lock()
        async with self._saving:
            captured = snapshot.capture(self.core, self.clock(), time.time(), only=only)
            targets = dict(self._targets())
            await asyncio.to_thread(self._write, self.state, captured, targets)

    @staticmethod
    def _write(state: StateStore, captured: snapshot.Captured,
               targets: dict[int, str]) -> None:
        """Make a captured snapshot's JSON rows and store those that changed (in the
        saver's thread: at 100,000 workers this is seconds the event loop is not held)."""
        data = captured.values()
        data["metrics_targets"] = {str(k): v for k, v in targets.items()}
        state.save(data)


async def refuse_unless_stored(context: grpc.aio.ServicerContext, write: Awaitable[None],
                               undo: Callable[[], bool] = lambda: True) -> None:
    """Await `write`; if the disk refuses it, `undo` and end the call (full:
    RESOURCE_EXHAUSTED, a worker retries for its vacancy timeout; read-only or
    failing: UNAVAILABLE), telling the client the cause and the operator (the log)
    the file. A registration that can no longer be undone (another one formed the
    membership with it meanwhile) stands, and the state saver retries its save."""
    try:
        await write
    except StoreWriteError as err:
        if not undo():
            logger.error("%s; the registration stands (the membership formed with it) "
                         "and the state saver retries", err)
            return
        logger.error("registration refused: %s", err)
        await context.abort(
            grpc.StatusCode[err.status],
            f"{err.reason}: the registration was not stored, so it is refused (nothing "
            "changed); the operator must free or fix the state dir's disk")
