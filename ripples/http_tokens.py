"""The run's tokens on its HTTP endpoints (docs/security.md): the coordinator's /metrics
and /sd, every worker's /metrics and the dashboard take the same bearer tokens as the
gRPC services (ripples/security.py), compared in constant time; /healthz and the
dashboard's login form stay open. A refusal is 401 with `WWW-Authenticate: Bearer` and
what to send.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

HTTP_OPEN_PATHS = frozenset({"/healthz", "/login"})
"""Paths served without a token (liveness probes, the dashboard's login form)."""


def token_matches(tokens: tuple[str, ...], presented: str) -> bool:
    """Whether `presented` is one of `tokens` (compared in constant time)."""
    return bool(presented) and any(hmac.compare_digest(presented.encode(), t.encode())
                                   for t in tokens)


def http_token_accepted(tokens: tuple[str, ...], authorization: str) -> bool:
    """Whether a request's `Authorization: Bearer` header holds one of `tokens`."""
    scheme, _, value = authorization.partition(" ")
    return scheme.lower() == "bearer" and token_matches(tokens, value.strip())


def cookie_value(header: str, name: str) -> str:
    """The value of cookie `name` in a Cookie header ("" when absent)."""
    for part in header.split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return ""


class HttpTokenGate:
    """ASGI middleware: every HTTP request but HTTP_OPEN_PATHS needs one of `tokens` in a
    bearer header (as Prometheus sends with `authorization.credentials_file`), or a
    signed-in session (`session`: the dashboard's; it checks the request's Cookie header).
    Refused: 401 with `WWW-Authenticate: Bearer` and what to send; a browser asking for a
    page (`login_page`) is sent to /login instead. Without tokens it lets everything
    through."""

    def __init__(self, app: Any, tokens: tuple[str, ...], *, login_page: bool = False,
                 open_prefixes: tuple[str, ...] = (),
                 session: Callable[[str], bool] | None = None) -> None:
        self.app = app
        self.tokens = tuple(t for t in tokens if t)
        self.login_page = login_page
        self.open_prefixes = open_prefixes
        """Paths under these serve without a token too (the dashboard's vendored script
        and style, which the login page needs)."""
        self.session = session

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or not self.tokens or path in HTTP_OPEN_PATHS
                or (self.open_prefixes and path.startswith(self.open_prefixes))):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        if (http_token_accepted(self.tokens, headers.get("authorization", ""))
                or (self.session is not None and self.session(headers.get("cookie", "")))):
            await self.app(scope, receive, send)
            return
        if self.login_page and "text/html" in headers.get("accept", ""):
            await send({"type": "http.response.start", "status": 303,
                        "headers": [(b"location", b"/login")]})
            await send({"type": "http.response.body", "body": b""})
            return
        body = (b"this endpoint requires the run's token: send 'Authorization: Bearer "
                b"<token>' (Prometheus: authorization.credentials_file in the scrape "
                b"config)\n")
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"text/plain; charset=utf-8"),
            (b"www-authenticate", b'Bearer realm="ripples"')]})
        await send({"type": "http.response.body", "body": body})


def wsgi_token_gate(app: Callable[..., Any], tokens: tuple[str, ...]) -> Callable[..., Any]:
    """The same gate for a WSGI app (a worker's Prometheus endpoint)."""
    accepted = tuple(t for t in tokens if t)
    if not accepted:
        return app

    def gated(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        if environ.get("PATH_INFO", "") in HTTP_OPEN_PATHS or http_token_accepted(
                accepted, environ.get("HTTP_AUTHORIZATION", "")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain; charset=utf-8"),
                                             ("WWW-Authenticate", 'Bearer realm="ripples"')])
        return [b"this endpoint requires the run's token: send 'Authorization: Bearer "
                b"<token>'\n"]

    return gated
