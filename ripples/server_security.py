"""The coordinator's side of the control plane's security (ripples/security.py): its
tokens and TLS files, its server credentials, and the interceptor that checks every
call's token before its handler runs.

A call without the token, or with a wrong one, is refused UNAUTHENTICATED; the read-only
token may call READ_ONLY_METHODS and is refused PERMISSION_DENIED elsewhere; health
checks (OPEN_PREFIXES) need none. A refused call's request is never read.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc

from ripples.security import (
    AUTHORIZATION_HEADER,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    check_tls_files,
    read_pem,
    read_secret,
    token_from,
)
from ripples.v1 import coordinator_pb2 as pb

RUNS_SERVICE: str = pb.DESCRIPTOR.services_by_name["Runs"].full_name
READ_ONLY_METHODS = frozenset(f"/{RUNS_SERVICE}/{method}" for method in (
    "GetRunStatus", "Consensus", "ListRuns", "GetLogs"))
"""What a read-only token may call: the runs' status and logs and the consensus model
(the Runs service but SubmitRun and StopRun)."""
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
"""Calls that need no token (probes)."""


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
        security = cls(token=token_from(token_file, env),
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
        pair = (read_pem(self.key_file, "key"), read_pem(self.cert_file, "certificate"))
        mutual = bool(self.client_ca_file)
        return grpc.ssl_server_credentials(
            [pair], root_certificates=(read_pem(self.client_ca_file, "client CA certificate")
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
        values = [v for k, v in (metadata or ()) if k == AUTHORIZATION_HEADER]
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
