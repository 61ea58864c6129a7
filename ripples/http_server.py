"""Serving an ASGI app with uvicorn on a socket bound beforehand, inside a running loop.

The coordinator (metrics and discovery) and the dashboard both serve HTTP this way:
binding first reports the real port at once (port 0 picks a free one) and a taken port
fails with a message before anything else starts.

An HTTP port is open to anyone on the network, and its clients must never starve the
process of what its gRPC side needs (file descriptors above all: a process that cannot
accept or open one stops answering every call). So every HTTP endpoint, these and each
worker's metrics (worker/metrics.py), holds at most `connection_cap()` connections (those
beyond it are closed as soon as they are accepted) and closes a connection that has not
sent a whole request head within HEAD_TIMEOUT_SECONDS of connecting or of its last
response (uvicorn's h11 protocol waits for a head forever); the process first raises its
open-files limit as far as it may (`raise_open_files_limit`), and the cap stays a small
part of that limit.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

HEAD_TIMEOUT_SECONDS = 10.0
"""A connection that has not sent a complete request head this long after connecting (or
after its last response) is closed: Prometheus and browsers send theirs at once."""
MAX_CONNECTIONS = 100
"""Connections one HTTP endpoint holds at most (fewer under a low open-files limit):
a few scrapers, dashboard viewers (one event stream each) and their page loads."""


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (the default soft
    limit, 1,024, is easily reached by a crowd of connections); returns the soft limit
    now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):  # a container's ceiling below the hard limit
            pass
    return soft


def connection_cap() -> int:
    """The connections an HTTP endpoint of this process may hold: MAX_CONNECTIONS, and at
    most an eighth of the open-files limit, so that the rest of the process (the gRPC
    service, the rendezvous store, state files, the workers' collectives) keeps what it
    needs whatever the HTTP side suffers."""
    return max(4, min(MAX_CONNECTIONS, raise_open_files_limit() // 8))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two bounds it lacks: connections beyond
    `connection_cap()` are dropped as soon as they are accepted, and one that has sent
    no complete request head HEAD_TIMEOUT_SECONDS after connecting or after its last
    response is closed (an idle keep-alive connection sooner: uvicorn's own
    timeout_keep_alive)."""

    max_connections = MAX_CONNECTIONS
    """Each endpoint's subclass sets it from connection_cap() (HttpEndpoint)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dropped = False
        self._head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            self._dropped = True
            transport.abort()
            return
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._dropped:
            return
        self._stop_waiting()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._await_head()

    def _await_head(self) -> None:
        self._stop_waiting()
        self._head_deadline = self.loop.call_later(HEAD_TIMEOUT_SECONDS, self._head_overdue)

    def _stop_waiting(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_overdue(self) -> None:
        self._head_deadline = None
        in_flight = self.cycle is not None and not self.cycle.response_complete
        if not in_flight and not self.transport.is_closing():
            self.transport.close()  # the head never came whole


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
        class Protocol(GuardedH11Protocol):
            max_connections = connection_cap()  # raises the open-files limit first

        # Streams (server-sent events) never end on their own: give them 1 s at shutdown.
        # log_config=None: uvicorn's records go through the process's own handlers (one
        # format, repeats summed up: ripples/log_repeats.py), not handlers of its own.
        # proxy_headers off: uvicorn would otherwise take a client's address from
        # X-Forwarded-For when the connection comes from 127.0.0.1, and a local process
        # could then escape the dashboard's per-address sign-in limit by rotating it.
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="auto",
                                timeout_graceful_shutdown=1, http=Protocol, log_config=None,
                                proxy_headers=False)
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
