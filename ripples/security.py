"""The control plane's security: TLS on the coordinator's gRPC service and bearer tokens.

Threat model and deployment: docs/security.md. In short: everything that talks to the
coordinator over gRPC (workers, host launchers, `ripples checkpoint`, the dashboard) may
be encrypted (TLS, the coordinator's certificate checked against a CA; mutual TLS as an
option) and must show a token when the coordinator has one; the data plane (the
rendezvous TCPStore and gloo/NCCL, as in every torch.distributed job) is neither, and
stays on a private network.

**Tokens.** The coordinator holds a token (`--token-file FILE`, else the file named by
RIPPLES_TOKEN_FILE, else the value of RIPPLES_TOKEN), and optionally a read-only one
(`--read-token-file`) that may only read (GetRunStatus, ListRuns, GetLogs, Consensus):
a dashboard's. Every call carries `authorization: Bearer <token>`; one server
interceptor compares it in constant time before any handler runs, so a refused call
(UNAUTHENTICATED: missing or wrong; PERMISSION_DENIED: a read-only token on a call that
changes the run) leaves no trace in the run. gRPC health checking (grpc.health.v1) needs
no token: probes carry none, and it tells nothing about the run.

**Clients** find their settings in the environment (RIPPLES_TOKEN_FILE or RIPPLES_TOKEN,
RIPPLES_TLS_CA, RIPPLES_TLS_CLIENT_CERT, RIPPLES_TLS_CLIENT_KEY), which every `ripples`
command sets from its flags (`--token-file`, `--tls-ca`, ...) before it starts anything,
so that the worker processes it launches inherit them. A token read from a file travels
to children as the file's path, never as its value. Tokens never appear in logs, reprs
or error messages.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from ripples.files import read_regular_file
from ripples.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

ENV_TOKEN = "RIPPLES_TOKEN"
ENV_TOKEN_FILE = "RIPPLES_TOKEN_FILE"
ENV_TLS_CA = "RIPPLES_TLS_CA"
ENV_TLS_CLIENT_CERT = "RIPPLES_TLS_CLIENT_CERT"
ENV_TLS_CLIENT_KEY = "RIPPLES_TLS_CLIENT_KEY"

SERVICES: tuple[str, ...] = tuple(s.full_name for s in pb.DESCRIPTOR.services_by_name.values())
"""The coordinator's gRPC services: ripples.v1.Worker, ripples.v1.Runs, ripples.v1.Agents
(health checking answers for each)."""
RUNS_SERVICE: str = pb.DESCRIPTOR.services_by_name["Runs"].full_name
READ_ONLY_METHODS = frozenset(f"/{RUNS_SERVICE}/{method}" for method in (
    "GetRunStatus", "Consensus", "ListRuns", "GetLogs"))
"""What a read-only token may call: the runs' status and logs and the consensus model
(the Runs service but SubmitRun and StopRun)."""
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
"""Calls that need no token (probes)."""
_HEADER = "authorization"


MAX_SECRET_BYTES = 4096
"""A token file holds one word: anything longer is the wrong file."""
MAX_PEM_BYTES = 1 << 20
"""A certificate chain or key in PEM is a few kilobytes."""
def read_secret(path: str | os.PathLike[str], what: str = "token") -> str:
    """The secret in a file (surrounding whitespace dropped); ValueError naming the file
    (never the content) when it is unreadable, not a small regular file, or empty."""
    data = read_regular_file(path, MAX_SECRET_BYTES, what=f"{what} file")
    try:
        value = data.decode().strip()
    except UnicodeDecodeError:
        raise ValueError(f"the {what} file {path} is not text: a {what} is one word") from None
    if not value:
        raise ValueError(f"the {what} file {path} is empty")
    if any(c.isspace() for c in value):
        raise ValueError(f"the {what} file {path} holds whitespace inside its value: a "
                         f"{what} is one word")
    return value


def _read_file(path: str, what: str) -> bytes:
    return read_regular_file(path, MAX_PEM_BYTES, what=what)


def check_tls_files(cert_file: str, key_file: str, ca_files: tuple[tuple[str, str], ...],
                    *, cert_option: str, key_option: str) -> None:
    """ValueError naming the file and the option unless `cert_file` holds a certificate,
    `key_file` its unencrypted private key, and each (file, option) of `ca_files` a CA
    certificate (empty names are skipped): gRPC itself only says that it cannot listen,
    or that a handshake failed."""
    for path, option in ((cert_file, cert_option), *ca_files):
        if path and b"-----BEGIN CERTIFICATE-----" not in _read_file(path, "certificate"):
            raise ValueError(f"{option} {path} holds no PEM certificate "
                             "('-----BEGIN CERTIFICATE-----')")
    if not key_file:
        return
    key = _read_file(key_file, "key")
    if b"ENCRYPTED" in key:
        raise ValueError(f"{key_option} {key_file} is encrypted: give the key without a "
                         "passphrase (e.g. `openssl pkey -in KEY -out PLAIN`), readable by "
                         "this user only")
    if b"PRIVATE KEY-----" not in key:
        held = " (it holds a certificate)" if b"CERTIFICATE-----" in key else ""
        raise ValueError(f"{key_option} {key_file} holds no PEM private key{held}: give the "
                         f"key of the certificate {cert_option} {cert_file}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert_file, key_file,
                                                                password=lambda: b"")
    except ssl.SSLError as err:
        mismatch = "KEY_VALUES_MISMATCH" in str(err)
        raise ValueError(
            f"{key_option} {key_file} is not the key of the certificate {cert_option} "
            f"{cert_file}: give the pair's key" if mismatch else
            f"cannot use the certificate {cert_option} {cert_file} with the key "
            f"{key_option} {key_file}: {err.reason or err}") from None


def _token_from(token_file: str, environ: Mapping[str, str]) -> str:
    """The token: from `token_file`, else RIPPLES_TOKEN_FILE's file, else RIPPLES_TOKEN."""
    path = token_file or environ.get(ENV_TOKEN_FILE, "")
    if path:
        return read_secret(path)
    token = environ.get(ENV_TOKEN, "").strip()
    if any(c.isspace() for c in token):
        raise ValueError(f"{ENV_TOKEN} holds whitespace: a token is one word")
    return token


def _is_loopback(target: str) -> bool:
    host = target.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------- clients
@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches the coordinator: its token and TLS files (all optional)."""

    token: str = field(default="", repr=False)
    ca_file: str = ""
    """TLS: the CA that signed the coordinator's certificate (empty: plaintext)."""
    cert_file: str = ""
    """Mutual TLS: this client's certificate (with key_file)."""
    key_file: str = ""
    server_name: str = ""
    """TLS: the name to check the coordinator's certificate for, when the address does
    not carry it (a probe that dials 127.0.0.1; empty: the address's host)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientSecurity:
        """From RIPPLES_TOKEN_FILE / RIPPLES_TOKEN and RIPPLES_TLS_*; ValueError naming
        the variable or file that is wrong."""
        env = os.environ if environ is None else environ
        security = cls(token=_token_from("", env), ca_file=env.get(ENV_TLS_CA, ""),
                       cert_file=env.get(ENV_TLS_CLIENT_CERT, ""),
                       key_file=env.get(ENV_TLS_CLIENT_KEY, ""))
        security.validate()
        return security

    @property
    def tls(self) -> bool:
        return bool(self.ca_file)

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError(f"mutual TLS needs both a client certificate and its key "
                             f"(--tls-client-cert and --tls-client-key, or "
                             f"{ENV_TLS_CLIENT_CERT} and {ENV_TLS_CLIENT_KEY})")
        if self.cert_file and not self.ca_file:
            raise ValueError("a client certificate is for TLS: give --tls-ca (the CA that "
                             f"signed the coordinator's certificate, or {ENV_TLS_CA}) too")
        check_tls_files(self.cert_file, self.key_file, ((self.ca_file, "--tls-ca"),),
                        cert_option="--tls-client-cert", key_option="--tls-client-key")

    def _credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read_file(self.ca_file, "CA certificate"),
            private_key=_read_file(self.key_file, "client key") if self.key_file else None,
            certificate_chain=(_read_file(self.cert_file, "client certificate")
                               if self.cert_file else None))

    def _warn_plaintext(self, target: str) -> None:
        if self.token and not self.tls and not _is_loopback(target):
            logger.warning("sending the token to %s without TLS: anyone on the network "
                           "path can read it (give --tls-ca)", target)

    def channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        """A blocking channel to `target` with this security."""
        self._warn_plaintext(target)
        if self.server_name:
            options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
        channel = (grpc.secure_channel(target, self._credentials(), options=options)
                   if self.tls else grpc.insecure_channel(target, options=options))
        if not self.token:
            return channel
        return grpc.intercept_channel(channel, _TokenClientInterceptor(self.token))

    def aio_channel(self, target: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """An asyncio channel to `target` with this security."""
        self._warn_plaintext(target)
        interceptors = _aio_token_interceptors(self.token) if self.token else None
        if self.tls:
            return grpc.aio.secure_channel(target, self._credentials(), options=options,
                                           interceptors=interceptors)
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


def tls_mismatch(target: str, security: ClientSecurity, timeout_seconds: float = 2.0) -> str:
    """Why the coordinator at `target` (HOST:PORT) turns this client's connections away
    when the reason is TLS: TLS on one side only, or a certificate the client's CA does
    not vouch for (or that names another host). "" when nothing listens there, or the
    handshake succeeds (the reason is elsewhere). gRPC only reports that the channel
    stays unready or a socket closed, so a client that failed to connect asks this
    before it says "unreachable": one TCP connection and one TLS handshake, each with
    `timeout_seconds`."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    try:
        raw = socket.create_connection((host, int(port)), timeout=timeout_seconds)
    except (OSError, ValueError):
        return ""  # nothing listens: truly unreachable
    anyone = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    anyone.check_hostname = False
    anyone.verify_mode = ssl.CERT_NONE
    anyone.set_alpn_protocols(["h2"])
    try:
        with anyone.wrap_socket(raw, server_hostname=host or None):
            speaks_tls = True
    except (ssl.SSLError, OSError):  # a plaintext gRPC server answers a hello with junk
        speaks_tls = False
    finally:
        raw.close()
    if speaks_tls and not security.tls:
        return (f"the coordinator at {target} speaks TLS and this client does not: give "
                f"--tls-ca (the CA that signed its certificate; or set {ENV_TLS_CA})")
    if not speaks_tls and security.tls:
        return (f"the coordinator at {target} speaks plaintext, not TLS: drop --tls-ca "
                f"({ENV_TLS_CA}), or start the coordinator with --tls-cert and --tls-key")
    if not speaks_tls:
        return ""
    checked = ssl.create_default_context(cafile=security.ca_file)
    checked.set_alpn_protocols(["h2"])
    name = security.server_name or host
    try:
        with (socket.create_connection((host, int(port)), timeout=timeout_seconds) as again,
              checked.wrap_socket(again, server_hostname=name)):
            return ""
    except ssl.SSLCertVerificationError as err:
        reason = str(err.verify_message).rstrip(".")
        return (f"the coordinator at {target}: certificate check failed: {reason}; check "
                f"--tls-ca {security.ca_file} (the CA that signed the coordinator's "
                f"certificate, which must name {name})")
    except (ssl.SSLError, OSError):
        return ""


def export_client_flags(token_file: str = "", ca_file: str = "", cert_file: str = "",
                        key_file: str = "") -> None:
    """Put a command's client flags into this process's environment, where every client
    it makes and every process it starts find them (ClientSecurity.from_env)."""
    for name, value in ((ENV_TOKEN_FILE, token_file), (ENV_TLS_CA, ca_file),
                        (ENV_TLS_CLIENT_CERT, cert_file), (ENV_TLS_CLIENT_KEY, key_file)):
        if value:
            os.environ[name] = str(Path(value).resolve())


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def _with_token(details: Any, token: str) -> _CallDetails:
    metadata = [*(details.metadata or ()), (_HEADER, f"Bearer {token}")]
    return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                        details.wait_for_ready, details.compression)


class _TokenClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                              grpc.StreamUnaryClientInterceptor,
                              grpc.StreamStreamClientInterceptor):
    """Adds the bearer token to every call of a blocking channel."""

    def __init__(self, token: str) -> None:
        self._token = token

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self._token), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(_with_token(details, self._token), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_token(details, self._token), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(_with_token(details, self._token), requests)

    def __repr__(self) -> str:
        return "_TokenClientInterceptor(token=<hidden>)"


def _aio_details(details: Any, token: str) -> grpc.aio.ClientCallDetails:
    metadata = grpc.aio.Metadata(*(details.metadata or ()))
    metadata.add(_HEADER, f"Bearer {token}")
    return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata,
                                      details.credentials, details.wait_for_ready)


def _aio_token_interceptors(token: str) -> list[grpc.aio.ClientInterceptor]:
    """The bearer token on every call of an asyncio channel (one interceptor per call
    shape: grpc.aio picks them by base class)."""

    class UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
        async def intercept_unary_unary(self, continuation: Any, details: Any,
                                        request: Any) -> Any:
            return await continuation(_aio_details(details, token), request)

    class UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
        async def intercept_unary_stream(self, continuation: Any, details: Any,
                                         request: Any) -> Any:
            return await continuation(_aio_details(details, token), request)

    class StreamStream(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Any, details: Any,
                                          requests: Any) -> Any:
            return await continuation(_aio_details(details, token), requests)

    return [UnaryUnary(), UnaryStream(), StreamStream()]


# ---------------------------------------------------------------------------- the server
@dataclass(frozen=True)
class ServerSecurity:
    """The coordinator's side: its tokens and TLS files (all optional)."""

    token: str = field(default="", repr=False)
    read_token: str = field(default="", repr=False)
    """A read-only token (GetRunStatus, ListRuns, GetLogs, Consensus): for dashboards."""
    cert_file: str = ""
    """TLS: the coordinator's certificate chain (with key_file)."""
    key_file: str = ""
    client_ca_file: str = ""
    """Mutual TLS: clients must show a certificate signed by this CA."""

    @classmethod
    def build(cls, *, token_file: str = "", read_token_file: str = "", cert_file: str = "",
              key_file: str = "", client_ca_file: str = "",
              environ: Mapping[str, str] | None = None) -> ServerSecurity:
        """From the flags, the token falling back on RIPPLES_TOKEN_FILE / RIPPLES_TOKEN;
        ValueError naming what is wrong."""
        env = os.environ if environ is None else environ
        security = cls(token=_token_from(token_file, env),
                       read_token=read_secret(read_token_file, "read-only token")
                       if read_token_file else "",
                       cert_file=cert_file, key_file=key_file, client_ca_file=client_ca_file)
        security.validate()
        return security

    @property
    def tls(self) -> bool:
        return bool(self.cert_file)

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS needs the coordinator's certificate and its key: give "
                             "--tls-cert and --tls-key")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("--tls-client-ca (mutual TLS) needs TLS: give --tls-cert and "
                             "--tls-key too")
        if self.read_token and not self.token:
            raise ValueError("a read-only token needs a full token too (--token-file or "
                             f"{ENV_TOKEN}): without one every call is allowed anyway")
        if self.read_token and hmac.compare_digest(self.read_token, self.token):
            raise ValueError("the read-only token must differ from the full token")
        check_tls_files(self.cert_file, self.key_file,
                        ((self.client_ca_file, "--tls-client-ca"),),
                        cert_option="--tls-cert", key_option="--tls-key")

    def credentials(self) -> grpc.ServerCredentials | None:
        """TLS server credentials (None: plaintext)."""
        if not self.tls:
            return None
        pair = (_read_file(self.key_file, "key"), _read_file(self.cert_file, "certificate"))
        mutual = bool(self.client_ca_file)
        return grpc.ssl_server_credentials(
            [pair], root_certificates=(_read_file(self.client_ca_file, "client CA certificate")
                                       if mutual else None),
            require_client_auth=mutual)

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.token, self.read_token)] if self.token else []

    def describe(self) -> str:
        """One line for the start-up message (never a token)."""
        parts = ["TLS" + (" (mutual)" if self.client_ca_file else "") if self.tls
                 else "plaintext"]
        parts.append("token" + (" + read-only token" if self.read_token else "")
                     if self.token else "no token")
        return ", ".join(parts)


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Checks the bearer token of every call before its handler runs."""

    def __init__(self, token: str, read_token: str = "") -> None:
        self._token = token.encode()
        self._read_token = read_token.encode()

    def verdict(self, method: str, metadata: Any) -> tuple[grpc.StatusCode, str] | None:
        """None when the call may go on, else the code and the message to refuse it."""
        if method.startswith(OPEN_PREFIXES):
            return None
        values = [v for k, v in (metadata or ()) if k == _HEADER]
        if not values:
            return (grpc.StatusCode.UNAUTHENTICATED,
                    "this coordinator requires a token: give --token-file FILE or set "
                    f"{ENV_TOKEN_FILE} or {ENV_TOKEN}")
        scheme, _, presented = str(values[0]).partition(" ")
        given = presented.strip().encode()
        if scheme.lower() == "bearer" and hmac.compare_digest(given, self._token):
            return None
        if (scheme.lower() == "bearer" and self._read_token
                and hmac.compare_digest(given, self._read_token)):
            if method in READ_ONLY_METHODS:
                return None
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"a read-only token may not call {method.rsplit('/', 1)[-1]}: use the "
                    "run's full token")
        return (grpc.StatusCode.UNAUTHENTICATED,
                "wrong token: check --token-file (or "
                f"{ENV_TOKEN_FILE} / {ENV_TOKEN}) against the coordinator's")

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        verdict = self.verdict(details.method, details.invocation_metadata)
        if verdict is None or handler is None:
            return handler
        return _refusing(handler, *verdict)

    def __repr__(self) -> str:
        return "TokenInterceptor(token=<hidden>)"


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode,
              message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses every call of `handler`'s method without reading its
    request. It takes the request as a stream whatever the method's shape: a unary
    request would be received whole, up to the 16 MiB message limit, and parsed before
    any handler runs, so that a crowd of unauthenticated calls could fill the
    coordinator's memory; a stream that is never read holds one HTTP/2 flow-control
    window (64 KiB) per call, and the refusal (only a status) reads the same to every
    client whatever its method's shape."""
    async def refuse(_requests: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    return grpc.stream_unary_rpc_method_handler(
        refuse, response_serializer=handler.response_serializer)


# ---------------------------------------------------------------------------- HTTP
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
