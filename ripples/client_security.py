"""A client's side of the control plane's security (ripples/security.py): its token and
TLS files from the environment, channels that carry them, and why a coordinator turns
its connections away when the reason is TLS.

Every `ripples` command puts its client flags into the environment first
(`export_client_flags`), so that every client it makes and every process it starts
finds them (`ClientSecurity.from_env`). The token rides on every call as
`authorization: Bearer <token>`, added by an interceptor of the channel.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from ripples.security import (
    AUTHORIZATION_HEADER,
    ENV_TLS_CA,
    ENV_TLS_CLIENT_CERT,
    ENV_TLS_CLIENT_KEY,
    ENV_TOKEN_FILE,
    check_tls_files,
    read_pem,
    token_from,
)

logger = logging.getLogger(__name__)


def _is_loopback(target: str) -> bool:
    host = target.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
        security = cls(token=token_from("", env), ca_file=env.get(ENV_TLS_CA, ""),
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
            root_certificates=read_pem(self.ca_file, "CA certificate"),
            private_key=read_pem(self.key_file, "client key") if self.key_file else None,
            certificate_chain=(read_pem(self.cert_file, "client certificate")
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
    metadata = [*(details.metadata or ()), (AUTHORIZATION_HEADER, f"Bearer {token}")]
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
    metadata.add(AUTHORIZATION_HEADER, f"Bearer {token}")
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
