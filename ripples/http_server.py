"""Serving an ASGI app with uvicorn on a socket bound beforehand, inside a running loop.

The coordinator (metrics and discovery) and the dashboard both serve HTTP this way:
binding first reports the real port at once (port 0 picks a free one) and a taken port
fails with a message before anything else starts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)


def bind(host: str, port: int, *, what: str = "HTTP", option: str = "--port") -> socket.socket:
    """A listening socket (port 0: a free one); OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen for {what} on {host}:{port}: {err}; "
                      f"pick another {option}") from err
    sock.listen(128)
    sock.setblocking(False)
    return sock


class HttpEndpoint:
    """uvicorn serving `app` on an already bound socket, as a task of the running loop."""

    def __init__(self, app: Any, sock: socket.socket, *, what: str = "HTTP endpoint") -> None:
        self.sock = sock
        self.port: int = sock.getsockname()[1]
        self.what = what
        # Streams (server-sent events) never end on their own: give them 1 s at shutdown.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="auto",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout_seconds: float = 10.0) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._server.serve(sockets=[self.sock]))
        deadline = asyncio.get_running_loop().time() + timeout_seconds
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError(f"the {self.what} stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the {self.what} did not start in {timeout_seconds} s")
            await asyncio.sleep(0.01)

    async def stop(self, timeout_seconds: float = 5.0) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, timeout_seconds)
        except TimeoutError:
            logger.warning("the %s did not stop within %.0f s", self.what, timeout_seconds)
        finally:
            self.sock.close()
