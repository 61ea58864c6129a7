"""Runs the dashboard: `serve(config)` until a signal, or `DashboardServer` on a thread
(`ripples run --dashboard`, tests)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading

from ripples.dashboard.app import DashboardConfig, create_app
from ripples.http_server import HttpEndpoint, bind

logger = logging.getLogger(__name__)


class DashboardServer:
    """The dashboard on its own event loop thread. Use start() / stop()."""

    def __init__(self, config: DashboardConfig) -> None:
        self.config = config
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._done: asyncio.Event | None = None

    async def _main(self) -> None:
        cfg = self.config
        endpoint = HttpEndpoint(create_app(cfg), bind(cfg.host, cfg.port, what="the dashboard",
                                                           option="port (--port; --dashboard-port "
                                                                  "for ripples run)"),
                                what="dashboard")
        self.port = endpoint.port
        await endpoint.start()
        self._done = asyncio.Event()
        self._ready.set()
        try:
            await self._done.wait()
        finally:
            await endpoint.stop()

    def _run_thread(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as err:  # surfaced by start()
            self._error = err
            self._ready.set()
        finally:
            self._loop.close()

    def start(self, timeout_seconds: float = 30.0) -> DashboardServer:
        self._thread = threading.Thread(target=self._run_thread, name="dashboard", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_seconds):
            raise TimeoutError(f"the dashboard did not start within {timeout_seconds} s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout_seconds: float = 10.0) -> None:
        """Idempotent: a second call (or one after a failed start) does nothing."""
        if (self._loop is not None and self._done is not None and self._thread is not None
                and self._thread.is_alive()):
            self._loop.call_soon_threadsafe(self._done.set)
            self._thread.join(timeout_seconds)

    @property
    def url(self) -> str:
        host = self.config.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{shown}:{self.port}/"


def serve(config: DashboardConfig) -> int:
    """Serve until SIGINT/SIGTERM."""
    server = DashboardServer(config).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"ripples dashboard on {server.url} (coordinator {config.coordinator})", flush=True)
    while not stop.wait(1.0):
        pass
    server.stop()
    return 0
