"""A service that runs on its own asyncio event loop thread, and the blocking entry point
that serves one until SIGINT/SIGTERM.

The coordinator and the dashboard are both asyncio servers that `ripples run` and the
tests embed in a process doing other work; `LoopThreadService` is that embedding.
"""

from __future__ import annotations

import abc
import asyncio
import signal
import threading
from collections.abc import Callable
from typing import Self


class LoopThreadService(abc.ABC):
    """Runs `_main()` on a fresh event loop in a daemon thread. Use start() / stop().

    `_main` sets the service up, then awaits `_until_stopped()` (which marks it started)
    and tears it down after; an exception before that is raised by start().
    """

    thread_name = "service"

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._done: asyncio.Event | None = None

    @abc.abstractmethod
    async def _main(self) -> None:
        """Set up, `await self._until_stopped()`, tear down."""

    async def _until_stopped(self) -> None:
        self._done = asyncio.Event()
        self._ready.set()
        await self._done.wait()

    def _run_thread(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as err:  # surfaced by start()
            self._error = err
            self._ready.set()
        finally:
            self._loop.close()

    def start(self, timeout_seconds: float = 30.0) -> Self:
        self._thread = threading.Thread(target=self._run_thread, name=self.thread_name,
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_seconds):
            raise TimeoutError(f"the {self.thread_name} did not start within "
                               f"{timeout_seconds} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """Idempotent: a second call (or one after a failed start) does nothing."""
        if (self._loop is not None and self._done is not None and self._thread is not None
                and self._thread.is_alive()):
            self._loop.call_soon_threadsafe(self._done.set)
            self._thread.join(timeout_seconds)


def serve_until_signal(service: LoopThreadService,
                       finished: Callable[[], bool] = lambda: False) -> int:
    """Block until SIGINT/SIGTERM (or until `finished()`), then stop the started service."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if finished():
            break
    service.stop()
    return 0
