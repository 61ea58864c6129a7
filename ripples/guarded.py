"""Background loops that survive their own errors.

A bare `while True` task dies with the first exception its body raises, silently: the
coordinator's lease reaper then never expires a lease again, the dashboard's poller never
polls again, and nothing says so. `guarded_loop` runs the body again after any error,
logging it with its traceback and the loop's name, and backs off exponentially while
the body keeps failing, so a persistent fault neither spins nor floods the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger(__name__)

MAX_BACKOFF_SECONDS = 10.0
"""Longest wait after repeated failures (never below the loop's own interval)."""


def backoff_seconds(interval: float, failures: int) -> float:
    """The wait before the next run: `interval` after a success, doubled per consecutive
    failure, capped at MAX_BACKOFF_SECONDS (or at `interval` if that is longer)."""
    return min(interval * 2 ** failures, max(interval, MAX_BACKOFF_SECONDS))


async def guarded_loop(name: str, body: Callable[[], Awaitable[None]], interval: float, *,
                       on_error: Callable[[], None] = lambda: None) -> None:
    """Await `body()` every `interval` seconds (waiting first) until cancelled.

    An exception from the body is logged with its traceback under `name`, reported to
    `on_error` (e.g. a Prometheus counter's `inc`), and the body runs again after a
    capped exponential back-off. Cancellation is not an error: it ends the loop."""
    failures = 0
    while True:
        await asyncio.sleep(backoff_seconds(interval, failures))
        try:
            await body()
        except Exception:
            failures += 1
            logger.exception("background task %s failed (%d in a row); retrying in %.2f s",
                             name, failures, backoff_seconds(interval, failures))
            on_error()
        else:
            failures = 0
