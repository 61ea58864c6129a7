"""Runs the dashboard: `serve(config)` until a signal, or `DashboardServer` on a thread
(`ripples run --dashboard`, tests)."""

from __future__ import annotations

import logging

from ripples.dashboard.app import create_app
from ripples.dashboard.config import DashboardConfig
from ripples.http_server import HttpEndpoint, bind
from ripples.loop_thread import LoopThreadService, serve_until_signal

logger = logging.getLogger(__name__)


class DashboardServer(LoopThreadService):
    """The dashboard on its own event loop thread. Use start() / stop()."""

    thread_name = "dashboard"

    def __init__(self, config: DashboardConfig) -> None:
        super().__init__()
        self.config = config
        self.port = 0
        self.app = create_app(config)

    async def _main(self) -> None:
        cfg = self.config
        sock = bind(cfg.host, cfg.port, what="the dashboard",
                    option="port (--port; --dashboard-port for ripples run)")
        endpoint = HttpEndpoint(self.app, sock, what="dashboard")
        self.port = endpoint.port
        await endpoint.start()
        try:
            await self._until_stopped()
        finally:
            await endpoint.stop()

    @property
    def url(self) -> str:
        host = self.config.host
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{shown}:{self.port}/"


def serve(config: DashboardConfig) -> int:
    """Serve until SIGINT/SIGTERM."""
    server = DashboardServer(config).start()
    print(f"ripples dashboard on {server.url} (coordinator {config.coordinator})", flush=True)
    return serve_until_signal(server)
