"""The dashboard's sign-in: sessions, a limit on attempts, and the same-origin checks.

A browser signs in once with the token (the login form); the cookie it gets back holds a
random session id, never the token, so a cookie that leaks (a shared machine, a proxy's
log) opens the page for one session's lifetime and tells nothing that reaches the
coordinator. Sessions live in the dashboard's memory: a restart signs everyone out.

Sign-in attempts are limited per client address (a token bucket: `attempts` at once,
then one more every window/attempts seconds), so the token cannot be guessed at the
speed of the network. Behind a proxy every viewer shares the proxy's address: the
client's address is the connection's, never a header's (X-Forwarded-For is not trusted,
so a local process cannot rotate it to escape the limit).

Against cross-site request forgery and DNS rebinding every request must name a host the
dashboard serves as (`RequestGuard`): an IP address, localhost, this machine's name, or
one of --allowed-hosts (a proxy's name); and a request that changes something (POST:
sign-in, sign-out) must come from the dashboard's own page (its Origin's host is the
request's host and port, or one of --allowed-hosts). A client that sends no Origin (curl, a
script) is not a browser a foreign page drives, and passes.
"""

from __future__ import annotations

import ipaddress
import math
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request

MAX_SESSIONS = 1000
"""Sessions kept at most; past it, signing in drops the oldest."""
MAX_CLIENTS = 10_000
"""Client addresses whose attempts are counted separately at most; past it (addresses by
the thousand, a distributed guess) the newcomers share one count."""
SHARED = "*"
"""The count of the addresses past MAX_CLIENTS."""
SESSION_COOKIE = "ripples_session"
"""The dashboard's sign-in cookie: a session id (HttpOnly, SameSite=Strict)."""


class Sessions:
    """Signed-in browsers: session id -> when it expires (bounded, in memory)."""

    def __init__(self, lifetime_seconds: float, *, limit: int = MAX_SESSIONS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lifetime_seconds = lifetime_seconds
        self.limit = limit
        self._clock = clock
        self._expiry: dict[str, float] = {}  # in order of creation

    def open(self) -> str:
        """A new session's id (unguessable: 256 random bits)."""
        now = self._clock()
        for sid in [s for s, end in self._expiry.items() if end <= now]:
            del self._expiry[sid]
        while len(self._expiry) >= self.limit:
            del self._expiry[next(iter(self._expiry))]
        sid = secrets.token_urlsafe(32)
        self._expiry[sid] = now + self.lifetime_seconds
        return sid

    def valid(self, sid: str) -> bool:
        """Whether `sid` is a live session (an expired one is forgotten)."""
        end = self._expiry.get(sid) if sid else None
        if end is None:
            return False
        if end <= self._clock():
            del self._expiry[sid]
            return False
        return True

    def close(self, sid: str) -> None:
        """Sign out: the session no longer opens anything."""
        self._expiry.pop(sid, None)

    def __len__(self) -> int:
        return len(self._expiry)


class AttemptLimiter:
    """Sign-in attempts per client address: a token bucket holding `attempts`, refilled
    at `attempts` per `window_seconds`."""

    def __init__(self, attempts: int, window_seconds: float, *, max_clients: int = MAX_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.attempts = attempts
        self.rate = attempts / window_seconds
        self.max_clients = max_clients
        self._clock = clock
        self._buckets: dict[str, tuple[float, float]] = {}  # address -> (tries left, at)

    def _left(self, address: str, now: float) -> float:
        left, at = self._buckets.get(address, (self.attempts, now))
        return min(float(self.attempts), left + (now - at) * self.rate)

    def take(self, address: str) -> float:
        """Count one attempt from `address`: 0 when it may go on, else the seconds until
        it may try again (nothing counted)."""
        now = self._clock()
        if address not in self._buckets and len(self._buckets) >= self.max_clients:
            for known in list(self._buckets):  # a full bucket is as good as none
                if self._left(known, now) >= self.attempts:
                    del self._buckets[known]
            if len(self._buckets) >= self.max_clients:
                address = SHARED
        left = self._left(address, now)
        if left < 1:
            return (1 - left) / self.rate
        self._buckets[address] = (left - 1, now)
        return 0.0


def retry_after(seconds: float) -> str:
    """A Retry-After header's value: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))


def _host_name(host_header: str) -> str:
    """The name in a Host header or an Origin's netloc, without its port, lowercased
    ("[::1]:8080" -> "::1")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class RequestGuard:
    """ASGI middleware: refuses a request for a host the dashboard does not serve as
    (400: DNS rebinding, a foreign name pointed at this address), and a POST whose Origin
    is another site's (403: cross-site request forgery)."""

    def __init__(self, app: Any, *, allowed_hosts: tuple[str, ...], listen_host: str) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.extra = frozenset(h.lower() for h in allowed_hosts if h != "*")
        names = {"localhost", socket.gethostname().lower()}
        if listen_host and not _is_ip(listen_host):
            names.add(listen_host.lower())
        self.names = frozenset(names) | self.extra

    def host_allowed(self, name: str) -> bool:
        """An IP address cannot be rebound; a name must be one the dashboard serves as."""
        return self.any_host or _is_ip(name) or name in self.names

    def refusal(self, method: str, headers: dict[str, str]) -> tuple[int, str] | None:
        """None when the request may go on, else the status and the message."""
        host = headers.get("host", "")
        name = _host_name(host)
        if host and not self.host_allowed(name):
            return 400, (f"this dashboard does not serve the host name {name!r}: if that is "
                         f"how viewers reach it (a proxy, a DNS name), start it with "
                         f"--allowed-hosts {name}")
        if method in ("GET", "HEAD", "OPTIONS") or "origin" not in headers:
            return None
        origin = headers["origin"]
        netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
        if netloc and (netloc == host.strip().lower() or self.any_host
                       or _host_name(netloc) in self.extra):
            return None
        return 403, (f"cross-site request refused: it comes from {origin!r}, not from this "
                     f"dashboard's page (a proxy's name goes in --allowed-hosts)")

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        refused = self.refusal(scope.get("method", "GET"), headers)
        if refused is None:
            await self.app(scope, receive, send)
            return
        code, message = refused
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8")]})
        await send({"type": "http.response.body", "body": message.encode() + b"\n"})


def served_over_https(request: Request) -> bool:
    """Whether the viewer reached the page over HTTPS: directly, or through a proxy that
    terminated TLS and says so (X-Forwarded-Proto). The session cookie is then marked
    Secure. Trusting the header can only withhold a cookie from a client that lied about
    its own connection, never expose one."""
    return (request.url.scheme == "https"
            or request.headers.get("x-forwarded-proto", "").strip().lower() == "https")
