"""All gRPC plumbing shared by the coordinator, workers, dashboard and launcher.

Every channel and server option lives here, with the reason for it, so that the
components agree and nobody tunes one side alone.
"""

from __future__ import annotations

import grpc

from ripples.client_security import ClientSecurity

ID_SPACE_BITS = 40
"""Group and comm ids of the coordinator's incarnation k (its k-th life, restarted from
its state dir) start at k << ID_SPACE_BITS: no id is ever handed out twice across
restarts, and a worker tells an old incarnation's comm ids from the new one's."""

# Messages are small (ids and timings); a status reply of a large run stays far below this.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Long-polls (AwaitStart) and streams (Synchronize) stay open for a long time: ping so
    # that a dead coordinator is noticed by the transport, not only by a deadline.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect fast after a coordinator restart instead of backing off for minutes.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Loopback and cluster networks: proxies from the environment are never wanted.
    ("grpc.enable_http_proxy", 0),
]

SERVER_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Accept the clients' keepalive pings (see CHANNEL_OPTIONS) without GOAWAY.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    # Two coordinators on one port would split the run silently: fail to bind instead.
    ("grpc.so_reuseport", 0),
]


def coordinator_channel(target: str, security: ClientSecurity | None = None) -> grpc.Channel:
    """A blocking channel to the coordinator at HOST:PORT, with TLS and the token of
    `security` (default: the environment's, ripples/client_security.py)."""
    security = security if security is not None else ClientSecurity.from_env()
    return security.channel(target, CHANNEL_OPTIONS)


def aio_channel(target: str, security: ClientSecurity | None = None) -> grpc.aio.Channel:
    """An asyncio channel to the coordinator at HOST:PORT (dashboard), secured as
    coordinator_channel's."""
    security = security if security is not None else ClientSecurity.from_env()
    return security.aio_channel(target, CHANNEL_OPTIONS)


def parse_target(target: str) -> tuple[str, int]:
    """Split HOST:PORT; ValueError with what to write instead."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT for the coordinator address, got {target!r}")
    return host.strip("[]"), int(port)


def tls_refused(detail: object) -> bool:
    """Whether a failed call's detail is a TLS handshake failure: a setting to fix (the
    CA, the certificate's names, TLS on one side only), never worth retrying."""
    return "handshake failed" in str(detail).lower()


def tls_suspected(detail: object) -> bool:
    """Whether a failed call's detail is one that TLS set on one side only, or a
    certificate check, produces (a handshake failure, or a socket the server closed):
    worth asking client_security.tls_mismatch before saying "unreachable". A network that
    drops packets (a timeout) or a port nobody listens on (refused) is not."""
    return tls_refused(detail) or "socket closed" in str(detail).lower()


class CoordinatorCallError(RuntimeError):
    """A coordinator call failed; the message says what to check."""

    def __init__(self, message: str, code: grpc.StatusCode | None) -> None:
        super().__init__(message)
        self.code = code


def describe_rpc_error(err: grpc.RpcError, target: str) -> str:
    """A one-line explanation of a failed call, naming what to check."""
    is_call = isinstance(err, grpc.Call | grpc.aio.AioRpcError)
    code = err.code() if is_call else None  # type: ignore[attr-defined]
    detail = err.details() if is_call else str(err)  # type: ignore[attr-defined]
    if code == grpc.StatusCode.UNAVAILABLE:
        if tls_refused(detail):
            return (f"coordinator at {target}: the TLS handshake failed ({detail}); check "
                    "--tls-ca (the CA that signed the coordinator's certificate, which must "
                    "name the address dialled) and that the coordinator serves TLS")
        hint = (" (a coordinator serving TLS closes plaintext connections: give --tls-ca)"
                if "socket closed" in str(detail).lower() else "")
        return f"coordinator at {target} is unreachable ({detail}); is it running?{hint}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"coordinator at {target} did not answer in time ({detail})"
    name = code.name if code is not None else "ERROR"
    return f"coordinator at {target} refused the request: {name}: {detail}"
